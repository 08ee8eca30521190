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
import torch
import torch.utils.data

from zloader.errors import Timeout, WorkerExited
from zloader.loader import Loader
from zloader.torch.failures import Failed, rebuild, torch_words
from zloader.torch.states import Place

if TYPE_CHECKING:
    from zloader.torch.dataloader import DataLoader

_NONE = object()


@dataclass
class Progress:
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


class Pass:
    """An iterator of a :class:`DataLoader`: one epoch's batches, counted; with a Loader
    of its own (``persistent_workers=False``), which it closes when the epoch ends, on an
    error, on :meth:`close` or when it is garbage collected."""

    def __init__(self, owner: DataLoader, batches: Iterator[Any], progress: Progress,
                 loader: Loader | None, sampling: Sampling | None) -> None:
        self._owner = owner  # the DataLoader lives while its iterators do, as in torch
        self._batches: Iterator[Any] | None = batches
        self._progress = progress
        self._loader = loader
        self._sampling = sampling
        self._counted = 0  # batches yielded, as torch counts them (not failures)
        self._reported = owner.reported_length()

    def __iter__(self) -> Pass:
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
        if self._sampling is not None:
            self._sampling.pull()  # as torch does for each batch it receives
        if isinstance(batch, Failed):  # this batch's; the next next() goes on
            raise batch.error
        self._counted += 1
        if self._owner.num_workers and self._reported is not None \
                and self._counted > self._reported:
            warnings.warn(_too_many(self._owner.dataset, self._reported, self._counted),
                          stacklevel=2)
        return batch

    def restart(self, batches: Iterator[Any], progress: Progress, loader: Loader | None,
                sampling: Sampling | None) -> None:
        """Go on with a new epoch (``iter()`` of a loader with persistent workers)."""
        self.end_epoch()
        self._batches, self._progress, self._loader = batches, progress, loader
        self._sampling = sampling
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


def draws_only_from(index_sampler: Any, generator: torch.Generator | None) -> bool:
    """Whether ``index_sampler`` is one of torch's, drawing from ``generator`` (None:
    torch's global one) alone, so that :class:`Sampling` can run it twice."""
    data = torch.utils.data
    sampler = index_sampler
    if type(index_sampler) is data.BatchSampler:
        sampler = index_sampler.sampler
    return (type(sampler) in (data.RandomSampler, data.SubsetRandomSampler,
                              data.WeightedRandomSampler)
            and sampler.generator is generator)


class Sampling:
    """An epoch's sampled batches, known at once, while the random state moves as torch
    moves it. Torch pulls batches from its sampler as it goes (``prefetch_factor *
    num_workers`` at ``iter()``, then one per batch received), and a sampler may draw at
    any pull (``RandomSampler`` draws one more permutation as it ends): with two live
    iterators, or an iterator left early, those draws decide what the others sample. So
    :attr:`batches` come from a second iterator of the sampler, run at once from the same
    random state, which is then put back; the first is pulled as torch pulls its own.
    (Only for torch's random samplers on the loader's generator: other samplers are run
    once, at ``iter()``, which is torch's order whenever one iterator runs at a time.)"""

    def __init__(self, owner: DataLoader, indices: Iterator[Any], ahead: int) -> None:
        start = owner._rng()
        self.batches = list(iter(owner._index_sampler))
        owner._set_rng(start)
        self._indices: Iterator[Any] | None = indices
        for _ in range(ahead):
            self.pull()

    def pull(self) -> None:
        """Pull one batch from the sampler (its values are those of :attr:`batches`)."""
        if self._indices is not None and next(self._indices, _NONE) is _NONE:
            self._indices = None


class Intake:
    """A pass's records from its workers (dicts with ``"w"``, the worker; see
    ``BatchSource``), read one at a time. A worker's first record of the epoch, its
    start (its snapshot before its first batch), is applied to its :class:`Place` as it
    arrives; :meth:`settle` reads ahead (keeping what it read) until every worker sent
    its start, which ``iter()`` waits for, so that ``state_dict()`` knows where each
    worker began and a worker's failure to start (``worker_init_fn`` raised) raises
    there, as in torchdata's ``StatefulDataLoader``."""

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
            self._ahead.append(record)

    def next(self) -> dict[str, Any] | None:
        """The next record that is not a start, None when there are no more."""
        return self._ahead.popleft() if self._ahead else self._read()

    def _read(self) -> dict[str, Any] | None:
        while True:
            record = next(self._records, None)
            if record is None:
                return None
            worker = record.get("w") if isinstance(record, dict) else None
            if not (isinstance(worker, int) and 0 <= worker < self._workers):
                raise RuntimeError(f"a DataLoader worker sent a record out of place: "
                                   f"{record!r:.80}")
            if "start" not in record:
                if "end" in record:
                    self._progress.control[0] += 1
                return record
            self._progress.control[0] += 1
            place = self._progress.places[worker]
            if not place.started:
                place.started = True
                if place.since == 0:  # the worker's snapshot before its first batch
                    place.snapshot, place.rng = record["start"], bytes(record["rng"])


def ordered(intake: Intake, firsts: list[int], progress: Progress,
            workers: int) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A map-style dataset's batches in the order of ``j``, worker ``w``'s from
    ``firsts[w]`` on (a resumed epoch's first batch may not be worker 0's, and a state
    saved out of order resumes each worker where it was), a failed one as its
    :class:`Failed`; each with the mark that records its worker's random state, snapshot
    and next batch once it is handed out."""
    pending: dict[int, dict[str, Any]] = {}
    want = min(firsts) if firsts else 0

    def absent() -> bool:  # batch ``want`` is not this epoch's to make: resumed past it
        return want < firsts[want % workers]

    while (record := intake.next()) is not None:
        pending[_number(record)] = record
        while absent() or want in pending:
            if not absent():
                yield _handed(pending.pop(want), progress, workers)
            want += 1
    if pending:
        raise RuntimeError(f"the DataLoader's workers did not send batch {want}")


def arrived(intake: Intake, progress: Progress,
            workers: int) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A map-style dataset's batches in the order they arrive (``in_order=False``), a
    failed one as its :class:`Failed`, each with its mark (see :func:`ordered`)."""
    while (record := intake.next()) is not None:
        _number(record)
        yield _handed(record, progress, workers)


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


def _handed(record: dict[str, Any], progress: Progress,
            workers: int) -> tuple[Any, Callable[[], None]]:
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
            place.next_batch = j + workers
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
                    yield _handed(record, self._progress, self._workers)
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
            yield _handed(record, self._progress, self._workers)


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
                 firsts: list[int], resumed: dict[int, bytes] | None,
                 places: dict[int, Place] | None = None) -> list[dict[str, Any]]:
    """What each worker gets for an epoch: ``common`` (seeds and the like), its random
    state when resumed (``resumed``: one per worker index, none for one as seeded) and,
    for a map-style dataset, its own share of the epoch's sampled ``batches`` (all of
    them, from batch 0) from its first batch ``firsts[w]`` on: batch ``j`` is worker
    ``j mod workers``'s (as in torch), so worker ``w`` gets batches ``firsts[w],
    firsts[w] + workers, ...`` as ``flat`` (their indices, int64 when all are ints),
    ``offsets`` (int64, where each batch starts in ``flat``), ``first`` and ``step``
    (``workers``). For an iterable dataset, ``places`` (a resumed epoch's) gives each
    worker the snapshot to restore and the batches to make again (``resume``)."""
    workers = len(firsts)
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
            own = batches[firsts[worker]::workers]
            groups = [list(b) if batched else [b] for b in own]
            offsets = np.zeros(len(groups) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(g) for g in groups])
            flat: Any = [i for g in groups for i in g]
            if all(isinstance(i, int) for i in flat):
                flat = np.asarray(flat, dtype=np.int64)
            plan.update(flat=flat, offsets=offsets, batched=batched,
                        first=firsts[worker], step=workers)
        plans.append(plan)
    return plans


def firsts_from(skip: int, workers: int, places: dict[int, Place] | None) -> list[int]:
    """Each worker's first batch number in an epoch resumed after ``skip`` batches: the
    first ``j >= skip`` that is its (``j mod workers``), or where its place says it was
    (a state saved with batches in completion order)."""
    firsts = [skip + (worker - skip) % workers for worker in range(workers)]
    for worker, place in (places or {}).items():
        if worker < workers and place.next_batch is not None:
            firsts[worker] = place.next_batch
    return firsts


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

