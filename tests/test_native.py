"""The compiled core against its pure-Python twins (zloader/_native.py): the same inputs give
the same outputs, byte for byte, over generated inputs; and ``ZLOADER_PURE`` picks the twins.

The compiled module is imported directly, so these tests compare both kernels under
``ZLOADER_PURE=1`` too, and fail where it was not built (``make test`` builds it)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader import _core, chunks  # type: ignore[attr-defined]

# A chunk as a split's reading gives it (values, int64 codes), or as later stages do (values,
# a list of origins: tuples of codes; a batch's rows' origins as an int64 array each).
_codes = st.lists(st.integers(0, 2**40), min_size=1, max_size=40)
_listed = st.lists(st.one_of(st.tuples(st.integers(0, 2**40)),
                             st.lists(st.integers(0, 99), min_size=1, max_size=3)
                             .map(lambda c: np.array(c, np.int64))),
                   min_size=1, max_size=40)


@st.composite
def _chunks(draw: st.DrawFn) -> list[tuple[list[object], object]]:
    out = []
    for n in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 9)) == 0:  # (now and then origins of another form)
            origins: object = draw(_listed)
        else:
            origins = np.array(draw(_codes), np.int64)
        values = [(n, k) if k % 3 else f"v{n}.{k}" for k in range(len(origins))]  # type: ignore[arg-type]
        out.append((values, origins))
    return out


def _run(kind: type, size: int, seed: int, track: bool,
         pushed: list[tuple[list[object], object]]) -> tuple[list[object], dict[str, object]]:
    rng = np.random.default_rng(seed)
    buffer = kind(size, rng, track)
    out = [buffer.push(list(values), origins if track else None) for values, origins in pushed]
    out.append(buffer.drain())
    out.append(buffer.drain())  # (nothing left)
    return out, rng.bit_generator.state


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (type(a) is type(b) and a.dtype == b.dtype  # type: ignore[union-attr]
                and a.tobytes() == b.tobytes())  # type: ignore[union-attr]
    if isinstance(a, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
                and all(map(_same, a, b)))  # type: ignore[arg-type]
    return a == b and type(a) is type(b)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 70), seed=st.integers(0, 2**32), track=st.booleans(),
       pushed=_chunks())
def test_the_shuffle_buffers_give_the_same_chunks(size: int, seed: int, track: bool,
                                                  pushed: list) -> None:
    pure, pure_state = _run(chunks.ShuffleBuffer, size, seed, track, pushed)
    compiled, compiled_state = _run(_core.ShuffleBuffer, size, seed, track, pushed)
    assert _same(pure, compiled)
    assert pure_state == compiled_state  # (as many draws taken: the run goes on alike)


def test_a_long_run_compacts_alike() -> None:
    """Many chunks through a small buffer: both compact the pool many times."""
    pushed = [([f"e{n}.{k}" for k in range(256)],
               np.arange(n * 256, (n + 1) * 256, dtype=np.int64)) for n in range(60)]
    for size in (1, 7, 1024):
        pure, _ = _run(chunks.ShuffleBuffer, size, 5, True, pushed)
        compiled, _ = _run(_core.ShuffleBuffer, size, 5, True, pushed)
        assert _same(pure, compiled)
        got = [v for chunk in pure if chunk is not None for v in chunk.values]
        assert sorted(got) == sorted(v for values, _ in pushed for v in values)


def test_zloader_pure_selects_the_pure_twins() -> None:
    script = ("import zloader._native as n, zloader.stages as s; "
              "print(n.ACTIVE, s.shuffle_buffer.__module__)")
    env = {**os.environ, "ZLOADER_PURE": "1"}
    pure = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split()
    env.pop("ZLOADER_PURE")
    used = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split()
    assert pure == ["False", "zloader.chunks"]
    assert used == ["True", "zloader._core"]
    version = subprocess.run([sys.executable, "-m", "zloader.cli", "--version"], env=env,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    assert version.strip().endswith("(compiled core)")
