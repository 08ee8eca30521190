"""What the parts of a Loader's I/O thread share: its :class:`Settings` (fixed when the
Loader is made) and its :class:`Session` (the job and the epoch under way)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zloader._defaults import HEARTBEAT
from zloader.lineage import Ledger
from zloader.transport.keys import Keys

__all__ = ["HEARTBEAT", "Session", "Settings"]


@dataclass(frozen=True)
class Settings:
    """A consumer's settings, from the Loader's arguments."""

    address: str  # the broker's
    prefetch: int  # records in flight per worker
    timeout: float  # the Loader's: a worker silent this long with credits is stuck
    use_rings: bool  # shared-memory rings for co-located workers
    ring_bytes: int | None
    keys: Keys | None
    data_bind: str | None  # where to serve the source data (None: a TCP port)
    balanced: bool
    exactly_once: bool
    coordinated: tuple[int, int] | None  # (num_consumers, consumer_index)
    fixed: bool  # static or no sharding: every worker index must end the epoch
    own: frozenset[int] = frozenset()  # pids of its own forked workers, whose records may
    # hold pickled leaves (Loader(objects=True)); nobody else's are unpickled
    memory_budget: int | None = None  # bytes for rings and records in flight (budget.py)
    width: int = 1  # the workers the job expects (its worker indices)


@dataclass
class Session:
    """The job this consumer joined and the epoch under way, as the broker link, the
    peers, the receiving side and the end of the epoch all see them."""

    consumer: str  # this consumer's id
    job: str | None = None  # None until the broker answers REGISTER, and once it forgets
    heartbeat: float = HEARTBEAT  # the broker's, once it has told us
    epoch: int | None = None  # the epoch under way (None before the first)
    epoch_input: tuple[Any, ...] | list[Any] = ()  # codec frames sent with OPEN
    ended: set[str] = field(default_factory=set)  # workers that ended the epoch (rerun)
    done: bool = False  # the epoch is over: Done was handed on
    rerun: int = 0  # how often the workers were asked to run the epoch again
    received: Ledger = field(default_factory=Ledger)  # origins received this epoch

    def start(self, epoch: int, epoch_input: tuple[Any, ...] | list[Any]) -> None:
        """Begin ``epoch``, which nothing of has been received yet."""
        self.epoch, self.epoch_input = epoch, epoch_input
        self.ended = set()
        self.done = False
        self.rerun = 0
        self.received = Ledger()
