"""A DataLoader's iterators (passes): one epoch's batches, counted; the epoch's sampling
as torch samples; the batches put back in order."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils.data

from zloader.errors import Timeout, WorkerExited
from zloader.loader import Loader
from zloader.torch.failures import Failed, rebuild, torch_words

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
            batch = next(self._batches)
        except StopIteration:
            self._progress.finished = True
            self.close()
            raise
        except Exception as exc:
            if self._owner.num_workers == 0:  # torch's own iterator: it goes on after
                self._progress.yielded += 1
                raise
            self.close()
            timeout = self._owner.timeout
            if isinstance(exc, Timeout) and timeout:
                raise Timeout(f"DataLoader timed out after {timeout} seconds") from exc
            if isinstance(exc, WorkerExited):  # torch's words; the cause says how and where
                raise WorkerExited(torch_words(exc), exc.pids, exc.codes) from exc
            raise
        except BaseException:
            self.close()
            raise
        self._progress.yielded += 1
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


def ordered(records: Iterator[Any], first: int, progress: Progress,
            workers: int) -> Iterator[Any]:
    """The batches of map-style records (see :func:`_checked`) in the order of ``j`` from
    ``first`` (a resumed epoch's first batch may not be worker 0's), a failed one as its
    :class:`Failed`; each batch's random state goes into ``progress`` as it is yielded."""
    pending: dict[int, tuple[bytes | memoryview, Any]] = {}
    want = first
    for record in records:
        j, state, batch = _checked(record, want)
        pending[j] = (state, batch)
        while want in pending:
            state, batch = pending.pop(want)
            if len(state):
                progress.workers[want % workers] = bytes(state)
            want += 1
            yield batch
    if pending:
        raise RuntimeError(f"the DataLoader's workers did not send batch {want}")


def arrived(records: Iterator[Any], progress: Progress, workers: int) -> Iterator[Any]:
    """The batches of records in the order they arrive (``in_order=False``; iterable
    datasets, whose workers' turns the Loader keeps), a failed one as its :class:`Failed`."""
    for record in records:
        j, state, batch = _checked(record, -1)
        if len(state):
            progress.workers[j % workers] = bytes(state)
        yield batch


def _checked(record: Any, least: int) -> tuple[int, bytes | memoryview, Any]:
    """``(j, state, batch)`` of a worker's record ``(j, random state after it or b"",
    batch)`` or ``(j, state, None, failure)``, whose batch becomes a :class:`Failed`.

    Raises:
        RuntimeError: the record is neither, or its ``j`` is below ``least``.
    """
    if not (isinstance(record, tuple) and len(record) in (3, 4)
            and isinstance(record[0], int) and record[0] >= least
            and isinstance(record[1], (bytes, memoryview))):
        raise RuntimeError(f"a DataLoader worker sent a batch out of place: {record!r:.80}")
    if len(record) == 4:
        return record[0], record[1], rebuild(record[3])
    return record[0], record[1], record[2]


def _too_many(dataset: Any, reported: int, counted: int) -> str:
    """torch's warning for an iterable dataset that yields more than its ``len()``."""
    return (f"Length of IterableDataset {dataset} was reported to be {reported}(when "
            f"accessing len(dataloader)), but {counted} samples have been fetched. For "
            "multiprocessing data-loading, this could be caused by not properly configuring "
            "the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for "
            "examples.")


def worker_plans(common: dict[str, Any], batches: list[Any] | None, batched: bool,
                 first: int, workers: int, resumed: dict[int, bytes] | None
                 ) -> list[dict[str, Any]]:
    """What each worker gets for an epoch: ``common`` (seeds and the like), its random
    state when resumed (``resumed``: one per worker index, none for one as seeded) and,
    for a map-style dataset, its own share of the epoch's sampled ``batches`` from batch
    ``first`` on: batch ``j`` is worker ``j mod workers``'s (as in torch), so worker ``w``
    gets batches ``j0, j0 + workers, ...`` as ``flat`` (their indices, int64 when all are
    ints), ``offsets`` (int64, where each batch starts in ``flat``), ``first`` (``j0``)
    and ``step`` (``workers``)."""
    plans = []
    for worker in range(workers):
        plan = dict(common)
        if resumed is not None:
            plan["rng"] = resumed.get(worker, b"")
        if batches is not None:
            own = batches[(worker - first) % workers::workers]
            groups = [list(b) if batched else [b] for b in own]
            offsets = np.zeros(len(groups) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(g) for g in groups])
            flat: Any = [i for g in groups for i in g]
            if all(isinstance(i, int) for i in flat):
                flat = np.asarray(flat, dtype=np.int64)
            plan.update(flat=flat, offsets=offsets, batched=batched,
                        first=first + (worker - first) % workers, step=workers)
        plans.append(plan)
    return plans


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

