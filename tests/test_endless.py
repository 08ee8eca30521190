"""Endless and repeated pipelines through the service: an epoch never ends short without
an error (design invariant 8), whichever workers die, and an empty endless input still
ends."""

from __future__ import annotations

import signal

import pytest

from tests.service import service
from zloader import Loader, Pipeline
from zloader.plan import plan
from zloader.runs import Context, Coverage, RunSettings


def _worker_part(pipeline: Pipeline, passes: dict[tuple[int, ...], list[int]],
                 num_splits: int) -> list[object]:
    """The worker part of ``pipeline`` run as a dynamically sharded worker that is handed
    ``passes[key]`` in each pass (none once the dict has no more: as if other workers took
    them), up to 20 elements."""
    ctx = Context(RunSettings(entropy=0), coverage=Coverage(num_splits, lambda: False))
    out = []
    for element in plan(pipeline).run_worker(lambda key: passes.get(key, []), 0, ctx):
        out.append(element)
        if len(out) == 20:
            break
    return out


def test_a_worker_whose_pass_went_to_others_goes_on_repeating():
    # Pass (0, 0) went to another worker; this one reads pass (0, 1) and on.
    passes = {(0, r): [0] for r in range(1, 30)}
    assert _worker_part(Pipeline.range(1).repeat(), passes, 1) == [0] * 20


def test_a_worker_ends_an_endless_repeat_once_it_read_every_split_empty():
    # Two splits, both empty after the filter, read in separate passes: then it ends.
    passes = {(0, 0): [0], (0, 1): [], (0, 2): [1]}
    for r in range(3, 1000):
        passes[(0, r)] = [0]
    got = _worker_part(Pipeline.range(2, split_size=1).filter(lambda x: False).repeat(),
                       passes, 2)
    assert got == []


def test_a_worker_with_no_splits_at_all_ends_an_endless_repeat():
    assert _worker_part(Pipeline.range(0).repeat(), {}, 0) == []


@pytest.mark.parametrize(("killed", "exactly_once"), [
    pytest.param(1, True, marks=pytest.mark.slow), (3, True),
    pytest.param(3, False, marks=pytest.mark.slow)])
def test_killing_workers_never_ends_an_endless_epoch(killed: int, exactly_once: bool):
    with service(workers=4) as (address, procs):
        with Loader(Pipeline.range(1).repeat(), broker=address, timeout=60,
                    exactly_once=exactly_once) as loader:
            count = 0
            for count, value in enumerate(loader, 1):
                assert value == 0
                if count == 20:
                    for p in procs[:killed]:
                        p.send_signal(signal.SIGKILL)
                if count == 400:
                    break
            assert count == 400, f"the endless epoch ended after {count} elements"


@pytest.mark.parametrize("exactly_once", [True, False])
def test_an_empty_endless_input_still_ends_through_workers(exactly_once: bool):
    for pipeline in (Pipeline.range(0).repeat(),
                     Pipeline.range(8, split_size=1).filter(lambda x: False).repeat()):
        with Loader(pipeline, num_workers=2, timeout=30, exactly_once=exactly_once) as loader:
            assert list(loader) == []
