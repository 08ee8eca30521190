"""A coordinated consumer's rounds (docs/coordinated.md; the broker's side is
zloader/broker/rounds.py): which round comes next, the elements held until the broker commits
their round, and the rounds lost for every consumer."""

from __future__ import annotations

import logging
import time
from typing import Any

from zloader._defaults import VACANT_WARNING
from zloader.client.items import Data, Lost

__all__ = ["Rounds"]

log = logging.getLogger("zloader.loader")


class Rounds:
    """A coordinated consumer's rounds (zloader/broker/rounds.py): it yields round k of an epoch
    once it holds its element and the broker has committed k; lost rounds are skipped."""

    def __init__(self, coordinated: tuple[int, int]) -> None:
        self.size, self.index = coordinated
        self.next = 0
        self.held: dict[int, Data] = {}
        self.committed: set[int] = set()
        self.lost: set[int] = set()
        self.issued: dict[str, int] = {}
        self.total_lost = 0  # the job's rounds lost so far (the same for every consumer)
        self.missed = 0  # rounds this consumer missed: it (re)joined after they were read
        self.reruns: dict[str, int] = {}  # epoch -> reruns the broker ordered
        self.ends: dict[str, int] = {}  # worker -> the latest rerun it ended (this epoch)
        self.start_at: tuple[int, int] | None = None  # (epoch, round) where it joined
        self.vacant: list[int] = []
        self._warned = time.monotonic()

    def joined(self, where: Any, epoch: int | None) -> None:
        """Where the broker placed this consumer on (re-)registering; when that is in the
        epoch under way, jump there now (the streams are opened afresh, so the elements
        held from before are dropped, credits and all)."""
        if not (isinstance(where, dict) and isinstance(where.get("round"), int)
                and isinstance(where.get("epoch"), int) and where["round"] > 0):
            return
        self.start_at = (where["epoch"], where["round"])
        log.info("joined coordinated reads as consumer %d of %d at round %d of epoch %d "
                 "(the rounds before it were read without this consumer)", self.index,
                 self.size, where["round"], where["epoch"])
        if epoch != where["epoch"]:
            self.missed += max(0, int(where.get("missed") or 0))
            return
        self.missed += max(0, where["round"] - self.next)
        self.next = max(self.next, where["round"])
        self.held = {n: item for n, item in self.held.items() if n >= self.next}
        self.committed = {n for n in self.committed if n >= self.next}
        self.lost = {n for n in self.lost if n >= self.next}

    def view(self, rounds: Any, address: str) -> None:
        """Take the job's rounds from its JOB view (``rounds``): the rounds numbered per
        epoch, those lost, the reruns ordered and the consumer indices not yet joined,
        warning when one has been missing a while (the broker at ``address``)."""
        if not isinstance(rounds, dict):
            return
        if isinstance(rounds.get("issued"), dict):
            self.issued = rounds["issued"]
        if isinstance(rounds.get("lost"), int):
            self.total_lost = rounds["lost"]
        if isinstance(rounds.get("reruns"), dict):
            self.reruns = rounds["reruns"]
        vacant = rounds.get("vacant")
        self.vacant = vacant if isinstance(vacant, list) else []
        now = time.monotonic()
        if not self.vacant:
            self._warned = now  # warn after a vacancy has lasted VACANT_WARNING seconds
        elif now - self._warned > VACANT_WARNING:
            self._warned = now
            log.warning("coordinated reads wait for consumer_index %s of %d to join the job "
                        "(broker %s): every round needs all %d consumers",
                        ", ".join(map(str, self.vacant)), self.size, address, self.size)

    def start(self, epoch: int) -> None:
        """Begin ``epoch``: from round 0, or from where this consumer joined it."""
        self.held.clear()
        self.committed.clear()
        self.lost.clear()
        self.next = 0
        self.ends.clear()
        if self.start_at is not None and self.start_at[0] == epoch:
            self.next = self.start_at[1]

    def hold(self, number: int, item: Data) -> bool:
        """Keep round ``number``'s element; False when the round is skipped here."""
        if number < self.next or number in self.lost:
            return False
        self.held[number] = item
        return True

    def uncommitted(self) -> list[int]:
        """The rounds held whose commit has not come (to acknowledge again)."""
        return [n for n in self.held if n not in self.committed]

    def commit(self, numbers: list[Any], lost: list[Any]) -> None:
        self.committed.update(n for n in numbers if isinstance(n, int) and n >= self.next)
        self.lost.update(n for n in lost if isinstance(n, int) and n >= self.next)

    def release(self) -> list[Data | Lost]:
        """Items in round order: records to yield, and the rounds lost (:class:`Lost`)
        whose credit goes back."""
        out: list[Data | Lost] = []
        for number in sorted(n for n in self.held if n in self.lost):
            item = self.held.pop(number)
            out.append(Lost(item.epoch, item.worker, item.index))
        while True:
            if self.next in self.lost:
                self.lost.discard(self.next)
            elif self.next in self.committed and self.next in self.held:
                self.committed.discard(self.next)
                out.append(self.held.pop(self.next))
            else:
                return out
            self.next += 1

    def finished(self, epoch: int | None) -> bool:
        """Every round the broker numbered in ``epoch`` was released or lost."""
        return self.next >= int(self.issued.get(str(epoch), 0))
