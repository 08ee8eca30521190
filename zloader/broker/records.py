"""The broker's plain records: workers, consumers, jobs, passes, fences, and the tables
that hold them (:class:`Tables`).

Records carry data and nothing else; the transitions that change them are functions in
the concern modules of this package (``jobs``, ``splits``, ``placement``, ``failures``,
``coordinated``, ``history``, ``status``, ``peers``), each taking the :class:`Tables`.
Nothing here imports zmq or runs user code: pipelines are kept as opaque blobs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from zloader._byfields import ByFields, FrozenByFields
from zloader._defaults import (
    AUTOSCALE_COOLDOWN,
    FENCE_GRACE,
    HEARTBEAT,
    KILLS_TO_FAIL,
    LIVENESS,
    MAX_JOBS,
    MAX_PEER_JOBS,
    MAX_PEER_PIPELINE_BYTES,
    MAX_PIPELINE_BYTES_HELD,
    MOVES_PER_SECOND,
)
from zloader.broker.autoscale import Autoscaler
from zloader.broker.journal import Journal
from zloader.broker.rounds import Rounds
from zloader.forward import BURST, RATE, Bucket
from zloader.mixing import Layout
from zloader.options import JobOptions
from zloader.sharing.handover import Switched
from zloader.sharing.prefix import Branches
from zloader.transport.fields import Record
from zloader.transport.protocol import Command

if TYPE_CHECKING:
    from zloader.broker.events import Event, WorkerGone, WorkerLeft

__all__ = [
    "FENCE_GRACE",
    "INHERITED",
    "KILLS_TO_FAIL",
    "Consumer",
    "Fence",
    "Handout",
    "Job",
    "Limits",
    "Metrics",
    "Out",
    "Pass",
    "Tables",
    "Worker",
]

INHERITED = {"inherited": True}
"""A job's ``pipeline`` when its Loader's forked workers hold it in memory (embedded)."""

Identity = bytes
"""A peer's ZeroMQ routing identity (the connection its messages came on)."""

PassKey = tuple[int, ...]
"""A pass of a job's input: ``(epoch, repeat, ...)``."""


class Out(NamedTuple):
    """One message to send: to ``identity``, the record of its body (``message``, one of
    zloader/transport/messages.py: the broker loop encodes it) and its ``payload`` frames
    (TASK's pipeline)."""

    identity: bytes
    message: Record
    payload: tuple[Any, ...] = ()

    @property
    def command(self) -> Command:
        return self.message.COMMAND

    @property
    def body(self) -> dict[str, Any]:
        """The body as it goes on the wire (encoded afresh each time: for tests and logs;
        the loop encodes each record once)."""
        return self.message.to_body()


@dataclass(eq=False, repr=False)
class Worker(ByFields):
    id: str
    identity: bytes
    host: str
    host_id: str
    pid: int
    endpoint: str
    prefer: str | None
    last_seen: float
    task: str | None = None
    current: tuple[PassKey, int] | None = None  # (pass, split) being read
    stats: dict[str, Any] = field(default_factory=dict)
    rate: float = 0.0
    trainers: dict[str, dict[str, int]] = field(default_factory=dict)  # shared job: lag
    warm: tuple[str, ...] = ()  # fingerprints of the pipelines it keeps loaded
    plain_data: bool = False  # its data socket speaks PLAIN, not CURVE (--plain-data)
    idle_since: float = 0.0  # when it last had no task (surplus marks, see status._surplus)
    doing: dict[str, Any] | None = None  # its producer's {epoch, split, stage} (heartbeat)
    sent_at: float = float("-inf")  # when its heartbeats last showed elements sent
    holds: frozenset[str] = frozenset()  # fingerprints of pipelines it inherited by fork
    slot: int | None = None  # the task index it was forked for (READY.slot), if any
    since: float = 0.0  # when it took its task (the pool's time slices, broker/pool.py)
    moving_to: str | None = None  # the job it moves to once its task is drained
    moving_since: float = 0.0  # when it was told to drain (placement.MOVE_DRAIN_SECONDS)
    # a shared job's drained task: what it hands on (HEARTBEAT.handover, placement.drained)
    handover: list[dict[str, Any]] = field(default_factory=list)
    leaving: bool = False  # it drains to leave (SIGTERM: HEARTBEAT.leaving), then says BYE
    # LOG lines it may send: twice what its own limit lets through (zloader/forward.py)
    log_budget: Bucket = field(default_factory=lambda: Bucket(2 * RATE, 4.0 * BURST))


@dataclass(eq=False, repr=False)
class Consumer(ByFields):
    id: str
    identity: bytes
    job: str
    host_id: str
    pid: int
    last_seen: float
    stats: dict[str, Any] = field(default_factory=dict)  # from its heartbeats
    active: bool = True  # it reads an epoch not yet ended (HEARTBEAT stats.active)
    joined: float = 0.0  # when it registered
    heard: bool = False  # it sent a HEARTBEAT or an EPOCH since (see jobs.unheard)
    branch: int = 0  # of a shared job whose trainers share a prefix: which it reads


@dataclass(eq=False, repr=False)
class Pass(ByFields):
    order: deque[int]
    handed: dict[str, list[int]] = field(default_factory=dict)
    requeued: deque[int] = field(default_factory=deque)
    # Exactly-once jobs: splits a worker finished reading whose elements it may still hold
    # (a shuffle buffer, a batch), and what to skip when a split of this pass is read again.
    read: dict[str, list[int]] = field(default_factory=dict)
    skips: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Workers told that no split is left in this pass: they ask for none again, so a split
    # re-queued now is not theirs (see splits.readers).
    over: set[str] = field(default_factory=set)
    # Worker id -> place (in what it was handed in this pass: its read, then its handed)
    # -> the pass the split handed there belongs to, where that is another pass of the
    # epoch (a re-queued split, see splits._hand). Kept per handing: a pass may read a
    # split of another pass and then its own copy of the same split.
    origins: dict[str, dict[int, PassKey]] = field(default_factory=dict)


@dataclass(eq=False, repr=False)
class Fence(ByFields):
    """A dead worker's splits of an exactly-once job, held until every consumer has said
    which of their elements it holds (it has stopped reading from that worker first)."""

    worker: str
    task: str | None
    died: bool
    splits: list[tuple[PassKey, int]]  # (pass, split)
    waiting: set[str]  # consumers yet to answer
    deadline: float  # then the silent ones are given up
    replies: dict[tuple[PassKey, int], dict[str, Any]] = field(default_factory=dict)
    event: WorkerGone | WorkerLeft | None = None  # journaled once it is done
    # A shared job's (zloader/sharing/handover.py): the worker's index, the splits it was
    # handed per pass in order, and each consumer's DELIVERED.shared ({epoch, done, count})
    index: int | None = None
    order: dict[PassKey, list[int]] = field(default_factory=dict)
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    taker: str | None = None  # the worker meant to make them again
    switches: Switched = field(default_factory=dict)  # when its mix took new weights


@dataclass(eq=False, repr=False, slots=True)
class Handout(ByFields):
    """How a job's splits go out: its source's splits, each pass's dispenser, how many
    splits were re-queued, the splits that killed workers, and what a resumed Loader
    had yielded (broker/splits.py reads and changes it)."""

    num_splits: int
    shuffle_splits: bool
    seed: int | None
    layout: Layout | None = None  # a mix's inputs' splits (zloader/mixing.py)
    passes: dict[PassKey, Pass] = field(default_factory=dict)
    requeues: dict[int, int] = field(default_factory=dict)  # epoch -> splits re-queued
    kills: dict[int, int] = field(default_factory=dict)  # split -> workers it killed
    failed: list[dict[str, Any]] = field(default_factory=list)  # splits given up on
    resume: tuple[int, Any] | None = None  # (epoch, Ledger) a resumed Loader delivered
    # What consumers that left (BYE) in or after their part of an epoch had yielded, by
    # epoch (a Ledger each, the last two epochs): not read again for the others when a
    # worker's splits are (failures.complete_fences)
    left: dict[int, Any] = field(default_factory=dict)
    # A shared job's: when each worker's mix took new weights, per pass (WEIGHED), to
    # make a dead worker's elements again with them (zloader/mixing.py ``Switches``)
    switches: dict[str, Switched] = field(default_factory=dict)


@dataclass(eq=False, repr=False, slots=True)
class Metrics(ByFields):
    """What a job's consumers and workers report, and what the broker samples of it:
    throughput, waiting, starvation and the autoscaler's wish (broker/status.py)."""

    elements: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0  # consumers' time waiting for data, summed
    skipped: int = 0
    unconfirmed: int = 0  # stuck reports the broker's own view did not confirm (not dropped)
    starvation: float = 0.0  # share of the last interval the consumers waited
    waited_at: tuple[float, float] | None = None  # (wait_seconds, time) at the last sample
    reported: bool = False  # a consumer sent its stats since the last sample
    sampled: bool = False  # its starvation was measured (a consumer reported between samples)
    stages: dict[str, float] = field(default_factory=dict)  # workers' seconds, by stage
    scaler: Autoscaler = field(default_factory=Autoscaler)  # desired_workers (dynamic jobs)
    desired: int = 0
    hungry_until: float = 0.0  # an epoch just started: hungry before its first sample


@dataclass(eq=False, repr=False, slots=True)
class Job(ByFields):
    """A job: its pipeline and options, its tasks and consumers, and its parts: how its
    splits go out (:class:`Handout`), its fences (a dead worker's splits held for the
    consumers' answers), its rounds (coordinated reads) and its :class:`Metrics`."""

    id: str
    fingerprint: str
    name: str | None
    options: JobOptions  # as the job runs them (JobOptions.applied)
    blob: bytes
    handout: Handout
    width: int  # static sharding: the fixed number of worker indices
    source_data: dict[str, Any] | None
    entropy: int
    created: float
    tasks: dict[str, str] = field(default_factory=dict)       # task id -> worker id
    indices: dict[str, int] = field(default_factory=dict)     # task id -> worker index
    consumers: set[str] = field(default_factory=set)
    silent: dict[str, float] = field(default_factory=dict)  # consumer -> when it expired
    error: dict[str, Any] | None = None
    idle_since: float | None = None
    linger: float = 0.0  # seconds a job without consumers is kept (more if they went silent)
    epoch: int = 0  # the highest epoch a consumer has started
    fences: dict[str, Fence] = field(default_factory=dict)
    # A shared job's fences whose dead worker was its last: made again by the next
    # worker it gets (failures.adopt_orphans), their epochs held until then
    orphans: list[tuple[str, Fence]] = field(default_factory=list)
    rounds: Rounds | None = None  # coordinated reads (num_consumers)
    metrics: Metrics = field(default_factory=Metrics)
    pipeline: dict[str, Any] | None = None  # where workers get a pipeline not in ``blob``
    owner: Identity | None = None  # the connection whose REGISTER made it (Limits.peer_*)
    # A shared job's own pipeline's prefixes and the pipelines that share one with it
    # (zloader/sharing/prefix.py); None: not shared, or it does not take branches.
    branches: Branches | None = None
    # Its latest tasks that left it cleanly (failures.leave): each sent its END last
    drained: list[dict[str, Any]] = field(default_factory=list)

    @property
    def sharding(self) -> str:
        return self.options.sharding

    @property
    def deterministic(self) -> bool:
        return self.options.deterministic

    @property
    def share(self) -> dict[str, Any] | None:
        """A shared job's window settings (None: not shared)."""
        return self.options.share

    @property
    def track(self) -> bool:
        """Exactly-once: elements carry origins (zloader/lineage/intsets.py)."""
        return self.options.exactly_once

    @property
    def weight(self) -> float:
        """Its share of the pool relative to other jobs' (``Loader(weight=)``)."""
        return self.options.weight

    @property
    def fixed(self) -> bool:
        """Its worker indices are fixed (static sharding or deterministic order): it takes
        at most ``width`` workers, the autoscaler leaves it alone, and the pool moves its
        workers only between epochs."""
        return self.sharding == "static" or self.deterministic


@dataclass(eq=False, repr=False)
class Limits(FrozenByFields):
    """What the broker holds for its peers, at most (docs/reliability.md, "Floods"): a
    REGISTER of a new job past one is refused with an ERROR naming it. ``peer_*``: the jobs
    made by one connection (one consumer's socket), still held."""

    jobs: int = MAX_JOBS
    peer_jobs: int = MAX_PEER_JOBS
    pipeline_bytes: int = MAX_PIPELINE_BYTES_HELD
    peer_pipeline_bytes: int = MAX_PEER_PIPELINE_BYTES


class Tables:
    """What the broker knows: its settings, workers, consumers and jobs by id, and who is
    behind each routing identity. Lookups only; the transitions are in the concern modules.

    Args:
        heartbeat: seconds between heartbeats.
        liveness: heartbeats a peer may miss before it is taken for dead.
        journal: where every state change is recorded (:mod:`zloader.broker.journal`); None: in
            memory only.
        cooldown: the autoscaler's (``zloader/broker/autoscale.py``).
        limits: what peers may make the broker hold (:class:`Limits`); None: the defaults.
    """

    def __init__(self, heartbeat: float = HEARTBEAT, liveness: int = LIVENESS,
                 journal: Journal | None = None,
                 cooldown: float = AUTOSCALE_COOLDOWN, limits: Limits | None = None) -> None:
        self.heartbeat = heartbeat
        self.limits = limits or Limits()
        self.cooldown = cooldown
        self.liveness = liveness
        self.journal = journal
        self.workers: dict[str, Worker] = {}
        self.consumers: dict[str, Consumer] = {}
        self.jobs: dict[str, Job] = {}
        self.peers: dict[bytes, tuple[str, str]] = {}  # identity -> ("worker"|"consumer", id)
        # actuators that asked for the status lately: id -> (cap, when, their workers' ids)
        self.actuators: dict[str, tuple[int, float, frozenset[str]]] = {}
        self.rejected = 0  # malformed or refused messages dropped (the broker counts them)
        self.refused = 0  # REGISTERs refused past a limit (admission.py)
        self.deaths = 0  # workers dropped as dead (silent past expiry, stuck, or gone)
        self.refusal_logged = float("-inf")  # when a refusal was last logged
        self.unjournaled: set[str] = set()  # jobs whose journal writes failed
        self.told: set[str] = set()  # consumers told so (history.journal_errors)
        self.replaying = False  # the journal is being replayed: record nothing
        self._task_jobs: dict[str, str] = {}  # task -> job id, checked on use (task_job)
        # the pool's moves (placement.py): MOVES_PER_SECOND, as many at once at most
        self.move_budget = Bucket(MOVES_PER_SECOND, MOVES_PER_SECOND)

    def record(self, event: Event) -> None:
        """Append ``event`` (broker/events.py) to the journal (nothing while it is
        replayed). A write that fails (a full disk) marks the job: it could not be resumed
        after a restart (``history.journal_errors`` tells its consumers)."""
        if self.journal is None or self.replaying:
            return
        written = self.journal.record(event.to_body())
        if not written and event.job_id is not None:
            self.unjournaled.add(event.job_id)

    @property
    def expiry(self) -> float:
        """Seconds of silence after which a peer is taken for dead."""
        return self.heartbeat * self.liveness

    def worker_at(self, identity: bytes) -> Worker | None:
        """The worker behind a routing identity, if it is one."""
        kind, pid = self.peers.get(identity, ("", ""))
        return self.workers.get(pid) if kind == "worker" else None

    def consumer_at(self, identity: bytes) -> Consumer | None:
        """The consumer behind a routing identity, if it is one."""
        kind, pid = self.peers.get(identity, ("", ""))
        return self.consumers.get(pid) if kind == "consumer" else None

    def task_job(self, task: str | None) -> str | None:
        """The id of the job that ``task`` belongs to (a task id is unique: a worker's
        heartbeat finds its job without looking through every job's)."""
        if task is None:
            return None
        known = self._task_jobs.get(task)
        if known is not None:
            job = self.jobs.get(known)
            if job is not None and task in job.tasks:
                return known
        found = next((j.id for j in self.jobs.values() if task in j.tasks), None)
        if found is None:
            self._task_jobs.pop(task, None)
        else:
            if len(self._task_jobs) > 2 * len(self.workers) + 64:  # ended tasks' entries
                self._task_jobs.clear()
            self._task_jobs[task] = found
        return found

    def job_of(self, task: str | None) -> Job | None:
        """The job that ``task`` belongs to."""
        return self.jobs.get(self.task_job(task) or "")

    def consumers_of(self, job: Job) -> list[Consumer]:
        """The registered consumers of ``job``."""
        return [c for cid in job.consumers if (c := self.consumers.get(cid)) is not None]

    def hosts(self, job: Job) -> set[str]:
        """The hosts of ``job``'s consumers."""
        return {c.host_id for c in self.consumers_of(job)}
