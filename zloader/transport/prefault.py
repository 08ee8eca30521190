"""Fault a mapping's pages in on a background thread, ahead of the code that writes them.

The first write to a page of a fresh shared-memory segment costs a page fault, and the
kernel zeroes the page inside it: about 0.4 ms per MiB on the hosts we measured, 28 ms for
a 64 MiB ring, which the ring's writer used to pay all at once (``MAP_POPULATE``) before it
could send its first record. A :class:`Prefaulter` pays it on a thread of its own instead,
at the lowest CPU priority, chunk by chunk from where the writer will write next, so that
the first records go out at once and the later ones find their pages mapped. A page the
writer reaches first simply faults on the data path, as it would without this thread.

``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) faults pages in as writes would, without
changing a byte, so the thread may run over pages the writer is filling. It is called
through ctypes, which lets go of the GIL for the call (Python's ``mmap.madvise`` holds it).
Where the call is missing (an older kernel, no libc), the thread stops at its first chunk
and pages fault in on first write.

Only use it on memory that is reserved (``posix_fallocate``): faulting a page of a full
``/dev/shm`` in would kill the process with SIGBUS.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import os
import threading
from typing import Any

from zloader._defaults import PREFAULT_CHUNK_BYTES, PREFAULT_JOIN_SECONDS

__all__ = ["Prefaulter"]

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only from 3.13 on
LOWEST_PRIORITY = 19


def _madvise() -> Any:
    """libc's madvise, or None where it cannot be called."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # (this process's symbols: libc's among them)
        function = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - no libc (not Linux)
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


class Prefaulter:
    """A daemon thread that faults in ``buf[start:end]``, beginning at ``first`` and
    wrapping around to ``start``, one chunk at a time.

    It keeps the mapping alive while it runs (a buffer export of ``buf``): closing the
    segment meanwhile drops the mapping only once the thread is done with it.
    """

    def __init__(self, buf: memoryview, start: int, end: int, first: int) -> None:
        """Start faulting in.

        Args:
            buf: a writable memoryview of a shared mapping (``Segment.buf``).
            start, end: the byte range to fault in; page-aligned offsets into ``buf``.
            first: where to begin, in ``[start, end)`` (the writer's next write).
        """
        page = os.sysconf("SC_PAGE_SIZE")
        first = max(start, min(end, first)) // page * page
        chunk = max(page, PREFAULT_CHUNK_BYTES // page * page)
        # The ranges in the order the writer reaches them: first..end, then start..first.
        self._ranges = [(first, end), (start, first)]
        self._chunk = chunk
        self._stop = threading.Event()
        self.done = threading.Event()
        self._anchor: Any = None
        if _MADVISE is None or end <= start:
            self.done.set()
            return
        self._anchor = ctypes.c_char.from_buffer(buf)  # pins the mapping, gives its address
        # A bare thread (a daemon's life): ``Thread.start`` would wait until the new thread
        # runs, and the new thread, which lowers its own priority first, could keep the
        # caller (a worker opening a consumer's ring) waiting for the interpreter's lock.
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        try:
            with contextlib.suppress(OSError):  # lowest priority: idle CPUs only
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
            base = ctypes.addressof(self._anchor)
            for low, high in self._ranges:
                for offset in range(low, high, self._chunk):
                    if self._stop.is_set():
                        return
                    length = min(self._chunk, high - offset)
                    if _MADVISE(base + offset, length, MADV_POPULATE_WRITE) != 0:
                        return  # an older kernel (EINVAL), or unmapped: faults on write
        finally:
            self._anchor = None  # lets the mapping go if the segment was closed meanwhile
            self.done.set()

    def close(self) -> None:
        """Stop at the end of the current chunk, waiting for that at most
        PREFAULT_JOIN_SECONDS (a starved thread lets the mapping go when it stops);
        idempotent."""
        self._stop.set()
        self.done.wait(PREFAULT_JOIN_SECONDS)
