"""WebDataset shards: tar files (``.tar``, or compressed as a whole: ``.tar.gz``) whose
members are grouped into samples by key, as the ``webdataset`` package does.

A member ``dir.v1/sample0001.seg.png`` has key ``dir.v1/sample0001`` (the path up to the
first dot of its last component) and extension ``seg.png`` (the rest, lower-cased).
Consecutive members with the same key make one sample::

    {"__key__": "dir.v1/sample0001", "__url__": shard, "seg.png": b"...", "cls": b"3"}

Values are the members' raw bytes (a ``.gz`` member stays compressed, as webdataset leaves
it before decoding). Members that are not regular files, and metadata named ``__*__``, are
skipped. Shards are read as a stream, member by member: one split per shard.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from zloader.errors import CodecError
from zloader.formats.base import FormatSource
from zloader.sources import ErrorPolicy

__all__ = ["WebDatasetSource", "read_samples", "split_key"]

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


def split_key(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name, or None when it has no extension."""
    match = _KEY.match(name)
    return (match.group(1), match.group(2)) if match else None


def read_samples(stream: Any, url: str) -> Iterator[dict[str, Any]]:
    """The samples of one tar stream (read sequentially, member by member).

    Raises:
        CodecError: two members of one sample have the same extension.
        tarfile.TarError: the stream is not a valid tar file.
    """
    sample: dict[str, Any] | None = None
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for member in tar:
            name = member.name
            if not member.isreg() or _META.match(name):
                continue
            parts = split_key(name)
            if parts is None:
                continue
            key, extension = parts[0], parts[1].lower()
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            tar.members = []  # type: ignore[attr-defined]  # a stream: keep no index of the members read
            if sample is None or sample["__key__"] != key:
                if sample is not None:
                    yield sample
                sample = {"__key__": key, "__url__": url}
            if extension in sample:
                raise CodecError(f"{url}: member {name!r} repeats extension {extension!r} "
                                 f"of sample {key!r}")
            sample[extension] = data
    if sample is not None:
        yield sample


@dataclass(frozen=True, eq=False, kw_only=True)
class WebDatasetSource(FormatSource):
    """Samples of WebDataset tar shards; one unit per shard."""

    kind: ClassVar[str] = "from_webdataset"

    def read_unit(self, unit: Any, policy: ErrorPolicy | None) -> Iterator[dict[str, Any]]:
        url = self.files[unit][0]
        with self.open(unit) as stream:
            yield from read_samples(stream, url)
