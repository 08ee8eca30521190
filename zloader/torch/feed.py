"""A map-style epoch's batches, sampled as torch samples them and handed to the workers
as they are due: the sampler is pulled ``prefetch_factor * num_workers`` times at
``iter()``, then once per batch yielded (torch's ``_try_put_index``), and each batch's
indices travel to its worker in the ``DISPATCH`` that hands it out. Nothing is drawn or
planned for the whole epoch up front, so the first batch costs the same for ten thousand
samples as for three million, and a sampler whose draws depend on training (a curriculum
that the trainer reweighs mid-epoch) is pulled when torch would pull it.

A batch of int indices goes as ``[j, n, k_1, ..., k_n]`` (its number, its size and its
indices, zigzag-coded so that a negative index fits a DISPATCH's non-negative items: see
:func:`encode`). A sampler whose first batch holds another kind of key (a ``str`` for a
dict-like dataset, a tensor) is drawn whole at ``iter()`` instead, and every worker is
planned the keys of its batches (``passes.worker_plans``); its DISPATCHes name batch
numbers only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

from zloader.torch import permutation
from zloader.torch.states import Batches

__all__ = ["Dispatcher", "Feed", "batches_of", "decode", "encode"]

_END = object()


def encode(number: int, keys: list[int] | np.ndarray) -> np.ndarray:
    """A batch's DISPATCH items: ``[number, len(keys), *zigzag(keys)]`` (int64 >= 0)."""
    array = np.asarray(keys, dtype=np.int64)
    out = np.empty(len(array) + 2, np.int64)
    out[0], out[1] = number, len(array)
    out[2:] = array << 1
    negative = array < 0
    out[2:][negative] = ((-array[negative]) << 1) - 1
    return out


def batches_of(sampler: Any) -> Iterator[Any]:
    """An iterator over a map-style epoch's batches: ``iter(sampler)``, or, for torch's
    own ``BatchSampler`` over its ``RandomSampler`` (without replacement or
    ``num_samples``) or ``SequentialSampler`` (what ``DataLoader(batch_size=...,
    shuffle=...)`` makes), the same batches as int64 arrays, cut from one permutation
    without making a Python int of each index (``tolist`` of 3 M indices is most of the
    sampler's time), drawing from the same generators at the same pulls
    (:func:`_cut`)."""
    sampler_type = type(getattr(sampler, "sampler", None))
    if type(sampler) is not torch.utils.data.BatchSampler or sampler_type not in (
            torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler):
        return iter(sampler)
    inner: Any = sampler.sampler
    if sampler_type is torch.utils.data.RandomSampler and (
            inner.replacement or inner._num_samples is not None):
        return iter(sampler)
    return _cut(inner, sampler.batch_size, sampler.drop_last)


def _cut(inner: Any, size: int, drop_last: bool) -> Iterator[Any]:
    """``BatchSampler(inner, size, drop_last)``'s batches, as arrays. Torch's draws, in
    its order: a ``RandomSampler`` without a generator draws its seed from torch's
    global one at the first pull; each draws a permutation then, and a second (empty)
    one where torch's sampler goes past its first: in the pull that makes a last partial
    batch, or else in the pull that finds the epoch over. A large permutation's first
    indices are emulated while torch draws it on a thread (zloader/torch/permutation.py):
    the generator moves on as torch's does, by the end of the DataLoader's ``iter()``
    (``permutation.settle``)."""
    count = len(inner.data_source)
    if count == 0:  # (torch's sampler then fails as it fails, or yields nothing)
        yield from torch.utils.data.BatchSampler(inner, size, drop_last)
        return
    shuffled = type(inner) is torch.utils.data.RandomSampler
    generator = None
    if shuffled:
        generator = inner.generator
        if generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        order: Any = permutation.randperm(count, generator, defer=True)
    else:
        order = np.arange(count, dtype=np.int64)
    full = count - count % size
    for start in range(0, full, size):
        yield order[start:start + size]
    if generator is not None:
        permutation.skip(count, generator)  # (torch's sampler's last, empty one)
    if full < count and not drop_last:
        yield order[full:]


def decode(items: list[int]) -> list[int]:
    """The indices that :func:`encode` zigzag-coded (``items`` past the number and size)."""
    return [k >> 1 if not k & 1 else -((k + 1) >> 1) for k in items]


class Feed:
    """The batches of a map-style epoch not yielded before (``done``: a resumed epoch's),
    pulled one at a time from the sampler's iterator ``indices``, numbered from 0 in the
    order it yields them. ``batched``: the sampler yields lists of indices (a batch
    sampler); else single indices, one batch each.

    The first batch is pulled at once: when its keys are not all ints, :attr:`streamed` is
    False and :meth:`sampled` draws the rest of the epoch."""

    def __init__(self, indices: Iterator[Any], done: Batches, batched: bool) -> None:
        self._indices = indices
        self._done = done
        self._batched = batched
        self._number = 0  # the next batch's number
        self.total: int | None = None  # the epoch's batches, once the sampler ended
        self._first = next(indices, _END)
        self.streamed = self._first is _END or _all_ints(self._keys(self._first))

    def _keys(self, batch: Any) -> list[Any] | np.ndarray:
        if not self._batched:
            return [batch]
        if isinstance(batch, np.ndarray) and batch.dtype == np.int64:  # (batches_of's)
            return batch
        return batch if isinstance(batch, list) else list(batch)

    def sampled(self) -> list[Any]:
        """The whole epoch's batches, drawn now (keys other than ints: see the module)."""
        first, self._first = self._first, _END
        batches = [] if first is _END else [first]
        batches.extend(self._indices)
        self.total = len(batches)
        return batches

    def next(self) -> np.ndarray | None:
        """The next batch's DISPATCH items (:func:`encode`), None once the sampler ended.

        Raises:
            TypeError: a batch after the first holds a key that is not an int.
        """
        while True:
            if self._first is not _END:  # (pulled at construction)
                batch, self._first = self._first, _END
            else:
                batch = next(self._indices, _END)
            if batch is _END:
                self.total = self._number
                return None
            number = self._number
            self._number += 1
            if number in self._done:  # (yielded before the state this epoch resumes)
                continue
            keys = self._keys(batch)
            if not _all_ints(keys):
                bad = next(k for k in keys if type(k) is not int)
                raise TypeError(
                    f"the sampler yielded the index {bad!r} ({type(bad).__name__}) in batch "
                    f"{number}, after batches of ints: zloader.torch.DataLoader hands a "
                    "map-style epoch's batches to its workers as they are drawn, which "
                    "needs every index of an epoch to be an int or every one another key")
            return encode(number, keys)


class Dispatcher:
    """An epoch's batches handed to the workers as torch's iterator hands them, each
    pulled from ``next_batch`` (a :meth:`Feed.next`, or batch numbers of a plan) when it
    is handed out: ``prefetch`` per worker at the start (:meth:`prime`), then one per
    batch received. In order, batch ``j`` goes to worker ``j mod workers``; with
    ``in_order=False`` each goes to the next worker in turn with fewer than ``prefetch``
    batches outstanding, so a worker stuck on a slow batch gets no more while the others
    go on. ``send(worker, items)`` is ``Loader.dispatch``; once the sampler has ended,
    every worker is told that none follow. :attr:`sent` holds the numbers handed out and
    not yet received, in order. ``done(worker, items)`` is ``Loader.dispatch_done``: a
    batch received, its items are done (the Loader sends a worker those not done again
    when its stream of them was lost; a batch made twice so is received once)."""

    def __init__(self, send: Callable[[int, Any], None],
                 next_batch: Callable[[], np.ndarray | None], workers: int, prefetch: int,
                 in_order: bool, done: Callable[[int, int], None] | None = None) -> None:
        self._send, self._done = send, done
        self._items: dict[int, int] = {}  # a number handed out -> how many items it took
        self._next = next_batch
        self._outstanding = [0] * workers
        self._turn = 0
        self._prefetch = prefetch
        self._in_order = in_order
        self.ended = False
        self.sent: deque[int] = deque()

    def prime(self) -> None:
        """Hand out the first ``prefetch`` batches of each worker."""
        for _ in range(self._prefetch * len(self._outstanding)):
            self._put()

    def outstanding(self, number: int) -> bool:
        """Whether batch ``number`` was handed out and not received yet."""
        return number in self._items

    def received(self, worker: int, number: int) -> bool:
        """Batch ``number`` of ``worker`` came (in order: was yielded): its items are done,
        hand out the next. False (and nothing done) for a batch received before: made
        again after its items were sent again."""
        items = self._items.pop(number, None)
        if items is None:
            return False
        if self._done is not None:
            self._done(worker, items)
        self._outstanding[worker] -= 1
        if self.sent and self.sent[0] == number:
            self.sent.popleft()
        else:
            self.sent.remove(number)
        self._put()
        return True

    def _put(self) -> None:
        if self.ended:
            return
        workers = len(self._outstanding)
        worker = None
        if not self._in_order:
            for _ in range(workers):
                candidate, self._turn = self._turn, (self._turn + 1) % workers
                if self._outstanding[candidate] < self._prefetch:
                    worker = candidate
                    break
            else:
                return  # (every worker is full: the sampler is not pulled ahead)
        items = self._next()
        if items is None:
            self.ended = True
            for each in range(workers):
                self._send(each, [])
            return
        number = int(items[0])
        if worker is None:
            worker = number % workers
        self._outstanding[worker] += 1
        self.sent.append(number)
        self._items[number] = len(items)
        self._send(worker, items)


def _all_ints(keys: list[Any] | np.ndarray) -> bool:
    return isinstance(keys, np.ndarray) or set(map(type, keys)) <= {int}
