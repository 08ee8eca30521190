"""One memory budget for a consumer's rings and the records in flight to it.

A consumer reads each co-located worker through a ring of its own, and lets every worker
have up to ``prefetch`` records in flight. Left alone, both grow with the worker count:
64 workers with 64 MiB rings could take 4 GiB of /dev/shm, and 64 workers each with 8
batches of 38 MB on the way hold 19 GB. :class:`Budget` bounds them together
(docs/pipeline.md, "Memory budget"):

- a new ring's capacity is the budget's share for one worker, at most DEFAULT_RING_BYTES
  (a ring's writer reserves only what its records reach, see zloader/transport/ring.py);
- a ring grows for larger records only while all rings together stay within the budget;
- each worker may have at most its share of the budget in flight to the consumer (OPEN's
  ``window``, in bytes; a record larger than that goes alone): once records are too large
  for ``prefetch`` of them to fit, fewer are in flight (at least one), and the Loader
  logs the prefetch this leaves, once per change (``stats()["prefetch"]``).

The default budget is MEMORY_BUDGET_SHM_SHARE of /dev/shm and at most
MEMORY_BUDGET_RAM_SHARE of the host's memory; ``Loader(memory_budget=)`` sets it.
"""

from __future__ import annotations

import logging
import os

from zloader._defaults import (
    DEFAULT_RING_BYTES,
    MEMORY_BUDGET_RAM_SHARE,
    MEMORY_BUDGET_SHM_SHARE,
    RING_BUDGET_SLACK,
)
from zloader.transport.ring import ALIGN

__all__ = ["Budget", "default_budget"]

log = logging.getLogger("zloader.loader")


def default_budget() -> int:
    """MEMORY_BUDGET_SHM_SHARE of /dev/shm's size, at most MEMORY_BUDGET_RAM_SHARE of the
    host's memory (the latter alone where /dev/shm does not say its size)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = int(ram * MEMORY_BUDGET_RAM_SHARE)
    try:
        info = os.statvfs("/dev/shm")
    except OSError:
        return budget
    if info.f_blocks:
        budget = min(budget, int(info.f_blocks * info.f_frsize * MEMORY_BUDGET_SHM_SHARE))
    return budget


class Budget:
    """The memory a consumer's rings and records in flight may take, and the records in
    flight per worker it allows (``limit``: the Loader's ``prefetch`` until records are
    found too large for it). ``width``: the workers the job expects."""

    def __init__(self, total: int | None, prefetch: int, width: int = 1) -> None:
        self.total = total if total is not None else default_budget()
        self.limit = prefetch
        self.width = width  # the workers the job expects: at least this many share it

    def _workers(self, workers: int) -> int:
        return max(1, workers, self.width)

    def window(self, workers: int) -> int:
        """The bytes of records one of ``workers`` workers may have in flight (OPEN)."""
        return self.total // self._workers(workers)

    def ring_bytes(self, workers: int) -> int:
        """A new ring's capacity when ``workers`` co-located workers share the budget."""
        share = self.total // self._workers(workers) // ALIGN * ALIGN
        return max(ALIGN, min(DEFAULT_RING_BYTES, share))

    def may_grow(self, held: int, more: int) -> bool:
        """Whether rings holding ``held`` bytes together may take ``more``."""
        return held + more <= self.total

    def large(self, workers: int) -> int:
        """Records above this size, ``limit`` of them from each of ``workers`` workers, do
        not fit the budget."""
        return self.total // (self._workers(workers) * self.limit)

    def fit(self, record_bytes: int, workers: int) -> None:
        """Lower ``limit`` so that records of ``record_bytes`` from ``workers`` workers
        fit the budget (keeping RING_BUDGET_SLACK records' room per worker: the one its
        user holds, the one being written), and log it when it changes."""
        workers = self._workers(workers)
        share = self.total // workers
        limit = max(1, min(self.limit, share // max(1, record_bytes) - RING_BUDGET_SLACK))
        if limit < self.limit:
            self.limit = limit
            log.warning(
                "the memory budget (%.0f MiB) limits prefetch to %d record%s per worker: "
                "records of %.1f MiB from %d workers; raise memory_budget= (or lower "
                "num_workers) to prefetch more", self.total / 2**20, limit,
                "" if limit == 1 else "s", record_bytes / 2**20, workers)

    @property
    def credit_batch(self) -> int:
        """Credits given back that make one CREDIT: half of ``limit`` (at least one)."""
        return max(1, self.limit // 2)
