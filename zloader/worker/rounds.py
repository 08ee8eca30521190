"""Rounds delivery: coordinated reads (``Loader(num_consumers=N)``, see zloader/broker/rounds.py
for the consumer's side and docs/coordinated.md).

The worker groups its records N at a time (one element each, made one after the other);
once every one of the N consumers has a credit for a group (reserved then), it asks the
broker to number the group (ROUND_REQ) and, when the number comes (ROUND), sends element j
to consumer j. An epoch's END goes out once the groups before it have; an epoch's last,
incomplete group is dropped and counted. The producer makes only as many records as the
consumers have credits for rounds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from zloader import codec
from zloader.transport.messages import End, Open
from zloader.transport.protocol import ProtocolError
from zloader.worker.credit import clamp
from zloader.worker.delivery import Delivery, EndOut, TaskPort, discard
from zloader.worker.outgoing import Head, Outgoing
from zloader.worker.streams import Stream

__all__ = ["Group", "RoundsDelivery"]


@dataclass(eq=False)
class Group:
    """One round's worth of records (element j for consumer j) of a coordinated job, or
    the epoch's end (``end``: the END body) once the rounds before it have gone out."""

    epoch: int
    records: list[Outgoing]
    end: End | None = None
    members: list[bytes] | None = None  # set when its number was asked for


class RoundsDelivery(Delivery):
    """Coordinated reads (see the module's docstring)."""

    def __init__(self, port: TaskPort, size: int) -> None:
        super().__init__(port)
        self.size = size  # N: the consumers of a round
        self.partial: list[Outgoing] = []  # the group being filled
        self.partial_epoch = -1
        # The full groups (and epoch ends) in order, the first ones waiting for their number.
        self.groups: deque[Group] = deque()
        self.replaced: set[str] = set()  # consumers a restarted one took over

    # --- consumers ------------------------------------------------------------------------

    def open(self, stream: Stream, opened: Open) -> None:
        if stream.consumer in self.replaced:
            self.port.remove_stream(stream)
            raise ProtocolError(f"consumer {stream.consumer} was taken over by another "
                                "with its consumer_index")
        index = opened.consumer_index
        if index is None or not index < self.size:
            raise ProtocolError(f"OPEN: field 'consumer_index' must be an integer from 0 to "
                                f"{self.size - 1} in a coordinated job, got {index!r}")
        stream.index = index
        super().open(stream, opened)

    def credit(self, stream: Stream, credits: int, part: int | None = None) -> None:
        stream.credits += clamp(credits)  # production follows the rounds they can take
        self.permit()

    def withdraw(self, stream: Stream) -> None:
        stream.credits = 0

    def consumer_gone(self, consumer: str, replaced: bool) -> None:
        if replaced:
            self.replaced.add(consumer)

    def breaks(self, epoch: int) -> bool:
        # A consumer left the epoch: its rounds can no longer be complete, so the epoch
        # ends here for the others too (the broker loses its open rounds).
        return any(s.index is not None and s.epoch > epoch for s in self.port.streams.values())

    # --- records --------------------------------------------------------------------------

    def deliver(self) -> None:
        """Group records N at a time; ask the broker to number each full group once every
        consumer has a credit for it (reserved now); an epoch's END goes out once the
        groups before it have. An epoch's last, incomplete group is dropped and counted."""
        self._group()
        port = self.port
        for group in [g for g in self.groups if g.members is None and g.epoch in port.finished
                      and g.end is None]:  # an abandoned epoch's groups
            self.groups.remove(group)
            discard(group.records)
        for group in list(self.groups):
            if group.members is not None:
                continue  # asked for already
            if group.end is not None:
                if group is not self.groups[0]:
                    break  # after the rounds still waiting for their number
                self.groups.popleft()
                for stream in port.streams.values():
                    if stream.epoch == group.epoch:
                        port.outlet.send(stream, group.end)
                port.finish_epoch(group.epoch)
                continue
            members = self._members(group.epoch)
            if members is None or min(s.credits for s in members) <= 0:
                break
            for stream in members:
                stream.credits -= 1
            group.members = [s.identity for s in members]
            port.ask_round(group.epoch, tuple(s.consumer for s in members))
        self.permit()

    def _group(self) -> None:
        """Move the producer's records into groups of N (and ends after them)."""
        port = self.port
        while self.pending:
            item = self.pending.popleft()
            epoch = item.epoch
            if self.left_over(item):
                continue
            if isinstance(item, EndOut):
                dropped = len(self.partial) if self.partial_epoch == epoch else 0
                discard(self.partial)
                end = End(epoch=epoch, skipped=item.skipped, dropped=item.dropped + dropped,
                          rerun=port.reruns.get(epoch, 0))
                self.groups.append(Group(epoch, [], end=end))
                continue
            outgoing = item
            if outgoing.gathered:  # it waits for its round: copy it, so the producer goes on
                outgoing.buffers = codec.joined(outgoing.buffers)
            outgoing.mark_taken()  # kept here: the producer may hand over the next
            if self.partial_epoch != epoch:
                discard(self.partial)
                self.partial_epoch = epoch
            self.partial.append(outgoing)
            if len(self.partial) == self.size:
                self.groups.append(Group(epoch, self.partial))
                self.partial = []

    def on_round(self, epoch: int, number: int | None) -> None:
        """The broker numbered the oldest group asked for (or refused it: null): send its
        elements, one to each consumer, or give back the credits reserved for it."""
        group = self.groups[0] if self.groups else None
        if group is None or group.members is None or group.epoch != epoch:
            super().on_round(epoch, number)  # (it says so)
            return
        self.groups.popleft()
        if number is None:
            self._unreserve(group)
        else:
            for record, identity in zip(group.records, group.members, strict=True):
                stream = self.port.streams.get(identity)
                if stream is not None:
                    self.port.outlet.record(stream, Head(epoch, 1, round=number),
                                            record.buffers)
        discard(group.records)
        self.deliver()

    def reconnected(self) -> None:
        """Answers to round requests sent on the old connection are lost (and the broker
        lost those rounds), so ask for them again."""
        for group in self.groups:
            self._unreserve(group)
        self.deliver()

    def _unreserve(self, group: Group) -> None:
        """Give back the credits reserved for a group whose number will not come (a
        re-opened stream has fresh credits already)."""
        for identity in group.members or ():
            stream = self.port.streams.get(identity)
            if stream is not None and stream.epoch == group.epoch:
                stream.credits += 1
        group.members = None

    def _members(self, epoch: int | None) -> list[Stream] | None:
        """The streams of consumers 0..N-1 reading ``epoch`` (the latest to open for an
        index), or None while one is missing."""
        by_index: dict[int, Stream] = {}
        for stream in self.port.streams.values():
            if stream.epoch == epoch and stream.index is not None:
                by_index[stream.index] = stream
        if len(by_index) < self.size:
            return None
        return [by_index[i] for i in range(self.size)]

    # --- production -----------------------------------------------------------------------

    def new_epoch(self, epoch: int) -> dict[str, Any]:
        while self.pool.acquire(blocking=False):  # permits start afresh (see permit)
            pass
        self.outstanding = 0
        return {}

    def permit(self) -> None:
        """Let the producer make as many records as the consumers have credits for rounds:
        N per round, the fewest credits of the N deciding."""
        port = self.port
        if port.producer is None or port.producing is None:
            return
        members = self._members(port.producing)
        rounds = min(s.credits for s in members) if members else 0
        waiting = sum(1 for g in self.groups if g.members is None and g.end is None)
        queued = len(self.partial) + self.size * waiting + len(self.pending)
        for _ in range(self.size * rounds - queued - self.outstanding):
            self.outstanding += 1
            self.pool.release()

    def busy(self) -> bool:
        return bool(self.pending or self.groups or self.partial)
