"""The broker's history in its journal (:mod:`zloader.journal`): the events every concern
records (``Tables.record``) replayed into the tables by a restarted broker, one function
per kind (:data:`APPLY`); a snapshot of the tables as events, for compaction; and the
consumers told when writing the journal failed. It sits above the concerns: replaying
calls their transitions, with recording off (``Tables.replaying``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from zloader.broker import failures, jobs, splits
from zloader.broker.events import (
    EpochStarted,
    Event,
    JobCreated,
    JobEnded,
    JobFailed,
    JobResumed,
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
from zloader.broker.records import Dispatch, Job, Out, Pass, Tables, Worker
from zloader.mixing import layout_of
from zloader.rounds import Rounds
from zloader.transport.messages import Error

__all__ = ["APPLY", "journal_errors", "restore", "snapshot"]

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
    within ``liveness`` heartbeats, or their splits go to others. Returns the number of
    jobs restored."""
    if state.journal is None:
        return 0
    state.replaying = True
    journal = state.journal
    try:
        for number, line in journal.replay():
            try:
                _apply(state, parse(line), now)
            except Exception:  # one bad line must not stop the broker
                log.debug("journal line %d: cannot apply %s", number, line, exc_info=True)
                journal.skipped.append(number)
    finally:
        state.replaying = False
    if journal.skipped:
        shown = ", ".join(map(str, journal.skipped[:20]))
        log.warning("journal %s: skipped %d lines (%s%s) that are torn, not UTF-8 JSON or "
                    "events it could not apply; the rest was restored", journal.path,
                    len(journal.skipped), shown, ", ..." if len(journal.skipped) > 20 else "")
    for job in state.jobs.values():
        job.idle_since = now  # collected unless a consumer comes back
        job.metrics.scaler.cooldown = state.cooldown
    return len(state.jobs)


def _apply(state: Tables, event: Event, now: float) -> None:
    """Replay one event through its kind's function in :data:`APPLY`."""
    APPLY[type(event)](state, event, now)


Apply = Callable[[Tables, Any, float], None]
"""Replays one event of its kind: (the tables, the event, the time)."""


def _of_job(apply: Callable[[Tables, Job, Any, float], None]) -> Apply:
    """``apply`` for an event of a job, run only while the job is known (one whose
    pipeline file is gone is not restored, and neither are its events)."""
    def of_known_job(state: Tables, event: Any, now: float) -> None:
        job = state.jobs.get(event.job_id or "")
        if job is not None:
            apply(state, job, event, now)
    return of_known_job


def _worker(state: Tables, event: WorkerReady, now: float) -> None:
    """A worker's READY: it is back as it was, and must reconnect to keep its task."""
    state.workers[event.id] = Worker(
        event.id, b"", event.host, event.host_id, event.pid, event.endpoint, event.prefer,
        now, plain_data=event.plain_data, idle_since=now)


def _job(state: Tables, event: JobCreated, now: float) -> None:
    """A job's registration; a job whose pipeline file is gone is not restored."""
    blob = state.journal.load_pipeline(event.id) if state.journal else None
    if blob is None:
        return
    dispatch = Dispatch(event.num_splits, event.shuffle_splits, event.seed,
                        layout_of(event.inputs))
    state.jobs[event.id] = Job(
        event.id, event.fingerprint, event.name, event.options, blob, dispatch, event.width,
        event.source_data, event.entropy, now,
        pipeline=dict(event.pipeline) if event.pipeline else None)


def _gone(state: Tables, event: WorkerGone, now: float) -> None:
    """A worker left the broker (dead, or drained and gone). The splits it lost are not
    re-queued here: each re-queue follows in the journal as an event of its own."""
    failures.drop_worker(state, event.worker, event.died, now, requeue=False,
                         clean=event.clean)


def _left(state: Tables, job: Job, event: WorkerLeft, now: float) -> None:
    """A worker moved to another job (``placement.preempt``); its re-queues follow, as
    a dead worker's do."""
    worker = state.workers.get(event.worker)
    if worker is not None and event.task in job.tasks:
        failures.leave(state, worker, job, event.task, False, now, requeue=False,
                       stays=True, clean=event.clean)


def _rounds(state: Tables, job: Job, event: RoundsSet, now: float) -> None:
    job.rounds = Rounds(event.size)


def _task(state: Tables, job: Job, event: TaskGiven, now: float) -> None:
    job.tasks[event.task] = event.worker
    job.indices[event.task] = event.index
    if event.worker in state.workers:
        state.workers[event.worker].task = event.task


def _split(state: Tables, job: Job, event: SplitHanded, now: float) -> None:
    splits.take(state, job, event.worker, event.pass_, event.split)
    if event.origin:
        job.dispatch.origin_of[(event.pass_, event.split)] = event.origin


def _requeue(state: Tables, job: Job, event: SplitRequeued, now: float) -> None:
    splits.requeue(state, job, event.pass_, event.split, event.skip)


def _resume(state: Tables, job: Job, event: JobResumed, now: float) -> None:
    jobs.resume(state, job, {"epoch": event.epoch, "delivered": event.delivered})


def _done(state: Tables, job: Job, event: PassRead, now: float) -> None:
    if event.pass_ in job.dispatch.passes:
        splits.mark_read(job, event.pass_, event.worker)
    worker = state.workers.get(event.worker)
    if worker is not None:
        worker.current = None


def _epoch(state: Tables, job: Job, event: EpochStarted, now: float) -> None:
    job.epoch = max(job.epoch, event.epoch)


def _pass(state: Tables, job: Job, event: PassKept, now: float) -> None:
    """A pass as a compacted journal keeps it."""
    key = event.pass_
    job.dispatch.passes[key] = Pass(
        deque(event.order), {w: list(s) for w, s in event.handed.items()},
        deque(event.requeued), {w: list(s) for w, s in event.read.items()},
        {int(split): skip for split, skip in event.skips.items()})
    for split, origin in event.origins:
        job.dispatch.origin_of[(key, int(split))] = tuple(origin)


def _failed(state: Tables, job: Job, event: JobFailed, now: float) -> None:
    job.error = event.error
    jobs.release(state, job, now)


def _end(state: Tables, job: Job, event: JobEnded, now: float) -> None:
    jobs.release(state, job, now)
    del state.jobs[job.id]


APPLY: dict[type[Event], Apply] = {
    WorkerReady: _worker, JobCreated: _job, WorkerGone: _gone,
    **{kind: _of_job(apply) for kind, apply in (
        (WorkerLeft, _left), (RoundsSet, _rounds), (TaskGiven, _task), (SplitHanded, _split),
        (SplitRequeued, _requeue), (JobResumed, _resume), (PassRead, _done),
        (EpochStarted, _epoch), (PassKept, _pass), (JobFailed, _failed), (JobEnded, _end))},
}
"""Each journal event's record -> how a restarted broker replays it into the tables."""


def snapshot(state: Tables) -> list[Event]:
    """The journal events that rebuild the state as it is now (for compaction)."""
    events: list[Event] = [WorkerReady.of(w) for w in state.workers.values()]
    for job in state.jobs.values():
        events.append(JobCreated.of(job))
        if job.rounds is not None:
            events.append(RoundsSet(job=job.id, size=job.rounds.size))
        events.append(EpochStarted(job=job.id, epoch=job.epoch))
        if job.dispatch.resume is not None:
            epoch, ledger = job.dispatch.resume
            events.append(JobResumed(job=job.id, epoch=epoch, delivered=ledger.to_json()))
        for task, worker in job.tasks.items():
            events.append(TaskGiven(job=job.id, task=task, worker=worker,
                                    index=job.indices[task]))
        for key, dispenser in job.dispatch.passes.items():
            events.append(PassKept.of(job, key, dispenser))
        if job.error is not None:
            events.append(JobFailed(job=job.id, error=job.error))
    return events
