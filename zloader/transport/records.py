"""A record's codec buffers packed into one block of memory (a shared-memory ring slot).

Layout: ``u32 count, u32 0, u64 size * count``, then each buffer at the next multiple of
``ALIGN`` bytes. Unpacking checks every size against the block, so a bad record raises
:class:`~zloader.errors.CodecError` instead of reading outside it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from zloader._defaults import MAX_BUFFERS, SEGMENT_BYTES, SMALL_COPY
from zloader.codec import Gather, nbytes
from zloader.errors import CodecError

__all__ = ["ALIGN", "SEGMENT_BYTES", "SMALL_COPY", "pack_into", "packed_size", "sizes_of", "unpack"]

ALIGN = 64
_HEAD = struct.Struct("<II")


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def sizes_of(buffers: Sequence[Any]) -> list[int]:
    """The byte size of each buffer (what :func:`packed_size` and :func:`pack_into` take,
    so that a record's sizes are found once)."""
    return [nbytes(b) for b in buffers]


def packed_size(buffers: Sequence[Any], sizes: Sequence[int] | None = None) -> int:
    """Bytes needed to pack ``buffers`` (``sizes``: theirs, when known)."""
    total = _align(_HEAD.size + 8 * len(buffers))
    for size in sizes_of(buffers) if sizes is None else sizes:
        total += _align(size)
    return total


def pack_into(buffers: Sequence[Any], block: memoryview,
              sizes: Sequence[int] | None = None) -> int:
    """Copy ``buffers`` into ``block`` (at least :func:`packed_size` bytes); returns the
    bytes used (``sizes``: theirs, when known). A :class:`~zloader.codec.Gather` buffer is
    copied part by part."""
    if sizes is None:
        sizes = sizes_of(buffers)
    head = _HEAD.size + 8 * len(sizes)
    struct.pack_into(f"<II{len(sizes)}Q", block, 0, len(sizes), 0, *sizes)
    offset = _align(head)
    target: Any = None
    for buffer, size in zip(buffers, sizes, strict=True):
        if isinstance(buffer, Gather):
            start = offset
            for part in buffer:
                if part.nbytes:
                    if target is None:
                        target = np.frombuffer(block, np.uint8)
                    target[start:start + part.nbytes] = np.frombuffer(part, np.uint8)
                start += part.nbytes
        elif size > SMALL_COPY:
            if target is None:
                target = np.frombuffer(block, np.uint8)
            target[offset:offset + size] = np.frombuffer(buffer, np.uint8)
        elif size:
            block[offset:offset + size] = memoryview(buffer).cast("B")
        offset += _align(size)
    return offset


def unpack(block: Any) -> list[memoryview]:
    """The buffers packed in ``block``, as views of it (no copy).

    Raises:
        CodecError: the block is not a valid packed record.
    """
    view = memoryview(block).cast("B") if not isinstance(block, memoryview) else block
    if view.nbytes < _HEAD.size:
        raise CodecError(f"record of {view.nbytes} bytes is shorter than its header")
    count, _ = _HEAD.unpack_from(view, 0)
    if count > MAX_BUFFERS or _HEAD.size + 8 * count > view.nbytes:
        raise CodecError(f"record claims {count} buffers, more than its {view.nbytes} bytes hold")
    sizes = struct.unpack_from(f"<{count}Q", view, _HEAD.size)
    offset = _align(_HEAD.size + 8 * count)
    out = []
    for size in sizes:
        if offset + size > view.nbytes:
            raise CodecError(f"record buffer of {size} bytes at {offset} runs past its "
                             f"{view.nbytes} bytes")
        out.append(view[offset:offset + size])
        offset += _align(size)
    return out
