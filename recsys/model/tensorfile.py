"""Tensors to and from a safetensors file: named raw arrays behind a JSON header, never pickle.

Uses the ``safetensors`` package when it is installed. Where it is not (it is a declared dependency,
but a minimal GPU image may lack it), a built-in reader and writer of the same documented format
take over, so a model saved on one machine loads on the other either way:

    8 bytes   little-endian u64 N, the header's length
    N bytes   JSON {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
              "__metadata__": {str: str}}, padded with spaces
    the rest  the tensors' bytes, C order, little-endian; offsets are relative to this part

The built-in reader treats the file as untrusted: every offset, size and dtype is checked before
use, and anything that does not add up is a ``ValueError``.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

try:  # pragma: no cover - which branch runs depends on the environment
    import safetensors.torch as _st
except ImportError:  # pragma: no cover
    _st = None

_MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (CPU copies, contiguous; no two may share memory) to ``path``."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    if _st is not None:
        _st.save_file(tensors, str(path), metadata=metadata)
    else:
        write_safetensors(tensors, Path(path), metadata)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Read every tensor in ``path`` onto the CPU; ``ValueError`` if it is not a safetensors file."""
    if _st is None:
        return read_safetensors(Path(path))[0]
    try:
        return _st.load_file(str(path))
    except Exception as exc:  # the library raises its own SafetensorError (and others) on bad input
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from exc


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """The built-in writer (see the module docstring for the layout)."""
    if sys.byteorder != "little":
        raise RuntimeError("the built-in safetensors writer needs a little-endian machine; install safetensors")
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The built-in reader: (tensors, metadata). Checks everything before trusting it."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path} is not a valid safetensors file: {why}")

    data = Path(path).read_bytes()
    if len(data) < 8:
        raise bad("shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, _MAX_HEADER_BYTES):
        raise bad(f"header length {n} does not fit the {len(data)}-byte file")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise bad("__metadata__ is not an object")
    buffer = memoryview(data)[8 + n :]
    tensors, spans = {}, []
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"entry {name!r} lacks a known dtype, a shape or two data_offsets") from None
        numel = 1
        for s in shape:
            if s < 0:
                raise bad(f"entry {name!r} has a negative dimension")
            numel *= s
        size = numel * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= len(buffer) or end - begin != size:
            raise bad(f"entry {name!r} has data_offsets [{begin}, {end}] for {size} bytes "
                      f"in a {len(buffer)}-byte data section")
        spans.append((begin, end))
        raw = bytearray(buffer[begin:end])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dtype).reshape(shape)
    spans.sort()
    for (_, end), (begin, _) in zip(spans, spans[1:]):
        if begin < end:
            raise bad("two tensors overlap")
    return tensors, {str(k): str(v) for k, v in metadata.items()}
