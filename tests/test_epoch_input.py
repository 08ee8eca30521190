"""``Loader.iterate(epoch_input)``: what each worker's run of an epoch is handed, the same
element for all or, with ``zloader.PerWorker``, each worker index its own; and the torch
adapter's use of it, each worker getting only its own batches' indices."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import zloader
import zloader.torch as zt
from zloader.sources import Source
from zloader.torch.passes import worker_plans


@dataclass(frozen=True, eq=False, kw_only=True)
class Echo(Source):
    """One element per split: the split, the worker that read it and its epoch input."""

    kind: ClassVar[str] = "echo_input"

    @property
    def num_splits(self) -> int:
        return 2

    def identity(self) -> tuple[Any, ...]:
        return (self.kind,)

    def read(self, split: int, policy: Any = None) -> Iterator[Any]:
        given = policy.settings.epoch_input
        yield {"split": split, "worker": int(policy.settings.worker),
               "input": given if given is not None else "none"}


def _loader() -> zloader.Loader:
    source = Echo(name="echo", shuffle_splits=False, seed=None, version=None)
    return zloader.Loader(zloader.Pipeline(source), num_workers=2, sharding="static",
                          timeout=30)


def _by_worker(elements: Iterator[Any]) -> dict[int, Any]:
    return {int(e["worker"]): e["input"] for e in elements}


def test_every_worker_gets_the_same_input_or_each_its_own() -> None:
    with _loader() as loader:
        shared = _by_worker(loader.iterate(np.arange(3)))
        assert sorted(shared) == [0, 1]
        assert all(np.array_equal(v, np.arange(3)) for v in shared.values())
        each = _by_worker(loader.iterate(zloader.PerWorker([np.arange(2), {"k": "v"}])))
        assert np.array_equal(each[0], np.arange(2)) and each[1] == {"k": "v"}
        # an index past the end, or a None, gets no input
        short = _by_worker(loader.iterate(zloader.PerWorker([7])))
        assert short == {0: 7, 1: "none"}
        assert _by_worker(loader.iterate()) == {0: "none", 1: "none"}


def test_an_input_the_codec_cannot_carry_is_refused_at_iterate() -> None:
    with _loader() as loader:
        with pytest.raises(zloader.CodecError, match="object"):
            loader.iterate(zloader.PerWorker([1, object()]))
        assert sorted(_by_worker(loader.iterate(zloader.PerWorker([1, 2])))) == [0, 1]


def test_each_torch_worker_is_planned_its_own_batches_only() -> None:
    batches = [[i, i + 1] for i in range(0, 26, 2)]  # 13 batches, resumed after 3
    todo = list(range(3, 13))
    plans = worker_plans({"seed": 5, "reseed": True}, batches, True, todo, 4, False,
                         {1: b"s"})
    for worker, plan in enumerate(plans):
        assert plan["seed"] == 5 and plan.get("rng") == (b"s" if worker == 1 else b"")
        numbers = plan["numbers"].tolist()
        assert numbers == [j for j in todo if j % 4 == worker]
        bounds = plan["offsets"]
        got = [plan["flat"][a:b].tolist() for a, b in itertools.pairwise(bounds)]
        assert got == [batches[j] for j in numbers]
    assert sum(len(p["flat"]) for p in plans) == 20  # each index after batch 3 goes to one
    # Dispatched (in_order=False): every worker may be handed any batch still to make.
    plans = worker_plans({}, batches, True, [0, 2, 5], 2, True, None)
    assert all(p["numbers"].tolist() == [0, 2, 5] and p["dispatched"] for p in plans)
    assert plans[1]["flat"].tolist() == [0, 1, 4, 5, 10, 11]


class Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> int:
        return index


def test_the_drop_in_yields_torchs_batches_from_per_worker_plans() -> None:
    kwargs: dict[str, Any] = {"batch_size": 7, "shuffle": True, "num_workers": 2}
    ours = zt.DataLoader(Indexed(), generator=torch.Generator().manual_seed(3), **kwargs)
    theirs = torch.utils.data.DataLoader(Indexed(), generator=torch.Generator().manual_seed(3),
                                         **kwargs)
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
