"""Coordinated reads: the broker's bookkeeping of one job's rounds, with no sockets.

A job read by ``num_consumers`` N coordinated consumers is read in *rounds*: a worker that
has N consecutive elements ready, and a credit from each of the N consumers, asks the broker
for the epoch's next round number and sends element j to consumer j. A consumer yields the
elements of an epoch in round order, and yields round k only once the broker has *committed*
it: every consumer has said it received its element of round k. So a round is yielded by
every consumer or by none, whatever dies:

- a worker dies: its rounds not yet committed are *lost*: every consumer skips them alike;
- a consumer leaves or is replaced (``consumer_index`` taken over by a restarted process):
  every round not yet committed is lost, since it cannot commit any more; the newcomer
  starts at the epoch's next round (the rounds before it are *missed*, counted);
- a consumer starts a later epoch while the others still read this one (it left early):
  the epoch's open rounds are lost and no more are numbered; its workers end the epoch;
- a worker asking with a membership the broker no longer has, or for an epoch a consumer
  has left, gets no number (the group of elements it made is dropped, counted as lost).

The broker tells the consumers what was committed or lost with ``COMMIT`` messages, and
how many rounds each epoch has with the job view (docs/protocol.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from zloader._byfields import ByFields
from zloader._defaults import KEEP_EPOCHS, KEEP_RESOLVED

__all__ = ["Rounds"]


@dataclass(eq=False, repr=False)
class _Open(ByFields):
    """A numbered round not yet committed: its worker and the consumers that have it."""

    worker: str
    acks: set[str] = field(default_factory=set)


@dataclass(eq=False, repr=False)
class Rounds(ByFields):
    size: int
    members: dict[int, str] = field(default_factory=dict)  # consumer index -> consumer id
    replaced: dict[str, str] = field(default_factory=dict)  # consumer id -> why it is out
    issued: dict[int, int] = field(default_factory=dict)  # epoch -> rounds numbered
    lost_in: dict[int, int] = field(default_factory=dict)  # epoch -> of those, lost
    open: dict[tuple[int, int], _Open] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)  # consumer id -> its epoch
    resolved: OrderedDict[tuple[int, int], bool] = field(default_factory=OrderedDict)
    reruns: dict[int, int] = field(default_factory=dict)  # epoch -> reruns ordered
    ordered_at: dict[int, int] = field(default_factory=dict)  # epoch -> requeues then
    lost: int = 0  # rounds lost, all epochs (numbered or refused)

    def index_of(self, consumer: str) -> int | None:
        return next((i for i, c in self.members.items() if c == consumer), None)

    def join(self, consumer: str, index: int, epoch: int) -> dict[str, int]:
        """``consumer`` takes ``index`` (whoever held it has left already): where it starts
        in ``epoch``, the job's current epoch."""
        self.members[index] = consumer
        start = self.issued.get(epoch, 0)
        return {"epoch": epoch, "round": start, "missed": start - self.lost_in.get(epoch, 0)}

    def issue(self, worker: str, epoch: int, members: list[Any]) -> int | None:
        """The next round of ``epoch`` for ``worker``, whose group of elements is addressed
        to ``members`` (consumer ids by index); None when they are not the members now."""
        if self.vacant() or members != [
                self.members.get(i) for i in range(self.size)] or any(
                self.started.get(c, -1) > epoch for c in members):
            self.lost += 1  # a group of elements that got no number: lost, not numbered
            return None
        number = self.issued.get(epoch, 0)
        self.issued[epoch] = number + 1
        self.open[(epoch, number)] = _Open(worker)
        return number

    def got(self, consumer: str, epoch: int, numbers: list[int]
            ) -> tuple[list[int], dict[str, list[int]]]:
        """``consumer`` received its element of these rounds: the rounds now committed,
        and what became of those it names again that were resolved already (it may have
        missed the message): ``{"rounds": [...], "lost": [...]}``."""
        committed = []
        again: dict[str, list[int]] = {"rounds": [], "lost": []}
        for number in numbers:
            entry = self.open.get((epoch, number))
            if entry is None:
                known = self.resolved.get((epoch, number))
                if known is not None:
                    again["rounds" if known else "lost"].append(number)
                continue
            entry.acks.add(consumer)
            if len(entry.acks) >= self.size:
                del self.open[(epoch, number)]
                self._resolve(epoch, number, True)
                committed.append(number)
        return committed, again

    def _resolve(self, epoch: int, number: int, committed: bool) -> None:
        self.resolved[(epoch, number)] = committed
        while len(self.resolved) > KEEP_RESOLVED:
            self.resolved.popitem(last=False)

    def epoch_started(self, consumer: str, epoch: int) -> dict[int, list[int]]:
        """``consumer`` started ``epoch``: the open rounds of earlier epochs are lost (it
        left them early), and no more are numbered."""
        if self.index_of(consumer) is None:
            return {}
        self.started[consumer] = max(epoch, self.started.get(consumer, epoch))
        return self._lose([key for key in self.open if key[0] < epoch])

    def order_rerun(self, epoch: int, requeues: int) -> None:
        """A consumer found splits of ``epoch`` waiting to be read again once every worker
        had ended it: order one more run of the epoch, for every consumer alike, unless
        one was ordered since those splits were re-queued."""
        if requeues > self.ordered_at.get(epoch, 0):
            self.ordered_at[epoch] = requeues
            self.reruns[epoch] = self.reruns.get(epoch, 0) + 1

    def lose_worker(self, worker: str) -> dict[int, list[int]]:
        """A worker died: its open rounds are lost."""
        return self._lose([key for key, entry in self.open.items() if entry.worker == worker])

    def leave(self, consumer: str) -> dict[int, list[int]]:
        """A consumer left: it gives up its index and every open round is lost."""
        index = self.index_of(consumer)
        if index is None:
            return {}
        del self.members[index]
        self.started.pop(consumer, None)
        return self._lose(list(self.open))

    def _lose(self, keys: list[tuple[int, int]]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for epoch, number in sorted(keys):
            del self.open[(epoch, number)]
            self._resolve(epoch, number, False)
            out.setdefault(epoch, []).append(number)
            self.lost += 1
            self.lost_in[epoch] = self.lost_in.get(epoch, 0) + 1
        return out

    def prune(self, epoch: int) -> None:
        """Forget epochs well before ``epoch`` (the job's current one)."""
        for old in [e for e in self.issued if e < epoch - KEEP_EPOCHS]:
            self.issued.pop(old, None)
            self.lost_in.pop(old, None)
        for old in [e for e in self.reruns if e < epoch - KEEP_EPOCHS]:
            self.reruns.pop(old, None)
            self.ordered_at.pop(old, None)
        for key in [k for k in self.open if k[0] < epoch - KEEP_EPOCHS]:
            del self.open[key]

    def view(self) -> dict[str, Any]:
        """What every consumer of the job is told (in the job view)."""
        return {"size": self.size, "issued": {str(e): n for e, n in self.issued.items()},
                "reruns": {str(e): n for e, n in self.reruns.items()}, "lost": self.lost,
                "vacant": self.vacant()}

    def vacant(self) -> list[int]:
        """The consumer indices no consumer holds now."""
        return [i for i in range(self.size) if i not in self.members]
