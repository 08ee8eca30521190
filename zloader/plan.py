"""How a pipeline is run by the service: cut into a worker part and a consumer part.

See docs/semantics.md. The worker part is the source and every stage before the first
``take``/``skip``; each worker runs it over the splits it is given. The consumer part is the
rest, run by the consumer over the merged stream of all workers.

A mix (``Pipeline.mix``/``choose``) is drawn where the streams meet when it can be
(:func:`draws_at_consumer`): the workers run each input's pipeline and send one stream per
input, and the consumer draws from those streams, as ``Pipeline.iter`` draws, then runs
the stages after the mix itself, so that the weights hold in every window of the stream
whatever the number of workers and however the inputs' splits lie among them. A
``repeat`` after the mix is moved onto its inputs where that yields the same elements
(:func:`repeats_moved`), or else drawn pass by pass (:attr:`Plan.passes`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zloader import stages as _stages
from zloader._byfields import FrozenByFields
from zloader._defaults import (
    DEFAULT_SPLITS,
    MAX_MIX_INPUTS,
    MIX_AHEAD_SHARE,
    MIX_SPREAD_SPLITS,
)
from zloader.cache import CachedSource, cached
from zloader.chunks import Chunk
from zloader.groups import announce
from zloader.lineage import Assigned, read_split, read_split_chunks
from zloader.mixing import MixSource, drawn, input_of, input_runs, mixed_run, weights_now
from zloader.options import JobOptions
from zloader.pipeline import Pipeline
from zloader.runs import Context
from zloader.sources import Source, _IndexedSource, in_parts

__all__ = ["CONSUMER_DRAWN", "Plan", "SplitFeed", "drawn_on_workers", "draws_at_consumer",
           "plan", "repeats_moved"]

SplitFeed = Callable[[_stages.Key], Iterable["int | Assigned"]]
"""Given a pass key, the splits this worker reads in that pass (possibly fetched lazily)."""

_CONSUMER_STAGES = (_stages.Take, _stages.Skip)

CONSUMER_DRAWN = (_stages.Map, _stages.Filter, _stages.Batch, _stages.Shuffle,
                  _stages.BucketByLength, _stages.Unbatch)
"""The stages after a mix that the consumer runs when it draws the mix: each output's
elements are known (tracked), so a state counts exactly those yielded (of each record,
the elements before a point, or, after a shuffle or a bucket, any of them; the rows an
unbatch made of a batch in another number are a group's, made again after a resume)."""

_ELEMENTWISE = (_stages.Map, _stages.Filter, _stages.Shuffle)
"""The stages that may come between a mix and a ``repeat(n)`` moved onto its inputs
(:func:`repeats_moved`): each element's output is its own, whatever pass it is in."""


@dataclass(eq=False, repr=False)
class Plan(FrozenByFields):
    """``pipeline`` cut in two: ``worker_stages`` after the source run on the workers,
    ``consumer_stages`` (a take/skip and what follows) on the consumer. When the consumer
    draws the mix (``mix`` is the pipeline's source), the workers run its inputs alone
    (:meth:`run_inputs`) and ``after_mix`` are the stages after it, run on the consumer
    (``worker_stages`` is then empty)."""

    pipeline: Pipeline
    worker_stages: tuple[_stages.Stage, ...]
    consumer_stages: tuple[_stages.Stage, ...]
    mix: MixSource | None = None
    after_mix: tuple[_stages.Stage, ...] = ()
    shards: int = 0  # a deterministic job's fixed shards (JobOptions.shards); 0: none
    passes: int = 0  # a repeat(n) after a mix the consumer draws: n; 0: none (_passes)
    # A mix its workers draw, in a job that may have several: each worker takes few of an
    # input's splits ahead (:meth:`ahead_at_most`)
    spread: bool = False

    @property
    def parts(self) -> int:
        """The streams each worker's records belong to (``DATA.part``): a mix the
        consumer draws has one per input (and per pass of a ``repeat(n)`` after it:
        part ``r * inputs + k``, input ``k``'s stream in pass ``r``), a deterministic job
        one per shard, and a deterministic job whose mix the consumer draws one per input
        and shard (part ``k * shards + v``: input ``k``'s stream over shard ``v``); 0:
        none."""
        if self.mix is None:
            return self.shards
        return len(self.mix.inputs) * max(1, self.shards) * max(1, self.passes)

    def ahead_at_most(self, key: _stages.Key) -> int | None:
        """The most splits of pass ``key`` a worker may ask for ahead of the one it reads
        (None: as many as its pace wants). A worker drawing a mix among the splits it
        holds takes at most 1/MIX_AHEAD_SHARE of an input's splits ahead: one that took
        many would leave the others none of that input for a while (:func:`spread`)."""
        if not self.spread or input_of(key) is None:
            return None
        return self.pipeline.source.splits_in(key) // MIX_AHEAD_SHARE

    def input_of(self, part: int) -> int:
        """The mix input whose stream part ``part`` is."""
        if self.shards:
            return part // self.shards
        assert self.mix is not None
        return part % len(self.mix.inputs)

    def run_worker(self, feed: SplitFeed, epoch: int, ctx: Context) -> Iterator[Any]:
        """The worker part for ``epoch``, reading the splits ``feed`` gives for each pass
        (split numbers, or :class:`~zloader.lineage.Assigned` splits whose elements are
        tagged with their origins; ``ctx.tally`` then names the pass ids used)."""
        read, read_chunks = self._reads(feed, ctx)
        ctx.records_from = len(self.worker_stages)  # (the producer encodes what it yields)
        return mixed_run(self.pipeline.source, read, self.worker_stages, ctx,
                         read_chunks)((epoch,))

    def run_trunk(self, feed: SplitFeed, epoch: int, ctx: Context,
                  tap: int) -> Iterator[Any]:
        """The source and the first ``tap`` worker stages for ``epoch``, reading the splits
        ``feed`` gives as :meth:`run_worker` reads them (a shared job's trunk,
        zloader/sharing/branches.py): the elements one at a time."""
        read, read_chunks = self._reads(feed, ctx)
        return mixed_run(self.pipeline.source, read, self.worker_stages[:tap], ctx,
                         read_chunks)((epoch,))

    def run_inputs(self, feed: SplitFeed, epoch: int,
                   ctx: Context) -> list[Iterator[Any]]:
        """A mix the consumer draws: each input's pipeline for ``epoch`` on this worker,
        one stream per input (and per pass of a repeat after the mix drawn pass by pass,
        :attr:`passes`: part ``r * inputs + k``), reading the splits ``feed`` gives for
        each input's passes as :meth:`run_worker` reads them."""
        assert self.mix is not None
        read, _ = self._reads(feed, ctx)
        ctx.records_from = 0  # (records of several inputs: no batch leaves its copy)
        if not self.passes:
            return [run((epoch,)) for run in input_runs(self.mix, read, ctx)]
        # Each pass of the repeat after the mix (the inputs' pass keys are iter()'s), part
        # ``r * inputs + k``; each input's runs started as soon as it is made, as above
        # (``ctx.aligned`` is the last one made's until the next is).
        count = len(self.mix.inputs)
        streams: list[Iterator[Any]] = []
        for run in input_runs(self.mix, read, ctx):
            streams += [run((epoch, r)) for r in range(self.passes)]
        return [streams[k * self.passes + r] for r in range(self.passes)
                for k in range(count)]

    def _reads(self, feed: SplitFeed, ctx: Context
               ) -> tuple[_stages.Run, Callable[[_stages.Key, int], Iterator[Chunk]]]:
        """The runs that read a pass's splits (one element, or one chunk, at a time)."""
        source = self.pipeline.source
        tally = ctx.tally

        def splits(key: _stages.Key) -> Iterator[tuple[int | Assigned, int]]:
            """Each split of pass ``key`` with the pass id of an Assigned split (0 else)."""
            coverage = ctx.coverage
            for split in feed(key):
                if isinstance(split, Assigned):  # exactly-once: tagged with origins
                    if coverage is not None:
                        coverage.read(key, split.split,
                                      split.pass_key == key and not split.skip)
                    yield split, tally.pass_id(split.pass_key)
                else:
                    if coverage is not None:
                        coverage.read(key, split, True)
                    yield split, 0

        def read(key: _stages.Key) -> Iterator[Any]:
            for split, pass_id in splits(key):
                if isinstance(split, Assigned):
                    self._rebuild(split, ctx)
                    yield from read_split(source, split, pass_id, ctx)
                else:
                    yield from ctx.read(split)

        def read_chunks(key: _stages.Key, size: int) -> Iterator[Chunk]:
            for split, pass_id in splits(key):
                if isinstance(split, Assigned):
                    self._rebuild(split, ctx)
                    for values, codes in read_split_chunks(source, split, pass_id, ctx, size):
                        yield Chunk(values, codes)
                else:
                    yield from ctx.read_chunks(split, size)

        tally.pass_keys, tally.keys = {}, []  # (this run's)
        ctx.source = source
        return read, read_chunks

    def _rebuild(self, split: Assigned, ctx: Context) -> None:
        """The groups anchored in ``split`` whose rows are to be made again: by the
        unbatch that made them (``ctx.rebuilds``), or, made by the consumer after a mix it
        draws, named to it in the next record (it makes them: zloader/client/draw.py)."""
        if not split.groups:
            return
        after = self.mix.after() if self.mix is not None else None
        for group, skip in split.groups:
            if after is not None and group.position >= after:
                announce(ctx.tally, group)
            else:
                ctx.rebuilds.append((group, skip))

    def run_consumer(self, elements: Iterator[Any], epoch: int,
                     ctx: Context) -> Iterator[Any]:
        """The consumer part for ``epoch`` over the merged worker stream ``elements``."""
        if not self.consumer_stages:
            return elements

        def read(key: _stages.Key) -> Iterator[Any]:
            return elements

        first = len(self.worker_stages) + 1
        if self.mix is not None:
            first = self.mix.after() + len(self.after_mix)
        return _stages.compose(read, self.consumer_stages, ctx, first)((epoch,))

    def remade_here(self, ctx: Context) -> None:
        """Set ``ctx`` to make here the rows of groups made after the mix this consumer
        draws (zloader/client/draw.py ``Regroup``): the mix's inputs' sources and stages,
        which their elements, read again, run through first."""
        assert self.mix is not None
        ctx.source = self.mix
        for which, pipeline in enumerate(self.mix.inputs):
            ctx.input_stages[which] = pipeline.stages
            ctx.note_sections(pipeline.stages, 1)

    def run_drawn(self, opened: Callable[[], list[Iterator[Any]]], epoch: int,
                  ctx: Context, rest: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """The consumer's draws of the mix for ``epoch`` over its inputs' streams
        (``opened()``'s, one per input, as the workers make them; drawn pass by pass,
        :attr:`passes`: pass ``r`` over the streams of its own), then, when every input
        was to be read to its end (``"all_exhausted"``, no weight 0), what comes after
        the (last pass's) draws ended (``rest()``: a dead worker's splits read again);
        and the stages after the mix over all that (the take/skip part is
        :meth:`run_consumer`'s)."""
        assert self.mix is not None
        mix, passes, count = self.mix, self.passes, len(self.mix.inputs)

        def read(key: _stages.Key) -> Iterator[Any]:
            last = True
            streams = opened
            if passes:  # (the repeat after the mix asks for pass key[1])
                at = key[1] * count
                last = key[1] == passes - 1

                def streams() -> list[Iterator[Any]]:
                    return opened()[at:at + count]
            yield from drawn(mix, streams, key, ctx)
            weights = weights_now(mix, key, ctx)
            if mix.stop == "all_exhausted" and min(weights) > 0 and last:
                yield from rest()  # (every pass's: after the last pass's draws)

        return _stages.compose(read, self.after_mix, ctx, mix.after(), after_mix=True)((epoch,))


def plan(pipeline: Pipeline, options: JobOptions | None = None) -> Plan:
    """Cut ``pipeline`` at its first ``take``/``skip``, and at its mix when the consumer
    draws it (:func:`draws_at_consumer` with the job's ``options``; None: in-process).

    Raises:
        ValueError: a ``repeat`` follows a ``take``/``skip`` (the consumer cannot re-run the
            workers' part within an epoch).
    """
    cut = next((i for i, stage in enumerate(pipeline.stages)
                if isinstance(stage, _CONSUMER_STAGES)), len(pipeline.stages))
    consumer = pipeline.stages[cut:]
    for stage in consumer:
        if isinstance(stage, _stages.Repeat):
            raise ValueError(
                f"stage {stage.name!r} repeats after a take/skip, which a Loader cannot run "
                "(the consumer cannot re-run the workers' part within an epoch); move the "
                "repeat before the take/skip, or iterate the Loader again for another epoch")
    shards = options.shards if options is not None and options.deterministic else 0
    if options is not None:
        moved = repeats_moved(pipeline, options)
        if draws_at_consumer(moved, options):
            assert isinstance(moved.source, MixSource)
            cut = len(moved.stages) - len(consumer)
            after = moved.stages[:cut]
            return Plan(moved, (), consumer, moved.source, after, shards, _passes(after))
        if options.sharding != "off" and isinstance(pipeline.source, MixSource):
            # (sharding "off": each worker reads every split, nothing to spread)
            pipeline = spread(pipeline)
            return Plan(pipeline, pipeline.stages[:cut], consumer, shards=shards,
                        spread=options.num_workers != 1)
    return Plan(pipeline, pipeline.stages[:cut], consumer, shards=shards)


def spread(pipeline: Pipeline) -> Pipeline:
    """``pipeline``, whose mix (if any) its workers draw, with its inputs in many splits,
    so that each worker holds some of every input until near its end (a worker mixes
    only the splits it holds: an input of one file would sit on one worker, and its
    share of what the trainer sees would follow that worker's pace, not its weight). An
    input addressed by index (``range``, ``from_items``, ``from_arrays``, ``from_torch``)
    of fewer than DEFAULT_SPLITS splits is cut into that many (its default); any other
    (files, a generator) of fewer than MIX_SPREAD_SPLITS is read in that many
    interleaved parts (:class:`~zloader.sources.PartsSource`: read
    that many times, each part keeping its share), a cache's own source so (under the
    cache), a source read in no fixed order one file a split first (:func:`_spread`). Only what a
    Loader runs changes (``iter()`` reads the inputs as they are), the same for every
    Loader and worker of the job, whatever its number of workers."""
    source = pipeline.source
    if not isinstance(source, MixSource):
        return pipeline
    inputs = tuple(Pipeline(_spread(p.source), p.stages) for p in source.inputs)
    if all(new.source is old.source for new, old in zip(inputs, source.inputs, strict=True)):
        return pipeline
    return Pipeline(dataclasses.replace(source, inputs=inputs), pipeline.stages)


def _spread(source: Source) -> Source:
    """``source`` in as many splits as :func:`spread` says. A source whose splits read
    their files in no fixed order (``deterministic=False`` with parallel reads: parts of
    such a split would overlap) is first read one file a split, each in its own order
    (the workers reading its parts read its files in parallel). A cache's own source is
    spread, under its stages: each part of a split is an entry of its own (the prefix's
    fingerprint, and so the entries' key, is another than the input's as written), and
    a part not cached yet runs the stages over its own elements only."""
    count = source.num_splits
    if isinstance(source, CachedSource):
        inner = _spread(source.source)
        return source if inner is source.source else cached(
            inner, source.stages, source.root, source.storage_options,
            source.max_entry_bytes)
    if isinstance(source, _IndexedSource):  # (as by default: DEFAULT_SPLITS, or finer)
        size = max(1, -(-source.length // DEFAULT_SPLITS))
        return dataclasses.replace(source, split_size=size) if size < source.split_size \
            else source
    if getattr(source, "deterministic", True) is False and count < MIX_SPREAD_SPLITS \
            and getattr(source, "parallel_reads", 1) > 1:
        source = dataclasses.replace(source, parallel_reads=1)  # type: ignore[call-arg]
        count = source.num_splits
    if count == 0 or count >= MIX_SPREAD_SPLITS:
        return source
    return in_parts(source, -(-MIX_SPREAD_SPLITS // count))


def _passes(after: tuple[_stages.Stage, ...]) -> int:
    """The passes of the ``repeat(n)`` among the stages after a mix the consumer draws
    (``n``; 0: none)."""
    repeat = next((s for s in after if isinstance(s, _stages.Repeat)), None)
    return 0 if repeat is None or repeat.count is None else repeat.count


def repeats_moved(pipeline: Pipeline, options: JobOptions) -> Pipeline:
    """``pipeline`` with each ``repeat`` after its mix moved onto every input of the mix,
    where that yields the same elements and lets the consumer draw the mix: a mix that
    reads every input to its end (``"all_exhausted"``, or ``"never"``), only maps, filters
    and shuffles between the mix and a repeat with a count (any stage the consumer draws
    before an endless one), no take/skip before it, in a job whose consumer can draw
    (:func:`drawn_on_workers`). ``mix(a, b).map(f).repeat(n)`` is run as
    ``mix(a.repeat(n), b.repeat(n)).map(f)``: each input's elements ``n`` times, as
    ``iter()`` yields them, drawn by weight over all the passes at once (the draws of one
    pass no longer end before the next begins: the order is not ``iter()``'s, with any
    number of workers). Otherwise ``pipeline`` itself (docs/semantics.md, "Mixing")."""
    source = pipeline.source
    if not isinstance(source, MixSource) or source.stop == "first_exhausted" \
            or _refused_by(options) is not None:
        return pipeline
    stages = pipeline.stages
    while True:
        at = next((i for i, stage in enumerate(stages)
                   if isinstance(stage, (_stages.Repeat, *_CONSUMER_STAGES))), None)
        if at is None or not isinstance(stages[at], _stages.Repeat):
            break
        repeat = stages[at]
        assert isinstance(repeat, _stages.Repeat)
        between = _ELEMENTWISE if repeat.count is not None else CONSUMER_DRAWN
        if any(type(stage) not in between for stage in stages[:at]):
            break
        inputs = tuple(Pipeline(p.source, (*p.stages, repeat)) for p in source.inputs)
        source = dataclasses.replace(source, inputs=inputs)
        stages = (*stages[:at], *stages[at + 1:])
    if source is pipeline.source:
        return pipeline
    return Pipeline(source, stages)


def draws_at_consumer(pipeline: Pipeline, options: JobOptions) -> bool:
    """Whether a job with ``options`` over ``pipeline`` draws its mix at the consumer:
    a mix whose stages after it (up to a take/skip) are all :data:`CONSUMER_DRAWN`, in a
    job whose workers deliver each record to one consumer (by its credits, or dealt
    round-robin: ``balanced``; not shared or coordinated, and sharded; deterministic only
    when read in fixed shards, ``JobOptions.shards``). Other mixes are drawn on each
    worker among the splits it holds (docs/semantics.md, "Mixing")."""
    return isinstance(pipeline.source, MixSource) and drawn_on_workers(pipeline, options) is None


def drawn_on_workers(pipeline: Pipeline, options: JobOptions) -> str | None:
    """Why a job with ``options`` draws ``pipeline``'s mix on each worker (the stage after
    it or the option that keeps the consumer from drawing it), or None: it has no mix, or
    the consumer draws it."""
    if not isinstance(pipeline.source, MixSource):
        return None
    refused = _refused_by(options)
    if refused is not None:
        return refused
    pipeline = repeats_moved(pipeline, options)
    inputs = len(pipeline.source.inputs)  # type: ignore[attr-defined]  # (a mix still)
    if options.deterministic and inputs * max(1, options.shards) > MAX_MIX_INPUTS:
        return (f"its {inputs} inputs over {options.shards} shards make "
                f"more than {MAX_MIX_INPUTS} streams")
    after = list(itertools.takewhile(lambda s: not isinstance(s, _CONSUMER_STAGES),
                                     pipeline.stages))
    repeats = [s for s in after if isinstance(s, _stages.Repeat)]  # (not moved)
    for stage in after:
        if type(stage) not in CONSUMER_DRAWN and not (
                isinstance(stage, _stages.Repeat)
                and _in_passes(stage, repeats, inputs, options)):
            return f"stage {stage.name!r} follows the mix"
    return None


def _in_passes(repeat: _stages.Repeat, repeats: list[_stages.Repeat], inputs: int,
               options: JobOptions) -> bool:
    """Whether the consumer draws a mix over a ``repeat`` after it that did not move onto
    its inputs (:func:`repeats_moved`) pass by pass, each input's stream of each pass a
    part of its own (:attr:`Plan.passes`): the only repeat, with a count, in a job that
    is not deterministic, its parts within MAX_MIX_INPUTS."""
    return (len(repeats) == 1 and repeat.count is not None and repeat.count >= 1
            and not options.deterministic and inputs * repeat.count <= MAX_MIX_INPUTS)


def _refused_by(options: JobOptions) -> str | None:
    """The option of a job that keeps its consumer from drawing a mix, or None."""
    for option, on in (("share=True", options.share is not None),
                       ("num_consumers", options.num_consumers),
                       ("deterministic=True without fixed shards (sharding='static', or "
                        "no num_workers)", options.deterministic and not options.shards),
                       ("sharding='off'", options.sharding == "off")):
        if on:
            return f"the job has {option}"
    return None
