"""The pool's policy: how many workers each job is entitled to, and which worker moves to
which job when a job lacks its share (docs/pool.md).

Pure functions over small frozen records, no sockets and no clock of their own: the
broker's state machine (``zloader/broker/placement.py``) builds a :class:`Claim` per job and a
:class:`Holding` per busy worker, asks :func:`next_move`, and carries the move out (the
worker leaves its job as a draining worker does, exactly once, then takes the new one).

The rules, in order of preference for the worker that moves:

1. A job that needs no workers now (its consumers are between epochs) or holds more than
   its autoscaler wants gives them to any hungry job.
2. A job gives one to a hungry job when, per unit of weight, it would still hold at least as
   many as the taker after the move (so moves converge: no worker goes back and forth).
3. Time-slicing: a hungry job with no worker at all takes one that has served its current
   job for :data:`SLICE_SECONDS` (more jobs than workers: each gets turns).

Static and deterministic jobs keep their workers mid-epoch (their worker indices are fixed);
between epochs they give them up like any job. A job that does not run exactly-once (shared,
balanced, coordinated, ``exactly_once=False``) has no fence for a move: mid-epoch it gives a
worker only to a hungry job that holds none (rule 3's turn, or any rule when the taker has
nothing), never to even out shares; ``placement`` makes such a move drain the worker first
where it can (docs/pool.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zloader._byfields import FrozenByFields
from zloader._defaults import SLICE_SECONDS

__all__ = ["Claim", "Holding", "next_move", "shares"]

UNBOUNDED = 1 << 30
"""``Claim.wants`` of a job that can use any number of workers."""


@dataclass(eq=False, repr=False)
class Claim(FrozenByFields):
    """What one job asks of the pool now."""

    job: str
    weight: float   # its share relative to the other jobs' (``Loader(weight=)``)
    held: int       # workers running it
    wants: int      # workers it can use: 0 between epochs, its autoscaler's desired count,
    #                 its width (static), else UNBOUNDED
    hungry: bool    # its consumers waited for data lately
    movable: bool   # its workers may be taken from it (dynamic, not deterministic)
    exact: bool = True  # a move mid-epoch repeats nothing (it runs exactly-once, or is idle)


@dataclass(eq=False, repr=False)
class Holding(FrozenByFields):
    """A worker that runs a task of ``job`` since ``since``."""

    worker: str
    job: str
    since: float
    # Among equals, lower moves first: (on its job's consumers' host, -its index), so a
    # remote worker before a local one, then the last assigned.
    rank: tuple[int, int] = (0, 0)


def shares(claims: Iterable[Claim], workers: int) -> dict[str, float]:
    """Each job's entitlement, in workers: ``workers`` divided in proportion to weight
    (max-min fair), no job given more than it wants and the rest shared by the others."""
    left = float(workers)
    open_claims = [c for c in claims if c.wants > 0]
    out = {c.job: 0.0 for c in claims}
    while open_claims and left > 1e-9:
        level = left / sum(c.weight for c in open_claims)
        capped = [c for c in open_claims if c.wants - out[c.job] <= c.weight * level]
        if not capped:
            for claim in open_claims:
                out[claim.job] += claim.weight * level
            break
        for claim in capped:
            left -= claim.wants - out[claim.job]
            out[claim.job] = float(claim.wants)
        open_claims = [c for c in open_claims if c not in capped]
    return out


def next_move(claims: Iterable[Claim], holdings: Iterable[Holding],
              eligible: Callable[[str, str], bool], now: float) -> tuple[str, str] | None:
    """``(worker, job)``: the busy worker to move to ``job``, or None when no move makes the
    pool fairer. ``eligible(worker, job)`` says whether the worker can run that job at all
    (a pipeline only forked workers hold, a worker only its own host can reach).

    Whether a job gives a worker to a taker depends on the two claims (rules 1 and 2) and,
    for rule 3, on how long the worker served; so each taker weighs the giving jobs
    first and looks at the workers of those that would give only (a fleet's usual tick,
    every job at its share, weighs jobs x jobs, not jobs x workers)."""
    by_job = {c.job: c for c in claims}
    by_giver: dict[str, list[Holding]] = {}
    for holding in holdings:
        by_giver.setdefault(holding.job, []).append(holding)
    takers = sorted((c for c in by_job.values() if c.hungry and c.held < c.wants),
                    key=lambda c: (c.held / c.weight, c.job))
    for taker in takers:
        best: tuple[tuple[Any, ...], Holding] | None = None
        for job, held in by_giver.items():
            giver = by_job.get(job)
            if giver is None or giver.job == taker.job or not giver.movable \
                    or (not giver.exact and taker.held > 0):
                continue
            reason = _reason(giver, taker)
            if reason is None and taker.held > 0:
                continue  # rule 3 is for a taker with no worker only
            for holding in held:
                rule = reason
                if rule is None and now - holding.since >= SLICE_SECONDS:
                    rule = 3
                if rule is None:
                    continue
                key = (rule, -giver.held / giver.weight, holding.rank, holding.since)
                if (best is None or key < best[0]) \
                        and eligible(holding.worker, taker.job):
                    best = (key, holding)
        if best is not None:
            return best[1].worker, taker.job
    return None


def _reason(giver: Claim, taker: Claim) -> int | None:
    """Why ``giver`` gives any of its workers to ``taker`` (rule 1 or 2), or None when
    it keeps them (rule 3, a time slice, depends on the worker: see :func:`next_move`)."""
    if giver.held > giver.wants:
        return 1
    after_giver = (giver.held - 1) / giver.weight
    after_taker = (taker.held + 1) / taker.weight
    if after_giver >= after_taker or math.isclose(after_giver, after_taker):
        return 2
    return None
