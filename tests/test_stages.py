"""Every stage against a plain-Python reference, edge cases included."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from zloader import Pipeline, PipelineError
from zloader.runs import Context


def values(pipeline: Pipeline, epoch: int = 0) -> list:
    return list(pipeline.iter(epoch))


# --- map / filter --------------------------------------------------------------------------

def test_map_matches_python_map():
    assert values(Pipeline.range(20).map(lambda x: x * x + 1)) == [x * x + 1 for x in range(20)]


@pytest.mark.parametrize("calls", [2, 3, 8])
def test_parallel_map_keeps_order_and_runs_concurrently(calls):
    seen_threads = set()
    lock = threading.Lock()

    def slow_square(x):
        with lock:
            seen_threads.add(threading.get_ident())
        return x * x

    result = values(Pipeline.range(200).map(slow_square, num_parallel_calls=calls))
    assert result == [x * x for x in range(200)]
    assert threading.get_ident() not in seen_threads  # ran on the pool, not the caller


def test_parallel_map_stops_its_threads_when_abandoned():
    before = threading.active_count()
    iterator = Pipeline.range(10_000).map(lambda x: x, num_parallel_calls=4).iter()
    assert next(iterator) == 0
    iterator.close()
    assert threading.active_count() == before


def test_filter_matches_python_filter():
    assert values(Pipeline.range(30).filter(lambda x: x % 3 == 1)) == [
        x for x in range(30) if x % 3 == 1]


def test_filter_everything_out_gives_empty():
    assert values(Pipeline.range(10).filter(lambda x: False)) == []


# --- shuffle -------------------------------------------------------------------------------

def test_shuffle_is_a_permutation_and_seeded_epochs_are_reproducible_and_differ():
    pipeline = Pipeline.range(100).shuffle(16, seed=7)
    epoch0, epoch1 = values(pipeline, 0), values(pipeline, 1)
    assert sorted(epoch0) == list(range(100)) == sorted(epoch1)
    assert epoch0 != list(range(100))
    assert epoch0 != epoch1
    assert values(pipeline, 0) == epoch0  # reproducible
    assert values(Pipeline.range(100).shuffle(16, seed=7), 1) == epoch1  # in a new object too


def test_shuffle_buffer_bounds_displacement():
    # With buffer b, the element emitted at output position i was read at input position
    # <= i + b - 1: nothing comes from further ahead than the buffer reaches.
    size, buffer = 500, 10
    out = values(Pipeline.range(size).shuffle(buffer, seed=3))
    assert all(value <= position + buffer - 1 for position, value in enumerate(out))


def test_shuffle_buffer_of_one_keeps_order():
    assert values(Pipeline.range(50).shuffle(1, seed=1)) == list(range(50))


def test_shuffle_without_reshuffle_repeats_epoch_zero_order():
    pipeline = Pipeline.range(64).shuffle(64, seed=5, reshuffle_each_epoch=False)
    assert values(pipeline, 0) == values(pipeline, 3)
    assert values(pipeline, 0) != list(range(64))


def test_shuffle_without_seed_differs_between_runs():
    pipeline = Pipeline.range(200).shuffle(200)
    runs = {tuple(values(pipeline)) for _ in range(3)}
    assert len(runs) > 1
    assert all(sorted(run) == list(range(200)) for run in runs)


def test_shuffle_seed_distinguishes_stages():
    pipeline = Pipeline.range(50).shuffle(50, seed=1).shuffle(50, seed=1)
    once = values(Pipeline.range(50).shuffle(50, seed=1))
    assert values(pipeline) != once  # the second stage does not undo or repeat the first


def test_shuffle_of_empty_input():
    assert values(Pipeline.range(0).shuffle(8, seed=1)) == []


# --- batch / unbatch -----------------------------------------------------------------------

def python_batches(items, size, drop_remainder):
    batches = [items[i:i + size] for i in range(0, len(items), size)]
    if drop_remainder and batches and len(batches[-1]) < size:
        batches.pop()
    return batches


@pytest.mark.parametrize("size", [1, 3, 10, 11, 25])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_batch_matches_python_chunks(size, drop_remainder):
    got = values(Pipeline.range(10).batch(size, drop_remainder=drop_remainder))
    expected = python_batches(list(range(10)), size, drop_remainder)
    assert [b.tolist() for b in got] == expected
    assert all(b.dtype == np.int64 for b in got)


def test_batch_stacks_nested_structures():
    items = [{"x": np.full((2, 3), i, np.float32), "y": (i, f"s{i}"), "z": [i * 0.5, None]}
             for i in range(5)]
    (batch,) = values(Pipeline.from_items(items).batch(5))
    assert batch["x"].shape == (5, 2, 3) and batch["x"].dtype == np.float32
    assert batch["x"][:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert batch["y"][0].tolist() == [0, 1, 2, 3, 4]
    assert batch["y"][1] == ["s0", "s1", "s2", "s3", "s4"]
    assert isinstance(batch["y"], tuple)
    assert batch["z"][0].dtype == np.float64
    assert batch["z"][1] == [None] * 5


def test_batch_of_unequal_shapes_names_the_stage_and_path():
    pipeline = Pipeline.from_items([np.zeros(2), np.zeros(3)]).batch(2, name="collate")
    with pytest.raises(PipelineError, match="collate") as info:
        values(pipeline)
    assert isinstance(info.value, ValueError)
    assert "different shapes" in str(info.value)


def test_batch_of_lists_of_different_lengths_says_how_to_batch_token_rows():
    """(Before: 'sequences of different lengths or types', no more.)"""
    with pytest.raises(PipelineError, match="sequences of 1 and 2 items") as info:
        values(Pipeline.from_items([[1], [2, 3]]).batch(2))
    assert "bucket_by_length(pad_value=...)" in str(info.value)
    assert "batch(k).map(lambda b: pack(tokenize(b))).unbatch()" in str(info.value)


def test_batch_of_empty_input():
    assert values(Pipeline.range(0).batch(4)) == []


def test_unbatch_inverts_batch():
    items = [{"a": np.arange(3) + i, "b": i, "c": f"t{i}"} for i in range(7)]
    rows = values(Pipeline.from_items(items).batch(3).unbatch())
    assert len(rows) == 7
    for row, item in zip(rows, items, strict=True):
        assert row["a"].tolist() == item["a"].tolist()
        assert row["b"] == item["b"] and row["c"] == item["c"]


def test_unbatch_of_plain_lists_yields_items():
    assert values(Pipeline.from_items([[1, 2], [3], []]).unbatch()) == [1, 2, 3]


def _tokenized(batch: np.ndarray) -> list[list[int]]:
    """A tokenizer's output: element ``v`` becomes ``1 + v % 3`` tokens, a list each."""
    return [[int(v)] * (1 + int(v) % 3) for v in batch]


def _packed_rows(batch: np.ndarray) -> list[list[int]]:
    """A packer's output: the batch's elements in rows of two, a list each."""
    tokens = [int(v) for v in batch]
    return [tokens[i:i + 2] for i in range(0, len(tokens), 2)]


def test_unbatch_of_a_list_of_rows_a_map_made_yields_each_row():
    """Lists of numbers (a tokenizer's, ragged; a packer's, of one length) and arrays of
    different lengths are rows, not structure: ``batch`` never makes a list of lists of
    numbers (it stacks numbers into arrays), and structure's leaves have one length.
    (Before: the packer's rows came out transposed, [[0, 2], [1, 3], ...], and the
    tokenizer's raised 'element[1] has 2 rows, others have 1'.)"""
    rows = values(Pipeline.range(6).batch(3).map(_tokenized).unbatch())
    assert rows == [[0], [1, 1], [2, 2, 2], [3], [4, 4], [5, 5, 5]]
    assert values(Pipeline.range(8).batch(4).map(_packed_rows).unbatch()) == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    columns = values(Pipeline.range(4).batch(4).map(
        lambda b: {"ids": _tokenized(b), "n": [1 + int(v) % 3 for v in b]}).unbatch())
    assert columns == [{"ids": [v] * (1 + v % 3), "n": 1 + v % 3} for v in range(4)]
    arrays = values(Pipeline.range(3).batch(3).map(
        lambda b: [np.arange(1 + int(v)) for v in b]).unbatch())
    assert [a.tolist() for a in arrays] == [[0], [0, 1], [0, 1, 2]]
    # What batch makes of list elements stays structure: its rows are the elements.
    assert values(Pipeline.from_items([[1, 2], [3, 4], [5, 6]]).batch(3).unbatch()) == \
        [[1, 2], [3, 4], [5, 6]]
    assert values(Pipeline.from_items([["a", "b"], ["c", "d"]]).batch(2).unbatch()) == \
        [["a", "b"], ["c", "d"]]


def test_unbatch_rejects_scalars_and_ragged_leaves():
    with pytest.raises(PipelineError, match="unbatch"):
        values(Pipeline.range(3).unbatch())
    ragged = {"a": np.zeros(2), "b": np.zeros(3)}
    with pytest.raises(PipelineError, match="rows"):
        values(Pipeline.from_items([ragged]).unbatch())


# --- repeat / take / skip ------------------------------------------------------------------

def test_repeat_count():
    assert values(Pipeline.range(3).repeat(3)) == [0, 1, 2] * 3
    assert values(Pipeline.range(3).repeat(0)) == []


def test_endless_repeat_with_take():
    assert values(Pipeline.range(4).repeat().take(10)) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_endless_repeat_of_empty_input_ends():
    assert values(Pipeline.range(0).repeat()) == []


def test_repeat_after_seeded_shuffle_reshuffles_each_repetition_reproducibly():
    pipeline = Pipeline.range(30).shuffle(30, seed=11).repeat(3)
    out = values(pipeline)
    reps = [out[0:30], out[30:60], out[60:90]]
    assert all(sorted(rep) == list(range(30)) for rep in reps)
    assert len({tuple(rep) for rep in reps}) == 3
    assert values(pipeline) == out
    assert values(pipeline, 1) != out


def test_repeat_after_unseeded_shuffle_still_permutes_each_repetition():
    out = values(Pipeline.range(20).shuffle(20).repeat(2))
    assert sorted(out[:20]) == sorted(out[20:]) == list(range(20))


@pytest.mark.parametrize("n", [0, 1, 5, 10, 50])
def test_take_matches_slicing(n):
    assert values(Pipeline.range(10).take(n)) == list(range(10))[:n]


@pytest.mark.parametrize("n", [0, 1, 5, 10, 50])
def test_skip_matches_slicing(n):
    assert values(Pipeline.range(10).skip(n)) == list(range(10))[n:]


def test_take_stops_pulling_from_upstream():
    pulled = []
    pipeline = Pipeline.range(1000).map(lambda x: pulled.append(x) or x).take(3)
    assert values(pipeline) == [0, 1, 2]
    assert len(pulled) == 3


def test_composed_pipeline_matches_reference():
    rng = random.Random(0)
    data = [rng.randrange(100) for _ in range(57)]
    pipeline = (Pipeline.from_items(data).map(lambda x: x + 1).filter(lambda x: x % 2 == 0)
                .skip(2).take(20).batch(6).unbatch())
    expected = [x + 1 for x in data if (x + 1) % 2 == 0][2:22]
    assert [int(v) for v in values(pipeline)] == expected


# --- immutability and errors ---------------------------------------------------------------

def test_methods_return_new_pipelines_and_leave_the_receiver_unchanged():
    base = Pipeline.range(5)
    mapped = base.map(lambda x: -x)
    assert mapped is not base
    assert values(base) == [0, 1, 2, 3, 4]
    assert len(base.stages) == 0 and len(mapped.stages) == 1
    with pytest.raises(AttributeError):
        base.stages = ()  # type: ignore[misc]


def test_user_error_arrives_as_pipeline_error_of_the_original_type():
    def lookup(x):
        return {}[x]

    pipeline = Pipeline.range(3).map(lookup, name="lookup")
    with pytest.raises(KeyError) as info:
        values(pipeline)
    error = info.value
    assert isinstance(error, PipelineError)
    assert error.stage == "lookup" and error.exc_type == "KeyError"
    assert "return {}[x]" in error.traceback
    assert "lookup" in str(error)


def test_parallel_map_error_names_the_stage():
    def fail_on_five(x):
        if x == 5:
            raise ValueError("five")
        return x

    with pytest.raises(ValueError, match="five") as info:
        values(Pipeline.range(20).map(fail_on_five, num_parallel_calls=4))
    assert info.value.stage == "map(fail_on_five)"


@pytest.mark.parametrize("build, message", [
    (lambda p: p.batch(0), "batch_size must be >= 1"),
    (lambda p: p.batch(2.0), "batch_size must be an int"),
    (lambda p: p.batch(True), "batch_size must be an int"),
    (lambda p: p.batch(2, drop_remainder=1), "drop_remainder must be True or False"),
    (lambda p: p.shuffle(0), "buffer_size must be >= 1"),
    (lambda p: p.shuffle(4, seed=-1), "seed must be >= 0"),
    (lambda p: p.shuffle(4, seed=2**64), "seed must be < 2\\*\\*64"),
    (lambda p: p.map(3), "fn must be callable"),
    (lambda p: p.map(abs, num_parallel_calls=0), "num_parallel_calls must be >= 1"),
    (lambda p: p.filter("x"), "predicate must be callable"),
    (lambda p: p.take(-1), "n must be >= 0"),
    (lambda p: p.skip(-2), "n must be >= 0"),
    (lambda p: p.repeat(-1), "count must be >= 0"),
    (lambda p: p.map(abs, name=""), "name must be a non-empty str"),
    (lambda p: p.iter(-1), "epoch must be >= 0"),
])
def test_bad_arguments_name_the_argument(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build(Pipeline.range(3))


def test_bucket_by_length_batches_similar_lengths_padded_to_the_longest():
    def sequence(n: int) -> dict:
        return {"tokens": np.arange(1, n + 1, dtype=np.int32), "label": n,
                "pair": (np.full((n, 2), n), "x")}

    lengths = [3, 12, 5, 25, 11, 7, 30, 2, 10]
    pipeline = (Pipeline.from_items(lengths).map(sequence)
                .bucket_by_length(lambda e: len(e["tokens"]), [10, 20], [2, 2, 2],
                                  pad_value=-1))
    batches = list(pipeline)
    # Bucket 0: [0, 10), bucket 1: [10, 20), bucket 2: [20, oo), as in tf.data.
    assert [list(b["label"]) for b in batches] == [[3, 5], [12, 11], [25, 30], [7, 2], [10]]
    first = batches[0]
    assert first["tokens"].shape == (2, 5) and first["tokens"].dtype == np.int32
    assert first["tokens"][0].tolist() == [1, 2, 3, -1, -1]
    assert first["pair"][0].shape == (2, 5, 2) and first["pair"][0][0, 3:].tolist() == \
        [[-1, -1], [-1, -1]]
    assert first["pair"][1] == ["x", "x"]
    assert [list(b["label"]) for b in pipeline.bucket_by_length(
        lambda e: e, [1], [1, 1]).take(0)] == []


def test_bucket_by_length_drop_remainder_and_rounds_keep_one_bucket_per_round():
    from zloader.runs import RunSettings

    pipeline = Pipeline.range(40).bucket_by_length(lambda x: x % 10, [5], [3, 3],
                                                   drop_remainder=True)
    assert all(len(b) == 3 for b in pipeline)
    assert sum(len(b) for b in pipeline) == 36  # each bucket's 20 -> 6 batches, 2 dropped
    stage = pipeline.stages[-1]
    ctx = Context(RunSettings(entropy=0, round_size=4))
    batches = list(stage.transform(iter(range(40)), (0,), 1, ctx))
    # Four batches of one bucket at a time; each bucket's last 2 batches make no round.
    assert len(batches) == 8 and ctx.tally.dropped == 4
    for start in range(0, 8, 4):
        assert len({int(x % 10 >= 5) for b in batches[start:start + 4] for x in b}) == 1


@pytest.mark.parametrize(("args", "error", "message"), [
    (([5, 3], [1, 1, 1]), ValueError, "strictly increasing"),
    (([5], [1, 1, 1]), ValueError, "len\\(boundaries\\) \\+ 1"),
    (([0], [1, 1]), ValueError, "boundaries\\[0\\] must be >= 1"),
    (([5], [1, 0]), ValueError, "batch_sizes\\[1\\] must be >= 1"),
    ((5, [1, 1]), TypeError, "boundaries must be a sequence"),
])
def test_bucket_by_length_checks_its_arguments(args, error, message):
    with pytest.raises(error, match=message):
        Pipeline.range(3).bucket_by_length(len, *args)


def test_bucket_by_length_errors_name_the_stage():
    bad_length = Pipeline.range(3).bucket_by_length(lambda x: -1, [5], [1, 1])
    with pytest.raises(PipelineError, match="int >= 0"):
        list(bad_length)
    mismatched = (Pipeline.range(4).map(lambda x: np.zeros((x + 1, x + 1)))
                  .bucket_by_length(lambda a: len(a), [10], [4, 4]))
    with pytest.raises(PipelineError, match="differ beyond axis 0"):
        list(mismatched)
