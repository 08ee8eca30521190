"""The Loader's I/O thread: the driver of a consumer's loop (loop.py).

The loop (:class:`~zloader.client.loop.ConsumerLoop`) owns the consumer's sockets and
state; this module decides which thread steps it. **The turn** (turn.py): one step runs
under a lock, and whoever holds it owns the sockets. The iterating thread steps the loop
itself while it waits for data (:meth:`IOThread.take`), so that a record wakes one thread,
not two; the I/O thread steps it otherwise: it reads ahead while the trainer computes,
sends heartbeats and acks, and runs the loop before the first epoch and after the last.
The iterating thread's requests go to the loop as typed commands
(:data:`~zloader.client.items.Command`), its items come back typed
(:data:`~zloader.client.items.Item`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

from zloader._defaults import POLL_MS
from zloader.client.items import (
    DispatchDone,
    DispatchItems,
    Failed,
    GiveCredit,
    Item,
    SetWeights,
    StartEpoch,
)
from zloader.client.loop import ConsumerLoop
from zloader.client.peers import Peer
from zloader.client.session import EpochInput
from zloader.client.stats import Stats
from zloader.client.turn import Turn

__all__ = ["IOThread"]

log = logging.getLogger("zloader.loader")


class IOThread(threading.Thread):
    """The thread that steps a consumer's :class:`ConsumerLoop` whenever the iterating
    thread does not. Its arguments are the loop's."""

    def __init__(self, address: str, blob: bytes, **arguments: Any) -> None:
        super().__init__(name="zloader-loader-io", daemon=True)
        self.loop = ConsumerLoop(address, blob, **arguments)
        self.settings = self.loop.settings
        self.stats: Stats = self.loop.stats
        self.items: queue.Queue[Item] = self.loop.items
        self.failure: BaseException | None = None  # what stopped the thread, if anything
        self._halt = threading.Event()
        # credits given back since the last wake-up, by worker (and mix input)
        self._unsent: dict[tuple[str, int | None], int] = {}
        self._turn = Turn()  # who steps the loop (see the module's docstring)

    # --- called from the iterating thread -------------------------------------------------

    def start_epoch(self, epoch: int, epoch_input: EpochInput) -> None:
        """Open ``epoch`` on every worker, with ``epoch_input`` (its codec frames)."""
        self.loop.submit(StartEpoch(epoch, epoch_input))

    def set_weights(self, weights: tuple[float, ...], stamp: float) -> None:
        """A mix's weights from now on (set at ``stamp``), on every worker."""
        self.loop.submit(SetWeights(weights, stamp))

    def dispatch(self, worker: int, items: tuple[int, ...], keep: bool = False) -> None:
        """Work items for the worker of index ``worker`` (none: no more), sent at once;
        ``keep``: kept until done, and sent again if lost."""
        self.loop.submit(DispatchItems(worker, items, keep))

    def dispatch_done(self, worker: int, count: int) -> None:
        """The next ``count`` items kept for ``worker`` are done (no wake-up: the loop
        forgets them at its next step)."""
        self.loop.submit(DispatchDone(worker, count), wake=False)

    def credit(self, worker: str, credits: int = 1, part: int | None = None) -> None:
        """Give ``worker`` back the credits of ``credits`` records used. The loop is woken
        only once a CREDIT is due (half the prefetch the memory budget allows, as
        :meth:`Peers.credit` sends them):
        fewer credits wait for its next poll (POLL_MS), or the next message it handles."""
        owed = self._unsent.get((worker, part), 0) + credits
        due = owed >= self.loop.budget.credit_batch
        # (lent: the iterating thread sends it as it steps)
        self.loop.submit(GiveCredit(worker, credits, part),
                         wake=due and not self._turn.lent())
        self._unsent[(worker, part)] = 0 if due else owed

    def wait_answered(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the broker's first answer (or a failure)."""
        return self.loop.answered.wait(timeout)

    def failed_waiting(self) -> Failed | None:
        """The first error item waiting in the queue (a refusal), left there, or None."""
        with self.items.mutex:  # (the queue's own lock: its deque is read, not taken)
            return next((item for item in self.items.queue if isinstance(item, Failed)), None)

    def take(self, timeout: float) -> Item | None:
        """The next item, or None when none came within ``timeout`` seconds. With none
        waiting, the calling thread borrows the turn and steps the loop itself until one
        comes (see the module's docstring); a failure of the loop there stops the I/O
        thread and comes back as an error item, as it would from the I/O thread."""
        with contextlib.suppress(queue.Empty):
            return self.items.get_nowait()
        deadline = time.monotonic() + timeout
        with self._turn.lent_to_reader(deadline, self.loop.wake) as had:
            stepped = had and self._step_until(deadline)
        return self._get(0.0 if stepped else max(0.0, deadline - time.monotonic()))

    def _step_until(self, deadline: float) -> bool:
        """Step the loop (the turn held) until an item waits or ``deadline`` passes.
        False when it could not: the sockets not made yet or closed, or the loop failed
        (its error item waits)."""
        try:
            while self.loop.running and not self._halt.is_set():
                self.loop.step(max(0, min(POLL_MS,
                                          int((deadline - time.monotonic()) * 1000))))
                if not self.items.empty() or time.monotonic() >= deadline:
                    return True
            return False
        except Exception as exc:  # (KeyboardInterrupt and the like propagate)
            self._failed(exc)
            return False

    def _get(self, timeout: float) -> Item | None:
        try:
            return self.items.get(timeout=timeout) if timeout > 0 else self.items.get_nowait()
        except queue.Empty:
            return None

    @property
    def registration(self) -> dict[str, Any]:
        """The body of this consumer's REGISTER (its ``consumer`` id, ``source_data``)."""
        return self.loop.registration

    @property
    def halted(self) -> bool:
        """Whether :meth:`close` was called (or the loop failed)."""
        return self._halt.is_set()

    @property
    def job(self) -> str | None:
        """The job's id, once the broker has answered (None again when it forgot it)."""
        return self.loop.job

    def peers(self) -> list[Peer]:
        """The workers that serve the job now, as this consumer sees them."""
        return self.loop.peers()

    def stall_reason(self, silent: float) -> str:
        """Why no data came for ``silent`` seconds, as far as this consumer can tell."""
        return self.loop.stall_reason(silent)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (the loop tells the workers and the broker) and wait for it."""
        self._halt.set()
        self.loop.wake()
        self._turn.stop()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)
        if not self.is_alive():
            self.loop.close_pipe()  # its fds go now, not when this object is collected
            self.loop.drop_items()

    # --- the thread -----------------------------------------------------------------------

    def run(self) -> None:
        try:
            with self._turn.held():
                self.loop.open()
            self._loop()
        except BaseException as exc:
            self._failed(exc)
        finally:
            # (an iterating thread in take() sees the halt at its next step and leaves)
            with self._turn.held():
                self.loop.close()

    def _failed(self, exc: BaseException) -> None:
        """The loop failed (a bug): stop, and hand the iterating thread the error."""
        self.failure = exc
        log.error("the Loader's I/O thread failed", exc_info=exc)
        self._halt.set()
        self.loop.wake()
        self.loop.put(Failed(exc))

    def _loop(self) -> None:
        """Step the loop whenever the iterating thread does not (see the docstring)."""
        while not self._halt.is_set():
            if not self._turn.take_for_io():
                continue
            try:
                self.loop.step(POLL_MS)
            finally:
                self._turn.release()
