"""Origins (zloader/lineage.py) in one process: every stage keeps each source element
accounted for exactly once, ledgers close splits, and packed sets round-trip."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader import Pipeline
from zloader.lineage import (
    Assigned,
    Ledger,
    decode_origins,
    digest,
    encode_origins,
    merge_info,
    pack,
    unpack,
)
from zloader.plan import plan
from zloader.stages import Context

SPLITS, SIZE = 6, 25


def tracked(pipeline: Pipeline, skip: dict[int, set[int]] | None = None):
    """Run the worker part with origins; return (values, origins counted, ends)."""
    ctx = Context(entropy=3, track=True, skip_errors=True)
    skip = skip or {}
    feed = lambda key: (Assigned(s, key, frozenset(skip.get(s, ()))) for s in range(SPLITS))
    values, origins = [], collections.Counter()
    for value, origin in plan(pipeline).run_worker(feed, 0, ctx):
        values.append(value)
        origins.update(zip(origin[1::3], origin[2::3], strict=True))
    origins.update(zip(ctx.loose[1::3], ctx.loose[2::3], strict=True))
    return values, origins, ctx.ends


def every_source_element() -> collections.Counter:
    return collections.Counter((s, i) for s in range(SPLITS) for i in range(SIZE))


def flaky(x):
    if x % 7 == 3:
        raise ValueError("bad element")
    return x


@pytest.mark.parametrize("build", [
    lambda p: p.map(lambda x: x * 2),
    lambda p: p.map(flaky),  # on_error="skip": the dropped ones still accounted for
    lambda p: p.map(flaky, num_parallel_calls=3),
    lambda p: p.filter(lambda x: x % 3 == 0),
    lambda p: p.shuffle(40, seed=1).batch(8),
    lambda p: p.batch(8, drop_remainder=True),
    lambda p: p.batch(5).shuffle(10, seed=2).unbatch(),
    lambda p: p.map(lambda x: np.ones(x % 9 + 1)).bucket_by_length(
        len, [4, 8], [3, 3, 3], drop_remainder=True),
])
def test_every_stage_accounts_for_every_source_element_once(build):
    pipeline = build(Pipeline.range(SPLITS * SIZE, split_size=SIZE))
    _, origins, ends = tracked(pipeline)
    assert origins == every_source_element()
    assert sorted((split, count) for _, split, count, _ in ends) == [
        (s, SIZE) for s in range(SPLITS)]


def test_a_split_read_again_skips_what_was_delivered_and_checks_its_digest():
    pipeline = Pipeline.range(SPLITS * SIZE, split_size=SIZE).shuffle(50, seed=0).batch(4)
    _, _, ends = tracked(pipeline)
    expect = {split: (count, crc) for _, split, count, crc in ends}
    skip = {2: set(range(0, SIZE, 2))}
    _, origins, _ = tracked(pipeline, skip)
    assert origins == every_source_element() - collections.Counter(
        (2, i) for i in skip[2])
    ctx = Context(entropy=3, track=True)
    wrong = (expect[1][0], expect[1][1] ^ 1)
    feed = lambda key: [Assigned(1, key, frozenset(), wrong)]
    with pytest.raises(Exception, match="read differently"):
        list(plan(pipeline).run_worker(feed, 0, ctx))


def test_digests_depend_on_the_content_only():
    a = [1, 2.5, "text", b"bytes", None, np.arange(10), {"k": (1, np.ones(3))}]
    crc = 0
    for element in a:
        crc = digest(element, crc)
    again = 0
    for element in [1, 2.5, "text", b"bytes", None, np.arange(10), {"k": (1, np.ones(3))}]:
        again = digest(element, again)
    assert crc == again
    assert digest(np.arange(10), 0) != digest(np.arange(1, 11), 0)


@given(st.sets(st.integers(0, 5000), max_size=300))
@settings(max_examples=100, derandomize=True, deadline=None)
def test_packed_sets_round_trip(values):
    assert unpack(pack(values)) == values


def test_bad_packed_sets_and_origins_are_refused():
    for bad in ("%%%", 5, "AAAA"):
        with pytest.raises(ValueError):
            unpack(bad)
    counts, triples = encode_origins([(0, (0, 1, 2))], [])
    assert decode_origins(counts, triples, 1)[0].tolist() == [0, 1]
    with pytest.raises(ValueError):
        decode_origins(counts, triples, 2)  # counts for another number of elements
    with pytest.raises(ValueError):
        decode_origins(counts, triples[:-8], 1)
    with pytest.raises(ValueError):
        merge_info(None, {"have": "", "expect": "x"})


def test_a_ledger_closes_a_split_once_all_its_elements_are_in_and_round_trips():
    ledger = Ledger()
    keys = [(0,)]
    ledger.add(keys, np.array([[0, 4, i] for i in range(3)]))
    assert ledger.info((0,), 4) == {"have": pack({0, 1, 2})}
    ledger.end((0,), 4, 5, 99)
    assert ledger.info((0,), 4)["expect"] == [5, 99]
    ledger.add(keys, np.array([[0, 4, 3], [0, 4, 4], [0, 7, 0]]))
    assert ledger.info((0,), 4) == {"all": True}
    copy = Ledger()
    copy.merge_json(ledger.to_json())
    assert copy.to_json() == ledger.to_json()
    assert copy.info((0,), 7) == {"have": pack({0})}
    assert merge_info(merge_info(None, copy.info((0,), 7)), {"all": True}) == {"all": True}
