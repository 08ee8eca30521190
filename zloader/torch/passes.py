"""A DataLoader's iterators (passes): one epoch's batches, counted; the epoch's sampling
as torch samples; the batches put back in order."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.utils.data

from zloader._byfields import ByFields
from zloader.errors import Timeout, WorkerExited
from zloader.loader import Loader
from zloader.torch import states
from zloader.torch.failures import Failed, rebuild, torch_words
from zloader.torch.feed import Dispatcher
from zloader.torch.states import Batches, Place

if TYPE_CHECKING:
    from zloader.torch.dataloader import DataLoader

_NONE = object()
_START = {"start": None}  # what Intake._read returns for a start record


@dataclass(eq=False, repr=False)
class Progress(ByFields):
    """Where a pass stands: the sampler's random state it started from, whether it drew a
    base seed from it, the batches it yielded (those it skipped when resumed included), and
    the random state of each worker after its last batch yielded (a worker not in it is as
    seeded)."""

    rng: str
    yielded: int
    finished: bool = False
    reseeded: bool = True  # the pass drew a base seed and seeded its workers afresh
    workers: dict[int, bytes] = field(default_factory=dict)
    loader: Loader | None = None  # the pass's Loader, for stats()
    places: dict[int, Place] = field(default_factory=dict)  # each worker's, see states
    last: int | None = None  # the worker whose batch was yielded last
    inline: Any = None  # num_workers=0, an iterable dataset: torch's fetcher of the epoch
    control: list[int] = field(default_factory=lambda: [0])  # start/end records read
    done: Batches = field(default_factory=Batches)  # a map-style epoch's batches yielded


class EpochIterator:
    """An iterator of a :class:`DataLoader`: one epoch's batches, counted; with a Loader
    of its own (``persistent_workers=False``), which it closes when the epoch ends, on an
    error, on :meth:`close` or when it is garbage collected."""

    def __init__(self, owner: DataLoader, batches: Iterator[Any], progress: Progress,
                 loader: Loader | None) -> None:
        self._owner = owner  # the DataLoader lives while its iterators do, as in torch
        self._batches: Iterator[Any] | None = batches
        self._progress = progress
        self._loader = loader
        self._counted = 0  # batches yielded, as torch counts them (not failures)
        self._reported = owner.reported_length()

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self._owner)

    @property
    def _workers(self) -> list[WorkerHandle]:
        """The worker processes of this pass's Loader, as torch's iterator lists its own
        (a private attribute some tools read): each with ``pid``, ``is_alive()``,
        ``join(timeout)`` and ``exitcode``. Empty without local workers."""
        loader = self._progress.loader
        processes = getattr(loader, "_processes", []) if loader is not None else []
        return [WorkerHandle(process) for process in processes]

    def __next__(self) -> Any:
        if self._batches is None:
            raise StopIteration
        try:
            batch, mark = next(self._batches)
        except StopIteration:
            self._progress.finished = True
            self.close()
            raise
        except Exception as exc:
            if self._owner.num_workers == 0:  # torch's own iterator: it goes on after
                self._progress.yielded += 1
                raise
            self.close()
            worded = in_torch_words(exc, self._owner.timeout)
            if worded is not None:
                raise worded from exc
            raise
        except BaseException:
            self.close()
            raise
        self._progress.yielded += 1
        if mark is not None:
            mark()  # the batch's worker's place, now that the batch is handed out
        if isinstance(batch, Failed):  # this batch's; the next next() goes on
            raise batch.error
        self._counted += 1
        if self._owner.num_workers and self._reported is not None \
                and self._counted > self._reported:
            warnings.warn(_too_many(self._owner.dataset, self._reported, self._counted),
                          stacklevel=2)
        return batch

    def restart(self, batches: Iterator[Any], progress: Progress, loader: Loader | None
                ) -> None:
        """Go on with a new epoch (``iter()`` of a loader with persistent workers)."""
        self.end_epoch()
        self._batches, self._progress, self._loader = batches, progress, loader
        self._counted, self._reported = 0, self._owner.reported_length()

    def end_epoch(self) -> None:
        """Stop reading the epoch under way (and the thread that pins its batches)."""
        batches, self._batches = self.__dict__.get("_batches"), None
        close = getattr(batches, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """End this pass: no more batches; its own workers stop."""
        self.end_epoch()
        loader, self._loader = self.__dict__.get("_loader"), None
        if loader is not None:
            loader.close()

    def __del__(self) -> None:
        self.close()


def in_torch_words(exc: BaseException, timeout: float) -> BaseException | None:
    """The error torch raises for ``exc`` (a Loader's timeout with ``timeout`` set, a dead
    worker), whose cause ``exc`` says how and where; None: ``exc`` is raised as it is."""
    if isinstance(exc, Timeout) and timeout:
        return Timeout(f"DataLoader timed out after {timeout} seconds")
    if isinstance(exc, WorkerExited):
        return WorkerExited(torch_words(exc), exc.pids, exc.codes)
    return None


class WorkerHandle:
    """A Loader's worker process, with the part of ``multiprocessing.Process``'s interface
    that users of torch's ``_workers`` call."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout)

    def terminate(self) -> None:
        if self.is_alive():
            self._process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.is_alive():
            self._process.send_signal(signal.SIGKILL)

    @property
    def exitcode(self) -> int | None:
        return self._process.poll()


def starts_with_first_batch(dataset: Any, iterable: bool, forked: bool, fresh: bool) -> bool:
    """Whether a pass's workers send their start with their first batch (its
    ``"first"``): ``fresh``ly ``forked`` workers of a map-style dataset that keeps no
    state. They say when they have started (seeded, ``worker_init_fn`` run), which
    ``iter()`` waits for only where it may fail (:func:`may_fail_to_start`), so that the
    first batch waits for worker 0 alone (``Loader.prepared``); such a worker's start
    snapshot is the one a state records for a worker not yet started."""
    return forked and fresh and not iterable and not states.is_stateful(dataset)


def may_fail_to_start(dataset: Any, worker_init_fn: Any) -> bool:
    """Whether a worker's start may raise (a ``worker_init_fn``, a datapipe's sharding),
    which ``iter()`` then waits for, as torchdata's ``StatefulDataLoader`` does."""
    return worker_init_fn is not None or isinstance(
        dataset, (torch.utils.data.IterDataPipe, torch.utils.data.MapDataPipe))


class Intake:
    """A pass's records from its workers (dicts with ``"w"``, the worker; see
    ``BatchSource``), read one at a time. A worker's start (its snapshot before its first
    batch: its first record of the epoch, or that record's ``"first"``) is applied to its
    :class:`Place` as it arrives; :meth:`settle` reads ahead (keeping what it read) until
    every worker sent its start, which ``iter()`` waits for, so that ``state_dict()``
    knows where each worker began and a worker's failure to start (``worker_init_fn``
    raised) raises there, as in torchdata's ``StatefulDataLoader``; unless the workers'
    starts are reported otherwise (``Loader.prepared``) and hold nothing a state needs
    (a map-style dataset that keeps no state: its start with its first batch)."""

    def __init__(self, records: Iterator[Any], progress: Progress, workers: int) -> None:
        self._records = records
        self._progress = progress
        self._workers = workers
        self._ahead: deque[dict[str, Any]] = deque()
        for worker in range(workers):
            progress.places.setdefault(worker, Place())

    def settle(self) -> None:
        """Read records until every worker sent its start (or no more come)."""
        places = self._progress.places
        while any(not places[w].started for w in range(self._workers)):
            record = self._read()
            if record is None:
                return
            if record is not _START:
                self._ahead.append(record)

    def next(self) -> dict[str, Any] | None:
        """The next record that is not a start, None when there are no more."""
        if self._ahead:
            return self._ahead.popleft()
        while (record := self._read()) is _START:
            pass
        return record

    def _read(self) -> dict[str, Any] | None:
        """The next record, or ``_START`` for a start (applied to its worker's place)."""
        record = next(self._records, None)
        if record is None:
            return None
        worker = record.get("w") if isinstance(record, dict) else None
        if not (isinstance(worker, int) and 0 <= worker < self._workers):
            raise RuntimeError(f"a DataLoader worker sent a record out of place: "
                               f"{record!r:.80}")
        first = record.get("first")  # (a start that came with the first batch, or end)
        if isinstance(first, dict):
            self._started(worker, first)
        if "start" not in record:
            if "end" in record:
                self._progress.control[0] += 1
            return record
        self._progress.control[0] += 1
        self._started(worker, record)
        return _START

    def _started(self, worker: int, start: dict[str, Any]) -> None:
        """Worker ``worker``'s start (``{"start": snapshot, "rng": random state}``), applied
        to its place."""
        place = self._progress.places[worker]
        if not place.started:
            place.started = True
            if place.since == 0:  # the worker's snapshot before its first batch
                place.snapshot, place.rng = start["start"], bytes(start["rng"])


def ordered(intake: Intake, progress: Progress,
            dispatcher: Dispatcher) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A map-style dataset's batches in the order ``dispatcher`` handed them out (the
    sampler's: all of the epoch's, or a resumed epoch's rest), a failed one as its
    :class:`Failed`; each with the mark that records its worker's random state and
    snapshot, and the batch as yielded, once it is handed out. Each yielded lets
    ``dispatcher`` hand out the next, as torch's iterator does."""
    pending: dict[int, dict[str, Any]] = {}
    sent = dispatcher.sent
    while (record := intake.next()) is not None:
        number = _number(record)
        if not dispatcher.outstanding(number) or number in pending:
            continue  # (made again: its worker's stream of items was sent again)
        pending[number] = record
        while sent and sent[0] in pending:
            number = sent[0]
            record = pending.pop(number)
            dispatcher.received(record["w"], number)
            yield _handed(record, progress)
    if pending or sent or not dispatcher.ended:
        why = f"but not batch {sent[0]}" if sent else "not handed out"
        raise RuntimeError(f"the DataLoader's workers sent batches {sorted(pending)[:5]} "
                           f"{why}")


def arrived(intake: Intake, progress: Progress,
            dispatcher: Dispatcher) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A map-style dataset's batches in the order they arrive (``in_order=False``), a
    failed one as its :class:`Failed`, each with its mark (see :func:`ordered`); each
    received lets ``dispatcher`` hand out the next."""
    while (record := intake.next()) is not None:
        if dispatcher.received(record["w"], _number(record)):
            yield _handed(record, progress)  # (not one made again: received before)


def _number(record: dict[str, Any]) -> int:
    """A map-style batch record's batch number ``j``.

    Raises:
        RuntimeError: the record has none, or one that is not its worker's.
    """
    j = record.get("j")
    if not (isinstance(j, int) and j >= 0 and isinstance(record.get("rng"), (bytes, memoryview))
            and ("batch" in record or "failure" in record)):
        raise RuntimeError(f"a DataLoader worker sent a batch out of place: {record!r:.80}")
    return j


def _handed(record: dict[str, Any], progress: Progress) -> tuple[Any, Callable[[], None]]:
    """A batch record as ``(batch or its Failed, mark)``; the mark records, once the batch
    is handed out, its worker's random state and snapshot, and where it goes on."""
    worker = record["w"]
    batch = rebuild(record["failure"]) if "failure" in record else record.get("batch")
    j = record.get("j")
    rng = bytes(record.get("rng", b""))

    def mark() -> None:
        place = progress.places[worker]
        if j is not None:  # map-style: a random state (empty when unchanged) per batch
            if rng:
                progress.workers[worker] = rng
            progress.done.add(j)
            if "snap" in record:
                place.snapshot = record["snap"]
        elif "snap" in record:  # iterable: a snapshot now and then, batches since
            place.snapshot, place.rng, place.since = record["snap"], rng, 0
        else:
            place.since += 1
        progress.last = worker
    return batch, mark


class Streams:
    """An iterable dataset's batches (see ``BatchSource._iterable``), one from each worker
    in turn as torch yields them (from the worker after ``progress.last``, leaving out
    workers whose iterator ended), or in arrival order (``in_order=False``); each with the
    mark that moves its worker's :class:`Place` once it is handed out."""

    def __init__(self, intake: Intake, progress: Progress, workers: int,
                 in_order: bool) -> None:
        self._intake = intake
        self._progress = progress
        self._workers = workers
        self._in_order = in_order
        self._queues: dict[int, deque[dict[str, Any]]] = {w: deque() for w in range(workers)}

    def __iter__(self) -> Iterator[tuple[Any, Callable[[], None]]]:
        places = self._progress.places
        if not self._in_order:
            while (record := self._intake.next()) is not None:
                if "end" in record:
                    _ended(places[record["w"]], record)
                else:
                    yield _handed(record, self._progress)
            return
        last = self._progress.last
        turn = 0 if last is None else (last + 1) % self._workers
        while True:
            live = [w for w in range(self._workers) if not places[w].ended]
            if not live:
                return
            worker = min(live, key=lambda w: (w - turn) % self._workers)
            queue = self._queues[worker]
            while not queue:
                record = self._intake.next()
                if record is None:
                    raise RuntimeError(f"DataLoader worker {worker} stopped before its "
                                       "iterator ended")
                self._queues[record["w"]].append(record)
            record = queue.popleft()
            turn = worker + 1
            if "end" in record:
                _ended(places[worker], record)
                continue
            yield _handed(record, self._progress)


def _ended(place: Place, record: dict[str, Any]) -> None:
    """A worker's iterator ended: its place is its end snapshot."""
    place.snapshot, place.rng = record["end"], bytes(record["rng"])
    place.since, place.ended, place.started = 0, True, True


def _too_many(dataset: Any, reported: int, counted: int) -> str:
    """torch's warning for an iterable dataset that yields more than its ``len()``."""
    return (f"Length of IterableDataset {dataset} was reported to be {reported}(when "
            f"accessing len(dataloader)), but {counted} samples have been fetched. For "
            "multiprocessing data-loading, this could be caused by not properly configuring "
            "the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for "
            "examples.")


def worker_plans(common: dict[str, Any], batches: list[Any] | None, batched: bool,
                 todo: list[int], workers: int, dispatched: bool,
                 resumed: dict[int, bytes] | None,
                 places: dict[int, Place] | None = None) -> list[dict[str, Any]]:
    """What each worker gets for an epoch: ``common`` (seeds and the like), its random
    state when resumed (``resumed``: one per worker index, none for one as seeded) and,
    for a map-style dataset, the sampled ``batches`` (all of the epoch's) it may make:
    those of ``todo`` (the batch numbers still to yield) that are its own, batch ``j``
    being worker ``j mod workers``'s as in torch, or all of ``todo`` when ``dispatched``
    (``in_order=False``: the consumer hands each to a worker with room, see
    :class:`Dispatcher`); as ``numbers`` (int64, the batch numbers), ``flat`` (their
    indices, int64 when all are ints) and ``offsets`` (int64, where each batch starts in
    ``flat``). For an iterable dataset, ``places`` (a resumed epoch's) gives each worker
    the snapshot to restore and the batches to make again (``resume``)."""
    plans = []
    for worker in range(workers):
        plan = dict(common)
        if resumed is not None:
            plan["rng"] = resumed.get(worker, b"")
        place = (places or {}).get(worker)
        if place is not None and (place.snapshot is not None or place.since or place.ended):
            plan["resume"] = {**(place.snapshot or {}), "since": place.since}
            if place.ended:
                fetcher = dict(plan["resume"].get("fetcher_state") or {})
                plan["resume"]["fetcher_state"] = {**fetcher, "fetcher_ended": True}
        if batches is not None:
            numbers = todo if dispatched else [j for j in todo if j % workers == worker]
            groups = [list(batches[j]) if batched else [batches[j]] for j in numbers]
            offsets = np.zeros(len(groups) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(g) for g in groups])
            flat: Any = [i for g in groups for i in g]
            if all(isinstance(i, int) for i in flat):
                flat = np.asarray(flat, dtype=np.int64)
            plan.update(numbers=np.asarray(numbers, dtype=np.int64), flat=flat,
                        offsets=offsets, batched=batched, dispatched=dispatched)
        plans.append(plan)
    return plans


class Unmarked:
    """Torch's own iterator (``num_workers=0``) as ``(batch, None)`` pairs: what a pass
    reads. It goes on after a batch that raised, as torch's does."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator

    def __iter__(self) -> Unmarked:
        return self

    def __next__(self) -> tuple[Any, None]:
        return next(self._iterator), None


def skipped(iterator: Iterator[Any], skip: int) -> Iterator[Any]:
    """``iterator`` (torch's own) with its first ``skip`` batches read and dropped (a
    failed one too). Not ``itertools.islice``: that ends at the first error, where torch's
    iterator goes on with the next batch."""
    for _ in range(skip):
        try:
            if next(iterator, _NONE) is _NONE:
                break
        except Exception:  # a failed batch before the resumed one: skipped too
            continue
    return iterator

