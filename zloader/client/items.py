"""What the I/O thread hands the iterating thread: :class:`Item` s (an exactly-once job's
records carry their :class:`~zloader.lineage.Origins`, checked by the I/O thread)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zloader.lineage import Origins

__all__ = ["Item", "Origins"]


@dataclass
class Item:
    """What the I/O thread hands the iterating thread."""

    kind: str  # "data", "end" (one worker finished the epoch), "done" (all did), "error"
    epoch: int = -1
    worker: str = ""
    index: int = 0
    elements: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    # Exactly-once jobs: where its elements came from (zloader/lineage.py).
    origins: Origins | None = None
