"""zloader.torch.DataLoader's states beyond map-style datasets read in order, as torchdata's
StatefulDataLoader keeps them: iterable datasets (restored from their own ``state_dict``
or made again up to where they were), ``snapshot_every_n_steps``, batches yielded out of
order, map-style datasets that keep a state, a resume of a resume, and the errors."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
import torch.utils.data

import zloader.torch as zt


def identity(batch: Any) -> Any:
    return batch


class Counted(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Worker ``w`` of ``n`` yields ``(i, draw)`` for its ``sizes[w]`` numbers; its
    iterator keeps a state (position and torch's random state) when ``stateful``."""

    def __init__(self, sizes: list[int], stateful: bool = True) -> None:
        self.sizes = sizes
        self.stateful = stateful

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        sizes = self.sizes if info is not None else [sum(self.sizes)]
        start = sum(sizes[:worker])
        numbers = list(range(start, start + sizes[worker]))
        return (StatefulRun if self.stateful else PlainRun)(numbers)


class PlainRun:
    def __init__(self, numbers: list[int]) -> None:
        self.numbers, self.i = numbers, 0

    def __iter__(self) -> PlainRun:
        return self

    def __next__(self) -> tuple[int, int]:
        if self.i >= len(self.numbers):
            raise StopIteration
        self.i += 1
        return self.numbers[self.i - 1], int(torch.randint(1000, ()).item())


class StatefulRun(PlainRun):
    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


def loader(dataset: Any, **kwargs: Any) -> zt.DataLoader:
    kwargs.setdefault("num_workers", 3)
    return zt.DataLoader(dataset, collate_fn=identity,
                         generator=torch.Generator().manual_seed(5), **kwargs)


def cut(make: Any, at: int) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """A loader's first epoch: the batches before ``at``, the state there, the rest."""
    first = make()
    try:
        it = iter(first)
        head = [next(it) for _ in range(at)]
        state = first.state_dict()
        return head, state, list(it)
    finally:
        first.close()


def resumed(make: Any, state: dict[str, Any]) -> list[Any]:
    again = make()
    try:
        again.load_state_dict(state)
        return list(again)
    finally:
        again.close()


@pytest.mark.parametrize("stateful", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("at", [0, 1, 7, 14])
def test_an_iterable_dataset_resumes_exactly(stateful, persistent, at):
    def make() -> zt.DataLoader:
        return loader(Counted([0, 30, 13], stateful), batch_size=3,
                      persistent_workers=persistent)
    head, state, rest = cut(make, at)
    if not stateful:  # nothing but zloader's own fields: JSON as it is
        state = json.loads(json.dumps(state))
    assert resumed(make, state) == rest
    numbers = sorted(i for batch in head + rest for i, _ in batch)
    assert numbers == list(range(43))  # each once, across the cut


@pytest.mark.parametrize("every", [0, 1, 4])
def test_snapshot_every_n_steps_remakes_the_batches_after_the_last_snapshot(every):
    def make() -> zt.DataLoader:
        return loader(Counted([20, 20]), num_workers=2, snapshot_every_n_steps=every)
    _, state, rest = cut(make, 11)
    snapshots = state["_snapshot"]["_worker_snapshots"]
    since = [snapshots[f"worker_{w}"]["since"] for w in range(2)]
    # worker 0 yielded 6 batches, worker 1 five; snapshots at their start and every 4th
    assert since == {0: [6, 5], 1: [0, 0], 4: [2, 1]}[every]
    assert resumed(make, state) == rest


def test_a_resume_of_a_resume_and_the_state_s_layout():
    def make() -> zt.DataLoader:
        return loader(Counted([9, 9, 9]), persistent_workers=True)
    plain = loader(Counted([9, 9, 9]))
    whole = list(plain)
    plain.close()
    _, state, _ = cut(make, 4)
    second = make()
    try:
        second.load_state_dict(state)
        it = iter(second)
        middle = [next(it) for _ in range(7)]
        state2 = second.state_dict()
    finally:
        second.close()
    assert whole[4:11] == middle
    assert resumed(make, state2) == whole[11:]
    worker = state2["_snapshot"]["_worker_snapshots"]["worker_2"]
    assert worker["fetcher_state"]["dataset_iter_state"]["i"] == 3  # its 3rd batch came last
    assert state2["_snapshot"]["_last_yielded_worker_id"] == 1


def test_a_worker_whose_iterator_ended_stays_ended():
    def make() -> zt.DataLoader:
        return loader(Counted([2, 12, 1]))
    _, state, rest = cut(make, 6)
    ended = [state["_snapshot"]["_worker_snapshots"][f"worker_{w}"]["fetcher_state"]
             ["fetcher_ended"] for w in range(3)]
    assert ended == [True, False, True]
    assert resumed(make, state) == rest


def test_in_process_iterable_datasets_resume_from_their_own_state():
    def make() -> zt.DataLoader:
        return loader(Counted([25]), num_workers=0, batch_size=4)
    _, state, rest = cut(make, 3)
    assert state["fetcher_state"]["dataset_iter_state"]["i"] == 12
    assert resumed(make, state) == rest


class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i == 0:
            time.sleep(0.5)
        return i


def test_batches_yielded_out_of_order_resume_per_worker():
    def make() -> zt.DataLoader:
        return zt.DataLoader(Slow(), num_workers=2, in_order=False)
    head, state, _ = cut(make, 4)
    got = [int(b) for b in head] + [int(b) for b in resumed(make, state)]
    assert sorted(got) == list(range(12))  # worker 0, slow on its first, resumes there


class Tally(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A map-style dataset that keeps a state: how many samples its copy has made."""

    def __init__(self) -> None:
        self.made = 0

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.made += 1
        return i, self.made

    def state_dict(self) -> dict[str, int]:
        return {"made": self.made}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.made = state["made"]


def test_a_map_style_dataset_s_own_state_is_restored_in_each_worker():
    def make() -> zt.DataLoader:
        return zt.DataLoader(Tally(), batch_size=2, num_workers=2, collate_fn=identity)
    _, state, rest = cut(make, 5)
    assert state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"] == {"made": 6}
    assert resumed(make, state) == rest


class Drawing(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> list[float]:
        first = torch.rand(()).item()
        time.sleep(0.02)  # a producer stopped now must not draw into the next epoch's
        return [float(i), first, torch.rand(()).item()]


def test_persistent_workers_left_mid_batch_do_not_draw_into_the_next_epoch():
    def make() -> zt.DataLoader:
        return zt.DataLoader(Drawing(), batch_size=2, num_workers=2, persistent_workers=True,
                             generator=torch.Generator().manual_seed(1))
    _, state, rest = cut(make, 0)
    again = make()
    try:
        for _ in range(3):
            it = iter(again)
            next(it)  # left while the workers make the next batches
        again.load_state_dict(state)
        def plain(batches: Any) -> list[Any]:
            return [[t.tolist() for t in b] for b in batches]
        assert plain(again) == plain(rest)
    finally:
        again.close()


def test_states_that_cannot_resume_here_are_refused():
    _, state, _ = cut(lambda: loader(Counted([4, 4, 4])), 2)
    with pytest.raises(ValueError, match="num_workers=3 and this loader has num_workers=2"):
        loader(Counted([4, 4, 4]), num_workers=2).load_state_dict(state)
    with pytest.raises(ValueError, match="snapshot_every_n_steps must be an int"):
        loader(Counted([1]), snapshot_every_n_steps=-1)
    _, mapped, _ = cut(lambda: zt.DataLoader(Slow(), num_workers=2, in_order=False), 3)
    snapshots = mapped["_snapshot"]["_worker_snapshots"]
    snapshots["worker_0"]["next_batch"], snapshots["worker_1"]["next_batch"] = 0, 7
    with pytest.raises(ValueError, match=r"out of order .* by 2 workers: it resumes only"):
        zt.DataLoader(Slow(), num_workers=3).load_state_dict(mapped)  # batches 1, 3, 5 had
    snapshots["worker_0"]["next_batch"], snapshots["worker_1"]["next_batch"] = 4, 3
    zt.DataLoader(Slow(), num_workers=3).load_state_dict(mapped)  # batches 0, 1, 2 had
    for field, value in (("_last_yielded_worker_id", "1"), ("_last_yielded_worker_id", 7)):
        crafted = json.loads(json.dumps(mapped))
        crafted["_snapshot"][field] = value
        with pytest.raises(ValueError, match="_last_yielded_worker_id"):
            zt.DataLoader(Slow(), num_workers=2).load_state_dict(crafted)
    crafted = json.loads(json.dumps(mapped))
    crafted["_snapshot"]["_worker_snapshots"]["worker_0"]["next_batch"] = -2
    with pytest.raises(ValueError, match="worker_0"):
        zt.DataLoader(Slow(), num_workers=2).load_state_dict(crafted)
    quiet = loader(Counted([3, 3, 3]))
    quiet.load_state_dict({})  # torchdata's "nothing to load"
    assert len(list(quiet)) == 9
    quiet.close()


def init_fails(worker: int) -> None:
    raise KeyError(f"no config for worker {worker}")


def test_a_worker_that_fails_to_start_raises_at_iter():
    broken = zt.DataLoader(Slow(), num_workers=2, worker_init_fn=init_fails)
    try:
        with pytest.raises(KeyError, match="no config for worker"):
            iter(broken)
    finally:
        broken.close()
