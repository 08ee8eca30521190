"""Argument checks shared by the public API: each raises with the argument's name."""

from __future__ import annotations

import re
from typing import Any

from zloader._defaults import LABEL_LIMIT

_SEED_LIMIT = 2**64


def integer(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``; bools and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np
            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} "
                            f"{value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def optional_integer(name: str, value: Any, minimum: int = 0) -> int | None:
    return None if value is None else integer(name, value, minimum)


def seed(value: Any, name: str = "seed") -> int | None:
    """A seed: None (fresh entropy each run) or an int in [0, 2**64)."""
    if value is None:
        return None
    value = integer(name, value, 0)
    if value >= _SEED_LIMIT:
        raise ValueError(f"{name} must be < 2**64, got {value}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def function(name: str, value: Any) -> Any:
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__} {value!r}")
    return value


def label(name: str, value: Any) -> str | None:
    """An optional display name or version tag: a non-empty str of at most
    ``LABEL_LIMIT`` characters (versions may be ints)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and name == "version":
        return str(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty str, got {_short(value)}")
    if len(value) > LABEL_LIMIT:
        raise ValueError(f"{name} must be at most {LABEL_LIMIT} characters, got "
                         f"{len(value)}: {_short(value)}")
    return value


_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")


def address(name: str, value: Any) -> str:
    """A ZeroMQ address to connect to: ``tcp://HOST:PORT`` (an IPv6 host in brackets) or
    ``ipc://PATH``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be an address like 'tcp://host:5555', got "
                        f"{type(value).__name__} {_short(value)}")
    match = _TCP.fullmatch(value)
    if match is not None and 0 < int(match.group(2)) < 65536:
        return value
    if value.startswith("ipc://") and len(value) > len("ipc://") and "\0" not in value:
        return value
    raise ValueError(f"{name} must be an address like 'tcp://host:5555' (a host and a port "
                     f"from 1 to 65535) or 'ipc:///path', got {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]} ({len(text)} chars)"
