"""The broker's history in its journal (:mod:`zloader.journal`): every state change recorded
as an event, replayed into the tables by a restarted broker, and a snapshot of the tables
as events for compaction.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from zloader.broker import failures, jobs, splits
from zloader.broker.records import Job, Out, Pass, Tables, Worker
from zloader.mixing import layout_of
from zloader.options import JobOptions
from zloader.rounds import Rounds
from zloader.transport.protocol import Command

__all__ = ["job_event", "journal_errors", "record", "restore", "snapshot", "worker_event"]

log = logging.getLogger("zloader.broker")


def record(state: Tables, event: dict[str, Any]) -> None:
    """Append ``event`` to the journal (nothing while it is replayed). A write that fails
    (a full disk) marks the job: it could not be resumed after a restart
    (:func:`journal_errors` tells its consumers)."""
    if state.journal is not None and not state.replaying \
            and not state.journal.record(event):
        job = event.get("id") if event["e"] == "job" else event.get("job")
        if isinstance(job, str):
            state.unjournaled.add(job)


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
    """Replay one event (its fields were checked by ``zloader.journal.well_formed``)."""
    kind = event["e"]
    job = state.jobs.get(str(event.get("job")))
    if kind == "worker":
        state.workers[event["id"]] = Worker(
            event["id"], b"", event["host"], event["host_id"], int(event["pid"]),
            event["endpoint"], event.get("prefer"), now,
            plain_data=event.get("plain_data") is True, idle_since=now)
    elif kind == "job":
        _apply_job(state, event, now)
    elif kind == "gone":
        failures.drop_worker(state, event["worker"], bool(event.get("died")), now,
                             requeue=not event.get("fenced"), clean=event.get("clean") is True)
    elif job is not None:
        _apply_to_job(state, job, event, now)


def _apply_job(state: Tables, event: dict[str, Any], now: float) -> None:
    """Replay a job's registration; a job whose pipeline file is gone is not restored."""
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


def _apply_to_job(state: Tables, job: Job, event: dict[str, Any], now: float) -> None:
    """Replay an event of ``job``."""
    kind = event["e"]
    if kind == "left":  # moved to another job (placement.preempt)
        worker = state.workers.get(event["worker"])
        if worker is not None and event["task"] in job.tasks:
            failures.leave(state, worker, job, event["task"], False, now,
                           requeue=not event.get("fenced"), stays=True,
                           clean=event.get("clean") is True)
    elif kind == "rounds":
        job.rounds = Rounds(int(event["size"]))
    elif kind == "task":
        job.tasks[event["task"]] = event["worker"]
        job.indices[event["task"]] = int(event["index"])
        if event["worker"] in state.workers:
            state.workers[event["worker"]].task = event["task"]
    elif kind == "split":
        key = tuple(event["pass"])
        splits.take(state, job, event["worker"], key, int(event["split"]))
        if event.get("origin"):
            job.origin_of[(key, int(event["split"]))] = tuple(event["origin"])
    elif kind == "requeue":
        splits.requeue(state, job, tuple(event["pass"]), int(event["split"]), event["skip"])
    elif kind == "resume":
        jobs.resume(state, job, event)
    elif kind == "done":
        if tuple(event["pass"]) in job.passes:
            splits.mark_read(job, tuple(event["pass"]), event["worker"])
        worker = state.workers.get(event["worker"])
        if worker is not None:
            worker.current = None
    elif kind == "epoch":
        job.epoch = max(job.epoch, int(event["epoch"]))
    elif kind == "pass":  # from a compacted journal
        key = tuple(event["pass"])
        job.passes[key] = Pass(
            deque(event["order"]), {w: list(s) for w, s in event["handed"].items()},
            deque(event["requeued"]), {w: list(s) for w, s in event["read"].items()},
            {int(split): skip for split, skip in event["skips"].items()})
        for split, origin in event["origins"]:
            job.origin_of[(key, int(split))] = tuple(origin)
    elif kind == "failed":
        job.error = event["error"]
        jobs.release(state, job, now)
    elif kind == "end":
        jobs.release(state, job, now)
        del state.jobs[job.id]


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


def worker_event(worker: Worker) -> dict[str, Any]:
    """The event that records a worker's READY."""
    return {"e": "worker", "id": worker.id, "host": worker.host, "host_id": worker.host_id,
            "pid": worker.pid, "endpoint": worker.endpoint, "prefer": worker.prefer,
            "plain_data": worker.plain_data}


def job_event(job: Job) -> dict[str, Any]:
    """The event that records a job's creation."""
    return {"e": "job", "id": job.id, "fingerprint": job.fingerprint, "name": job.name,
            "options": job.options.to_body(), "num_splits": job.num_splits,
            "shuffle_splits": job.shuffle_splits, "seed": job.seed, "width": job.width,
            "source_data": job.source_data, "entropy": job.entropy, "pipeline": job.pipeline,
            **({"inputs": [list(item) for item in job.layout.inputs]}
               if job.layout is not None else {})}
