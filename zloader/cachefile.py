"""The file of one cache entry (the elements of one split) and where entries are kept.

An entry holds the elements a cached prefix produced from one split, each encoded by
:mod:`zloader.codec` (never pickled), and is only ever seen whole: a writer writes a
temporary file next to it and renames it into place when the split was read to its end.

Layout (little-endian; ``pad`` zero bytes up to the next multiple of ``ALIGN`` from the
start of the file, so that arrays decoded from a memory-mapped entry are aligned)::

    entry   = header frame* trailer
    header  = MAGIC version:u8 split:u64 length:u16 fingerprint:ascii
    frame   = count:u32 size:u64*count codec-header (pad buffer)*(count - 1)
    trailer = END count:u64 body:u64 crc32:u32

A frame is one element: the sizes of the codec's buffers, then the buffers (the codec's
header first, unpadded). The trailer gives the element count, the size of everything
before it (``body``) and the CRC-32 of those bytes: the count and checksum are known only
at the end, and object storage cannot seek back to a header while it writes. A reader
checks all of it (magic, version, fingerprint, split, size, checksum, every frame's bounds,
the count) before it yields an element, and rejects the entry with :class:`BadEntry`
otherwise.

A :class:`Store` is a cache location: a local directory, or a URL that fsspec understands
(through :mod:`zloader.storage`, with retries). Entries are ``<root>/<fingerprint>/
split-<n>.zlc``; temporary files add ``.tmp-<host>-<pid>-<random>`` to the name. Local
entries are memory-mapped when read; remote ones are fetched whole (one split's bytes).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from zloader import codec
from zloader.errors import CodecError, ZloaderError
from zloader.storage import StorageError, filesystem, is_url, retrying

__all__ = ["ALIGN", "BadEntry", "EntryFile", "EntryWriter", "Store", "entry_frames",
           "is_fingerprint"]

VERSION = 1
ALIGN = 64
MAGIC = b"ZLCACHE"
END = b"ZLCEND\0\0"
SUFFIX = ".zlc"
TEMP = ".tmp-"

_HEAD = struct.Struct("<7sBQH")
_TRAILER = struct.Struct("<8sQQI")
_U32 = struct.Struct("<I")


class BadEntry(ZloaderError, ValueError):
    """A cache entry is not a whole, valid entry of the expected split; it says why."""


class CacheWriteError(ZloaderError, TypeError):
    """An element the cache cannot store (the codec does not carry one of its values)."""


def is_fingerprint(name: str) -> bool:
    """Whether ``name`` looks like a pipeline fingerprint (64 hex digits): a folder of
    entries."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _pad(offset: int) -> int:
    return -offset % ALIGN


class EntryWriter:
    """Writes one entry to ``file``: :meth:`add` each element, then :meth:`finish`."""

    def __init__(self, file: BinaryIO, fingerprint: str, split: int) -> None:
        self.file = file
        self.offset = 0
        self.crc = 0
        self.count = 0
        name = fingerprint.encode("ascii")
        self._put(_HEAD.pack(MAGIC, VERSION, split, len(name)) + name)

    def _put(self, data: Any) -> None:
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.offset += memoryview(data).nbytes

    def _align(self) -> None:
        if _pad(self.offset):
            self._put(bytes(_pad(self.offset)))

    def add(self, element: Any) -> None:
        """Append one element.

        Raises:
            CacheWriteError: the codec cannot encode it; the message says what to change.
        """
        try:
            buffers = codec.encode(element)
        except CodecError as exc:
            raise CacheWriteError(
                f"{exc}; the cache stores elements as the codec encodes them and never "
                "pickles (Loader(objects=True) does not apply to it): convert the value in "
                "a map before .cache(), or move .cache() before the stage that makes it"
            ) from None
        sizes = [codec.nbytes(b) for b in buffers]
        self._put(struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes))
        self._put(buffers[0])
        for buffer in buffers[1:]:
            self._align()
            for part in (buffer if isinstance(buffer, codec.Gather) else (buffer,)):
                self._put(part)
        self.count += 1

    def finish(self) -> None:
        """Write the trailer (the count and the checksum); the file is then complete."""
        self.file.write(_TRAILER.pack(END, self.count, self.offset, self.crc))


def entry_frames(data: Any, fingerprint: str, split: int) -> list[list[memoryview]]:
    """The codec buffers of each element of the entry ``data`` (views, not copies), after
    checking the whole entry.

    Raises:
        BadEntry: the entry is short, corrupt, or not the one of ``fingerprint``/``split``.
    """
    view = memoryview(data).cast("B")
    size = view.nbytes
    if size < _HEAD.size + _TRAILER.size:
        raise BadEntry(f"short file ({size} bytes)")
    magic, version, found_split, length = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadEntry("not a cache entry (bad magic)")
    if version != VERSION:
        raise BadEntry(f"entry format version {version}, this zloader reads {VERSION}")
    name = bytes(view[_HEAD.size:_HEAD.size + length]).decode("ascii", "replace")
    if name != fingerprint or found_split != split:
        raise BadEntry(f"holds split {found_split} of {name[:16]}..., not split {split} of "
                       f"{fingerprint[:16]}...")
    end, count, body, crc = _TRAILER.unpack_from(view, size - _TRAILER.size)
    if end != END or body != size - _TRAILER.size:
        raise BadEntry(f"truncated or unfinished ({size} bytes, no valid trailer)")
    if zlib.crc32(view[:body]) != crc:
        raise BadEntry("checksum mismatch (corrupt)")
    frames: list[list[memoryview]] = []
    offset = _HEAD.size + length
    while offset < body:
        offset, frame = _frame(view, offset, body)
        frames.append(frame)
    if len(frames) != count:
        raise BadEntry(f"{len(frames)} elements where the trailer says {count}")
    return frames


def _frame(view: memoryview, offset: int, body: int) -> tuple[int, list[memoryview]]:
    if offset + _U32.size > body:
        raise BadEntry(f"frame at byte {offset} overruns the entry")
    (count,) = _U32.unpack_from(view, offset)
    offset += _U32.size
    if count < 1 or offset + 8 * count > body:
        raise BadEntry(f"frame at byte {offset} has a bad buffer count {count}")
    sizes = struct.unpack_from(f"<{count}Q", view, offset)
    offset += 8 * count
    buffers = []
    for index, length in enumerate(sizes):
        if index:
            offset += _pad(offset)
        if offset + length > body:
            raise BadEntry(f"buffer at byte {offset} overruns the entry")
        buffers.append(view[offset:offset + length])
        offset += length
    return offset, buffers


@dataclass(frozen=True)
class EntryFile:
    """A file under a store's root: its fingerprint folder, name, size and last write."""

    fingerprint: str
    name: str
    size: int
    mtime: float

    @property
    def temporary(self) -> bool:
        return TEMP in self.name

    @property
    def split(self) -> int | None:
        """The split of a committed entry (``split-<n>.zlc``), else None."""
        stem = self.name.removesuffix(SUFFIX)
        if self.temporary or stem == self.name or not stem.startswith("split-"):
            return None
        number = stem.removeprefix("split-")
        return int(number) if number.isdigit() else None


class Store:
    """A cache location: a local directory (``root`` absolute) or an fsspec URL.

    Every operation on a URL is retried on transient errors (:func:`zloader.storage.
    retrying`); one that still fails raises :class:`~zloader.storage.StorageError`.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root.rstrip("/") or "/"
        self.storage_options = storage_options
        self.remote = is_url(root)
        self._fs: Any = None
        self._inner = ""

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None:
            self._fs, inner = filesystem(self.root, self.storage_options)
            self._inner = inner.rstrip("/")
        return self._fs, self._inner

    def path(self, fingerprint: str, split: int) -> str:
        """Where the entry of ``split`` lives (a local path, or a URL)."""
        return f"{self.root}/{fingerprint}/split-{split}{SUFFIX}"

    def load(self, fingerprint: str, split: int) -> Any:
        """The bytes of the entry (an mmap of a local file), or None when there is none."""
        path = self.path(fingerprint, split)
        if not self.remote:
            try:
                with open(path, "rb") as file:
                    if os.fstat(file.fileno()).st_size == 0:
                        return b""
                    return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                return None
        fs, inner = self._filesystem()
        try:
            return retrying(lambda: fs.cat_file(f"{inner}/{fingerprint}/split-{split}{SUFFIX}"),
                            path, "read")
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise

    @contextlib.contextmanager
    def writing(self, fingerprint: str, split: int) -> Iterator[tuple[BinaryIO, Any]]:
        """A temporary file for the entry of ``split``, and a function that commits it
        (renames it into place). Leaving the block without committing removes it."""
        name = f"split-{split}{SUFFIX}"
        temp = f"{name}{TEMP}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        url = f"{self.root}/{fingerprint}/{temp}"
        if self.remote:
            fs, inner = self._filesystem()
            folder = f"{inner}/{fingerprint}"
            retrying(lambda: fs.makedirs(folder, exist_ok=True), url, "write")
            file = retrying(lambda: fs.open(f"{folder}/{temp}", "wb"), url, "write")

            def rename() -> None:
                retrying(lambda: fs.mv(f"{folder}/{temp}", f"{folder}/{name}"), url,
                         "commit")
        else:
            folder = f"{self.root}/{fingerprint}"
            os.makedirs(folder, exist_ok=True)
            file = open(f"{folder}/{temp}", "wb")  # noqa: SIM115 (closed by commit, or below)

            def rename() -> None:
                os.replace(f"{folder}/{temp}", f"{folder}/{name}")
        done = False

        def commit() -> None:
            nonlocal done
            file.close()
            rename()
            done = True
        try:
            yield file, commit
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    file.close()
                with contextlib.suppress(Exception):
                    self._remove_one(f"{folder}/{temp}")

    def files(self) -> list[EntryFile]:
        """Every entry and temporary file under the root's fingerprint folders."""
        found = []
        if not self.remote:
            if not os.path.isdir(self.root):
                return []
            for folder in sorted(os.listdir(self.root)):
                if not is_fingerprint(folder) or not os.path.isdir(f"{self.root}/{folder}"):
                    continue
                for name in sorted(os.listdir(f"{self.root}/{folder}")):
                    with contextlib.suppress(FileNotFoundError):
                        stat = os.stat(f"{self.root}/{folder}/{name}")
                        found.append(EntryFile(folder, name, stat.st_size, stat.st_mtime))
            return found
        fs, inner = self._filesystem()
        fs.invalidate_cache()  # fsspec keeps listings; other processes write entries
        if not retrying(lambda: fs.exists(inner), self.root, "list"):
            return []
        listed = retrying(lambda: fs.find(inner, detail=True), self.root, "list")
        for path, info in sorted(listed.items()):
            folder, _, name = path[len(inner) + 1:].partition("/")
            if is_fingerprint(folder) and name and "/" not in name:
                found.append(EntryFile(folder, name, int(info.get("size") or 0),
                                       _mtime(info)))
        return found

    def remove(self, file: EntryFile) -> None:
        """Delete one file (an entry or a temporary file); a missing one is no error."""
        if self.remote:
            _, inner = self._filesystem()
            self._remove_one(f"{inner}/{file.fingerprint}/{file.name}")
        else:
            self._remove_one(f"{self.root}/{file.fingerprint}/{file.name}")
            with contextlib.suppress(OSError):  # the folder, once empty
                os.rmdir(f"{self.root}/{file.fingerprint}")

    def _remove_one(self, path: str) -> None:
        if not self.remote:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        fs, _ = self._filesystem()
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)


def _mtime(info: dict[str, Any]) -> float:
    for key in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value: Any = info.get(key)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)):
            return float(value)
    return time.time()
