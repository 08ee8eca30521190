"""JSON lines files (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): one element per line, one
split per file. Blank lines are skipped; lines end with ``\\n`` (``\\r\\n`` too).

A line that cannot be read (not UTF-8, not JSON, nested deeper than the parser goes, or
longer than ``max_line_bytes``) is an error naming the file and the line
(:class:`~zloader.errors.CodecError`), for that line only: under ``on_error="skip"`` it is
counted and the next line is read. A line is read at most ``max_line_bytes`` at a time
(``MAX_LINE_BYTES`` by default), after decompression, so a compressed file of one huge
line takes no more memory than that. Compression is chosen by the file name's suffix;
``.zst`` needs the ``zstandard`` package (``pip install 'zloader[formats]'``).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

from zloader._defaults import MAX_LINE_BYTES, READ_BLOCK_BYTES
from zloader.errors import CodecError
from zloader.formats.base import Bad, FormatSource

__all__ = ["JsonlSource", "read_lines"]


def _decompressed(stream: BinaryIO, name: str) -> BinaryIO:
    lower = name.lower()
    if lower.endswith(".gz"):
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value,unused-ignore]
    if lower.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"reading {name} needs zstandard: pip install "
                              "'zloader[formats]'") from None
        reader = zstandard.ZstdDecompressor().stream_reader(stream)
        return io.BufferedReader(reader, buffer_size=READ_BLOCK_BYTES)  # type: ignore[arg-type,unused-ignore]
    return stream


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
            try:
                value = json.loads(line.decode("utf-8"))
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
