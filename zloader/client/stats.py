"""The one record both of a Loader's threads read: :class:`Stats`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Stats"]


@dataclass
class Stats:
    """A consumer's counters and what it knows of its job.

    The I/O thread writes every field but the last two, which the iterating thread writes
    (and the I/O thread sends to the broker in heartbeats, for its metrics). Each field has
    one writer, and the other thread only reads it: no lock is needed.
    """

    bytes: int = 0  # of records received
    records: int = 0
    private: int = 0  # records that bypassed a full ring
    segments: int = 0  # records too large for the ring, sent in a segment of their own
    held: int = 0  # records whose notice came before an earlier record's DATA message
    skipped: int = 0  # elements the workers dropped (on_error="skip") this epoch
    per_worker: dict[int, int] = field(default_factory=dict)  # elements by worker pid
    lagged: int = 0  # a shared job's elements this trainer lost to the lag policy
    replayed: int = 0  # ... and the elements made again for it (it joined late)
    dropped: int = 0  # elements dropped to keep rounds whole (coordinated reads)
    rejected: int = 0  # corrupt records and malformed messages dropped (logged)
    rounds_lost: int = 0  # the job's rounds lost so far (coordinated reads)
    rounds_missed: int = 0  # rounds this consumer passed over when it (re)joined
    last_progress: float = field(default_factory=time.monotonic)  # when data last came
    was_doing: dict[int, str] = field(default_factory=dict)  # pid -> what a worker that
    # left the job did
    # The job, as the broker last described it.
    stages: dict[str, float] = field(default_factory=dict)  # its workers' seconds by stage
    job_epoch: int | None = None  # its epoch when this consumer joined; None until it did
    entropy: int | None = None  # its random entropy, once known
    share: dict[str, object] | None = None  # a shared job's window settings
    width: int = 1  # its worker indices
    indices: tuple[int, ...] = ()  # those of the workers that serve it now
    # Written by the iterating thread.
    yielded: int = 0  # elements
    wait_seconds: float = 0.0  # waiting for data
