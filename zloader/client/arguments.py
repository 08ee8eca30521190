"""The Loader's arguments that need more than one check (zloader/_check.py has the
single ones): each error names the argument at fault and what to pass instead."""

from __future__ import annotations

import logging
import math
from typing import Any

from zloader import _check
from zloader._defaults import DEFAULT_PREFETCH
from zloader.pipeline import Pipeline
from zloader.sharing.options import settings
from zloader.transport.ring import ALIGN

__all__ = ["DEFAULT_PREFETCH", "ON_ERROR", "SHARDING", "TRANSPORTS", "choice", "coordination",
           "share_settings", "timeout_seconds", "valid_ring_bytes"]

log = logging.getLogger("zloader.loader")

SHARDING = ("dynamic", "static", "off")
TRANSPORTS = ("auto", "tcp")
ON_ERROR = ("raise", "skip")


def timeout_seconds(timeout: Any) -> float:
    """Check ``timeout``: a finite positive number of seconds."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) \
            or not math.isfinite(timeout) or timeout <= 0:
        # nan compares false with everything and inf never elapses: either would
        # silently turn the bound off
        raise ValueError(f"timeout must be a finite positive number of seconds, got "
                         f"{timeout!r}")
    return float(timeout)


def valid_ring_bytes(value: Any) -> int | None:
    """Check ``ring_bytes`` here, not seconds later in the I/O thread."""
    value = _check.optional_integer("ring_bytes", value, ALIGN)
    if value is not None and value % ALIGN:
        raise ValueError(f"ring_bytes must be a multiple of {ALIGN} bytes, got {value}")
    return value


def share_settings(pipeline: Pipeline, broker: str | None, share: bool,
                   window_bytes: int | None, lag: str,
                   block_seconds: float) -> dict[str, Any] | None:
    """Check the sharing arguments: the shared job's window settings, or None without
    ``share``. (What share may not go with is the job's options' rule:
    ``JobOptions.check``.)"""
    if not _check.boolean("share", share):
        return None
    if broker is None:
        raise ValueError("share=True needs a broker that every sharing trainer uses: start "
                         "zloader-broker and pass broker='tcp://HOST:PORT'")
    if not pipeline.shareable:
        log.warning("this pipeline cannot be fingerprinted soundly (see the "
                    "FingerprintWarning), so share=True runs it alone")
    return settings(window_bytes, lag, block_seconds)


def coordination(num_consumers: Any, consumer_index: Any) -> tuple[int, int] | None:
    """Check the coordinated-read arguments: (num_consumers, consumer_index) or None.
    (What they may not go with is the job's options' rule: ``JobOptions.check``.)"""
    if num_consumers is None and consumer_index is None:
        return None
    if num_consumers is None or consumer_index is None:
        given = "num_consumers" if consumer_index is None else "consumer_index"
        raise ValueError(f"{given} was given alone: coordinated reads need both "
                         "num_consumers (how many consumers read the job) and consumer_index "
                         "(this one's, from 0)")
    size = _check.integer("num_consumers", num_consumers, 1)
    index = _check.integer("consumer_index", consumer_index, 0)
    if index >= size:
        raise ValueError(f"consumer_index must be in [0, num_consumers) = [0, {size}), got "
                         f"{index}")
    return size, index


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Check that argument ``name`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
