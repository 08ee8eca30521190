"""The compiled core against its pure-Python twins (zloader/_native.py): the same inputs give
the same outputs, byte for byte, over generated inputs; and ``ZLOADER_PURE`` picks the twins.

The compiled module is imported directly, so these tests compare both kernels under
``ZLOADER_PURE=1`` too, and fail where it was not built (``make test`` builds it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader import _core, chunks  # type: ignore[attr-defined]
from zloader.lineage import INDEX_BITS, decode_origins, encode_origins

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


# Origin blocks as workers write them (zloader/lineage/wire.py): reads of splits of two
# passes, elements of one code each or several (a batch's rows, as a tuple or an array),
# loose codes, split ends; then, now and then, one int64 of the block changed to a value
# that breaks a rule, or the block cut or lengthened (a hostile or corrupted record).
_PASS_KEYS = {(0,): 0, (0, 7): 1}
_EDGES = [-1, 0, 1, 2, 3, 7, 64, (1 << 31), (1 << 32) - 1, 1 << 32, (1 << 62), (1 << 63) - 1,
          -(1 << 63)]


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[bytes, int]:
    reads = draw(st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(0, 5)),
                          min_size=1, max_size=4))
    code = st.builds(lambda r, i: r << INDEX_BITS | i, st.integers(0, len(reads) - 1),
                     st.integers(0, 300))
    element = st.one_of(st.tuples(code),
                        st.lists(code, min_size=1, max_size=5).map(tuple),
                        st.lists(code, min_size=1, max_size=5)
                        .map(lambda c: np.array(c, np.int64)))
    if draw(st.booleans()):  # (a batch's rows; past SMALL_ORIGIN_BLOCK, a shuffle's go as codes)
        origins: list = [np.array(draw(st.lists(code, min_size=20, max_size=120)), np.int64)]
    else:
        origins = draw(st.lists(element, min_size=0, max_size=40))
    loose = draw(st.lists(code, max_size=3))
    ends = draw(st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(0, 5),
                                   st.integers(0, 300), st.integers(0, 2**33))
                         .map(list), max_size=3))
    block = np.frombuffer(encode_origins(origins, loose, reads, _PASS_KEYS, ends),
                          np.int64).copy()
    change = draw(st.integers(0, 3))
    if change == 1:
        block[draw(st.integers(0, len(block) - 1))] = draw(st.sampled_from(_EDGES))
    raw = block.tobytes()
    if change == 2:
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif change == 3:
        raw += bytes(8 * draw(st.integers(1, 3)))
    return raw, len(origins)


def _decoded(decode: object, raw: bytes, elements: int) -> object:
    try:
        return decode(raw, elements)  # type: ignore[operator]
    except ValueError as exc:
        return ("ValueError", str(exc))


@settings(max_examples=600, deadline=None)
@given(case=_blocks(), other_count=st.booleans())
def test_the_origin_block_decoders_agree(case: tuple[bytes, int], other_count: bool) -> None:
    raw, elements = case
    elements += other_count  # (a block read for another number of elements)
    pure = _decoded(decode_origins, raw, elements)
    compiled = _decoded(_core.decode_origins, raw, elements)
    if isinstance(pure, tuple):
        assert compiled == pure
        return
    assert not isinstance(compiled, tuple), compiled
    for field in ("keys", "uniform", "counts", "loose", "runs", "ends", "reads", "codes",
                  "groups"):
        assert _same(getattr(pure, field), getattr(compiled, field)), field


def test_zloader_pure_selects_the_pure_twins() -> None:
    script = ("import zloader._native as n, zloader.stages as s, zloader.client.receive as r; "
              "print(n.ACTIVE, s.shuffle_buffer.__module__, r.decode_origins.__module__)")
    env = {**os.environ, "ZLOADER_PURE": "1"}
    pure = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split()
    env.pop("ZLOADER_PURE")
    used = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split()
    assert pure == ["False", "zloader.chunks", "zloader.lineage.wire"]
    assert used == ["True", "zloader._core", "zloader._core"]
    version = subprocess.run([sys.executable, "-m", "zloader.cli", "--version"], env=env,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    assert version.strip().endswith("(compiled core)")


_E2E = """
import hashlib, json, zloader, zloader._native as native
pipeline = zloader.Pipeline.range(20000).shuffle(300, seed=3).batch(64)
digest = hashlib.sha256()
with zloader.Loader(pipeline, num_workers=2, deterministic=True) as loader:
    for batch in loader:
        digest.update(batch.tobytes())
    state = loader.state_dict()
print(json.dumps([native.ACTIVE, digest.hexdigest(), state["epoch"]]))
"""


def test_a_loader_gives_the_same_batches_with_either_kernels() -> None:
    """End to end: a deterministic Loader's shuffled batches, made by forked workers with
    the compiled core and with ZLOADER_PURE=1, are the same bytes."""
    outputs = []
    for pure in ("0", "1"):
        env = {**os.environ, "ZLOADER_PURE": pure}
        done = subprocess.run([sys.executable, "-c", _E2E], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (compiled, *made), (pure, *made_pure) = outputs
    assert (compiled, pure) == (True, False)
    assert made == made_pure
