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
snapshot, made again and dropped on resume) and ``next_batch`` (a map-style worker's next
batch number); ``_snapshot._last_yielded_worker_id`` is the worker whose batch came
last. With ``num_workers=0`` an iterable dataset's ``dataset_state`` and
``fetcher_state`` are top-level keys, as in torchdata.
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass
from typing import Any

from zloader.torch.seeding import unpack_rng

VERSION = 1


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
    next_batch: int | None = None  # a map-style worker's next batch number


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
        if place.next_batch is not None:
            entry["next_batch"] = place.next_batch
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
                              ended=ended(saved), started=True,
                              next_batch=entry.get("next_batch"))
    return found


def checked(state: Any, workers: int, iterable: bool) -> dict[str, Any]:
    """``state`` (what ``DataLoader.state_dict()`` returned) checked, its workers' random
    states decoded: ``{..., "reseed": whether its epoch drew a base seed, "workers":
    {index: packed state}, "places": {index: Place}}``.

    Raises:
        ValueError: ``state`` is not such a dict, names a worker beyond ``workers``, or is
            an iterable dataset's saved with another ``num_workers`` (each worker's
            position lies in its own share of the dataset).
    """
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
    found = {}
    for key, text in state.get("workers", {}).items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < workers
                and isinstance(text, str)):
            raise ValueError(f"state['workers'] holds {key!r}: not a worker of this "
                             f"loader's {workers} (num_workers must be the saved loader's)")
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
                and isinstance(entry.get("fetcher_state") or {}, dict)
                and isinstance(entry.get("next_batch", 0), int)
                and entry.get("next_batch", 0) >= 0):
            raise ValueError(f"state['_snapshot']['_worker_snapshots'][{key!r}] is not a "
                             "worker's snapshot saved by zloader.torch.DataLoader")
    last = (state.get("_snapshot") or {}).get("_last_yielded_worker_id")
    if last is not None and not (isinstance(last, int) and not isinstance(last, bool)
                                 and 0 <= last < max(workers, 1)):
        raise ValueError(f"state['_snapshot']['_last_yielded_worker_id'] is {last!r}: not a "
                         f"worker of this loader's {workers}")
    places = places_of(state, found)
    if not iterable and saved_workers not in (None, workers) and any(
            p.next_batch is not None and not _in_prefix(w, p.next_batch, state)
            for w, p in places.items()):
        raise ValueError(
            f"this state's batches were yielded out of order (in_order=False) by "
            f"{saved_workers} workers: it resumes only with num_workers={saved_workers}")
    # A state saved before "reseed" was recorded: an epoch with a base seed took it.
    reseed = state.get("reseed", state.get("base_seed") is None)
    return {**state, "reseed": reseed, "workers": found, "places": places}


def _in_prefix(worker: int, next_batch: int, state: dict[str, Any]) -> bool:
    """Whether a map-style worker's next batch is the one it has after the state's
    ``batches`` first batches of the epoch (with the saved loader's ``num_workers``)."""
    saved = state.get("num_workers") or 1
    skip = state["batches"]
    return next_batch == skip + (worker - skip) % saved


def resumed_places(resume: dict[str, Any] | None, iterable: bool, persistent: bool,
                   workers: int) -> dict[int, Place] | None:
    """The workers' places a checked state (:func:`checked`) resumes; None: none to
    resume. A finished epoch's state resumes at the next epoch: persistent workers keep
    their dataset's state from then (not their ended iterators'), others start afresh,
    as torchdata's do. A map-style state saved with another ``num_workers`` resumes by
    its batch count alone (:func:`checked` made sure that is where each worker was)."""
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
