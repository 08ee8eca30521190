"""The file of one cache entry (the elements of one split) and where entries are kept.

An entry holds the elements a cached prefix produced from one split, each encoded by
:mod:`zloader.codec` (never pickled), and is only ever seen whole: a writer writes a
temporary file next to it and renames it into place when the split was read to its end.

Layout (little-endian; ``pad`` zero bytes up to the next multiple of ``ALIGN`` from the
start of the file, so that arrays decoded from an entry are aligned)::

    entry   = header frame* trailer
    header  = MAGIC version:u8 split:u64 length:u16 fingerprint:ascii
    frame   = count:u32 size:u64*count codec-header (pad buffer)*(count - 1)
    trailer = END count:u64 body:u64 crc32:u32

A frame is one element: the sizes of the codec's buffers, then the buffers (the codec's
header first, unpadded). The trailer gives the element count, the size of everything
before it (``body``) and the CRC-32 of those bytes: the count and checksum are known only
at the end, and object storage cannot seek back to a header while it writes. A reader
checks all of it (magic, version, fingerprint, split, size, checksum, every frame's bounds,
the count) and decodes every element once before it yields one, and rejects the entry with
:class:`BadEntry` otherwise.

A :class:`Store` is a cache location: a local directory, or a URL that fsspec understands
(through :mod:`zloader.storage`, with retries). Entries are ``<root>/<fingerprint>/
split-<n>.zlc``; temporary files add ``.tmp-<host>-<pid>-<random>`` to the name. An entry
is read into memory whole (at most ``max_entry_bytes``, never more than the file has; a
local one only once two small reads found its header and trailer right), not
memory-mapped: another process may truncate a file it can write, and a truncated mapping
kills its reader with SIGBUS. A cache folder may be shared with other users, who can plant
anything in it: locally, a fingerprint folder is opened without following symbolic links
and every file through it (``O_NOFOLLOW``), an entry is opened without blocking and read
only when it is a regular file, and listing and removal see only regular files named as
this module names its own.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import socket
import stat
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from zloader import codec
from zloader._defaults import CACHE_MAX_ENTRY_BYTES
from zloader.errors import CodecError, ZloaderError
from zloader.storage import StorageError, filesystem, is_url, retrying

__all__ = ["ALIGN", "BadEntry", "Entry", "EntryFile", "EntryWriter", "Store", "entry_frames",
           "is_fingerprint", "is_own_name", "open_entry"]

VERSION = 1
ALIGN = 64
MAGIC = b"ZLCACHE"
END = b"ZLCEND\0\0"
SUFFIX = ".zlc"
TEMP = ".tmp-"

_HEAD = struct.Struct("<7sBQH")
_TRAILER = struct.Struct("<8sQQI")
_U32 = struct.Struct("<I")

_ENTRY_NAME = re.compile(r"split-(0|[1-9][0-9]*)\.zlc")
_TEMP_NAME = re.compile(r"split-(0|[1-9][0-9]*)\.zlc\.tmp-[A-Za-z0-9._-]+-[0-9]+-[0-9a-f]+")
_NOT_HOST = re.compile(r"[^A-Za-z0-9._-]")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NO_LINK = os.O_NOFOLLOW
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in as read


class BadEntry(ZloaderError, ValueError):
    """A cache entry is not a whole, valid entry of the expected split; it says why."""


class CacheWriteError(ZloaderError, TypeError):
    """An element the cache cannot store (the codec does not carry one of its values)."""


def is_fingerprint(name: str) -> bool:
    """Whether ``name`` looks like a pipeline fingerprint (64 hex digits): a folder of
    entries."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def is_own_name(name: str) -> bool:
    """Whether ``name`` is one this module gives a file: an entry (``split-<n>.zlc``) or a
    temporary file (``split-<n>.zlc.tmp-<host>-<pid>-<hex>``)."""
    return bool(_ENTRY_NAME.fullmatch(name) or _TEMP_NAME.fullmatch(name))


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

    @property
    def size(self) -> int:
        """The bytes the entry will have once finished, with what was added so far."""
        return self.offset + _TRAILER.size

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


@dataclass(frozen=True)
class Entry:
    """A checked entry: its bytes, where its frames lie and how many there are."""

    view: memoryview
    start: int
    body: int
    count: int

    def frames(self) -> Iterator[list[memoryview]]:
        """The codec buffers of each element, in order (views into :attr:`view`)."""
        offset = self.start
        while offset < self.body:
            offset, frame = _frame(self.view, offset, self.body)
            yield frame

    def elements(self) -> Iterator[Any]:
        """The decoded elements, in order; arrays are read-only views into the entry."""
        return (codec.decode(frame) for frame in self.frames())


def open_entry(data: Any, fingerprint: str, split: int) -> Entry:
    """Check the entry ``data`` whole, and decode each element once (kept in none: memory
    stays that of the entry and one element), so that reading it cannot fail midway.

    ``data`` must not change while the entry is in use: give bytes read into memory.

    Raises:
        BadEntry: the entry is short, corrupt, not the one of ``fingerprint``/``split``, or
            an element in it does not decode.
    """
    view = memoryview(data).cast("B")
    size = view.nbytes
    if size < _HEAD.size + _TRAILER.size:
        raise BadEntry(f"short file ({size} bytes)")
    start = _check_head(view, fingerprint, split)
    count, body, crc = _check_trailer(view[size - _TRAILER.size:], size)
    if zlib.crc32(view[:body]) != crc:
        raise BadEntry("checksum mismatch (corrupt)")
    entry = Entry(view, start, body, count)
    found = 0
    for frame in entry.frames():
        try:
            codec.decode(frame)
        except Exception as exc:  # anyone may have written it: any failure is a bad entry
            raise BadEntry(f"element {found} does not decode: {exc}") from None
        found += 1
    if found != count:
        raise BadEntry(f"{found} elements where the trailer says {count}")
    return entry


def _check_head(data: Any, fingerprint: str, split: int) -> int:
    """Check the header at the start of ``data`` (an entry, or its first bytes): magic,
    version, fingerprint and split. Returns where the first frame starts.

    Raises:
        BadEntry: it is not the header of the entry of ``fingerprint``/``split``.
    """
    magic, version, found_split, length = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadEntry("not a cache entry (bad magic)")
    if version != VERSION:
        raise BadEntry(f"entry format version {version}, this zloader reads {VERSION}")
    name = bytes(data[_HEAD.size:_HEAD.size + length]).decode("ascii", "replace")
    if name != fingerprint or found_split != split:
        raise BadEntry(f"holds split {found_split} of {name[:16]}..., not split {split} of "
                       f"{fingerprint[:16]}...")
    return _HEAD.size + length


def _check_trailer(data: Any, size: int) -> tuple[int, int, int]:
    """Check the trailer ``data`` (the last bytes of an entry of ``size`` bytes). Returns
    its element count, body size and checksum.

    Raises:
        BadEntry: it is not a trailer, or not the one of an entry of this size.
    """
    end, count, body, crc = _TRAILER.unpack_from(data, 0)
    if end != END or body != size - _TRAILER.size:
        raise BadEntry(f"truncated or unfinished ({size} bytes, no valid trailer)")
    return count, body, crc


def _check_ends(fd: int, size: int, fingerprint: str, split: int) -> None:
    """Check the header and trailer of the entry open as ``fd`` (of ``size`` bytes) with
    two small reads, before it is read whole: a file that is no entry of this split (one
    planted sparse, say, claiming what max_entry_bytes allows and holding nothing) is
    then refused at the cost of those reads, not of its size.

    Raises:
        BadEntry: it is too short, or its header or trailer is wrong.
    """
    if size < _HEAD.size + _TRAILER.size:
        raise BadEntry(f"short file ({size} bytes)")
    head = os.pread(fd, _HEAD.size + len(fingerprint), 0)
    trailer = os.pread(fd, _TRAILER.size, size - _TRAILER.size)
    if len(head) < _HEAD.size or len(trailer) < _TRAILER.size:  # cut meanwhile
        raise BadEntry(f"truncated while it was opened ({size} bytes before)")
    _check_head(head, fingerprint, split)
    _check_trailer(trailer, size)


def entry_frames(data: Any, fingerprint: str, split: int) -> list[list[memoryview]]:
    """The codec buffers of each element of the entry ``data`` (views, not copies), after
    checking the whole entry (:func:`open_entry`).

    Raises:
        BadEntry: the entry is short, corrupt, or not the one of ``fingerprint``/``split``.
    """
    return list(open_entry(data, fingerprint, split).frames())


def _frame(view: memoryview, offset: int, body: int) -> tuple[int, list[memoryview]]:
    """The frame at ``offset``: where the next one starts, and its buffers (views). Every
    size it claims is checked against ``body`` before it is used."""
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
            raise BadEntry(f"buffer at byte {offset} overruns the entry (it claims {length} "
                           f"bytes)")
        buffers.append(view[offset:offset + length])
        offset += length
    return offset, buffers


def _check_size(size: int, limit: int) -> None:
    if size > limit:
        raise BadEntry(f"{size:,} bytes, more than max_entry_bytes ({limit:,}): an entry is "
                       "read into memory whole; raise Pipeline.cache(max_entry_bytes=) if "
                       "its splits are this large")


def _read_whole(fd: int, size: int) -> memoryview:
    """At most ``size`` (> 0) bytes of ``fd`` from where it is, read-only: fewer when the
    file was cut meanwhile (the entry's checks then reject it). The memory is private and
    anonymous, its pages faulted in at once (not zeroed by Python first, as a bytearray's
    would be: reading an entry costs about one copy)."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _POPULATE)
    view = memoryview(buffer)
    got = 0
    while got < size:
        read = os.readv(fd, [view[got:]])
        if not read:
            break
        got += read
    return view[:got].toreadonly()


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return kind
    return "not a file"


@dataclass(frozen=True)
class EntryFile:
    """A file under a store's root: its fingerprint folder, name, size and last write."""

    fingerprint: str
    name: str
    size: int
    mtime: float

    @property
    def temporary(self) -> bool:
        return bool(_TEMP_NAME.fullmatch(self.name))

    @property
    def split(self) -> int | None:
        """The split of a committed entry (``split-<n>.zlc``), else None."""
        match = _ENTRY_NAME.fullmatch(self.name)
        return int(match.group(1)) if match else None


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

    def load(self, fingerprint: str, split: int,
             limit: int = CACHE_MAX_ENTRY_BYTES) -> Any:
        """The bytes of the entry (read into memory), or None when there is none.

        Raises:
            BadEntry: it is larger than ``limit``, or (locally) not a regular file, or
                reached through a symbolic link, or its header or trailer is not this
                entry's; it is not read.
            OSError: it cannot be read (:class:`~zloader.storage.StorageError` for a URL).
        """
        if not self.remote:
            return self._load_local(fingerprint, split, limit)
        fs, inner = self._filesystem()
        path = self.path(fingerprint, split)
        key = f"{inner}/{fingerprint}/split-{split}{SUFFIX}"
        try:
            size = int(retrying(lambda: fs.size(key), path, "read"))
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise
        _check_size(size, limit)
        if size == 0:
            return b""
        return retrying(lambda: fs.cat_file(key, start=0, end=size), path, "read")

    def _load_local(self, fingerprint: str, split: int, limit: int) -> Any:
        try:
            with self._folder(fingerprint) as folder:
                fd = os.open(f"split-{split}{SUFFIX}", _READ_FLAGS, dir_fd=folder)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise BadEntry("a symbolic link (not followed)") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BadEntry(f"not a regular file ({_kind(info.st_mode)})")
            _check_size(info.st_size, limit)
            _check_ends(fd, info.st_size, fingerprint, split)
            return _read_whole(fd, info.st_size)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _folder(self, fingerprint: str, create: bool = False) -> Iterator[int]:
        """The fingerprint folder, open (a descriptor), never through a symbolic link.

        Raises:
            FileNotFoundError: it, or the root, is not there (and ``create`` is False).
            BadEntry: it is a symbolic link, or not a folder.
        """
        if not is_fingerprint(fingerprint):
            raise BadEntry(f"{fingerprint!r} is not a fingerprint")
        if create:
            os.makedirs(self.root, exist_ok=True)
        root = os.open(self.root, _DIR_FLAGS)
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(fingerprint, dir_fd=root)
            try:
                folder = os.open(fingerprint, _DIR_FLAGS | _NO_LINK, dir_fd=root)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise BadEntry(f"{self.root}/{fingerprint} is a symbolic link or not a "
                                   "folder (not followed)") from None
                raise
        finally:
            os.close(root)
        try:
            yield folder
        finally:
            os.close(folder)

    @contextlib.contextmanager
    def writing(self, fingerprint: str, split: int) -> Iterator[tuple[BinaryIO, Any]]:
        """A temporary file for the entry of ``split``, and a function that commits it
        (renames it into place). Leaving the block without committing removes it.

        Raises:
            OSError: the file cannot be made.
            BadEntry: (locally) the fingerprint folder is a symbolic link or not a folder.
        """
        name = f"split-{split}{SUFFIX}"
        temp = _temp_name(name)
        with contextlib.ExitStack() as stack:
            if self.remote:
                file, rename, discard = self._remote_temp(fingerprint, name, temp)
            else:
                fd = stack.enter_context(self._folder(fingerprint, create=True))
                file, rename, discard = _local_temp(fd, name, temp)
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
                        discard()

    def _remote_temp(self, fingerprint: str, name: str,
                     temp: str) -> tuple[BinaryIO, Callable[[], None], Callable[[], None]]:
        """The remote temporary file ``temp`` for :meth:`writing` (its fingerprint folder
        made first), a function that renames it to ``name`` and one that removes it."""
        url = f"{self.root}/{fingerprint}/{temp}"
        fs, inner = self._filesystem()
        folder = f"{inner}/{fingerprint}"
        retrying(lambda: fs.makedirs(folder, exist_ok=True), url, "write")
        file = retrying(lambda: fs.open(f"{folder}/{temp}", "wb"), url, "write")

        def rename() -> None:
            retrying(lambda: fs.mv(f"{folder}/{temp}", f"{folder}/{name}"), url, "commit")

        def discard() -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(f"{folder}/{temp}")
        return file, rename, discard

    def files(self) -> list[EntryFile]:
        """Every entry and temporary file under the root's fingerprint folders: regular
        files named as this module names them, reached without following a symbolic link
        (locally); anything else there is not the cache's and is left out.

        Raises:
            FileNotFoundError: the root is not there, or not a folder; it names it.
        """
        if not self.remote:
            return self._local_files()
        fs, inner = self._filesystem()
        fs.invalidate_cache()  # fsspec keeps listings; other processes write entries
        if not retrying(lambda: fs.isdir(inner), self.root, "list"):
            raise FileNotFoundError(f"no cache folder at {self.root}")
        found = []
        listed = retrying(lambda: fs.find(inner, detail=True), self.root, "list")
        for path, info in sorted(listed.items()):
            folder, _, name = path[len(inner) + 1:].partition("/")
            if is_fingerprint(folder) and is_own_name(name) and info.get("type") != "directory":
                found.append(EntryFile(folder, name, int(info.get("size") or 0),
                                       _mtime(info)))
        return found

    def _local_files(self) -> list[EntryFile]:
        try:
            root = os.open(self.root, _DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"no cache folder at {self.root}") from None
        found = []
        try:
            for fingerprint in sorted(os.listdir(root)):
                if not is_fingerprint(fingerprint):
                    continue
                try:
                    folder = os.open(fingerprint, _DIR_FLAGS | _NO_LINK, dir_fd=root)
                except OSError:  # a symbolic link, a file, or gone
                    continue
                try:
                    for name in sorted(os.listdir(folder)):
                        if not is_own_name(name):
                            continue
                        with contextlib.suppress(FileNotFoundError):
                            info = os.stat(name, dir_fd=folder, follow_symlinks=False)
                            if stat.S_ISREG(info.st_mode):
                                found.append(EntryFile(fingerprint, name, info.st_size,
                                                       info.st_mtime))
                finally:
                    os.close(folder)
        finally:
            os.close(root)
        return found

    def remove(self, file: EntryFile) -> bool:
        """Delete one file (an entry or a temporary file) and then its folder if empty.
        Locally only a regular file named as the cache names its own, in a folder reached
        without a symbolic link, is removed. Returns whether it was.
        """
        if not is_fingerprint(file.fingerprint) or not is_own_name(file.name):
            return False
        if self.remote:
            fs, inner = self._filesystem()
            try:
                fs.rm_file(f"{inner}/{file.fingerprint}/{file.name}")
            except FileNotFoundError:
                return False
            return True
        try:
            with self._folder(file.fingerprint) as folder:
                info = os.stat(file.name, dir_fd=folder, follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    return False
                os.unlink(file.name, dir_fd=folder)
        except (FileNotFoundError, BadEntry):
            return False
        with contextlib.suppress(OSError):  # the folder, once empty (never a link: ENOTDIR)
            root = os.open(self.root, _DIR_FLAGS)
            try:
                os.rmdir(file.fingerprint, dir_fd=root)
            finally:
                os.close(root)
        return True


def _temp_name(name: str) -> str:
    """A temporary name for the entry ``name``: unique to this host, process and call."""
    host = _NOT_HOST.sub("_", socket.gethostname()) or "host"
    return f"{name}{TEMP}{host}-{os.getpid()}-{os.urandom(4).hex()}"


def _local_temp(fd: int, name: str,
                temp: str) -> tuple[BinaryIO, Callable[[], None], Callable[[], None]]:
    """The local temporary file ``temp`` in the fingerprint folder ``fd``, made anew and
    never through a symbolic link, a function that renames it to ``name`` and one that
    removes it."""
    file = os.fdopen(os.open(temp, _WRITE_FLAGS, 0o666, dir_fd=fd), "wb")

    def rename() -> None:
        os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)

    def discard() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=fd)
    return file, rename, discard


def _mtime(info: dict[str, Any]) -> float:
    for key in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value: Any = info.get(key)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)):
            return float(value)
    return time.time()
