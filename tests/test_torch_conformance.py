"""Conformance: the same case, run against ``torch.utils.data.DataLoader`` and against
``zloader.torch.DataLoader``, must show the user the same thing: the batches (as nested
lists), the exceptions (the type a user catches, and what the message says), the warnings,
the lengths.

A case is a function of the DataLoader class that returns what it saw. :func:`observe`
runs it with the global random states seeded alike, turns tensors into lists and an
exception into an :class:`Raised` record, and closes whatever zloader loaders the case
made. Each item of issue 17 has cases here (see docs/torch.md); those that need the
runtime to change are ``xfail(strict=True)`` with the reason. Cases that start many
processes (spawn), or wait on a timeout, are ``slow``.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import zloader.torch as zt

Case = Callable[[type], Any]


# --- the harness ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Raised:
    """An exception as the user sees it: the class an ``except`` clause would name (the
    first built-in or test-module class in its MRO) and facts about its message."""

    kind: type
    facts: tuple[Any, ...] = ()


def raised(exc: BaseException, *needles: str) -> Raised:
    kind = next(k for k in type(exc).__mro__
                if k.__module__ in ("builtins", __name__))
    return Raised(kind, tuple(needle in str(exc) for needle in needles))


def plain(value: Any) -> Any:
    """Tensors as lists (with their dtype), containers kept: comparable with ``==``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value) if not hasattr(value, "_fields") \
            else tuple(plain(v) for v in value)
    if isinstance(value, Iterator):
        return [plain(v) for v in value]
    return value


class Tracking:
    """The DataLoader class under test, remembering the zloader loaders made from it."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.made: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loader = self.cls(*args, **kwargs)
        self.made.append(loader)
        return loader

    def __getitem__(self, item: Any) -> Any:
        return self.cls[item]

    def close(self) -> None:
        for loader in self.made:
            close = getattr(loader, "close", None)
            if close is not None:
                close()
        self.made.clear()


def observe(cls: type, case: Case) -> Any:
    """What ``case`` saw with the DataLoader class ``cls``."""
    # Earlier tests' garbage collected here, not in a worker torch forks (torch's workers
    # do not freeze it): one run of the suite lost a torch worker to a segfault while
    # the child collected garbage at its fork.
    gc.collect()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    factory = Tracking(cls)
    try:
        return plain(case(factory))
    finally:
        factory.close()
        gc.collect()  # torch's workers of iterators a case dropped stop here
        stop_helpers()


def stop_helpers() -> None:
    """Stop the processes multiprocessing keeps for spawn and forkserver (the resource
    tracker, the fork server): they outlive torch's workers, and the leak check counts
    them."""
    from multiprocessing import forkserver, resource_tracker

    forkserver._forkserver._stop()  # type: ignore[attr-defined]
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


def batches(loader: Any) -> list[Any]:
    """Every outcome of one epoch: a batch, or a :class:`Raised` in a failed batch's place
    (the epoch goes on after it, as torch's does)."""
    out: list[Any] = []
    iterator = iter(loader)
    while True:
        try:
            out.append(plain(next(iterator)))
        except StopIteration:
            return out
        except Exception as exc:
            out.append(raised(exc, "worker process", "Traceback (most recent call last)",
                              "raise "))
        if len(out) > 1000:
            raise AssertionError("the epoch does not end")


def run_case(case: Case) -> None:
    expected = observe(tud.DataLoader, case)
    got = observe(zt.DataLoader, case)
    assert got == expected


CASES: dict[str, Any] = {}


def case(*marks: Any) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[fn.__name__] = pytest.param(fn, id=fn.__name__, marks=marks)
        return fn
    return register


# --- datasets ------------------------------------------------------------------------------

class Squares(tud.Dataset):
    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": torch.tensor([i, i * i]), "i": i}


class Noisy(tud.Dataset):
    """Samples that show the worker's seeding: its id and draws from the three global
    random generators torch seeds in each worker."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = tud.get_worker_info()
        return (i, -1 if info is None else info.id, -1 if info is None else info.num_workers,
                random.random(), float(np.random.rand()), torch.rand(1))


class Broken(tud.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise KeyError(f"no sample {i}")
        return i


class DatasetError(ValueError):
    """An exception class of the user's own."""


class OwnError(tud.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i == 2:
            raise DatasetError(f"bad sample {i}")
        return i


class Sharded(tud.IterableDataset):
    """Shards itself by worker, as torch's documentation shows."""

    def __init__(self, n: int = 10, length: int | None = None) -> None:
        self.n, self.length = n, length

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("no length")
        return self.length

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class BrokenStream(tud.IterableDataset):
    """Each worker's stream raises once, at its third sample, then goes on."""

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        worker = 0 if info is None else info.id
        return _BrokenIterator(worker)


class _BrokenIterator:
    def __init__(self, worker: int) -> None:
        self.worker, self.at = worker, 0

    def __iter__(self) -> _BrokenIterator:
        return self

    def __next__(self) -> int:
        self.at += 1
        if self.at > 5:
            raise StopIteration
        if self.at == 3:
            raise IndexError(f"stream {self.worker} hiccup")
        return self.worker * 100 + self.at


class Batched(tud.Dataset):
    """``__getitems__`` answers for a whole batch (and ``__getitem__`` differs, so the
    batches tell which one ran)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return -i

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [i * 10 for i in indices]


class Counted(tud.Dataset):
    """Holds a ``multiprocessing.Value`` and ``Lock``, which forked workers inherit."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("fork")
        self.count = context.Value("i", 0)
        self.lock = context.Lock()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        with self.lock:
            self.count.value += 1
        return i


class Gated(tud.Dataset):
    """Sample 0 waits for ``gate`` (an inherited Event): with two workers, worker 0's
    first batch comes after worker 1's however fast each runs."""

    def __init__(self) -> None:
        self.gate = multiprocessing.get_context("fork").Event()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 0:
            self.gate.wait(60)
        return i


class Slow(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 2:
            time.sleep(4)
        return i


MARK = 0
"""Changed by a case in the parent: forked workers see the change, spawned ones do not."""


class Marked(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, MARK


@dataclass
class Pair:
    """A collate output of the user's own class."""

    x: torch.Tensor


def pair_collate(samples: list[Any]) -> Pair:
    return Pair(torch.as_tensor(samples))


def bfloat16_collate(samples: list[Any]) -> torch.Tensor:
    return torch.as_tensor(samples, dtype=torch.bfloat16)


def named_collate(samples: list[Any]) -> Any:
    """A batch and its file names as a numpy array of str (a dtype no tensor holds)."""
    return torch.as_tensor(samples), np.array([f"img_{s}.jpg" for s in samples])


def sparse_item(index: int) -> Any:
    return torch.eye(3).to_sparse() * index


def packed_collate(samples: list[Any]) -> Any:
    sequences = [torch.arange(int(s) + 1, dtype=torch.float32) for s in samples]
    return torch.nn.utils.rnn.pack_sequence(sequences, enforce_sorted=False)


def sum_collate(samples: list[Any]) -> dict[str, Any]:
    return {"sum": sum(samples), "items": torch.as_tensor(samples)}


def count_collate(samples: list[Any]) -> torch.Tensor:
    return torch.tensor(len(samples))


def broken_collate(samples: list[int]) -> torch.Tensor:
    if 4 in samples:
        raise ZeroDivisionError("collate cannot take 4")
    return torch.as_tensor(samples)


def init_worker(worker: int) -> None:
    info = tud.get_worker_info()
    assert info is not None and info.id == worker
    torch.manual_seed(1000 + worker)  # the dataset's draws show this ran


# --- item 1: the constructor ---------------------------------------------------------------

@case()
def positional_arguments_in_torch_order(DataLoader: Any) -> Any:
    generator = torch.Generator().manual_seed(7)
    # dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
    # pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator
    loader = DataLoader(Squares(10), 3, True, None, None, 2, None, False, True, 0, None, None,
                        generator)
    return batches(loader), loader.generator is generator, len(loader)


@case()
def keyword_only_arguments_as_torch(DataLoader: Any) -> Any:
    refused = False
    try:
        DataLoader(Squares(), 2, False, None, None, 2, None, False, False, 0, None, None, None,
                   2)  # prefetch_factor is keyword-only
    except TypeError:
        refused = True
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, prefetch_factor=1,
                        persistent_workers=False, pin_memory_device="", in_order=True)
    return refused, batches(loader), loader.in_order, loader.prefetch_factor


@case()
def multiprocessing_context_validated_as_torch(DataLoader: Any) -> Any:
    seen = []
    for value, workers in (("no-such-method", 2), (3, 2), ("fork", 0)):
        try:
            DataLoader(Squares(), num_workers=workers, multiprocessing_context=value)
            seen.append(None)
        except Exception as exc:
            seen.append(raised(exc, "multiprocessing_context"))
    loader = DataLoader(Squares(), num_workers=2, multiprocessing_context="fork")
    seen.append(loader.multiprocessing_context.get_start_method())
    try:
        loader.multiprocessing_context = 5
    except Exception as exc:
        seen.append(raised(exc))
    return seen


@case()
def a_context_object_starts_forked_workers(DataLoader: Any) -> Any:
    return marked_batches(DataLoader, multiprocessing.get_context("fork"), 2)



def marked_batches(DataLoader: Any, context: Any, workers: int) -> Any:
    global MARK
    MARK = 1
    try:
        return batches(DataLoader(Marked(), batch_size=2, num_workers=workers,
                                  multiprocessing_context=context))
    finally:
        MARK = 0


@case(pytest.mark.slow)
def spawned_workers_take_a_fresh_interpreter(DataLoader: Any) -> Any:
    return marked_batches(DataLoader, "spawn", 2)


@case(pytest.mark.slow)
def forkserver_workers_take_a_fresh_interpreter(DataLoader: Any) -> Any:
    return marked_batches(DataLoader, "forkserver", 1)


@case(pytest.mark.slow)
def spawned_workers_make_torchs_batches(DataLoader: Any) -> Any:
    return batches(DataLoader(Noisy(), batch_size=2, num_workers=2,
                              multiprocessing_context="spawn",
                              generator=torch.Generator().manual_seed(8)))


@case()
def in_order_false_yields_batches_as_they_complete(DataLoader: Any) -> Any:
    dataset = Gated()
    loader = DataLoader(dataset, batch_size=1, num_workers=2, in_order=False, timeout=60,
                        multiprocessing_context="fork")  # the gate is inherited
    iterator = iter(loader)
    first = plain(next(iterator))  # worker 1's batch: worker 0 waits for the gate
    dataset.gate.set()
    rest = [plain(b) for b in iterator]
    return first, sorted(rest)


@case()
def invalid_combinations_raise_torchs_types(DataLoader: Any) -> Any:
    seen = []
    for kwargs in ({"shuffle": True, "sampler": [0, 1]},
                   {"batch_sampler": [[0, 1]], "batch_size": 2},
                   {"batch_sampler": [[0, 1]], "batch_size": None, "drop_last": True},
                   {"num_workers": -1}, {"timeout": -1},
                   {"num_workers": 0, "prefetch_factor": 2},
                   {"num_workers": 0, "persistent_workers": True},
                   {"batch_size": None, "drop_last": True}):
        try:
            DataLoader(Squares(), **kwargs)
            seen.append(None)
        except Exception as exc:
            seen.append(raised(exc))
    for kwargs in ({"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]}):
        try:
            DataLoader(Sharded(), **kwargs)
            seen.append(None)
        except Exception as exc:
            seen.append(raised(exc))
    return seen


# --- item 2: an error does not end the epoch -----------------------------------------------

@case()
def a_dataset_error_without_workers_is_one_batch_s(DataLoader: Any) -> Any:
    return batches(DataLoader(Broken(), batch_size=2))


@case()
def a_dataset_error_in_a_worker_is_one_batch_s(DataLoader: Any) -> Any:
    return batches(DataLoader(Broken(), batch_size=2, num_workers=2))


@case(pytest.mark.slow)  # torch's persistent workers take 10 s to stop after an error
def errors_with_persistent_workers_end_no_epoch(DataLoader: Any) -> Any:
    loader = DataLoader(Broken(), batch_size=2, num_workers=2, persistent_workers=True)
    return [batches(loader) for _ in range(2)]


@case()
def a_user_exception_class_arrives_as_itself(DataLoader: Any) -> Any:
    return batches(DataLoader(OwnError(), batch_size=1, num_workers=2))


@case()
def a_collate_error_is_one_batch_s(DataLoader: Any) -> Any:
    return batches(DataLoader(list(range(8)), batch_size=2, num_workers=2,
                              collate_fn=broken_collate))


@case()
def an_iterable_dataset_error_is_one_batch_s(DataLoader: Any) -> Any:
    return (batches(DataLoader(BrokenStream(), batch_size=None, num_workers=2)),
            batches(DataLoader(BrokenStream(), batch_size=2, num_workers=2)))


# --- item 3: timeout -----------------------------------------------------------------------

@case(pytest.mark.slow)
def a_batch_slower_than_timeout_raises_runtime_error(DataLoader: Any) -> Any:
    loader = DataLoader(Slow(), batch_size=1, num_workers=2, timeout=1)
    try:
        list(loader)
    except RuntimeError as exc:
        return RuntimeError, str(exc)
    return None


# --- item 4: datasets torch accepts --------------------------------------------------------

@case()
def getitems_makes_the_batches(DataLoader: Any) -> Any:
    return (batches(DataLoader(Batched(), batch_size=3, num_workers=2)),
            batches(DataLoader(Batched(), batch_size=3)),
            batches(DataLoader(Batched(), batch_size=None, num_workers=2)))


@case()
def multiprocessing_primitives_are_inherited_through_fork(DataLoader: Any) -> Any:
    dataset = Counted()
    out = batches(DataLoader(dataset, batch_size=2, num_workers=2,
                             multiprocessing_context="fork"))
    return out, dataset.count.value


# Types the codec does not carry: the Loader's own workers pickle them (Loader(objects=True)).

@case()
def a_collate_output_of_the_user_s_class(DataLoader: Any) -> Any:
    out = []
    for batch in DataLoader(list(range(6)), batch_size=2, num_workers=2,
                            collate_fn=pair_collate):
        out.append((type(batch).__name__, batch.x.tolist()))
    return out


@case()
def bfloat16_batches(DataLoader: Any) -> Any:
    return batches(DataLoader(list(range(6)), batch_size=2, num_workers=2,
                              collate_fn=bfloat16_collate))


@case()
def prefetch_factor_0_with_workers_is_refused_at_iter(DataLoader: Any) -> Any:
    loader = DataLoader(list(range(4)), num_workers=2, prefetch_factor=0)
    try:  # (before: taken for the default, 2)
        iter(loader)
    except AssertionError:
        return "AssertionError"
    return "iterated"


@case()
def a_numpy_array_of_str_in_a_batch(DataLoader: Any) -> Any:
    out = []  # (before: the codec refused it, and the epoch ended at the first batch)
    for values, names in DataLoader(list(range(6)), batch_size=2, num_workers=2,
                                    collate_fn=named_collate):
        out.append((values.tolist(), type(names).__name__, names.dtype.str, names.tolist()))
    return out


@case()
def sparse_coo_tensor_batches(DataLoader: Any) -> Any:
    out = []  # (before: weighing it for its record raised "nbytes is not defined")
    for batch in DataLoader([sparse_item(i) for i in range(4)], batch_size=None,
                            num_workers=2):
        out.append((batch.layout, batch.to_dense().tolist()))
    return out


@case()
def packed_sequence_batches(DataLoader: Any) -> Any:
    out = []
    for batch in DataLoader(list(range(6)), batch_size=3, num_workers=2,
                            collate_fn=packed_collate):
        out.append((type(batch).__name__, batch.data.tolist(), batch.batch_sizes.tolist()))
    return out


# --- item 5: the API surface ---------------------------------------------------------------

@case()
def subscriptable_as_a_generic(DataLoader: Any) -> Any:
    loader = DataLoader[int](Squares(4), batch_size=2)
    return DataLoader[int].__args__, batches(loader)


@case()
def a_torch_data_loader_with_torch_s_attributes(DataLoader: Any) -> Any:
    loader = DataLoader(Squares(6), batch_size=4, num_workers=2, shuffle=True)
    iterable = DataLoader(Sharded(6), batch_size=2)
    return (isinstance(loader, tud.DataLoader), loader._auto_collation,
            type(loader._index_sampler).__name__, type(loader.sampler).__name__,
            loader._dataset_kind, iterable._dataset_kind, loader.prefetch_factor,
            loader.pin_memory, loader.timeout, loader.generator, loader.collate_fn.__name__)


@case()
def fixed_attributes_refuse_assignment(DataLoader: Any) -> Any:
    loader = DataLoader(Squares(8), batch_size=2, num_workers=2)
    seen = []
    for name in ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                 "persistent_workers"):
        try:
            setattr(loader, name, getattr(loader, name))
            seen.append(None)
        except Exception as exc:
            seen.append(raised(exc, f"{name} attribute should not be set"))
    loader.num_workers = 1  # the others take effect at the next iter(), as in torch
    loader.collate_fn = count_collate
    loader.timeout = 30
    seen.append((loader.num_workers, loader.timeout, batches(loader)))
    return seen


@case()
def len_as_torch(DataLoader: Any) -> Any:
    lengths = [len(DataLoader(Squares(10), batch_size=3)),
               len(DataLoader(Squares(10), batch_size=3, drop_last=True)),
               len(DataLoader(Squares(10), batch_size=None)),
               len(DataLoader(Squares(10), batch_sampler=[[0, 1], [2]])),
               len(DataLoader(Sharded(10, length=10), batch_size=4)),
               len(DataLoader(Sharded(10, length=10), batch_size=4, drop_last=True))]
    try:
        len(DataLoader(Sharded(10), batch_size=4))
    except TypeError:
        lengths.append("TypeError")
    return lengths


@case()
def an_iterable_dataset_longer_than_its_len_warns(DataLoader: Any) -> Any:
    loader = DataLoader(Sharded(10, length=4), batch_size=2, num_workers=2)
    reported = len(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = batches(loader)
    messages = [str(w.message) for w in caught if "Length of IterableDataset" in str(w.message)]
    return reported, out, len(messages), [
        ("was reported to be 4" in m, "samples have been fetched" in m) for m in messages]


@case()
def persistent_workers_peek_then_a_whole_epoch(DataLoader: Any) -> Any:
    loader = DataLoader(Squares(10), batch_size=3, num_workers=2, persistent_workers=True,
                        shuffle=True, generator=torch.Generator().manual_seed(3))
    peeked = plain(next(iter(loader)))
    first = [plain(b) for b in loader]
    second = [plain(b) for b in loader]
    return peeked, first, second, iter(loader) is iter(loader)


# --- the core behaviours -------------------------------------------------------------------

@case()
def seeded_shuffle_with_and_without_workers(DataLoader: Any) -> Any:
    return [batches(DataLoader(Squares(), batch_size=5, shuffle=True, num_workers=workers,
                               generator=torch.Generator().manual_seed(11)))
            for workers in (0, 2)]


@case()
def samplers_and_batch_samplers(DataLoader: Any) -> Any:
    generator = torch.Generator().manual_seed(5)
    return (
        batches(DataLoader(Squares(), batch_size=2, num_workers=2, sampler=tud
                           .SubsetRandomSampler([1, 4, 6, 9, 10], generator=generator))),
        batches(DataLoader(Squares(), batch_size=3, num_workers=2, sampler=tud
                           .WeightedRandomSampler([1.0] * 6 + [5.0] * 6, 8,
                                                  generator=generator))),
        batches(DataLoader(Squares(), num_workers=2,
                           batch_sampler=[[0, 11], [3], [5, 6, 7]])),
        batches(DataLoader(Squares(), num_workers=2, batch_sampler=tud.BatchSampler(
            tud.SequentialSampler(range(12)), batch_size=5, drop_last=True))),
        batches(DataLoader(Squares(), batch_size=5, drop_last=True, num_workers=2)),
    )


@case()
def collate_fn_and_batch_size_none(DataLoader: Any) -> Any:
    return (batches(DataLoader(list(range(7)), batch_size=3, num_workers=2,
                               collate_fn=sum_collate)),
            batches(DataLoader(Squares(5), batch_size=None, num_workers=2)))


@case()
def worker_init_fn_and_get_worker_info(DataLoader: Any) -> Any:
    generator = torch.Generator().manual_seed(2)
    return (batches(DataLoader(Noisy(), batch_size=2, num_workers=2, generator=generator)),
            batches(DataLoader(Noisy(), batch_size=2, num_workers=2, generator=generator,
                               worker_init_fn=init_worker)))


@case()
def iterable_datasets_sharded_by_worker_info(DataLoader: Any) -> Any:
    return (batches(DataLoader(Sharded(11), batch_size=2, num_workers=2)),
            batches(DataLoader(Sharded(11), batch_size=2, num_workers=2, drop_last=True)),
            batches(DataLoader(Sharded(5), batch_size=None, num_workers=2)))


@case()
def persistent_workers_across_epochs(DataLoader: Any) -> Any:
    loader = DataLoader(Noisy(), batch_size=3, num_workers=2, persistent_workers=True,
                        shuffle=True, generator=torch.Generator().manual_seed(4))
    return [batches(loader) for _ in range(3)]


def shuffled_pipe() -> Any:
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(range(12)).shuffle().sharding_filter()


@case()
def an_iterdatapipe_shuffles_with_torch_s_shared_seed(DataLoader: Any) -> Any:
    """torch seeds a datapipe's shuffles with a seed all workers share, drawn from the
    generator around the base seed; persistent workers get a new one each epoch."""
    generator = torch.Generator().manual_seed(3)
    fresh = [batches(DataLoader(shuffled_pipe(), batch_size=2, num_workers=2,
                                generator=generator)) for _ in range(2)]
    persistent = DataLoader(shuffled_pipe(), batch_size=2, num_workers=2, generator=generator,
                            persistent_workers=True)
    return fresh, [batches(persistent) for _ in range(2)], generator.initial_seed()


@case()
def an_iterator_dropped_mid_epoch_stops_its_workers(DataLoader: Any) -> Any:
    """Through ``_workers``, torch's private list of its iterator's processes, which some
    tools read (pid, is_alive, join, exitcode, terminate)."""
    iterator = iter(DataLoader(Squares(), batch_size=2, num_workers=2))
    workers = iterator._workers
    first = plain(next(iterator))
    del iterator
    ended = []
    for worker in workers:
        worker.join(30)
        ended.append((worker.is_alive(), worker.exitcode))
        worker.terminate()  # (a no-op on one that exited)
    return first, len(workers), ended


@case()
def pin_memory_off_leaves_batches_unpinned(DataLoader: Any) -> Any:
    return [b["x"].is_pinned() for b in DataLoader(Squares(6), batch_size=2, num_workers=2)]


class Killing(tud.Dataset):
    """Sample 9 kills the worker process that fetches it (as a segfault in a decoder)."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        if i == 9 and tud.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


# --- the tests -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES.values()))
def test_zloader_shows_what_torch_shows(case: Case) -> None:
    run_case(case)


def test_a_worker_s_error_names_the_worker_and_holds_the_original_traceback() -> None:
    loader = zt.DataLoader(Broken(), batch_size=2, num_workers=2)
    try:
        iterator = iter(loader)
        next(iterator)
        with pytest.raises(KeyError) as info:
            next(iterator)
        text = str(info.value)
        assert "DataLoader worker process 1" in text and "index 3" in text
        assert 'raise KeyError(f"no sample {i}")' in text
        assert plain(next(iterator)) == ("tensor", "torch.int64", [4, 5])
    finally:
        loader.close()


def test_a_killed_worker_is_named_with_how_it_died() -> None:
    """zloader alone: torch's own loader raises RuntimeError, ConnectionResetError or
    EOFError here depending on where it notices the death, and may leave its workers to
    the garbage collector, so the two are not compared."""
    start = time.monotonic()
    loader = zt.DataLoader(Killing(), batch_size=2, num_workers=2)
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed "
                                               "by signal: Killed") as info:
            list(loader)  # torch's words for a worker a signal killed
        assert "killed by SIGKILL" in str(info.value.__cause__)
        assert info.value.codes == (-signal.SIGKILL,)
        assert time.monotonic() - start < 30  # promptly, not after the 60 s timeout
    finally:
        loader.close()
