"""Which Loaders share a job, and the settings of the window a shared job keeps.

Loaders with ``share=True`` attach to one job when they register with the same broker and
their pipelines have the same fingerprint and these options agree: ``sharding``,
``deterministic``, ``on_error``. Everything else may differ between them (``prefetch``,
``timeout``, ``transport``, ``ring_bytes``, ``num_workers``). The window settings
(``share_window_bytes``, ``share_lag``, ``share_block_seconds``) are those of the Loader that
created the job; later ones are told, not refused.
"""

from __future__ import annotations

from typing import Any

from zloader import _check
from zloader._defaults import DEFAULT_BLOCK_SECONDS, WINDOW_MAX, WINDOW_MIN
from zloader.sharing.window import LAG_POLICIES

__all__ = ["DEFAULT_BLOCK_SECONDS", "KEY_OPTIONS", "default_window_bytes", "settings"]

KEY_OPTIONS = ("sharding", "deterministic", "on_error")
"""Options that must be equal, with the fingerprint, for two Loaders to share a job."""


def default_window_bytes() -> int:
    """A sixteenth of the memory available now, between 64 MiB and 4 GiB (per worker)."""
    import psutil  # here, so that ``import zloader`` stays light

    available = int(psutil.virtual_memory().available)
    return max(WINDOW_MIN, min(WINDOW_MAX, available // 16))


def settings(window_bytes: int | None, lag: str, block_seconds: float) -> dict[str, Any]:
    """Check the window settings of a sharing Loader.

    Raises:
        ValueError / TypeError: a bad value, named in the message.
    """
    size = _check.optional_integer("share_window_bytes", window_bytes, 1 << 16)
    if lag not in LAG_POLICIES:
        raise ValueError(f"share_lag must be one of {', '.join(map(repr, LAG_POLICIES))}, "
                         f"got {lag!r}")
    if (not isinstance(block_seconds, (int, float)) or isinstance(block_seconds, bool)
            or not block_seconds >= 0):
        raise ValueError(f"share_block_seconds must be a number >= 0, got {block_seconds!r}")
    return {"window_bytes": size if size is not None else default_window_bytes(),
            "lag": lag, "block_seconds": float(block_seconds)}
