"""WebDataset shards: tar files (``.tar``, or compressed as a whole: ``.tar.gz``) whose
members are grouped into samples by key, as the ``webdataset`` package does.

A member ``dir.v1/sample0001.seg.png`` has key ``dir.v1/sample0001`` (the path up to the
first dot of its last component) and extension ``seg.png`` (the rest, lower-cased).
Consecutive members with the same key make one sample::

    {"__key__": "dir.v1/sample0001", "__url__": shard, "seg.png": b"...", "cls": b"3"}

Values are the members' raw bytes (a ``.gz`` member stays compressed, as webdataset leaves
it before decoding). Members that are not regular files, and metadata named ``__*__``, are
skipped. Shards are read as a stream, member by member: one split per shard. A shard
compressed whole (gzip, bzip2, xz, zstd: zloader/formats/compressed.py) is inflated by the
reader, every compressed stream of it (``cat a.gz b.gz`` and bgzip make several).

A member larger than ``max_member_bytes`` (``MAX_MEMBER_BYTES`` by default; the size its
header states, which for a sparse member may be far more than the shard holds) is never
read: its sample is an error naming the shard, the member and the limit, as is a sample
that repeats an extension. Such a sample is that sample's error only (under
``on_error="skip"`` it is counted and the next sample is read).

What leaves the rest of a shard unreadable ends it with a :class:`CorruptShard` naming the
shard and the offset (in the tar stream, after decompression): a damaged header; a member
whose stored size runs past the end of the shard, or, where skipping it means reading it
through (a compressed shard, or one of unknown size), past ``max_member_bytes`` (tarfile
would skip it a block at a time, for hours when a header claims terabytes); headers of one
member taking more than ``MAX_TAR_HEADER_BYTES`` (tarfile reads PAX and GNU long-name
headers and sparse maps whole), or malformed PAX records; anything but zeros after the
end-of-archive block (stdlib tarfile takes a damaged header, or a lone zero block, for the
end of the archive and stops there in silence). A sample is yielded once the member after
it, or the archive's checked end, was read, or before a shard-ending error at the header
of another sample's member; one that such an error interrupts is lost with the rest of
the shard.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from zloader._defaults import MAX_MEMBER_BYTES, MAX_TAR_HEADER_BYTES, READ_BLOCK_BYTES
from zloader.errors import CodecError
from zloader.formats.base import Bad, FormatSource
from zloader.formats.compressed import inflated

__all__ = ["CorruptShard", "WebDatasetSource", "read_samples", "split_key"]

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")
_BLOCK = tarfile.BLOCKSIZE
_INVALID: type[Exception] = tarfile.InvalidHeaderError  # type: ignore[attr-defined]
"""What tarfile raises for a block that is not a header (and takes, past the first
member, for the end of the archive)."""


class CorruptShard(CodecError):
    """A tar shard cannot be read past some point; the message names the shard and the
    offset in its tar stream. ``member``: the name in the header refused, where one was."""

    member: str | None = None


def split_key(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name, or None when it has no extension."""
    match = _KEY.match(name)
    return (match.group(1), match.group(2)) if match else None


def read_samples(stream: Any, url: str, max_member_bytes: int = MAX_MEMBER_BYTES,
                 size: int | None = None,
                 max_header_bytes: int = MAX_TAR_HEADER_BYTES) -> Iterator[Any]:
    """The samples of one tar stream (read sequentially, member by member), and a
    :class:`~zloader.formats.base.Bad` in place of a sample with a member larger than
    ``max_member_bytes`` or a repeated extension (a :class:`CodecError` naming them).

    Args:
        stream: the shard, from its first byte (compressed whole, or not).
        url: the shard, in messages.
        max_member_bytes: the largest member read.
        size: the shard's bytes, when known: a member stored past them ends the shard.
        max_header_bytes: the most the headers of one member may take.

    Raises:
        CorruptShard: a damaged header, a member stored past the shard's end (or, when
            the shard is compressed or its size unknown, past ``max_member_bytes``),
            headers over ``max_header_bytes``, or data after the end-of-archive block.
        tarfile.TarError: the stream is not a valid tar file (a member ends early, ...).
        EOFError, OSError: a compressed shard is cut short or corrupt (its inflater's).
    """
    sample: dict[str, Any] | None = None
    bad: Bad | None = None
    with inflated(stream, url) as (tar_stream, compressed), \
            _Shard.open(  # type: ignore[call-overload]  # tarfile.open passes these on
                fileobj=tar_stream, mode="r|", url=url, max_member_bytes=max_member_bytes,
                capacity=None if compressed else size,
                max_header_bytes=max_header_bytes) as tar:
        members = iter(tar)
        while True:
            try:
                member = next(members)
            except StopIteration:
                break
            except CorruptShard as exc:  # (a sample whose every member was read, first)
                refused = split_key(exc.member or "")
                if sample is not None and refused is not None \
                        and refused[0] != sample["__key__"]:
                    yield bad or sample
                raise
            tar.members = []  # a stream: keep no index of the members read
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
                sample[extension] = tar.extractfile(member).read()
        tar.check_end()
    if sample is not None:
        yield bad or sample


def _bad(url: str, key: str, what: str) -> Bad:
    return Bad(CodecError(f"{url}: {what}"), f"shard {url}, sample {key!r}")


class _Reads:
    """The tar stream as tarfile reads it, seen by :class:`_Header`: while a member's
    headers are read, each read is counted against their allowance and refused past it
    (before anything is allocated), and a PAX header's records are checked as they come.

    Attributes:
        allowance: what the headers being read may still read; None between headers.
        start: where the headers being read began.
        check: a function of the next read's bytes returning what is wrong with them.
    """

    def __init__(self, stream: Any, url: str, limit: int) -> None:
        self.stream = stream
        self.url = url
        self.limit = limit
        self.allowance: int | None = None
        self.start = 0
        self.check: Callable[[bytes], str | None] | None = None

    def read(self, size: int) -> bytes:
        if self.allowance is not None:
            if size > self.allowance:
                raise CorruptShard(
                    f"{self.url}: the headers of the member at offset {self.start} take "
                    f"more than {self.limit} bytes (MAX_TAR_HEADER_BYTES; its extended "
                    f"headers or sparse map run on): a damaged or forged shard")
            self.allowance -= size
        data: bytes = self.stream.read(size)
        if self.check is not None:
            check, self.check = self.check, None
            problem = check(data)
            if problem is not None:
                raise CorruptShard(f"{self.url}: the PAX header at offset {self.start}: "
                                   f"{problem}")
        return data

    def tell(self) -> int:
        return int(self.stream.tell())

    def seek(self, position: int) -> int:
        return int(self.stream.seek(position))

    def __getattr__(self, name: str) -> Any:  # the rest, seldom called
        return getattr(self.stream, name)


class _Header(tarfile.TarInfo):
    """A member's headers, read within their allowance (:class:`_Reads`); a damaged header
    is a :class:`CorruptShard`, not, as tarfile has it, the end of the archive."""

    @classmethod
    def fromtarfile(cls, archive: tarfile.TarFile) -> _Header:
        reads: _Reads = archive.fileobj  # type: ignore[assignment]
        start = reads.tell()
        outermost = reads.allowance is None
        if outermost:  # the first header of a member; its extended ones come within
            reads.allowance, reads.start = reads.limit, start
        try:
            return super().fromtarfile(archive)
        except _INVALID as exc:
            raise CorruptShard(f"{reads.url}: the header at offset {start} is damaged "
                               f"({exc}): the shard cannot be read past it") from None
        except RecursionError:  # extended headers chained (each reads the next one)
            if not outermost:
                raise
            raise CorruptShard(f"{reads.url}: the member at offset {start} has more "
                               "extended headers than Python can nest: a damaged or "
                               "forged shard") from None
        finally:
            if outermost:
                reads.allowance = None

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> _Header:
        if 0 < len(buf) < _BLOCK and buf.count(0) < len(buf):  # tarfile: an end, in silence
            raise _INVALID(f"truncated, {len(buf)} bytes")
        return super().frombuf(buf, encoding, errors)

    def _proc_pax(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        reads: _Reads = archive.fileobj  # type: ignore[assignment]
        if self.type == tarfile.XGLTYPE:  # global: its keys stay for the rest of the shard
            kept = sum(len(k) + len(v) for k, v in archive.pax_headers.items())
            if kept + self.size > reads.limit:
                raise CorruptShard(f"{reads.url}: the global PAX headers up to offset "
                                   f"{reads.start} take more than {reads.limit} bytes "
                                   "(MAX_TAR_HEADER_BYTES): a damaged or forged shard")
        reads.check = _pax_problem
        return super()._proc_pax(archive)  # type: ignore[misc]


class _Shard(tarfile.TarFile):
    """A tar stream read member by member, refusing what would take unbounded time or
    memory and telling a damaged archive from its end."""

    tarinfo = _Header

    def __init__(self, name: Any, mode: Any, fileobj: Any, *, url: str,
                 max_member_bytes: int, capacity: int | None, max_header_bytes: int,
                 **kwargs: Any) -> None:
        self.url = url
        self.max_member_bytes = max_member_bytes
        self.capacity = capacity
        super().__init__(name, mode, _Reads(fileobj, url, max_header_bytes), **kwargs)

    def next(self) -> tarfile.TarInfo | None:
        member = super().next()
        if member is not None:
            try:
                self._check_stored(member)
            except CorruptShard as exc:
                exc.member = member.name
                raise
        return member

    def _check_stored(self, member: tarfile.TarInfo) -> None:
        """Refuse ``member`` if what it stores cannot be passed at a bounded cost: tarfile
        moves to the next header (``self.offset``) by reading a block at a time, also past
        the end of the data, as far as the header says."""
        stored = member.size  # of any type: folders and links must store nothing
        if member.sparse is not None:  # what it stores, not its size with the holes
            stored = self.offset - member.offset_data
        where = f"{self.url}: member {member.name!r} (header at offset {member.offset})"
        if member.size < 0 or self.offset < member.offset_data:
            raise CorruptShard(f"{where} claims a negative size: a damaged or forged header")
        if self.capacity is not None:
            if member.offset_data + stored > self.capacity:
                raise CorruptShard(
                    f"{where} claims {stored} bytes from offset {member.offset_data}, past "
                    f"the end of the shard ({self.capacity} bytes): the shard is cut short "
                    "(a partial download or copy?), or the header is damaged or forged")
        elif stored > self.max_member_bytes:
            raise CorruptShard(
                f"{where} claims {stored} bytes, more than max_member_bytes="
                f"{self.max_member_bytes}, and in a compressed shard (or one of unknown "
                "size) it cannot be skipped without reading it through: raise "
                "from_webdataset(max_member_bytes=) if members this large are meant")

    def check_end(self) -> None:
        """After the last member: check that nothing but zeros (end-of-archive blocks,
        padding) follows where tarfile saw the end, up to the end of the stream.

        Raises:
            CorruptShard: something else does (a lone zero block amid members, archives
                joined with ``cat``), naming where.
        """
        end, position = self.offset, self.fileobj.tell()
        while True:
            data = self.fileobj.read(READ_BLOCK_BYTES)
            if not data:
                return
            rest = data.lstrip(b"\0")
            if rest:
                raise CorruptShard(
                    f"{self.url}: the archive ends at offset {end} (a zero block) but data "
                    f"follows at offset {position + len(data) - len(rest)}: a damaged "
                    "header, or tar archives joined into one file")
            position += len(data)


def _pax_problem(data: bytes) -> str | None:
    """What is wrong with the records of a PAX header (``"%d %s=%s\\n"``, the length
    counting the whole record), or None. Checked in linear time before tarfile parses
    them: in CPython releases before the fix of CVE-2024-6232 (3.11.10, 3.12.6) its
    regular expression scans from each record to the next ``=``, which records without one
    turn into quadratic time (26 s for 256 KiB on 3.11.7, minutes for 1 MiB)."""
    position, size = 0, len(data)
    while position < size and data[position:position + 1].isdigit():
        space = data.find(b" ", position, position + 21)
        digits = data[position:space] if space > position else b""
        if not digits.isdigit():
            return f"a record at byte {position} has no length"
        end = position + int(digits)
        if end <= space or end > size or data[end - 1] != 0x0A \
                or data.find(b"=", space + 1, end) < 0:
            return f"the record at byte {position} is malformed"
        position = end
    return None


@dataclass(frozen=True, eq=False, kw_only=True)
class WebDatasetSource(FormatSource):
    """Samples of WebDataset tar shards; one unit per shard."""

    kind: ClassVar[str] = "from_webdataset"
    max_member_bytes: int = MAX_MEMBER_BYTES

    def read_unit(self, unit: Any) -> Iterator[Any]:
        url, stated, _ = self.files[unit]
        with self.open(unit) as stream:
            yield from read_samples(stream, url, self.max_member_bytes,
                                    _size(stream, stated))

    def _format_options(self) -> tuple[Any, ...]:
        return (self.max_member_bytes,)


def _size(stream: Any, stated: int) -> int | None:
    """The bytes of the open shard ``stream``: a local file's now, else as listed (None
    when storage did not say)."""
    try:
        return os.fstat(stream.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return stated if stated > 0 else None
