"""A DataLoader's resumable state: its layout, what a worker snapshots of a dataset that
keeps state of its own, and the checks a loaded state gets.

``DataLoader.state_dict()`` is a small dict: zloader's own fields (``zloader_torch``: the
layout's version; ``rng``: the random state the epoch sampled from; ``batches``: the
batches it yielded; ``base_seed``, ``reseed``; ``workers``: each worker's packed random
state, base64) and, per worker, what torchdata's ``StatefulDataLoader`` records under the
same names, so that tools which read those find them: ``_snapshot._worker_snapshots
.worker_<i>`` holds ``worker_id``, ``dataset_state`` (the dataset's ``state_dict()``
when it has ``state_dict``/``load_state_dict``), ``fetcher_state`` (for an iterable
dataset: ``dataset_iter_state``, its iterator's ``state_dict()`` when it has one, and
``fetcher_ended``), and zloader's ``since`` (that worker's batches yielded after the
snapshot, made again and dropped on resume); ``_snapshot._last_yielded_worker_id`` is
the worker whose batch came last. A map-style dataset's state with workers also records
which batches of the epoch were yielded (``yielded``: sorted ``[first, end)`` ranges of
batch numbers; one range unless they came out of order). With ``num_workers=0`` an
iterable dataset's ``dataset_state`` and ``fetcher_state`` are top-level keys, as in
torchdata.
"""

from __future__ import annotations

import base64
import bisect
import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from zloader.torch.seeding import unpack_rng

VERSION = 2
"""The layout's version (2: map-style batches yielded as ranges, not a next batch per
worker)."""


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` keeps a state of its own: it has ``state_dict`` and
    ``load_state_dict`` (torchdata's ``Stateful`` protocol)."""
    return (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def state_of(obj: Any) -> Any:
    """A copy of ``obj.state_dict()`` when ``obj`` is stateful (a dataset may return its
    own live containers, which it goes on changing), else None."""
    return copy.deepcopy(obj.state_dict()) if is_stateful(obj) else None


def load(obj: Any, state: Any) -> None:
    """``obj.load_state_dict(state)``, when there is a state to load and ``obj`` takes it."""
    if state is not None and is_stateful(obj):
        obj.load_state_dict(state)


def snapshot(worker: int, dataset: Any, iterator: Any = None, ended: bool = False,
             iterable: bool = True) -> dict[str, Any]:
    """What worker ``worker`` records of its dataset (and, for an iterable one, of the
    iterator it made from it), under torchdata's names. An iterator that is the dataset
    itself is recorded once, as the iterator."""
    if not iterable:
        return {"worker_id": worker, "dataset_state": state_of(dataset),
                "fetcher_state": None}
    return {"worker_id": worker,
            "dataset_state": state_of(dataset) if iterator is not dataset else None,
            "fetcher_state": {"dataset_iter_state": state_of(iterator),
                              "fetcher_ended": bool(ended)}}


def resume_into(dataset: Any, make_iterator: Any, saved: dict[str, Any] | None) -> Any:
    """Restore a worker's dataset from ``saved`` (a :func:`snapshot`, or None), make its
    iterator with ``make_iterator()`` and restore that: torchdata's order (dataset state,
    then ``iter()``, then the iterator's state)."""
    if saved is not None:
        load(dataset, saved.get("dataset_state"))
    iterator = make_iterator()
    fetcher = (saved or {}).get("fetcher_state") or {}
    if fetcher.get("dataset_iter_state") is not None:
        load(iterator, fetcher["dataset_iter_state"])
    return iterator


def ended(saved: dict[str, Any] | None) -> bool:
    """Whether the snapshot ``saved`` is of an iterator that had ended."""
    fetcher = (saved or {}).get("fetcher_state") or {}
    return bool(fetcher.get("fetcher_ended"))


def inline(dataset: Any, fetcher: Any) -> dict[str, Any]:
    """The top-level ``dataset_state`` and ``fetcher_state`` of an iterable dataset's
    state with ``num_workers=0``; ``fetcher``: torch's fetcher of the epoch under way
    (None between epochs, when only the dataset's own state carries over)."""
    if fetcher is None:
        return {"dataset_state": state_of(dataset), "fetcher_state": None}
    iterator = fetcher.dataset_iter
    return {"dataset_state": state_of(dataset) if iterator is not dataset else None,
            "fetcher_state": {"dataset_iter_state": state_of(iterator),
                              "fetcher_ended": bool(fetcher.ended)}}


@dataclass
class Place:
    """Where one worker stands, as far as the batches yielded go: the snapshot of its
    dataset it had at its last batch yielded that carried one (None: as its seeding and
    ``iter()`` leave it), its random state then (empty: as seeded), its batches yielded
    since, and whether its iterator ended. ``started``: its first record of the epoch
    arrived (or the epoch was resumed), so the snapshot is known."""

    snapshot: dict[str, Any] | None = None
    rng: bytes = b""
    since: int = 0
    ended: bool = False
    started: bool = False


class Batches:
    """The batch numbers of a map-style epoch yielded so far, as sorted, disjoint
    ``[first, end)`` ranges: one while they come in order, a few more when they come as
    workers make them (``in_order=False``)."""

    def __init__(self, ranges: Iterable[Iterable[int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for first, end in ranges:
            self._starts.append(first)
            self._ends.append(end)

    def add(self, number: int) -> None:
        """Batch ``number`` was yielded."""
        starts, ends = self._starts, self._ends
        if ends and ends[-1] == number:  # the usual case: the next batch in order
            ends[-1] += 1
            return
        at = bisect.bisect_right(starts, number)
        if at and ends[at - 1] > number:
            return
        left = at > 0 and ends[at - 1] == number
        right = at < len(starts) and starts[at] == number + 1
        if left and right:
            ends[at - 1] = ends[at]
            del starts[at], ends[at]
        elif left:
            ends[at - 1] = number + 1
        elif right:
            starts[at] = number
        else:
            starts.insert(at, number)
            ends.insert(at, number + 1)

    def ranges(self) -> list[list[int]]:
        return [[first, end] for first, end in zip(self._starts, self._ends, strict=True)]

    def todo(self, total: int) -> list[int]:
        """The batch numbers below ``total`` not yielded, in order."""
        left: list[int] = []
        at = 0
        for first, end in zip(self._starts, self._ends, strict=True):
            left.extend(range(at, min(first, total)))
            at = max(at, end)
        left.extend(range(at, total))
        return left


def layout(places: dict[int, Place], last: int | None) -> dict[str, Any]:
    """The per-worker part of a state (``_snapshot``), from the workers' places."""
    snapshots = {}
    for worker, place in sorted(places.items()):
        entry: dict[str, Any] = dict(place.snapshot) if place.snapshot is not None else \
            {"worker_id": worker, "dataset_state": None, "fetcher_state": None}
        entry["worker_id"] = worker
        if place.ended:
            fetcher = dict(entry.get("fetcher_state") or {"dataset_iter_state": None})
            fetcher["fetcher_ended"] = True
            entry["fetcher_state"] = fetcher
        entry["since"] = place.since
        snapshots[f"worker_{worker}"] = entry
    return {"_worker_snapshots": snapshots, "_last_yielded_worker_id": last}


def places_of(state: dict[str, Any], rngs: dict[int, bytes]) -> dict[int, Place]:
    """The workers' places a checked state records (see :func:`checked`)."""
    found = {}
    for key, entry in (state.get("_snapshot") or {}).get("_worker_snapshots", {}).items():
        worker = int(key.removeprefix("worker_"))
        saved = {k: entry.get(k) for k in ("worker_id", "dataset_state", "fetcher_state")}
        has_state = saved["dataset_state"] is not None or bool(
            (saved["fetcher_state"] or {}).get("dataset_iter_state") is not None)
        found[worker] = Place(snapshot=saved if has_state or ended(saved) else None,
                              rng=rngs.get(worker, b""), since=int(entry.get("since", 0)),
                              ended=ended(saved), started=True)
    return found


def checked(state: Any, workers: int, iterable: bool) -> dict[str, Any]:
    """``state`` (what ``DataLoader.state_dict()`` returned) checked, its workers' random
    states decoded: ``{..., "reseed": whether its epoch drew a base seed, "workers":
    {index: packed state}, "places": {index: Place}, "yielded": Batches}``.

    Raises:
        ValueError: ``state`` is not such a dict (or one of another layout version),
            names a worker beyond ``workers``, or is an iterable dataset's saved with
            another ``num_workers`` (each worker's position lies in its own share of the
            dataset).
    """
    version = state.get("zloader_torch") if isinstance(state, dict) else None
    if isinstance(version, int) and version != VERSION:
        raise ValueError(f"this state has layout version {version} and this zloader reads "
                         f"version {VERSION}: it was saved by another zloader version")
    if not (isinstance(state, dict) and state.get("zloader_torch") == VERSION
            and isinstance(state.get("rng"), str)
            and isinstance(state.get("batches"), int) and state["batches"] >= 0
            and (state.get("base_seed") is None or isinstance(state["base_seed"], int))
            and isinstance(state.get("reseed", False), bool)
            and isinstance(state.get("workers", {}), dict)
            and isinstance(state.get("_snapshot", {}), dict)):
        raise ValueError("state must be what zloader.torch.DataLoader.state_dict() "
                         "returned")
    saved_workers = state.get("num_workers")
    if iterable and saved_workers is not None and saved_workers != workers:
        raise ValueError(
            f"this state of an iterable dataset was saved with num_workers={saved_workers} "
            f"and this loader has num_workers={workers}: each worker's position lies in "
            "its own share of the dataset (its get_worker_info()), so it resumes only with "
            "the same num_workers")
    # A map-style state resumes with another num_workers by the batches it yielded alone
    # (each worker as seeded): its workers' parts are checked against its own count.
    saved = workers
    if (not iterable and isinstance(saved_workers, int) and not isinstance(saved_workers, bool)
            and saved_workers > 0):
        saved = saved_workers
    found = {}
    for key, text in state.get("workers", {}).items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < saved
                and isinstance(text, str)):
            raise ValueError(f"state['workers'] holds {key!r}: not a worker of this "
                             f"loader's {saved} (num_workers must be the saved loader's)")
        try:
            data = base64.b64decode(text, validate=True)
        except ValueError:
            raise ValueError(f"state['workers'][{key!r}] is not base64") from None
        unpack_rng(data)  # raises on a corrupt one
        found[int(key)] = data
    snapshots = (state.get("_snapshot") or {}).get("_worker_snapshots", {})
    if not isinstance(snapshots, dict):
        raise ValueError("state['_snapshot']['_worker_snapshots'] must be a dict")
    for key, entry in snapshots.items():
        number = key.removeprefix("worker_") if isinstance(key, str) else ""
        if not (number.isdigit() and isinstance(entry, dict)
                and isinstance(entry.get("since", 0), int) and entry.get("since", 0) >= 0
                and isinstance(entry.get("fetcher_state") or {}, dict)):
            raise ValueError(f"state['_snapshot']['_worker_snapshots'][{key!r}] is not a "
                             "worker's snapshot saved by zloader.torch.DataLoader")
    last = (state.get("_snapshot") or {}).get("_last_yielded_worker_id")
    if last is not None and not (isinstance(last, int) and not isinstance(last, bool)
                                 and 0 <= last < max(saved, 1)):
        raise ValueError(f"state['_snapshot']['_last_yielded_worker_id'] is {last!r}: not a "
                         f"worker of this loader's {saved}")
    # A state saved before "reseed" was recorded: an epoch with a base seed took it.
    reseed = state.get("reseed", state.get("base_seed") is None)
    places = places_of(state, found)
    if saved != workers:
        found, places = {}, {}
    return {**state, "reseed": reseed, "workers": found, "places": places,
            "yielded": yielded_of(state)}


def yielded_of(state: dict[str, Any]) -> Batches:
    """The batches a state records as yielded: its ``yielded`` ranges, or its first
    ``batches`` (a state without them: in order, or an iterable dataset's).

    Raises:
        ValueError: ``yielded`` is not sorted, disjoint ``[first, end)`` ranges of batch
            numbers that hold ``batches`` batches.
    """
    ranges = state.get("yielded")
    if ranges is None:
        return Batches([[0, state["batches"]]] if state["batches"] else [])
    at, count = 0, 0
    ok = isinstance(ranges, list)
    for pair in ranges if ok else ():
        ok = (isinstance(pair, list) and len(pair) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
              and at <= pair[0] < pair[1])
        if not ok:
            break
        at, count = pair[1] + 1, count + pair[1] - pair[0]
    if not ok or count != state["batches"]:
        raise ValueError(f"state['yielded'] is {ranges!r:.80}: not the sorted, disjoint "
                         f"[first, end) ranges of the {state['batches']} batches the state "
                         "yielded")
    return Batches(ranges)


def resumed_places(resume: dict[str, Any] | None, iterable: bool, persistent: bool,
                   workers: int) -> dict[int, Place] | None:
    """The workers' places a checked state (:func:`checked`) resumes; None: none to
    resume. A finished epoch's state resumes at the next epoch: persistent workers keep
    their dataset's state from then (not their ended iterators'), others start afresh,
    as torchdata's do. A map-style state saved with another ``num_workers`` resumes by
    the batches it yielded alone (``yielded``), each worker as seeded."""
    if resume is None:
        return None
    places: dict[int, Place] = resume["places"]
    finished = resume.get("finished") and not resume["batches"]
    if finished:
        if not persistent:
            return None
        return {w: Place(snapshot={**p.snapshot, "fetcher_state": None}
                         if p.snapshot is not None else None, rng=p.rng)
                for w, p in places.items() if p.snapshot is not None or p.rng}
    if not iterable and resume.get("num_workers", workers) != workers:
        return None
    return places
