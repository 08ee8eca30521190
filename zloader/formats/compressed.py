"""Files compressed whole (gzip, bzip2, xz or lzma, zstd), known by their first bytes
whatever their name, as the format readers take them (JSON lines, WebDataset shards).

The inflaters read their input a block at a time and a stream cut short is an error at
its end (gzip, bzip2 and xz raise ``EOFError``; zstandard's own readers end quietly, so
zstd frames are inflated here: :class:`_Zstd`). A gzip file of several members (``cat
a.gz b.gz``, bgzip) is read through all of them. ``zstd`` needs the ``zstandard`` package
(``pip install 'zloader[formats]'``).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from zloader._defaults import READ_BLOCK_BYTES, ZSTD_PIECE_BYTES

__all__ = ["inflated", "kind"]


def _zstd(stream: BinaryIO) -> BinaryIO:
    try:
        import zstandard
    except ImportError:
        raise ImportError("reading a zstd-compressed file needs zstandard: pip install "
                          "'zloader[formats]'") from None
    return io.BufferedReader(_Zstd(stream, zstandard.ZstdDecompressor()),
                             buffer_size=READ_BLOCK_BYTES)


_INFLATERS: tuple[tuple[re.Pattern[bytes], tuple[str, ...], Callable[[Any], Any]], ...] = (
    (re.compile(rb"\x1f\x8b\x08"), (".gz",),
     lambda stream: gzip.GzipFile(fileobj=stream, mode="rb")),
    (re.compile(rb"BZh[1-9](?:1AY&SY|\x17rE8P\x90)"), (".bz2",), bz2.BZ2File),
    (re.compile(rb"\xfd7zXZ\x00|\x5d\x00\x00\x80"), (".xz", ".lzma"), lzma.LZMAFile),
    (re.compile(rb"\x28\xb5\x2f\xfd"), (".zst", ".zstd"), _zstd),
)
"""The first bytes of each compressed format (no JSON text nor tar header starts so), the
suffixes that name it, and what inflates it (tarfile's own gzip stops at the end of the
first member, in silence)."""


def kind(head: bytes) -> str | None:
    """The suffix of the compression whose first bytes ``head`` holds, or None."""
    return next((suffixes[0] for magic, suffixes, _ in _INFLATERS if magic.match(head)), None)


@contextlib.contextmanager
def inflated(stream: Any, name: str) -> Iterator[tuple[Any, bool]]:
    """``stream`` inflated when its first bytes say it is compressed (by ``name``'s suffix
    where they cannot be looked at: a stream that can neither peek nor seek), and whether
    it was; closing it leaves ``stream`` open."""
    head = _head(stream)
    lower = name.lower()
    for magic, suffixes, inflate in _INFLATERS:
        if magic.match(head) if head is not None else lower.endswith(suffixes):
            with inflate(stream) as inflated_stream:
                yield inflated_stream, True
            return
    yield stream, False


def _head(stream: Any) -> bytes | None:
    """The first 16 bytes of ``stream``, left unread; None where they cannot be."""
    peek = getattr(stream, "peek", None)
    if peek is not None:
        return bytes(peek(16)[:16])
    if not stream.seekable():
        return None
    head = stream.read(16)
    stream.seek(-len(head), os.SEEK_CUR)
    return bytes(head)


class _Zstd(io.RawIOBase):
    """Zstandard frames, one after another, inflated as they are read, ZSTD_PIECE_BYTES of
    input at a time; input that ends inside a frame (a truncated file) is an error, where
    zstandard's own readers end quietly."""

    def __init__(self, stream: BinaryIO, decompressor: Any) -> None:
        super().__init__()
        self._stream, self._decompressor = stream, decompressor
        self._frame = decompressor.decompressobj()
        self._inside = False  # (input of the current frame taken)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = self._stream.read(ZSTD_PIECE_BYTES)
            if not chunk:
                if self._inside:
                    raise EOFError("the zstd frame ends before its end (a truncated file)")
                return 0
            self._pending = memoryview(self._inflate(chunk))
        view = memoryview(buffer).cast("B")
        size = min(len(view), len(self._pending))
        view[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def _inflate(self, chunk: bytes) -> bytes:
        out = [self._frame.decompress(chunk)]
        self._inside = True
        while self._frame.eof:  # (the frame ended: what is left starts the next)
            rest = self._frame.unused_data
            self._frame, self._inside = self._decompressor.decompressobj(), bool(rest)
            if not rest:
                break
            out.append(self._frame.decompress(rest))
        return b"".join(out)
