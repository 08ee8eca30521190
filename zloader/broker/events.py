"""The broker's journal events (zloader/journal.py) made from its records: a worker's
READY and a job's creation, which both the handlers and a snapshot of the tables
(``history.snapshot``) write."""

from __future__ import annotations

from typing import Any

from zloader.broker.records import Job, Worker

__all__ = ["job_event", "worker_event"]


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
