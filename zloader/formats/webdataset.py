"""WebDataset shards: tar files (``.tar``, or compressed as a whole: ``.tar.gz``) whose
members are grouped into samples by key, as the ``webdataset`` package does.

A member ``dir.v1/sample0001.seg.png`` has key ``dir.v1/sample0001`` (the path up to the
first dot of its last component) and extension ``seg.png`` (the rest, lower-cased).
Consecutive members with the same key make one sample::

    {"__key__": "dir.v1/sample0001", "__url__": shard, "seg.png": b"...", "cls": b"3"}

Values are the members' raw bytes (a ``.gz`` member stays compressed, as webdataset leaves
it before decoding). Members that are not regular files, and metadata named ``__*__``, are
skipped. Shards are read as a stream, member by member: one split per shard.

A member larger than ``max_member_bytes`` (``MAX_MEMBER_BYTES`` by default; the size its
header states, which for a sparse member may be far more than the shard holds) is never
read: its sample is an error naming the shard, the member and the limit, as is a sample
that repeats an extension. Such a sample is that sample's error only (under
``on_error="skip"`` it is counted and the next sample is read); a broken tar ends the shard.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from zloader._defaults import MAX_MEMBER_BYTES
from zloader.errors import CodecError
from zloader.formats.base import Bad, FormatSource

__all__ = ["WebDatasetSource", "read_samples", "split_key"]

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


def split_key(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name, or None when it has no extension."""
    match = _KEY.match(name)
    return (match.group(1), match.group(2)) if match else None


def read_samples(stream: Any, url: str,
                 max_member_bytes: int = MAX_MEMBER_BYTES) -> Iterator[Any]:
    """The samples of one tar stream (read sequentially, member by member), and a
    :class:`~zloader.formats.base.Bad` in place of a sample with a member larger than
    ``max_member_bytes`` or a repeated extension (a :class:`CodecError` naming them).

    Raises:
        tarfile.TarError: the stream is not a valid tar file.
    """
    sample: dict[str, Any] | None = None
    bad: Bad | None = None
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for member in tar:
            tar.members = []  # type: ignore[attr-defined]  # a stream: keep no index of the members read
            name = member.name
            if not member.isreg() or _META.match(name):
                continue
            parts = split_key(name)
            if parts is None:
                continue
            key, extension = parts[0], parts[1].lower()
            if sample is None or sample["__key__"] != key:
                if sample is not None:
                    yield bad or sample
                sample, bad = {"__key__": key, "__url__": url}, None
            if bad is not None:
                continue  # the sample is lost already: read none of its other members
            if member.size > max_member_bytes:
                bad = _bad(url, key, f"member {name!r} is {member.size} bytes, more than "
                                     f"max_member_bytes={max_member_bytes}: raise "
                                     "from_webdataset(max_member_bytes=) if members this "
                                     "large are meant")
            elif extension in sample:
                bad = _bad(url, key, f"member {name!r} repeats extension {extension!r} of "
                                     f"sample {key!r}")
            else:
                sample[extension] = tar.extractfile(member).read()  # type: ignore[union-attr]
    if sample is not None:
        yield bad or sample


def _bad(url: str, key: str, what: str) -> Bad:
    return Bad(CodecError(f"{url}: {what}"), f"shard {url}, sample {key!r}")


@dataclass(frozen=True, eq=False, kw_only=True)
class WebDatasetSource(FormatSource):
    """Samples of WebDataset tar shards; one unit per shard."""

    kind: ClassVar[str] = "from_webdataset"
    max_member_bytes: int = MAX_MEMBER_BYTES

    def read_unit(self, unit: Any) -> Iterator[Any]:
        url = self.files[unit][0]
        with self.open(unit) as stream:
            yield from read_samples(stream, url, self.max_member_bytes)

    def _format_options(self) -> tuple[Any, ...]:
        return (self.max_member_bytes,)
