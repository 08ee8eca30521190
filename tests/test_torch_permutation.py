"""A large shuffle's first indices emulated while torch draws the whole permutation on a
thread (zloader/torch/permutation.py): torch's permutation index for index, and the
generator left at once as ``torch.randperm`` leaves it."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import zloader.torch as zt
from tests.test_torch_sampled import Sized
from zloader.torch import permutation
from zloader.torch.permutation import Permutation


def _generator(seed: int, draws: int) -> torch.Generator:
    """A generator seeded with ``seed`` that drew ``draws`` times already (its mt19937
    part-way through its state, or at its start when none)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    for _ in range(draws):
        torch.empty((), dtype=torch.int64).random_(generator=generator)
    return generator


def _theirs(count: int, state: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    generator = torch.Generator()
    generator.set_state(state)
    return torch.randperm(count, generator=generator).numpy(), generator.get_state()


def test_this_torch_s_kernel_is_the_one_emulated() -> None:
    # (else every large shuffle draws the whole permutation before the first batch)
    assert permutation._checked()
    smallest = permutation.PERMUTATION_MIN_SAMPLES
    assert permutation.available(smallest, torch.Generator())
    assert not permutation.available(smallest - 1, torch.Generator())
    assert not permutation.available(permutation._LIMIT, torch.Generator())


def test_a_kernel_other_than_the_one_emulated_is_found_out_before_any_use(monkeypatch) -> None:
    emulate = Permutation._emulate

    def off_by_one(self: Permutation, stop: int) -> None:
        emulate(self, stop)
        self._emulated[:stop] = (self._emulated[:stop] + 1) % self.count

    monkeypatch.setattr(Permutation, "_emulate", off_by_one)
    permutation._checked.cache_clear()
    try:
        assert not permutation._checked()
        assert not permutation.available(permutation.PERMUTATION_MIN_SAMPLES, torch.Generator())
    finally:
        monkeypatch.undo()
        permutation._checked.cache_clear()
    assert permutation._checked()


@pytest.mark.parametrize("count", [2, 624, 625, 1249, 5000, 70_001])
@pytest.mark.parametrize("draws", [0, 1, 623, 700])
@pytest.mark.parametrize("thread", [True, False])
def test_the_permutation_and_the_generator_s_state_are_torch_s(count, draws, thread) -> None:
    generator = _generator(count + draws, draws)
    before = generator.get_state()
    mine = Permutation(count, generator, ahead=min(count, 3000), thread=thread)
    want, after = _theirs(count, before)
    assert torch.equal(generator.get_state(), after)  # (at once, before any index)
    pieces, at, rng = [], 0, random.Random(count)
    while at < count:  # (taken in uneven steps, emulated then torch's)
        stop = min(count, at + rng.choice([1, 7, 64, 500, 4000]))
        pieces.append(mine[at:stop].copy())
        at = stop
    assert np.array_equal(np.concatenate(pieces), want)
    tail = max(0, count - 3)
    assert np.array_equal(mine[tail:], want[tail:])


def test_a_process_that_exits_while_torch_draws_the_permutation_exits_cleanly() -> None:
    # (a daemon thread inside torch's C++ code aborts the interpreter's exit)
    code = ("import torch; from zloader.torch.permutation import Permutation; "
            "g = torch.Generator(); g.manual_seed(0); "
            "print(Permutation(3_000_000, g)[0:5000][:4].tolist())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)) == 4


def test_the_thread_starts_once_a_quarter_of_the_emulated_indices_are_taken() -> None:
    # (started with the workers, it slowed their start on a host with few cores)
    mine = Permutation(100_000, _generator(4, 0), ahead=4000)
    first = mine[0:1000].copy()
    assert mine._thread is None
    assert mine[0:1001][:1000].tolist() == first.tolist()
    thread = mine._thread
    assert thread is not None
    thread.join()
    want, _ = _theirs(100_000, _generator(4, 0).get_state())
    assert np.array_equal(mine[0:100_000], want)


def test_a_fork_waits_for_the_thread_drawing_a_permutation() -> None:
    generator = _generator(5, 0)
    mine = Permutation(3_000_000, generator)
    mine.take(permutation.PERMUTATION_AHEAD // 4 + 1)
    thread = mine._thread
    assert thread is not None and thread in permutation._running
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert not thread.is_alive() and thread not in permutation._running


def test_a_deferred_permutation_moves_its_generator_on_when_settled() -> None:
    generator = _generator(6, 2)
    want, after = _theirs(200_000, generator.get_state())
    before = generator.get_state()
    mine = permutation.randperm(200_000, generator, defer=True)
    assert isinstance(mine, Permutation)
    first = mine[0:64].copy()
    assert torch.equal(generator.get_state(), before)  # (not yet)
    permutation.settle()
    assert torch.equal(generator.get_state(), after)
    assert np.array_equal(first, want[:64])
    other = _generator(7, 0)  # (any later draw settles those deferred first)
    mine = permutation.randperm(200_000, generator, defer=True)
    permutation.skip(10, other)
    assert not torch.equal(generator.get_state(), after)
    assert np.array_equal(mine[0:200_000], _theirs(200_000, after)[0])


class _Slow:
    """A permutation's engine whose skip is slowed (``skipping`` set as it starts): a
    thread that settles it is inside the skip for 0.3 s."""

    def __init__(self, engine: Any, skipping: threading.Event) -> None:
        self.engine, self.skipping = engine, skipping

    def random_raw(self, *args: Any, **kwargs: Any) -> Any:
        self.skipping.set()
        time.sleep(0.3)
        return self.engine.random_raw(*args, **kwargs)

    @property
    def state(self) -> Any:
        return self.engine.state


def test_a_permutation_settled_by_another_thread_meanwhile_is_still_torch_s(
        monkeypatch, caplog) -> None:
    # (a second loader's iter() on another thread settles what is pending: whoever comes
    # second waits for the skip, so the whole permutation is checked against its end)
    monkeypatch.setattr(permutation, "_broken", False)
    count = 3_000_000
    generator = _generator(8, 1)
    want, after = _theirs(count, generator.get_state())
    mine = Permutation(count, generator, ahead=1000, thread=False, defer=True)
    mine.take(1000)
    skipping = threading.Event()
    assert mine._move is not None
    gen, engine, rest, words = mine._move
    mine._move = (gen, _Slow(engine, skipping), rest, words)
    other = threading.Thread(target=permutation.settle)
    with caplog.at_level(logging.WARNING, "zloader.torch"):
        other.start()
        assert skipping.wait(10)
        whole = mine[0:count]  # (settles it too: waits for the other thread's skip)
        other.join()
    assert np.array_equal(whole, want) and torch.equal(generator.get_state(), after)
    assert not permutation._broken and "not the permutation" not in caplog.text


def test_settle_returns_once_what_another_thread_took_is_settled() -> None:
    # (a second loader's thread settles this loader's pending permutation: this loader's
    # iter() returns only once its generator has moved on)
    generator = _generator(9, 0)
    _, after = _theirs(300_000, generator.get_state())
    mine = permutation.randperm(300_000, generator, defer=True)
    assert isinstance(mine, Permutation) and mine._move is not None
    skipping = threading.Event()
    gen, engine, rest, words = mine._move
    mine._move = (gen, _Slow(engine, skipping), rest, words)
    other = threading.Thread(target=permutation.settle)
    other.start()
    assert skipping.wait(10)  # (the other thread took it and skips)
    permutation.settle()
    assert torch.equal(generator.get_state(), after)
    other.join()


def test_skip_moves_the_generator_on_as_a_dropped_randperm_does() -> None:
    generator = _generator(9, 3)
    _, after = _theirs(300_000, generator.get_state())
    permutation.skip(300_000, generator)
    assert torch.equal(generator.get_state(), after)


def test_a_whole_permutation_that_differs_from_the_emulated_one_still_gives_each_index_once(
        monkeypatch, caplog) -> None:
    monkeypatch.setattr(permutation, "_broken", False)
    drawn = Permutation._draw

    def reversed_draw(self: Permutation, start: torch.Tensor, nice: bool = True) -> None:
        drawn(self, start, nice)
        self._drawn["order"] = self._drawn["order"][::-1].copy()

    monkeypatch.setattr(Permutation, "_draw", reversed_draw)
    count = 10_000
    mine = Permutation(count, _generator(1, 0), ahead=count, thread=False)
    first = mine[0:100].copy()
    with caplog.at_level(logging.WARNING, "zloader.torch"):
        whole = mine[0:count]
    assert np.array_equal(whole[:100], first)
    assert np.array_equal(np.sort(whole), np.arange(count))
    assert "not the permutation zloader emulated for its first 100 indices" in caplog.text
    assert not permutation.available(count * 100, torch.Generator())  # (plain from now on)


def test_a_loader_s_emulated_epochs_are_torch_s_and_so_is_its_generator_after_each(
        monkeypatch) -> None:
    monkeypatch.setattr(permutation, "PERMUTATION_MIN_SAMPLES", 1000)
    monkeypatch.setattr(permutation, "PERMUTATION_AHEAD", 500)
    data = Sized(20_000)
    generator = torch.Generator()
    generator.manual_seed(2)
    theirs = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True,
                                         generator=generator)
    want, states = [], []
    for _ in range(2):
        iterator = iter(theirs)
        want.append([next(iterator).tolist()])
        states.append(generator.get_state())  # (the user's view: after the first batch)
        want[-1].extend(b.tolist() for b in iterator)
    generator.manual_seed(2)
    ours = zt.DataLoader(data, batch_size=64, shuffle=True, generator=generator,
                         num_workers=2)
    try:
        for epoch in range(2):
            iterator = iter(ours)  # (torch's iter() with workers draws the permutation)
            assert torch.equal(generator.get_state(), states[epoch])
            got = [next(iterator).tolist()]
            assert torch.equal(generator.get_state(), states[epoch])
            got.extend(b.tolist() for b in iterator)
            assert got == want[epoch]
    finally:
        ours.close()
