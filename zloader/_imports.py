"""Importing zloader's own modules with the cyclic garbage collector paused.

Each import creates many objects that all live on (classes, functions, dataclass
methods), and the collector's full collections walk every object the process holds. In
a trainer that imported torch first (some 175,000 objects tracked) those collections made
``import zloader.torch`` about 50 ms slower, a third of it. Nothing an import creates is
garbage, so nothing is lost by not looking while it runs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the garbage collector for the block, then turn it back on if it was on
    (a process that had turned it off keeps it off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
