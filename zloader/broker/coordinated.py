"""Coordinated reads (``num_consumers``, docs/coordinated.md): workers ask for round
numbers (ROUND_REQ), consumers say which rounds they received (RECEIVED), and every
consumer of the job is told which rounds were committed or lost (COMMIT). The bookkeeping
itself is :class:`zloader.broker.rounds.Rounds`, one per coordinated job.
"""

from __future__ import annotations

from typing import Any

from zloader.broker.records import Job, Out, Tables
from zloader.broker.rounds import Rounds
from zloader.transport.messages import Commit, Received, Round, RoundReq

__all__ = ["announce", "round_request", "round_status", "rounds_received"]


def round_request(state: Tables, identity: bytes, msg: RoundReq, now: float) -> list[Out]:
    """ROUND_REQ: a worker has a round's elements ready: number it (or refuse, ``round``
    null)."""
    worker = state.worker_at(identity)
    task, epoch, members = msg.task, msg.epoch, list(msg.members)
    job = state.job_of(task)
    if worker is None or job is None or job.rounds is None or worker.task != task:
        return [Out(identity, Round(task=task, epoch=epoch, round=None))]
    number = job.rounds.issue(worker.id, epoch, members)
    return [Out(identity, Round(task=task, epoch=epoch, round=number))]


def rounds_received(state: Tables, identity: bytes, msg: Received, now: float) -> list[Out]:
    """RECEIVED: a consumer received its elements of some rounds: commit the complete
    ones."""
    consumer = state.consumer_at(identity)
    job = state.jobs.get(consumer.job) if consumer is not None else None
    if consumer is None or job is None or job.rounds is None:
        return []
    epoch, numbers = msg.epoch, list(msg.rounds)
    if job.rounds.index_of(consumer.id) is None:
        return []
    committed, again = job.rounds.got(consumer.id, epoch, numbers)
    out = announce(state, job, {epoch: committed} if committed else {}, {})
    if again["rounds"] or again["lost"]:  # answered to this consumer alone
        out.append(Out(identity, Commit(epoch=epoch, rounds=tuple(again["rounds"]),
                                        lost=tuple(again["lost"]),
                                        total_lost=job.rounds.lost)))
    return out


def announce(state: Tables, job: Job, committed: dict[int, list[int]],
             lost: dict[int, list[int]]) -> list[Out]:
    """Tell every consumer of a coordinated job which rounds were committed or lost."""
    assert job.rounds is not None
    out = []
    for epoch in sorted(set(committed) | set(lost)):
        commit = Commit(epoch=epoch, rounds=tuple(committed.get(epoch, ())),
                        lost=tuple(lost.get(epoch, ())), total_lost=job.rounds.lost)
        for consumer_id in job.rounds.members.values():
            consumer = state.consumers.get(consumer_id)
            if consumer is not None:
                out.append(Out(consumer.identity, commit))
    return out


def round_status(rounds: Rounds, epoch: int) -> dict[str, Any]:
    """A coordinated job's rounds for ``zloader status``: consumers, the current epoch's
    rounds numbered, rounds lost so far, indices waiting for a consumer."""
    return {"num_consumers": rounds.size, "epoch": epoch,
            "rounds": rounds.issued.get(epoch, 0), "lost": rounds.lost,
            "vacant": rounds.vacant()}
