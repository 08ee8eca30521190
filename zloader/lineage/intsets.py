"""Sets of small ints as short strings (a compressed bitmap in base64): how a ledger's
indices travel in JSON bodies and states.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["pack", "unpack"]


def pack(values: Iterable[int]) -> str:
    """A set of ints >= 0 as base64 of a compressed bitmap."""
    array = values if isinstance(values, np.ndarray) else np.fromiter(values, np.int64)
    if not len(array):
        return ""
    mask = np.zeros(int(array.max()) + 1, bool)
    mask[array] = True
    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes())).decode()


def unpack(text: Any, limit: int = 1 << 32) -> set[int]:
    """The set :func:`pack` made.

    Raises:
        ValueError: ``text`` is not one (or holds more than ``limit`` bits).
    """
    if text == "":
        return set()
    if not isinstance(text, str):
        raise ValueError(f"a packed set must be a string, not {type(text).__name__}")
    try:
        raw = zlib.decompressobj().decompress(base64.b64decode(text, validate=True),
                                              limit // 8 + 1)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"not a packed set: {exc}") from None
    return set(np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8))).tolist())
