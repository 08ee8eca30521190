"""An epoch's dispatched work items: what a consumer hands a worker during the epoch
(``DISPATCH``) for a source whose elements are made as the consumer asks for them
(``Source.dispatched``: the torch drop-in's ``in_order=False``, where each batch goes to
whichever worker has room). The worker's socket thread puts them in; the producer's
pipeline takes them, waiting while there are none."""

from __future__ import annotations

import threading
from collections import deque

from zloader._defaults import DISPATCH_WAIT, MAX_DISPATCHED
from zloader.transport.protocol import ProtocolError

__all__ = ["Dispatched"]


class Dispatched:
    """One epoch's work items, in the order they came; an empty ``DISPATCH`` says none
    will follow. At most ``MAX_DISPATCHED`` wait at once (a consumer that sends more is
    refused: it dispatches far ahead of what the worker makes)."""

    def __init__(self) -> None:
        self._items: deque[int] = deque()
        self._ended = False
        self._ready = threading.Condition()

    def put(self, items: tuple[int, ...]) -> None:
        """Items from a consumer (none: the last were sent).

        Raises:
            ProtocolError: more would wait than ``MAX_DISPATCHED``.
        """
        with self._ready:
            if len(self._items) + len(items) > MAX_DISPATCHED:
                raise ProtocolError(f"DISPATCH: more than {MAX_DISPATCHED} work items "
                                    "would wait for the worker")
            if items:
                self._items.extend(items)
            else:
                self._ended = True
            self._ready.notify()

    def wake(self) -> None:
        """Wake a producer waiting for items (it is being stopped: it looks at its stop
        event now, not after ``DISPATCH_WAIT``)."""
        with self._ready:
            self._ready.notify_all()

    def take(self, stop: threading.Event) -> int | None:
        """The next item, waiting for one; None once the consumer said none will follow
        and all were taken, or when ``stop`` is set (the producer is stopped)."""
        with self._ready:
            while not self._items:
                if self._ended or stop.is_set():
                    return None
                self._ready.wait(DISPATCH_WAIT)
            return self._items.popleft()

    def take_many(self, count: int, stop: threading.Event) -> list[int]:
        """The next ``count`` items, waiting for them; fewer once the consumer said none
        will follow and all were taken, or when ``stop`` is set."""
        taken: list[int] = []
        with self._ready:
            while len(taken) < count:
                items = self._items
                if not items:
                    if self._ended or stop.is_set():
                        break
                    self._ready.wait(DISPATCH_WAIT)
                    continue
                want = min(count - len(taken), len(items))
                taken.extend(items.popleft() for _ in range(want))
        return taken
