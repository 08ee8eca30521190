"""A worker process's C allocator, set up for records made afresh.

A pipeline that makes a large array for every element (a decoded image batch) allocates
and frees one block of that size per record. Left alone, glibc serves a block above its
mmap threshold with a fresh mapping and unmaps it when freed, or keeps it in the arena of
the thread that made it and trims it back to the kernel: either way the next record's
memory is new to the process, and the kernel zeroes and faults in every page of it. With
fresh 9.6 MB batches (bench.transport section h) that cost as much system time as making
the batch did user time, in the producer thread of every worker.

:func:`keep_freed_memory` sets glibc so that such blocks come from one heap and stay mapped
when freed (up to ``MALLOC_TRIM_THRESHOLD`` bytes of them): the next record reuses memory
that is already the process's. It changes nothing else: blocks above
``MALLOC_MMAP_THRESHOLD`` (glibc's largest) are still mapped for each record, and other C
libraries are left as they are.
"""

from __future__ import annotations

import ctypes
import logging
import os

from zloader._defaults import MALLOC_ARENAS, MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD

__all__ = ["keep_freed_memory"]

log = logging.getLogger("zloader.worker")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return False


def keep_freed_memory() -> bool:
    """Set this process's C allocator to reuse the memory of freed large blocks (see the
    module's docstring). Call it once, early in a worker process; calling it again does
    no harm.

    Returns:
        Whether the settings were applied (False where the C library is not glibc).
    """
    if not _glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = all(mallopt(parameter, value) == 1 for parameter, value in (
        (_M_ARENA_MAX, MALLOC_ARENAS),
        (_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)))
    if not applied:
        log.debug("mallopt refused a setting: the allocator keeps its defaults")
    return applied
