"""Shared delivery: how a worker serves a shared job (docs/sharing.md).

Every record the producer makes enters the job's :class:`~zloader.sharing.window.Window`
(as its lag policy allows), stored once (:mod:`zloader.sharing.store`); each trainer's
cursor sends it the records it has credits for. A trainer that joins an epoch under way
is first sent the rest of the epoch from the window, then what it missed, made again for
it alone by a replay producer that reads the splits this worker read the first time. The
producer makes as many records as the readiest trainer can take; a replay as many as its
trainer can.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from zloader import codec
from zloader.sharing.store import Stored, store
from zloader.sharing.window import Window, WindowSettings
from zloader.transport.messages import Data, End, Open
from zloader.worker.credit import clamp
from zloader.worker.delivery import Delivery, EpochEnd, Pending, RecordOut, TaskPort
from zloader.worker.permits import Pool
from zloader.worker.producer import Outgoing, Producer
from zloader.worker.streams import Stream

__all__ = ["SharedDelivery"]


class SharedDelivery(Delivery):
    """A shared job's delivery (see the module's docstring)."""

    def __init__(self, port: TaskPort, share: WindowSettings) -> None:
        super().__init__(port)
        self.window = Window(share.window_bytes, share.lag, share.block_seconds)
        self.stored: dict[str, Stored] = {}  # each record's memory, by segment name
        # The splits read per epoch and pass, in order, to make a late joiner's missed
        # elements again, and the replays to run: (trainer, epoch, elements missed).
        self.splits: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self.replays: deque[tuple[bytes, int, int]] = deque()
        self.replayer: Producer | None = None
        self.replaying: tuple[bytes, int] | None = None  # (trainer, elements sent so far)
        self.replay_pending: deque[Pending] = deque()
        self.replay_outstanding = 0

    # --- trainers -------------------------------------------------------------------------

    def open(self, stream: Stream, opened: Open) -> None:
        """A trainer starts (or re-opens) an epoch: place its cursor in the window; what
        it missed of an epoch under way is made again for it (a replay)."""
        port, epoch, credits = self.port, opened.epoch, opened.credits
        cursor = self.window.cursors.get(stream.identity)
        if cursor is None or cursor.epoch != epoch:
            finished = epoch in port.finished and epoch != port.producing
            cursor = self.window.join(stream.identity, epoch,
                                      epoch == port.producing or finished, finished)
            if cursor.missed > 0:
                self.replays.append((stream.identity, epoch, cursor.missed))
        elif cursor.done:
            port.outlet.send(stream, End(epoch=epoch, lagged=cursor.lagged))
        stream.epoch = epoch
        cursor.credits = clamp(credits)
        port.abandon_stale()  # every trainer left the epoch being produced
        port.maybe_produce()
        self.deliver()

    def credit(self, stream: Stream, credits: int, part: int | None = None) -> None:
        cursor = self.window.cursors.get(stream.identity)  # production follows the window
        if cursor is not None:
            cursor.credits += clamp(credits)

    def withdraw(self, stream: Stream) -> None:
        stream.credits = 0

    def leave(self, stream: Stream) -> None:
        self.window.leave(stream.identity)
        for stored in list(self.stored.values()):
            stored.holders.discard(stream.identity)
            self._release(stored)
        if self.replaying is not None and self.replaying[0] == stream.identity:
            self._stop_replay()
        self.replays = deque(r for r in self.replays if r[0] != stream.identity)
        if not self.window.cursors:  # the last trainer left: free the window's memory
            self._evicted(self.window.clear())
        self.withdraw(stream)

    def mapped(self, stream: Stream, names: list[Any]) -> None:
        for name in names:
            stored = self.stored.get(name) if isinstance(name, str) else None
            if stored is not None:
                stored.holders.discard(stream.identity)
                self._release(stored)

    # --- records --------------------------------------------------------------------------

    def on_record(self, producer: Producer, epoch: int, outgoing: Outgoing,
                  head: dict[str, Any]) -> None:
        if producer is not self.replayer:
            super().on_record(producer, epoch, outgoing, head)
            return
        self.replay_outstanding = max(0, self.replay_outstanding - 1)
        self.replay_pending.append(RecordOut(epoch, outgoing, head))
        self.deliver()

    def on_end(self, producer: Producer, body: dict[str, Any]) -> None:
        if producer is not self.replayer:
            super().on_end(producer, body)
            return
        self.replay_pending.append(EpochEnd.of(body))
        self.deliver()

    def deliver(self) -> None:
        """Admit produced records into the window (as the lag policy allows), send a
        replay's records to its trainer, then send every trainer what it may take."""
        port = self.port
        now = time.monotonic()
        while self.pending:
            item = self.pending[0]
            epoch = item.epoch
            if isinstance(item, EpochEnd):
                self.pending.popleft()
                self.window.add(epoch, 0, 0, end=True, skipped=item.skipped)
                port.finish_epoch(epoch)
                continue
            outgoing, head = item.outgoing, item.head
            if epoch in port.finished:  # an abandoned epoch's leftovers
                self.pending.popleft()
                outgoing.mark_taken()
                continue
            nbytes = sum(codec.nbytes(b) for b in outgoing.buffers)
            admitted, gone = self.window.room(nbytes, now)
            self._evicted(gone)
            if not admitted:
                break  # "block": retried from the loop until the lagging trainer moves
            stored = store(outgoing.buffers)
            outgoing.mark_taken()
            self.pending.popleft()
            self.window.add(epoch, int(head["count"]), nbytes, stored,
                            skipped=int(head.get("skipped", 0)))
            if stored.name is not None:
                self.stored[stored.name] = stored
        self._fan_out()
        self.permit()

    def _fan_out(self) -> None:
        port, window = self.port, self.window
        for stream in list(port.streams.values()):
            cursor = window.cursors.get(stream.identity)
            if cursor is None or cursor.done or cursor.replaying:
                continue
            while cursor.credits > 0 or cursor.end is not None:
                entry = cursor.end or window.next_for(cursor)
                if entry is None:
                    break
                cursor.end = None
                cursor.seq = max(cursor.seq, entry.seq + 1)
                if entry.end:
                    if cursor.missed > 0:
                        cursor.replaying = True  # its replay's records go out now
                    else:
                        cursor.done = True
                        port.outlet.send(stream, End(epoch=entry.epoch,
                                                     skipped=entry.skipped,
                                                     lagged=cursor.lagged))
                    break
                cursor.credits -= 1
                self._send_stored(stream, entry.epoch, entry.count, entry.skipped,
                                  entry.data, cursor.lagged)
        while self.replaying is not None and self.replay_pending and self._send_replay():
            pass

    def _send_stored(self, stream: Stream, epoch: int, count: int, skipped: int,
                     stored: Stored, lagged: int) -> None:
        outlet = self.port.outlet
        outlet.count(count, stored.length)
        if stream.ring is not None and stored.segment is not None:  # co-located
            stored.holders.add(stream.identity)
            outlet.send(stream, Data(epoch=epoch, count=count, skipped=skipped, ring=None,
                                     lagged=lagged, segment=(stored.segment.name, stored.length),
                                     shared=True))
        else:
            outlet.send(stream, Data(epoch=epoch, count=count, skipped=skipped, ring=None,
                                     lagged=lagged), stored.frames)

    def _send_replay(self) -> bool:
        """Send the replay's next record (or its end) to its trainer, once the trainer has
        reached the end of the epoch in the window; False: not yet."""
        port = self.port
        item = self.replay_pending[0]
        epoch = item.epoch
        trainer, sent = self.replaying or (b"", 0)
        stream = port.streams.get(trainer)
        cursor = self.window.cursors.get(trainer)
        if stream is None or cursor is None:
            self._stop_replay()
            return False
        if not cursor.replaying:
            return False
        if isinstance(item, EpochEnd):
            self.replay_pending.popleft()
            cursor.lagged += max(0, cursor.missed - sent)  # splits no longer on record
            cursor.done, cursor.replaying, cursor.missed = True, False, 0
            port.outlet.send(stream, End(epoch=epoch, skipped=item.skipped,
                                         lagged=cursor.lagged, replayed=sent))
            self._stop_replay()
            port.maybe_produce()
            return False
        if cursor.credits <= 0:
            return False
        outgoing, head = item.outgoing, item.head
        self.replay_pending.popleft()
        cursor.credits -= 1
        self.replaying = (trainer, sent + int(head["count"]))
        port.outlet.record(stream, epoch, outgoing.buffers, head)
        outgoing.mark_taken()
        return True

    # --- production -----------------------------------------------------------------------

    def new_epoch(self, epoch: int) -> dict[tuple[int, ...], list[int]]:
        while self.pool.acquire(blocking=False):  # permits start afresh (see permit)
            pass
        self.outstanding = 0
        for old in [e for e in self.splits if e < epoch - 2]:
            del self.splits[old]
        return self.splits.setdefault(epoch, {})

    def start_side(self) -> None:
        """A late joiner waits for what it missed: make it again, if no replay runs."""
        if self.replayer is not None:
            return
        while self.replays:
            trainer, epoch, missed = self.replays.popleft()
            if trainer in self.port.streams:
                self.replaying = (trainer, 0)
                self.replay_outstanding = 0
                self.replayer = self.port.start_producer(
                    epoch, Pool(), splits=self.splits.setdefault(epoch, {}),
                    replay=missed)
                self.permit()
                break

    def _stop_replay(self) -> None:
        if self.replayer is not None:
            self.port.drop_producer(self.replayer)
        self.replayer, self.replaying = None, None
        for item in self.replay_pending:
            if isinstance(item, RecordOut):
                item.outgoing.mark_taken()
        self.replay_pending.clear()

    def permit(self) -> None:
        """Let the producers make as many records as trainers can take now: the task's
        as far as the readiest trainer, a replay as far as its trainer."""
        port = self.port
        if self.replayer is not None and self.replaying is not None:
            cursor = self.window.cursors.get(self.replaying[0])
            lead = cursor.credits if cursor is not None else 0
            for _ in range(lead - len(self.replay_pending) - self.replay_outstanding):
                self.replay_outstanding += 1
                self.replayer.pool.release()
        if port.producer is not None and port.producing is not None:
            for _ in range(self.window.lead(port.producing) - len(self.pending)
                           - self.outstanding):
                self.outstanding += 1
                port.producer.pool.release()

    def side_producers(self) -> list[Producer]:
        return [self.replayer] if self.replayer is not None else []

    def busy(self) -> bool:
        """Records not sent yet, to the window or from it to a trainer that lags behind
        (a worker that drains waits for them: the splits they came from are done, and
        nobody would read them again), or a late trainer's replay to run or under way."""
        return (super().busy() or self.window.unsent() or bool(self.replays)
                or self.replayer is not None or bool(self.replay_pending))

    # --- memory ---------------------------------------------------------------------------

    def _evicted(self, gone: list[Any]) -> None:
        for entry in gone:
            stored = entry.data
            if isinstance(stored, Stored):
                stored.evicted = True
                self._release(stored)

    def _release(self, stored: Stored) -> None:
        if stored.releasable:
            if stored.name is not None:
                self.stored.pop(stored.name, None)
            stored.free()

    # --- the worker's loop ----------------------------------------------------------------

    def poll(self) -> None:
        if self.pending:
            self.deliver()  # a record blocked by a lagging trainer: look again

    def stats(self) -> dict[str, Any]:
        """Each trainer's lag (elements produced here that it has not been sent yet) and
        the elements it lost to the lag policy, for ``zloader status``."""
        out = {}
        for identity, cursor in self.window.cursors.items():
            stream = self.port.streams.get(identity)
            if stream is not None:
                lag = sum(e.count for e in self.window.entries if e.seq >= cursor.seq)
                out[stream.consumer] = {"lag": lag, "skipped": cursor.lagged}
        return {"trainers": out}

    def close(self) -> None:
        for stored in self.stored.values():
            stored.free()
        self.stored.clear()
