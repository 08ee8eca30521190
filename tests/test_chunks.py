"""Stages that take elements in chunks (a shuffle, a batch): what comes out depends on the
elements and the seed only, never on how they were chunked; origins stay with their values;
the shuffle lets go of what left it; a slow input is not held back for a chunk."""

from __future__ import annotations

import gc
import random
import time

import numpy as np
import pytest

from zloader import Pipeline, PipelineError, codec, collate
from zloader import chunks as zchunks
from zloader._defaults import CHUNK_ELEMENTS, SHUFFLE_DRAW_CHUNK, STACK_LATER_BYTES
from zloader.runs import Context, RunSettings


def reference_shuffle(elements, size, rng):
    """tf.data's buffered shuffle, one element at a time (the stage's specification)."""
    buffer, draws = [], []
    for element in elements:
        if len(buffer) < size:
            buffer.append(element)
            continue
        if not draws:
            draws = rng.integers(0, size, SHUFFLE_DRAW_CHUNK).tolist()
            draws.reverse()
        slot = draws.pop()
        yield buffer[slot]
        buffer[slot] = element
    for slot in rng.permutation(len(buffer)).tolist():
        yield buffer[slot]


def chunked(values, sizes, origins=None):
    """``values`` cut into chunks of the sizes drawn from ``sizes`` (cycled)."""
    at, turn = 0, 0
    while at < len(values):
        size = sizes[turn % len(sizes)]
        turn += 1
        yield zchunks.Chunk(values[at:at + size],
                            None if origins is None else origins[at:at + size])
        at += size


def shuffled(stage, chunks, ctx):
    out = []
    for chunk in stage.transform(chunks, (0,), 1, ctx):
        assert chunk.values, "a chunk is never empty"
        out.append(chunk)
    return out


@pytest.mark.parametrize("size", [1, 7, 100, 1000])
@pytest.mark.parametrize("sizes", [[1], [3, 5, 250], [CHUNK_ELEMENTS], [997]])
def test_shuffle_output_is_the_reference_whatever_the_chunks(size, sizes):
    values = [f"v{i}" for i in range(3000)]
    stage = Pipeline.range(1).shuffle(size, seed=5).stages[-1]
    ctx = Context(RunSettings(entropy=0))
    got = [v for chunk in shuffled(stage, chunked(values, sizes), ctx) for v in chunk.values]
    expected = list(reference_shuffle(values, size, ctx.rng(5, 1, (0,))))
    assert got == expected


@pytest.mark.parametrize("form", ["codes", "tuples", "codes then tuples", "tuples then codes"])
def test_tracked_shuffle_and_batch_keep_each_origin_with_its_value(form):
    values = list(range(5000))
    codes = [10_000 + v for v in values]
    origins: list = [(c,) for c in codes] if form == "tuples" else np.array(codes)
    if form == "codes then tuples":  # (a pool of codes that meets origins of another form)
        chunks = [*chunked(values[:2000], [256], np.array(codes[:2000])),
                  *chunked(values[2000:], [100], [(c,) for c in codes[2000:]])]
    elif form == "tuples then codes":
        chunks = [*chunked(values[:2000], [100], [(c,) for c in codes[:2000]]),
                  *chunked(values[2000:], [256], np.array(codes[2000:]))]
    else:
        chunks = list(chunked(values, [1, 33, 256], origins))
    pipeline = Pipeline.range(1).shuffle(300, seed=1).batch(64)
    shuffle, batch = pipeline.stages
    ctx = Context(RunSettings(entropy=0, track=True))
    out = list(batch.transform(shuffle.transform(iter(chunks), (0,), 1, ctx), (0,), 2, ctx))
    assert sum(len(b) for b, _ in out) == 5000
    for rows, origin in out:
        assert isinstance(origin, np.ndarray) and origin.dtype == np.int64
        assert (origin == rows + 10_000).all()
    assert sorted(np.concatenate([o for _, o in out]).tolist()) == codes


def test_batch_that_drops_its_remainder_keeps_the_dropped_origins_as_loose():
    stage = Pipeline.range(1).batch(4, drop_remainder=True).stages[-1]
    ctx = Context(RunSettings(entropy=0, track=True))
    out = list(stage.transform(chunked(list(range(10)), [3], np.arange(10)), (0,), 1, ctx))
    assert [o.tolist() for _, o in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ctx.tally.loose == [8, 9]


class Counted:
    """An element that counts its live instances."""

    alive = 0

    def __init__(self) -> None:
        Counted.alive += 1

    def __del__(self) -> None:
        Counted.alive -= 1


def test_shuffle_lets_go_of_the_elements_that_left_it():
    size = 500
    stage = Pipeline.range(1).shuffle(size, seed=0).stages[-1]
    ctx = Context(RunSettings(entropy=0))
    Counted.alive = 0

    def chunks():
        for _ in range(200):
            yield zchunks.Chunk([Counted() for _ in range(CHUNK_ELEMENTS)], None)

    most = 0
    for chunk in stage.transform(chunks(), (0,), 1, ctx):
        del chunk  # (no cycles: freed at once, no collection needed)
        most = max(most, Counted.alive)
    # The buffer, plus the chunk coming in and the one going out.
    assert most <= size + 2 * CHUNK_ELEMENTS
    gc.collect()
    assert Counted.alive == 0


def test_a_slow_input_reaches_a_shuffle_one_element_at_a_time():
    def slow(x):
        time.sleep(0.01)
        return x

    pipeline = Pipeline.range(12).map(slow).shuffle(2, seed=0)
    started = time.monotonic()
    first = next(iter(pipeline.iter(0)))
    # Two fill the buffer, the third lets one out: not a chunk of many slow elements.
    assert time.monotonic() - started < 0.5 and first in range(3)
    sizes = [len(chunk.values) for chunk in zchunks.chunks_of(
        (slow(x) for x in range(6)), False)]
    assert sizes == [1] * 6


def test_elements_read_before_the_input_failed_are_handed_on_first():
    def failing():
        yield 1
        yield 2
        raise ValueError("boom")

    chunks = zchunks.chunks_of(failing(), False)
    assert next(chunks).values == [1]
    assert next(chunks).values == [2]
    with pytest.raises(ValueError, match="boom"):
        next(chunks)


def test_a_shuffled_batched_pipeline_matches_the_reference_in_process():
    pipeline = Pipeline.range(2000).map(lambda x: x * 3).shuffle(128, seed=9).batch(50)
    got = np.concatenate(list(pipeline.iter(0))).tolist()
    assert sorted(got) == [x * 3 for x in range(2000)]
    ctx = Context(RunSettings(entropy=0))
    rng = ctx.rng(9, 2, (0,))
    assert got == list(reference_shuffle([x * 3 for x in range(2000)], 128, rng))


def test_batch_at_the_end_of_a_worker_leaves_large_arrays_to_the_record():
    rows = [np.full((128, 128), i, np.uint8) for i in range(8)]
    assert STACK_LATER_BYTES <= 8 * 128 * 128
    later = collate.stack(rows, later=True)
    assert isinstance(later, codec.Stacked)
    assert (np.asarray(later) == np.stack(rows)).all()
    assert isinstance(collate.stack(rows), np.ndarray)
    small = [np.zeros(4, np.uint8)] * 8
    assert isinstance(collate.stack(small, later=True), np.ndarray)
    nested = collate.stack([{"image": r, "label": i} for i, r in enumerate(rows)], later=True)
    assert isinstance(nested["image"], codec.Stacked)
    assert nested["label"].tolist() == list(range(8))
    strided = [r[:, ::2] for r in rows] * 2
    assert isinstance(collate.stack(strided, later=True), np.ndarray)  # not contiguous


def test_batches_of_large_arrays_from_workers_equal_those_made_in_process():
    import zloader

    def image(i):
        return {"image": np.full((64, 64, 3), i % 251, np.uint8), "label": i}

    pipeline = Pipeline.range(400, split_size=50).map(image).batch(20)
    with zloader.Loader(pipeline, num_workers=2) as loader:
        got = list(loader)
    assert all(isinstance(b["image"], np.ndarray) for b in got)
    labels = np.concatenate([b["label"] for b in got])
    assert sorted(labels.tolist()) == list(range(400))
    for batch in got:
        expected = np.stack([image(int(i))["image"] for i in batch["label"]])
        assert (batch["image"] == expected).all()


@pytest.mark.parametrize(("values", "message"), [
    ([1, "a"], "mixes a number with str"),
    ([1.5, None], "mixes a number with NoneType"),
    ([1, 2**70], "ints do not fit in int64"),
    ([1, b"x"], "mixes a number with bytes"),
])
def test_numbers_that_cannot_be_batched_still_say_why(values, message):
    with pytest.raises(TypeError, match=message):
        collate.stack(values)
    with pytest.raises(PipelineError, match=message):
        list(Pipeline.from_items(values).batch(2))


def test_numbers_batch_to_the_dtype_numpy_gives():
    assert collate.stack([1, 2, 3]).dtype == np.int64
    assert collate.stack([True, False]).dtype == np.bool_
    assert collate.stack([1, 2.5]).dtype == np.float64
    assert collate.stack([np.float32(1), np.float32(2)]).dtype == np.float32
    shuffled_ints = random.Random(0).sample(range(100), 100)
    assert collate.stack(shuffled_ints).tolist() == shuffled_ints


def test_light_elements_are_read_ahead_and_heavy_ones_as_they_are_used():
    from zloader.lineage import Assigned, light, read_split_chunks

    assert light([1, 2.5, None, "path/to/a.jpg", b"x" * 100, ("a.jpg", 3)])
    assert light([np.zeros(3)]) and light([{"x": np.zeros((28, 28), np.uint8), "y": np.int64(1)}])
    assert not light([np.zeros((224, 224, 3), np.uint8)]) and not light(["x" * 5000])
    assert not light([("a.jpg", np.zeros(10**4))]) and not light([tuple(range(20))])
    assert not light([object()]) and not light([{"a": [1, 2]}])  # (one level deep)

    class Listed:
        def __init__(self, items):
            self.items = items

        def read(self, split, policy=None):
            return iter(self.items)

    def sizes(items):
        ctx = Context(RunSettings(entropy=0, track=True))
        return [len(values) for values, _ in read_split_chunks(Listed(items), Assigned(0, (0,)),
                                                               0, ctx)]

    assert sizes([f"p{i}" for i in range(100)]) == [1, 2, 4, 8, 16, 32, 37]
    assert sizes([np.full(1024, i) for i in range(5)]) == [1] * 5  # 8 KiB each
    assert sizes(list(range(600))) == [1, 255, 256, 88]  # ints: the digest's groups


@pytest.mark.parametrize("shuffled", [False, True])
def test_tracked_batches_of_batches_hold_their_own_rows_origins(shuffled):
    from zloader import plan
    from zloader.lineage import Assigned

    pipeline = Pipeline.range(400, split_size=100).batch(4)
    if shuffled:
        pipeline = pipeline.shuffle(7, seed=1)
    ctx = Context(RunSettings(entropy=0, track=True))
    feed = lambda key: (Assigned(s, key) for s in range(4))

    def code(value):
        return ctx.tally.reads.index((0, value // 100)) << 32 | value % 100

    out = list(plan.plan(pipeline.batch(3)).run_worker(feed, 0, ctx))
    assert sum(rows.shape[0] for rows, _ in out) == 100
    for rows, origin in out:  # each its own 12 elements' (or 4 a row), none of another's
        assert sorted(origin.tolist()) == sorted(code(int(v)) for v in rows.reshape(-1))
    # A batch of batches unbatched: its rows hold 4 elements each, which the unbatch
    # cannot tell apart once they are one batch's; exactly-once refuses it up front
    # (zloader/groups.py), as it could not make such a row again.
    from zloader.groups import pipeline_refusal
    refused = pipeline_refusal(pipeline.batch(3).unbatch().batch(5, drop_remainder=True))
    assert refused is not None and "'batch(4)'" in refused


def test_an_element_stage_after_the_source_gets_non_int_elements_as_it_asks_for_them():
    """(a torch dataset's batches, with their random draws, are made in their turn)"""
    from zloader.lineage import Assigned, read_split

    made = []

    class Counting:
        def read(self, split, policy=None):
            for i in range(50):
                made.append(i)
                yield f"p{i}"

    ctx = Context(RunSettings(entropy=0, track=True))
    elements = read_split(Counting(), Assigned(0, (0,)), 0, ctx)
    for taken in range(1, 6):
        next(elements)
        assert len(made) == taken
