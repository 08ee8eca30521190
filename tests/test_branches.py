"""Prefix sharing's engine as plain calls: one trunk run, each branch's own stages over it,
against each branch's pipeline run alone over the same splits (zloader/sharing/branches.py).
The service around it (trainers, windows, faults) is tests/test_sharing.py's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zloader
from zloader.options import JobOptions
from zloader.plan import plan
from zloader.runs import Context, RunSettings
from zloader.sharing.branches import Branch, Tree, first_tap, prefix_of
from zloader.sharing.prefix import shared_stages

CALLS = {"n": 0}


def decode(x):
    CALLS["n"] += 1
    return np.full(3, x, np.int64)


def brighter(a):
    return a * 2


def odd(a):
    return int(a[0]) % 2 == 1


def total(a):
    return int(a.sum())


def _values(element):
    return np.asarray(element).tolist()


def _alone(pipeline, feed, epoch=0, worker=0):
    planned = plan(pipeline, JobOptions(share={}))
    ctx = Context(RunSettings(entropy=11, worker=worker, workers=2))
    return [_values(e) for e in planned.run_worker(feed, epoch, ctx)]


def _branched(pipelines, tap, feed, epoch=0, worker=0, late=None, history=1 << 30):
    """Each pipeline's elements, run as branches of the first (each sharing ``tap``
    stages; or ``tap[i]``), all from the start or, ``late[i]``, attached once that many
    elements were made."""
    options = JobOptions(share={})
    taps = tap if isinstance(tap, list) else [len(pipelines[0].stages)] + [tap] * (
        len(pipelines) - 1)
    branches = [Branch(i, plan(p, options), taps[i]) for i, p in enumerate(pipelines)]
    ctx = Context(RunSettings(entropy=11, worker=worker, workers=2))
    tree = Tree(branches[0].plan, min(taps[1:], default=1), feed, epoch, ctx, history)
    late = late or {}
    for branch in branches[1:]:
        if branch.index not in late:
            tree.attach(branch)
    out: dict[int, list] = {i: [] for i in range(len(pipelines))}
    for made, (which, element) in enumerate(tree, 1):
        out[which].append(_values(element))
        for index, when in late.items():
            if when == made:
                tree.attach(branches[index])
    out["refused"] = sorted(tree.refused)
    return out


def _feed(splits):
    return lambda key: iter(splits)


SUFFIXES = {
    "batch10": lambda p: p.batch(10),
    "shuffle_batch25": lambda p: p.shuffle(64, seed=7).batch(25),
    "augment_batch4": lambda p: p.map(brighter).batch(4),
    "filter": lambda p: p.filter(odd),
    "unbatch_map": lambda p: p.batch(6).map(lambda b: b[:2]).unbatch().map(total),
    "none": lambda p: p,
}


def test_each_branch_gets_what_its_pipeline_makes_alone_and_the_trunk_runs_once():
    trunk = zloader.Pipeline.range(300, split_size=20).map(decode)
    pipelines = [make(trunk) for make in SUFFIXES.values()]
    feed = _feed([3, 0, 7, 1, 14, 2])
    CALLS["n"] = 0
    out = _branched(pipelines, 1, feed, epoch=2, worker=1)
    assert CALLS["n"] == 120  # six splits of 20, decoded once for six branches
    for which, pipeline in enumerate(pipelines):
        assert out[which] == _alone(pipeline, feed, epoch=2, worker=1), \
            list(SUFFIXES)[which]


def test_a_trunk_of_several_stages_with_a_shuffle_in_it():
    trunk = zloader.Pipeline.range(200, split_size=25).map(decode).shuffle(50, seed=3)
    pipelines = [trunk.batch(8), trunk.map(brighter).filter(odd), trunk.map(total)]
    feed = _feed(range(8))
    out = _branched(pipelines, 2, feed)
    for which, pipeline in enumerate(pipelines):
        assert out[which] == _alone(pipeline, feed)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(sorted(SUFFIXES)), min_size=1, max_size=4),
       st.lists(st.integers(0, 14), min_size=0, max_size=10, unique=True),
       st.integers(0, 3))
def test_generated_branches_match_their_pipelines(names, splits, epoch):
    trunk = zloader.Pipeline.range(150, split_size=10).map(decode)
    pipelines = [SUFFIXES[name](trunk) for name in names]
    out = _branched(pipelines, 1, _feed(splits), epoch=epoch)
    for which, pipeline in enumerate(pipelines):
        assert out[which] == _alone(pipeline, _feed(splits), epoch=epoch)


def test_where_a_trunk_may_end():
    base = zloader.Pipeline.range(10).map(decode)
    a = base.batch(2).repeat(2).map(brighter)
    assert first_tap(a, len(a.stages)) == 3  # after the repeat
    assert first_tap(base.map(brighter), 2) == 1  # at least one stage
    ours = a.prefix_fingerprints
    theirs = base.batch(2).repeat(2).map(total).prefix_fingerprints
    assert shared_stages(ours, theirs, 3, 4) == 3
    assert shared_stages(ours, theirs, 4, 4) == 0  # they differ before the fourth
    other = zloader.Pipeline.range(10).map(total).prefix_fingerprints
    assert shared_stages(ours, other, 1, 4) == 0  # only the source in common


@pytest.mark.parametrize("tap", [1, 2])
def test_a_failing_branch_raises_the_stage_error(tap):
    def boom(a):
        raise ValueError("bad augment")
    trunk = zloader.Pipeline.range(40, split_size=10).map(decode).map(brighter)
    pipelines = [trunk.batch(5), trunk.map(boom, name="augment")]
    with pytest.raises(zloader.PipelineError, match="augment"):
        _branched(pipelines, tap, _feed([0, 1]))


def test_a_branch_attached_while_the_epoch_runs_gets_it_all_while_the_history_lasts():
    trunk = zloader.Pipeline.range(200, split_size=20).map(decode)
    pipelines = [trunk.batch(10), trunk.shuffle(32, seed=1).batch(7), trunk.filter(odd)]
    feed = _feed(range(10))
    CALLS["n"] = 0
    out = _branched(pipelines, 1, feed, late={1: 5, 2: 12})
    assert CALLS["n"] == 200 and out["refused"] == []
    for which, pipeline in enumerate(pipelines):
        assert out[which] == _alone(pipeline, feed)
    # Past the history's bytes (each decoded element: 24 bytes) a late branch is refused
    # (its trainers get the epoch made for them alone); one on time is not.
    out = _branched(pipelines, 1, feed, late={1: 1, 2: 30}, history=24 * 60)
    assert out["refused"] == [2] and out[2] == []
    assert out[1] == _alone(pipelines[1], feed)


def test_branches_part_from_branch_zero_at_their_own_stage():
    base = zloader.Pipeline.range(120, split_size=15).map(decode).map(brighter)
    pipelines = [base.map(total), base.batch(4), zloader.Pipeline.range(
        120, split_size=15).map(decode).filter(odd), base.map(total).batch(3)]
    feed = _feed([7, 1, 3, 0, 5])
    CALLS["n"] = 0
    out = _branched(pipelines, [3, 2, 1, 3], feed, late={2: 20})
    assert CALLS["n"] == 75
    for which, pipeline in enumerate(pipelines):
        assert out[which] == _alone(pipeline, feed)


def test_what_a_shared_loader_says_of_its_prefixes():
    pipeline = zloader.Pipeline.range(10).map(decode).batch(2).repeat(2).map(brighter)
    said = prefix_of(plan(pipeline, JobOptions(share={})))
    assert said["prefixes"] == list(pipeline.prefix_fingerprints)
    assert said["first_tap"] == 3 and said["stage_names"][0].startswith("map")
    # Records in parts (a deterministic job's fixed shards) and a pipeline with no worker
    # stage take no branches.
    shards = JobOptions(share={}, deterministic=True, sharding="static", shards=2)
    assert prefix_of(plan(pipeline, shards)) == {}
    assert prefix_of(plan(zloader.Pipeline.range(10).take(3), JobOptions(share={}))) == {}
