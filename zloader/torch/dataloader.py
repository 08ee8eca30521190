"""The drop-in ``torch.utils.data.DataLoader`` with zloader's workers."""

from __future__ import annotations

import base64
import copy
import functools
import math
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
import torch.utils.data

from zloader.client.session import PerWorker
from zloader.loader import Loader
from zloader.pipeline import Pipeline
from zloader.torch import permutation, states
from zloader.torch.feed import Dispatcher, Feed, batches_of
from zloader.torch.passes import (
    EpochIterator,
    Intake,
    Progress,
    Streams,
    Unmarked,
    arrived,
    in_torch_words,
    may_fail_to_start,
    ordered,
    skipped,
    starts_with_first_batch,
    worker_plans,
)
from zloader.torch.source import BatchSource
from zloader.torch.states import Batches, Place
from zloader.torch.tensors import Prefetcher, to_torch

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """``torch.utils.data.DataLoader`` with zloader's workers: change the import, keep the
    arguments. A subclass of torch's, built by torch's constructor (every attribute is
    torch's, with torch's assignment rules); iterating is zloader's.

    ``num_workers=0`` loads in this process, exactly as torch does. ``num_workers > 0`` makes
    batches on zloader worker processes (embedded, or the broker's). For a map-style
    dataset the batches are torch's: this loader samples indices with torch's own sampler,
    draws the base seed from ``generator`` as torch does, seeds worker ``i`` with ``base
    seed + i`` (afresh each epoch unless ``persistent_workers``), gives batch ``j`` to
    worker ``j mod num_workers`` and yields batches in order. Iterable datasets see
    ``torch.utils.data.get_worker_info()`` in each worker, so self-sharding keeps working.

    Iterators behave as torch's. Without ``persistent_workers`` each ``iter()`` is a pass
    of its own, with its own workers, which take the dataset as it is at that ``iter()``
    (changes made between epochs are seen) and stop when the pass ends or its iterator is
    dropped; two live iterators are two independent passes. With ``persistent_workers``
    the workers (and the dataset copy they took) last until :meth:`close`, and, as in
    torch, there is one iterator: ``iter()`` returns it, restarted at a new epoch. (An
    epoch left early leaves persistent workers' random states where they had got to, which
    may be further than torch's had: the next epoch samples as torch does, but random
    augmentations in the dataset may then differ from torch's.)

    A batch whose ``__getitem__`` (``__getitems__``, iterator) or ``collate_fn`` raised
    raises in its place, as a :class:`zloader.PipelineError` that is also the original
    type (built-in, or the user's class when this process has imported its module) and
    whose message names the worker and holds the original traceback; the next ``next()``
    goes on with the following batch, as in torch. docs/torch.md lists what still differs.

    Args:
        dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
        pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context,
        generator, prefetch_factor, persistent_workers, pin_memory_device, in_order: as in
            torch 2.13, in torch's order (``prefetch_factor`` on are keyword-only).
            ``timeout > 0``: a batch that takes longer raises ``zloader.Timeout`` (a
            ``RuntimeError``) "DataLoader timed out after N seconds"; ``timeout=0`` means
            no per-batch limit, but a dead or silent worker set still raises (after 60 s).
            ``multiprocessing_context``: local workers fork, or start as ``"spawn"`` (a
            fresh interpreter given the pickled dataset) for ``"spawn"`` and
            ``"forkserver"``. ``in_order=False``: batches in the order they are made.
        snapshot_every_n_steps: as in torchdata's ``StatefulDataLoader``: how often (in
            each worker's batches) an iterable dataset that keeps a state (it, or its
            iterator, has ``state_dict``/``load_state_dict``) is snapshotted for
            :meth:`state_dict`; a resume makes again the batches after the last
            snapshot. 0 or None: only at each epoch's start and end. Default 1.
        broker: a zloader broker address: ``num_workers`` of the broker's workers (wherever
            they run; this process starts none) make the batches, as torch's workers
            ``0 .. num_workers - 1`` would. A pass waits for that many to be free (and
            raises after ``timeout``, or 60 s, without them). Needs ``num_workers > 0``.
        share: not available here (raises ValueError): share a Pipeline through
            :class:`IterableDataset` (``share=True``) instead.
        job_name: a name for the broker's job (shown by ``zloader status``); without
            ``persistent_workers`` each pass is a job of its own, ``job_name.N``.
        device: move each batch to this device (``non_blocking``).
        pack_dataset: forked workers read the dataset's large lists of plain values (its
            ``samples``, ``targets``, a list of paths) from one packed copy in shared
            memory instead of copying them page by page as they read (default True;
            docs/pipeline.md, "Packed datasets"). False: they read the lists themselves,
            as torch's workers do.

    Raises:
        ValueError, TypeError: what torch's DataLoader raises for the same arguments;
            ValueError for ``broker`` with ``num_workers=0``.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: torch.Generator | None = None,
                 *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True,
                 snapshot_every_n_steps: int | None = 1, broker: str | None = None,
                 share: bool = False, job_name: str | None = None,
                 device: str | torch.device | None = None, pack_dataset: bool = True) -> None:
        self._service: Loader | None = None  # persistent_workers: the one Loader
        self._passes: weakref.WeakSet[EpochIterator] = weakref.WeakSet()  # live iterators
        if isinstance(timeout, float) and not math.isfinite(timeout):
            raise ValueError(f"timeout must be a finite number of seconds (0: no per-batch "
                             f"limit), got {timeout!r}")
        if share:
            raise ValueError(
                "share=True is not available for zloader.torch.DataLoader: its batches "
                "follow this loader's own sampler and seeds, so no other trainer's match. "
                "Share a zloader.Pipeline instead: zloader.torch.IterableDataset(pipeline, "
                "share=True, broker=...)")
        # torch validates every argument and builds the sampler and collate function.
        super().__init__(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
            in_order=in_order)
        _check_own_arguments(snapshot_every_n_steps, broker, num_workers)
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.device = torch.device(device) if device is not None else None
        self._broker = broker
        self._job_name = job_name
        self._pack_dataset = pack_dataset
        self._persistent = persistent_workers
        self._iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        self._base_seed: int | None = None
        self._progress: Progress | None = None  # the latest pass's
        self._live: weakref.ref[EpochIterator] | None = None  # persistent_workers: the one
        self._started = 0  # passes started (names the jobs of passes on a broker)
        self._resume: dict[str, Any] | None = None

    @property
    def _prefetch(self) -> int:
        """Batches each worker makes ahead (torch's default 2). Raises AssertionError for
        ``prefetch_factor=0``, as torch's iterator does (0 would mean 2 here)."""
        if self.prefetch_factor is not None and self.prefetch_factor <= 0:
            raise AssertionError(f"prefetch_factor={self.prefetch_factor}: a worker must "
                                 "make at least one batch ahead (torch asserts > 0)")
        return self.prefetch_factor or 2

    def reported_length(self) -> int | None:
        """The ``len()`` an iterable dataset reported through ``len(loader)`` (None: not
        asked, or a map-style dataset), which its passes warn on exceeding, as torch's."""
        if not self._iterable:
            return None
        reported = self._IterableDataset_len_called
        return reported if isinstance(reported, int) else None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        loaded, self._resume = self._resume, None
        resume = None
        if loaded is not None:  # load_state_dict: sample that epoch again, skip what was had
            resume = states.checked(loaded, self.num_workers, self._iterable,
                                    states.epoch_batches(self), self.generator)
            self._set_rng(resume["rng"])
            # An epoch that drew its base seed draws it again, from the same random state,
            # so that the sampler then draws what it drew; one that did not (persistent
            # workers after their first epoch) takes the saved one.
            self._base_seed = None if resume["reseed"] else resume["base_seed"]
        iterator = self._live() if self._live is not None else None
        if iterator is not None:
            iterator.end_epoch()  # before the next starts: the Loader reads one at a time
            iterator.restart(*self._start(resume))
            return iterator
        iterator = EpochIterator(self, *self._start(resume))
        self._passes.add(iterator)
        if self._persistent:
            self._live = weakref.ref(iterator)
        return iterator

    def _start(self, resume: dict[str, Any] | None
               ) -> tuple[Iterator[Any], Progress, Loader | None]:
        """Start a pass (an epoch), at the position of ``resume`` (a checked loaded state,
        or None): its batches (with their marks, see ``passes``), its progress and the
        Loader that is its own (None: no workers, or the persistent one). A map-style
        epoch is sampled as its batches are handed to the workers (``feed``). A resumed
        epoch skips the batches the state had yielded, and every worker takes the random
        state it had then (a worker without one its state as seeded); an iterable
        dataset's workers restore their snapshots (``states``)."""
        skip = resume["batches"] if resume is not None else 0
        places = states.resumed_places(resume, self._iterable, self._persistent,
                                       self.num_workers)
        previous = self._progress
        progress = Progress(rng=self._rng(), yielded=skip)
        self._progress = progress
        if self.num_workers == 0:
            return self._inline(resume, progress), progress, None
        plan, indices = self._plan()
        plan["every"] = self.snapshot_every_n_steps or 0
        if starts_with_first_batch(
                self.dataset, self._iterable,
                forked=self._broker is None and self._start_method() == "fork",
                fresh=not self._persistent or self._service is None):
            plan["start"] = "first"
        progress.reseeded = bool(plan["reseed"])
        workers = self._resumed_workers(resume, places, progress)
        # The workers start before the sampler's first pull, as torch's do: forking them
        # (and their start) overlaps the first permutation drawn here.
        loader, own = self._pass_loader()
        try:  # (a large shuffle moves its generator on once the first batches are out)
            plans, next_batch = self._sampled(own, indices, resume, progress, plan,
                                              workers, places)
            self._carry(progress, previous, workers, bool(plan["reseed"]))
            progress.loader = loader
            intake, dispatcher = self._open(loader, own, plans, progress, next_batch,
                                            plan.get("start") == "first")
        finally:
            permutation.settle()
        batches: Iterator[tuple[Any, Any]]
        if dispatcher is None:
            batches = iter(Streams(intake, progress, self.num_workers, bool(self.in_order)))
        elif self.in_order:
            batches = ordered(intake, progress, dispatcher)
        else:
            batches = arrived(intake, progress, dispatcher)
        return (self._deliver((to_torch(batch), mark) for batch, mark in batches), progress,
                own)

    def _carry(self, progress: Progress, previous: Progress | None,
               workers: dict[int, bytes] | None, reseed: bool) -> None:
        """What a pass's ``progress`` takes from the pass before (``previous``): the
        workers' random states, where they go on (or those it resumes, ``workers``), and a
        persistent Loader's count."""
        if workers is not None:
            progress.workers = dict(workers)
        elif not reseed and previous is not None:  # workers go on where they are
            progress.workers = dict(previous.workers)
        if self._persistent and previous is not None:  # one Loader: its count goes on
            progress.control = previous.control

    def _sampled(self, own: Loader | None, indices: Iterator[Any] | None,
                 resume: dict[str, Any] | None, progress: Progress, plan: dict[str, Any],
                 workers: dict[int, bytes] | None, places: dict[int, Place] | None
                 ) -> tuple[PerWorker, Callable[[], np.ndarray | None] | None]:
        """The pass's plan for each worker and how its batches are dispatched
        (:meth:`_sample`, ``passes.worker_plans``); a failure (the sampler's, a Ctrl-C)
        closes the pass's ``own`` Loader, whose workers have started."""
        try:
            sampled, next_batch, todo = self._sample(indices, resume, progress, plan)
            return PerWorker(worker_plans(plan, sampled, self._auto_collation, todo,
                                          self.num_workers, not self.in_order, workers,
                                          places)), next_batch
        except BaseException:
            if own is not None:
                own.close()
            raise

    def _resumed_workers(self, resume: dict[str, Any] | None,
                         places: dict[int, Place] | None,
                         progress: Progress) -> dict[int, bytes] | None:
        """The random states a pass's workers resume from (None: each as seeded), from
        ``resume`` (a checked loaded state, or None) and the workers' ``places`` it resumes
        (``states.resumed_places``), which go to ``progress`` with the worker whose batch
        came last."""
        workers = resume["workers"] if resume is not None else None
        if places is not None:
            if self._iterable:
                workers = {w: p.rng for w, p in places.items() if p.rng}
            progress.places = places
            progress.last = resume.get("_snapshot", {}).get("_last_yielded_worker_id") \
                if resume is not None and resume["batches"] else None
        return workers

    def _sample(self, indices: Iterator[Any] | None, resume: dict[str, Any] | None,
                progress: Progress, plan: dict[str, Any]
                ) -> tuple[list[Any] | None, Callable[[], np.ndarray | None] | None, list[int]]:
        """How a map-style pass hands out its batches (``indices``: its sampler's iterator;
        None for an iterable dataset, which has nothing to hand out): the whole epoch
        sampled now (None: streamed, keys that are ints), the DISPATCH items one at a time
        (None: none to send) and the batch numbers still to yield of a sampled epoch.
        Records the batches yielded (``resume``'s) in ``progress`` and how the batches go
        in ``plan``; a resumed state is checked against the epoch once it is sampled."""
        sampled, next_batch, todo = None, None, list[int]()
        if indices is not None:  # the batches still to yield, and those yielded
            progress.done = resume["yielded"] if resume is not None else Batches()
            feed = Feed(indices, progress.done, self._auto_collation)
            plan["batched"] = self._auto_collation
            if feed.streamed:
                plan["streamed"] = True
                next_batch = self._checked_end(feed, resume)
            else:  # keys other than ints: the whole epoch now, each worker planned its own
                sampled = feed.sampled()
                if resume is not None:
                    states.within(resume, len(sampled))
                todo = progress.done.todo(len(sampled))
                next_batch = _numbers(todo)
        return sampled, next_batch, todo

    def _pass_loader(self) -> tuple[Loader, Loader | None]:
        """The Loader a pass reads from and the one that is its own, which it closes when it
        ends (None: the persistent one, made at the first pass and kept)."""
        if self._persistent:
            if self._service is None:
                self._service = self._loader()
            return self._service, None
        own = self._loader()
        return own, own

    def _open(self, loader: Loader, own: Loader | None, plans: PerWorker, progress: Progress,
              next_batch: Callable[[], np.ndarray | None] | None, reported: bool = False
              ) -> tuple[Intake, Dispatcher | None]:
        """Start a pass's workers on ``loader`` with their ``plans`` and wait until each
        has started: the records they send and the dispatcher that hands them the batches
        ``next_batch`` gives (None: none, each worker makes its own). Workers whose start
        is ``reported`` (``Loader.prepared``) are waited for so, if their start may fail;
        the others (and one that failed to start) until their first record, which brings
        their start snapshot or error. A failure closes the pass's ``own`` Loader and
        raises in torch's words where torch has them."""
        dispatcher = Dispatcher(functools.partial(loader.dispatch, until_done=True),
                                next_batch, self.num_workers, self._prefetch,
                                bool(self.in_order), loader.dispatch_done) \
            if next_batch is not None else None
        try:
            intake = Intake(loader.iterate(plans), progress, self.num_workers)
            if dispatcher is not None:  # (sent with each worker's OPEN: no round trip)
                dispatcher.prime()
            permutation.settle()  # (while the workers make their first batches)
            if not (reported and (not may_fail_to_start(self.dataset, self.worker_init_fn)
                                  or loader.prepared(self.timeout or 60.0))):
                intake.settle()  # each worker started: its first snapshot; its init errors
        except BaseException as exc:
            if own is not None:
                own.close()
            worded = in_torch_words(exc, self.timeout)
            if worded is not None:
                raise worded from exc
            raise
        return intake, dispatcher

    @staticmethod
    def _checked_end(feed: Feed, resume: dict[str, Any] | None
                     ) -> Callable[[], np.ndarray | None]:
        """``feed.next``, checking a resumed state against the epoch once the sampler
        ended (a sampler without ``len()``: its batches are known only then)."""
        def next_batch() -> np.ndarray | None:
            items = feed.next()
            if items is None and resume is not None and feed.total is not None:
                states.within(resume, feed.total)
            return items
        return next_batch

    def _inline(self, resume: dict[str, Any] | None, progress: Progress) -> Iterator[Any]:
        """torch's own iterator (``num_workers=0``), resumed: a dataset (or its iterator)
        that keeps a state restores it; any other skips the batches the state had
        yielded by making them again."""
        skip = resume["batches"] if resume is not None else 0
        dataset = self.dataset
        if self._iterable and resume is not None and "dataset_state" in resume:
            states.load(dataset, resume["dataset_state"])
        iterator = torch.utils.data.DataLoader.__iter__(self)
        fetcher = getattr(iterator, "_dataset_fetcher", None)
        if self._iterable and fetcher is not None:
            progress.inline = fetcher
            saved = resume.get("fetcher_state") if resume is not None else None
            if saved is not None:
                states.load(fetcher.dataset_iter, saved.get("dataset_iter_state"))
                fetcher.ended = bool(saved.get("fetcher_ended"))
            if states.is_stateful(dataset) or states.is_stateful(fetcher.dataset_iter):
                skip = 0
        return Unmarked(skipped(iterator, skip))

    def _plan(self) -> tuple[dict[str, Any], Iterator[Any] | None]:
        """What every worker gets for an epoch (the base seed and the like) and, for a
        map-style dataset, the sampler's iterator (pulled as the batches are handed out:
        ``feed``); drawn in torch's order: make the sampler iterator, draw the base seed."""
        torch_loader = self
        indices = None if self._iterable else batches_of(torch_loader._index_sampler)
        reseed = self._base_seed is None or not self._persistent
        # An IterDataPipe's shuffles take a seed shared by all workers, drawn as torch
        # draws it: a new torch iterator draws one before its base seed (the workers' one)
        # and one after it; a persistent one's later epochs draw one each.
        datapipe = isinstance(torch_loader.dataset, torch.utils.data.IterDataPipe)
        shared = self._draw() if datapipe else None
        if reseed:
            self._base_seed = self._draw()
            if datapipe:
                self._draw()
        plan: dict[str, Any] = {"seed": self._base_seed, "reseed": reseed}
        if shared is not None:
            plan["shared_seed"] = shared
        return plan, indices

    def _draw(self) -> int:
        """A seed from this loader's generator (torch's global one without it)."""
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, as a small dict (JSON-serializable when the dataset's own
        states are; layout in ``zloader/torch/states.py``): the random state its latest
        pass sampled from, the batches it yielded, its workers' random states (torch,
        numpy and ``random``) after the last of them and, for a dataset that keeps a state
        (``state_dict``/``load_state_dict``, or an iterator with them), each worker's
        snapshot of it. ``load_state_dict`` makes the next iteration sample that epoch
        again (same order, same seeds, the workers' random states restored) and yield only
        the batches after those; a finished epoch resumes at the next one.

        A map-style dataset's batches are skipped without being made. An iterable
        dataset's workers restore their last snapshot and make again the batches they
        yielded after it (every batch of an iterator that keeps no state: its
        ``snapshot_every_n_steps`` apart otherwise); its state resumes only with the same
        ``num_workers``. A map-style state records which batches were yielded (ranges of
        batch numbers: they may come out of order, ``in_order=False``), so it resumes with
        any ``num_workers``. Random state the dataset keeps itself (a ``Generator`` object
        made in ``worker_init_fn``) is recorded only through its own ``state_dict``.
        """
        if self._resume is not None:  # loaded and not yet iterated: that is where it is
            return copy.deepcopy(self._resume)
        progress = self._progress
        finished = progress is not None and progress.finished
        places: dict[int, Place] = {}
        if progress is None or finished:
            rng, batches, last = self._rng(), 0, None
            # The next epoch reseeds the workers, unless they persist.
            workers = progress.workers if progress is not None and self._persistent else {}
            reseed = self._base_seed is None or not self._persistent
            if progress is not None and self._persistent:
                places = progress.places
        else:
            rng, batches, workers = progress.rng, progress.yielded, progress.workers
            reseed, places, last = progress.reseeded, progress.places, progress.last
        if self._iterable and self.num_workers:
            workers = {w: p.rng for w, p in places.items() if p.rng}
        state: dict[str, Any] = {
            "zloader_torch": states.VERSION, "num_workers": self.num_workers, "rng": rng,
            "batches": batches, "base_seed": self._base_seed, "reseed": reseed,
            "finished": finished,
            "workers": {str(w): base64.b64encode(s).decode()
                        for w, s in sorted(workers.items())}}
        state.update(self._worker_state(progress, finished, batches, places, last))
        return state

    def _worker_state(self, progress: Progress | None, finished: bool, batches: int,
                      places: dict[int, Place], last: int | None) -> dict[str, Any]:
        """The part of :meth:`state_dict`'s state that records where the workers are: with
        workers, a map-style dataset's ``yielded`` ranges and each worker's ``_snapshot``
        (from its ``places``; ``last``: the worker whose batch came last); without, an
        iterable dataset's ``dataset_state`` and ``fetcher_state`` (``states.inline``)."""
        state: dict[str, Any] = {}
        if self.num_workers and not self._iterable:
            state["yielded"] = progress.done.ranges() if progress and batches else []
        if self.num_workers:
            state["_snapshot"] = states.layout(
                {w: places.get(w, Place()) for w in range(self.num_workers)}, last)
        elif self._iterable:
            fetcher = progress.inline if progress is not None and not finished else None
            state.update(states.inline(self.dataset, fetcher))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` on the next iteration. It sets the random state
        the sampler draws from (this loader's ``generator``, or torch's global one) to the
        one that epoch started from, and the workers' to theirs. An empty dict loads
        nothing (as torchdata's ``StatefulDataLoader``).

        Raises:
            ValueError: ``state`` is not such a dict (or one of another layout version),
                or one of an iterable dataset saved with another ``num_workers``, or one
                of its fields does not fit the epoch it resumes (past its batches, a
                worker the state's ``num_workers`` lacks, a key the layout does not have,
                a random state that does not decode; ``zloader.torch.states.checked``):
                the message names the field (``state['yielded']``). A sampler without
                ``len()`` has its batches counted at ``iter()``, which raises then.
        """
        if isinstance(state, dict) and not state:
            return
        states.checked(state, self.num_workers, self._iterable, states.epoch_batches(self),
                       self.generator)
        self._resume = copy.deepcopy(state)

    def stats(self) -> dict[str, Any]:
        """The :meth:`zloader.Loader.stats` of the latest pass's workers (as they were when
        the pass ended, if it has); empty with ``num_workers=0`` or before the first pass.
        ``elements`` counts batches, not the records each worker sends at an epoch's
        start (and, for an iterable dataset, its end) for ``state_dict``."""
        progress = self._progress
        loader = progress.loader if progress is not None else None
        if progress is None or loader is None:
            return {}
        stats = loader.stats()
        if "elements" in stats:
            stats["elements"] -= progress.control[0]
        return stats

    def _rng(self) -> str:
        generator = self.generator
        state = generator.get_state() if generator is not None else torch.get_rng_state()
        return base64.b64encode(state.numpy().tobytes()).decode()

    def _set_rng(self, text: str) -> None:
        state = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
        generator = self.generator
        if generator is not None:
            generator.set_state(state)
        else:
            torch.set_rng_state(state)

    def _loader(self) -> Loader:
        """A Loader (worker processes, or a job on the broker's) over the dataset as it is
        now."""
        torch_loader = self
        source = BatchSource(
            name="dataset", shuffle_splits=False, seed=None, version=None,
            dataset=torch_loader.dataset, collate_fn=self._torch_collate(),
            worker_init_fn=torch_loader.worker_init_fn, persistent=self._persistent,
            width=self.num_workers, iterable=self._iterable,
            batch_size=torch_loader.batch_size if torch_loader._auto_collation else None,
            drop_last=torch_loader.drop_last, token=os.urandom(8).hex(),
            objects=self._broker is None, first_seed=self._base_seed,
            )
        self._started += 1
        job_name = self._job_name
        if job_name is not None and not self._persistent:
            job_name = f"{job_name}.{self._started}"  # a pass's job lingers a while
        return Loader(Pipeline(source), broker=self._broker,
                      num_workers=0 if self._broker is not None else self.num_workers,
                      width=self.num_workers, sharding="static",
                      deterministic=bool(self.in_order),
                      job_name=job_name, prefetch=self._prefetch,
                      timeout=self.timeout or 60.0, start_method=self._start_method(),
                      objects=self._broker is None, pack_dataset=self._pack_dataset)

    def _start_method(self) -> str:
        """How local workers start: ``multiprocessing_context``'s start method, where
        ``"forkserver"`` (which the Loader lacks) starts them as ``"spawn"`` does (a fresh
        interpreter given the pickled dataset: what user code sees is the same)."""
        context = self.multiprocessing_context
        if context is None:
            return "fork"
        return "fork" if context.get_start_method() == "fork" else "spawn"

    def _torch_collate(self) -> Callable[[list[Any]], Any] | None:
        collate = self.collate_fn
        defaults = (torch.utils.data.default_collate, torch.utils.data.default_convert)
        return None if collate in defaults else collate

    def _deliver(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Yield batches; pinned and/or moved to ``device`` ahead of use on a background
        thread when asked (a CUDA copy runs on a side stream and the training loop's stream
        waits for it, so the copy overlaps the previous step)."""
        pin = self.pin_memory and self.num_workers > 0
        if pin and not torch.cuda.is_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=4)
            pin = False
        device = self.device
        if not pin and device is None:
            return batches
        return Prefetcher(batches, pin, device, depth=self._prefetch)

    def close(self) -> None:
        """Stop the worker processes of every pass (also done when the loader is garbage
        collected); its iterators end."""
        for iterator in list(self.__dict__.get("_passes", ())):
            iterator.close()
        service = self.__dict__.get("_service")
        if service is not None:
            service.close()
            self._service = None

    def __del__(self) -> None:
        self.close()


def _check_own_arguments(snapshot_every_n_steps: Any, broker: str | None,
                         num_workers: int) -> None:
    """Refuse the arguments torch's DataLoader does not have (checked after torch's own):
    a ``snapshot_every_n_steps`` that is not an int >= 0 or None, and a ``broker`` with
    ``num_workers=0``.

    Raises:
        ValueError: naming the argument and what it takes.
    """
    if snapshot_every_n_steps is not None and (
            isinstance(snapshot_every_n_steps, bool)
            or not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 0):
        raise ValueError(f"snapshot_every_n_steps must be an int >= 0 or None (0 and "
                         f"None: no snapshots within an epoch), got "
                         f"{snapshot_every_n_steps!r}")
    if broker is not None and num_workers == 0:
        raise ValueError(
            "broker= needs num_workers > 0: num_workers=0 loads in this process, as "
            "torch does; pass num_workers=N to have N of the broker's workers make the "
            "batches")


def _numbers(todo: list[int]) -> Callable[[], np.ndarray | None]:
    """The batch numbers of ``todo`` one at a time, as DISPATCH items (a planned epoch:
    each worker has its batches' keys, ``passes.worker_plans``)."""
    left = iter(todo)

    def next_batch() -> np.ndarray | None:
        number = next(left, None)
        return None if number is None else np.array([number], np.int64)
    return next_batch
