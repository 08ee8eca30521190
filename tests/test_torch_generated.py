"""DataLoaders nobody designed, against torch's own: random ``zloader.torch.DataLoader``
arguments (map-style and iterable datasets whose samples carry the worker's random draws,
one whose iterator keeps its own state, one with a sample that raises, every sampler torch
has, a ``DistributedSampler`` told each epoch, a batch sampler of one's own, batch sizes
with and without auto-collation, ``drop_last``, a ``collate_fn`` and a ``worker_init_fn``
of one's own, 1-3 workers, forked or a zloader-broker's (``broker=``), ``in_order``,
``persistent_workers``, ``prefetch_factor``, ``snapshot_every_n_steps``, a generator or
torch's global one), each run for three epochs beside ``torch.utils.data.DataLoader``
with the same arguments, the first maybe left early and the dataset maybe changed by the
trainer between epochs. Each must yield torch's batches, batch for batch
(``in_order=False``: the same batches, in the order they came), and ``len()``; a loader
resumed from a ``state_dict`` taken before ``iter()``, at a random batch, and of a
resume, must yield what the uninterrupted one yields from there, and the next epoch too.

Odd seeds have every shuffle's first indices emulated (zloader/torch/permutation.py). A
few seeds run in ``make test``; ``-m slow`` runs 120.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import zloader.torch as zt
from tests.service import service
from zloader.torch import permutation

FAST_SEEDS = (0, 1, 5)  # (5: through a broker's workers)
SLOW_SEEDS = [seed for seed in range(2, 124) if seed not in FAST_SEEDS]


# --- datasets, samplers and functions: module level, so that spawn could pickle them -------


class Drawn(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i``: ``[i + offset, torch draw, numpy draw, random draw]`` (float64): a
    worker seeded otherwise than torch's shows in every sample, and one that sees the
    dataset as it was before the trainer changed ``offset`` in the first index."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.offset = 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index + self.offset), torch.rand(()).item(),
                             float(np.random.rand()), random.random()], dtype=torch.float64)


class Mixed(Drawn):
    """Sample ``i`` as a tuple of an array, a str, an int, a float, a dict of a list and
    None, and bytes: what the default collate and the codec must both carry."""

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return (np.full((2, 3), index + self.offset, np.int32), f"p/{index}", index,
                float(index) / 4, {"l": [index, index + 1], "n": None}, bytes([index % 256]))


class Failing(Drawn):
    """:class:`Drawn`, but sample 7 raises (where torch re-raises it in the trainer)."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 7:
            raise ValueError(f"sample {index} is corrupt")
        return super().__getitem__(index)


class Keyed(Drawn):
    """Sample ``i`` as a dict with an int, a tensor and a str (collated per key)."""

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return {"i": index, "r": torch.rand(2), "name": f"s{index}"}


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """``size`` samples, each worker its share (``get_worker_info``), with draws."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, self.size, step):
            yield torch.tensor([float(index), torch.rand(()).item(),
                                float(np.random.rand())], dtype=torch.float64)


class Positioned(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """:class:`Stream` whose iterator keeps its own state (torchdata's ``Stateful``:
    ``state_dict``/``load_state_dict``, its position and torch's random state), which a
    resumed worker restores instead of making its batches again."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return Position(list(range(start, self.size, step)))


class Position:
    def __init__(self, numbers: list[int]) -> None:
        self.numbers, self.at = numbers, 0

    def __iter__(self) -> Position:
        return self

    def __next__(self) -> torch.Tensor:
        if self.at >= len(self.numbers):
            raise StopIteration
        self.at += 1
        return torch.tensor([float(self.numbers[self.at - 1]), torch.rand(()).item()],
                            dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at, "rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


def reseeding_init(worker_id: int) -> None:
    """A ``worker_init_fn`` that reseeds numpy by worker and draws from torch."""
    np.random.seed(1000 + worker_id)
    torch.rand(3)


def reversed_collate(batch: list[Any]) -> Any:
    """A ``collate_fn`` of one's own: torch's default over the batch reversed."""
    return torch.utils.data.default_collate(batch[::-1])


class Chunks(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """A batch sampler of one's own: uneven batches, shuffled by torch's global RNG."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.size).tolist()
        at, width = 0, 1
        while at < self.size:
            yield order[at:at + width]
            at += width
            width = width % 4 + 1

    def __len__(self) -> int:
        count, at, width = 0, 0, 1
        while at < self.size:
            count, at, width = count + 1, at + width, width % 4 + 1
        return count


# --- the grammar ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    seed: int
    dataset: str
    size: int
    options: dict[str, Any]
    sampler: str
    cut: int  # the batch a state is taken at (then half way through what is left)
    mutate: bool = False  # the trainer changes the dataset between the epochs
    steps: int | None = None  # the first epoch is left after this many batches
    pool: bool = False  # made by a zloader-broker's workers (broker=), not forked ones

    def dataset_of(self) -> Any:
        return {"drawn": Drawn, "keyed": Keyed, "stream": Stream, "mixed": Mixed,
                "failing": Failing, "positioned": Positioned}[self.dataset](self.size)

    def arguments(self) -> dict[str, Any]:
        """The DataLoader's arguments (a fresh sampler and generator each call)."""
        kwargs = dict(self.options)
        data = self.dataset_of()
        if kwargs.pop("seeded", False):
            kwargs["generator"] = torch.Generator().manual_seed(self.seed)
        if self.sampler == "replacement":
            kwargs["sampler"] = torch.utils.data.RandomSampler(data, replacement=True,
                                                               num_samples=self.size + 3)
        elif self.sampler == "num_samples":
            kwargs["sampler"] = torch.utils.data.RandomSampler(
                data, num_samples=max(1, self.size // 2))
        elif self.sampler == "weighted":
            kwargs["sampler"] = torch.utils.data.WeightedRandomSampler(
                [1.0 + i % 3 for i in range(self.size)], self.size)
        elif self.sampler == "subset":
            kwargs["sampler"] = torch.utils.data.SubsetRandomSampler(
                list(range(0, self.size, 2)))
        elif self.sampler == "list":
            kwargs["sampler"] = list(range(self.size))[::-1]
        elif self.sampler == "distributed":  # (set_epoch'd before each epoch: epochs())
            kwargs["sampler"] = torch.utils.data.DistributedSampler(
                data, num_replicas=2, rank=self.seed % 2, shuffle=True, seed=self.seed,
                drop_last=self.seed % 3 == 0)
        elif self.sampler == "chunks":
            for name in ("batch_size", "shuffle", "drop_last"):
                kwargs.pop(name, None)
            kwargs["batch_sampler"] = Chunks(self.size)
        return {"dataset": data, **kwargs}


def draw(seed: int) -> Case:
    rng = random.Random(seed)
    dataset = rng.choice(["drawn", "drawn", "keyed", "stream", "positioned", "mixed",
                          "failing"])
    size = rng.choice([0, 1, 5, 12, 17, 30])
    workers = rng.choice([1, 2, 2, 3])
    options: dict[str, Any] = {"num_workers": workers, "timeout": 60}
    options["batch_size"] = rng.choice([None, 1, 2, 3, 5, 5])
    sampler = "default"
    if dataset not in ("stream", "positioned"):
        sampler = rng.choice(["default", "default", "default", "replacement", "num_samples",
                              "weighted", "subset", "list", "chunks", "distributed"])
        if sampler == "default":
            options["shuffle"] = rng.random() < 0.6
    if options["batch_size"] is not None:
        options["drop_last"] = rng.random() < 0.3
    elif sampler == "chunks":
        sampler = "default"
    options["in_order"] = rng.random() < 0.75
    options["persistent_workers"] = rng.random() < 0.5
    if rng.random() < 0.4:
        options["prefetch_factor"] = rng.choice([1, 3])
    if rng.random() < 0.3:
        options["worker_init_fn"] = reseeding_init
    if rng.random() < 0.2 and options["batch_size"] is not None and dataset == "drawn":
        options["collate_fn"] = reversed_collate
    options["seeded"] = rng.random() < 0.7
    if rng.random() < 0.3:
        options["snapshot_every_n_steps"] = rng.choice([1, 3])
    mutate = dataset in ("drawn", "mixed") and rng.random() < 0.3
    steps = rng.choice([1, 2, 4]) if rng.random() < 0.25 else None
    pool = rng.random() < 0.25
    return Case(seed, dataset, size, options, sampler, rng.randrange(0, 8), mutate, steps,
                pool)


# --- comparing -----------------------------------------------------------------------------


def plain(batch: Any) -> Any:
    """A batch as nested lists and plain values (tensors and arrays as lists)."""
    if isinstance(batch, torch.Tensor | np.ndarray):
        return batch.tolist()
    if isinstance(batch, dict):
        return {key: plain(value) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return [plain(value) for value in batch]
    if isinstance(batch, bytes):
        return batch.hex()
    return batch


def epochs(make: Callable[[], Any], case: Case) -> list[list[Any]]:
    """Three epochs of a new loader from ``make``, each as plain batches, then its
    ``len()`` (or None without one). An epoch that raised ends with the exception
    (:class:`Raised`), and the next starts; the first stops after ``case.steps`` batches
    when set (a ``break``, as a training loop's step limit does); with ``case.mutate``
    the dataset's ``offset`` grows by 100 after each epoch (workers forked afresh see
    it, persistent ones do not: torch's semantics)."""
    loader = make()
    try:
        out = []
        for epoch in range(3):
            batches: list[Any] = []
            out.append(batches)
            set_epoch(loader, epoch)
            try:
                for batch in loader:
                    batches.append(plain(batch))
                    if epoch == 0 and len(batches) == case.steps:
                        break
            except Exception as exc:  # (the user's sample, re-raised in the trainer)
                batches.append(Raised(exc))
            if case.mutate:
                loader.dataset.offset += 100
        try:
            out.append([len(loader)])
        except TypeError:
            out.append([None])
        return out
    finally:
        _close(loader)


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a ``DistributedSampler`` the epoch, as a DDP training loop does."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        sampler.set_epoch(epoch)


def _close(loader: Any) -> None:
    """Stop a loader's workers now: ours by ``close()``; torch's (persistent ones, or
    those of an epoch that raised) once nothing holds its iterator."""
    if isinstance(loader, zt.DataLoader):
        loader.close()
        return
    loader._iterator = None
    gc.collect()


class Raised:
    """An epoch's end by an exception: equal to another of the same kind (``==`` is
    asked of ours against torch's: ours must be an instance of torch's type, as a user's
    ``except`` clause asks) with the same mention, or not, of the corrupt sample."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc.with_traceback(None)  # (its frames would keep the loader alive)
        self.named = "sample 7 is corrupt" in str(exc)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Raised) and isinstance(self.exc, type(other.exc)) \
            and self.named == other.named

    def __repr__(self) -> str:
        return f"Raised({type(self.exc).__name__}: {str(self.exc)[:200]!r})"


def same(got: list[Any], want: list[Any], in_order: bool) -> bool:
    """``got`` is ``want``; ``in_order=False``: the same batches of the same samples, in any
    order (which worker makes a batch, and so what it draws, is the timing's: the draws
    are left out)."""
    if in_order:
        return got == want
    return collections.Counter(map(_key, got)) == collections.Counter(map(_key, want))


def _key(batch: Any) -> str:
    if isinstance(batch, Raised):
        return f"raised {batch.named}"  # (and the kind: compared by same's caller)
    return json.dumps(_indices(batch), sort_keys=True, default=repr)


def _indices(value: Any) -> Any:
    """``value`` without its random draws (the floats that are not whole numbers)."""
    if isinstance(value, dict):
        return {key: _indices(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_indices(item) for item in value]
    if isinstance(value, float) and not value.is_integer():
        return None
    return value


def seeded(case: Case, make: Callable[[], Any]) -> Callable[[], Any]:
    """``make`` with torch's global RNG (and numpy's and random's) seeded by the case
    first: a loader without a generator draws its seeds from it."""
    def made() -> Any:
        torch.manual_seed(case.seed)
        np.random.seed(case.seed)
        random.seed(case.seed)
        return make()
    return made


def run(case: Case, broker: str | None = None) -> None:
    """``case`` through ours (the workers of the pool at ``broker`` when given) against
    torch's DataLoader."""
    in_order = case.options["in_order"]
    ours = seeded(case, lambda: zt.DataLoader(**case.arguments(), broker=broker))
    theirs = seeded(case, lambda: torch.utils.data.DataLoader(**_torch_s(case.arguments())))
    try:
        want = epochs(theirs, case)
    except Exception as exc:  # torch refuses the arguments (an empty dataset, shuffled)
        with pytest.raises(type(exc)):
            epochs(ours, case)
        return
    whole = epochs(ours, case)
    assert len(whole) == len(want), case
    raised = False
    for epoch, (got, expected) in enumerate(zip(whole, want, strict=True)):
        if not in_order and epoch == 0 and case.steps is not None:
            pass  # (which batches come before the break, a failing one included: timing's)
        elif not in_order and expected and isinstance(expected[-1], Raised):
            assert got and got[-1] == expected[-1], (case, got, expected)  # (when: timing's)
        elif (raised or (epoch and case.steps is not None)) \
                and case.options["persistent_workers"]:
            # After an epoch that raised, what torch's persistent workers draw next is
            # the timing's (torch itself differs from run to run); after one left early,
            # ours may have drawn more or less than torch's (docs/torch.md, "Differences
            # from torch"): the samples only.
            keys = [_key(b) for b in got], [_key(b) for b in expected]
            assert keys[0] == keys[1] if in_order else same(got, expected, False), \
                (case, got, expected)
        else:
            assert same(got, expected, in_order), (case, got, expected)
        raised = raised or any(isinstance(b, Raised) for b in expected)
    if case.mutate or case.steps is not None \
            or any(isinstance(b, Raised) for epoch in whole for b in epoch):
        return
    first = whole[0]
    cut = min(case.cut, len(first))
    state, taken = _cut(ours, None, cut)
    fresh = ours()  # (a state taken before any iter(): the whole run from its start)
    try:
        start = json.loads(json.dumps(fresh.state_dict()))
    finally:
        fresh.close()
    again = ours()
    try:
        again.load_state_dict(start)
        assert same([plain(batch) for batch in again], first, in_order), case
    finally:
        again.close()
    later = cut + (len(first) - cut) // 2
    state2, middle = _cut(ours, state, later - cut)
    resumed = ours()
    try:
        resumed.load_state_dict(state2)
        rest = []
        for epoch in range(2):
            set_epoch(resumed, epoch)
            rest.append([plain(batch) for batch in resumed])
    finally:
        resumed.close()
    if not in_order:  # (the same batches: which worker made which, the timing's)
        assert same(taken + middle + rest[0], first, False), case
        assert same(rest[1], whole[1], False), case
        return
    assert taken == first[:cut], case
    assert middle == first[cut:later], case
    assert rest[0] == first[later:], case
    assert rest[1] == whole[1], case


def _torch_s(arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` less the one torch's DataLoader lacks (torchdata's)."""
    arguments.pop("snapshot_every_n_steps", None)
    return arguments


def _cut(make: Callable[[], Any], state: dict[str, Any] | None,
         count: int) -> tuple[dict[str, Any], list[Any]]:
    """A loader from ``make`` (loaded with ``state``), ``count`` batches of it and its
    state then (through JSON, as a checkpoint keeps it)."""
    loader = make()
    try:
        if state is not None:
            loader.load_state_dict(state)
        iterator = iter(loader)
        taken = [plain(next(iterator)) for _ in range(count)]
        return json.loads(json.dumps(loader.state_dict())), taken
    finally:
        loader.close()


def _run(seed: int, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    if monkeypatch is None:  # (tests/sweep.py's call)
        with pytest.MonkeyPatch.context() as patch:
            _run(seed, patch)
        return
    if seed % 2:  # (every shuffle's first indices emulated: zloader/torch/permutation.py)
        monkeypatch.setattr(permutation, "PERMUTATION_MIN_SAMPLES", 2)
        monkeypatch.setattr(permutation, "PERMUTATION_AHEAD", 1 + seed % 37)
    case = draw(seed)
    if not case.pool:
        run(case)
        return
    with service(workers=3) as (address, _):  # (a broker and 3 worker processes)
        run(case, address)


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_generated_drop_in_loaders_yield_torch_s_batches(seed, monkeypatch):
    _run(seed, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_many_generated_drop_in_loaders_yield_torch_s_batches(seed, monkeypatch):
    _run(seed, monkeypatch)
