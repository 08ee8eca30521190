"""A ledger's groups (zloader/lineage/ledger.py) at a state's scale: thousands of groups of
shuffled elements, defined one by one, all at once, merged from JSON or copied, hold the
same; a state's groups are merged with one merge per split, and malformed member runs
are refused naming the run; a state too large for other bodies resumes, and one too large
to send is refused when the Loader is made."""

from __future__ import annotations

import base64
import collections
import itertools
import json
import random
import re
import time
import tracemalloc
import zlib
from dataclasses import astuple
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader import Loader, Pipeline
from zloader.client import exactly_once
from zloader.lineage import Group, Ledger, Ranges, decode_origins, encode_origins
from zloader.lineage.tags import INDEX_MASK, MemberRuns, flat_runs
from zloader.transport import protocol

SPLIT = 96  # elements per split


def _groups(seed: int, splits: int, size: int, nested: bool) -> list[tuple[Group, set[int]]]:
    """Groups of ``size`` shuffled elements (the last up to twice as many) over ``splits``
    splits of pass (0,), every element in one, each with
    a random number of rows and some of them held; ``nested``: and groups of the first
    groups' rows (a packer after a tokenizer)."""
    rng = random.Random(seed)
    elements = [(split, index) for split in range(splits) for index in range(SPLIT)]
    rng.shuffle(elements)
    out = []
    cuts = list(range(0, len(elements), size))
    for at, stop in zip(cuts, [*cuts[1:-1], len(elements)], strict=False):
        members = elements[at:stop]  # (the last takes the rest: every element is in one)
        anchor = members[0]
        group = Group((0,), anchor[0], anchor[1], 3, rng.randint(1, 2 * len(members)),
                      tuple(((0,), split, index, 1) for split, index in members))
        out.append((group, {row for row in range(group.rows) if rng.random() < 0.6}))
    for group, held in list(out[:4]) if nested else ():
        rows = [row for row in range(group.rows) if row not in held]
        if rows:
            packed = Group(group.rows_key, group.split, rows[0], 7, len(rows),
                           tuple((group.rows_key, group.split, row, 1) for row in rows))
            out.append((packed, set(range(len(rows) // 2))))
    return out


def _ended(ledger: Ledger, splits: int) -> Ledger:
    for split in range(splits):
        ledger.end((0,), split, SPLIT, 0)
    return ledger


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), splits=st.integers(1, 6), size=st.sampled_from([1, 3, 8, 40]),
       nested=st.booleans(), ended=st.booleans())
def test_groups_defined_one_by_one_at_once_merged_or_copied_hold_the_same(seed, splits, size,
                                                                         nested, ended):
    """The oracle: a ledger holds a function of the groups and rows it was told, in any
    order and however many at a time."""
    groups = _groups(seed, splits, size, nested)
    one_by_one = Ledger()
    for group, rows in reversed(groups):
        one_by_one.define(group, rows)
    at_once = Ledger()
    at_once.define_all([(group, group.id, rows) for group, rows in groups])
    if ended:
        _ended(one_by_one, splits), _ended(at_once, splits)
    merged = Ledger()
    merged.merge_json(at_once.to_json())
    half = Ledger()  # (a copy taken halfway, then told the rest)
    half.define_all([(group, group.id, rows) for group, rows in groups[::2]])
    if ended:
        _ended(half, splits)
    before = half.to_json()
    copied = half.copy()
    copied.define_all([(group, group.id, rows) for group, rows in groups[1::2]])
    assert half.to_json() == before  # (the copy is its own)
    expected = one_by_one.to_json()
    for ledger in (at_once, merged, copied):
        assert ledger.to_json() == expected
        for split in range(splits):
            assert ledger.info((0,), split) == one_by_one.info((0,), split)
    at_once.define_all([(group, group.id, range(group.rows)) for group, _ in groups])
    assert all(at_once.info((0,), split) == {"all": True} for split in range(splits)) == ended


def test_a_state_s_thousands_of_shuffled_groups_are_merged_once_per_split(monkeypatch):
    """3,000 groups of 32 shuffled elements over 1,000 splits: their elements are added with
    one merge per split (before, one per element: a resumed state of a tokenizer's
    pipeline held the broker for seconds, and its workers reconnected)."""
    groups = _groups(7, 1000, 32, False)
    assert len(groups) == 2999 and len({group.split for group, _ in groups}) > 900
    state = Ledger()
    state.define_all([(group, group.id, rows) for group, rows in groups])
    value = state.to_json()
    adds = []
    add = Ledger._add
    monkeypatch.setattr(Ledger, "_add", lambda self, key, split, starts, ends: (
        adds.append(len(starts)), add(self, key, split, starts, ends)))
    resumed = Ledger()
    resumed.merge_json(value)
    assert resumed.to_json() == value
    assert len(adds) <= 1000  # (elements: one merge per split)


BAD_RUNS = [
    [[[True], 0, 0, 1]],  # a bool in the key
    [[[0.0], 0, 0, 1]],
    [[[], 0, 0, 1]],
    [[[0] * 65, 0, 0, 1]],
    [[[-1], 0, 0, 1]],
    [[[0], -1, 0, 1]],
    [[[0], 0, 0, 0]],
    [[[0], 0, 1.0, 1]],
    [[[0], False, 0, 1]],
    [[[0], INDEX_MASK + 1, 0, 1]],
    [[[0], 0, INDEX_MASK, 2]],
    [[[0], 0, 0]],
    [[(0,), 0, 0, 1]],
    [[[0], 0, 0, 1], "x"],
]


@pytest.mark.parametrize("runs", BAD_RUNS)
def test_a_malformed_member_run_is_refused_naming_it(runs):
    value = [[0], 0, 0, 3, 1, [[[0], 0, 0, 1], *runs], ""]
    with pytest.raises(ValueError, match=r"member run must be \[key, split, first, length\], "
                                         r"got " + re.escape(repr(runs[-1])[:20])):
        Group.from_json(value)
    good = [[0], 0, 0, 3, 1, [[[0], 0, 0, 1], [[0, 2], 5, 6, 7]], ""]
    group, _, _ = Group.from_json(good)
    assert group is not None and group.members == (((0,), 0, 0, 1), ((0, 2), 5, 6, 7))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 600), max_size=400), st.sampled_from([set, list, iter]))
def test_ranges_of_a_few_indices_in_python_and_of_many_in_numpy_agree(values, kind):
    ranges = Ranges.of(kind(values))
    assert ranges.indices().tolist() == sorted(set(values))
    assert ranges.count == len(set(values))
    assert all(end < start for start, end in zip(ranges.starts[1:], ranges.ends, strict=False))
    assert Ranges.of(range(3, 9)).starts == [3] and Ranges.of(range(4, 4)).count == 0
    assert np.array_equal(Ranges.of(range(0, 10, 3)).indices(), [0, 3, 6, 9])


def test_member_runs_kept_flat_are_the_runs_and_one_object_a_group():
    """A group decoded from a block or a state keeps its runs in one flat tuple
    (:class:`MemberRuns`): it iterates, compares and hashes as the tuple of runs; and a
    thousand groups of 64 single elements take about half the memory that a tuple per
    run took."""
    runs = (((0,), 4, 5, 1), ((0, 2), 9, 1, 3))
    kept = MemberRuns(tuple(itertools.chain.from_iterable(runs)))
    assert tuple(kept) == runs and list(kept) == list(runs) and len(kept) == 2
    assert kept == runs and runs == kept and kept == MemberRuns(kept.flat)
    assert hash(kept) == hash(runs) and kept[1] == runs[1] and kept[:1] == runs[:1]
    assert kept != runs[:1] and kept != list(runs) and repr(kept) == repr(runs)
    assert flat_runs(runs) == kept.flat and flat_runs(kept) is kept.flat
    group = Group((0,), 4, 5, 3, 2, runs)
    assert Group((0,), 4, 5, 3, 2, kept) == group and len({group, Group(*astuple(group))}) == 1
    decoded, _, _ = Group.from_json(group.to_json())
    assert decoded == group and isinstance(decoded.members, MemberRuns)

    pass_keys = {(0,): 0}
    reads = [(0, split) for split in range(8)]
    section = []
    for at in range(1000):  # (anchor, position 3, 64 rows, 64 runs of one element)
        elements = [(at * 7 + k) % 8 for k in range(64)]
        section += [0, elements[0], at, 3, 64, 64]
        section += [v for split in elements for v in (0, split, at, 1)]
    block = encode_origins([(0,)], [], reads, pass_keys, [], [section])
    tracemalloc.start()
    try:
        origins = decode_origins(block, 1)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < 5000 * 1000  # (a tuple per run: 6.9 KB a group; flat: 3.8 KB)
    assert len(origins.groups) == 1000 and all(len(g.members) == 64 for g in origins.groups)
    assert origins.groups[1].members[2] == ((0,), (7 + 2) % 8, 1, 1)


def spread(batch: Any) -> np.ndarray:
    """Drops elements ``% 7 == 3``, gives those ``% 11 == 0`` twice (rows keep their value)."""
    keep = [int(x) for x in np.asarray(batch) if x % 7 != 3]
    return np.array(keep + [x for x in keep if x % 11 == 0], np.int64)


def _shuffled_tokens(n: int) -> Pipeline:
    return Pipeline.range(n, seed=1).shuffle(1000, seed=2).batch(64).map(spread).unbatch()


def _state_at(pipeline: Pipeline, count: int) -> tuple[list[int], dict[str, Any]]:
    with Loader(pipeline, num_workers=2, timeout=60) as loader:
        elements = iter(loader)
        got = [int(x) for x in itertools.islice(elements, count)]
        return got, loader.state_dict()


def test_a_state_larger_than_other_bodies_resumes_exactly(monkeypatch):
    """A state's groups travel in the resumed Loader's REGISTER, whose body may be
    MAX_REGISTER_BODY_BYTES; other bodies stay at MAX_BODY_BYTES. (Before, a tokenizer's
    state over 1 MiB, 2.6 MB for 1 M elements behind a 20,000-element shuffle, was dropped
    by the broker as malformed and the Loader timed out saying no broker answered.) Here
    the other bodies' limit is made small enough for this state to exceed it."""
    pipeline = _shuffled_tokens(40_000)
    got, state = _state_at(pipeline, 12_000)
    size = len(json.dumps(state))
    assert size > 32 << 10
    monkeypatch.setattr(protocol, "MAX_BODY_BYTES", 16 << 10)
    with Loader(pipeline, num_workers=2, timeout=60, state=state) as loader:
        got += [int(x) for x in loader]
    assert collections.Counter(got) == collections.Counter(int(x) for x in pipeline.iter(0))


def test_a_state_too_large_to_send_is_refused_when_the_loader_is_made(monkeypatch):
    """A state that no broker would take is refused at once, saying why and what to
    change, not after the Loader's timeout."""
    pipeline = _shuffled_tokens(20_000)
    _, state = _state_at(pipeline, 5_000)
    monkeypatch.setattr(exactly_once, "MAX_REGISTER_BODY_BYTES", exactly_once.MAX_BODY_BYTES
                        + (16 << 10))
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"MiB of delivered origins.*MAX_REGISTER_BODY_BYTES"
                                         r".*exactly_once=False"):
        Loader(pipeline, num_workers=2, timeout=60, state=state)
    assert time.monotonic() - started < 30  # (does not wait for the timeout)


def _packed(rows: list[list[int]], keys: list[list[int]] | None = None) -> list[Any]:
    raw = np.array(rows, "<i8").tobytes()
    return [keys if keys is not None else [[0]],
            base64.b64encode(zlib.compress(raw)).decode()]


@pytest.mark.parametrize("members", [
    _packed([[1, 0, 0, 1]]),  # a key's place past its keys
    _packed([[0, -1, 0, 1]]), _packed([[0, 0, -1, 1]]), _packed([[0, 0, 0, 0]]),
    _packed([[0, INDEX_MASK + 1, 0, 1]]), _packed([[0, 0, INDEX_MASK, 2]]),
    _packed([[0, 0, 2**62, 2**62]]),  # (no overflow)
    _packed([[0, 0, 0, 1]], [[True]]), _packed([[0, 0, 0, 1]], []),
    _packed([]), [[[0]], "not base64!"], [[[0]], base64.b64encode(b"\x00" * 32).decode()],
    [[[0]], base64.b64encode(zlib.compress(b"\x00" * 31)).decode()],
    [[[0]], base64.b64encode(zlib.compress(b"\x00" * 64)[:-6]).decode()],  # (cut short)
    [[[0]], base64.b64encode(zlib.compress(b"\x00" * 32) + b"xx").decode()],
])
def test_packed_member_runs_are_checked(members):
    """A state lists a group's runs packed (one string a group, not a list a run); a
    malformed one is refused saying so."""
    with pytest.raises(ValueError, match="member runs"):
        Group.from_json([[0], 0, 0, 3, 1, members, ""])


def test_a_state_lists_a_group_s_runs_packed_and_reads_the_old_lists():
    group = Group((0,), 4, 5, 3, 2, (((0,), 4, 5, 1), ((0, 2), 9, 1, 3), ((0,), 4, 7, 1)))
    value = group.to_json([1])
    assert isinstance(value[5][1], str) and value[5][0] == [[0], [0, 2]]
    assert Group.from_json(json.loads(json.dumps(value))) == (group, group.id, {1})
    old = [*value[:5], [[list(k), s, a, n] for k, s, a, n in group.members], value[6]]
    assert Group.from_json(old) == (group, group.id, {1})  # (a state saved before)
    groups = _groups(3, 40, 64, False)
    state = Ledger()
    state.define_all([(one, one.id, rows) for one, rows in groups])
    listed = [[*g[:5], [[list(k), s, a, n] for k, s, a, n in Group.from_json(g)[0].members],
               g[6]] for g in state.to_json()[0][3]]
    assert len(json.dumps(state.to_json())) * 2 < len(json.dumps(listed))
