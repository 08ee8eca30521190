"""zloader.torch.DataLoader's states beyond map-style datasets read in order, as torchdata's
StatefulDataLoader keeps them: iterable datasets (restored from their own ``state_dict``
or made again up to where they were), ``snapshot_every_n_steps``, batches yielded out of
order, map-style datasets that keep a state, a resume of a resume, and the errors: states
that cannot resume here, and crafted or corrupted ones, refused with a ValueError that
names the field."""

from __future__ import annotations

import json
import os
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


class Gated(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``(worker id, i)`` for ``i < n``; index 0 waits until ``gate`` exists (the test
    creates it), so the worker making it is stuck while the others go on."""

    def __init__(self, gate: Any, n: int = 10) -> None:
        self.gate, self.n = str(gate), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == 0:
            deadline = time.monotonic() + 60  # does not hang if the test fails first
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        info = torch.utils.data.get_worker_info()
        return (info.id if info is not None else -1), i


def gated_run(loader: zt.DataLoader, gate: Any, before: int,
              stop: int | None = None) -> tuple[list[tuple[int, int]], dict[str, Any] | None]:
    """``(worker, i)`` of the batches ``loader`` yields, opening ``gate`` once ``before``
    came; with ``stop``, its state after ``stop`` batches (and no more are read)."""
    got: list[tuple[int, int]] = []
    state = None
    for worker, i in loader:
        got.append((int(worker), int(i)))
        if len(got) == before:
            open(gate, "w").close()
        if len(got) == stop:
            state = loader.state_dict()
            break
    return got, state


def test_out_of_order_batches_go_to_the_worker_with_room_as_in_torch(tmp_path):
    """torch's dispatch with in_order=False (its test_out_of_order_index_ds, with a gate in
    place of a sleep): worker 0 is stuck on index 0 with index 2 queued behind it
    (prefetch_factor 2), and every later batch goes to worker 1."""
    gate = tmp_path / "gate"
    dl = zt.DataLoader(Gated(gate), num_workers=2, prefetch_factor=2, in_order=False)
    try:
        got, _ = gated_run(dl, gate, before=8)
    finally:
        dl.close()
    assert got == [(1, 1), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 9),
                   (0, 0), (0, 2)]


@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_batches_yielded_out_of_order_resume_exactly(tmp_path, workers):
    """A state taken while worker 0 is stuck (batches 0 and 2 not yielded) records the
    batches yielded, not a count: a resume, with the same or another num_workers, yields
    exactly the rest; a resume of that resume goes on from its own state."""
    gate = tmp_path / "gate"
    first = zt.DataLoader(Gated(gate, 16), num_workers=2, in_order=False)
    try:
        head, state = gated_run(first, gate, before=6, stop=5)
    finally:
        first.close()
    assert state is not None and 0 not in [i for _, i in head]
    assert state["yielded"] == [[1, 2], [3, 7]]
    state = json.loads(json.dumps(state))
    gate.unlink(missing_ok=True)
    second = zt.DataLoader(Gated(gate, 16), num_workers=workers, in_order=False)
    second.load_state_dict(state)
    try:
        middle, again = gated_run(second, gate, before=1, stop=4)
    finally:
        second.close()
    third = zt.DataLoader(Gated(gate, 16), num_workers=2, in_order=False)
    third.load_state_dict(again)
    try:
        rest, _ = gated_run(third, gate, before=0)
    finally:
        third.close()
    got = [i for _, i in head + middle + rest]
    assert sorted(got) == list(range(16))


def test_persistent_workers_leave_a_dispatched_epoch_for_the_next(tmp_path):
    """in_order=False with persistent workers: an epoch left while a worker waits for
    its next batch (and one while a worker is stuck in a batch) does not hold up the
    next epoch, which yields every batch once."""
    gate = tmp_path / "gate"
    dl = zt.DataLoader(Gated(gate, 12), num_workers=2, in_order=False,
                       persistent_workers=True)
    try:
        open(gate, "w").close()
        first = iter(dl)
        assert len([next(first) for _ in range(3)]) == 3
        again = sorted(int(i) for _, i in dl)
        assert again == list(range(12))
        assert sorted(int(i) for _, i in dl) == list(range(12))
    finally:
        dl.close()


def test_batches_yielded_out_of_order_resume_per_worker():
    def make() -> zt.DataLoader:
        return zt.DataLoader(Slow(), num_workers=2, in_order=False)
    head, state, _ = cut(make, 4)
    got = [int(b) for b in head] + [int(b) for b in resumed(make, state)]
    assert sorted(got) == list(range(12))


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
    for field, value in (("_last_yielded_worker_id", "1"), ("_last_yielded_worker_id", 7)):
        crafted = json.loads(json.dumps(mapped))
        crafted["_snapshot"][field] = value
        with pytest.raises(ValueError, match="_last_yielded_worker_id"):
            zt.DataLoader(Slow(), num_workers=2).load_state_dict(crafted)
    for ranges in ([[0, 2]], [[1, 3], [2, 3]], [[2, 1], [0, 4]], [[0, 1], [1, 3]],
                   [[0, True], [2, 4]], "0-3", [[-1, 2]]):  # 3 batches yielded
        crafted = json.loads(json.dumps(mapped))
        crafted["yielded"] = ranges
        with pytest.raises(ValueError, match=r"state\['yielded'\]"):
            zt.DataLoader(Slow(), num_workers=2).load_state_dict(crafted)
    crafted = json.loads(json.dumps(mapped))
    crafted["yielded"] = [[0, 1], [4, 6]]  # any 3 batches resume, with any num_workers
    zt.DataLoader(Slow(), num_workers=3).load_state_dict(crafted)
    crafted["zloader_torch"] = 1
    with pytest.raises(ValueError, match="layout version 1 and this zloader reads version 2"):
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


class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``(i, a draw of torch's)``: its workers' random states move, so a state holds them."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, torch.rand(()).item()


def noisy(**kwargs: Any) -> zt.DataLoader:
    """12 batches of 2, 2 workers."""
    kwargs.setdefault("num_workers", 2)
    return zt.DataLoader(Noisy(), batch_size=2, collate_fn=identity,
                         generator=torch.Generator().manual_seed(2), **kwargs)


@pytest.fixture(scope="module")
def mid_epoch() -> tuple[str, list[Any]]:
    """A real state of :func:`noisy`'s loader 3 batches into its epoch (as JSON, to be
    crafted afresh by each test) and the batches after it."""
    _, state, rest = cut(noisy, 3)
    assert state["batches"] == 3 and state["yielded"] == [[0, 3]]
    assert sorted(state["workers"]) == ["0", "1"]
    return json.dumps(state), rest


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def worker(state: dict[str, Any], name: str = "worker_0") -> dict[str, Any]:
    entry: dict[str, Any] = state["_snapshot"]["_worker_snapshots"][name]
    return entry


SNAPSHOTS = r"state\['_snapshot'\]\['_worker_snapshots'\]"

# (what is crafted into the real state, the message: the field's path, what it holds and
# what was expected). The first eight are the review's findings: each was accepted (and
# misbehaved: an empty epoch, a batch too many or too few, a field ignored) or raised
# something other than a ValueError that names the field.
CRAFTED = {
    "batches_and_yielded_past_the_epoch": (
        lambda s: s.update(batches=10**18, yielded=[[0, 10**18]]),
        r"state\['batches'\] is 1000000000000000000: expected an int \(not a bool\) from 0 "
        r"to 12, the 12 batches of the epoch it resumes"),
    "batches_past_the_epoch_without_yielded": (
        lambda s: (s.update(batches=10**18), s.pop("yielded")),
        r"state\['batches'\] is 1000000000000000000: expected .* from 0 to 12"),
    "batches_a_bool": (
        lambda s: s.update(batches=True, yielded=[[0, 1]]),
        r"state\['batches'\] is True: expected an int \(not a bool\)"),
    "yielded_past_the_epoch": (
        lambda s: s.update(yielded=[[0, 2], [50, 51]]),
        r"state\['yielded'\]\[1\] is \[50, 51\]: expected .*end <= 12"),
    "since_of_a_map_style_worker": (
        lambda s: worker(s).update(since=10**12),
        SNAPSHOTS + r"\['worker_0'\]\['since'\] is 1000000000000: expected an int \(not a "
        r"bool\) from 0 to 0, a map-style dataset's workers make no batch again"),
    "a_worker_the_state_does_not_have": (
        lambda s: s["_snapshot"]["_worker_snapshots"].update(
            worker_99={**worker(s), "worker_id": 99}),
        SNAPSHOTS + r" has the key 'worker_99': expected only worker_0 \.\. worker_1 in one "
        r"per worker of the state's num_workers=2"),
    "a_value_100_000_deep": (
        lambda s: worker(s).update(dataset_state=nested(100_000)),
        SNAPSHOTS + r"\['worker_0'\]\['dataset_state'\]\[0\]\[0\]\.\.\. nests deeper than "
        r"100 levels"),
    "rng_not_base64": (
        lambda s: s.update(rng="not base64!"),
        r"state\['rng'\] is not base64 \(.*\): expected the base64 random state of the "
        r"loader's generator"),
    # and more of the same kinds
    "rng_of_another_size": (
        lambda s: s.update(rng="AAAA"),
        r"state\['rng'\] decodes to 3 bytes: expected 5056"),
    "a_worker_s_rng_corrupt": (
        lambda s: s["workers"].update({"0": "AAAA"}),
        r"state\['workers'\]\['0'\] does not decode \(.*\): expected a worker's packed"),
    "a_worker_s_rng_not_base64": (
        lambda s: s["workers"].update({"1": "???"}),
        r"state\['workers'\]\['1'\] is not base64"),
    "a_worker_number_past_the_state_s": (
        lambda s: s["workers"].update({"2": s["workers"]["0"]}),
        r"state\['workers'\] holds '2': expected the keys '0' \.\. '1'"),
    "an_unknown_key": (
        lambda s: s.update(note="mine"),
        r"state has the key 'note': expected only zloader_torch, .* in a state of a "
        r"map-style dataset saved with num_workers=2"),
    "a_missing_field": (
        lambda s: s.pop("reseed"),
        r"state\['reseed'\] is missing"),
    "finished_not_a_bool": (
        lambda s: s.update(finished="yes"),
        r"state\['finished'\] is 'yes': expected a bool"),
    "num_workers_a_bool": (
        lambda s: s.update(num_workers=True),
        r"state\['num_workers'\] is True: expected an int \(not a bool\)"),
    "num_workers_past_its_snapshots": (
        lambda s: s.update(num_workers=10**18),
        SNAPSHOTS + r"\['worker_2'\] is missing"),
    "base_seed_past_int64": (
        lambda s: s.update(base_seed=2**64),
        r"state\['base_seed'\] is 18446744073709551616: expected an int"),
    "a_worker_s_id_not_its_own": (
        lambda s: worker(s, "worker_1").update(worker_id=0),
        SNAPSHOTS + r"\['worker_1'\]\['worker_id'\] is 0: expected .* from 1 to 1"),
    "a_fetcher_state_for_a_map_style_worker": (
        lambda s: worker(s).update(fetcher_state={"dataset_iter_state": None,
                                                  "fetcher_ended": True}),
        SNAPSHOTS + r"\['worker_0'\]\['fetcher_state'\] is \{.*\}: expected None"),
    "an_unknown_key_in_a_worker_s_snapshot": (
        lambda s: worker(s).update(extra=1),
        SNAPSHOTS + r"\['worker_0'\] has the key 'extra': expected only worker_id, "),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_state_is_refused_naming_its_field(mid_epoch, case):
    """A real mid-epoch state with one field crafted: load_state_dict raises ValueError
    naming the field's path, what it holds and what was expected."""
    craft, message = CRAFTED[case]
    state = json.loads(mid_epoch[0])
    craft(state)
    fresh = noisy()
    try:
        with pytest.raises(ValueError, match=message) as caught:
            fresh.load_state_dict(state)
        assert type(caught.value) is ValueError  # not binascii.Error, not RecursionError
        assert fresh.state_dict()["batches"] == 0  # nothing of it was loaded
    finally:
        fresh.close()


def test_the_state_the_crafted_ones_come_from_resumes(mid_epoch):
    state, rest = mid_epoch
    assert resumed(noisy, json.loads(state)) == rest
    def samples(batches: list[Any]) -> list[int]:
        return [i for batch in batches for i, _ in batch]
    # with another num_workers the same batches (the workers start as seeded: other draws)
    assert samples(resumed(lambda: noisy(num_workers=3), json.loads(state))) == samples(rest)


class Unsized(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Batches of 2 of 24 indices, in order, without ``len()``."""

    def __iter__(self) -> Any:
        return iter([[i, i + 1] for i in range(0, 24, 2)])


def test_a_sampler_without_len_has_the_state_checked_against_the_sampled_epoch():
    def make() -> zt.DataLoader:
        return zt.DataLoader(Noisy(), batch_sampler=Unsized(), num_workers=2,
                             collate_fn=identity)
    _, state, rest = cut(make, 2)
    crafted = json.loads(json.dumps(state))
    crafted["yielded"] = [[0, 1], [20, 21]]  # batch 20 of an epoch of 12
    again = make()
    try:
        # its epoch's batches are known only once the sampler ended: refused then
        again.load_state_dict(crafted)
        with pytest.raises(ValueError, match=r"state\['yielded'\] has the range \[20, 21\]: "
                                             r"expected .* end <= 12"):
            list(again)
    finally:
        again.close()
    assert resumed(make, state) == rest


def test_an_iterable_worker_s_since_is_bounded_by_the_batches_yielded():
    def make() -> zt.DataLoader:
        return loader(Counted([4, 4], stateful=False), num_workers=2)
    _, state, rest = cut(make, 3)
    assert [worker(state, f"worker_{w}")["since"] for w in range(2)] == [2, 1]
    crafted = json.loads(json.dumps(state))
    worker(crafted)["since"] = 10**12  # worker 0 would skip every batch it has
    with pytest.raises(ValueError, match=SNAPSHOTS + r"\['worker_0'\]\['since'\] is "
                                         r"1000000000000: expected .* from 0 to 3"):
        make().load_state_dict(crafted)
    worker(crafted)["since"] = 3  # with worker 1's 1: 4 of the 3 batches yielded
    with pytest.raises(ValueError, match=SNAPSHOTS + r"\['worker_1'\]\['since'\] is 1: "
                                         r"expected .* from 0 to 0"):
        make().load_state_dict(crafted)
    assert resumed(make, state) == rest
