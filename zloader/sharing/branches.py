"""Prefix sharing: one run of the stages trainers have in common, each trainer's own
stages after it (docs/sharing.md, "Sharing a prefix").

Trainers of a shared job whose pipelines begin alike (equal prefix fingerprints) and then
differ are the job's *branches*: branch 0 is the pipeline the job was made with, each
other one a pipeline that joined it and has its source and first ``tap`` stages in common
with branch 0 (its trunk). A worker reads its splits once and runs branch 0's worker part
over them once, with a tap at each stage boundary where a branch may part from it; each
branch's own stages (``stages[tap:]`` of its worker part) run over what passes its tap
(:class:`Tree`). What a branch makes is what its own pipeline makes over the same
splits (the stages see the same elements in the same order, with the same seeds), so a
trainer of it can be sent, and made again, exactly what it would get alone.

Where a trunk may end: at any stage boundary of the worker part after which no branch
repeats (a ``repeat`` re-reads what is before it: it cannot run on what a trunk hands on),
and after at least one stage (a source alone is not worth the coupling).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from zloader import stages as _stages
from zloader._byfields import FrozenByFields
from zloader._defaults import MAX_STAGES
from zloader.mixing import MixSource
from zloader.pipeline import Pipeline
from zloader.plan import Plan, SplitFeed
from zloader.runs import Context

__all__ = ["Branch", "Tree", "first_tap", "prefix_of"]


@dataclass(eq=False, repr=False)
class Branch(FrozenByFields):
    """One branch of a shared job: its index (0: the job's own pipeline), its pipeline
    planned as the job runs it, the stages it has in common with branch 0 (``tap``), and
    the fingerprint that names it."""

    index: int
    plan: Plan
    tap: int = 0
    fingerprint: str = ""


def first_tap(pipeline: Pipeline, worker_stages: int) -> int:
    """The fewest stages a trunk of ``pipeline`` may hold: one, and every ``repeat`` of
    its worker part (its first ``worker_stages`` stages)."""
    last = max((i + 1 for i, stage in enumerate(pipeline.stages[:worker_stages])
                if isinstance(stage, _stages.Repeat)), default=0)
    return max(1, last)


def prefix_of(planned: Plan) -> dict[str, Any]:
    """What a shared job's REGISTER says of its pipeline's prefixes (``prefixes``,
    ``first_tap``, ``stage_names``: see zloader/sharing/prefix.py); empty when the
    pipeline cannot share a prefix (records in parts: a mix the consumer draws, a
    deterministic job's shards; no worker stage; too many stages)."""
    pipeline = planned.pipeline
    count = len(planned.worker_stages)
    if planned.parts or not count or count > MAX_STAGES or not pipeline.shareable:
        return {}
    return {"prefixes": list(pipeline.prefix_fingerprints[:count + 1]),
            "first_tap": first_tap(pipeline, count),
            "stage_names": [stage.name[:128] for stage in planned.worker_stages]}


def _suffix_start(plan: Plan, tap: int) -> int:
    """The position of the first stage after a trunk of ``tap`` stages (positions name
    a stage's seeds: the same as in the whole pipeline)."""
    source = plan.pipeline.source
    return (source.after() if isinstance(source, MixSource) else 1) + tap


class _History:
    """The elements that passed each tap since the epoch began, while they fit in
    ``budget`` bytes together (a branch that comes later in the epoch starts from them);
    dropped at once, for every tap, when they do not."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept = budget > 0

    def take(self, size: int) -> bool:
        """Whether an element of ``size`` bytes is kept too."""
        if self.kept:
            self.budget -= size
            self.kept = self.budget >= 0
        return self.kept


class _Tap:
    """A stage boundary of the trunk: its upstream's elements, handed to each subscriber
    (the next stage of branch 0, a branch whose own stages start here) in turn, pulled by
    whichever subscriber wants one first; what others have not taken waits in their
    queues."""

    def __init__(self, upstream: Iterator[Any], history: _History) -> None:
        self.upstream = upstream
        self.history = history
        self.passed: list[Any] | None = []  # (while ``history`` keeps them)
        self.queues: dict[int, deque[Any]] = {}
        self.ended = False

    def subscribe(self, owner: int) -> Iterator[Any] | None:
        """The elements from the epoch's first, for ``owner`` (a branch index); None when
        those that passed already are no longer kept."""
        if self.passed is None:
            return None
        self.queues[owner] = deque(self.passed)
        return self._fed(owner)

    def _fed(self, owner: int) -> Iterator[Any]:
        mine = self.queues[owner]
        while True:
            if mine:
                yield mine.popleft()
                continue
            if self.ended:
                return
            try:
                element = next(self.upstream)
            except StopIteration:
                self.ended = True
                self.passed = None
                return
            for queue in self.queues.values():
                queue.append(element)
            if self.passed is not None:
                if self.history.take(_size(element)):
                    self.passed.append(element)
                else:
                    self.passed = None
            element = None


def _size(element: Any, depth: int = 0) -> int:
    """About how many bytes ``element`` holds (arrays and buffers; containers two deep)."""
    nbytes = getattr(element, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(element, (bytes, str)):
        return len(element)
    if depth < 2 and isinstance(element, (list, tuple)):
        return 64 + sum(_size(item, depth + 1) for item in element)
    if depth < 2 and isinstance(element, dict):
        return 64 + sum(_size(item, depth + 1) for item in element.values())
    return 64


class Tree:
    """One epoch's run of a shared job's pipelines on a worker: branch 0's worker part
    with a :class:`_Tap` at each stage boundary a branch may start from
    (``first_tap``..all), each branch's own stages fed from the tap where it parts from
    branch 0. A branch may be added while the epoch runs (:meth:`attach`) as long as
    every element that passed its tap is still kept (``history_bytes`` in all): it then
    gets the whole epoch, as if it had been there from the start.

    Iterating it yields ``(branch index, element)`` pairs, each branch's in its own
    order; the branch whose queues hold the most elements goes next, so none runs far
    ahead of the others."""

    def __init__(self, plan: Plan, first: int, feed: SplitFeed, epoch: int, ctx: Context,
                 history_bytes: int, incoming: deque[Branch] | None = None,
                 attached: set[int] | None = None, refused: set[int] | None = None) -> None:
        self.plan, self.epoch, self.ctx = plan, epoch, ctx
        stages = plan.worker_stages
        self.first = first
        history = _History(history_bytes)
        upstream = plan.run_trunk(feed, epoch, ctx, first)
        ctx.records_from = 0  # (records of several branches: no batch leaves its copy)
        self.taps: dict[int, _Tap] = {}
        for k in range(first, len(stages) + 1):
            tap = self.taps[k] = _Tap(upstream, history)
            if k < len(stages):
                upstream = self._own(tap.subscribe(0), stages[k:k + 1], plan, k)
        main = self.taps[len(stages)].subscribe(0)
        assert main is not None
        self.outputs: dict[int, Iterator[Any]] = {0: main}
        self.owned: dict[int, list[deque[Any]]] = {
            0: [tap.queues[0] for tap in self.taps.values()]}
        # (attach: from another thread, which reads ``attached`` and ``refused``)
        self.incoming: deque[Branch] = deque() if incoming is None else incoming
        self.attached: set[int] = set() if attached is None else attached
        self.refused: set[int] = set() if refused is None else refused
        self.attached.add(0)

    def _own(self, fed: Iterator[Any] | None, stages: tuple[_stages.Stage, ...], plan: Plan,
             tap: int) -> Iterator[Any]:
        assert fed is not None
        run: Callable[[_stages.Key], Iterator[Any]] = lambda key: fed
        return _stages.compose(run, stages, self.ctx, _suffix_start(plan, tap))((self.epoch,))

    def attach(self, branch: Branch) -> None:
        """Ask for ``branch`` to be added (any thread): at the next element, into
        :attr:`attached` if it can still get the whole epoch, else :attr:`refused`."""
        self.incoming.append(branch)

    def _add(self, branch: Branch) -> None:
        if branch.index in self.attached or branch.index in self.refused:
            return
        tap = self.taps.get(branch.tap)
        fed = tap.subscribe(branch.index) if tap is not None else None
        if tap is None or fed is None:
            self.refused.add(branch.index)
            return
        self.outputs[branch.index] = self._own(fed, branch.plan.worker_stages[branch.tap:],
                                               branch.plan, branch.tap)
        self.owned[branch.index] = [tap.queues[branch.index]]
        self.attached.add(branch.index)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        outputs, owned = self.outputs, self.owned
        while outputs or self.incoming:
            while self.incoming:
                self._add(self.incoming.popleft())
            if not outputs:
                break
            which = max(outputs, key=lambda k: sum(map(len, owned[k])))
            try:
                element = next(outputs[which])
            except StopIteration:
                del outputs[which]
                for queue in owned.pop(which):
                    queue.clear()
                continue
            yield which, element
