"""The compiled core: ``zloader._core``, built from zloader/_core.pyx by setup.py when
Cython and a C compiler are at hand (``pip install`` and ``make test`` build it; a build
that fails leaves the pure-Python package, with a warning). Each of its kernels has a
pure-Python twin in the module that owns the work, which gives the same results byte for
byte (tests/test_native.py), and the owner picks one with :func:`pick`.

``ZLOADER_PURE=1`` in the environment selects the pure twins (the tests run the record
path both ways); so does a missing or stale build. :data:`ACTIVE` says which is used.
"""

from __future__ import annotations

import os
import threading
from typing import Any, TypeVar

__all__ = ["ACTIVE", "REASON", "fence", "pick", "summary"]

T = TypeVar("T")

_core: Any = None
REASON = ""
if os.environ.get("ZLOADER_PURE", "").strip() not in ("", "0"):
    REASON = "ZLOADER_PURE is set"
else:
    try:
        from zloader import _core  # type: ignore[attr-defined,no-redef]
    except ImportError as exc:  # (not built here: no compiler, or a checkout never installed)
        REASON = f"not built ({exc})"
    else:
        # A checkout whose zloader/_core.pyx changed since the build (an edit, a git
        # checkout): its kernels may no longer be the twins' (rebuild: pip install -e .).
        # (An installed wheel holds no .pyx; 2 s: files written in one go are not stale.)
        _source = os.path.join(os.path.dirname(__file__), "_core.pyx")
        try:
            _stale = os.path.getmtime(_source) > os.path.getmtime(_core.__file__) + 2
        except (OSError, TypeError):
            _stale = False
        if _stale:
            _core, REASON = None, ("stale build: zloader/_core.pyx changed since it was "
                                   "built (pip install -e . rebuilds it)")

ACTIVE = _core is not None
"""Whether the compiled kernels are used in this process (and the workers it forks)."""


def pick(name: str, pure: T) -> T:
    """The compiled kernel ``name`` when the compiled core is used, else ``pure``."""
    if _core is None:
        return pure
    compiled: T = getattr(_core, name)
    return compiled


def summary() -> str:
    """Which kernels run here, in a few words (``zloader --version``)."""
    return "compiled core" if ACTIVE else f"pure-Python kernels: {REASON}"


_BARRIER = threading.Lock()


def _fence() -> None:
    """A full memory barrier in pure Python, between a write to shared memory and a read
    of what another process writes there (a ring's credits, zloader/transport/ring.py):
    a lock's atomic instruction is one on x86; elsewhere a wake missed for want of one
    costs the wait's timeout. The compiled core's is a real fence."""
    _BARRIER.acquire()
    _BARRIER.release()


fence = pick("fence", _fence)
"""A full memory barrier (sequentially consistent): compiled where built."""
