"""JSON lines files (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): one element per line, one
split per file. Blank lines are skipped; lines end with ``\\n`` (``\\r\\n`` too).

A line that cannot be read (not UTF-8, not JSON, nested deeper than the parser goes, or
longer than ``max_line_bytes``) is an error naming the file and the line
(:class:`~zloader.errors.CodecError`), for that line only: under ``on_error="skip"`` it is
counted and the next line is read. A line is read at most ``max_line_bytes`` at a time
(``MAX_LINE_BYTES`` by default), after decompression, so a compressed file of one huge
line takes no more memory than that. A file compressed whole (gzip, bzip2, xz, zstd) is
inflated, known by its first bytes (zloader/formats/compressed.py); cut short, it is an
error at its end.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

from zloader._defaults import MAX_LINE_BYTES, READ_BLOCK_BYTES
from zloader.errors import CodecError
from zloader.formats.base import Bad, FormatSource
from zloader.formats.compressed import inflated

__all__ = ["JsonlSource", "read_lines"]


def read_lines(stream: BinaryIO, name: str,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Any]:
    """The JSON values of the lines of ``stream`` (inflated when it is compressed:
    :mod:`zloader.formats.compressed`), and a :class:`~zloader.formats.base.Bad` in place
    of each line that cannot be read. Blank lines are passed over."""
    with inflated(stream, name) as (raw, _):
        for number, line in itertools.chain.from_iterable(_split_lines(raw, max_line_bytes)):
            if line is None:
                yield _bad(name, number, f"is longer than max_line_bytes={max_line_bytes}: "
                           "raise from_jsonl(max_line_bytes=) if lines this long are meant")
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


def _split_lines(raw: BinaryIO, max_line_bytes: int
                 ) -> Iterator[list[tuple[int, bytes | None]]]:
    """Each line of ``raw`` that is not blank, without its newline, with its number (from
    1), a block's at a time (a list each), read READ_BLOCK_BYTES at a time and cut in C:
    a block of blank lines is counted,
    not stepped through (a file of a billion blank lines, compressed to kilobytes, reads in
    the time it takes to inflate). None in place of a line longer than
    ``max_line_bytes``, whose rest is dropped as it comes (memory holds at most that much
    of one line)."""
    pending: list[bytes] = []  # the start of a line that goes on in the next block
    number, size, dropping = 0, 0, False
    while chunk := raw.read(READ_BLOCK_BYTES):
        if not pending and not dropping and chunk.isspace():
            number += chunk.count(b"\n")
            tail = chunk[chunk.rfind(b"\n") + 1:]
            pending, size = ([tail], len(tail)) if tail else ([], 0)
            continue
        *ended, tail = chunk.split(b"\n")
        lines: list[tuple[int, bytes | None]] = []
        for line in ended:
            number += 1
            if dropping:  # (the end of a line too long)
                dropping = False
                continue
            if pending:
                line = b"".join((*pending, line))
                pending, size = [], 0
            if len(line) > max_line_bytes:
                lines.append((number, None))
            elif line and not line.isspace():
                lines.append((number, line))
        if tail and not dropping:
            pending.append(tail)
            size += len(tail)
            if size > max_line_bytes:
                lines.append((number + 1, None))
                pending, size, dropping = [], 0, True
        yield lines
    if pending:
        line = b"".join(pending)
        if len(line) > max_line_bytes:
            yield [(number + 1, None)]
        elif not line.isspace():
            yield [(number + 1, line)]


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
