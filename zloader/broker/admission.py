"""Admission: whether a REGISTER may make one more job, within the broker's :class:`Limits`
(``records.py``; docs/reliability.md, "Floods").

A job holds its pickled pipeline and its records until it ends, so what peers can make
the broker hold is bounded twice: per connection (the one whose REGISTER made the job: a
Loader makes one), and for all together (so that many connections cannot do it either).
Past a bound the REGISTER is refused with an ERROR that names the limit, its flag and its
constant; the refusal costs one pass over the jobs, and makes nothing.
"""

from __future__ import annotations

import logging

from zloader._defaults import REFUSALS_LOGGED_EVERY
from zloader.broker.records import Out, Tables
from zloader.transport.messages import Error

__all__ = ["admit"]

log = logging.getLogger("zloader.broker")


def admit(state: Tables, identity: bytes, pipeline_bytes: int, now: float) -> list[Out]:
    """The ERROR that refuses a new job of ``pipeline_bytes`` bytes registered by
    ``identity``, or nothing when it is within every limit."""
    why = _over(state, identity, pipeline_bytes)
    if why is None:
        return []
    state.refused += 1
    if now - state.refusal_logged >= REFUSALS_LOGGED_EVERY:
        state.refusal_logged = now
        log.warning("refused a REGISTER from %s: %s (%d refused so far)", identity.hex(),
                    why, state.refused)
    return [Out(identity, Error(message=f"the broker refused a new job: {why}"))]


def _over(state: Tables, identity: bytes, pipeline_bytes: int) -> str | None:
    """Which limit a new job would pass, in words, or None."""
    limits = state.limits
    if len(state.jobs) >= limits.jobs:
        return _said(f"it holds {len(state.jobs)} jobs, its most", "--max-jobs", "MAX_JOBS")
    mine = held = peer_bytes = 0
    for job in state.jobs.values():
        held += len(job.blob)
        if job.owner == identity:
            mine += 1
            peer_bytes += len(job.blob)
    if mine >= limits.peer_jobs:
        return _said(f"this connection made {mine} jobs it still holds, the most one peer "
                     "may", "--max-peer-jobs", "MAX_PEER_JOBS")
    if peer_bytes + pipeline_bytes > limits.peer_pipeline_bytes:
        return _said(f"this connection's jobs would hold {peer_bytes + pipeline_bytes} bytes "
                     f"of pipelines, more than the {limits.peer_pipeline_bytes} one peer may",
                     "--max-peer-pipeline-bytes", "MAX_PEER_PIPELINE_BYTES")
    if held + pipeline_bytes > limits.pipeline_bytes:
        return _said(f"its jobs would hold {held + pipeline_bytes} bytes of pipelines, more "
                     f"than the {limits.pipeline_bytes} it keeps in all",
                     "--max-pipeline-bytes", "MAX_PIPELINE_BYTES_HELD")
    return None


def _said(what: str, flag: str, constant: str) -> str:
    return (f"{what} (raise zloader-broker {flag}, default {constant} in "
            "zloader/_defaults/; or end jobs that are no longer read)")
