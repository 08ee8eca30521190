"""Credit delivery: a task's records go to its consumers as their credits allow.

Plain: each record to the consumer with the most credits (the readiest), so a fast consumer
takes more; the producer takes one of the consumers' credits per record, so memory stays
bounded by what they granted, and by the bytes a consumer's memory budget allows in flight
from this worker (OPEN.window; a record goes alone when nothing else is in flight).
Balanced (``Loader(balanced=N)``): once the N consumers of the job have opened an epoch,
records (one element each) are dealt round-robin, whatever their speed, so each gets an
equal share.
By part (a mix its consumers draw, a deterministic job's shards: zloader/plan.py): a
consumer's credits are per part, and so are the producer's permits
(zloader/worker/permits.py); each record goes to a consumer with credit for its part
(balanced: each part's records dealt round-robin among those with credit for it), a
part's records and its END in order.
"""

from __future__ import annotations

from collections import deque

from zloader._defaults import MAX_GRANT, OVERDRAW_RECORDS
from zloader.transport import records
from zloader.transport.messages import End
from zloader.worker.delivery import Delivery, EndOut, Pending, TaskPort
from zloader.worker.outgoing import Outgoing
from zloader.worker.permits import Permits
from zloader.worker.streams import Stream

__all__ = ["MAX_GRANT", "CreditDelivery", "clamp"]


def clamp(credits: int) -> int:
    """A grant of credits, within [0, MAX_GRANT]."""
    return max(0, min(credits, MAX_GRANT))


class CreditDelivery(Delivery):
    """Plain or balanced credit delivery (see the module's docstring). Its producers
    deliver their records themselves (``inline``): the one producer of an epoch delivers
    only before its END, and that END is what ends the epoch."""

    inline = True

    def __init__(self, port: TaskPort, balanced: int = 0, parts: int = 0) -> None:
        super().__init__(port)
        self.balanced = balanced  # consumers to deal to (0: by credit)
        self.turn = 0  # whose turn it is, when dealing
        self.part_turns: dict[int, int] = {}  # (the same, for each part's records)
        self.overdrawn = False  # draining to move: records go out without credit
        # Records by part (a mix its consumers draw, a deterministic job's shards):
        # permits per part (the producer takes those).
        self.permits = Permits(parts) if parts else None

    def credit(self, stream: Stream, credits: int, part: int | None = None) -> None:
        credits = clamp(credits)
        permits = self.permits
        if permits is None:
            stream.credits += credits
            for _ in range(credits):
                self.pool.release()
            return
        if stream.part_credits is None:
            stream.part_credits = [0] * permits.parts
        for which in range(permits.parts) if part is None else (part,):
            if which < permits.parts:
                stream.part_credits[which] += credits
                stream.credits += credits
                permits.release(which, credits)

    def overdraw(self) -> None:
        self.overdrawn = True
        if self.permits is not None:
            for part in range(self.permits.parts):
                self.permits.release(part, OVERDRAW_RECORDS)
        else:
            self.pool.release(OVERDRAW_RECORDS)
        self.deliver()

    def withdraw(self, stream: Stream) -> None:
        if self.permits is not None:
            for part, credits in enumerate(stream.part_credits or ()):
                self.permits.take_back(part, credits)
            stream.part_credits = None
        for _ in range(stream.credits if self.permits is None else 0):
            if not self.pool.acquire(blocking=False):
                break
        stream.credits = 0

    def deliver(self) -> None:
        """Send pending records to consumers with credit, in order; an epoch's END goes
        out once all its records have."""
        if self.permits is not None:
            self._deliver_parts()
            return
        port = self.port
        while self.pending:
            item = self.pending[0]
            epoch = item.epoch
            if self.left_over(item):
                self.pending.popleft()
                continue
            streams = [s for s in port.streams.values() if s.epoch == epoch]
            if isinstance(item, EndOut):
                self.pending.popleft()
                self._end(item, streams)
                continue
            sizes = records.sizes_of(item.buffers)  # (the outlet's too: found once)
            size = sum(sizes)
            taker = self._next(streams, size)
            if taker is None:
                return
            self.pending.popleft()
            taker.credits -= 1
            taker.sent(size)
            port.outlet.record(taker, item.head, item.buffers, sizes)
            item.mark_taken()

    def _deliver_parts(self) -> None:
        """:meth:`deliver` by part: each record to a consumer with credit for its part
        (``Head.part``); a record that cannot go holds back the later ones of its part
        only (and the epoch's END, which goes last)."""
        port = self.port
        waiting: deque[Pending] = deque()  # what cannot go yet, in order
        held: set[int | None] = set()  # inputs with something waiting (None: the END)
        while self.pending:
            item = self.pending.popleft()
            epoch = item.epoch
            if self.left_over(item):
                continue
            part = item.head.part if isinstance(item, Outgoing) else item.part
            if part in held or None in held or (part is None and waiting):
                waiting.append(item)
                held.add(part)
                continue
            streams = [s for s in port.streams.values() if s.epoch == epoch]
            if isinstance(item, EndOut):
                if part is not None and self.balanced and len(streams) < self.balanced:
                    # (a part's END waits, as its records do, for every consumer to open
                    # the epoch: one that opened later would never learn that the part
                    # ended here, and would wait for it)
                    waiting.append(item)
                    held.add(part)
                    continue
                self._end(item, streams)
                continue
            assert part is not None  # (a record by part names its part)
            sizes = records.sizes_of(item.buffers)
            taker = self._taker_of(part, streams)
            if taker is None:
                waiting.append(item)
                held.add(part)
                continue
            if taker.part_credits is not None:
                taker.part_credits[part] -= 1
            taker.credits -= 1
            taker.sent(sum(sizes))
            port.outlet.record(taker, item.head, item.buffers, sizes)
            item.mark_taken()
        self.pending = waiting

    def _taker_of(self, part: int, streams: list[Stream]) -> Stream | None:
        """Who gets the next record of ``part`` (None: nobody can now): the consumer with
        the most credit for it; balanced, the next in turn for that part that has credit
        for it (each part's records dealt round-robin once every consumer opened the
        epoch). A consumer whose turn it is but whose draws took none of that part
        lately is passed over: the consumers draw the mix themselves, each as its own
        weights and inputs say, and one waiting for a part must not wait for another to
        draw it (two such waits would hold each other up for ever)."""
        def credit(stream: Stream) -> int:
            return stream.part_credits[part] if stream.part_credits is not None else 0

        if self.balanced:
            if len(streams) < self.balanced:
                return None
            order = sorted(streams, key=lambda s: s.consumer)
            turn = self.part_turns.get(part, 0)
            for step in range(len(order)):
                stream = order[(turn + step) % len(order)]
                if credit(stream) > 0 or self.overdrawn:
                    self.part_turns[part] = turn + step + 1
                    return stream
            return None
        ready = [s for s in streams if self.overdrawn or credit(s) > 0]
        return max(ready, key=credit) if ready else None

    def _end(self, item: EndOut, streams: list[Stream]) -> None:
        """Send ``item`` (an epoch's END, or a part's) to the consumers of its epoch; the
        epoch's finishes it here."""
        block = item.origins  # what no record carried (exactly-once)
        end = End(epoch=item.epoch, skipped=item.skipped, origins=block is not None,
                  part=item.part)
        for stream in streams:
            self.port.outlet.send(stream, end, [block] if block is not None else ())
        if item.part is None:
            self.port.finish_epoch(item.epoch)

    def _next(self, streams: list[Stream], size: int) -> Stream | None:
        """Who gets the next record, of ``size`` bytes, of the epoch these ``streams``
        read (None: nobody can take it now: no credit, or no room in its window)."""
        if self.balanced:
            # Deal records round-robin, whatever the consumers' speed: equal shares,
            # once every consumer sharing the job has opened the epoch.
            if len(streams) < self.balanced:
                return None
            order = sorted(streams, key=lambda s: s.consumer)
            stream = order[self.turn % len(order)]
            if (stream.credits <= 0 or not stream.fits(size)) and not self.overdrawn:
                return None
            self.turn += 1
            return stream
        ready = [s for s in streams
                 if (s.credits > 0 and s.fits(size)) or self.overdrawn]
        if not ready:
            return None
        return max(ready, key=lambda s: s.credits)
