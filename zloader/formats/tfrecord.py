"""TFRecord files: one split per file (``parallel_reads`` groups them), raw records.

A TFRecord file is a sequence of records, each::

    uint64 length (little-endian) | uint32 masked CRC-32C of length | data[length] |
    uint32 masked CRC-32C of data

optionally compressed as a whole with GZIP or ZLIB. Records are read as a stream (at
most a read block ahead). With ``verify=True`` both checksums are checked: a record whose
data does not match its checksum raises :class:`CorruptRecord` naming the file and the
record's offset (in the uncompressed stream), or is counted and skipped under
``on_error="skip"``; a length that does not match its own checksum ends the file (nothing
after it can be framed), the same way.
"""

from __future__ import annotations

import gzip
import io
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

from zloader._defaults import READ_BLOCK_BYTES
from zloader.errors import CodecError
from zloader.formats._crc32c import masked_crc32c
from zloader.formats.base import FormatSource
from zloader.sources import ErrorPolicy

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

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while not self._pending:
            if self._inflate.eof:
                return 0
            chunk = self._stream.read(READ_BLOCK_BYTES)
            if not chunk:
                self._pending = self._inflate.flush()
                if not self._pending:
                    return 0
                break
            self._pending = self._inflate.decompress(chunk)
        size = min(len(view), len(self._pending))
        view[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size


def read_records(stream: BinaryIO, name: str, verify: bool = True,
                 policy: ErrorPolicy | None = None) -> Iterator[bytes]:
    """The records of an (uncompressed) TFRecord stream.

    Args:
        stream: a binary file object, read sequentially.
        name: the file or URL, for error messages.
        verify: check the length and data checksums.
        policy: counts, and skips when it skips errors, the corrupt records.

    Raises:
        CorruptRecord: a truncated or corrupt record (naming ``name`` and its offset).
    """
    offset = 0
    while True:
        header = stream.read(_HEADER.size)
        if not header:
            return
        if len(header) < _HEADER.size:
            yield from _fail(policy, f"{name}: truncated record header at offset {offset}")
            return
        length, length_crc = _HEADER.unpack(header)
        if verify and masked_crc32c(header[:8]) != length_crc:
            yield from _fail(policy, f"{name}: corrupt record length at offset {offset} "
                                     "(checksum mismatch)")
            return
        data = stream.read(length)
        footer = stream.read(_FOOTER.size)
        if len(data) < length or len(footer) < _FOOTER.size:
            yield from _fail(policy, f"{name}: truncated record at offset {offset} "
                                     f"({length} bytes expected)")
            return
        if verify and masked_crc32c(data) != _FOOTER.unpack(footer)[0]:
            if policy is None or not policy.skip_errors:
                raise CorruptRecord(f"{name}: corrupt record at offset {offset} (data "
                                    "checksum mismatch)")
            policy.skipped += 1  # this record only: the next one is framed all the same
        else:
            yield data
        offset += _HEADER.size + length + _FOOTER.size


def _fail(policy: ErrorPolicy | None, message: str) -> Iterator[bytes]:
    """End the file: raise, or count the error when the policy skips errors."""
    if policy is None or not policy.skip_errors:
        raise CorruptRecord(message)
    policy.skipped += 1
    yield from ()


@dataclass(frozen=True, eq=False, kw_only=True)
class TFRecordSource(FormatSource):
    """Raw records (bytes) of TFRecord files; one unit per file."""

    kind: ClassVar[str] = "from_tfrecord"
    compression: str | None
    verify: bool

    def read_unit(self, unit: Any, policy: ErrorPolicy | None) -> Iterator[bytes]:
        path = self.files[unit][0]
        with self.open(unit) as raw, \
                decompressed(raw, self.compression) as stream:
            yield from read_records(stream, path, self.verify, policy)

    def _format_options(self) -> tuple[Any, ...]:
        return (self.compression, self.verify)
