"""Credit delivery: a task's records go to its consumers as their credits allow.

Plain: each record to the consumer with the most credits (the readiest), so a fast consumer
takes more; the producer takes one of the consumers' credits per record, so memory stays
bounded by what they granted, and by the bytes a consumer's memory budget allows in flight
from this worker (OPEN.window; a record goes alone when nothing else is in flight).
Balanced (``Loader(balanced=N)``): once the N consumers of the job have opened an epoch,
records (one element each) are dealt round-robin, whatever their speed, so each gets an
equal share.
"""

from __future__ import annotations

from zloader._defaults import MAX_GRANT, OVERDRAW_RECORDS
from zloader.transport import records
from zloader.transport.messages import End
from zloader.worker.delivery import Delivery, EpochEnd, RecordOut, TaskPort
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

    def __init__(self, port: TaskPort, balanced: int = 0) -> None:
        super().__init__(port)
        self.balanced = balanced  # consumers to deal to (0: by credit)
        self.turn = 0  # whose turn it is, when dealing
        self.overdrawn = False  # draining to move: records go out without credit

    def credit(self, stream: Stream, credits: int) -> None:
        credits = clamp(credits)
        stream.credits += credits
        for _ in range(credits):
            self.pool.release()

    def overdraw(self) -> None:
        self.overdrawn = True
        self.pool.release(OVERDRAW_RECORDS)
        self.deliver()

    def withdraw(self, stream: Stream) -> None:
        for _ in range(stream.credits):
            if not self.pool.acquire(blocking=False):
                break
        stream.credits = 0

    def deliver(self) -> None:
        """Send pending records to consumers with credit, in order; an epoch's END goes
        out once all its records have."""
        port = self.port
        while self.pending:
            item = self.pending[0]
            epoch = item.epoch
            if epoch in port.finished:  # an abandoned epoch's leftovers
                self.pending.popleft()
                if isinstance(item, RecordOut):
                    item.outgoing.mark_taken()
                continue
            streams = [s for s in port.streams.values() if s.epoch == epoch]
            if isinstance(item, EpochEnd):
                self.pending.popleft()
                block = item.origins  # what no record carried (exactly-once)
                end = End(epoch=epoch, skipped=item.skipped, origins=block is not None)
                for stream in streams:
                    port.outlet.send(stream, end, [block] if block is not None else ())
                port.finish_epoch(epoch)
                continue
            outgoing, head = item.outgoing, item.head
            sizes = records.sizes_of(outgoing.buffers)  # (the outlet's too: found once)
            size = sum(sizes)
            taker = self._next(streams, size)
            if taker is None:
                return
            self.pending.popleft()
            taker.credits -= 1
            taker.sent(size)
            port.outlet.record(taker, epoch, outgoing.buffers, head, sizes)
            outgoing.mark_taken()

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
