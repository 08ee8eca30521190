"""How a pipeline is run by the service: cut into a worker part and a consumer part.

See docs/semantics.md. The worker part is the source and every stage before the first
``take``/``skip``; each worker runs it over the splits it is given. The consumer part is the
rest, run by the consumer over the merged stream of all workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zloader import stages as _stages
from zloader.chunks import Chunk
from zloader.lineage import Assigned, read_split, read_split_chunks
from zloader.mixing import mixed_run
from zloader.pipeline import Pipeline

__all__ = ["Plan", "SplitFeed", "plan"]

SplitFeed = Callable[[_stages.Key], Iterable["int | Assigned"]]
"""Given a pass key, the splits this worker reads in that pass (possibly fetched lazily)."""

_CONSUMER_STAGES = (_stages.Take, _stages.Skip)


@dataclass(frozen=True)
class Plan:
    pipeline: Pipeline
    worker_stages: tuple[_stages.Stage, ...]
    consumer_stages: tuple[_stages.Stage, ...]

    def run_worker(self, feed: SplitFeed, epoch: int, ctx: _stages.Context) -> Iterator[Any]:
        """The worker part for ``epoch``, reading the splits ``feed`` gives for each pass
        (split numbers, or :class:`~zloader.lineage.Assigned` splits whose elements are
        tagged with their origins; ``ctx.tally`` then names the pass ids used)."""
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
                    ctx.rebuilds.extend(split.groups)  # (made again by their unbatch)
                    yield from read_split(source, split, pass_id, ctx)
                else:
                    yield from ctx.read(split)

        def read_chunks(key: _stages.Key, size: int) -> Iterator[Chunk]:
            for split, pass_id in splits(key):
                if isinstance(split, Assigned):
                    ctx.rebuilds.extend(split.groups)
                    for values, codes in read_split_chunks(source, split, pass_id, ctx, size):
                        yield Chunk(values, codes)
                else:
                    yield from ctx.read_chunks(split, size)

        tally.pass_keys, tally.keys = {}, []  # (this run's)
        ctx.source = source
        ctx.records_from = len(self.worker_stages)  # (the producer encodes what it yields)
        return mixed_run(source, read, self.worker_stages, ctx, read_chunks)((epoch,))

    def run_consumer(self, elements: Iterator[Any], epoch: int,
                     ctx: _stages.Context) -> Iterator[Any]:
        """The consumer part for ``epoch`` over the merged worker stream ``elements``."""
        if not self.consumer_stages:
            return elements

        def read(key: _stages.Key) -> Iterator[Any]:
            return elements

        first = len(self.worker_stages) + 1
        return _stages.compose(read, self.consumer_stages, ctx, first)((epoch,))


def plan(pipeline: Pipeline) -> Plan:
    """Cut ``pipeline`` at its first ``take``/``skip``.

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
    return Plan(pipeline, pipeline.stages[:cut], consumer)
