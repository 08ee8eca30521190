"""Pipeline blobs that workers fetch from the Loader that registered them.

A pipeline whose pickled form is large (a map-style dataset holding a million file paths)
does not pass through the broker: the Loader serves it from its source socket and
registers only its SHA-256 digest and size (docs/protocol.md, FETCH). A worker fetches it
when a task needs it, checks the digest the broker gave, and keeps it:

- in memory, the last few by digest, so a worker given the same job again (the next
  epoch's task, a job it left and rejoins) does not fetch it again;
- in a directory of the host, when its supervisor (``zloader-worker --processes N`` or
  ``--autoscale``) made one: the first worker process of the host fetches, the others wait
  on a file lock and read the file, so a host fetches one fingerprint's blob once.

The directory is private (mode 0700, made by the supervisor, removed when it exits), its
files 0600, and every read is checked against the digest, so a file that changed on disk is
fetched again, never run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections import OrderedDict
from collections.abc import Callable

from zloader._defaults import DISK_ENTRIES, MEMORY_ENTRIES
from zloader._hash import sha256

__all__ = ["BlobCache", "BlobError", "digest_of"]

_DIGEST = re.compile(r"[0-9a-f]{64}")


class BlobError(Exception):
    """A fetched blob does not match its digest, or its description is malformed."""


def digest_of(blob: bytes | memoryview) -> str:
    return sha256(blob).hexdigest()


class BlobCache:
    """Blobs by SHA-256 digest, in memory and optionally in a host directory.

    Args:
        directory: a private directory shared by the worker processes of this host, or
            None (memory only).
    """

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self.fetches = 0  # how many times this process called ``fetch``

    def get(self, digest: str, size: int, fetch: Callable[[], bytes]) -> bytes:
        """The blob with ``digest`` (``size`` bytes), calling ``fetch`` only if neither
        this process nor (with a directory) another worker of the host has it.

        Raises:
            BlobError: ``digest`` is not a SHA-256 hex digest, or what ``fetch`` returned
                does not match it.
        """
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise BlobError(f"not a SHA-256 hex digest: {digest!r}")
        blob = self._memory.get(digest)
        if blob is None:
            blob = self._from_host(digest, size, fetch) if self.directory else \
                self._fetch(digest, size, fetch)
        self._memory[digest] = blob
        self._memory.move_to_end(digest)
        while len(self._memory) > MEMORY_ENTRIES:
            self._memory.popitem(last=False)
        return blob

    def _fetch(self, digest: str, size: int, fetch: Callable[[], bytes]) -> bytes:
        self.fetches += 1
        blob = bytes(fetch())
        if len(blob) != size or digest_of(blob) != digest:
            raise BlobError(f"the blob fetched ({len(blob)} bytes) does not match the digest "
                            f"and size ({size} bytes) its Loader registered with the broker")
        return blob

    def _from_host(self, digest: str, size: int, fetch: Callable[[], bytes]) -> bytes:
        assert self.directory is not None
        path = os.path.join(self.directory, digest)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one process of the host fetches; others wait
            blob = _read(path)
            if blob is not None and len(blob) == size and digest_of(blob) == digest:
                return blob
            blob = self._fetch(digest, size, fetch)
            _write(path, blob)
            self._trim(keep=digest)
            return blob
        finally:
            os.close(fd)

    def _trim(self, keep: str) -> None:
        """Remove the oldest blobs beyond DISK_ENTRIES (never ``keep``)."""
        directory = self.directory
        assert directory is not None
        try:
            names = [n for n in os.listdir(directory) if _DIGEST.fullmatch(n)]
            dated = sorted(names, key=lambda n: os.stat(os.path.join(directory, n))
                           .st_mtime_ns)
        except OSError:
            return
        for name in dated[:max(0, len(dated) - DISK_ENTRIES)]:
            if name != keep:
                for suffix in ("", ".lock"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(directory, name + suffix))


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return None


def _write(path: str, blob: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(blob)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk: the blob is still used from memory
