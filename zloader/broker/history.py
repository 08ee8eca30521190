"""The broker's history in its journal (:mod:`zloader.broker.journal`): the events every concern
records (``Tables.record``) replayed into the tables by a restarted broker, one function
per kind (:data:`APPLY`); a snapshot of the tables as events, for compaction; and the
consumers told when writing the journal failed. It sits above the concerns: replaying
calls their transitions, with recording off (``Tables.replaying``).

Replay checks each event against the state the events before it made, as the live broker
could only have made it: a split handed must be waiting in its pass (in its order, or
re-queued), to a worker that runs a task of the job; a split re-queued must have been
handed out, not be waiting already, and (but for a consumer's reread) no longer be held;
a split is one of its pass's; a job, pass, worker or task an event names must exist. An
event that does not fit is skipped (counted by kind for the one warning), never applied.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zloader._byfields import ByFields
from zloader.broker import failures, jobs, splits
from zloader.broker.events import (
    BranchAdded,
    ConsumerLeft,
    EpochStarted,
    Event,
    JobCreated,
    JobEnded,
    JobFailed,
    JobResumed,
    MixWeighed,
    OrphanAdopted,
    Orphaned,
    PassKept,
    PassRead,
    RoundsSet,
    SplitHanded,
    SplitRequeued,
    TaskGiven,
    WorkerGone,
    WorkerLeft,
    WorkerReady,
    parse,
)
from zloader.broker.journal import VERSION, Journal, branch_file
from zloader.broker.records import FENCE_GRACE, Fence, Handout, Job, Out, Pass, Tables, Worker
from zloader.broker.rounds import Rounds
from zloader.mixing import layout_of
from zloader.sharing.handover import Switched
from zloader.sharing.prefix import Branches, Member
from zloader.transport.messages import Error

__all__ = ["APPLY", "Replay", "journal_errors", "restore", "snapshot"]

log = logging.getLogger("zloader.broker")


def journal_errors(state: Tables) -> list[Out]:
    """ERROR, naming the work dir and the failure, to each consumer of a job whose
    journal writes failed (once per consumer). Their Loaders raise it; the job and
    the others go on in memory."""
    if not state.unjournaled or state.journal is None:
        return []
    out = []
    for job_id in list(state.unjournaled):
        job = state.jobs.get(job_id)
        if job is None:
            state.unjournaled.discard(job_id)
            continue
        for consumer_id in job.consumers - state.told:
            consumer = state.consumers.get(consumer_id)
            if consumer is not None:
                state.told.add(consumer_id)
                out.append(Out(consumer.identity,
                               Error(message=state.journal.failure or "")))
    return out


def restore(state: Tables, now: float) -> int:
    """Rebuild the state from the journal (a restarted broker): jobs, tasks, splits
    handed out and finished, epochs. Workers come back as they were and must reconnect
    within ``liveness`` heartbeats, or their splits go to others. Lines the journal does
    not trust and events that do not fit the state are skipped, with one warning; a
    journal that had such lines, or of an older version, is then rewritten from what was
    restored. Returns the number of jobs restored."""
    if state.journal is None:
        return 0
    state.replaying = True
    journal = state.journal
    replay = Replay(state, now)
    try:
        for number, line in journal.replay():
            try:
                event = parse(line)
            except Exception as exc:  # ProtocolError: a kind or field it does not take
                log.debug("journal line %d: %s", number, exc)
                journal.skip(number, "fields missing or of the wrong type")
                continue
            try:
                why = APPLY[type(event)](replay, event)
            except Exception:  # one bad line must not stop the broker
                log.debug("journal line %d: cannot apply %s", number, line, exc_info=True)
                why = "an event that failed to apply"
            if why is not None:
                log.debug("journal line %d skipped (%s): %s", number, why, line)
                journal.skip(number, why)
    finally:
        state.replaying = False
    _report(journal)
    if journal.skipped or journal.reordered or journal.missing or journal.version != VERSION:
        journal.compact([event.to_body() for event in snapshot(state)])
    # Its consumers are not journaled: each comes back by itself (REGISTER naming the job)
    # once its socket has reconnected (ZeroMQ's backoff: up to RECONNECT_MAX_MS) and it
    # was told UNKNOWN, a heartbeat or two, which may well be past one expiry. Collected
    # before that, the job would be made anew for it, its epoch handed out whole again:
    # wait for them as for consumers that went silent.
    grace = state.expiry * FENCE_GRACE
    for job in state.jobs.values():
        job.idle_since = now  # collected unless a consumer comes back
        job.linger = max(job.linger, grace)
        job.metrics.scaler.cooldown = state.cooldown
    return len(state.jobs)


def _report(journal: Journal) -> None:
    """One warning for what the replay skipped (the count, the line numbers and each
    kind's count), took out of order or found missing."""
    said = []
    if journal.skipped:
        numbers = sorted(journal.skipped)
        shown = ", ".join(map(str, numbers[:20])) + (", ..." if len(numbers) > 20 else "")
        kinds = ", ".join(f"{kind}: {count}" for kind, count
                          in journal.skipped_kinds.most_common())
        said.append(f"skipped {len(numbers)} lines ({shown}) it could not trust or apply, "
                    f"by kind [{kinds}]")
    if journal.reordered:
        said.append(f"replayed {journal.reordered} lines that were out of place in the "
                    "file in the order of their sequence numbers")
    if journal.missing:
        said.append(f"found {journal.missing} sequence numbers missing (lines lost)")
    if said:
        log.warning("journal %s: %s; the rest was restored and the journal rewritten from "
                    "it", journal.path, "; ".join(said))


@dataclass(eq=False, repr=False)
class Replay(ByFields):
    """A replay under way: the tables it fills, the time, and what it learnt on the way
    that the tables do not keep."""

    state: Tables
    now: float
    # jobs created whose pipeline file is gone (collected jobs): not restored, and neither
    # are their events (not skipped: nothing is wrong with them)
    unrestored: set[str] = field(default_factory=set)


Apply = Callable[[Replay, Any], str | None]
"""Replays one event of its kind into the replay's tables; returns None once it is
applied, or why it does not fit the state (then it changed nothing)."""


def _of_job(apply: Callable[[Replay, Job, Any], str | None]) -> Apply:
    """``apply`` for an event of a job, run only while the job is known (one whose
    pipeline file is gone is not restored, and neither are its events)."""
    def of_known_job(replay: Replay, event: Any) -> str | None:
        job = replay.state.jobs.get(event.job_id or "")
        if job is not None:
            return apply(replay, job, event)
        return None if event.job_id in replay.unrestored else "an event of a job not there"
    return of_known_job


def _worker(replay: Replay, event: WorkerReady) -> str | None:
    """A worker's READY: it is back as it was, and must reconnect to keep its task."""
    now = replay.now
    replay.state.workers[event.id] = Worker(
        event.id, b"", event.host, event.host_id, event.pid, event.endpoint, event.prefer,
        now, plain_data=event.plain_data, idle_since=now)
    return None


def _job(replay: Replay, event: JobCreated) -> str | None:
    """A job's registration; a job whose pipeline file is gone is not restored."""
    state = replay.state
    if event.id in state.jobs:
        return "a job created twice"
    blob = state.journal.load_pipeline(event.id) if state.journal else None
    if blob is None:
        replay.unrestored.add(event.id)
        return None
    replay.unrestored.discard(event.id)
    handout = Handout(event.num_splits, event.shuffle_splits, event.seed,
                        layout_of(event.inputs))
    job = state.jobs[event.id] = Job(
        event.id, event.fingerprint, event.name, event.options, blob, handout, event.width,
        event.source_data, event.entropy, replay.now,
        pipeline=dict(event.pipeline) if event.pipeline else None)
    prefix = event.prefix
    if prefix is not None:
        try:
            job.branches = Branches(Member(
                event.fingerprint, tuple(map(str, prefix["prefixes"])),
                tuple(map(str, prefix["names"])), blob, job.pipeline, event.source_data,
                int(prefix["first_tap"]), len(prefix["prefixes"]) - 1))
        except (KeyError, TypeError, ValueError):
            return "a job whose prefixes are malformed (it takes no branches)"
    return None


def _orphan(replay: Replay, job: Job, event: Orphaned) -> str | None:
    """A shared job's last worker's splits, kept for its next worker (failures.py)."""
    if any(token == event.fence for token, _ in job.orphans):
        return "an orphaned fence kept twice"
    try:
        order = {tuple(int(k) for k in key): [int(s) for s in splits]
                 for key, splits in event.order}
    except (TypeError, ValueError):
        return "an orphaned fence whose splits are malformed"
    switches: Switched = {}
    for key, at, weights in event.switches:
        switches.setdefault(tuple(key), []).append((at, tuple(weights)))
    job.orphans.append((event.fence, Fence(event.worker, None, event.died, [], set(), 0.0,
                                           index=event.index, order=order,
                                           answers=dict(event.answers), switches=switches)))
    return None


def _weighed(replay: Replay, job: Job, event: MixWeighed) -> str | None:
    """A shared job's worker's mix took new weights (splits.weighed)."""
    worker = replay.state.workers.get(event.worker)
    if worker is None or worker.task is None or job.tasks.get(worker.task) != worker.id:
        return "new weights of a worker without a task of its job"
    if not splits.note(job, event.worker, event.pass_, event.at, event.weights):
        return "new weights noted twice, or before ones noted already"
    return None


def _adopted(replay: Replay, job: Job, event: OrphanAdopted) -> str | None:
    kept = len(job.orphans)
    job.orphans = [(token, fence) for token, fence in job.orphans if token != event.fence]
    return None if len(job.orphans) < kept else "an adopted fence that was not kept"


def _branch(replay: Replay, job: Job, event: BranchAdded) -> str | None:
    """A branch of a shared job (a pipeline sharing a prefix with its own): back in its
    place, unless its pipeline file is gone (its trainers then get a job of their own)."""
    branches = job.branches
    if branches is None or event.branch != len(branches.members) + 1:
        return "a branch out of its order"
    blob = replay.state.journal.load_pipeline(branch_file(job.id, event.branch)) \
        if replay.state.journal else None
    if blob is None:
        return "a branch whose pipeline file is gone"
    branches.add(Member(event.fingerprint, event.prefixes, event.names, blob,
                        dict(event.pipeline) if event.pipeline else None,
                        dict(event.source_data) if event.source_data else None,
                        event.first_tap, event.tap))
    return None


def _gone(replay: Replay, event: WorkerGone) -> str | None:
    """A worker left the broker (dead, or drained and gone). The splits it lost are not
    re-queued here: each re-queue follows in the journal as an event of its own. A fenced
    one is journaled once its fence is done: a compaction meanwhile left it out already."""
    state = replay.state
    if event.worker not in state.workers:
        return None if event.fenced else "a worker gone that was not there"
    failures.drop_worker(state, event.worker, event.died, replay.now, requeue=False,
                         clean=event.clean)
    return None


def _left(replay: Replay, job: Job, event: WorkerLeft) -> str | None:
    """A worker moved to another job (``placement.preempt``); its re-queues follow, as
    a dead worker's do (a fenced one: see :func:`_gone`)."""
    state = replay.state
    worker = state.workers.get(event.worker)
    if worker is None or job.tasks.get(event.task) != worker.id:
        return None if event.fenced else "a worker leaving a task it did not have"
    failures.leave(state, worker, job, event.task, False, replay.now, requeue=False,
                   stays=True, clean=event.clean)
    return None


def _rounds(replay: Replay, job: Job, event: RoundsSet) -> str | None:
    job.rounds = Rounds(event.size)
    return None


def _task(replay: Replay, job: Job, event: TaskGiven) -> str | None:
    worker = replay.state.workers.get(event.worker)
    if worker is None:
        return "a task for a worker not there"
    if job.tasks.get(event.task, event.worker) != event.worker:
        return "a task given twice"
    job.tasks[event.task] = event.worker
    job.indices[event.task] = event.index
    worker.task = event.task
    return None


def _split(replay: Replay, job: Job, event: SplitHanded) -> str | None:
    """A split handed to a worker: it must run a task of the job, and the split be one of
    its pass's, waiting there (in its order, or re-queued in ``origin``)."""
    key, split = event.pass_, event.split
    worker = replay.state.workers.get(event.worker)
    if worker is None or worker.task is None or job.tasks.get(worker.task) != worker.id:
        return "a split for a worker without a task of its job"
    if split not in splits.split_range(job, key):
        return "a split out of its pass's range"
    if event.origin is not None:
        origin = job.handout.passes.get(event.origin)
        if event.origin == key or event.origin[0] != key[0] or origin is None \
                or split not in origin.requeued:
            return "a split handed twice"
    else:
        handing = job.handout.passes.get(key) or splits.starting(job, key)
        if split not in handing.requeued and split not in handing.order:
            return "a split handed twice"
    splits.take(replay.state, job, event.worker, key, split, event.origin)
    return None


def _requeue(replay: Replay, job: Job, event: SplitRequeued) -> str | None:
    """A split to be read again: one of its pass's, handed out and not waiting already;
    taken back from its worker (a leave, a fence), or, exactly once, one a worker holds
    (a consumer's reread)."""
    key, split = event.pass_, event.split
    handing = job.handout.passes.get(key)
    if handing is None:
        return "a re-queue in a pass not started"
    if split not in splits.split_range(job, key):
        return "a split out of its pass's range"
    if split in handing.requeued:
        return "a split re-queued twice"
    resume = job.handout.resume
    if split in handing.order or (
            resume is not None and resume[0] == key[0] and split in resume[1].done.get(key, ())):
        return "a split re-queued without having been handed out"
    if not job.track and splits.holds(job, key, split):
        return "a split re-queued while a worker holds it"
    splits.requeue(replay.state, job, key, split, event.skip)
    return None


def _resume(replay: Replay, job: Job, event: JobResumed) -> str | None:
    jobs.resume(replay.state, job, {"epoch": event.epoch, "delivered": event.delivered})
    return None


def _consumer_left(replay: Replay, job: Job, event: ConsumerLeft) -> str | None:
    try:
        jobs.note_left(replay.state, job, event.epoch, event.delivered, record=False)
    except ValueError as exc:
        return f"what a consumer that left had yielded is malformed ({exc})"
    return None


def _done(replay: Replay, job: Job, event: PassRead) -> str | None:
    """A worker read the splits it was handed in a pass: one started (or, if it hands no
    split, one it started without a split to journal)."""
    worker = replay.state.workers.get(event.worker)
    if worker is None:
        return "a pass done by a worker not there"
    if event.pass_ not in job.handout.passes:
        if splits.starting(job, event.pass_).order:
            return "a pass done before it started"
        splits.dispenser(replay.state, job, event.pass_)  # it had none to hand
    splits.mark_read(job, event.pass_, event.worker)
    worker.current = None
    return None


def _epoch(replay: Replay, job: Job, event: EpochStarted) -> str | None:
    job.epoch = max(job.epoch, event.epoch)
    return None


def _pass(replay: Replay, job: Job, event: PassKept) -> str | None:
    """A pass as a compacted journal keeps it."""
    key = event.pass_
    if key in job.handout.passes:
        return "a pass kept twice"
    inside = splits.split_range(job, key)
    named = [*event.order, *event.requeued, *(int(split) for split in event.skips),
             *(entry[0] for entry in event.origins if len(entry) == 2),
             *(split for group in (event.handed, event.read) for held in group.values()
               for split in held)]
    if any(split not in inside for split in named):
        return "a split out of its pass's range"
    handing = Pass(
        deque(event.order), {w: list(s) for w, s in event.handed.items()},
        deque(event.requeued), {w: list(s) for w, s in event.read.items()},
        {int(split): skip for split, skip in event.skips.items()})
    for entry in event.origins:
        origin = tuple(entry[-1])
        if len(entry) == 3:
            worker_id, place = entry[0], int(entry[1])
            if place >= len(handing.read.get(worker_id, ())) + len(handing.handed.get(
                    worker_id, ())):
                return "a re-queued split's place past what its worker was handed"
            handing.origins.setdefault(worker_id, {})[place] = origin
            continue
        for worker_id in {*handing.handed, *handing.read}:  # a journal of before: by split
            for place, split in enumerate(
                    [*handing.read.get(worker_id, ()), *handing.handed.get(worker_id, ())]):
                if split == entry[0]:
                    handing.origins.setdefault(worker_id, {})[place] = origin
    job.handout.passes[key] = handing
    return None


def _failed(replay: Replay, job: Job, event: JobFailed) -> str | None:
    job.error = event.error
    jobs.release(replay.state, job, replay.now)
    return None


def _end(replay: Replay, job: Job, event: JobEnded) -> str | None:
    jobs.release(replay.state, job, replay.now)
    del replay.state.jobs[job.id]
    return None


APPLY: dict[type[Event], Apply] = {
    WorkerReady: _worker, JobCreated: _job, WorkerGone: _gone,
    **{kind: _of_job(apply) for kind, apply in (
        (WorkerLeft, _left), (BranchAdded, _branch), (Orphaned, _orphan),
        (OrphanAdopted, _adopted), (RoundsSet, _rounds), (TaskGiven, _task),
        (SplitHanded, _split), (SplitRequeued, _requeue), (JobResumed, _resume),
        (ConsumerLeft, _consumer_left), (PassRead, _done), (EpochStarted, _epoch),
        (PassKept, _pass), (JobFailed, _failed), (JobEnded, _end),
        (MixWeighed, _weighed))},
}
"""Each journal event's record -> how a restarted broker replays it into the tables, or
why it does not fit them."""


def snapshot(state: Tables) -> list[Event]:
    """The journal events that rebuild the state as it is now (for compaction)."""
    events: list[Event] = [WorkerReady.of(w) for w in state.workers.values()]
    for job in state.jobs.values():
        events.append(JobCreated.of(job))
        if job.branches is not None:
            events += [BranchAdded.of(job, k) for k in range(1, len(job.branches.members) + 1)]
        events += [Orphaned.of(job, token, fence) for token, fence in job.orphans]
        if job.rounds is not None:
            events.append(RoundsSet(job=job.id, size=job.rounds.size))
        events.append(EpochStarted(job=job.id, epoch=job.epoch))
        if job.handout.resume is not None:
            epoch, ledger = job.handout.resume
            events.append(JobResumed(job=job.id, epoch=epoch, delivered=ledger.to_json()))
        events += [ConsumerLeft(job=job.id, epoch=epoch, delivered=ledger.to_json())
                   for epoch, ledger in sorted(job.handout.left.items())]
        for task, worker in job.tasks.items():
            events.append(TaskGiven(job=job.id, task=task, worker=worker,
                                    index=job.indices[task]))
        for key, dispenser in job.handout.passes.items():
            events.append(PassKept.of(job, key, dispenser))
        events += [MixWeighed(job=job.id, worker=worker, pass_=key, at=at, weights=w)
                   for worker, switched in job.handout.switches.items()
                   for key, noted in switched.items() for at, w in noted]
        if job.error is not None:
            events.append(JobFailed(job=job.id, error=job.error))
    return events
