"""Shared-memory segments: plain files in ``/dev/shm``, mapped with :mod:`mmap`.

A segment is created by one process (its *owner*, which alone unlinks it) and attached
by others by name. :mod:`multiprocessing.shared_memory` is deliberately not used: its
resource tracker starts a helper process per interpreter, and it unlinks segments it
did not create when an attaching process exits.

Names come from :func:`segment_name` only, and carry the creator's uid and pid
(``zloader-<uid>-<pid>-<kind>-<8 hex>``), so :func:`sweep` can remove the segments of
owners that died without cleaning up (``kill -9``, OOM killer); :func:`sweep_dirs` does
the same for embedded Loaders' socket directories.

Memory is reserved when the segment is created (``posix_fallocate``), so a full
``/dev/shm`` fails there with :class:`ShmError` instead of as a ``SIGBUS`` on some later
write, and every page is faulted in when mapped, so the data path never page-faults. A
ring's writer is the exception: it reserves the ring's data region as its records reach
into it (:meth:`Segment.reserve`), and faults those pages in on a background thread
(``zloader/transport/prefault.py``), so that a ring costs the memory its records use, not
its capacity, and its first record does not wait for the kernel to zero the whole ring.

Unmapping memory that numpy arrays or memoryviews still point at would make them
dangling, so :meth:`Segment.close` never does it: while views made from
:attr:`Segment.buf` are alive the mapping stays, and it is unmapped when the last of
them is garbage collected.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import weakref
from types import TracebackType

from zloader.errors import ZloaderError

__all__ = ["PREFIX", "SHM_DIR", "Segment", "ShmError", "alive", "check_name", "segment_name",
           "sweep", "sweep_dirs"]

SHM_DIR = "/dev/shm"
PREFIX = "zloader-"
"""Every segment name starts with this; the leak checks and :func:`sweep` rely on it."""
KIND_MAX = 16
"""Longest ``kind`` accepted by :func:`segment_name`."""
PAGE_SIZE = mmap.PAGESIZE

_KIND = re.compile(rf"[a-z0-9]{{1,{KIND_MAX}}}\Z")
# What follows the prefix in a name made by segment_name: uid, pid, kind, random suffix.
_REST = re.compile(rf"(\d{{1,10}})-(\d{{1,10}})-([a-z0-9]{{1,{KIND_MAX}}})-[0-9a-f]{{8}}\Z")
_MIB = 1024 * 1024
# Python's mmap module has MAP_POPULATE on Linux since 3.10; 0 means "touch pages instead".
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class ShmError(ZloaderError, OSError):
    """A shared-memory segment could not be created because ``/dev/shm`` is too small."""


def segment_name(kind: str) -> str:
    """Return a fresh segment name for this process.

    Args:
        kind: what the segment holds, 1 to ``KIND_MAX`` characters of ``[a-z0-9]``
            (``"ring"``).

    Returns:
        ``zloader-<uid>-<pid>-<kind>-<8 random hex digits>``.

    Raises:
        ValueError: ``kind`` is not a short lowercase alphanumeric string.
    """
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise ValueError(f"segment kind must be 1 to {KIND_MAX} characters of [a-z0-9], "
                         f"got {kind!r}")
    return f"{PREFIX}{os.getuid()}-{os.getpid()}-{kind}-{os.urandom(4).hex()}"


def check_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a zloader segment's (:func:`segment_name`)."""
    if not (isinstance(name, str) and name.startswith(PREFIX)
            and _REST.match(name, len(PREFIX))):
        raise ValueError(f"not a zloader segment name: {name!r} (expected "
                         f"{PREFIX}<uid>-<pid>-<kind>-<8 hex digits>)")


def _unlink_path(path: str, owner_pid: int) -> None:
    """Remove a segment file; the finalizer behind :meth:`Segment.unlink`.

    A process forked from the owner inherits the finalizer; only the owner itself
    may remove the file, so the pid is checked.
    """
    if os.getpid() != owner_pid:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Segment:
    """One mapped shared-memory segment.

    Make one with :meth:`create` (the owner) or :meth:`attach`. Used as a context
    manager it is closed on exit, and unlinked too when this process created it.

    Attributes:
        name: the file name in ``/dev/shm``, suitable for :meth:`attach`.
        size: the mapped size in bytes.
        owner: whether this process created the segment (and must unlink it).
    """

    name: str
    size: int
    owner: bool

    def __init__(self, name: str, size: int, mapping: mmap.mmap, owner: bool) -> None:
        """Wrap an existing mapping; use :meth:`create` or :meth:`attach` instead."""
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping
        self._buf: memoryview | None = memoryview(mapping)
        self._unlinker: weakref.finalize[[str, int], Segment] | None = None
        if owner:
            # Unlinks at garbage collection or interpreter exit if unlink() was never
            # called, so a forgotten segment does not outlive the process in /dev/shm.
            self._unlinker = weakref.finalize(self, _unlink_path, _path(name), os.getpid())

    @classmethod
    def create(cls, kind: str, size: int, reserve: int | None = None) -> Segment:
        """Create, reserve and map a new segment of ``size`` bytes, filled with zeros.

        Args:
            kind: what the segment holds (see :func:`segment_name`).
            size: size in bytes, at least 1.
            reserve: reserve (allocate) only the first ``reserve`` bytes here and map the
                rest lazily; whoever writes the rest must reserve it first
                (:meth:`reserve`, or ``attach(..., reserve=True)``), or a full /dev/shm
                would kill it with SIGBUS. None: all of it, and every page mapped now. A
                ring's reader reserves its header only: its writer, another process,
                reserves the data as its records reach it, so the reader does not spend
                its own time zeroing it.

        Returns:
            The mapped segment; this process owns it and must :meth:`unlink` it.

        Raises:
            ShmError: ``/dev/shm`` does not have ``size`` bytes free. Nothing is left
                behind in ``/dev/shm``.
            ValueError: bad ``kind`` or ``size``.
            OSError: the file could not be created or mapped for another reason.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"segment size must be a positive int, got {size!r}")
        name = segment_name(kind)
        _check_free(size)  # fail before creating anything in the common case
        path = _path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            try:
                _reserve(fd, size if reserve is None else min(reserve, size))
                if reserve is not None:
                    os.ftruncate(fd, size)
            except _NoSpace:
                raise _no_space(size) from None
            mapping = _map(fd, size, prefault_write=True, lazy=reserve is not None)
        except BaseException:
            os.close(fd)
            _unlink_path(path, os.getpid())
            raise
        # The mmap holds its own duplicate of the descriptor; ours is no longer needed.
        os.close(fd)
        return cls(name, size, mapping, owner=True)

    @classmethod
    def attach(cls, name: str, private: bool = False, reserve: bool = False,
               populate: bool = True) -> Segment:
        """Map an existing segment created by another process (or this one).

        Args:
            name: the segment's name, as made by :func:`segment_name`.
            private: map it copy-on-write: writes through this mapping change only this
                process's copy of the pages written (the segment and other processes never
                see them). Pages are then faulted in when first read, not up front.
            reserve: allocate every page of the file now (the writer of a segment whose
                creator reserved only part of it, see :meth:`create`).
            populate: fault every page in now (``MAP_POPULATE``). False: pages fault in
                when first touched, or when a :class:`~zloader.transport.prefault.Prefaulter`
                gets to them (a ring's writer, which must not wait for all of them).

        Returns:
            The mapped segment; it is never unlinked through this object.

        Raises:
            ValueError: ``name`` is not a zloader segment name, or the file is not a
                regular non-empty file.
            FileNotFoundError: no such segment (its owner unlinked it).
        """
        check_name(name)
        # O_NOFOLLOW: /dev/shm is world-writable, a symlink planted there must not be followed.
        fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < 1:
                raise ValueError(f"shared-memory segment {name!r} is not a regular "
                                 "non-empty file")
            if reserve:
                try:
                    _reserve(fd, info.st_size)
                except _NoSpace:
                    raise _no_space(info.st_size) from None
            mapping = _map(fd, info.st_size, prefault_write=False, private=private,
                           lazy=not populate)
        finally:
            os.close(fd)
        return cls(name, info.st_size, mapping, owner=False)

    def reserve(self, start: int, end: int) -> None:
        """Allocate bytes ``start`` to ``end`` of the segment's file (a ring's writer
        reserves its data region as its records reach further into it).

        Raises:
            ShmError: /dev/shm has no room for them.
            OSError: the segment is gone (its owner unlinked it).
        """
        fd = os.open(_path(self.name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            _reserve(fd, end, start)
        except _NoSpace:
            raise _no_space(end - start) from None
        finally:
            os.close(fd)

    @property
    def buf(self) -> memoryview:
        """The whole segment as a writable memoryview (``format "B"``).

        Raises:
            ValueError: the segment was closed.
        """
        if self._buf is None:
            raise ValueError(f"shared-memory segment {self.name!r} is closed")
        return self._buf

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._buf is None

    def close(self) -> None:
        """Drop this object's mapping; idempotent, never raises BufferError.

        If memoryviews or arrays made from :attr:`buf` are still alive, the memory
        stays mapped (and valid) until the last of them is garbage collected.
        """
        buf, mapping = self._buf, self._mmap
        self._buf = self._mmap = None
        if buf is not None:
            # BufferError: something holds a buffer of buf itself, which keeps it alive.
            with contextlib.suppress(BufferError):
                buf.release()
        if mapping is not None:
            # BufferError: views still point into the mapping. Dropping our reference
            # leaves the mmap alive through them; it unmaps itself when they are gone.
            with contextlib.suppress(BufferError):
                mapping.close()

    def unlink(self) -> None:
        """Remove the segment's name from ``/dev/shm``; idempotent.

        Only the owner may unlink. Processes that have the segment mapped keep their
        mapping; the memory is freed when the last mapping goes.

        Raises:
            PermissionError: this process attached the segment rather than creating it.
        """
        if self._unlinker is None:
            raise PermissionError(f"only the process that created segment {self.name!r} "
                                  "may unlink it")
        self._unlinker()  # runs at most once

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Segment {self.name!r} {self.size} bytes {state}>"


def sweep(prefix: str = PREFIX) -> list[str]:
    """Remove the segments of this user whose creating process no longer exists.

    Only names of the form ``<prefix><uid>-<pid>-<kind>-<hex>`` are considered, only
    regular files (and named pipes) owned by this user whose name carries this user's
    uid, and only when no process with that pid exists. A pid that has been reused by
    another process keeps its segments (they are removed by a later sweep). Processes in
    another pid namespace that share this ``/dev/shm`` look dead: do not sweep across containers.

    Args:
        prefix: the name prefix to look for.

    Returns:
        The names removed.

    Raises:
        ValueError: ``prefix`` is empty or contains ``/``.
    """
    if not prefix or "/" in prefix or "\0" in prefix:
        raise ValueError(f"bad segment name prefix {prefix!r}")
    uid = os.getuid()
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        match = _REST.match(name, len(prefix))
        if match is None or int(match.group(1)) != uid:
            continue
        pid = int(match.group(2))
        if alive(pid):
            continue
        path = _path(name)
        try:
            info = os.lstat(path)
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode)) \
                    or info.st_uid != uid:  # (a pipe: a consumer's notices, notice.py)
                continue
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            continue  # raced with its owner or another sweep, or not ours after all
        removed.append(name)
    return removed


def sweep_dirs(root: str | None = None) -> list[str]:
    """Remove the embedded-mode socket directories (``zloader-<pid>-<random>`` in the temp
    directory) of this user's dead processes; returns their names."""
    import shutil
    import tempfile

    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        parts = name.split("-")
        if (len(parts) != 3 or parts[0] != "zloader" or not parts[1].isdigit()
                or len(parts[1]) > 10):
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if (info.st_uid == os.getuid() and stat.S_ISDIR(info.st_mode)
                and not alive(int(parts[1]))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    if pid <= 0:
        return True  # kill(0) and kill(-1) address groups of processes: never "dead"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits only to be reaped (it holds nothing any more:
    a trainer killed by SIGTERM whose parent has not called wait() yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat_line = file.read()
    except OSError:
        return False
    return stat_line[stat_line.rfind(b")") + 2:][:1] == b"Z"


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class _NoSpace(Exception):
    """/dev/shm is full (raised as :func:`_no_space`'s ShmError by the callers)."""


def _reserve(fd: int, size: int, start: int = 0) -> None:
    """Allocate bytes ``start`` to ``size`` of ``fd``'s file: ftruncate alone would leave
    pages to be allocated on first touch, and a full /dev/shm would then kill the writer
    with SIGBUS."""
    try:
        os.posix_fallocate(fd, start, size - start)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _NoSpace from None
        raise


def _map(fd: int, size: int, prefault_write: bool, private: bool = False,
         lazy: bool = False) -> mmap.mmap:
    if private or lazy:  # private: populating would copy every page; lazy: see create()
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if not _MAP_POPULATE:
        # Fault every page in now rather than on the data path. Only the creator
        # writes (zeros over zeros); an attacher must not race the owner's writes.
        if prefault_write:
            for offset in range(0, size, PAGE_SIZE):
                mapping[offset] = 0
        else:
            total = 0
            for offset in range(0, size, PAGE_SIZE):
                total += mapping[offset]
    return mapping


def _free_bytes() -> int | None:
    """Bytes free in /dev/shm, or None when the file system does not say (no size limit)."""
    try:
        info = os.statvfs(SHM_DIR)
    except OSError:
        return None
    if info.f_blocks == 0:
        return None
    return info.f_bavail * info.f_frsize


def _check_free(size: int) -> None:
    free = _free_bytes()
    if free is not None and size > free:
        raise _no_space(size)


def _no_space(size: int) -> ShmError:
    free = _free_bytes()
    free_text = "unknown" if free is None else f"{free / _MIB:.1f} MiB"
    return ShmError(
        errno.ENOSPC,
        f"cannot reserve {size / _MIB:.1f} MiB in {SHM_DIR} ({free_text} free): lower "
        f"ring_bytes or enlarge {SHM_DIR} (mount -o remount,size=8G {SHM_DIR}; in Docker, "
        "run with --shm-size=8g)")
