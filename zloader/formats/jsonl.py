"""JSON lines files (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): one element per line, one
split per file. Blank lines are skipped; lines end with ``\\n`` (``\\r\\n`` too).

A line that cannot be read (not UTF-8, not JSON, nested deeper than the parser goes, or
longer than ``max_line_bytes``) is an error naming the file and the line
(:class:`~zloader.errors.CodecError`), for that line only: under ``on_error="skip"`` it is
counted and the next line is read. A line is read at most ``max_line_bytes`` at a time
(``MAX_LINE_BYTES`` by default), after decompression, so a compressed file of one huge
line takes no more memory than that. Compression (gzip, zstd, bzip2, xz) is known by the
file's first bytes, whatever its name (by its suffix where the stream cannot go back);
``.zst`` needs the ``zstandard`` package (``pip install 'zloader[formats]'``). A
compressed stream cut short is an error at its end.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

from zloader._defaults import MAX_LINE_BYTES, READ_BLOCK_BYTES, ZSTD_PIECE_BYTES
from zloader.errors import CodecError
from zloader.formats.base import Bad, FormatSource

__all__ = ["JsonlSource", "read_lines"]


_MAGIC = ((b"\x1f\x8b", ".gz"), (b"\x28\xb5\x2f\xfd", ".zst"), (b"BZh", ".bz2"),
          (b"\xfd7zXZ\x00", ".xz"))
"""The first bytes of each compressed format (no JSON text starts so), and its suffix."""


def _compression(stream: BinaryIO, name: str) -> str:
    """The suffix of the compression ``stream`` holds ("" for none): by its first bytes
    (a gzip file named ``.jsonl`` is one), else by ``name``."""
    if stream.seekable():
        head = stream.read(6)
        stream.seek(0)
        return next((suffix for magic, suffix in _MAGIC if head.startswith(magic)), "")
    lower = name.lower()
    return next((suffix for _, suffix in _MAGIC if lower.endswith(suffix)),
                ".zst" if lower.endswith(".zstd") else "")


def _decompressed(stream: BinaryIO, name: str) -> BinaryIO:
    kind = _compression(stream, name)
    if kind == ".gz":
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value,unused-ignore]
    if kind == ".bz2":
        return bz2.BZ2File(stream)  # type: ignore[return-value,unused-ignore]
    if kind == ".xz":
        return lzma.LZMAFile(stream)  # type: ignore[return-value,unused-ignore]
    if kind == ".zst":
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"reading {name} needs zstandard: pip install "
                              "'zloader[formats]'") from None
        return io.BufferedReader(_Zstd(stream, zstandard.ZstdDecompressor()),
                                 buffer_size=READ_BLOCK_BYTES)
    return stream


class _Zstd(io.RawIOBase):
    """Zstandard frames, one after another, inflated as they are read, ZSTD_PIECE_BYTES of input
    at a time; input that ends inside a frame (a truncated file) is an error, where
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


def read_lines(stream: BinaryIO, name: str,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Any]:
    """The JSON values of the lines of ``stream`` (decompressed by ``name``'s suffix), and a
    :class:`~zloader.formats.base.Bad` in place of each line that cannot be read."""
    with _decompressed(stream, name) as raw:
        number = 0
        while True:
            line = raw.readline(max_line_bytes + 1)
            if not line:
                return
            number += 1
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                yield _bad(name, number, f"is longer than max_line_bytes={max_line_bytes}: "
                           "raise from_jsonl(max_line_bytes=) if lines this long are meant")
                _skip_line(raw)  # only when reading goes on (skipping errors)
                continue
            if not line.strip():
                continue
            try:  # (a byte order mark before the first line, as Windows tools write)
                value = json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))
            except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
                yield _bad(name, number, f"is not JSON: {exc}")
                continue
            except RecursionError:
                yield _bad(name, number, "nests too deep to parse")
                continue
            yield value


def _bad(name: str, number: int, what: str) -> Bad:
    return Bad(CodecError(f"{name}: line {number} {what}"), f"file {name}, line {number}")


def _skip_line(raw: BinaryIO) -> None:
    """Read the rest of the current line and drop it, a block at a time."""
    while True:
        rest = raw.readline(READ_BLOCK_BYTES)
        if not rest or rest.endswith(b"\n"):
            return


@dataclass(frozen=True, eq=False, kw_only=True)
class JsonlSource(FormatSource):
    """The values of JSON lines files; one unit per file. ``max_line_bytes``: the longest
    line read (a longer one is an error for that line)."""

    kind: ClassVar[str] = "from_jsonl"
    max_line_bytes: int = MAX_LINE_BYTES

    def read_unit(self, unit: Any) -> Iterator[Any]:
        path = self.files[unit][0]
        with self.open(unit) as stream:
            yield from read_lines(stream, path, self.max_line_bytes)

    def _format_options(self) -> tuple[Any, ...]:
        return (self.max_line_bytes,)
