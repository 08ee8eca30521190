"""A mix its workers draw (a shared job, a deterministic one read in static shards, and
the other cases docs/semantics.md lists) reads each input of fewer than
MIX_SPREAD_SPLITS splits in that many (zloader/plan.py ``spread``): every worker holds
some of every input, so the weights hold in every window of what a trainer sees, and
every element still comes once."""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import pytest

from tests.service import service
from tests.test_mix_windows import BASES, WEIGHTS, assert_every_window_holds, slowly, which
from zloader import Loader, Pipeline
from zloader._defaults import MIX_SPREAD_SPLITS
from zloader.cache import CachedSource
from zloader.errors import MixWindowWarning
from zloader.options import JobOptions
from zloader.plan import plan, spread
from zloader.sources import PartsSource, RangeSource, default_split_size


def few_splits(tmp_path: pathlib.Path, form: str = "file") -> Pipeline:
    """Three inputs: many splits (made slowly), one split (a range), and 700 JSON lines
    in one file (``form`` "cache": cached) or in two read in one split as they come
    ("unordered"): both small inputs would sit on one worker each."""
    halves = [(tmp_path / f"small-{half}.jsonl", range(half * 350, half * 350 + 350))
              for half in range(2)] if form == "unordered" else \
        [(tmp_path / "small.jsonl", range(700))]
    for path, lines in halves:
        path.write_text("".join(json.dumps(BASES[2] + i) + "\n" for i in lines))
    paths = [str(path) for path, _ in halves]
    lines = Pipeline.from_jsonl(paths, parallel_reads=2, deterministic=False) \
        if form == "unordered" else Pipeline.from_jsonl(paths[0])
    if form == "cache":
        lines = lines.map(int).cache(str(tmp_path / "cache"))
    return Pipeline.mix([Pipeline.range(BASES[0], BASES[0] + 4000, split_size=100).map(slowly),
                         Pipeline.range(BASES[1], BASES[1] + 2000, split_size=2000),
                         lines], WEIGHTS, seed=11).batch(8)


def every(source: object) -> list[object]:
    """All of ``source``'s elements, split by split in order."""
    return [x for split in range(source.num_splits) for x in source.read(split)]


def flat(batches: object) -> list[int]:
    return [int(x) for batch in batches for x in np.asarray(batch).reshape(-1)]


def test_spread_cuts_indexed_inputs_finer_and_reads_files_in_interleaved_parts(tmp_path):
    mix = few_splits(tmp_path)
    inputs = [p.source for p in mix.source.inputs]
    spread_inputs = [p.source for p in spread(mix).source.inputs]
    for cut, was in zip(spread_inputs[:2], inputs[:2], strict=True):  # (as by default)
        assert isinstance(cut, RangeSource)
        assert cut.split_size == default_split_size(was.length)  # (at most 256 splits)
        assert every(cut) == every(was)
    assert MIX_SPREAD_SPLITS == 16
    parts = spread_inputs[2]
    assert isinstance(parts, PartsSource) and parts.num_splits == 16
    lines = list(inputs[2].read(0))
    for part in range(16):  # part j: elements j, j + 16, ... of the file
        assert list(parts.read(part)) == lines[part::16]
    assert "element 35 (split 0)" in parts.locate(3, 2)  # (3 + 2 * 16, of the file)
    # Another pipeline to the fingerprint, the same elements, and iter() as written.
    assert spread(mix).fingerprint != mix.fingerprint
    assert sorted(flat(spread(mix).iter(0))) == sorted(flat(mix.iter(0)))
    once = spread(mix)
    assert spread(once) is once  # (nothing left under MIX_SPREAD_SPLITS splits)


def test_a_source_read_in_no_fixed_order_is_read_a_file_a_split_then_in_parts(tmp_path):
    """Parts of a split that reads its files as they come would overlap (and miss
    elements): such a source is read one file a split, each in its own order, and those
    splits in parts; every element comes once."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(f"{i}\n" for i in range(100)))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(f"{i}\n" for i in range(100, 250)))
    unordered = Pipeline.from_jsonl([str(path), str(other)], parallel_reads=2,
                                    deterministic=False)
    mix = Pipeline.mix([Pipeline.range(100), unordered], [1, 1], seed=1)
    parts = spread(mix).source.inputs[1].source
    assert isinstance(parts, PartsSource) and parts.source.parallel_reads == 1
    assert parts.num_splits == 16
    assert sorted(every(parts)) == list(range(250))
    assert spread(spread(mix)).source.inputs[1].source.identity() == parts.identity()


def test_a_cache_s_own_source_is_spread_under_it_and_each_part_is_an_entry(tmp_path):
    """A cached input of one file is read in parts under the cache (a part not cached
    yet runs the cached stages over its own elements only), a cached range cut finer;
    each part is an entry of its own, under another key than the input as written."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(f"{i}\n" for i in range(100)))
    calls = tmp_path / "calls"
    calls.mkdir()

    def counted(x: int) -> int:
        (calls / str(x)).touch(exist_ok=False)  # (raises if run twice on one element)
        return x * 10

    store = tmp_path / "cache"
    from_file = Pipeline.from_jsonl(str(path)).map(counted).cache(str(store))
    from_range = Pipeline.range(1000, split_size=1000).map(int).cache(str(store))
    mix = Pipeline.mix([from_file, from_range], [1, 1], seed=1)
    parts, cut = (p.source for p in spread(mix).source.inputs)
    assert isinstance(parts, CachedSource) and isinstance(parts.source, PartsSource)
    assert parts.num_splits == 16 and parts.key != from_file.source.key
    assert isinstance(cut, CachedSource) and cut.num_splits == 250
    assert sorted(every(parts)) == [10 * i for i in range(100)]  # (each element mapped once)
    assert len(list(calls.iterdir())) == 100
    assert sorted(every(parts)) == [10 * i for i in range(100)]  # (now from the entries)
    assert sorted(every(cut)) == list(range(1000))


def test_only_a_mix_its_workers_draw_is_spread(tmp_path):
    mix = few_splits(tmp_path)
    drawn_here = plan(mix, JobOptions())  # (the consumer draws: the inputs as they are)
    assert [p.source for p in drawn_here.pipeline.source.inputs] == \
        [p.source for p in mix.source.inputs]
    static = plan(mix, JobOptions(sharding="static", deterministic=True))
    assert [p.source.num_splits for p in static.pipeline.source.inputs] == [250, 250, 16]
    every_split = plan(mix, JobOptions(sharding="off"))  # (each worker reads them all)
    assert every_split.pipeline is mix
    assert plan(mix).pipeline is mix  # (in this process)


@pytest.mark.parametrize(("workers", "form"), [
    (2, "file"), *(pytest.param(w, "file", marks=pytest.mark.slow) for w in (4, 8)),
    *(pytest.param(4, form, marks=pytest.mark.slow) for form in ("cache", "unordered"))])
def test_a_shared_mix_holds_its_weights_in_every_window_with_inputs_of_one_split(
        tmp_path, workers, form):
    """(``form`` "cache": the file input cached, which its parts are, each on its own;
    "unordered": two files read in one split as they come.)"""
    mix = few_splits(tmp_path, form)
    with service(workers) as (address, _):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MixWindowWarning)
            with Loader(mix, broker=address, share=True, timeout=60) as loader:
                got = flat(loader)
    assert sorted(got) == sorted(flat(mix.iter(0)))
    # Before any input runs out (the 10% one, 700 elements, near draw 7,000):
    assert_every_window_holds(which(got), 5000, workers)


def test_a_deterministic_mix_in_static_shards_holds_its_weights_and_repeats_its_stream(
        tmp_path):
    mix = few_splits(tmp_path)
    runs = []
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MixWindowWarning)
            with Loader(mix, num_workers=2, sharding="static", deterministic=True,
                        timeout=60) as loader:
                runs.append(flat(loader))
    assert runs[0] == runs[1]
    assert sorted(runs[0]) == sorted(flat(mix.iter(0)))
    assert_every_window_holds(which(runs[0]), 5000, "static")


@pytest.mark.parametrize("workers", [pytest.param(8, marks=pytest.mark.slow)])
def test_workers_drawing_a_mix_take_few_of_an_input_s_splits_ahead(tmp_path, workers):
    """A worker reading quick splits asks for many ahead; drawing a mix among the splits
    it holds, it takes at most 1/MIX_AHEAD_SHARE of an input's (else one worker took an
    input's splits and the others' streams went without it for a while)."""
    mix = few_splits(tmp_path).repeat(1).repeat(1)  # (two repeats: the workers draw it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixWindowWarning)
        with Loader(mix, num_workers=workers, timeout=60) as loader:
            got = flat(loader)
    assert sorted(got) == sorted(flat(mix.iter(0)))
    assert_every_window_holds(which(got), 5000, workers)
