"""Origins (zloader/lineage/) in one process: every stage keeps each source element
accounted for exactly once, ledgers close splits, and packed sets round-trip."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader import Pipeline
from zloader.lineage import (
    INDEX_BITS,
    INDEX_MASK,
    Assigned,
    Ledger,
    Ranges,
    decode_origins,
    digest,
    encode_origins,
    merge_info,
    pack,
    unpack,
)
from zloader.plan import plan
from zloader.runs import Context, RunSettings

SPLITS, SIZE = 6, 25


def tracked(pipeline: Pipeline, skip: dict[int, set[int]] | None = None):
    """Run the worker part with origins; return (values, origins counted, ends)."""
    ctx = Context(RunSettings(entropy=3, track=True, skip_errors=True))
    skip = skip or {}
    feed = lambda key: (Assigned(s, key, frozenset(skip.get(s, ()))) for s in range(SPLITS))
    values, origins = [], collections.Counter()

    def places(codes):  # (split, index) of each origin code
        return [(ctx.tally.reads[c >> INDEX_BITS][1], c & INDEX_MASK) for c in codes]

    for value, origin in plan(pipeline).run_worker(feed, 0, ctx):
        values.append(value)
        origins.update(places(origin))
    origins.update(places(ctx.tally.loose))
    return values, origins, ctx.tally.ends


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
    ctx = Context(RunSettings(entropy=3, track=True))
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
    block = encode_origins([(2,)], [], [(0, 1)], {(0,): 0}, [])
    assert decode_origins(block, 1).runs.tolist() == [[0, 1, 2, 1]]
    with pytest.raises(ValueError):
        decode_origins(block, 2)  # a block for another number of elements
    with pytest.raises(ValueError):
        decode_origins(block[:-8], 1)
    with pytest.raises(ValueError):
        merge_info(None, {"have": "", "expect": "x"})


def test_a_ledger_closes_a_split_once_all_its_elements_are_in_and_round_trips():
    ledger = Ledger()
    keys = {0: (0,)}
    ledger.add(keys, np.array([[0, 4, i, 1] for i in range(3)]))
    assert ledger.info((0,), 4) == {"have": pack({0, 1, 2})}
    ledger.end((0,), 4, 5, 99)
    assert ledger.info((0,), 4)["expect"] == [5, 99]
    ledger.add(keys, np.array([[0, 4, 3, 2], [0, 7, 0, 1]]))
    assert ledger.info((0,), 4) == {"all": True}
    copy = Ledger()
    copy.merge_json(ledger.to_json())
    assert copy.to_json() == ledger.to_json()
    assert copy.info((0,), 7) == {"have": pack({0})}
    assert merge_info(merge_info(None, copy.info((0,), 7)), {"all": True}) == {"all": True}


def test_origins_of_consecutive_elements_compress_to_one_run_per_split():
    """A record of elements read in order holds one run per split, whatever its length;
    a shuffled batch's rows are sorted into runs; a ledger rebuilds the same origins."""
    pipeline = Pipeline.range(SPLITS * SIZE, split_size=SIZE)
    ctx = Context(RunSettings(entropy=3, track=True))
    feed = lambda key: (Assigned(s, key) for s in range(SPLITS))
    tagged = list(plan(pipeline).run_worker(feed, 0, ctx))
    tally = ctx.tally
    block = encode_origins([t[1] for t in tagged], [], tally.reads, tally.pass_keys, tally.ends)
    origins = decode_origins(block, len(tagged))
    assert origins.runs.tolist() == [[0, s, 0, SIZE] for s in range(SPLITS)]
    assert origins.uniform == 1 and origins.counts is None
    ledger = Ledger()
    origins.note(ledger)
    assert ledger.done == {(0,): set(range(SPLITS))} and not ledger.open

    ctx = Context(RunSettings(entropy=3, track=True))
    batched = Pipeline.range(SPLITS * SIZE, split_size=SIZE).shuffle(60, seed=4).batch(50)
    batches = list(plan(batched).run_worker(feed, 0, ctx))
    tally = ctx.tally
    block = encode_origins([t[1] for t in batches], [], tally.reads, tally.pass_keys, tally.ends)
    origins = decode_origins(block, len(batches))
    assert origins.uniform == 50 and len(batches) == 3  # 150 = SPLITS * SIZE
    assert len(origins.runs) < 150  # a batch's rows of one split sorted together
    ledger = Ledger()
    origins.note(ledger, 1)  # the first batch alone: its 50 rows
    assert sum(r.count for r in ledger.open.values()) == 50
    origins.note(ledger)
    assert ledger.done == {(0,): set(range(SPLITS))} and not ledger.open


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), max_size=60),
       st.integers(0, 5))
@settings(max_examples=100, derandomize=True, deadline=None)
def test_ranges_hold_the_union_of_what_was_added(runs, chunk):
    ranges, expected = Ranges(), set()
    step = chunk + 1
    for at in range(0, len(runs), step):
        part = runs[at:at + step]
        ranges.add(np.array([s for s, _ in part], np.int64),
                   np.array([s + n for s, n in part], np.int64))
        expected |= {i for s, n in part for i in range(s, s + n)}
        assert ranges.count == len(expected)
    assert ranges.indices().tolist() == sorted(expected)
    assert all(b < a for a, b in zip(ranges.starts[1:], ranges.ends, strict=False))
    assert Ranges.of(expected).indices().tolist() == sorted(expected)


def test_a_malformed_origin_block_is_refused_saying_why():
    good = np.frombuffer(encode_origins([(2,), (3,)], [], [(0, 1)], {(0,): 0},
                                        [[0, 1, 4, 9]]), np.int64)
    decode_origins(good.tobytes(), 2)

    def changed(at, value):
        bad = good.copy()
        bad[at] = value
        return bad.tobytes()

    head, keys, ends, runs = 8, 8, 11, 15  # where each part of this block starts
    for block, why in [
        (good.tobytes()[:-3], "whole number"),
        (changed(1, -2), "does not fit"),  # uniform count
        (changed(keys, 1 << 30), "pass keys"),  # pass id out of range
        (changed(keys + 2, -1), "pass keys"),  # a key < 0
        (changed(ends, 7), "split end"),  # an end naming an unknown pass
        (changed(runs, 3), "origin run"),  # a run naming an unknown pass
        (changed(runs + 2, (1 << 32) - 1), "origin run"),  # past 2**32
        (changed(runs + 3, 1), "do not match"),  # fewer origins than the elements hold
        (good.tobytes() + bytes(8), "as long as"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_origins(block, 2)
    assert head == 8


def test_a_block_carries_its_groups_and_refuses_malformed_ones():
    from zloader.lineage import Group, Ledger
    # Two rows of a group of 3 source elements (split 4, indices 5..7 of pass (0,)): read 0
    # is the split, read 1 the group's rows.
    pass_keys = {(0,): 0, (0, 1 << 41 | 3, 5): 1}
    reads = [(0, 4), (1, 4)]
    group = [0, 4, 5, 3, 2, 1, 0, 4, 5, 3]  # anchor, position 3, 2 rows, 1 run
    block = encode_origins([(1 << 32 | 0,), (1 << 32 | 1,)], [], reads, pass_keys, [], [group])
    origins = decode_origins(block, 2)
    assert origins.groups == [Group((0,), 4, 5, 3, 2, (((0,), 4, 5, 3),))]
    ledger = Ledger()
    origins.note(ledger, 1)  # one row yielded: the split stays open, the group too
    assert ledger.held((0,), 4).tolist() == [5, 6, 7]
    listed, _, held = Group.from_json(ledger.info((0,), 4)["groups"][0])
    assert listed == origins.groups[0] and listed.rows == 2 and held == {0}
    origins.note(ledger)
    assert "groups" not in ledger.info((0,), 4)
    good = np.frombuffer(block, np.int64)
    at = len(good) - 4 - 10  # the group section: before the one run of the rows

    def changed(offset, value):
        bad = good.copy()
        bad[at + offset] = value
        return bad.tobytes()

    for bad, why in [(changed(0, 9), "group must be"),  # a pass the block does not name
                     (changed(4, 0), "group must be"),  # no rows
                     (changed(6, 9), "member run"),  # a member run of an unknown pass
                     (changed(8, 4), "start with its anchor")]:  # not the anchor first
        with pytest.raises(ValueError, match=why):
            decode_origins(bad, 2)


def scattered_block(reads, ends=()):
    """An origin block of one batch whose 64 rows' codes are scattered (a shuffle's): it
    travels as codes, with the table of ``reads`` [(pass id, split), ...] they come from."""
    codes = np.array([(i % len(reads)) << INDEX_BITS | (i * 37) % 64 for i in range(64)])
    block = encode_origins([codes], [], reads, {(0, 3): 0}, [list(e) for e in ends])
    return np.frombuffer(block, np.int64).copy(), codes


def test_scattered_origins_travel_as_codes_and_a_ledger_holds_the_same_as_from_runs():
    block, codes = scattered_block([(0, 4), (0, 5)], ends=[(0, 4, 64, 1)])
    origins = decode_origins(block.tobytes(), 1)
    assert origins.codes is not None and origins.codes.tolist() == codes.tolist()
    assert origins.reads == [0, 0, 4, 1, 0, 5] and not len(origins.runs)
    from_codes, from_runs = Ledger(), Ledger()
    origins.note(from_codes)
    rows = [[0, 4 + (c >> INDEX_BITS), c & INDEX_MASK, 1] for c in codes.tolist()]
    from_runs.add({0: (0, 3)}, np.array(rows, np.int64))
    from_runs.end((0, 3), 4, 64, 1)
    assert from_codes.to_json() == from_runs.to_json()
    assert from_codes.held((0, 3), 5).tolist() == sorted({(i * 37) % 64 for i in range(1, 64, 2)})
    part = Ledger()
    origins.note(part, 0)  # none of the batch's rows yielded yet
    assert not part.open and not part.done


def test_a_malformed_codes_block_is_refused_saying_why():
    good, _ = scattered_block([(0, 4), (0, 5)])
    decode_origins(good.tobytes(), 1)
    table, codes = 8 + 4, 8 + 4 + 6  # where the reads and the codes of this block start

    def changed(at, value):
        bad = good.copy()
        bad[at] = value
        return bad.tobytes()

    for block, why in [
        (changed(5, 1), "does not fit"),  # runs and reads both
        (changed(6, 3), "as long as"),  # more reads than the block holds
        (changed(table + 3, 0), "origin read"),  # a read twice
        (changed(table + 1, 9), "origin read"),  # a pass the block does not name
        (changed(table, 1 << 31), "origin read"),  # a read past 2**31
        (changed(table + 2, -1), "origin read"),  # a split < 0
        (changed(codes + 5, 2 << INDEX_BITS), "names a read"),  # read 2: not in the table
        (changed(codes, -1), "names a read"),
        (changed(table + 3, 5), "names a read"),  # reads 0 and 5: codes of read 1 in the gap
        (good.tobytes()[:-8], "as long as"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_origins(block, 1)


def test_a_ledger_of_codes_keeps_splits_apart_and_repeats_once():
    """Codes of several records and splits sorted together: a split's last index
    (2**32 - 1) next to the following split's first is no run across them; a code
    received twice counts once; reads numbered alike by two workers stay apart."""
    last = INDEX_MASK
    ledger = Ledger()
    keys = {0: (0,)}
    worker_a = [0, 0, 7, 1, 0, 8]  # read 0 is split 7, read 1 split 8
    worker_b = [0, 0, 9]  # read 0 is split 9
    ledger.add_codes(keys, worker_a, np.array([last, 1 << INDEX_BITS, last - 1, last]))
    ledger.add_codes(keys, worker_b, np.array([0, 2, 1]))
    assert ledger.held((0,), 7).tolist() == [last - 1, last]
    assert ledger.held((0,), 8).tolist() == [0]
    assert ledger.held((0,), 9).tolist() == [0, 1, 2]
    assert ledger.open[((0,), 7)].count == 2


@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.one_of(
    st.integers(0, 70), st.integers(INDEX_MASK - 3, INDEX_MASK))), min_size=1, max_size=80),
    max_size=8))
@settings(max_examples=100, derandomize=True, deadline=None)
def test_a_ledger_holds_the_same_from_codes_as_from_runs(records):
    """(Records of one read, most, are sorted a split at a time as 32-bit indices; the
    last index of a split, 2**32 - 1, among them.)"""
    keys = {0: (1,), 1: (2,)}
    reads = [[0, 0, 5], [1, 1, 5], [2, 0, 6], [3, 1, 9]]  # read 1: another pass
    from_codes, from_runs = Ledger(), Ledger()
    for record in records:
        codes = np.array([read << INDEX_BITS | index for read, index in record])
        used = sorted({r for r, _ in record})
        from_codes.add_codes(keys, [v for r in used for v in reads[r]], codes)
        from_runs.add(keys, np.array([[*reads[r][1:], i, 1] for r, i in record]))
    assert from_codes.done == from_runs.done
    assert {place: (held.starts, held.ends, held.count)
            for place, held in from_codes.open.items()} == \
        {place: (held.starts, held.ends, held.count) for place, held in from_runs.open.items()}


def test_a_ledger_adds_records_of_workers_with_their_own_pass_ids_alike():
    """Records are added many at a time; each worker numbers its passes itself."""
    keys_a, keys_b = {0: (0,), 1: (0, 1)}, {0: (0, 1), 1: (0,)}
    one, many = Ledger(), Ledger()
    records = [(keys_a, np.array([[0, 3, i * 4, 4], [1, 3, i * 4, 4]])) for i in range(50)]
    records += [(keys_b, np.array([[1, 3, 200 + i * 4, 4], [0, 5, i, 1]])) for i in range(50)]
    for keys, runs in records:
        one.add(keys, runs)
        one.open  # read after each record: nothing waits to be added
        many.add(keys, runs)
    one.end((0,), 3, 400, 7)
    many.end((0,), 3, 400, 7)
    assert one.to_json() == many.to_json()
    assert many.done == {(0,): {3}}
    assert many.held((0, 1), 3).tolist() == list(range(200))
    assert many.held((0, 1), 5).tolist() == list(range(50))


def test_a_large_origin_block_decodes_to_plain_ints():
    """What a consumer sends on (DELIVERED, state_dict) is JSON: no numpy scalars."""
    tags = [(i,) for i in range(100)]
    block = encode_origins(tags, [], [(0, 9)], {(0, 3): 0}, [[0, 9, 100, 5]])
    origins = decode_origins(block, 100)
    assert origins.keys == {0: (0, 3)} and origins.ends == [((0, 3), 9, 100, 5)]
    json.dumps([origins.keys[0], origins.ends])
    ledger = Ledger()
    origins.note(ledger)
    json.dumps(ledger.to_json())
    json.dumps(ledger.info((0, 3), 9))


def test_a_split_end_among_kept_origins_closes_the_split_once_they_are_added():
    """A record of many short splits brings an end for each: the ledger keeps its origins
    to add many records at once, and closes each split whose end came once they are added
    (at the next read), whole or not."""
    ledger = Ledger()
    keys = {0: (0,)}
    # read 0 is split 4 (3 elements), read 1 split 5 (2 elements, 1 of them here)
    ledger.add_codes(keys, [0, 0, 4, 1, 0, 5], np.array([2, 1 << INDEX_BITS | 1, 0, 1]))
    ledger.end((0,), 4, 3, 7)
    ledger.end((0,), 5, 2, 9)
    assert ledger.done == {(0,): {4}}
    assert ledger.held((0,), 5).tolist() == [1]
    assert ledger.info((0,), 5) == {"have": ledger.info((0,), 5)["have"], "expect": [2, 9]}
    # the rest of split 5 comes later, kept again: its end is known already
    ledger.add_codes(keys, [1, 0, 5], np.array([1 << INDEX_BITS | 0]))
    assert ledger.done == {(0,): {4, 5}}
    assert ledger.open == {}
    ledger.end((0,), 4, 3, 7)  # (an end again: a split read again, whole already)
    assert ledger.done == {(0,): {4, 5}}
