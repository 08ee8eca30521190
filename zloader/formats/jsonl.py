"""JSON lines files (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): one element per line, one
split per file. Blank lines are skipped. A line that is not valid JSON raises
:class:`~zloader.errors.CodecError` naming the file and the line, or is counted and
skipped under ``on_error="skip"``. Compression is chosen by the file name's suffix;
``.zst`` needs the ``zstandard`` package (``pip install 'zloader[formats]'``).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

from zloader.errors import CodecError
from zloader.formats.base import FormatSource
from zloader.sources import ErrorPolicy

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
        return zstandard.ZstdDecompressor().stream_reader(stream)  # type: ignore[no-any-return,unused-ignore]
    return stream


def read_lines(stream: BinaryIO, name: str,
               policy: ErrorPolicy | None = None) -> Iterator[Any]:
    """The JSON values of the lines of ``stream`` (decompressed by ``name``'s suffix)."""
    with _decompressed(stream, name) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8")
        for number, line in enumerate(text, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                if policy is None or not policy.skip_errors:
                    raise CodecError(f"{name}: line {number} is not JSON: {exc}") from None
                policy.skipped += 1
                continue
            yield value


@dataclass(frozen=True, eq=False, kw_only=True)
class JsonlSource(FormatSource):
    """The values of JSON lines files; one unit per file."""

    kind: ClassVar[str] = "from_jsonl"

    def read_unit(self, unit: Any, policy: ErrorPolicy | None) -> Iterator[Any]:
        path = self.files[unit][0]
        with self.open(unit) as stream:
            yield from read_lines(stream, path, policy)
