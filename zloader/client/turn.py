"""The turn: who steps a consumer's loop now (zloader/client/thread.py).

One step of the loop (heartbeat, commands, one poll of every socket and the messages it
finds) runs under a lock, and whoever holds it owns the consumer's sockets: ZeroMQ sockets
may change threads across a lock. The iterating thread borrows the turn while it waits
for data (:meth:`Turn.lent_to_reader`), so that a record wakes one thread, not two. The
I/O thread keeps away while it is lent and for LEND_SECONDS after it came back
(:meth:`Turn.take_for_io`): a trainer back for its next element within that time finds the
sockets free; one away longer has the I/O thread read ahead for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from zloader._defaults import LEND_SECONDS

__all__ = ["LEND_SECONDS", "Turn"]


class Turn:
    """The lock over one consumer's loop, and when the iterating thread last held it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lent_at = -1.0  # when the iterating thread last gave the turn back
        self._taking = False  # the iterating thread holds it, or waits for it
        self._stopping = threading.Event()  # ends the I/O thread's wait (the loop stops)

    def lent(self) -> bool:
        """Whether the iterating thread steps the loop now, or did just now."""
        return self._taking or time.monotonic() - self._lent_at < LEND_SECONDS

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the turn (the I/O thread's start and shutdown)."""
        with self._lock:
            yield

    @contextlib.contextmanager
    def lent_to_reader(self, deadline: float, wake: Callable[[], None]) -> Iterator[bool]:
        """The iterating thread borrows the turn: yields whether it got it by
        ``deadline`` (``wake`` ends the I/O thread's poll, so that it lets go)."""
        self._taking = True
        try:
            had = self._lock.acquire(blocking=False)
            if not had:
                wake()
                had = self._lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            try:
                yield had
            finally:
                if had:
                    self._lent_at = time.monotonic()
                    self._lock.release()
        finally:
            self._taking = False

    def take_for_io(self) -> bool:
        """The I/O thread's turn: True when it now holds it (let go with
        :meth:`release`); False after waiting while it is lent, or when the iterating
        thread took it just now."""
        left = (LEND_SECONDS if self._taking
                else self._lent_at + LEND_SECONDS - time.monotonic())
        if left > 0:
            self._stopping.wait(left)
            return False
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        """The I/O thread lets go of the turn."""
        self._lock.release()

    def stop(self) -> None:
        """The loop stops: the I/O thread waits no more."""
        self._stopping.set()
