"""The autoscaling policy (zloader/autoscale.py) on traces: a simulated job whose consumers'
starvation follows from its worker count, sampled once a second, with seeded noise."""

from __future__ import annotations

import itertools
import random

import pytest

from zloader.autoscale import Autoscaler


def run(need: float, start: int, seconds: int = 3000, noise: float = 0.02, ceiling: float = 1.0,
        seed: int = 0, floor_wait: float = 0.0) -> list[int]:
    """Worker counts over time; the actuator follows the decision at once. Consumers wait
    ``1 - workers / need`` of their time (at least ``floor_wait``, e.g. a transfer they
    wait on whatever the workers), capped at ``ceiling``."""
    rng = random.Random(seed)
    scaler = Autoscaler(cooldown=30.0)
    workers, history = start, []
    for now in range(seconds):
        starvation = min(ceiling, max(floor_wait, 1.0 - workers / need))
        starvation = max(0.0, starvation + rng.uniform(-noise, noise))
        workers = scaler.update(float(now), workers, starvation)
        history.append(workers)
    return history


def changes(history: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(history) if a != b)


@pytest.mark.parametrize("seed", range(5))
def test_a_starved_job_grows_to_what_it_needs_and_stays(seed):
    history = run(need=4.0, start=1, seed=seed)
    assert history[-1] in (4, 5)  # 4 ends the waiting; a 5th may be tried and kept
    assert changes(history[1500:]) <= 2  # settled: at most one probe down and back


@pytest.mark.parametrize("seed", range(5))
def test_an_over_provisioned_job_shrinks_and_does_not_oscillate(seed):
    history = run(need=3.0, start=10, seed=seed)
    assert 3 <= history[-1] <= 4
    assert changes(history[600:]) <= 4  # settled: rare probes, each undone at once


def test_a_job_not_bound_by_its_workers_gets_one_more_try_and_no_more():
    # The consumers wait 40% of the time however many workers serve (a slow link).
    history = run(need=1.0, start=2, floor_wait=0.4)
    assert max(history) <= 3 and history[-1] in (2, 3)


def test_noise_around_a_threshold_does_not_make_it_flap():
    history = run(need=4.0, start=4, noise=0.05)
    assert changes(history) <= 8


def test_actuators_that_lag_are_waited_for():
    scaler = Autoscaler(cooldown=10.0)
    assert scaler.update(0.0, 1, 0.9) == 1
    assert scaler.update(11.0, 1, 0.9) == 2  # decided: add one
    for now in range(12, 40):  # the actuator has not started it yet: no new decision
        assert scaler.update(float(now), 1, 0.9) == 2
