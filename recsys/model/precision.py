"""Which float precision a device runs natively: the one check training and scoring share.

bf16 pays only where the hardware multiplies in it: CUDA GPUs that support it, and CPUs with
AVX-512-BF16 or AMX-BF16 (through oneDNN). Elsewhere torch still accepts bf16 on the CPU but
emulates it, slower than fp32, so both the scoring core (``scoring.dtype``) and training
(``train.precision``) refuse it there rather than run slow in silence, and ``auto`` picks it only
where it is native.

Pure torch: the core's modules use it on any machine the models run on.
"""
from __future__ import annotations

from pathlib import Path

import torch

# train.precision / TrainSettings.precision; "auto" resolves per device (resolve_precision)
PRECISIONS = ("auto", "fp32", "bf16")


def cpu_bf16_supported() -> bool:
    """Whether this CPU runs bf16 matrix products natively (AVX-512-BF16 or AMX-BF16) through oneDNN.

    Without them torch still accepts bf16 on the CPU, but emulates it, slower than fp32: that is
    why the scoring core refuses ``dtype="bfloat16"`` and training ``precision="bf16"`` there
    instead of silently running slow.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        caps = torch._C._cpu._get_cpu_capability()   # torch's own cpuinfo: {'avx512_bf16': True, ...}
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    except (AttributeError, RuntimeError):
        pass
    try:  # older torch: the kernel's flags
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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
