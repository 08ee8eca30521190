"""The autoscaling policy (zloader/broker/autoscale.py) on traces: a simulated job whose consumers'
starvation follows from its worker count, sampled once a second, with seeded noise."""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import random
from collections.abc import Callable

import pytest

from zloader.broker.autoscale import START_SECONDS, Autoscaler


def run(need: float | Callable[[int], float], start: int, seconds: int = 3000,
        noise: float = 0.02, ceiling: float = 1.0, seed: int = 0,
        floor_wait: float = 0.0) -> list[int]:
    """Worker counts over time; the actuator follows the decision at once. Consumers wait
    ``1 - workers / need`` of their time (at least ``floor_wait``, e.g. a transfer they
    wait on whatever the workers), capped at ``ceiling``; ``need`` may change over time (a
    function of the second)."""
    rng = random.Random(seed)
    scaler = Autoscaler(cooldown=30.0)
    workers, history = start, []
    for now in range(seconds):
        needed = need(now) if callable(need) else need
        starvation = min(ceiling, max(floor_wait, 1.0 - workers / needed))
        starvation = max(0.0, starvation + rng.uniform(-noise, noise))
        workers = scaler.update(float(now), workers, starvation)
        history.append(workers)
    return history


def changes(history: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(history) if a != b)


@pytest.mark.parametrize("need", [1, 2, 4, 14, 15, 16, 24, 32, 100, 1000])
@pytest.mark.parametrize("seed", range(3))
def test_a_job_that_needs_up_to_a_thousand_workers_gets_them_in_a_few_steps(need, seed):
    """From one worker, a job reaches what it needs in a number of decisions that grows
    with the logarithm of the need (each step at most doubles the count, and goes no
    further than the count that would end the waiting), then stays there: probes with
    backoff, no oscillation. (One worker at a time, with each addition to cut the waiting
    by 7 points, no job grew past 14.)"""
    history = run(need=float(need), start=1, seconds=6000, seed=seed)
    decisions = 30  # seconds: the cooldown
    reached = next(i for i, w in enumerate(history) if w >= 0.95 * need)
    # log2(need) doublings and a few more steps, and two steps undone by noise (each a
    # hold of 10 cooldowns) at most
    assert reached <= decisions * (math.ceil(math.log2(need)) + 4 + 2 * 10)
    assert 0.95 * need <= history[-1] <= 1.1 * need + 1
    assert changes(history[3000:]) <= 4  # settled: rare probes, with backoff
    assert max(history) <= 1.1 * need + 1  # never far past the need


def test_a_job_whose_need_drops_comes_down_and_stays():
    # 32 workers needed, then 8 (the consumer slowed): an eighth fewer per cooldown while
    # that costs the consumers nothing; the count that costs them is undone.
    history = run(need=lambda now: 32.0 if now < 1000 else 8.0, start=1, seconds=4000)
    assert history[999] == 32
    assert 8 <= history[-1] <= 9
    assert changes(history[2500:]) <= 4


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


def test_a_job_not_bound_by_its_workers_gets_one_try_and_no_more():
    # The consumers wait 40% of the time however many workers serve (a slow link): the
    # count that would end that wait (2 / 0.6: 4) is tried once, undone, and probed again
    # only with backoff.
    history = run(need=1.0, start=2, floor_wait=0.4)
    assert max(history) <= 4 and history[-1] in (2, 3)
    assert changes(history) <= 8  # 4 tries in 3,000 s, 300, 600 then 1,200 s apart


def test_noise_around_a_threshold_does_not_make_it_flap():
    history = run(need=4.0, start=4, noise=0.05)
    assert changes(history) <= 8


def test_actuators_that_lag_are_waited_for_two_cooldowns():
    scaler = Autoscaler(cooldown=10.0)
    assert scaler.update(0.0, 1, 0.9) == 1
    assert scaler.update(11.0, 1, 0.9) == 2  # decided: add one
    for now in range(12, 25):  # the actuator has not started it yet: no new decision
        assert scaler.update(float(now), 1, 0.9) == 2
    for now in range(25, 35):  # it came: a cooldown of samples from now on
        assert scaler.update(float(now), 2, 0.5) == 2
    assert scaler.update(35.0, 2, 0.5) == 4  # it helped by 40 points: on to 2 / 0.5


def test_an_addition_never_carried_out_is_given_up_and_not_asked_again_for_a_while():
    scaler = Autoscaler(cooldown=10.0)  # e.g. an actuator at its --max-processes
    scaler.update(0.0, 2, 0.9)
    assert scaler.update(11.0, 2, 0.9) == 4  # (twice as many at most in one step)
    assert scaler.update(11.0 + START_SECONDS - 1, 2, 0.9) == 4
    assert scaler.update(11.0 + START_SECONDS + 1, 2, 0.9) == 2  # given up
    for now in range(80, 170):  # a ceiling for hold cooldowns, though it still waits
        assert scaler.update(float(now), 2, 0.9) == 2


def test_an_addition_whose_need_went_away_is_dropped_at_once():
    scaler = Autoscaler(cooldown=10.0)
    scaler.update(0.0, 2, 0.9)
    assert scaler.update(11.0, 2, 0.9) == 4
    assert scaler.update(12.0, 2, 0.0) == 4  # one quiet sample is not enough (reports jitter)
    for now in range(13, 16):
        assert scaler.update(float(now), 2, 0.01) == 4
    assert scaler.update(16.0, 2, 0.01) == 2  # half a cooldown quiet: no more wanted
    for now in range(17, 26):
        scaler.update(float(now), 2, 0.01)
    assert scaler.update(26.0, 2, 0.01) == 1  # and no ceiling: it may shrink as usual


TRACES = json.loads((pathlib.Path(__file__).parent / "data" / "autoscale_traces.json")
                    .read_text())


def replay(workload: str, start: int, seconds: float = 3000.0) -> list[int]:
    """Worker counts over time when the starvation the broker sees is the one recorded
    with that many workers (bench/autoscale_trace.py; counts above 4 replay 4's)."""
    recorded = TRACES["workloads"][workload]
    step = TRACES["heartbeat"]
    scaler = Autoscaler(cooldown=30.0)
    workers, history = start, []
    for i in range(int(seconds / step)):
        samples = recorded[str(min(workers, 4))]
        workers = scaler.update(i * step, workers, samples[i % len(samples)])
        history.append(workers)
    return history


def test_on_the_recorded_io_bound_trace_it_settles_at_the_count_that_ends_the_wait():
    history = replay("io", start=1)
    assert history[-1] == 3 and max(history) <= 4
    assert changes(history[len(history) // 2:]) <= 4  # rare probes, with backoff


def test_on_the_recorded_cpu_bound_trace_it_stops_where_workers_stop_helping():
    # Two cores: the recorded wait is 80, 71, 52 and 47% with 1 to 4 workers (more replay
    # 4's). Going from 2 to 4 cut it by 24 points of the 29 it would have if the workers
    # were all the consumer waits for: kept; doubling to 8 bought nothing: undone, and
    # probed again only with backoff.
    history = replay("cpu", start=1)
    assert history[-1] == 4 and max(history) == 8
    assert changes(history[len(history) // 2:]) <= 4


def test_on_the_recorded_traces_an_over_provisioned_job_comes_down():
    assert replay("io", start=8)[-1] == 3


def test_a_worker_lost_on_its_own_is_waited_for_and_sets_no_ceiling():
    scaler = Autoscaler(cooldown=10.0)
    for now in range(0, 600):  # steady at 4, waiting 5%: no change
        assert scaler.update(float(now), 4, 0.05) == 4
    for now in range(600, 600 + int(START_SECONDS)):  # one died: a replacement may come
        assert scaler.update(float(now), 3, 0.3) == 4
    assert scaler.update(600.0 + START_SECONDS + 1, 3, 0.3) == 3  # none came: taken
    for now in range(662, 672):
        scaler.update(float(now), 3, 0.3)
    assert scaler.update(672.0, 3, 0.3) == 5  # and asked for again (3 / 0.7): no ceiling


def test_a_removal_never_carried_out_sets_a_floor_instead_of_flapping():
    scaler = Autoscaler(cooldown=10.0)  # a fixed pool: nobody drains
    history = [scaler.update(float(now), 4, 0.0) for now in range(0, 400)]
    assert history[10] == 3  # asked for
    assert set(history[50:150]) == {4}  # given up: 4 is a floor for hold cooldowns
    assert changes(history) <= 5  # then probed again, with backoff (flapping: 8 or more)
