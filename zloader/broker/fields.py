"""Fields of REGISTER and READY bodies, checked (the exactly-once rule is
:func:`zloader.lineage.exactly_once`).

Each function takes a value as it came off the wire and returns it checked (or raises
:class:`ProtocolError` naming the field); nothing here changes the broker's state.
"""

from __future__ import annotations

from typing import Any

from zloader._defaults import WEIGHT_RANGE
from zloader.broker.records import INHERITED
from zloader.lineage import exactly_once
from zloader.sharing.window import LAG_POLICIES
from zloader.transport.protocol import ProtocolError

__all__ = ["coordinated", "count", "exactly_once", "holds", "pipeline_ref", "share",
           "source_data", "weight"]


def share(value: Any) -> dict[str, Any] | None:
    """REGISTER's ``share``: a shared job's window settings, or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError("REGISTER: share must be {window_bytes, lag, block_seconds}")
    size, lag, block = value.get("window_bytes"), value.get("lag"), value.get("block_seconds")
    if (isinstance(size, bool) or not isinstance(size, int) or size < 1
            or lag not in LAG_POLICIES or isinstance(block, bool)
            or not isinstance(block, (int, float)) or not block >= 0):
        raise ProtocolError(f"REGISTER: bad share settings {value!r}")
    return {"window_bytes": size, "lag": lag, "block_seconds": float(block)}


def coordinated(value: Any, name: str | None) -> tuple[int, int] | None:
    """REGISTER's ``coordinated``: (num_consumers, consumer_index) or None."""
    if value is None:
        return None
    size = value.get("size") if isinstance(value, dict) else None
    index = value.get("index") if isinstance(value, dict) else None
    if (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 16
            or isinstance(index, bool) or not isinstance(index, int)
            or not 0 <= index < size):
        raise ProtocolError(f"REGISTER: coordinated must be {{size >= 1, 0 <= index < size}}, "
                            f"got {value!r}")
    if not name:
        raise ProtocolError("REGISTER: coordinated reads need a job_name")
    return size, index


def weight(value: Any) -> float:
    """REGISTER.weight: a job's share of the pool relative to other jobs'."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not WEIGHT_RANGE[0] <= value <= WEIGHT_RANGE[1]:
        raise ProtocolError(f"REGISTER: weight must be a number from {WEIGHT_RANGE[0]} to "
                            f"{WEIGHT_RANGE[1]:.0f}")
    return float(value)


def count(value: Any) -> int:
    """REGISTER.balanced: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 16:
        raise ProtocolError(f"REGISTER: balanced must be an int >= 0, got {value!r}")
    return value


def source_data(value: Any) -> dict[str, Any] | None:
    """REGISTER.source_data: where workers fetch in-memory source data, or None."""
    if value is None:
        return None
    if (not isinstance(value, dict) or not isinstance(value.get("endpoint"), str)
            or value.get("kind") not in ("arrays", "items")):
        raise ProtocolError("REGISTER: source_data must be {endpoint, kind: arrays|items}")
    return {"endpoint": value["endpoint"], "kind": value["kind"]}


def holds(value: Any) -> frozenset[str]:
    """READY's ``holds``: the fingerprints of the pipelines a forked worker inherited."""
    if value is None:
        return frozenset()
    if not (isinstance(value, list) and len(value) <= 64
            and all(isinstance(v, str) and len(v) <= 128 for v in value)):
        raise ProtocolError("READY: holds must be a list of at most 64 fingerprints")
    return frozenset(value)


def pipeline_ref(value: Any, blob: bytes) -> dict[str, Any] | None:
    """REGISTER's ``pipeline``: None (the pipeline is the payload), ``{inherited: true}``
    (embedded: the Loader's forked workers hold it) or ``{endpoint, sha256, bytes}`` (the
    Loader serves it; docs/protocol.md)."""
    if value is None:
        if not blob:
            raise ProtocolError("REGISTER: an empty pipeline payload and no 'pipeline' field")
        return None
    if value == INHERITED:
        return dict(INHERITED)
    if (isinstance(value, dict) and isinstance(value.get("endpoint"), str)
            and isinstance(value.get("sha256"), str) and len(value["sha256"]) == 64
            and isinstance(value.get("bytes"), int) and not isinstance(value["bytes"], bool)
            and value["bytes"] >= 0):
        return {"endpoint": value["endpoint"], "sha256": value["sha256"],
                "bytes": value["bytes"]}
    raise ProtocolError("REGISTER: pipeline must be {inherited: true} or "
                        "{endpoint, sha256, bytes}")
