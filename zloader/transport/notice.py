"""Record notices: how a co-located worker tells its consumer that a record is in a ring,
without a ZeroMQ message.

A consumer that reads rings makes one named pipe (a FIFO in ``/dev/shm``, named like a
segment: ``zloader-<uid>-<pid>-notify-<hex>``) and names it in its OPEN, with the ring's
id. A worker that writes a record into that consumer's ring puts the record's DATA body in
the ring too, in front of its buffers (a *framed* record, :func:`frame_size`), and then
writes one 16-byte notice to the pipe: the ring's id, the record's length and position
(:data:`NOTICE`). Writes of 16 bytes to a pipe are atomic, so any number of workers share
it; the consumer wakes on the pipe's descriptor and reads every notice waiting in one
``read``, however many records and workers they come from. The pipe also orders memory:
what the worker wrote before its ``write`` is visible to the consumer after its ``read``
returned the notice, on every architecture.

A record keeps its order among its worker's messages: the notice is written before the
worker sends anything after it, and the consumer reads the pipe before it handles any
message from a worker. A record can still go as a DATA message (a segment, or over the
socket when the ring is full), and a later record's notice can then be read before that
message arrives: so a framed record's body says how many of its epoch's records went to
the consumer as DATA messages before it (``after``), and the consumer holds it back until
that many have come (``Receiver.notice``; after NOTICE_HOLD_SECONDS, or at the worker's
END, it takes what it holds: a message lost on the way must not stop the stream). A notice
that could not be written (the pipe full or gone) goes as a DATA message naming the framed
record in the ring (its ``framed`` flag); since a ring's records are taken in the order
they were written, the rest of that epoch's records to that consumer then go as DATA
messages (``Stream.unnoticed`` in zloader/worker/streams.py).

A notice is checked like any input: an unknown ring id is dropped, and the ring checks
the position and length (:meth:`~zloader.transport.ring.RingReader.claim`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import weakref
from collections.abc import Iterator

from zloader._defaults import NOTICE_READ_BYTES
from zloader.transport.shm import SHM_DIR, check_name, segment_name

__all__ = ["FRAME_HEAD", "NOTICE", "Notices", "frame_size", "open_notify"]

NOTICE = struct.Struct("<IIQ")
"""One notice: ring id, record length, record position (little-endian, 16 bytes)."""

FRAME_HEAD = struct.Struct("<II")
"""A framed record starts with its DATA body's length (and 4 bytes of zeros); the body
follows, then the record's packed buffers at the next multiple of FRAME_ALIGN."""

FRAME_ALIGN = 64
"""Where a framed record's buffers start (as the ring's records: any dtype lines up)."""



def frame_size(body: int, packed: int) -> tuple[int, int]:
    """Where the buffers of a framed record start (its body having ``body`` bytes), and
    its whole length (``packed``: the buffers' packed size)."""
    start = -(-(FRAME_HEAD.size + body) // FRAME_ALIGN) * FRAME_ALIGN
    return start, start + packed


class Notices:
    """The consumer's end: the pipe, made at once and unlinked by :meth:`close`. Its
    descriptor (:attr:`fd`) is polled; :meth:`read` takes every notice waiting."""

    def __init__(self) -> None:
        self.name = segment_name("notify")
        path = os.path.join(SHM_DIR, self.name)
        os.mkfifo(path, 0o600)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            # A writer of its own keeps the pipe from reading as closed (a poll that never
            # waits) between one worker's leaving and the next one's coming.
            self._keep = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._path = path
        # Unlinked at exit too (a trainer stopped by Ctrl-C may not close its Loader), by
        # this process only (a forked child inherits the finalizer).
        self._unlink = weakref.finalize(self, _unlink, path, os.getpid())

    def read(self) -> Iterator[tuple[int, int, int]]:
        """``(ring id, length, position)`` of every notice waiting (none: nothing)."""
        chunks = []
        while True:
            try:
                chunk = os.read(self.fd, NOTICE_READ_BYTES)
            except BlockingIOError:
                break
            chunks.append(chunk)
            if len(chunk) < NOTICE_READ_BYTES:
                break
        if not chunks:
            return iter(())
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        # (writes of NOTICE.size are atomic: what is waiting is whole notices)
        return NOTICE.iter_unpack(data[: len(data) - len(data) % NOTICE.size])

    def close(self) -> None:
        """Close both ends and unlink the pipe (safe twice)."""
        fds, self.fd, self._keep = (self.fd, self._keep), -1, -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._unlink()


def _unlink(path: str, owner: int) -> None:
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            os.unlink(path)


def open_notify(name: str) -> int | None:
    """The worker's end of a consumer's notice pipe called ``name``: a descriptor to write
    notices to, or None when it is not one (a name that is not a zloader segment's, a file
    that is not a pipe, a pipe gone): records then go with a DATA message each."""
    try:
        check_name(name)
    except ValueError:
        return None
    try:
        fd = os.open(os.path.join(SHM_DIR, name),
                     os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        return None
    return fd
