"""The iterating thread's side of a consumer: it takes the I/O thread's items and yields
an epoch's elements across the job's workers, in arrival order or (deterministic) one
from each worker in index order, giving each record's credit back once yielded; it
bounds every wait by the Loader's timeout."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from zloader._defaults import LOST_GRACE_SECONDS, POLL_SECONDS
from zloader.client.draw import Inputs
from zloader.client.exactly_once import Yielded
from zloader.client.items import Data, Done, End, Failed, Item
from zloader.client.session import encoded
from zloader.client.thread import IOThread
from zloader.errors import PipelineError, Timeout

__all__ = ["Merger"]


class Merger:
    """Yields the elements of the epochs of one I/O thread's consumer.

    ``deaths`` says which of the Loader's own worker processes died (added to a timeout's
    message); ``lost`` raises :class:`WorkerExited` when the epoch cannot complete without
    them; ``max_skipped`` bounds the elements workers may drop (``on_error="skip"``);
    ``resume`` is what a resumed state had delivered (:func:`resume_from`).
    """

    def __init__(self, io: IOThread, *, timeout: float, deterministic: bool,
                 max_skipped: int | None, deaths: Callable[[], str],
                 lost: Callable[[], None] = lambda: None,
                 resume: dict[str, Any] | None = None) -> None:
        self.io = io
        self.timeout = timeout
        self.deterministic = deterministic
        self.max_skipped = max_skipped
        self.deaths = deaths
        self.lost = lost
        self.elements = 0  # yielded, all epochs
        self.wait = 0.0  # seconds spent waiting for data, all epochs
        self.yielded = Yielded(resume)  # the origins yielded of the epoch under way
        self._reading: int | None = None  # the epoch of the live iterator
        self._pid = os.getpid()  # the process whose I/O thread feeds this merger

    def epoch(self, epoch: int, epoch_input: Any) -> Iterator[Any]:
        """Start ``epoch`` on the workers, handing them ``epoch_input`` (a codec element,
        a :class:`~zloader.client.session.PerWorker` of them, or None), and return its
        elements. An older iterator of this merger raises from
        then on.

        Raises:
            CodecError: the codec cannot carry ``epoch_input``.
        """
        # One iterator at a time: this one ends any older one (which raises if used again)
        # instead of both taking each other's records.
        self._reading = epoch
        self.yielded.begin(epoch)
        self.io.start_epoch(epoch, encoded(epoch_input))
        return self._round_robin(epoch) if self.deterministic else self._merged(epoch)

    def inputs(self, epoch: int, epoch_input: Any, parts: int, track: bool,
               skip: list[int] | None = None) -> Inputs:
        """Start ``epoch`` as :meth:`epoch` does, for records by part (zloader/plan.py):
        the ``parts`` inputs of a mix this consumer draws (``track``: exactly-once), or
        a deterministic job's shards (``skip``: each one's elements to drop, yielded
        before a resume) (zloader/client/draw.py)."""
        self._reading = epoch
        self.yielded.begin(epoch)
        self.io.start_epoch(epoch, encoded(epoch_input))
        inputs = Inputs(self, epoch, parts, track, skip)
        handles = inputs.handles
        self.yielded.partial = handles.note_partial if handles is not None else None
        return inputs

    def job_epoch(self) -> int:
        """Wait for the broker's first answer (bounded by the timeout) and return the
        job's epoch then.

        Raises:
            ZloaderError: the broker refused the job, or its workers failed to start.
            Timeout: no answer within the timeout.
        """
        while not self.io.wait_answered(POLL_SECONDS):
            self.check_progress()
        failed = self.io.failed_waiting()
        if failed is not None:
            raise failed.error
        epoch = self.io.stats.job_epoch
        assert epoch is not None  # (the loop sets answered once it is known)
        return epoch

    def _merged(self, epoch: int) -> Iterator[Any]:
        """Elements of ``epoch`` from every worker, in arrival order."""
        while True:
            item = self.next_item(epoch)
            if isinstance(item, Done):
                self.yielded.done(epoch)  # all of it yielded
                return
            if isinstance(item, Data):
                self.yielded.record(item.origins, self.elements)
                for element in item.elements:
                    self.elements += 1
                    yield element
                self.io.credit(item.worker, 1)
                self.check_skipped()
            if isinstance(item, (Data, End)):
                self.yielded.recorded(item.origins, epoch)

    def _round_robin(self, epoch: int) -> Iterator[Any]:
        """Elements of ``epoch``, one from each worker in index order (deterministic)."""
        pending: dict[int, deque[Any]] = {}
        ended: set[int] = set()
        done = False
        turn = 0  # the worker index whose element comes next
        stats = self.io.stats
        since = time.monotonic()  # when the wait for the next element in order began
        while True:
            # Every index up to the job's width takes part, known yet or not.
            order = sorted(set(range(stats.width)) | set(stats.indices) | set(pending))
            chosen: int | None = None
            blocked = False
            start = _first_at_least(order, turn)
            for index in order[start:] + order[:start]:
                if pending.get(index):
                    chosen = index
                    break
                if index not in ended and not done:
                    blocked = True  # its next element decides the order: wait for it
                    break
            if chosen is not None:
                turn = chosen + 1
                self.elements += 1
                yield pending[chosen].popleft()
                since = time.monotonic()
                continue
            if done and not blocked:
                return
            # Others' records do not count as progress: the element due may still be late.
            item = self.next_item(epoch, since)
            if isinstance(item, Data):
                pending.setdefault(item.index, deque()).extend(item.elements)
                self.io.credit(item.worker, 1)
                self.check_skipped()
            elif isinstance(item, End):
                ended.add(item.index)
            elif isinstance(item, Done):
                done = True

    def next_item(self, epoch: int, since: float | None = None,
                   once: bool = False) -> Item | None:
        """The next item of ``epoch`` from the I/O thread. The timeout counts from the
        last data of any worker, or from ``since`` when given (the element due in order).
        ``once``: None when none came within one poll (the caller looks again at what it
        waits for: the workers serving the job may have changed)."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this Loader's iterator was made in process {self._pid} and cannot be "
                f"used in process {os.getpid()} (a forked child): its I/O thread stays with "
                "that process; make a new Loader in this process")
        if epoch != self._reading:
            raise RuntimeError(
                f"this iterator's epoch {epoch} was left: iter() started epoch "
                f"{self._reading} on the same Loader (one iterator at a time; a new iter() "
                "ends the previous one, whose elements not yet yielded are dropped)")
        stats = self.io.stats
        start = time.monotonic()
        try:
            while True:
                item = self.io.take(POLL_SECONDS)
                if item is None:
                    # The wait under way counts now: a consumer that nothing serves must
                    # show as starved while it waits, not once an element comes.
                    stats.wait_seconds = self.wait + time.monotonic() - start
                    self.check_progress(since)
                    if once:
                        return None
                    continue
                if isinstance(item, Failed):
                    deaths = self.deaths() if isinstance(item.error, Timeout) else ""
                    if deaths:
                        raise Timeout(f"{item.error} ({deaths})") from None
                    raise item.error
                if item.epoch == epoch:
                    return item
                if isinstance(item, Data):  # a record of an epoch left early: its credit
                    self.io.credit(item.worker, 1, item.part)
        finally:
            self.wait += time.monotonic() - start
            stats.wait_seconds, stats.yielded = self.wait, self.elements

    def check_progress(self, since: float | None = None) -> None:
        """Raise when the I/O thread stopped, a worker the epoch needs died, or no data
        came for the timeout (since the last data, or since ``since``).

        Raises:
            RuntimeError: the I/O thread failed.
            WorkerExited: one of the Loader's own workers died and the epoch cannot
                complete without it.
            Timeout: no data for ``timeout`` seconds, saying why as far as known.
        """
        io = self.io
        if not io.is_alive():
            if io.failure is None and io.halted:
                raise RuntimeError("the Loader was closed while this iterator waited for "
                                   "data")
            raise RuntimeError(f"the Loader's I/O thread stopped: {io.failure!r}")
        silent = time.monotonic() - (since if since is not None else io.stats.last_progress)
        if silent > LOST_GRACE_SECONDS:  # what a dead worker sent comes first
            self.lost()
        if silent > self.timeout:
            deaths = self.deaths()
            raise Timeout(io.stall_reason(silent) + (f" ({deaths})" if deaths else ""))

    def check_skipped(self) -> None:
        skipped = self.io.stats.skipped
        if self.max_skipped is not None and skipped > self.max_skipped:
            raise PipelineError.create(
                "loader", "RuntimeError",
                f"{skipped} elements were skipped (on_error='skip'), more than "
                f"max_skipped={self.max_skipped}", builtin="RuntimeError")


def _first_at_least(order: list[int], turn: int) -> int:
    return next((i for i, index in enumerate(order) if index >= turn), 0)
