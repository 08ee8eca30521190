"""A job's view for its consumers (the JOB body) and who gets it: read by every concern
that changes what a consumer must know (a worker joins or leaves the job, a split is
re-queued, the job fails)."""

from __future__ import annotations

from typing import Any

from zloader.broker import splits
from zloader.broker.records import Job, Out, Tables
from zloader.transport import messages

__all__ = ["busy_workers", "job_view", "tell_consumers"]


def job_view(state: Tables, job: Job, busy: int | None = None) -> messages.Job:
    """The JOB: the job's workers, failures, pending re-reads, rounds and fences.
    ``busy``: how many of the broker's workers run a task (counted here if not given: a
    caller making many views counts once)."""
    workers: list[dict[str, Any]] = []
    for task, worker_id in job.tasks.items():
        worker = state.workers.get(worker_id)
        if worker is not None:
            workers.append({"worker": worker.id, "task": task,
                            "endpoint": worker.endpoint,
                            "host_id": worker.host_id, "index": job.indices[task],
                            "pid": worker.pid, "host": worker.host,
                            "plain_data": worker.plain_data})
            if worker.doing is not None:
                workers[-1]["doing"] = worker.doing
    workers.sort(key=lambda w: w["index"])
    fencing: dict[str, int] = {}
    for fence in job.fences.values():
        for key, _ in fence.splits:
            fencing[str(key[0])] = fencing.get(str(key[0]), 0) + 1
    # Made by the broker, so known good: built without the frozen record's __init__ (a
    # view goes out with every consumer's heartbeat answer).
    return messages.Job.checked(dict(
        job=job.id, workers=tuple(workers), failed=tuple(job.handout.failed), error=job.error,
        heartbeat=state.heartbeat, consumers=len(job.consumers | set(job.silent)),
        busy_elsewhere=(busy_workers(state) if busy is None else busy)
        - sum(1 for t, w in job.tasks.items()
              if (worker := state.workers.get(w)) is not None and worker.task == t),
        pending=splits.pending(job), share=job.share, epoch=job.epoch, width=job.width,
        entropy=job.entropy, stages={k: round(v, 3) for k, v in job.metrics.stages.items()},
        state="failed" if job.error else "running",
        rounds=job.rounds.view() if job.rounds is not None else None,
        fences=tuple({"id": token, "worker": fence.worker, "task": fence.task,
                      "splits": [[list(key), split] for key, split in fence.splits],
                      "waiting": sorted(fence.waiting),
                      **({"taker": fence.taker} if fence.taker is not None else {})}
                     for token, fence in job.fences.items()),
        fencing=fencing or None, joined=None, read=None, drained=tuple(job.drained)))


def tell_consumers(state: Tables, job: Job) -> list[Out]:
    """The job's view, to each of its consumers."""
    view = job_view(state, job)
    return [Out(c.identity, view) for c in state.consumers_of(job)]


def busy_workers(state: Tables) -> int:
    """How many of the broker's workers run a task: the jobs' tasks, counted per job (a
    task is its worker's from ``placement.give`` to ``failures.leave`` or
    ``jobs.release``, which change both), not per worker (every consumer's heartbeat
    answer counts them, and a fleet's workers outnumber its jobs)."""
    return sum(len(j.tasks) for j in state.jobs.values())
