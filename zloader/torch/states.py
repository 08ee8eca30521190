"""A DataLoader's resumable state: its layout, what a worker snapshots of a dataset that
keeps state of its own, and the checks a loaded state gets.

``DataLoader.state_dict()`` is a small dict: zloader's own fields (``zloader_torch``: the
layout's version; ``num_workers``: the saving loader's; ``rng``: the random state the
epoch sampled from; ``batches``: the batches it yielded; ``base_seed``, ``reseed``;
``finished``: the epoch had ended; ``workers``: each worker's packed random state,
base64) and, per worker, what torchdata's ``StatefulDataLoader`` records under the
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

A loaded state is checked in one place, :func:`checked` (and :func:`within`, once the
epoch of a sampler without ``len()`` is sampled), against the epoch it resumes: a field
that is missing, unknown to the layout, of the wrong type (a bool is not an int), past
the epoch's batches or the state's workers, that does not decode or nests too deep is
refused with a ``ValueError`` naming its path (``state['yielded'][1]``).
"""

from __future__ import annotations

import base64
import bisect
import copy
import random
import re
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch
import torch.utils.data

from zloader._byfields import ByFields
from zloader._defaults import CODEC_MAX_DEPTH
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


@dataclass(eq=False, repr=False)
class Place(ByFields):
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

    def __contains__(self, number: int) -> bool:
        at = bisect.bisect_right(self._starts, number)
        return at > 0 and self._ends[at - 1] > number

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


MAX_DEPTH = CODEC_MAX_DEPTH
"""How deep a state may nest (what a dataset's own ``state_dict()`` returns included):
a deeper one (or one that holds itself) is refused before anything copies it. The
codec's limit: a worker's part of the state goes to it through the codec."""

_INT64_MAX = int(np.iinfo(np.int64).max)  # counts and base seeds (drawn as int64s >= 0)
_FETCHER_KEYS = ("dataset_iter_state", "fetcher_ended")
_ENTRY_KEYS = ("worker_id", "dataset_state", "fetcher_state", "since")
_SNAPSHOT_KEYS = ("_worker_snapshots", "_last_yielded_worker_id")
_MISSING = object()
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring = 3, 6, 4, 40
_SHOWN.maxlong, _SHOWN.maxother = 40, 40


def checked(state: Any, workers: int, iterable: bool, total: int | None = None,
            generator: torch.Generator | None = None) -> dict[str, Any]:
    """``state`` (what ``DataLoader.state_dict()`` returned) checked against the epoch it
    resumes, its workers' random states decoded: ``{..., "reseed": whether its epoch drew
    a base seed, "workers": {index: packed state}, "places": {index: Place}, "yielded":
    Batches}``.

    Every field is checked here, where it is read: zloader's layout fixes every key of
    the state outside what a dataset's own ``state_dict()`` returned (``dataset_state``,
    ``dataset_iter_state``: those are the dataset's, passed to it as they are), so a key
    missing or one it does not have is refused; counts and worker numbers are ints (not
    bools) within the epoch's bounds (``total`` batches; the state's own ``num_workers``);
    a map-style worker's ``since`` is 0 (its batches are never made again), an iterable
    one's at most the batches yielded, all workers' together; the random states decode
    (the sampler's ``rng`` to a state of ``generator``, each worker's to torch, numpy and
    ``random`` states); nothing nests deeper than :data:`MAX_DEPTH`, which is checked
    without recursion.

    Args:
        state: what ``DataLoader.state_dict()`` returned.
        workers: the loader's ``num_workers``.
        iterable: whether its dataset is an ``IterableDataset``.
        total: the batch count of the epoch the state resumes, as the loader plans it
            (None: not known before it samples; :func:`within` checks it then).
        generator: the loader's ``generator`` (None: torch's global one).

    Raises:
        ValueError: naming the field (its path in the state, ``state['yielded'][1]``),
            what it holds and what was expected: ``state`` is not such a dict (or one of
            another layout version), a field is missing, unknown, of the wrong type, out
            of bounds or does not decode, it names a worker beyond its own
            ``num_workers``, or it is an iterable dataset's saved with another
            ``num_workers`` (each worker's position lies in its own share of the
            dataset).
    """
    _check_depth(state)
    _version(state)
    saved = _num_workers(state, workers, iterable)
    batches, reseed = _epoch(state, total, generator)
    found = _worker_rngs(_field(state, "state", "workers"), saved)
    yielded = _parts(state, saved, iterable, batches, total)
    places = places_of(state, found)
    if saved != workers:  # a map-style state resumes by the batches it yielded alone
        found, places = {}, {}
    return {**state, "reseed": reseed, "workers": found, "places": places,
            "yielded": yielded}


def within(resume: dict[str, Any], total: int) -> Batches:
    """The batches a checked state (:func:`checked`) records as yielded, checked against
    the epoch it resumes as the loader sampled it (``total`` batches; a sampler without
    ``len()`` is known only then).

    Raises:
        ValueError: the state's ``batches`` or ``yielded`` lie past that epoch.
    """
    epoch = f"the {total} batches of the epoch it resumes, as this loader sampled it"
    if resume["batches"] > total:
        _refuse("state['batches']", f"is {resume['batches']}",
                f"an int from 0 to {total}, {epoch}")
    done: Batches = resume["yielded"]
    ranges = done.ranges()
    if ranges and ranges[-1][1] > total:
        _refuse("state['yielded']", f"has the range {ranges[-1]}",
                f"[first, end) ranges with end <= {total}, {epoch}")
    return done


def epoch_batches(loader: Any) -> int | None:
    """The batch count of a map-style loader's epoch as it is known before it samples:
    ``len()`` of its index sampler (what torch's ``len(loader)`` says); None for an
    iterable dataset or a sampler without ``len()`` (:func:`within` checks a state
    against the sampled epoch then)."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return len(loader._index_sampler)
    except (TypeError, NotImplementedError):
        return None


def _version(state: Any) -> None:
    """Refuse ``state`` unless it is a dict of this layout's :data:`VERSION`
    (``state['zloader_torch']``)."""
    if not isinstance(state, dict):
        _refuse("state", f"is {_shown(state)}",
                "the dict zloader.torch.DataLoader.state_dict() returned")
    version = state.get("zloader_torch", _MISSING)
    if _is_int(version) and version != VERSION:
        raise ValueError(f"this state has layout version {version} and this zloader reads "
                         f"version {VERSION}: it was saved by another zloader version")
    if version != VERSION or not _is_int(version):
        _refuse("state['zloader_torch']", _held(version),
                f"{VERSION}: state must be what zloader.torch.DataLoader.state_dict() "
                "returned")


def _num_workers(state: dict[str, Any], workers: int, iterable: bool) -> int:
    """``state['num_workers']``, the saving loader's, checked: an iterable dataset's state
    resumes only with the same ``workers``."""
    saved = _int(state, "state", "num_workers", 0, _INT64_MAX,
                 "the num_workers of the loader that saved the state")
    if iterable and saved != workers:
        raise ValueError(
            f"this state of an iterable dataset was saved with num_workers={saved} "
            f"and this loader has num_workers={workers}: each worker's position lies in "
            "its own share of the dataset (its get_worker_info()), so it resumes only with "
            "the same num_workers")
    return saved


def _epoch(state: dict[str, Any], total: int | None,
           generator: torch.Generator | None) -> tuple[int, bool]:
    """Check what ``state`` records of its epoch (``batches``, within ``total`` when
    known; the sampler's ``rng``, a state of ``generator``; ``base_seed``, ``reseed``,
    ``finished``); return its ``batches`` and ``reseed``."""
    epoch = "the batches of the epoch it resumes" if total is None else \
        f"the {total} batches of the epoch it resumes, as this loader plans it"
    batches = _int(state, "state", "batches", 0,
                   _INT64_MAX if total is None else total, epoch)
    _rng(_field(state, "state", "rng"), "state['rng']", generator)
    base_seed = _field(state, "state", "base_seed")
    if base_seed is not None:
        _int(state, "state", "base_seed", 0, _INT64_MAX,
             "None or the base seed the epoch drew (an int64)")
    reseed = _bool(state, "state", "reseed", "whether the epoch drew its base seed")
    if _bool(state, "state", "finished", "whether the epoch had ended") and batches:
        _refuse("state['finished']", f"is True with {batches} batches yielded",
                "False, or 0 batches: a finished epoch's state resumes at the next epoch")
    return batches, reseed


def _parts(state: dict[str, Any], saved: int, iterable: bool, batches: int,
           total: int | None) -> Batches:
    """Check the fields of ``state`` that depend on its dataset's kind and its ``saved``
    num_workers (``yielded``, ``_snapshot``, or the top-level ``dataset_state`` and
    ``fetcher_state``) and that it has no key its layout lacks; return the batches it
    records as yielded."""
    keys = ["zloader_torch", "num_workers", "rng", "batches", "base_seed", "reseed",
            "finished", "workers"]
    yielded = Batches([[0, batches]] if batches else [])
    if saved and not iterable:
        keys.append("yielded")
        yielded = _yielded(_field(state, "state", "yielded"), batches, total)
    if saved:
        keys.append("_snapshot")
        _snapshot(_field(state, "state", "_snapshot"), saved, iterable, batches)
    elif iterable:
        keys += ["dataset_state", "fetcher_state"]
        _field(state, "state", "dataset_state")
        _fetcher(_field(state, "state", "fetcher_state"), "state['fetcher_state']")
    _only(state, "state", keys, "a state of a"
          f"{'n iterable' if iterable else ' map-style'} dataset saved with "
          f"num_workers={saved}")
    return yielded


def _check_depth(state: Any) -> None:
    """Refuse ``state`` if its dicts, lists, tuples and sets nest deeper than
    :data:`MAX_DEPTH` (or hold themselves); walked without recursion, each container
    once at its deepest place."""
    containers = (dict, list, tuple, set, frozenset)
    deepest: dict[int, int] = {}
    todo: list[tuple[Any, tuple[Any, ...]]] = [(state, ())]
    while todo:
        value, keys = todo.pop()
        if len(keys) > MAX_DEPTH:
            shown = "".join(f"[{k!r:.30}]" for k in keys[:6])
            _refuse(f"state{shown}...", f"nests deeper than {MAX_DEPTH} levels (or holds "
                    "itself)", f"a state at most {MAX_DEPTH} levels deep")
        if deepest.get(id(value), -1) >= len(keys):
            continue
        deepest[id(value)] = len(keys)
        items: Iterable[tuple[Any, Any]] = (
            value.items() if isinstance(value, dict)
            else enumerate(value) if isinstance(value, (list, tuple))
            else ((None, v) for v in value))
        todo.extend((v, (*keys, k)) for k, v in items if isinstance(v, containers))


def _refuse(path: str, wrong: str, expected: str) -> NoReturn:
    raise ValueError(f"{path} {wrong}: expected {expected}")


def _shown(value: Any) -> str:
    return _SHOWN.repr(value)


def _held(value: Any) -> str:
    return "is missing" if value is _MISSING else f"is {_shown(value)}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(parent: dict[str, Any], path: str, key: str) -> Any:
    """``parent[key]``, refused when missing."""
    value = parent.get(key, _MISSING)
    if value is _MISSING:
        _refuse(f"{path}[{key!r}]", "is missing",
                "it in a state zloader.torch.DataLoader.state_dict() returned")
    return value


def _int(parent: dict[str, Any], path: str, key: str, low: int, high: int,
         what: str) -> int:
    value = _field(parent, path, key)
    if not (_is_int(value) and low <= value <= high):
        _refuse(f"{path}[{key!r}]", _held(value),
                f"an int (not a bool) from {low} to {high}, {what}")
    return int(value)


def _bool(parent: dict[str, Any], path: str, key: str, what: str) -> bool:
    value = _field(parent, path, key)
    if not isinstance(value, bool):
        _refuse(f"{path}[{key!r}]", _held(value), f"a bool, {what}")
    return value


def _only(mapping: dict[Any, Any], path: str, keys: list[str], what: str) -> None:
    """Refuse a key of ``mapping`` not in ``keys`` (the layout's)."""
    for key in mapping:
        if key not in keys:
            _refuse(path, f"has the key {_shown(key)}", f"only {', '.join(keys)} in {what}")


def _dict(value: Any, path: str, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        _refuse(path, _held(value), f"a dict, {what}")
    return value


def _b64(text: Any, path: str, what: str) -> bytes:
    if not isinstance(text, str):
        _refuse(path, _held(text), f"a str, {what}")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error
        _refuse(path, f"is not base64 ({exc})", what)


def _rng(text: Any, path: str, generator: torch.Generator | None) -> None:
    """Refuse the sampler's random state ``text`` unless it decodes to a state of
    ``generator`` (None: torch's global one)."""
    what = "the base64 random state of the loader's generator that state_dict() saved"
    data = _b64(text, path, what)
    current = generator.get_state() if generator is not None else torch.get_rng_state()
    if len(data) != current.numel():
        _refuse(path, f"decodes to {len(data)} bytes", f"{current.numel()}: {what}")
    probe = torch.Generator(device=generator.device if generator is not None else "cpu")
    try:
        probe.set_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except (RuntimeError, ValueError, TypeError) as exc:
        _refuse(path, f"is not a random state of this generator ({exc})", what)


def _worker_rngs(value: Any, saved: int) -> dict[int, bytes]:
    """The workers' packed random states of ``state['workers']``, each decoded and tried."""
    path = "state['workers']"
    what = f"{{'<worker>': base64 random state}} for the state's {saved} workers"
    found = {}
    for key, text in _dict(value, path, what).items():
        if not (isinstance(key, str) and re.fullmatch("0|[1-9][0-9]*", key)
                and int(key) < saved):
            _refuse(path, f"holds {key!r}", f"the keys '0' .. '{saved - 1}', the workers of "
                    f"the state's num_workers={saved}" if saved else
                    "no keys: the state was saved with num_workers=0")
        where = f"{path}[{key!r}]"
        data = _b64(text, where, "a worker's base64 random state that state_dict() saved")
        try:
            torch_state, numpy_state, py_state = unpack_rng(data)
            if not (0 <= numpy_state[2] <= 624 and numpy_state[3] in (0, 1)):
                raise ValueError("numpy's position out of range")
            torch.Generator().set_state(torch.frombuffer(bytearray(torch_state),
                                                         dtype=torch.uint8))
            np.random.RandomState().set_state(numpy_state)
            random.Random().setstate(py_state)
        except (RuntimeError, ValueError, TypeError) as exc:
            _refuse(where, f"does not decode ({exc})",
                    "a worker's packed torch, numpy and random states, as state_dict() "
                    "saved them")
        found[int(key)] = data
    return found


def _yielded(ranges: Any, batches: int, total: int | None) -> Batches:
    """The batches ``state['yielded']`` records: sorted, disjoint ``[first, end)`` ranges of
    batch numbers of the epoch (``total`` batches, when known) that hold ``batches``."""
    path = "state['yielded']"
    if not isinstance(ranges, list):
        _refuse(path, _held(ranges), "a list of sorted, disjoint [first, end) ranges of "
                f"the batch numbers yielded ({batches})")
    at, count = 0, 0
    high = f"end <= {total}, the batches of the epoch it resumes, as this loader plans it" \
        if total is not None else f"end <= {_INT64_MAX}"
    for index, pair in enumerate(ranges):
        if not (isinstance(pair, list) and len(pair) == 2 and all(map(_is_int, pair))
                and at <= pair[0] < pair[1] <= (_INT64_MAX if total is None else total)):
            _refuse(f"{path}[{index}]", _held(pair),
                    f"[first, end) of ints (not bools), {at} <= first < end, sorted, "
                    f"disjoint and not touching the range before; {high}")
        at, count = pair[1] + 1, count + pair[1] - pair[0]
    if count != batches:
        _refuse(path, f"holds {count} batches", f"the {batches} of state['batches']")
    return Batches(ranges)


def _snapshot(value: Any, saved: int, iterable: bool, batches: int) -> None:
    """Check ``state['_snapshot']``: a snapshot per worker of the state's ``saved``, as
    :func:`layout` writes them."""
    path = "state['_snapshot']"
    _dict(value, path, "the workers' snapshots")
    snapshots = _dict(_field(value, path, "_worker_snapshots"),
                      f"{path}['_worker_snapshots']", "{'worker_<i>': snapshot}")
    path += "['_worker_snapshots']"
    for key in snapshots:  # then each of worker_0 .. is there: at most one more is read
        number = re.fullmatch("worker_(0|[1-9][0-9]*)", key) if isinstance(key, str) else None
        if number is None or int(number[1]) >= saved:
            _refuse(path, f"has the key {_shown(key)}", f"only worker_0 .. worker_"
                    f"{saved - 1} in one per worker of the state's num_workers={saved}")
    since_all = 0
    for worker in range(saved):
        name = f"worker_{worker}"
        where = f"{path}[{name!r}]"
        entry = _dict(_field(snapshots, path, name), where, "a worker's snapshot")
        _only(entry, where, list(_ENTRY_KEYS), "a worker's snapshot")
        _int(entry, where, "worker_id", worker, worker, f"the worker's number, {worker}")
        _field(entry, where, "dataset_state")
        fetcher = _field(entry, where, "fetcher_state")
        if iterable:
            _fetcher(fetcher, f"{where}['fetcher_state']")
            since = _int(entry, where, "since", 0, batches - since_all,
                         f"the worker's batches among the {batches} yielded "
                         f"({since_all} are other workers')")
            since_all += since
        else:
            if fetcher is not None:
                _refuse(f"{where}['fetcher_state']", _held(fetcher),
                        "None: a map-style dataset's worker has no iterator")
            _int(entry, where, "since", 0, 0,
                 "a map-style dataset's workers make no batch again on resume")
    _only(value, "state['_snapshot']", list(_SNAPSHOT_KEYS), "a state's _snapshot")
    last = _field(value, "state['_snapshot']", "_last_yielded_worker_id")
    if last is not None and not (_is_int(last) and 0 <= last < saved):
        _refuse("state['_snapshot']['_last_yielded_worker_id']", _held(last),
                f"None or a worker of the state's num_workers={saved} (0 .. {saved - 1})")


def _fetcher(value: Any, path: str) -> None:
    """Check a ``fetcher_state``: None, or torchdata's ``{dataset_iter_state,
    fetcher_ended}``."""
    if value is None:
        return
    _dict(value, path, f"None or {{{', '.join(_FETCHER_KEYS)}}}")
    _only(value, path, list(_FETCHER_KEYS), "a fetcher_state")
    _field(value, path, "dataset_iter_state")
    _bool(value, path, "fetcher_ended", "whether the worker's iterator had ended")


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
