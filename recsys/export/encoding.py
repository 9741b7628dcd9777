"""The byte format of one user's list in the key-value store, and its encoder and decoder.

Pure numpy and pyarrow (the core layer): the export's tasks encode a whole Arrow batch of published
rows at once, the frontend decodes one value per lookup, and a client in any language can read a
value with the layout below (docs/export.md gives it with examples).

Layout of a value (format 1), all integers little-endian::

    offset  size       field
    0       1          format: 1
    1       1          flags: bit 0 set -> item ids are uint32, clear -> int64; bits 1-7 are 0
    2       1          source: index into the version's ``sources`` list (e.g. 0 "model", 1 "popularity")
    3       1          reserved, 0
    4       n * w      item ids, best first (w = 4 or 8 bytes)
    4+n*w   n * 4      scores, float32 (IEEE 754), same order

``n`` is not stored: it is ``(len(value) - 4) / (w + 4)``. The header keeps the ids and scores 4-byte
aligned, so a reader can view them in place. Ids are written as uint32 when every id of the value fits
(0 <= id < 2**32, the common case), which makes a top-100 list 804 bytes where int64 ids would make it
1,204; scores stay float32 so that a lookup returns exactly the published score (a 16-bit float keeps
three significant digits). Measured against JSON in ``benchmarks/export_load.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

FORMAT = 1
HEADER_BYTES = 4
FLAG_UINT32_IDS = 0x01
_U32_LIMIT = 2 ** 32


class EncodingError(ValueError):
    """A value that is not format 1, or rows the format cannot hold."""


@dataclass(frozen=True)
class DecodedList:
    item_ids: np.ndarray     # [n] int64, best first
    scores: np.ndarray       # [n] float32
    source: int              # index into the version's sources


def encode_list(item_ids: np.ndarray, scores: np.ndarray, source: int) -> bytes:
    """One list (the fallback list, a test's row) -> its value."""
    ids = np.asarray(item_ids, dtype=np.int64)
    vals = np.asarray(scores, dtype=np.float32)
    if ids.shape != vals.shape or ids.ndim != 1:
        raise EncodingError(f"item ids {ids.shape} and scores {vals.shape} must be 1-d and of one length")
    narrow = bool(len(ids) == 0 or (ids.min() >= 0 and ids.max() < _U32_LIMIT))
    header = bytes((FORMAT, FLAG_UINT32_IDS if narrow else 0, _source_byte(source), 0))
    return header + ids.astype("<u4" if narrow else "<i8").tobytes() + vals.astype("<f4").tobytes()


def decode(value: bytes) -> DecodedList:
    """A value -> its list; raises EncodingError naming what is wrong with it."""
    if len(value) < HEADER_BYTES:
        raise EncodingError(f"a value of {len(value)} bytes is shorter than the {HEADER_BYTES}-byte header")
    if value[0] != FORMAT:
        raise EncodingError(f"value format {value[0]} is not {FORMAT}; this reader is older than the exporter")
    width = 4 if value[1] & FLAG_UINT32_IDS else 8
    body = len(value) - HEADER_BYTES
    if body % (width + 4):
        raise EncodingError(f"a value of {len(value)} bytes does not hold whole (id, score) pairs of "
                            f"{width} + 4 bytes")
    n = body // (width + 4)
    ids = np.frombuffer(value, dtype="<u4" if width == 4 else "<i8", count=n, offset=HEADER_BYTES)
    scores = np.frombuffer(value, dtype="<f4", count=n, offset=HEADER_BYTES + n * width)
    return DecodedList(ids.astype(np.int64), scores.astype(np.float32), value[2])


def _source_byte(source: int) -> int:
    if not 0 <= source < 256:
        raise EncodingError(f"source index {source} does not fit the format's one byte (at most 256 sources)")
    return int(source)


@dataclass(frozen=True)
class EncodedBatch:
    """A batch of rows encoded: ``values[i]`` is user ``user_ids[i]``'s value (a bytes-like view into one
    buffer per list length: ``bytes(value)`` copies it out; Redis clients send views as they are)."""

    user_ids: np.ndarray      # [U] int64
    values: list[memoryview]
    value_bytes: int


def encode_batch(batch: pa.RecordBatch | pa.Table, sources: Sequence[str]) -> EncodedBatch:
    """Rows of the output contract (``user_id``, ``recommendations``, ``source``) -> one value per row.

    Vectorised: rows are grouped by list length (normally one group: every user gets ``top_n``), and
    each group becomes one ``[rows, bytes]`` array whose rows are the values; only the final slicing
    into one view per user is a Python loop (views, not ``bytes``: a view is far cheaper to make than a
    copy; measured: docs/performance.md, "Figures that lived in the code"). ``sources``: the version's
    source names, in index order; a row whose source is not among them is an error (the exporter lists
    them from the manifest).
    """
    user_ids = _column(batch, "user_id").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    recs = _column(batch, "recommendations")
    if isinstance(recs, pa.ChunkedArray):
        recs = recs.combine_chunks()
    if recs.null_count:
        raise EncodingError(f"{recs.null_count} row(s) have a null recommendations list; the published "
                            "partition must hold a list for every user")
    offsets = recs.offsets.to_numpy()
    counts = np.diff(offsets)
    flat = recs.values.slice(offsets[0], offsets[-1] - offsets[0]) if len(recs) else recs.values.slice(0, 0)
    item_ids = flat.field("item_id").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    scores = flat.field("score").to_numpy(zero_copy_only=False).astype("<f4", copy=False)
    source_index = _source_indices(_column(batch, "source"), sources)
    starts = offsets[:-1] - offsets[0]

    n = len(user_ids)
    values: list[memoryview] = [memoryview(b"")] * n
    total = 0
    for count in np.unique(counts):
        rows = np.flatnonzero(counts == count)
        if count and len(rows) == n:                                # one group: the lists lie end to end
            ids = item_ids.reshape(n, count)
            vals = scores.reshape(n, count)
        elif count:
            cols = starts[rows, None] + np.arange(count)           # [R, count] positions in the flat arrays
            ids = item_ids[cols]
            vals = scores[cols]
        else:
            ids = np.zeros((len(rows), 0), np.int64)
            vals = np.zeros((len(rows), 0), np.float32)
        narrow = bool(ids.size == 0 or (ids.min() >= 0 and ids.max() < _U32_LIMIT))
        width = 4 if narrow else 8
        header = np.zeros((len(rows), HEADER_BYTES), np.uint8)
        header[:, 0] = FORMAT
        header[:, 1] = FLAG_UINT32_IDS if narrow else 0
        header[:, 2] = source_index[rows]
        block = np.concatenate([header,
                                np.ascontiguousarray(ids.astype("<u4" if narrow else "<i8")).view(np.uint8),
                                np.ascontiguousarray(vals).view(np.uint8)], axis=1)
        size = HEADER_BYTES + int(count) * (width + 4)
        buf = memoryview(np.ascontiguousarray(block)).cast("B")
        for j, row in enumerate(rows.tolist()):
            values[row] = buf[j * size:(j + 1) * size]
        total += size * len(rows)
    return EncodedBatch(user_ids, values, total)


def _column(batch: pa.RecordBatch | pa.Table, name: str):
    try:
        return batch.column(name)
    except KeyError:
        raise EncodingError(f"the rows have no {name!r} column; columns: {batch.schema.names}") from None


def _source_indices(column, sources: Sequence[str]) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    encoded = column.dictionary_encode()
    names = encoded.dictionary.to_pylist()
    unknown = [s for s in names if s not in sources]
    if unknown:
        raise EncodingError(f"source(s) {unknown} are not among the version's sources {list(sources)}")
    lookup = np.array([sources.index(s) for s in names] or [0], dtype=np.uint8)
    return lookup[encoded.indices.to_numpy(zero_copy_only=False)]
