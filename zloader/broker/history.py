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
from zloader.broker.events import job_event, worker_event
from zloader.broker.records import Job, Out, Pass, Tables, Worker
from zloader.mixing import layout_of
from zloader.options import JobOptions
from zloader.rounds import Rounds
from zloader.transport.protocol import Command

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
                out.append(Out(consumer.identity, Command.ERROR,
                               {"message": state.journal.failure}))
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
        for number, event in journal.replay():
            try:
                _apply(state, event, now)
            except Exception:  # one bad line must not stop the broker
                log.debug("journal line %d: cannot apply %s", number, event, exc_info=True)
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
        job.scaler.cooldown = state.cooldown
    return len(state.jobs)


def _apply(state: Tables, event: dict[str, Any], now: float) -> None:
    """Replay one event (its fields were checked by ``zloader.journal.well_formed``): a
    worker's or a job's through its kind's function in :data:`APPLY`; a job's other
    events only while the job is known (one whose pipeline file is gone is not)."""
    apply = APPLY[event["e"]]
    if event["e"] in _OF_NO_JOB:
        apply(state, None, event, now)
        return
    job = state.jobs.get(str(event.get("job")))
    if job is not None:
        apply(state, job, event, now)


def _worker(state: Tables, job: None, event: dict[str, Any], now: float) -> None:
    """A worker's READY: it is back as it was, and must reconnect to keep its task."""
    state.workers[event["id"]] = Worker(
        event["id"], b"", event["host"], event["host_id"], int(event["pid"]),
        event["endpoint"], event.get("prefer"), now,
        plain_data=event.get("plain_data") is True, idle_since=now)


def _job(state: Tables, job: None, event: dict[str, Any], now: float) -> None:
    """A job's registration; a job whose pipeline file is gone is not restored."""
    blob = state.journal.load_pipeline(event["id"]) if state.journal else None
    if blob is None:
        return
    state.jobs[event["id"]] = Job(
        event["id"], event["fingerprint"], event["name"],
        JobOptions.from_body(event["options"]), blob,  # Wrong: the line is skipped
        event["num_splits"], event["shuffle_splits"], event["seed"], event["width"],
        event["source_data"], event["entropy"], now,
        pipeline=dict(event["pipeline"]) if event.get("pipeline") else None,
        layout=layout_of(event.get("inputs")))


def _gone(state: Tables, job: None, event: dict[str, Any], now: float) -> None:
    """A worker left the broker (dead, or drained and gone)."""
    failures.drop_worker(state, event["worker"], bool(event.get("died")), now,
                         requeue=not event.get("fenced"), clean=event.get("clean") is True)


def _left(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    """A worker moved to another job (``placement.preempt``)."""
    worker = state.workers.get(event["worker"])
    if worker is not None and event["task"] in job.tasks:
        failures.leave(state, worker, job, event["task"], False, now,
                       requeue=not event.get("fenced"), stays=True,
                       clean=event.get("clean") is True)


def _rounds(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    job.rounds = Rounds(int(event["size"]))


def _task(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    job.tasks[event["task"]] = event["worker"]
    job.indices[event["task"]] = int(event["index"])
    if event["worker"] in state.workers:
        state.workers[event["worker"]].task = event["task"]


def _split(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    key = tuple(event["pass"])
    splits.take(state, job, event["worker"], key, int(event["split"]))
    if event.get("origin"):
        job.origin_of[(key, int(event["split"]))] = tuple(event["origin"])


def _requeue(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    splits.requeue(state, job, tuple(event["pass"]), int(event["split"]), event["skip"])


def _resume(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    jobs.resume(state, job, event)


def _done(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    if tuple(event["pass"]) in job.passes:
        splits.mark_read(job, tuple(event["pass"]), event["worker"])
    worker = state.workers.get(event["worker"])
    if worker is not None:
        worker.current = None


def _epoch(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    job.epoch = max(job.epoch, int(event["epoch"]))


def _pass(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    """A pass as a compacted journal keeps it."""
    key = tuple(event["pass"])
    job.passes[key] = Pass(
        deque(event["order"]), {w: list(s) for w, s in event["handed"].items()},
        deque(event["requeued"]), {w: list(s) for w, s in event["read"].items()},
        {int(split): skip for split, skip in event["skips"].items()})
    for split, origin in event["origins"]:
        job.origin_of[(key, int(split))] = tuple(origin)


def _failed(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    job.error = event["error"]
    jobs.release(state, job, now)


def _end(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    jobs.release(state, job, now)
    del state.jobs[job.id]


APPLY: dict[str, Callable[[Tables, Any, dict[str, Any], float], None]] = {
    "worker": _worker, "job": _job, "gone": _gone, "left": _left, "rounds": _rounds,
    "task": _task, "split": _split, "requeue": _requeue, "resume": _resume, "done": _done,
    "epoch": _epoch, "pass": _pass, "failed": _failed, "end": _end,
}
"""Each journal event's kind -> how a restarted broker replays it into the tables."""

_OF_NO_JOB = frozenset({"worker", "job", "gone"})
"""The kinds that are not a known job's events (a worker's, or a job's creation)."""


def snapshot(state: Tables) -> list[dict[str, Any]]:
    """The journal events that rebuild the state as it is now (for compaction)."""
    events: list[dict[str, Any]] = [worker_event(w) for w in state.workers.values()]
    for job in state.jobs.values():
        events.append(job_event(job))
        if job.rounds is not None:
            events.append({"e": "rounds", "job": job.id, "size": job.rounds.size})
        events.append({"e": "epoch", "job": job.id, "epoch": job.epoch})
        if job.resume is not None:
            events.append({"e": "resume", "job": job.id, "epoch": job.resume[0],
                           "delivered": job.resume[1].to_json()})
        for task, worker in job.tasks.items():
            events.append({"e": "task", "job": job.id, "task": task, "worker": worker,
                           "index": job.indices[task]})
        for key, dispenser in job.passes.items():
            events.append({"e": "pass", "job": job.id, "pass": list(key),
                           "order": list(dispenser.order),
                           "requeued": list(dispenser.requeued),
                           "handed": dispenser.handed, "read": dispenser.read,
                           "skips": dispenser.skips,
                           "origins": [[split, list(origin)] for (k, split), origin
                                       in job.origin_of.items() if k == key]})
        if job.error is not None:
            events.append({"e": "failed", "job": job.id, "error": job.error})
    return events
