"""The whole-array helpers of exactly-once bookkeeping (zloader/lineage/): a batch's
origins gathered as one int64 array, the union of many origin runs in one sort, a split's
digest taken by groups of ints (and the earlier way for an earlier reading's digest)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader import Pipeline
from zloader.errors import PipelineError
from zloader.lineage import (
    DIGEST_GROUP,
    DIGEST_MARK,
    INDEX_BITS,
    Assigned,
    Ledger,
    decode_origins,
    digest,
    encode_origins,
    gather,
    merge_runs,
    read_split,
    untag,
)
from zloader.plan import plan
from zloader.runs import Context, RunSettings


def test_gather_takes_tuples_arrays_and_empty_origins_in_order():
    assert gather([(5,), (3,), (9,)]).tolist() == [5, 3, 9]
    mixed = [(1, 2), np.array([7, 8], np.int64), (), (4,)]
    assert gather(mixed).tolist() == [1, 2, 7, 8, 4]
    assert gather([]).dtype == np.int64 and len(gather([])) == 0
    values, codes = untag([("a", (4,)), ("b", (2,))])
    assert values == ["a", "b"] and codes.tolist() == [4, 2]
    values, codes = untag([("a", np.array([4, 5])), ("b", ())])
    assert values == ["a", "b"] and codes.tolist() == [4, 5]


def test_a_tracked_batch_holds_its_rows_origins_as_one_array_that_encodes_alike():
    ctx = Context(RunSettings(entropy=1, track=True))
    feed = lambda key: (Assigned(s, key) for s in range(3))
    pipeline = Pipeline.range(600, split_size=200).shuffle(100, seed=3).batch(64)
    batches = list(plan(pipeline).run_worker(feed, 0, ctx))
    assert all(isinstance(origin, np.ndarray) and origin.dtype == np.int64
               for _, origin in batches)
    as_tuples = [tuple(origin.tolist()) for _, origin in batches]
    tally = ctx.tally
    block = encode_origins([origin for _, origin in batches], [], tally.reads, tally.pass_keys,
                           tally.ends)
    assert block == encode_origins(as_tuples, [], tally.reads, tally.pass_keys, tally.ends)
    ledger = Ledger()
    decode_origins(block, len(batches)).note(ledger)
    assert ledger.done == {(0,): {0, 1, 2}} and not ledger.open


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 200),
                          st.integers(1, 30)), min_size=1, max_size=200),
       st.booleans(), st.sampled_from([1, 400, 10**6]), st.booleans())
@settings(max_examples=200, derandomize=True, deadline=None)
def test_merge_runs_is_the_union_of_the_runs_per_place(rows, wide, spread, counted):
    runs = np.array(rows, np.int64)
    if wide:  # split numbers past the one-key sort: the two-key sort gives the same
        runs[:, 1] += 1 << 21
    # Indices close together are merged by counting, far apart by sorting: the same.
    runs[:, 2] *= spread
    places, starts, ends = merge_runs(np.repeat(runs, 4096 // len(runs) + 1, axis=0)
                                      if counted else runs)
    expected: dict[int, set[int]] = {}
    for pass_id, split, start, length in runs.tolist():
        expected.setdefault(pass_id << INDEX_BITS | split, set()).update(
            range(start, start + length))
    got: dict[int, set[int]] = {}
    for place, start, end in zip(places.tolist(), starts.tolist(), ends.tolist(),
                                 strict=True):
        got.setdefault(place, set()).update(range(start, end))
    assert got == expected
    order = list(zip(places.tolist(), starts.tolist(), strict=True))
    assert order == sorted(order)
    same = places[1:] == places[:-1]
    assert (starts[1:][same] > ends[:-1][same]).all()  # disjoint, not touching


def test_merge_runs_of_many_places_or_a_shuffles_scattered_origins():
    rng = np.random.default_rng(0)
    many = np.array([[0, split, 5, 1] for split in range(40)] * 2, np.int64)
    places, starts, ends = merge_runs(many)  # more places than counted: sorted
    assert places.tolist() == list(range(40)) and set(starts) == {5} and set(ends) == {6}
    indices = rng.permutation(100_000)[:60_000]  # one split, scattered
    runs = np.column_stack((np.zeros(60_000, np.int64), np.full(60_000, 7), indices,
                            np.ones(60_000, np.int64)))
    places, starts, ends = merge_runs(runs)
    held = np.zeros(100_000, bool)
    held[indices] = True
    edges = np.flatnonzero(np.diff(held.view(np.int8), prepend=0, append=0))
    assert (places == 7).all()
    assert starts.tolist() == edges[0::2].tolist() and ends.tolist() == edges[1::2].tolist()


class _Listed:
    """A source of given splits (lists), for read_split."""

    def __init__(self, splits):
        self.splits = splits

    def read(self, split, ctx):
        yield from self.splits[split]


def _read(elements, expect=None, skip=frozenset()):
    ctx = Context(RunSettings(entropy=1, track=True))
    tagged = list(read_split(_Listed([elements]), Assigned(0, (0,), skip, expect), 0, ctx))
    return tagged, tuple(ctx.tally.ends[0][2:])


def test_a_split_digest_by_groups_depends_on_the_elements_only_and_is_marked():
    ints = list(range(3 * DIGEST_GROUP + 7))
    mixed = [*ints[:300], np.arange(4), "s", *ints[:5], 2.5, *ints]
    for elements in (ints, mixed, [np.ones(3)] * 5, []):
        tagged, (count, crc) = _read(elements)
        assert [value for value, _ in tagged] == elements and count == len(elements)
        assert [origin for _, origin in tagged] == [(i,) for i in range(len(elements))]
        assert crc & DIGEST_MARK
        assert _read(list(elements))[1] == (count, crc)
        assert _read(elements, expect=(count, crc))[1] == (count, crc)
    changed = list(ints)
    changed[700] += 1
    assert _read(changed)[1] != _read(ints)[1]
    with pytest.raises(PipelineError, match="read differently"):
        _read(changed, expect=_read(ints)[1])


def test_a_split_read_again_against_a_digest_taken_an_element_at_a_time_takes_it_so():
    """A state saved before digests were taken by groups holds digests without the mark:
    a split read again for it is digested as they were, element by element."""
    elements = [*range(1000), np.arange(3), "x"]
    old = 0
    for element in elements:
        old = digest(element, old)
    assert not old & DIGEST_MARK
    tagged, (count, crc) = _read(elements, expect=(len(elements), old), skip=frozenset({1, 5}))
    assert (count, crc) == (len(elements), old)
    assert [origin for _, origin in tagged][:3] == [(0,), (2,), (3,)]
    with pytest.raises(PipelineError, match="read differently"):
        _read(elements, expect=(len(elements), old ^ 1))


def test_a_source_failing_mid_read_has_the_elements_before_it_yielded_first():
    def failing(split, ctx):
        yield from range(700)
        raise ValueError("disk gone")

    source = _Listed([])
    source.read = failing
    ctx = Context(RunSettings(entropy=1, track=True))
    seen = []
    with pytest.raises(ValueError, match="disk gone"):
        for value, _ in read_split(source, Assigned(0, (0,)), 0, ctx):
            seen.append(value)
    assert seen == list(range(700))


def test_a_slow_source_of_ints_is_not_read_ahead():
    """Ints are read a group at a time only from a quick source: one that takes its time
    for each element is read one at a time, so that its first elements are not held back
    until a group's last has been read."""
    made = []

    class Slow:
        def read(self, split, ctx):
            for i in range(20):
                time.sleep(0.003)  # longer than READ_AHEAD_SECONDS per element
                made.append(i)
                yield i

    ctx = Context(RunSettings(entropy=1, track=True))
    reader = read_split(Slow(), Assigned(0, (0,)), 0, ctx)
    for taken in range(1, 6):
        value, origin = next(reader)
        assert value == taken - 1 and origin == (taken - 1,)
        assert len(made) == taken  # read no further than what was taken
    assert [value for value, _ in reader] == list(range(5, 20))
