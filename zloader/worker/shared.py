"""Shared delivery: how a worker serves a shared job (docs/sharing.md).

Every record the producer makes enters the job's :class:`~zloader.sharing.window.Window`
(as its lag policy allows), stored once (:mod:`zloader.sharing.store`); each trainer's
cursor sends it the records it has credits for. A trainer that joins an epoch under way
is first sent the rest of the epoch from the window, then what it missed, made again for
it alone by a replay producer that reads the splits this worker read the first time. The
producer makes as many records as the readiest trainer can take; a replay as many as its
trainer can. A worker that drains to move hands the splits it read on to another worker
of the job, which makes them again, whole, for trainers that start those epochs later
(zloader/sharing/handover.py).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from zloader import codec
from zloader.sharing.handover import Had, Segment, Switched, from_wire, to_wire
from zloader.sharing.store import Stored, store
from zloader.sharing.window import Entry, Window, WindowSettings
from zloader.transport.messages import Data, End, Fail, Open
from zloader.worker.credit import clamp
from zloader.worker.delivery import Delivery, EndOut, Pending, TaskPort
from zloader.worker.outgoing import Outgoing
from zloader.worker.permits import Pool
from zloader.worker.producer import Producer
from zloader.worker.streams import Stream

__all__ = ["SharedDelivery"]

log = logging.getLogger("zloader.worker")

WHOLE = sys.maxsize
"""A replay's limit when it makes all its splits make (an adopted segment)."""


@dataclass(eq=False)
class Replay:
    """Elements made again for one trainer: those from ``skip`` (a count, or the places
    of those it had: ``[[start, end], ...]``) to ``limit`` of what those ``splits`` make
    (per pass, in order) through the pipeline of its ``branch``,
    read as worker ``index`` (None: this one); ``segment``: the adopted segment they are
    (None: this worker's own, what the trainer missed). A replay of all (``limit``
    :data:`WHOLE`) of this worker's own epoch waits for the epoch to be read here."""

    trainer: bytes
    epoch: int
    limit: int
    splits: dict[tuple[int, ...], list[int]]
    index: int | None = None
    segment: Segment | None = None
    skip: Had = 0
    branch: int = 0
    switches: Switched | None = None  # when its mix took new weights (mixing.Switches)


class SharedDelivery(Delivery):
    """A shared job's delivery (see the module's docstring)."""

    def __init__(self, port: TaskPort, share: WindowSettings) -> None:
        super().__init__(port)
        self.window = Window(share.window_bytes, share.lag, share.block_seconds)
        self.stored: dict[str, Stored] = {}  # each record's memory, by segment name
        # The splits read per epoch and pass, in order, to make a late joiner's missed
        # elements again, and the replays to run, one at a time.
        self.splits: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self.switches: dict[int, Switched] = {}  # and when its mix took new weights
        self.replays: deque[Replay] = deque()
        self.replayer: Producer | None = None
        self.replay: Replay | None = None  # the one running
        self.replaying: tuple[bytes, int] | None = None  # (trainer, elements sent so far)
        self.replayed: dict[bytes, int] = {}  # elements of earlier replays, per trainer
        # Other workers' splits adopted, per epoch (handover.py), and a handover's
        # entries until its last one comes.
        self.adopted: dict[int, list[Segment]] = {}
        self.incoming: list[dict[str, Any]] = []
        # It left the job cleanly, handing its splits of these epochs on (None: not yet):
        # another worker makes them
        self.handed_epochs: set[int] | None = None
        # The branches each epoch's production here makes (a trainer of another one
        # gets that epoch made for it alone; zloader/sharing/branches.py).
        self.made: dict[int, set[int]] = {}
        self.failed: dict[int, dict[str, Any]] = {}  # branches that could not be loaded
        # epochs whose end waits for a handover: a dead worker's fence, or a draining
        # worker's (adopt)
        self.held: set[int] = set()
        self.acks: dict[bytes, set[str]] = {}  # trainer -> fences its next END names
        self.replay_pending: deque[Pending] = deque()
        self.replay_outstanding = 0

    # --- trainers -------------------------------------------------------------------------

    def open(self, stream: Stream, opened: Open) -> None:
        """A trainer starts (or re-opens) an epoch: place its cursor in the window; what
        it missed of an epoch under way is made again for it (a replay)."""
        port, epoch, credits = self.port, opened.epoch, opened.credits
        cursor = self.window.cursors.get(stream.identity)
        if self.handed_epochs is not None and (cursor is None or cursor.epoch != epoch):
            # (an OPEN that crossed its handover: the worker it went to serves this one,
            # and names this task in its END, which the trainer waits for)
            port.outlet.send(stream, End(epoch=epoch,
                                         handed=port.id if epoch in self.handed_epochs
                                         else None))
            return
        if opened.branch in self.failed:  # (its pipeline could not be loaded here)
            self._fail(stream.identity, epoch, self.failed[opened.branch])
            return
        if cursor is None or cursor.epoch != epoch:
            self._moved_on(stream.identity, epoch)
            finished = epoch in port.finished and epoch != port.producing
            started = epoch == port.producing or finished
            branch = opened.branch
            unmade = WHOLE if started and branch not in self.made.get(epoch, {0}) else None
            if unmade is not None and epoch == port.producing:
                self._attach(branch)  # (all of the epoch, if the trunk still has it)
            cursor = self.window.join(stream.identity, epoch, started, finished, branch,
                                      unmade)
            had = self.window.resume(cursor, opened.had) if opened.had else 0
            if cursor.missed > had:
                self.replays.append(Replay(stream.identity, epoch, cursor.missed,
                                           self.splits.setdefault(epoch, {}), skip=had,
                                           branch=branch,
                                           switches=self.switches.setdefault(epoch, {})))
            for segment in self.adopted.get(epoch, ()):
                if stream.consumer not in segment.served:
                    if segment.fence is not None:  # (its END names the dead one's fence)
                        self.acks.setdefault(stream.identity, set()).add(segment.fence)
                    self._owe(stream, segment)
        elif cursor.done:
            port.outlet.send(stream, End(epoch=epoch, lagged=cursor.lagged))
        stream.epoch = epoch
        cursor.credits = clamp(credits)
        port.abandon_stale()  # every trainer left the epoch being produced
        port.maybe_produce()
        self.deliver()

    def _moved_on(self, trainer: bytes, epoch: int) -> None:
        """``trainer`` opens ``epoch``: what was still to be made for it of an earlier
        epoch is dropped (it reads that no longer; a replay waiting for its credits
        there would hold every other trainer's replay back)."""
        if self.replay is not None and self.replay.trainer == trainer \
                and self.replay.epoch < epoch:
            self._stop_replay()
            self.replayed.pop(trainer, None)
        self.replays = deque(r for r in self.replays
                             if r.trainer != trainer or r.epoch >= epoch)

    def branches_for(self, epoch: int) -> set[int]:
        return self.made.get(epoch, {0})

    def branch_failed(self, index: int, error: dict[str, Any]) -> None:
        """Branch ``index``'s pipeline could not be loaded here: its trainers get the
        error (FAIL) rather than wait, now and when they open an epoch later."""
        self.failed[index] = error
        for cursor in self.window.cursors.values():
            if cursor.branch == index:
                self._fail(cursor.trainer, cursor.epoch, error)

    def _fail(self, trainer: bytes, epoch: int, error: dict[str, Any]) -> None:
        stream = self.port.streams.get(trainer)
        self.replays = deque(r for r in self.replays if r.trainer != trainer)
        if stream is not None:
            self.port.outlet.send(stream, Fail(epoch=epoch, error=error))

    def branch_added(self, index: int) -> None:
        if any(c.branch == index and c.epoch == self.port.producing
               for c in self.window.cursors.values()):
            self._attach(index)

    def _attach(self, index: int) -> None:
        """Ask the producer of the epoch under way to make branch ``index`` too, from the
        epoch's start (its trainers then get it as if it had been there from the start;
        :meth:`_attached` sees to that), once the branch is known here."""
        branch, producer = self.port.branches.get(index), self.port.producer
        if branch is not None and producer is not None:
            producer.attach(branch)

    def _attached(self) -> None:
        """Branches the producer added to the epoch under way: their trainers reading it
        are sent its records as they come, not the epoch made again."""
        producer, epoch = self.port.producer, self.port.producing
        made = self.made.get(epoch) if epoch is not None else None
        if producer is None or made is None or producer.attached <= made:
            return
        added = producer.attached - made
        made |= added
        for cursor in self.window.cursors.values():
            if cursor.epoch == epoch and cursor.branch in added and cursor.missed == WHOLE:
                cursor.missed = 0
                self.replays = deque(
                    r for r in self.replays if not (r.trainer == cursor.trainer
                                                    and r.epoch == epoch and r.limit == WHOLE
                                                    and r.segment is None))

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
        self.replays = deque(r for r in self.replays if r.trainer != stream.identity)
        self.replayed.pop(stream.identity, None)
        self.acks.pop(stream.identity, None)
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

    def on_record(self, producer: Producer, outgoing: Outgoing) -> None:
        if producer is not self.replayer:
            super().on_record(producer, outgoing)
            return
        self.replay_outstanding = max(0, self.replay_outstanding - 1)
        self.replay_pending.append(outgoing)
        self.deliver()

    def on_end(self, producer: Producer, end: EndOut) -> None:
        if producer is not self.replayer:
            super().on_end(producer, end)
            return
        self.replay_pending.append(end)
        self.deliver()

    def deliver(self) -> None:
        """Admit produced records into the window (as the lag policy allows), send a
        replay's records to its trainer, then send every trainer what it may take."""
        port = self.port
        now = time.monotonic()
        self._attached()
        while self.pending:
            item = self.pending[0]
            epoch = item.epoch
            if isinstance(item, EndOut):
                self.pending.popleft()
                self.window.add(epoch, 0, 0, end=True, skipped=item.skipped)
                port.finish_epoch(epoch)
                continue
            if epoch in port.finished:  # an abandoned epoch's leftovers
                self.pending.popleft()
                item.mark_taken()
                continue
            nbytes = sum(codec.nbytes(b) for b in item.buffers)
            admitted, gone = self.window.room(nbytes, now)
            self._evicted(gone)
            if not admitted:
                break  # "block": retried from the loop until the lagging trainer moves
            stored = store(item.buffers)
            item.mark_taken()
            self.pending.popleft()
            self.window.add(epoch, item.head.count, nbytes, stored, skipped=item.head.skipped,
                            branch=item.head.branch)
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
            while True:  # (records while it has credits; its END needs none)
                entry = cursor.end or window.next_for(cursor)
                if entry is None or (entry.end and entry.epoch in self.held):
                    break  # (a dead worker's elements may still be owed: see adopt)
                if not entry.end and cursor.credits <= 0:
                    break
                cursor.end = None
                window.took(cursor, entry)
                if entry.end:
                    if cursor.missed > 0 or self._owes(stream.identity):
                        cursor.replaying = True  # its replays' records go out now
                    else:
                        cursor.done = True
                        port.outlet.send(stream, End(epoch=entry.epoch,
                                                     fences=self._acked(stream),
                                                     skipped=entry.skipped,
                                                     lagged=cursor.lagged))
                    break
                cursor.credits -= 1
                self._send_stored(stream, entry, cursor.lagged)
        while self.replaying is not None and self.replay_pending and self._send_replay():
            pass

    def _send_stored(self, stream: Stream, entry: Entry, lagged: int) -> None:
        """Send the window's record ``entry`` (its place: ``DATA.first``)."""
        outlet, stored, count = self.port.outlet, entry.data, entry.count
        outlet.count(count, stored.length)
        if stream.ring is not None and stored.segment is not None:  # co-located
            stored.holders.add(stream.identity)
            outlet.send(stream, Data(epoch=entry.epoch, count=count, skipped=entry.skipped,
                                     ring=None, lagged=lagged, first=entry.first,
                                     segment=(stored.segment.name, stored.length),
                                     shared=True))
        else:
            outlet.send(stream, Data(epoch=entry.epoch, count=count, skipped=entry.skipped,
                                     ring=None, lagged=lagged, first=entry.first),
                        stored.frames)

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
        if isinstance(item, EndOut):
            if epoch in self.held:
                return False  # (a dead worker's elements may still be owed: see adopt)
            self.replay_pending.popleft()
            replay = self.replay
            if replay is not None and replay.segment is not None:
                replay.segment.served.add(stream.consumer)
            else:  # (what it was not sent: splits no longer on record; ``skip`` it had)
                skip = replay.skip if replay is not None and isinstance(replay.skip, int) \
                    else 0
                if cursor.missed != WHOLE:
                    cursor.lagged += max(0, cursor.missed - skip - sent)
                cursor.missed = 0
            sent += self.replayed.pop(trainer, 0)
            self._stop_replay()
            if self._owes(trainer):  # another replay for it (an adopted segment): next
                self.replayed[trainer] = sent
            else:
                cursor.done, cursor.replaying = True, False
                port.outlet.send(stream, End(epoch=epoch, skipped=item.skipped,
                                             fences=self._acked(stream),
                                             lagged=cursor.lagged, replayed=sent))
            port.maybe_produce()
            return False
        if cursor.credits <= 0:
            return False
        self.replay_pending.popleft()
        cursor.credits -= 1
        replay = self.replay
        if replay is not None and replay.segment is None and isinstance(replay.skip, int):
            item.head.first = replay.skip + sent  # (its place in what this worker made)
        self.replaying = (trainer, sent + item.head.count)
        port.outlet.record(stream, item.head, item.buffers)
        item.mark_taken()
        return True

    # --- production -----------------------------------------------------------------------

    def new_epoch(self, epoch: int) -> dict[str, Any]:
        while self.pool.acquire(blocking=False):  # permits start afresh (see permit)
            pass
        self.outstanding = 0
        for old in [e for e in self.splits if e < epoch - 2]:
            del self.splits[old]
            self.switches.pop(old, None)
        for old in [e for e in self.adopted if e < epoch - 2]:
            del self.adopted[old]
        for old in [e for e in self.made if e < epoch - 2]:
            del self.made[old]
        # The branches its producer makes: those known here that a trainer reads (one of
        # another comes later: it is added to the run, or the epoch made again for it).
        made = self.made[epoch] = {0} | {c.branch for c in self.window.cursors.values()
                                         if c.branch in self.port.branches}
        splits = self.splits.setdefault(epoch, {})
        switches = self.switches.setdefault(epoch, {})
        for cursor in self.window.cursors.values():  # (a branch whose pipeline is on its way)
            if cursor.epoch == epoch and cursor.branch not in made and not cursor.done:
                cursor.missed = WHOLE  # (unless the producer adds it: see _attached)
                self.replays.append(Replay(cursor.trainer, epoch, WHOLE, splits,
                                           branch=cursor.branch, switches=switches))
        return {"splits": splits, "switches": switches}

    def start_side(self) -> None:
        """A late joiner waits for what it missed: make it again, if no replay runs."""
        if self.replayer is not None:
            return
        port = self.port
        self.replays = deque(r for r in self.replays if r.trainer in port.streams)
        for replay in self.replays:
            if replay.branch not in port.branches or (  # (its pipeline is on its way)
                    replay.limit == WHOLE and replay.segment is None
                    and replay.epoch == port.producing):  # (not all read here yet)
                continue
            self.replays.remove(replay)
            self.replay, self.replaying = replay, (replay.trainer, 0)
            self.replay_outstanding = 0
            self.replayer = port.start_producer(
                replay.epoch, Pool(), replay.index, branch=replay.branch,
                splits=replay.splits, replay=replay.limit, skip=replay.skip,
                switches=replay.switches if replay.switches is not None else {})
            self.permit()
            break

    def _owe(self, stream: Stream, segment: Segment) -> None:
        """Make adopted ``segment`` again for ``stream``'s trainer (less the elements it
        had of it), after what it waits for now."""
        cursor = self.window.cursors.get(stream.identity)
        self.replays.append(Replay(stream.identity, segment.epoch, WHOLE, segment.splits,
                                   segment.index, segment,
                                   segment.had.get(stream.consumer, 0),
                                   cursor.branch if cursor is not None else 0,
                                   segment.switches))

    def _owes(self, trainer: bytes) -> bool:
        """Whether a replay for ``trainer`` runs or is still to run."""
        return (self.replay is not None and self.replay.trainer == trainer) \
            or any(r.trainer == trainer for r in self.replays)

    def _stop_replay(self) -> None:
        if self.replayer is not None:
            self.port.drop_producer(self.replayer)
        self.replayer, self.replaying, self.replay = None, None, None
        for item in self.replay_pending:
            if isinstance(item, Outgoing):
                item.mark_taken()
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
        nobody would read them again), records sent in a segment a trainer has not
        confirmed mapping yet (the worker unlinks them as it leaves), or a late trainer's
        replay to run or under way."""
        return (super().busy() or self.window.unsent() or bool(self.replays)
                or self.replayer is not None or bool(self.replay_pending)
                or any(stored.holders for stored in self.stored.values()))

    # --- moves (handover.py) -------------------------------------------------------------

    def handover(self) -> list[dict[str, Any]]:
        """The splits this worker read in each epoch it keeps and those it adopted, with
        the trainers that have all they make (each that has ended the epoch here, or
        reads a later one: a trainer starts the job's newest epoch). A trainer still
        waiting for an epoch this worker never made gets its END now, and from then on an
        OPEN of another epoch is answered with its END: each names this task where
        something of that epoch was handed on (``END.handed``), which the taker makes
        for that trainer and names in its END (the trainer waits for it)."""
        consumers = {identity: stream.consumer
                     for identity, stream in self.port.streams.items()}

        def served(epoch: int) -> set[str]:
            return {consumers[identity] for identity, cursor in self.window.cursors.items()
                    if identity in consumers
                    and (cursor.epoch > epoch or (cursor.epoch == epoch and cursor.done))}

        port = self.port
        own = [Segment(epoch, port.spec.index, passes, served(epoch),
                       switches=self.switches.get(epoch, {}))
               for epoch, passes in sorted(self.splits.items()) if any(passes.values())]
        adopted = [Segment(epoch, s.index, s.splits, s.served | served(epoch),
                           switches=s.switches)
                   for epoch, segments in sorted(self.adopted.items()) for s in segments]
        self.handed_epochs = {segment.epoch for segment in own + adopted}
        for identity, cursor in self.window.cursors.items():
            stream = port.streams.get(identity)
            if stream is None or cursor.done or cursor.epoch in self.held \
                    or cursor.epoch in port.finished:
                continue
            # An epoch it opened here that this worker never made: it got none of it here
            # (not served), and what was handed on of it comes from the taker.
            cursor.done = True
            port.outlet.send(stream, End(
                epoch=cursor.epoch, fences=self._acked(stream), lagged=cursor.lagged,
                handed=port.id if cursor.epoch in self.handed_epochs else None))
        return to_wire(own + adopted)

    def handed(self) -> set[int] | None:
        return self.handed_epochs

    def adopt(self, entries: tuple[dict[str, Any], ...], held: tuple[int, ...] = (),
              fence: str | None = None) -> None:
        """HANDOVER: once its last entry came, make each segment again for the trainers
        of its epoch here that it did not serve (at once for those reading the epoch,
        when they open it for the others), less what each had of it; ``held``: the epochs
        whose end waits for a handover (a dead worker's, whose segments the broker makes,
        or a draining worker's); ``fence``: the dead one's fence, or the drained task's
        id (what the ENDs of the trainers they are made for name)."""
        self.incoming.extend(entries)
        if self.incoming and self.incoming[-1]["last"]:
            self._adopt(from_wire(self.incoming), fence)
            self.incoming = []
        # (the epochs of a handover whose last entry has not come yet stay held: the
        # broker's hold may end with its first entry)
        self.held = set(held) | {entry["epoch"] for entry in self.incoming}
        self.port.maybe_produce()
        self.deliver()

    def _adopt(self, segments: list[Segment], fence: str | None) -> None:
        """Owe each segment to the trainers reading its epoch here that do not have it all.
        Each such trainer's END names ``fence``, one that opens the epoch here later
        included (:meth:`open`), and one whose epoch ended here already gets the rest,
        then its END again: it waits for that (it answered the dead worker's fence, or
        the drained worker answered its OPEN with an END naming its task, ``END.handed``:
        its OPEN there crossed the handover, and here came before the hold)."""
        for segment in segments:
            segment.fence = fence
            self.adopted.setdefault(segment.epoch, []).append(segment)
            for identity, cursor in self.window.cursors.items():
                stream = self.port.streams.get(identity)
                if stream is None or cursor.epoch != segment.epoch \
                        or stream.consumer in segment.served:
                    continue
                if fence is not None:
                    self.acks.setdefault(identity, set()).add(fence)
                    if cursor.done:
                        cursor.done, cursor.replaying = False, True
                elif cursor.done:  # (a handover naming nothing: no trainer waits for it)
                    log.warning("trainer %s ended epoch %d before a moved worker's splits "
                                "of it were handed here: it misses what they made",
                                stream.consumer, cursor.epoch)
                    continue
                self._owe(stream, segment)

    def _acked(self, stream: Stream) -> tuple[str, ...]:
        """The fences whose elements ``stream``'s trainer had before this END."""
        return tuple(sorted(self.acks.pop(stream.identity, ())))

    def reconnected(self) -> None:
        self.held = set()  # (a restarted broker knows no fence: nothing will release them)

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
                lag = sum(e.count for e in self.window.entries
                          if e.seq >= cursor.seq and e.branch == cursor.branch)
                out[stream.consumer] = {"lag": lag, "skipped": cursor.lagged,
                                        "branch": cursor.branch}
        return {"trainers": out}

    def close(self) -> None:
        for stored in self.stored.values():
            stored.free()
        self.stored.clear()
