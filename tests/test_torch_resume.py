"""zloader.torch.DataLoader's state_dict/load_state_dict, as torchdata's StatefulDataLoader
defines them: a resumed loader yields exactly the batches the uninterrupted run would have
yielded (samples and the workers' random draws), into a new loader or the same one, and a
loaded state that has not been iterated yet is the loader's state."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import zloader.torch as zt


class Drawn(torch.utils.data.Dataset):
    """Each sample is its index and the worker's next draws of torch, numpy and random."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()),
                             random.random()], dtype=torch.float64)


def plain(batches: Iterator[Any]) -> list[list[list[float]]]:
    return [batch.tolist() for batch in batches]


def loader(persistent: bool = True, **kwargs: Any) -> zt.DataLoader:
    return zt.DataLoader(Drawn(), batch_size=2, shuffle=True, num_workers=2,
                         persistent_workers=persistent,
                         generator=torch.Generator().manual_seed(3), **kwargs)


def reference() -> list[list[list[float]]]:
    """The first epoch from torch's own DataLoader, as the same arguments make it."""
    batches = torch.utils.data.DataLoader(Drawn(), batch_size=2, shuffle=True, num_workers=2,
                                          persistent_workers=True,
                                          generator=torch.Generator().manual_seed(3))
    return plain(iter(batches))


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(state))
    return out


@pytest.mark.parametrize("at", [0, 1, 3])
def test_persistent_workers_resume_their_first_epoch_with_the_batches_torch_yields(at):
    whole = reference()
    original = loader()
    try:
        it = iter(original)
        before = [next(it).tolist() for _ in range(at)]
        state = roundtrip(original.state_dict())
        rest = plain(it)
    finally:
        original.close()
    assert before + rest == whole
    resumed = loader()
    try:
        resumed.load_state_dict(state)
        assert plain(iter(resumed)) == rest  # the same samples and the same draws
    finally:
        resumed.close()


def test_states_loaded_back_into_the_same_persistent_loader_replay_its_first_epoch():
    whole = reference()
    same = loader()
    try:
        it = iter(same)
        start = same.state_dict()
        got = [next(it).tolist() for _ in range(4)]
        middle = same.state_dict()
        same.load_state_dict(middle)
        got += plain(iter(same))
        same.load_state_dict(start)
        again = plain(iter(same))
    finally:
        same.close()
    assert got == whole
    assert again == whole


def test_a_state_of_a_later_epoch_loaded_into_the_same_loader_restores_its_workers():
    same = loader()
    try:
        list(same)  # epoch 0: the workers are seeded once; epoch 1 goes on from there
        it = iter(same)
        before = [next(it).tolist() for _ in range(3)]
        state = roundtrip(same.state_dict())
        rest = plain(it)  # the persistent workers draw on past the saved state
        same.load_state_dict(state)
        replayed = plain(iter(same))
        following = plain(iter(same))
    finally:
        same.close()
    assert len(before) == 3 and len(rest) == 3
    assert replayed == rest  # each worker back at the state it had after its last batch
    fresh = loader()
    try:
        list(fresh)
        list(fresh)
        assert plain(iter(fresh)) == following  # and the next epoch goes on as before
    finally:
        fresh.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_state_dict_before_iterating_a_loaded_state_is_that_state(persistent):
    original = loader(persistent)
    try:
        it = iter(original)
        for _ in range(3):
            next(it)
        saved = roundtrip(original.state_dict())
        rest = plain(it)
    finally:
        original.close()
    fresh = loader(persistent)
    try:
        fresh.load_state_dict(saved)
        assert fresh.state_dict() == saved
        again = loader(persistent)
        try:
            again.load_state_dict(fresh.state_dict())  # a state of a state resumes alike
            assert plain(iter(again)) == rest
        finally:
            again.close()
    finally:
        fresh.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_loading_into_a_loader_mid_epoch_replaces_its_position(persistent):
    original = loader(persistent)
    try:
        start = roundtrip(original.state_dict())
        whole = plain(iter(original))
    finally:
        original.close()
    busy = loader(persistent)
    try:
        it = iter(busy)
        for _ in range(3):
            next(it)
        busy.load_state_dict(start)
        assert busy.state_dict() == start  # not the iterator's 3 batches
        assert plain(iter(busy)) == whole
    finally:
        busy.close()
