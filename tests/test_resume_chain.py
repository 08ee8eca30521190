"""A state taken from a resumed Loader covers everything delivered since the epoch began
(design invariant 8): resumes of resumes, with workers killed in between and the
consumer count changing, yield each element of the epoch once."""

from __future__ import annotations

import collections
import os
import signal
from typing import Any

from tests.service import service
from zloader import Loader, Pipeline

N = 3000
PIPELINE = Pipeline.range(N, split_size=100).shuffle(500, seed=3)


def _part(state: Any, count: int, seen: collections.Counter, kill_at: int | None = None,
          **options: Any) -> dict[str, Any]:
    """Read ``count`` elements of a Loader resumed from ``state`` (killing one of its two
    workers after ``kill_at``) and return its state."""
    with Loader(PIPELINE, num_workers=2, state=state, timeout=60, **options) as loader:
        iterator = iter(loader)
        for taken in range(count):
            seen[next(iterator)] += 1
            if taken == kill_at:
                os.kill(loader._processes[0].pid, signal.SIGKILL)
        return loader.state_dict()


def _rest(state: Any, seen: collections.Counter) -> None:
    with Loader(PIPELINE, num_workers=2, state=state, timeout=60) as loader:
        seen.update(loader)


def _assert_once(seen: collections.Counter) -> None:
    repeated = sorted(value for value, times in seen.items() if times > 1)
    lost = sorted(set(range(N)) - set(seen))
    assert not repeated and not lost, \
        f"{len(repeated)} repeated (e.g. {repeated[:5]}), {len(lost)} lost (e.g. {lost[:5]})"


def test_a_resume_of_a_resume_yields_each_element_once():
    seen: collections.Counter = collections.Counter()
    s1 = _part(None, 700, seen)
    s2 = _part(s1, 700, seen)
    _rest(s2, seen)
    _assert_once(seen)


def test_a_chain_of_four_resumes_with_workers_killed_between_yields_each_element_once():
    seen: collections.Counter = collections.Counter()
    state = None
    for part in range(4):
        state = _part(state, 500, seen, kill_at=100 if part % 2 else None)
    _rest(state, seen)
    _assert_once(seen)


def test_a_state_taken_before_iterating_a_resumed_loader_is_the_state_it_resumed():
    seen: collections.Counter = collections.Counter()
    s1 = _part(None, 600, seen)
    with Loader(PIPELINE, num_workers=2, state=s1, timeout=60) as loader:
        untouched = loader.state_dict()
    assert untouched["epoch"] == s1["epoch"]
    s3 = _part(untouched, 600, seen)
    _rest(s3, seen)
    _assert_once(seen)


def test_job_name_consumers_resumed_by_one_then_another_yield_each_element_once():
    seen: collections.Counter = collections.Counter()
    with service(workers=2) as (address, _):
        loaders = [Loader(PIPELINE, broker=address, job_name="chain", timeout=60)
                   for _ in range(2)]
        try:
            live = [iter(loader) for loader in loaders]
            taken = 0
            while live and taken < 600:  # (in turn; a consumer whose part ended leaves:
                for iterator in list(live):  # the other may have been dealt most of it)
                    try:
                        seen[next(iterator)] += 1
                        taken += 1
                    except StopIteration:
                        live.remove(iterator)
            states = [loader.state_dict() for loader in loaders]
        finally:
            for loader in loaders:
                loader.close()
        # Two consumers' states resumed by one consumer, then that one's state by another.
        with Loader(PIPELINE, broker=address, job_name="chain", state=states,
                    timeout=60) as one:
            iterator = iter(one)
            for _ in range(700):
                seen[next(iterator)] += 1
            state = one.state_dict()
        with Loader(PIPELINE, broker=address, job_name="chain", state=state,
                    timeout=60) as last:
            seen.update(last)
    _assert_once(seen)
