"""The broker's journal events (zloader/broker/journal.py), one frozen record per kind.

Every change the broker must survive a restart with is recorded as one of these through
``Tables.record`` (records.py), one JSON line each (``{"e": kind, ...fields}``), and
replayed by ``history.restore``, which parses each line with :func:`parse`: a line whose
kind is unknown or whose fields are missing, of the wrong type or out of range is
skipped (and counted), never half applied. The fields are checked as a message's are
(zloader/transport/fields.py); lists that grow with the job (a pass's splits) are
checked without the message limit on entries.

The journal's schema version (``zloader.broker.journal.VERSION``) names these shapes: change
one, and bump it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from zloader.broker.records import Fence, Job, Pass, PassKey, Worker
from zloader.options import JobOptions
from zloader.transport.fields import (
    INDEX,
    NAME,
    PASS_KEY,
    Body,
    Wrong,
    array,
    boolean,
    fld,
    integer,
    is_int,
    list_of,
    obj,
    optional,
    text,
)
from zloader.transport.protocol import ProtocolError
from zloader.transport.shapes import MIX_WEIGHTS, mix_inputs, weight_switch

__all__ = [
    "KINDS",
    "BranchAdded",
    "ConsumerLeft",
    "EpochStarted",
    "Event",
    "JobCreated",
    "JobEnded",
    "JobFailed",
    "JobResumed",
    "MixWeighed",
    "OrphanAdopted",
    "Orphaned",
    "PassKept",
    "PassRead",
    "RoundsSet",
    "SplitHanded",
    "SplitRequeued",
    "TaskGiven",
    "WorkerGone",
    "WorkerLeft",
    "WorkerReady",
    "parse",
]


# --- shapes that grow with a job (no MAX_ITEMS bound) ---------------------------------------

def _splits(value: Any) -> list[int]:
    if not (isinstance(value, list) and all(is_int(v) and v >= 0 for v in value)):
        raise Wrong("must be a list of splits (integers >= 0)")
    return value


def _switches(value: Any) -> tuple[Any, ...]:
    """``[[pass, draws, weights], ...]``: when a worker's mix took new weights."""
    if not isinstance(value, (list, tuple)):
        raise Wrong("must be a list of [pass, draws, weights]")
    return tuple(weight_switch(entry) for entry in value)


def _holders(value: Any) -> dict[str, list[int]]:
    """Worker id -> the splits it holds."""
    if not isinstance(value, dict):
        raise Wrong("must map worker ids to lists of splits")
    for splits in value.values():
        _splits(splits)
    return value


def _skips(value: Any) -> dict[str, Any]:
    """Split (as JSON text) -> what to skip when it is read again."""
    if not (isinstance(value, dict) and all(
            isinstance(key, str) and key.isdigit() and isinstance(skip, dict)
            for key, skip in value.items())):
        raise Wrong("must map splits to what to skip")
    return value


def _origins(value: Any) -> list[Any]:
    """[[worker id, place, pass key], ...]: the passes the splits handed at those places
    of a worker's (splits.origin_at) belong to; a journal of before kept
    [[split, pass key], ...] (history._pass reads both)."""
    wrong = "must be a list of [worker id, place, pass key] (or [split, pass key])"
    if not isinstance(value, list):
        raise Wrong(wrong)
    for entry in value:
        if not isinstance(entry, list) or len(entry) not in (2, 3) \
                or (len(entry) == 3 and not isinstance(entry[0], str)) \
                or not (is_int(entry[-2]) and entry[-2] >= 0):
            raise Wrong(wrong)
        PASS_KEY(entry[-1])
    return value


def _inputs(value: Any) -> list[Any]:
    if not mix_inputs(value):
        raise Wrong("must be a mix's inputs, [[num_splits, shuffle_splits, seed], ...]")
    return value


def _anything(value: Any) -> Any:
    return value  # read where it is used (JobResumed.delivered: Ledger.merge_json)


# --- the events ------------------------------------------------------------------------------

@dataclass(eq=False, repr=False, kw_only=True)
class Event(Body):
    """One journal line: ``{"e": KIND, ...fields}``."""

    KIND: ClassVar[str]

    @classmethod
    def label(cls) -> str:
        return f"journal event {cls.KIND!r}"

    def to_body(self) -> dict[str, Any]:
        return {"e": self.KIND, **super().to_body()}

    @property
    def job_id(self) -> str | None:
        """The job it concerns (None: a worker's)."""
        job = getattr(self, "job", None)
        return job if isinstance(job, str) else None


@dataclass(eq=False, repr=False, kw_only=True)
class WorkerReady(Event):
    """A worker registered (READY)."""

    KIND = "worker"
    id: str = fld(NAME)
    host: str = fld(text(255))
    host_id: str = fld(NAME)
    pid: int = fld(INDEX)
    endpoint: str = fld(NAME)
    prefer: str | None = fld(optional(NAME), None)
    plain_data: bool = fld(boolean, False)

    @classmethod
    def of(cls, worker: Worker) -> WorkerReady:
        return cls(id=worker.id, host=worker.host, host_id=worker.host_id, pid=worker.pid,
                   endpoint=worker.endpoint, prefer=worker.prefer,
                   plain_data=worker.plain_data)


def _job_options(body: Any) -> JobOptions:
    """A job's options as a journal holds them: one of version 3 or before has no
    ``shards`` (added in version 4: 0, one per worker index, as those jobs ran)."""
    if isinstance(body, dict) and "shards" not in body:
        body = {**body, "shards": 0}
    return JobOptions.from_body(body)


@dataclass(eq=False, repr=False, kw_only=True)
class JobCreated(Event):
    """A job was made (its pipeline is kept beside the journal, by its id)."""

    KIND = "job"
    id: str = fld(NAME)
    fingerprint: str = fld(NAME)
    name: str | None = fld(optional(NAME))
    options: JobOptions = fld(_job_options)
    num_splits: int = fld(INDEX)
    shuffle_splits: bool = fld(boolean)
    seed: int | None = fld(optional(integer()))
    width: int = fld(INDEX)
    source_data: dict[str, Any] | None = fld(optional(obj))
    entropy: int = fld(integer())
    pipeline: dict[str, Any] | None = fld(optional(obj), None)
    inputs: list[Any] | None = fld(optional(_inputs), None, omit=True)
    # a shared job that takes branches: its pipeline's prefixes (zloader/sharing/prefix.py)
    prefix: dict[str, Any] | None = fld(optional(obj), None, omit=True)

    @property
    def job_id(self) -> str | None:
        return self.id

    @classmethod
    def of(cls, job: Job) -> JobCreated:
        handout = job.handout
        own = job.branches.own if job.branches is not None else None
        return cls(id=job.id, fingerprint=job.fingerprint, name=job.name, options=job.options,
                   num_splits=handout.num_splits, shuffle_splits=handout.shuffle_splits,
                   seed=handout.seed, width=job.width, source_data=job.source_data,
                   entropy=job.entropy, pipeline=job.pipeline,
                   inputs=[list(item) for item in handout.layout.inputs]
                   if handout.layout is not None else None,
                   prefix=None if own is None else {
                       "prefixes": list(own.prefixes), "names": list(own.names),
                       "first_tap": own.first_tap})


@dataclass(eq=False, repr=False, kw_only=True)
class BranchAdded(Event):
    """A shared job took a pipeline that shares a prefix with its own as branch ``branch``
    (its pipeline is kept beside the journal, by job and branch)."""

    KIND = "branch"
    job: str = fld(NAME)
    branch: int = fld(integer(1))
    fingerprint: str = fld(NAME)
    prefixes: tuple[str, ...] = fld(list_of(NAME))
    names: tuple[str, ...] = fld(list_of(text(128)))
    first_tap: int = fld(integer(1))
    tap: int = fld(integer(1))
    pipeline: dict[str, Any] | None = fld(optional(obj), None, omit=True)
    source_data: dict[str, Any] | None = fld(optional(obj), None, omit=True)

    @classmethod
    def of(cls, job: Job, index: int) -> BranchAdded:
        assert job.branches is not None
        member = job.branches.members[index - 1]
        return cls(job=job.id, branch=index, fingerprint=member.fingerprint,
                   prefixes=member.prefixes, names=member.names,
                   first_tap=member.first_tap, tap=member.tap, pipeline=member.pipeline,
                   source_data=member.source_data)


@dataclass(eq=False, repr=False, kw_only=True)
class Orphaned(Event):
    """A shared job's last worker left uncleanly: the splits it was handed (per pass, in
    order) and what each trainer said it had of them, kept for the job's next worker to
    make again (``failures.adopt_orphans``)."""

    KIND = "orphan"
    job: str = fld(NAME)
    fence: str = fld(NAME)
    worker: str = fld(NAME)
    index: int = fld(INDEX)
    died: bool = fld(boolean)
    order: list[Any] = fld(array)  # [[pass, [split, ...]], ...]
    answers: dict[str, Any] = fld(obj)  # consumer -> its DELIVERED.shared
    # when its mix took new weights: [[pass, draws, weights], ...] (handover.py)
    switches: tuple[Any, ...] = fld(_switches, (), omit=True)

    @classmethod
    def of(cls, job: Job, token: str, fence: Fence) -> Orphaned:
        return cls(job=job.id, fence=token, worker=fence.worker, index=fence.index or 0,
                   died=fence.died, order=[[list(k), v] for k, v in fence.order.items()],
                   answers=fence.answers,
                   switches=tuple([list(k), at, list(w)]
                                  for k, switched in fence.switches.items()
                                  for at, w in switched))


@dataclass(eq=False, repr=False, kw_only=True)
class OrphanAdopted(Event):
    """A shared job's next worker was given its last one's splits to make again."""

    KIND = "adopted"
    job: str = fld(NAME)
    fence: str = fld(NAME)


@dataclass(eq=False, repr=False, kw_only=True)
class RoundsSet(Event):
    """A job reads in coordinated rounds of ``size`` consumers."""

    KIND = "rounds"
    job: str = fld(NAME)
    size: int = fld(INDEX)


@dataclass(eq=False, repr=False, kw_only=True)
class TaskGiven(Event):
    """A worker took a task of a job, at a worker index."""

    KIND = "task"
    job: str = fld(NAME)
    task: str = fld(NAME)
    worker: str = fld(NAME)
    index: int = fld(INDEX)


@dataclass(eq=False, repr=False, kw_only=True)
class SplitHanded(Event):
    """A split of a pass went to a worker (``origin``: the pass it belongs to, when it
    was re-queued from another)."""

    KIND = "split"
    job: str = fld(NAME)
    pass_: PassKey = fld(PASS_KEY, wire="pass")
    split: int = fld(INDEX)
    worker: str = fld(NAME)
    origin: PassKey | None = fld(optional(PASS_KEY), None, omit=True)


@dataclass(eq=False, repr=False, kw_only=True)
class MixWeighed(Event):
    """A shared job's worker's mix draws a pass with new weights from a draw on (WEIGHED:
    its elements are made again with them should it die)."""

    KIND = "weighed"
    job: str = fld(NAME)
    worker: str = fld(NAME)
    pass_: PassKey = fld(PASS_KEY, wire="pass")
    at: int = fld(INDEX)
    weights: tuple[float, ...] = fld(MIX_WEIGHTS)


@dataclass(eq=False, repr=False, kw_only=True)
class SplitRequeued(Event):
    """A split is to be read again, less what ``skip`` says."""

    KIND = "requeue"
    job: str = fld(NAME)
    pass_: PassKey = fld(PASS_KEY, wire="pass")
    split: int = fld(INDEX)
    skip: dict[str, Any] = fld(obj)


@dataclass(eq=False, repr=False, kw_only=True)
class JobResumed(Event):
    """A resumed Loader's epoch and what it had yielded (a Ledger's JSON)."""

    KIND = "resume"
    job: str = fld(NAME)
    epoch: int = fld(INDEX)
    delivered: Any = fld(_anything)


@dataclass(eq=False, repr=False, kw_only=True)
class ConsumerLeft(Event):
    """A consumer left (BYE) in or after its part of an epoch: what it had yielded of it (a
    Ledger's JSON), merged with what others that left had."""

    KIND = "bye"
    job: str = fld(NAME)
    epoch: int = fld(INDEX)
    delivered: Any = fld(_anything)


@dataclass(eq=False, repr=False, kw_only=True)
class PassRead(Event):
    """A worker read every split it was handed in a pass (PASS_DONE)."""

    KIND = "done"
    job: str = fld(NAME)
    pass_: PassKey = fld(PASS_KEY, wire="pass")
    worker: str = fld(NAME)


@dataclass(eq=False, repr=False, kw_only=True)
class EpochStarted(Event):
    KIND = "epoch"
    job: str = fld(NAME)
    epoch: int = fld(INDEX)


@dataclass(eq=False, repr=False, kw_only=True)
class PassKept(Event):
    """A pass as it is (a compacted journal's, in place of its history)."""

    KIND = "pass"
    job: str = fld(NAME)
    pass_: PassKey = fld(PASS_KEY, wire="pass")
    order: list[int] = fld(_splits)
    requeued: list[int] = fld(_splits)
    handed: dict[str, list[int]] = fld(_holders)
    read: dict[str, list[int]] = fld(_holders)
    skips: dict[Any, Any] = fld(_skips)
    origins: list[Any] = fld(_origins)

    @classmethod
    def of(cls, job: Job, key: PassKey, handing: Pass) -> PassKept:
        return cls(job=job.id, pass_=key, order=list(handing.order),
                   requeued=list(handing.requeued), handed=handing.handed,
                   read=handing.read, skips=handing.skips,
                   origins=[[worker_id, place, list(origin)]
                            for worker_id, places in handing.origins.items()
                            for place, origin in places.items()])


@dataclass(eq=False, repr=False, kw_only=True)
class JobFailed(Event):
    """The job's pipeline raised (TASK_FAILED): the job ends with this error."""

    KIND = "failed"
    job: str = fld(NAME)
    error: dict[str, Any] = fld(obj)


@dataclass(eq=False, repr=False, kw_only=True)
class JobEnded(Event):
    KIND = "end"
    job: str = fld(NAME)


@dataclass(eq=False, repr=False, kw_only=True)
class WorkerGone(Event):
    """A worker left the broker: ``died``, or drained first (``clean``); ``fenced``: its
    splits' re-queues follow as events of their own."""

    KIND = "gone"
    worker: str = fld(NAME)
    died: bool = fld(boolean, False)
    fenced: bool = fld(boolean, False, omit=True)
    clean: bool = fld(boolean, False, omit=True)


@dataclass(eq=False, repr=False, kw_only=True)
class WorkerLeft(Event):
    """A worker left a job's task for another job (``placement.preempt``)."""

    KIND = "left"
    job: str = fld(NAME)
    task: str = fld(NAME)
    worker: str = fld(NAME)
    fenced: bool = fld(boolean, False, omit=True)
    clean: bool = fld(boolean, False, omit=True)


KINDS: dict[str, type[Event]] = {cls.KIND: cls for cls in (
    WorkerReady, JobCreated, BranchAdded, Orphaned, OrphanAdopted, RoundsSet, TaskGiven,
    SplitHanded, SplitRequeued, JobResumed, ConsumerLeft, PassRead, EpochStarted, PassKept,
    JobFailed, JobEnded, WorkerGone, WorkerLeft, MixWeighed)}
"""Each kind's record."""


def parse(line: Any) -> Event:
    """The event a journal line holds.

    Raises:
        ProtocolError: an unknown kind, or a field missing, of the wrong type or out of
            range (the message names the kind and the field).
    """
    kind = line.get("e") if isinstance(line, dict) else None
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"journal: no event of kind {str(kind)[:40]!r}")
    return cls.from_body(line)

