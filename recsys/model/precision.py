"""Which precision a device runs natively: the one check training and scoring share.

bf16 pays only where the hardware multiplies in it: CUDA GPUs that support it, and CPUs with
AVX-512-BF16 or AMX-BF16 (through oneDNN). Elsewhere torch still accepts bf16 on the CPU but
emulates it, slower than fp32, so both the scoring core (``scoring.dtype``) and training
(``train.precision``) refuse it there rather than run slow in silence, and ``auto`` picks it only
where it is native.

int8 (``scoring.dtype=int8``, :mod:`recsys.model.int8`) pays only where oneDNN's int8 kernels have
an integer dot-product instruction: AMX-INT8, AVX-512-VNNI or AVX-VNNI. Without one they fall back
to ``vpmaddubsw``, whose 16-bit intermediate sums can saturate (oneDNN, "Nuances of int8
computations"), and with oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) the int8 product ran no
faster than fp32 (measured: docs/performance.md, "Figures that lived in the code"): the scoring core
refuses int8 there.

Both CPU checks read the processor's flags through one seam, :func:`cpu_capabilities` (torch's own
cpuinfo, else ``/proc/cpuinfo``), and honour oneDNN's documented ISA cap ``ONEDNN_MAX_CPU_ISA``
for int8 and bf16: an operator who holds oneDNN below VNNI gets the int8 refusal, one who holds it below
its bf16 kernels gets fp32 from ``auto``, never a silently slow run.

Pure torch: the core's modules use it on any machine the models run on.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

# train.precision / TrainSettings.precision; "auto" resolves per device (resolve_precision)
PRECISIONS = ("auto", "fp32", "bf16")


# what the int8 kernels need: one of these integer dot-product instructions (torch's cpuinfo names)
INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
# ONEDNN_MAX_CPU_ISA values (oneDNN's dev guide, "CPU dispatcher control") that hold oneDNN below
# every VNNI/AMX kernel; other values (AVX2_VNNI, AVX512_CORE_VNNI and above, ALL, DEFAULT) keep one
_ONEDNN_ISA_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_MIC", "AVX512_MIC_4OPS", "AVX512_CORE")
# ... and below every bf16 dot-product kernel (AVX512_CORE_BF16 and the AMX ones keep them)
_ONEDNN_ISA_WITHOUT_BF16 = (*_ONEDNN_ISA_WITHOUT_VNNI, "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE_VNNI")


def cpu_capabilities() -> Mapping[str, bool]:
    """This CPU's instruction-set flags, e.g. ``{'avx512_bf16': True, 'amx_int8': False, ...}``.

    From torch's own cpuinfo (the flags its kernels dispatch on); on a torch without it, from the
    kernel's ``/proc/cpuinfo`` (empty when neither can be read). The one place the precision checks
    read the hardware, so a test can present another CPU here without touching the checks themselves.
    """
    try:
        return dict(torch._C._cpu._get_cpu_capability())   # torch's own cpuinfo
    except (AttributeError, RuntimeError):
        pass
    try:  # older torch: the kernel's flags
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return {}
    return {f: True for f in flags}   # the flags used here are spelled alike in both


def cpu_bf16_supported(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this CPU runs bf16 matrix products natively (AVX-512-BF16 or AMX-BF16) through oneDNN.

    Without them torch still accepts bf16 on the CPU, but emulates it, slower than fp32: that is
    why the scoring core refuses ``dtype="bfloat16"`` and training ``precision="bf16"`` there
    instead of silently running slow. The same holds where ``ONEDNN_MAX_CPU_ISA`` (read from
    ``environ``, default the process environment) holds oneDNN below its bf16 kernels, so an
    operator's cap makes ``auto`` train in fp32 rather than in emulated bf16.
    """
    environ = os.environ if environ is None else environ
    if not torch.backends.mkldnn.is_available():
        return False
    if environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _ONEDNN_ISA_WITHOUT_BF16:
        return False
    caps = cpu_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def cpu_int8_refusal(environ: Mapping[str, str] | None = None) -> str:
    """Why this CPU cannot run the int8 scoring path natively ('' when it can).

    It can where torch has oneDNN's dynamic int8 linear kernel (the ``onednn`` quantized engine) and
    the CPU has an integer dot-product instruction (AMX-INT8, AVX-512-VNNI or AVX-VNNI) that
    ``ONEDNN_MAX_CPU_ISA`` (read from ``environ``, default the process environment) does not hold
    oneDNN below. The reason names what is missing and what to use instead.
    """
    environ = os.environ if environ is None else environ
    if not torch.backends.mkldnn.is_available() or "onednn" not in torch.backends.quantized.supported_engines:
        return ("this torch build has no oneDNN int8 kernels (torch.backends.quantized.supported_engines lacks "
                "'onednn')")
    caps = cpu_capabilities()
    if not any(caps.get(f) for f in INT8_FLAGS):
        return ("this CPU has none of AMX-INT8, AVX-512-VNNI, AVX-VNNI (see the flags in /proc/cpuinfo: amx_int8, "
                "avx512_vnni, avx_vnni), so int8 products would run no faster than fp32 and could saturate")
    cap = environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap in _ONEDNN_ISA_WITHOUT_VNNI:
        return (f"ONEDNN_MAX_CPU_ISA={cap} holds oneDNN below its VNNI/AMX int8 kernels on this worker, so int8 "
                "products would run no faster than fp32")
    return ""


def cpu_int8_supported() -> bool:
    """Whether this CPU runs the int8 scoring path natively (see :func:`cpu_int8_refusal`)."""
    return not cpu_int8_refusal()


def bf16_native(device: torch.device) -> bool:
    """Whether ``device`` multiplies in bf16 natively (a CUDA GPU that supports it, or a CPU as above)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_bf16_supported()
    return False


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """``fp32`` or ``bf16``: what training runs in on ``device``.

    ``auto`` is bf16 where the device runs it natively and fp32 elsewhere; ``bf16`` where it is
    not native is refused (ValueError naming the setting and what to use), since emulated bf16
    would make training slower, the opposite of why anyone asks for it.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    device = torch.device(device)
    if precision == "fp32":
        return "fp32"
    native = bf16_native(device)
    if precision == "auto":
        return "bf16" if native else "fp32"
    if not native:
        where = ("this CPU has neither AVX-512-BF16 nor AMX-BF16 (see the flags in /proc/cpuinfo), so bf16 "
                 "would be emulated and slower than fp32" if device.type == "cpu"
                 else f"{device} does not support bf16")
        raise ValueError(f"train.precision=bf16 needs native bf16, but {where}; "
                         "use train.precision=auto (bf16 only where native) or fp32")
    return "bf16"
