"""What the parts of a Loader's I/O thread share: its :class:`Settings` (fixed when the
Loader is made) and its :class:`Session` (the job and the epoch under way)."""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from zloader import codec
from zloader._byfields import ByFields, FrozenByFields
from zloader._defaults import HEARTBEAT, MAX_RANGES
from zloader.lineage import Ledger
from zloader.transport.keys import Keys

__all__ = ["HEARTBEAT", "EpochInput", "PerWorker", "Session", "Settings", "encoded"]


@dataclass(eq=False, repr=False)
class PerWorker(FrozenByFields):
    """An epoch input with one element per worker index: ``Loader.iterate(PerWorker(xs))``
    hands the worker of index ``i`` the element ``xs[i]`` alone (``Context.settings.epoch_input``),
    and a worker of an index past the end None. The torch adapter sends each worker only
    its own batches' indices this way, rather than the whole epoch's to every worker."""

    inputs: Sequence[Any]


@dataclass(eq=False, repr=False)
class EpochInput(FrozenByFields):
    """An epoch's input as codec frames, as it goes with OPEN: the same frames for every
    worker (``shared``), or each worker index its own (``each``)."""

    shared: tuple[Any, ...] | list[Any] = ()
    each: tuple[list[Any], ...] | None = None

    def frames(self, index: int) -> tuple[Any, ...] | list[Any]:
        """The frames for the worker of ``index`` (none past the end of ``each``)."""
        if self.each is None:
            return self.shared
        return self.each[index] if 0 <= index < len(self.each) else ()


def encoded(epoch_input: Any) -> EpochInput:
    """``epoch_input`` (None, a codec element or a :class:`PerWorker` of them) as frames.

    Raises:
        CodecError: the codec cannot carry it (or one of a :class:`PerWorker`'s).
    """
    if isinstance(epoch_input, PerWorker):
        return EpochInput(each=tuple(codec.encode(item) if item is not None else []
                                     for item in epoch_input.inputs))
    return EpochInput(codec.encode(epoch_input) if epoch_input is not None else [])


@dataclass(eq=False, repr=False)
class Settings(FrozenByFields):
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
    named: bool = False  # a job_name: other consumers may take part in its epochs at any time
    own: Container[int] = frozenset()  # pids of its own forked workers, whose records may
    # hold pickled leaves (Loader(objects=True)); nobody else's are unpickled
    memory_budget: int | None = None  # bytes for rings and records in flight (budget.py)
    width: int = 1  # the workers the job expects (its worker indices)
    dispatched: bool = False  # its workers make what it dispatches (Loader.dispatch)
    parts: int = 0  # a mix this consumer draws (zloader/plan.py): its inputs, each of
    # which has credits of its own (``prefetch`` each)
    made_here: int = 0  # and the position of its first stage after the mix: the groups of
    # unbatches from there on are made here, not received (zloader/client/draw.py)


@dataclass(eq=False, repr=False)
class Session(ByFields):
    """The job this consumer joined and the epoch under way, as the broker link, the
    peers, the receiving side and the end of the epoch all see them."""

    consumer: str  # this consumer's id
    job: str | None = None  # None until the broker answers REGISTER, and once it forgets
    heartbeat: float = HEARTBEAT  # the broker's, once it has told us
    epoch: int | None = None  # the epoch under way (None before the first)
    epoch_input: EpochInput = field(default_factory=EpochInput)  # codec frames sent with OPEN
    ended: set[str] = field(default_factory=set)  # workers that ended the epoch (rerun)
    done: bool = False  # the epoch is over: Done was handed on
    rerun: int = 0  # how often the workers were asked to run the epoch again
    received: Ledger = field(default_factory=Ledger)  # origins received this epoch
    # A shared job's: elements received this epoch from each worker (what a trainer says
    # it had of a dead one's, DELIVERED.shared)
    got_from: dict[str, int] = field(default_factory=dict)
    # ... and the places of those elements in what each worker made (DATA.first), as
    # ascending [start, end] ranges (DELIVERED.shared.ranges)
    got_places: dict[str, list[list[int]]] = field(default_factory=dict)
    # ... and the dead workers' fences whose elements it waits for this epoch: fence ->
    # the worker that makes them again (its END names the fence: ``acked``); a drained
    # worker's task it opened the epoch on too late (END.handed) -> "" (any worker)
    awaiting: dict[str, str] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    broken: set[str] = field(default_factory=set)  # workers a record of which was lost
    weights: tuple[float, ...] | None = None  # a mix's, as Loader.set_weights set them
    weights_stamp: float = 0.0  # when
    # A shared job's branch this consumer reads (JOB.branch; its OPEN says so): 0 unless
    # its pipeline shares a prefix with the job's (zloader/sharing/branches.py)
    branch: int = 0
    # Work items (Loader.dispatch) for worker indices not connected yet, sent with the
    # OPEN (each with whether it is kept until done), and those kept until done (Loader.
    # dispatch_done) that were sent, per index, in order: sent again when lost
    undispatched: dict[int, list[tuple[list[int], bool]]] = field(default_factory=dict)
    dispatch_kept: dict[int, deque[list[int]]] = field(default_factory=dict)

    def got(self, worker: str, count: int, first: int | None) -> None:
        """``count`` elements came from ``worker`` this epoch (at place ``first`` of what it
        made, a shared job's record; None: another's, made again by it)."""
        self.got_from[worker] = self.got_from.get(worker, 0) + count
        if first is None:
            return
        ranges = self.got_places.setdefault(worker, [])
        if ranges and ranges[-1][1] == first:
            ranges[-1][1] += count
        else:
            ranges.append([first, first + count])

    def places(self, worker: str) -> list[list[int]] | None:
        """The places of what came from ``worker`` this epoch of what it made itself
        (merged ranges; what it made again of another worker's splits has none), or
        None when they are too scattered to say (the count says it then)."""
        ranges = self.got_places.get(worker, [])
        merged: list[list[int]] = []
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged if len(merged) <= MAX_RANGES else None  # (else: the count alone)

    def start(self, epoch: int, epoch_input: EpochInput, made_here: int = 0) -> None:
        """Begin ``epoch``, which nothing of has been received yet (``made_here``:
        ``Settings.made_here``)."""
        self.epoch, self.epoch_input = epoch, epoch_input
        self.ended = set()
        self.done = False
        self.rerun = 0
        self.received = Ledger(made_here)
        self.got_from, self.awaiting, self.acked, self.broken = {}, {}, set(), set()
        self.got_places = {}
        self.undispatched, self.dispatch_kept = {}, {}
