"""Where a file source's files live: local paths, or URLs that fsspec understands
(``s3://``, ``gs://``, ``http(s)://``, ``file://``).

Local paths need nothing beyond Python; any other URL imports fsspec (and its protocol's
package, such as s3fs) when it is first used, and raises an ImportError naming the extra
to install when it is missing. Every storage operation (listing, stat, open, each read)
is retried with exponential backoff on a transient error; a permanent one (missing file,
permission) and the last failed retry raise :class:`StorageError` naming the URL. An
operation that waits longer than ``STORAGE_WAIT_WARNING`` seconds (a server that accepts
and never answers) is logged as a warning naming the URL and what is waited for, and
again every ``STORAGE_WAIT_REPEAT`` seconds while it waits (:func:`waiting`).

A file is described by a :data:`FileRef`: ``(path or URL, size, version tag)``, the tag
being the modification time in nanoseconds of a local file, or an object's ETag (else its
modification time) in object storage: what a source's fingerprint hashes, never the
content.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import io
import itertools
import logging
import math
import os
import random
import re
import stat as _stat_module
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar, overload

from zloader._byfields import ByFields
from zloader._defaults import (
    READ_BLOCK_BYTES,
    STORAGE_BACKOFF,
    STORAGE_BACKOFF_MAX,
    STORAGE_RETRIES,
    STORAGE_WAIT_REPEAT,
    STORAGE_WAIT_WARNING,
)
from zloader.errors import ZloaderError

__all__ = ["FileRef", "StorageError", "filesystem", "is_url", "list_dirs", "list_files",
           "list_tree", "open_file", "retrying", "waiting"]

log = logging.getLogger("zloader.storage")

FileRef = tuple[str, int, str]
"""A file of a source: (absolute path or URL, size in bytes, version tag)."""

_T = TypeVar("_T")

_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
              ImportError, TypeError, ValueError, KeyError)
"""Failures that another attempt will not cure."""


class StorageError(ZloaderError, OSError):
    """A file or URL could not be listed, opened or read; the message names it."""


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in path


def _local(path: str) -> str | None:
    """The local path of ``path`` (a plain path or a ``file://`` URL), else None."""
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if is_url(path) else path


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise ImportError("reading URLs needs fsspec and the package of the URL's protocol: "
                          "pip install 'zloader[cloud]' (s3fs for s3://, gcsfs for gs://, "
                          "aiohttp for http(s)://)") from None
    return fsspec


def _filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it."""
    fsspec = _fsspec()
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        raise ImportError(f"cannot read {url}: {exc}; pip install 'zloader[cloud]' or the "
                          "fsspec package of its protocol") from None
    return fs, path


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it (for writers such as the
    cache, which need more than :func:`open_file`).

    Raises:
        ImportError: fsspec or the URL's protocol package is missing; it names the extra.
    """
    return _filesystem(url, storage_options)


def _permanent(exc: BaseException) -> bool:
    return isinstance(exc, _PERMANENT) or not isinstance(exc, Exception)


def _backoff(attempt: int) -> float:
    delay: float = min(STORAGE_BACKOFF_MAX, STORAGE_BACKOFF * 2 ** attempt)
    return delay * (0.5 + random.random() / 2)


@dataclass(eq=False, repr=False)
class _Wait(ByFields):
    """A read that waits on storage: where, what, since when."""

    url: str
    what: str
    started: float
    warn_at: float


class _Watch:
    """The storage operations in flight in this process, and one daemon thread that warns
    about each that waits too long. One thread for all: opening thousands of files starts
    no thread per file, and it is woken only when a wait is due sooner than it planned."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._waits: dict[int, _Wait] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf

    @contextlib.contextmanager
    def waiting(self, url: str, what: str) -> Iterator[None]:
        now = time.monotonic()
        wait = _Wait(url, what, now, now + STORAGE_WAIT_WARNING)
        with self._lock:
            token = next(self._tokens)
            self._waits[token] = wait
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="zloader-storage-watch")
                self._thread.start()
            elif wait.warn_at < self._wake_at:
                self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                late = [w for w in self._waits.values() if w.warn_at <= now]
                for wait in late:
                    wait.warn_at = now + STORAGE_WAIT_REPEAT
                notes = [(w.what, w.url, now - w.started) for w in late]
                if not notes:
                    self._wake_at = min((w.warn_at for w in self._waits.values()),
                                        default=math.inf)
                    self._lock.wait(None if self._wake_at == math.inf
                                    else self._wake_at - now)
                    self._wake_at = -math.inf  # awake: a new wait need not notify
                    continue
            for what, url, seconds in notes:
                log.warning("still waiting to %s %s after %.0f s: the storage does not "
                            "answer (each of up to %d attempts lasts until the filesystem's "
                            "own timeout, which storage_options may set)", what, url,
                            seconds, STORAGE_RETRIES)


_WATCH = _Watch()
os.register_at_fork(after_in_child=_WATCH._reset)  # the thread and its lock stay behind


def waiting(url: str, what: str) -> contextlib.AbstractContextManager[None]:
    """A context in which this process waits on storage for ``url``: past
    ``STORAGE_WAIT_WARNING`` seconds a warning names ``url`` and ``what`` is waited for
    (``"stat"``, ``"open"``), and again every ``STORAGE_WAIT_REPEAT`` seconds."""
    return _WATCH.waiting(url, what)


def retrying(operation: Callable[[], _T], url: str, what: str) -> _T:
    """``operation()``, retried with backoff on transient errors; a warning is logged
    while it waits long (:func:`waiting`).

    Raises:
        StorageError: the error was permanent, or every attempt failed; it names ``url``.
    """
    with waiting(url, what):
        return _retrying(operation, url, what)


def _retrying(operation: Callable[[], _T], url: str, what: str) -> _T:
    for attempt in range(STORAGE_RETRIES):
        try:
            return operation()
        except BaseException as exc:
            if _permanent(exc):
                if isinstance(exc, ImportError) or not isinstance(exc, Exception):
                    raise
                raise StorageError(f"cannot {what} {url}: {type(exc).__name__}: {exc}") \
                    from exc
            if attempt + 1 == STORAGE_RETRIES:
                raise StorageError(f"cannot {what} {url} after {STORAGE_RETRIES} attempts: "
                                   f"{type(exc).__name__}: {exc}") from exc
            time.sleep(_backoff(attempt))
    raise AssertionError("unreachable")  # pragma: no cover


def _paths(paths_or_glob: Any, what: str) -> tuple[list[str], bool]:
    """The given paths as strings, and whether they came from one glob pattern."""
    if isinstance(paths_or_glob, (str, os.PathLike)):
        return [os.fspath(paths_or_glob)], _glob.has_magic(os.fspath(paths_or_glob))
    if isinstance(paths_or_glob, Iterable) and not isinstance(paths_or_glob, bytes):
        paths = [os.fspath(p) for p in paths_or_glob]
        if not all(isinstance(p, str) for p in paths):
            raise TypeError(f"{what}: paths must be str or path-like")
        return paths, False
    raise TypeError(f"{what}: give a path, a URL, a glob pattern or a list of them, got "
                    f"{type(paths_or_glob).__name__}")


def _tag(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "LastModified", "last_modified", "mtime",
                "updated", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def list_files(paths_or_glob: Any, storage_options: dict[str, Any] | None = None,
               what: str = "source") -> tuple[FileRef, ...]:
    """Expand a glob pattern (sorted matches, ``**`` recurses) or check a list of paths and
    URLs; stat each file.

    Raises:
        ValueError: a file does not exist or is not a file, or the pattern matches none.
        StorageError: storage failed after its retries.
    """
    paths, pattern = _paths(paths_or_glob, what)
    if not pattern or _is_file(paths[0], storage_options):
        return tuple(_stat(path, storage_options, what) for path in paths)
    found = tuple(ref for ref in (_stat(path, storage_options, what, folders=True)
                                  for path in _expand(paths[0], storage_options, what))
                  if ref is not None)
    if not found:
        raise ValueError(f"{what}: pattern {paths[0]!r} matched no files (folders it "
                         "matches are passed over)")
    return found


def _is_file(path: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether ``path`` names a file as it is written (a file whose name holds ``[``,
    ``*`` or ``?`` is that file, not a pattern)."""
    local = _local(path)
    if local is not None:
        return os.path.isfile(local)
    fs, inner = _filesystem(path, storage_options)
    try:
        return bool(retrying(lambda: fs.isfile(inner), path, "stat"))
    except StorageError:
        return False


def _expand(pattern: str, storage_options: dict[str, Any] | None, what: str) -> list[str]:
    local = _local(pattern)
    if local is not None:
        found = sorted(_glob.glob(local, recursive=True))
    else:
        fs, path = _filesystem(pattern, storage_options)
        matches = retrying(lambda: fs.glob(path), pattern, "list")
        found = sorted(fs.unstrip_protocol(m) for m in matches)
    if not found:
        raise ValueError(f"{what}: pattern {pattern!r} matched no files")
    return found


@overload
def _stat(path: str, storage_options: dict[str, Any] | None, what: str) -> FileRef: ...
@overload
def _stat(path: str, storage_options: dict[str, Any] | None, what: str,
          folders: bool) -> FileRef | None: ...
def _stat(path: str, storage_options: dict[str, Any] | None, what: str,
          folders: bool = False) -> FileRef | None:
    """``path``'s :data:`FileRef`; None for a folder where ``folders`` (a glob's match).

    Raises:
        ValueError: it does not exist, or is no file (a folder, unless ``folders``).
    """
    local = _local(path)
    if local is not None:
        absolute = os.path.abspath(local)
        try:
            stat = os.stat(absolute)
        except OSError as exc:
            raise ValueError(f"{what}: cannot read {path!r}: {exc.strerror}"
                             f"{_braces(path)}") from None
        if folders and _stat_module.S_ISDIR(stat.st_mode):
            return None
        if not _stat_module.S_ISREG(stat.st_mode):
            raise ValueError(f"{what}: {path!r} is not a file")
        return absolute, stat.st_size, str(stat.st_mtime_ns)
    fs, inner = _filesystem(path, storage_options)
    try:
        info = retrying(lambda: fs.info(inner), path, "stat")
    except StorageError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise ValueError(f"{what}: cannot read {path!r}: no such file"
                             f"{_braces(path)}") from None
        raise
    if folders and info.get("type") == "directory":
        return None
    if info.get("type") != "file":
        raise ValueError(f"{what}: {path!r} is not a file")
    return path, int(info.get("size") or 0), _tag(info)


def _braces(path: str) -> str:
    """A hint for a path written with braces (``shard-{000..009}.tar``, as webdataset and
    the shell expand them), which is read as it is written."""
    if re.search(r"\{[^{}]*(\.\.|,)[^{}]*\}", path) is None:
        return ""
    return (" (braces are not expanded: give the list of paths, e.g. "
            "[f'shard-{i:03d}.tar' for i in range(10)], or a glob pattern)")


def list_tree(root: str, storage_options: dict[str, Any] | None = None,
              what: str = "source", keep: Callable[[str], bool] | None = None
              ) -> list[tuple[str, FileRef]]:
    """Every file under directory ``root`` whose path relative to it (with ``/``) ``keep``
    keeps (all by default): that path and its :data:`FileRef`, sorted by folder then name
    (as ``os.walk`` sorted). Symbolic links to folders are followed, as torchvision does;
    a file not kept is never looked at (a broken link among them is no error).

    Raises:
        ValueError: ``root`` is not a directory, or a file kept cannot be read (a broken
            link).
    """
    local = _local(root)
    found: list[tuple[str, FileRef]] = []
    if local is not None:
        base = os.path.abspath(local)
        if not os.path.isdir(base):
            raise ValueError(f"{what}: {root!r} is not a directory")
        for folder, _dirs, files in os.walk(base, followlinks=True):
            for name in files:
                full = os.path.join(folder, name)
                relative = os.path.relpath(full, base).replace(os.sep, "/")
                if keep is not None and not keep(relative):
                    continue
                try:
                    stat = os.stat(full)
                except OSError as exc:
                    raise ValueError(f"{what}: cannot read {full!r}: {exc.strerror}") \
                        from None
                found.append((relative, (full, stat.st_size, str(stat.st_mtime_ns))))
    else:
        fs, inner = _filesystem(root, storage_options)
        inner = inner.rstrip("/")
        listed = retrying(lambda: fs.find(inner, detail=True), root, "list")
        if not listed:
            raise ValueError(f"{what}: {root!r} is empty or not a directory")
        for path, info in listed.items():
            if path.startswith(inner + "/") and info.get("type") == "file" and (
                    keep is None or keep(path[len(inner) + 1:])):
                found.append((path[len(inner) + 1:], (fs.unstrip_protocol(path),
                                                       int(info.get("size") or 0),
                                                       _tag(info))))
    return sorted(found, key=lambda item: item[0].rpartition("/")[::2])


def list_dirs(root: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The names of the folders directly in ``root``, sorted."""
    local = _local(root)
    if local is not None:
        with os.scandir(os.path.abspath(local)) as entries:
            return sorted(e.name for e in entries if e.is_dir())
    fs, inner = _filesystem(root, storage_options)
    inner = inner.rstrip("/")
    listed = retrying(lambda: fs.ls(inner, detail=True), root, "list")
    return sorted(info["name"].rstrip("/").rpartition("/")[2] for info in listed
                  if info.get("type") == "directory")


def open_file(path: str, storage_options: dict[str, Any] | None = None,
              size: int | None = None) -> BinaryIO:
    """Open a file or URL for streaming binary reads: at most ``READ_BLOCK_BYTES`` are
    fetched ahead, never the whole file. A URL's reads are retried (reopening at the same
    offset) on transient errors. ``size``, when known (a :data:`FileRef`'s), spares object
    storage the request that would ask for it.

    Raises:
        StorageError: it cannot be opened or read; the message names it.
    """
    local = _local(path)
    if local is not None:
        try:
            return open(local, "rb", buffering=READ_BLOCK_BYTES)
        except OSError as exc:
            raise StorageError(f"cannot open {path}: {exc.strerror or exc}") from exc
    fs, inner = _filesystem(path, storage_options)

    def opener() -> Any:
        if size is not None:
            try:
                return fs.open(inner, "rb", block_size=READ_BLOCK_BYTES,
                               cache_type="readahead", size=size)
            except TypeError:  # a filesystem whose files take no size: it asks itself
                pass
        return fs.open(inner, "rb", block_size=READ_BLOCK_BYTES, cache_type="readahead")

    return io.BufferedReader(RetryingFile(opener, path), buffer_size=READ_BLOCK_BYTES)


class RetryingFile(io.RawIOBase):
    """A raw binary stream over ``opener()``'s file that reopens it and seeks back to where
    it was when a read fails transiently (a dropped connection, a 5xx)."""

    def __init__(self, opener: Callable[[], Any], url: str) -> None:
        super().__init__()
        self._opener = opener
        self.url = url
        self._position = 0
        self._file: Any = retrying(opener, url, "open")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._position = retrying(lambda: self._file.seek(offset, whence), self.url, "seek")
        return self._position

    def readinto(self, buffer: Any) -> int:
        with waiting(f"{self.url} at offset {self._position}", "read"):
            return self._readinto(buffer)

    def _readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        for attempt in range(STORAGE_RETRIES):
            try:
                if self._file is None:  # the last attempt failed: reopen where it was
                    self._file = self._opener()
                    self._file.seek(self._position)
                data = self._file.read(len(view))
                view[:len(data)] = data
                self._position += len(data)
                return len(data)
            except BaseException as exc:
                if _permanent(exc):
                    raise StorageError(f"cannot read {self.url} at offset {self._position}: "
                                       f"{type(exc).__name__}: {exc}") from exc
                if attempt + 1 == STORAGE_RETRIES:
                    raise StorageError(f"cannot read {self.url} at offset {self._position} "
                                       f"after {STORAGE_RETRIES} attempts: "
                                       f"{type(exc).__name__}: {exc}") from exc
                self._discard()
                time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _discard(self) -> None:
        broken, self._file = self._file, None
        if broken is not None:
            with contextlib.suppress(Exception):  # a broken file's close may fail too
                broken.close()

    def close(self) -> None:
        if not self.closed:
            try:
                self._discard()
            finally:
                super().close()
