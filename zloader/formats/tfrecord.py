"""TFRecord files: one split per file (``parallel_reads`` groups them), raw records.

A TFRecord file is a sequence of records, each::

    uint64 length (little-endian) | uint32 masked CRC-32C of length | data[length] |
    uint32 masked CRC-32C of data

optionally compressed as a whole with GZIP or ZLIB. Records are read as a stream (at
most a read block ahead). With ``verify=True`` both checksums are checked: a record whose
data does not match its checksum is a :class:`CorruptRecord` naming the file and the
record's offset (in the uncompressed stream), for that record only (under
``on_error="skip"`` it is counted and the next record is read). A length that does not
match its own checksum, or is larger than ``max_record_bytes`` (``MAX_RECORD_BYTES`` by
default), ends the file, the same way: nothing after it can be framed. A length is never
allocated before its bytes are read: a record is read a block at a time.
"""

from __future__ import annotations

import gzip
import io
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

from zloader._defaults import MAX_RECORD_BYTES, READ_BLOCK_BYTES
from zloader.errors import CodecError
from zloader.formats import compressed
from zloader.formats._crc32c import masked_crc32c
from zloader.formats.base import Bad, FormatSource

__all__ = ["COMPRESSIONS", "CorruptRecord", "TFRecordSource", "decompressed", "read_records"]

COMPRESSIONS = (None, "GZIP", "ZLIB")
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


class CorruptRecord(CodecError):
    """A record of a file failed its checks; the message names the file and the offset."""


def decompressed(stream: BinaryIO, compression: str | None) -> BinaryIO:
    """``stream`` as it reads after decompression (streaming, not whole)."""
    if compression is None:
        return stream
    if compression == "GZIP":
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    if compression == "ZLIB":
        return io.BufferedReader(_ZlibReader(stream), buffer_size=READ_BLOCK_BYTES)
    raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")


class _ZlibReader(io.RawIOBase):
    """A zlib-compressed stream, inflated as it is read."""

    def __init__(self, stream: BinaryIO) -> None:
        super().__init__()
        self._stream = stream
        self._inflate = zlib.decompressobj()
        self._pending = b""
        self._started = False  # (an empty file is an empty stream)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while not self._pending:
            if self._inflate.eof:
                return 0
            chunk = self._inflate.unconsumed_tail or self._stream.read(READ_BLOCK_BYTES)
            if not chunk:
                self._pending = self._inflate.flush()
                if not self._pending:
                    if self._started and not self._inflate.eof:
                        raise EOFError("the zlib stream ends before its end (a truncated "
                                       "file)")
                    return 0
                break
            self._started = True
            # at most a block out of any input: a small chunk may inflate a thousandfold
            self._pending = self._inflate.decompress(chunk, READ_BLOCK_BYTES)
        size = min(len(view), len(self._pending))
        view[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size


def read_records(stream: BinaryIO, name: str, verify: bool = True,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[Any]:
    """The records of an (uncompressed) TFRecord stream, and a
    :class:`~zloader.formats.base.Bad` holding a :class:`CorruptRecord` (naming ``name``
    and the offset) in place of each record that fails its data checksum.

    Args:
        stream: a binary file object, read sequentially.
        name: the file or URL, for error messages.
        verify: check the length and data checksums.
        max_record_bytes: the largest record read; a larger length ends the stream.

    Yields a last Bad and stops at a truncated record, a length that fails its checksum or
    one over ``max_record_bytes``: nothing after it can be framed.
    """
    offset = 0
    while True:
        header = stream.read(_HEADER.size)
        if not header:
            return
        if len(header) < _HEADER.size:
            yield _bad(name, offset, f"{name}: truncated record header at offset {offset}")
            return
        length, length_crc = _HEADER.unpack(header)
        if verify and masked_crc32c(header[:8]) != length_crc:
            yield _bad(name, offset, f"{name}: corrupt record length at offset {offset} "
                                     f"(checksum mismatch){_compressed(header, offset)}")
            return
        if length > max_record_bytes:
            yield _bad(name, offset, f"{name}: record at offset {offset} claims {length} "
                                     f"bytes, more than max_record_bytes={max_record_bytes} "
                                     "(a corrupt length, or raise from_tfrecord("
                                     "max_record_bytes=))")
            return
        data = _read(stream, length)
        footer = stream.read(_FOOTER.size)
        if len(data) < length or len(footer) < _FOOTER.size:
            yield _bad(name, offset, f"{name}: truncated record at offset {offset} "
                                     f"({length} bytes expected)")
            return
        if verify and masked_crc32c(data) != _FOOTER.unpack(footer)[0]:
            # this record only: the next one is framed all the same
            yield _bad(name, offset, f"{name}: corrupt record at offset {offset} (data "
                                     "checksum mismatch)")
        else:
            yield data
        offset += _HEADER.size + length + _FOOTER.size


def _compressed(header: bytes, offset: int) -> str:
    """A hint for a compressed file read as an uncompressed one (its first bytes)."""
    if offset:
        return ""
    if compressed.kind(header) == ".gz":
        return ": the file is gzip-compressed, read it with compression=\"GZIP\""
    if header[0] == 0x78 and int.from_bytes(header[:2], "big") % 31 == 0:
        return ": the file looks zlib-compressed, read it with compression=\"ZLIB\""
    return ""


def _read(stream: BinaryIO, length: int) -> bytes:
    """Up to ``length`` bytes of ``stream``, read a block at a time past one block: memory
    grows with the bytes the file holds, not with the length it claims."""
    if length <= READ_BLOCK_BYTES:
        return stream.read(length)
    blocks = []
    left = length
    while left:
        block = stream.read(min(left, READ_BLOCK_BYTES))
        if not block:
            break
        blocks.append(block)
        left -= len(block)
    return b"".join(blocks)


def _bad(name: str, offset: int, message: str) -> Bad:
    return Bad(CorruptRecord(message), f"file {name}, offset {offset}")


@dataclass(frozen=True, eq=False, kw_only=True)
class TFRecordSource(FormatSource):
    """Raw records (bytes) of TFRecord files; one unit per file."""

    kind: ClassVar[str] = "from_tfrecord"
    compression: str | None
    verify: bool
    max_record_bytes: int = MAX_RECORD_BYTES

    def read_unit(self, unit: Any) -> Iterator[Any]:
        path = self.files[unit][0]
        with self.open(unit) as raw, \
                decompressed(raw, self.compression) as stream:
            yield from read_records(stream, path, self.verify, self.max_record_bytes)

    def _format_options(self) -> tuple[Any, ...]:
        return (self.compression, self.verify, self.max_record_bytes)
