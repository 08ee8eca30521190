"""``torch.randperm(count, generator)`` for a large epoch, its first indices at once.

torch's ``RandomSampler`` draws a permutation of the whole epoch at its first pull: 64 ms
for 3 M samples on a quiet core, and two or three times that on a host whose cores are
busy starting the workers, all of it before the first batch. Its CPU kernel (below
``2**32 / 20`` elements) is a forward Fisher-Yates shuffle: for ``i < count - 1``,
``j = i + random() % (count - i)`` and ``r[i], r[j]`` swapped, ``random()`` being the 32-bit
output of the generator's mt19937. Position ``i`` is final after the ``i``-th draw, so the
first ``k`` indices take ``k`` draws and a sparse record of the swaps. And the generator's
mt19937 is numpy's ``MT19937`` (the same twist and tempering, ``pos`` being torch's
``625 - left``), which skips the ``count - 1`` draws in C: 8 ms for 3 M.

So :class:`Permutation` leaves the generator as ``randperm`` would leave it (the user's
code, which may draw from the same generator, sees torch's states): at once, or, made with
``defer`` (a DataLoader's sampler), at :func:`settle`, which its ``iter()`` calls before it
returns, once the workers have their first batches. It emulates the
first indices as they are asked for, and has torch draw the whole permutation from a copy
of the generator on a thread of lower priority (``PERMUTATION_NICE``), which then takes
over. That thread starts only once a quarter of the emulated indices are taken: the first
batches are out by then. Started with the workers, it slowed their start on a host with
few cores (the 3 M, 8-worker first batch of bench.startup, 2 cores: 106 ms against 93
without it), though niced: torch's kernel runs part of its work on an OpenMP thread of
its own, at the trainer's priority. The emulation is checked against torch once per
process on a few small permutations (:func:`_checked`), and each whole permutation against
the indices emulated before it: a torch whose kernel differs gets a warning, still a
permutation (the rest of torch's, without the indices handed out already) and, from then
on, plain ``randperm``. The thread is not a daemon (an interpreter that exits while a
thread runs torch's C++ code aborts), and a fork waits for it (a child forked inside
torch's kernel could inherit its thread pool mid-task).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Any

import numpy as np
import torch

from zloader._defaults import PERMUTATION_AHEAD, PERMUTATION_MIN_SAMPLES, PERMUTATION_NICE

__all__ = ["Permutation", "available", "randperm", "settle", "skip"]

log = logging.getLogger("zloader.torch")

_LIMIT = (2**32 - 1) // 20  # (from here on, torch's kernel draws 64 bits an index)
_STATE_WORDS = 624  # mt19937's state: torch's CPU generator state holds it from byte 24
_LEFT, _NEXT, _WORDS = slice(8, 12), slice(16, 24), slice(24, 24 + 8 * _STATE_WORDS)
_broken = False  # a whole permutation differed from the emulated one: plain randperm
_running: set[threading.Thread] = set()  # the threads drawing a permutation now
_unsettled: list[Permutation] = []  # deferred: their generators not moved on yet
_SETTLING = threading.RLock()


def _settle() -> None:
    """Before a fork: wait for the threads drawing a permutation."""
    for thread in list(_running):
        thread.join()


os.register_at_fork(before=_settle)


def settle() -> None:
    """Move on the generators of the permutations made with ``defer`` since the last call
    (:meth:`Permutation.settle`): a DataLoader's ``iter()`` calls it once its workers have
    their first batches, so that the skip overlaps their making them, and before it
    returns (torch's ``iter()`` leaves the generator past its first permutation)."""
    with _SETTLING:  # (one another thread took is settled before this call returns)
        while _unsettled:
            _unsettled.pop(0).settle()


def available(count: int, generator: torch.Generator) -> bool:
    """Whether :class:`Permutation` stands for ``torch.randperm(count, generator)`` here:
    a CPU generator, a count in the emulated kernel's range and worth it, and this
    torch's kernel checked (:func:`_checked`)."""
    return (not _broken and PERMUTATION_MIN_SAMPLES <= count < _LIMIT
            and generator.device.type == "cpu" and _checked())


def randperm(count: int, generator: torch.Generator, defer: bool = False
             ) -> np.ndarray | Permutation:
    """``torch.randperm(count, generator=generator)``, as an array or, where it is
    :func:`available`, a :class:`Permutation` (``defer``: the generator moved on at the
    next :func:`settle`). Permutations deferred before are settled first."""
    settle()
    if available(count, generator):
        return Permutation(count, generator, defer=defer)
    return torch.randperm(count, generator=generator).numpy()


def skip(count: int, generator: torch.Generator) -> None:
    """Draw ``torch.randperm(count, generator=generator)`` and drop it: where it is
    :func:`available`, the generator is only moved on (8 ms for 3 M, not 64).
    Permutations deferred before are settled first."""
    settle()
    if available(count, generator):
        Permutation(count, generator, ahead=0, thread=False)
    else:
        torch.randperm(count, generator=generator)


@functools.cache
def _checked() -> bool:
    """Whether the emulation gives this torch's permutations and generator states (a few
    counts, from a generator that drew before)."""
    try:
        generator = torch.Generator()
        generator.manual_seed(0x5EED)
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        for count in (2, 3, 1000, 5000):
            before = generator.get_state()
            mine = Permutation(count, generator, ahead=count, thread=False)
            emulated = mine.take(count - 1).copy()  # (every index drawn: the last follows)
            after = generator.get_state()
            generator.set_state(before)
            theirs = torch.randperm(count, generator=generator).numpy()
            if not (np.array_equal(emulated, theirs[:count - 1])
                    and torch.equal(after, generator.get_state())):
                return False
        return True
    except Exception:  # (a state laid out otherwise: torch's own randperm, then)
        log.debug("torch.randperm is not emulated here", exc_info=True)
        return False


class Permutation:
    """``torch.randperm(count, generator)``, the generator left at once as that call
    leaves it; :meth:`take` gives its indices ``[0, stop)``: emulated until torch has
    drawn the whole one on a thread (``thread``, started once a quarter of ``ahead`` is
    taken), else emulated up to ``ahead``, then drawn."""

    def __init__(self, count: int, generator: torch.Generator,
                 ahead: int | None = None, thread: bool = True, defer: bool = False
                 ) -> None:
        self.count = count
        ahead = PERMUTATION_AHEAD if ahead is None else ahead
        start = generator.get_state()
        words = start.numpy()
        engine = np.random.MT19937()
        engine.state = {"bit_generator": "MT19937", "state": {
            "key": words[_WORDS].view(np.uint64).astype(np.uint32),
            "pos": 625 - int(words[_LEFT].view(np.int32)[0])}}
        draws = max(0, count - 1)
        self._draws = engine.random_raw(min(ahead, draws)).astype(np.int64)
        self._end: torch.Tensor | None = None
        self._move: tuple[torch.Generator, Any, int, np.ndarray] | None = (
            generator, engine, draws - len(self._draws), words)
        if defer:
            _unsettled.append(self)
        else:
            self.settle()
        self._swapped: dict[int, int] = {}  # position -> the index there, where moved
        self._emulated = np.empty(len(self._draws), np.int64)
        self._made = 0  # positions emulated
        self._order: np.ndarray | None = None
        self._drawn: dict[str, Any] = {}
        self._start = start
        self._thread: threading.Thread | None = None
        self._thread_at = ahead // 4 if thread else None  # (taken past it: started)

    def settle(self) -> None:
        """Leave the generator as ``randperm`` leaves it (once: the draws past the emulated
        ones skipped, in C and without the GIL; see :func:`settle`). Under a lock: two
        loaders' threads may both settle it, and each finds it moved on once they return."""
        with _SETTLING:
            move, self._move = self._move, None
            if move is None:
                return
            generator, engine, rest, words = move
            engine.random_raw(rest, output=False)
            state = engine.state["state"]
            end = words.copy()
            end[_LEFT] = np.array([625 - state["pos"]], np.int32).view(np.uint8)
            end[_NEXT] = np.array([state["pos"]], np.uint64).view(np.uint8)
            end[_WORDS] = state["key"].astype(np.uint64).view(np.uint8)
            self._end = torch.from_numpy(end)
            generator.set_state(self._end)

    def take(self, stop: int) -> np.ndarray:
        """The permutation's indices ``[0, stop)`` (a view: do not write into it)."""
        if self._order is None:
            if self._thread_at is not None and stop > self._thread_at:
                self._thread_at = None
                # (not a daemon: an interpreter that exits waits for it, as it must for a
                # thread in torch's C++ code, which is aborted otherwise)
                self._thread = threading.Thread(target=self._draw, args=(self._start,),
                                                name="zloader-randperm")
                _running.add(self._thread)
                self._thread.start()
            if stop <= len(self._draws) and (self._thread is None
                                             or self._thread.is_alive()):
                self._emulate(stop)
                return self._emulated[:stop]
            self._order = self._whole()
            self._swapped, self._draws = {}, self._draws[:0]
        return self._order[:stop]

    def __getitem__(self, part: slice) -> np.ndarray:
        """Its indices ``[part.start, part.stop)``, as an array's slice."""
        start, stop, _ = part.indices(self.count)
        return self.take(stop)[start:]

    def __len__(self) -> int:
        return self.count

    def _emulate(self, stop: int) -> None:
        swapped, draws, out, count = self._swapped, self._draws, self._emulated, self.count
        for i in range(self._made, stop):
            j = i + int(draws[i]) % (count - i)
            out[i] = swapped.get(j, j)
            swapped[j] = swapped.pop(i, i)
        self._made = max(self._made, stop)

    def _draw(self, start: torch.Tensor, nice: bool = True) -> None:
        """torch's whole permutation, from a copy of the generator as it was (on the
        thread: ``nice``)."""
        if nice:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PERMUTATION_NICE)
        try:
            copy = torch.Generator()
            copy.set_state(start)
            self._drawn["order"] = torch.randperm(self.count, generator=copy).numpy()
            self._drawn["end"] = copy.get_state()
        finally:
            _running.discard(threading.current_thread())

    def _whole(self) -> np.ndarray:
        """torch's whole permutation, checked against the positions emulated."""
        global _broken
        self.settle()
        if self._thread is not None:
            self._thread.join()
        if "order" not in self._drawn:  # (no thread, or it failed: drawn here)
            self._draw(self._start, nice=False)
        order, made = self._drawn["order"], self._made
        if np.array_equal(order[:made], self._emulated[:made]) and \
                self._end is not None and torch.equal(self._drawn["end"], self._end):
            return order
        _broken = True
        log.warning("torch.randperm(%d) here is not the permutation zloader emulated for "
                    "its first %d indices: this epoch's order is not torch's from index "
                    "%d on (still each index once); plain randperm from now on",
                    self.count, made, made)
        rest = order[~np.isin(order, self._emulated[:made])]
        return np.concatenate([self._emulated[:made], rest])
