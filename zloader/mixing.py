"""Mixing pipelines: ``Pipeline.mix`` draws each element from one of several input
pipelines by weight, ``Pipeline.choose`` in a fixed repeating pattern (docs/semantics.md,
"Mixing").

A mix is a source, :class:`MixSource`, whose splits are its inputs' splits numbered one
after another (input ``k``'s split ``s`` is ``offset[k] + s``). Each input is read in passes
of its own: the pass key of input ``k`` within the mix's pass ``key`` is
``(*key, MIX_KEY + k)`` (then a repetition number, with ``stop="never"``), and a pass key
ending so names input ``k``'s splits only. That rule is plain values (:class:`Layout`), so
the broker hands out each input's splits, and exactly-once accounts for them, per input
pass, without loading any pipeline code; with one worker the Loader reads what
``Pipeline.iter`` reads.

Each input keeps its own stages (maps, shuffles, batches); the mix takes one element at a
time from the input it draws, and the stages after the mix see the mixed stream.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from zloader import _check
from zloader import stages as _stages
from zloader._byfields import FrozenByFields
from zloader._defaults import GROUP_KEY, MIX_DRAW_CHUNK, MIX_KEY
from zloader._seeding import Key
from zloader.runs import Context
from zloader.sharing.handover import Switched
from zloader.sources import Source, split_order

if TYPE_CHECKING:
    from zloader.pipeline import Pipeline

__all__ = ["MIX_KEY", "STOP_RULES", "Layout", "LiveWeights", "MixSource", "Switches", "drawn",
           "input_runs", "layout_of", "mixed_run", "mixed_source", "new_weights",
           "register_info", "weights_now"]

_DRAWS = MIX_KEY - 1
"""The last element of the key of a mix's own draws."""

STOP_RULES = ("first_exhausted", "all_exhausted", "never")


class LiveWeights:
    """A mix's weights as its consumers last set them (``Loader.set_weights``), shared by
    a worker's task and its producers: the draws read :attr:`value` before each chunk.
    None: the mix's own weights. ``stamp``: when they were set (the setting Loader's
    clock): of the weights a job's consumers send, the last set win, whichever consumer
    opens an epoch later."""

    def __init__(self) -> None:
        self.value: tuple[float, ...] | None = None
        self.stamp = 0.0

    def offer(self, weights: tuple[float, ...], stamp: float) -> None:
        """Take ``weights`` unless weights set later are held already (the same values
        again change nothing the draws see)."""
        if stamp >= self.stamp:
            if weights != self.value:
                self.value = weights
            self.stamp = stamp


class Switches:
    """Where a shared job's worker notes when its mix takes new weights, so that the
    mix's elements can be made again exactly (zloader/sharing/handover.py: a place must
    name the same element the second time): each pass's draws come from one seeded
    generator, :data:`~zloader._defaults.MIX_DRAW_CHUNK` at a time, and new weights
    start a new chunk; the same switches at the same draws make the same draws.

    Recording (``replay`` False): each switch goes into ``log`` and to ``confirm``, which
    returns once the broker has noted it (a worker that dies then is made again by
    another, from what the broker holds): no element drawn with the new weights leaves
    the worker before. Replaying: the weights come from ``log``, switched at the draws
    they were switched at the first time, whatever the Loader's weights are now.
    """

    def __init__(self, log: Switched, replay: bool = False,
                 confirm: Callable[[Key, int, tuple[float, ...]], None] | None = None) -> None:
        self.log, self.replay, self.confirm = log, replay, confirm
        # The weights each pass's draws ended with (None: the mix's own), as they ran.
        self.final: dict[Key, tuple[float, ...] | None] = {}

    def script(self, key: Key) -> Scripted | None:
        """For a replay, pass ``key``'s weights as the first run switched them (None
        when recording)."""
        return Scripted(self.log.setdefault(key, [])) if self.replay else None

    def took(self, key: Key, count: int, weights: tuple[float, ...]) -> None:
        """Pass ``key`` draws with ``weights`` from its draw ``count`` on (recording)."""
        if self.replay:
            return
        self.log.setdefault(key, []).append((count, weights))
        if self.confirm is not None:
            self.confirm(key, count, weights)


class Scripted(LiveWeights):
    """A replay's weights: :attr:`value` is what was in force after the count of draws
    last given to :meth:`at` (counts that never decrease), by ``switched``."""

    def __init__(self, switched: list[tuple[int, tuple[float, ...]]]) -> None:
        super().__init__()
        self._switched, self._next = switched, 0

    def at(self, count: int) -> None:
        switched = self._switched
        while self._next < len(switched) and switched[self._next][0] <= count:
            self.value = switched[self._next][1]
            self._next += 1


def new_weights(source: Source, weights: Any) -> tuple[float, ...]:
    """``weights`` for the mix ``source``, checked and made to sum to 1 as
    :meth:`Pipeline.mix` makes them.

    Raises:
        ValueError: ``source`` is not a mix drawn by weight, or the weights are not one per
            input, finite, >= 0 and not all 0.
    """
    if not isinstance(source, MixSource) or source.pattern is not None:
        raise ValueError("set_weights() needs a Loader over Pipeline.mix(...) (a choose has "
                         "a pattern, not weights)")
    return _weights(weights, len(source.inputs))


def layout_of(inputs: Any) -> Layout | None:
    """The layout of a mix's ``inputs`` as REGISTER carries them (None: not a mix)."""
    if inputs is None:
        return None
    return Layout(tuple((int(n), bool(shuffle), seed) for n, shuffle, seed in inputs))


def register_info(source: Source) -> dict[str, Any]:
    """``REGISTER.source`` for ``source``: what the broker needs to hand its splits out."""
    info: dict[str, Any] = {"num_splits": source.num_splits,
                            "shuffle_splits": source.shuffle_splits, "seed": source.seed}
    if isinstance(source, MixSource):
        info["inputs"] = [list(item) for item in source.layout.inputs]
    return info


def input_of(key: Key) -> int | None:
    """The mix input that pass ``key`` reads (its last ``MIX_KEY + k``), or None (the
    ``GROUP_KEY`` parts of a group's rows' pass are no input, zloader/groups.py)."""
    for part in reversed(key):
        if MIX_KEY <= part < GROUP_KEY:
            return part - MIX_KEY
    return None


@dataclass(eq=False, repr=False)
class Layout(FrozenByFields):
    """Which splits each pass of a mix reads, as plain values: per input, its number of
    splits, whether it shuffles them and its seed (what ``REGISTER.source.inputs``
    carries)."""

    inputs: tuple[tuple[int, bool, int | None], ...]

    @cached_property
    def offsets(self) -> list[int]:
        return [0, *itertools.accumulate(n for n, _, _ in self.inputs)]

    def splits_of(self, key: Key) -> int:
        """How many splits pass ``key`` reads (0: a key of no input)."""
        which = input_of(key)
        return self.inputs[which][0] if which is not None and which < len(self.inputs) else 0

    def order(self, key: Key, entropy: int) -> list[int]:
        """The splits pass ``key`` reads, in order, numbered across inputs; none for a key
        that names no input."""
        which = input_of(key)
        if which is None or which >= len(self.inputs):
            return []
        count, shuffle, seed = self.inputs[which]
        offset = self.offsets[which]
        return [offset + split for split in split_order(count, shuffle, seed, entropy, key)]


@dataclass(frozen=True, eq=False, kw_only=True)
class MixSource(Source):
    """The source of a mixed pipeline: its inputs (each a source and its stages) and how
    elements are taken from them: by ``weights`` (``pattern`` None) or in ``pattern``."""

    kind: ClassVar[str] = "mix"
    inputs: tuple[Pipeline, ...]
    weights: tuple[float, ...]
    pattern: tuple[int, ...] | None
    stop: str

    @cached_property
    def layout(self) -> Layout:
        return Layout(tuple((p.source.num_splits, p.source.shuffle_splits, p.source.seed)
                            for p in self.inputs))

    @property
    def num_splits(self) -> int:
        return sum(p.source.num_splits for p in self.inputs)

    def split_order(self, key: Key, entropy: int) -> Sequence[int]:
        return self.layout.order(key, entropy)

    def splits_in(self, key: Key) -> int:
        return self.layout.splits_of(key)

    def readers(self) -> list[Source]:
        return [reader for p in self.inputs for reader in p.source.readers()]

    def _at(self, split: int) -> tuple[int, int]:
        """(input, its split) of the mix's split ``split``."""
        offsets = self.layout.offsets
        if not 0 <= split < offsets[-1]:
            raise IndexError(f"split {split} is not one of the mix's {offsets[-1]} splits")
        which = bisect.bisect_right(offsets, split) - 1
        return which, split - offsets[which]

    def read(self, split: int, policy: Any = None) -> Iterator[Any]:
        which, own = self._at(split)
        return self.inputs[which].source.read(own, policy)

    def locate(self, split: int, index: int) -> str:
        which, own = self._at(split)
        return f"input {which}: {self.inputs[which].source.locate(own, index)}"

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.weights, self.pattern, self.stop, self.seed,
                tuple((p.source.kind, p.source.identity(),
                       tuple(stage.identity() for stage in p.stages)) for p in self.inputs))

    def describe(self) -> str:
        return f"mix of {', '.join(p.source.describe() for p in self.inputs)}"

    def run(self, read: _stages.Run, ctx: Context) -> tuple[_stages.Run, int]:
        """The mixed run over ``read`` (the run that reads a pass's splits): each input's
        stages over its own passes, then the draws; and the last position up to which
        every input's stages keep their source's order (:attr:`Context.aligned`).
        Positions: each input's stages count from 1, the stages after the mix from
        :meth:`after`."""
        runs, aligned = [], []
        for made in input_runs(self, read, ctx):
            runs.append(made)
            aligned.append(ctx.aligned)

        def run(key: Key) -> Iterator[Any]:
            def streams() -> list[Iterator[Any]]:
                return [r(key) for r in runs]
            return drawn(self, streams, key, ctx)

        return run, min(aligned, default=0)

    def after(self) -> int:
        """The position of the first stage after the mix."""
        return 1 + max((len(p.stages) for p in self.inputs), default=0)


def mixed_run(source: Source, read: _stages.Run, stages: tuple[_stages.Stage, ...],
              ctx: Context, read_chunks: Any = None) -> _stages.Run:
    """``stages`` over ``source`` read by ``read`` (and ``read_chunks``), a mix's inputs
    first when ``source`` is a :class:`MixSource`."""
    if not isinstance(source, MixSource):
        return _stages.compose(read, stages, ctx, read_chunks=read_chunks)
    inner, aligned = source.run(read, ctx)
    run = _stages.compose(inner, stages, ctx, source.after(), after_mix=True)
    if aligned < source.after() - 1:  # an input reorders: after it, no element's place
        ctx.aligned = min(ctx.aligned, aligned)
    return run


def input_runs(source: MixSource, read: _stages.Run, ctx: Context
               ) -> Iterator[_stages.Run]:
    """Each input's run within the mix's pass, over ``read``: its stages over its own
    pass key (``(*key, MIX_KEY + k)``), repeated for ever (an endless ``repeat``, which
    ends when the input shows itself empty) with ``stop="never"``. Made one at a time:
    ``ctx.aligned`` is the last one's until the next is made."""
    for which, pipeline in enumerate(source.inputs):
        ctx.input_stages[which] = pipeline.stages  # (a group's elements run them again)
        inner = _stages.compose(read, pipeline.stages, ctx)
        if source.stop == "never":
            inner = _stages.Repeat(name=f"mix input {which}").wrap(inner, 0, ctx)
        yield _in_pass(inner, which)


def _in_pass(inner: _stages.Run, which: int) -> _stages.Run:
    def run(key: Key) -> Iterator[Any]:
        return inner((*key, MIX_KEY + which))
    return run


def drawn(source: MixSource, opened: Callable[[], list[Iterator[Any]]], key: Key,
          ctx: Context) -> Iterator[Any]:
    """The mix's draws in pass ``key`` over its inputs' streams (``opened()``'s, made at
    the first element; no generator of their own: each element passes through the
    draws' alone): by weight (the weights ``ctx.settings.mix_weights`` holds, when set)
    or in the pattern, under the mix's stop rule. On a dynamically sharded worker, a mix
    that ends while some inputs had not (it stopped with its first input to end, or an
    input's weight was set to 0) ends those inputs' passes there (:func:`_end_early`)."""
    def finish(ended: list[Iterator[Any]]) -> None:
        if ctx.coverage is not None:
            _end_early(ended, key, ctx)

    if source.pattern is not None:
        return _in_pattern(opened, source.pattern, source.stop, finish)
    return _by_weight(opened, np.asarray(source.weights, dtype=np.float64), source.stop,
                      lambda: ctx.rng(source.seed, 0, (*key, _DRAWS)),
                      ctx.settings.mix_weights, finish, key, ctx.settings.mix_switches)


def weights_now(source: MixSource, key: Key, ctx: Context) -> tuple[float, ...]:
    """The weights pass ``key`` of mix ``source`` drew its last elements with."""
    switches: Switches | None = ctx.settings.mix_switches
    live = ctx.settings.mix_weights
    if switches is not None and key in switches.final:
        latest = switches.final[key]  # (as they ran: a replay's are the first run's)
    else:
        latest = live.value if live is not None else None
    if latest is not None and len(latest) == len(source.inputs) and sum(latest) > 0:
        return latest
    return source.weights


def _end_early(streams: list[Iterator[Any]], key: Key, ctx: Context) -> None:
    """On a dynamically sharded worker, a mix that ended while some inputs had not (it
    stopped with its first input to end, or an input's weight was set to 0 while it ran):
    end those inputs' passes (no more splits are asked for) and drop the rest of the
    splits they were handed, read to their end, so that exactly-once counts every element
    of a split that was handed out (the consumer would wait for a split left half read).
    An input that ended has nothing left: draining it reads nothing."""
    assert ctx.coverage is not None
    for which, stream in enumerate(streams):
        ctx.coverage.end((*key, MIX_KEY + which))
        for element in stream:
            ctx.drop(element)


def _by_weight(opened: Callable[[], list[Iterator[Any]]], weights: np.ndarray, stop: str,
               seeded: Callable[[], np.random.Generator], settable: LiveWeights | None,
               finish: Callable[[list[Iterator[Any]]], None], key: Key = (),
               switches: Switches | None = None) -> Iterator[Any]:
    """Draw an input by weight for each element, among those not exhausted; an input that
    ends ends the mix (``first_exhausted``) or leaves the draw (otherwise). ``settable``:
    weights set while the mix runs (a worker's), which apply from the next element;
    ``switches``: where a shared job's worker notes when it took them (pass ``key``), or
    whence a replay takes them instead (:class:`Switches`).

    Draws come :data:`MIX_DRAW_CHUNK` at a time. Without ``settable`` (in this process),
    each input's elements for a chunk are read ahead at once (``islice``: no Python step
    per element) and, when every input had enough, put in the draws' order by one
    ``itemgetter``; an error an input raised is raised at its draw, after the elements
    drawn before it. A worker reads each element when it is drawn: an input's end is
    then decided as late as can be (a split of a dead worker may still come). What was
    read ahead and not yielded when the mix stops goes back in front of its stream, and
    ``finish`` gets the streams (``opened()``'s, made at the first element) once the mix
    ended (not when it is closed early)."""
    streams = opened()
    rng = seeded()
    done = False  # the mix ended (rather than being closed)
    ended: set[int] = set()
    failed: dict[int, BaseException] = {}  # raised by an input, after what it had read
    applied = None
    ahead: list[list[Any]] = [[] for _ in streams]  # read, not yet yielded, per input
    count = 0  # draws yielded
    scripted = switches.script(key) if switches is not None else None
    if scripted is not None:  # (a replay: the draws read the weights the first run had)
        settable = scripted
    # New weights are taken at the first chunk and after a yield that found them, never
    # after a chunk cut short by an input's end: a replay, which sees them only after a
    # yield, then switches where this run did. Weights of the same values are no switch.
    due, in_use = True, None
    try:
        while True:
            if scripted is not None:
                scripted.at(count)
            latest = settable.value if settable is not None else None
            if due and latest is not None and latest is not applied:
                applied = latest
                if latest != in_use:
                    in_use = latest
                    if switches is not None:
                        switches.took(key, count, latest)
                    if len(latest) == len(streams) and sum(latest) > 0:
                        weights = np.asarray(latest, dtype=np.float64)
            due = False
            live = [k for k in range(len(streams)) if weights[k] > 0 and k not in ended]
            if not live:
                done = True
                return
            shares = weights[live] / weights[live].sum()
            drawn = np.asarray(live)[rng.choice(len(live), size=MIX_DRAW_CHUNK, p=shares)]
            if settable is None:
                counts = np.bincount(drawn, minlength=len(streams)).tolist()
                if _read_ahead(streams, ahead, counts, live, failed):
                    yield from _interleaved(ahead, drawn, counts)
                    continue
            taken = [0] * len(streams)
            try:
                for which in drawn.tolist():
                    at = taken[which]
                    if at < len(ahead[which]):  # read ahead
                        taken[which] = at + 1
                        element = ahead[which][at]
                    else:
                        if which in failed:
                            raise failed.pop(which)
                        element = next(streams[which], _ENDED)
                        if element is _ENDED:  # this input ended here
                            if stop == "first_exhausted":
                                done = True
                                return
                            ended.add(which)  # the rest are drawn again, among those left
                            break
                    yield element
                    count += 1
                    if scripted is not None:
                        scripted.at(count)
                    value = settable.value if settable is not None else None
                    if value is not applied:
                        if value == in_use:
                            applied = value  # (the same values again)
                        else:
                            due = True
                            break  # new weights: draw the rest with them
            finally:
                for k, used in enumerate(taken):
                    del ahead[k][:used]
    finally:
        if switches is not None:
            switches.final[key] = in_use
        for k, rest in enumerate(ahead):
            if rest:
                streams[k] = itertools.chain(rest, streams[k])
        if done:
            finish(streams)


_ENDED = object()


def _read_ahead(streams: list[Iterator[Any]], ahead: list[list[Any]], counts: list[int],
                live: list[int], failed: dict[int, BaseException]) -> bool:
    """Read into ``ahead[k]`` what input ``k`` lacks for ``counts[k]`` draws (an error it
    raises goes into ``failed``); whether every input had enough."""
    whole = True
    for k in live:
        need = counts[k] - len(ahead[k])
        if need > 0 and k not in failed:
            try:
                ahead[k].extend(itertools.islice(streams[k], need))
            except Exception as exc:  # (what it read before the error stays in ahead[k])
                failed[k] = exc
        whole = whole and len(ahead[k]) >= counts[k]
    return whole


def _interleaved(ahead: list[list[Any]], drawn: np.ndarray,
                 counts: list[int]) -> tuple[Any, ...]:
    """The first ``counts[k]`` elements of each ``ahead[k]`` (taken out of it) in the
    order of the draws ``drawn`` (each position's input)."""
    parts: list[Any] = []
    for k, count in enumerate(counts):
        if count == len(ahead[k]):  # (the usual case: no copy of the part)
            parts += ahead[k]
            ahead[k] = []
        elif count:
            parts += ahead[k][:count]
            del ahead[k][:count]
    where = np.empty(len(drawn), dtype=np.int64)
    where[np.argsort(drawn, kind="stable")] = np.arange(len(drawn))
    if len(parts) == 1:
        return (parts[0],)
    return operator.itemgetter(*where.tolist())(parts)


def _in_pattern(opened: Callable[[], list[Iterator[Any]]], pattern: tuple[int, ...],
                stop: str, finish: Callable[[list[Iterator[Any]]], None]) -> Iterator[Any]:
    """Take the inputs (``opened()``'s streams) in ``pattern``, over and over; an
    exhausted input ends the mix (``first_exhausted``) or is passed over (otherwise, until
    all of the pattern's are); then ``finish`` gets the streams."""
    streams = opened()
    live = set(pattern)
    while live:
        for which in pattern:
            if which not in live:
                continue
            try:
                yield next(streams[which])
            except StopIteration:
                if stop == "first_exhausted":
                    finish(streams)
                    return
                live.discard(which)
    finish(streams)


def mixed_source(pipelines: Sequence[Pipeline], weights: Sequence[float] | None,
                 pattern: Sequence[int] | None, seed: int | None, stop: str) -> MixSource:
    """Check a mix's arguments and make its source.

    Raises:
        ValueError: fewer than one input, an input that is itself a mix or ends in a
            take/skip, weights of the wrong length, negative, not finite or all zero, a
            pattern naming no input, or an unknown stop rule.
    """
    inputs = tuple(pipelines)
    if not inputs:
        raise ValueError("a mix needs at least one input pipeline")
    for index, pipeline in enumerate(inputs):
        if isinstance(pipeline.source, MixSource):
            raise ValueError(f"mix input {index} is itself a mix: mix all the inputs in one "
                             "Pipeline.mix instead")
        if any(isinstance(stage, (_stages.Take, _stages.Skip)) for stage in pipeline.stages):
            raise ValueError(f"mix input {index} has a take/skip, which runs on the "
                             "consumer; apply it after the mix")
    if stop not in STOP_RULES:
        raise ValueError(f"stop must be one of {', '.join(map(repr, STOP_RULES))}, "
                         f"got {stop!r}")
    if pattern is not None:
        chosen = tuple(_check.integer("pattern item", k, 0) for k in pattern)
        if not chosen or max(chosen) >= len(inputs):
            raise ValueError(f"pattern must name inputs 0..{len(inputs) - 1}, got {chosen}")
        shares = tuple(float(chosen.count(k)) / len(chosen) for k in range(len(inputs)))
        return MixSource(name="choose", shuffle_splits=False, seed=None, version=None,
                         inputs=inputs, weights=shares, pattern=chosen, stop=stop)
    shares = _weights(weights, len(inputs))
    seed = _check.seed(seed)
    return MixSource(name="mix", shuffle_splits=False, seed=seed, version=None,
                     inputs=inputs, weights=shares, pattern=None, stop=stop)


def _weights(weights: Sequence[float] | None, count: int) -> tuple[float, ...]:
    """``weights`` checked and made to sum to 1, each rounded to 12 significant digits
    (equal when None). A positive weight stays positive however small, and weights too
    large to add up (``[1e308, 1e308]``) are scaled by their largest first.

    Raises:
        TypeError: ``weights`` is a string or mapping, or a weight is not a real number.
        ValueError: not ``count`` of them, or one negative or not finite, or all zero.
    """
    if weights is None:
        return tuple(_rounded(1.0 / count) for _ in range(count))
    if isinstance(weights, (str, bytes, dict)) or not hasattr(weights, "__len__"):
        raise TypeError(f"weights must be a sequence of numbers, one per input, got "
                        f"{type(weights).__name__} {weights!r:.80}")
    values = []
    for at, weight in enumerate(weights):
        if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, (int, float,
                                                                         np.number)):
            raise TypeError(f"weights[{at}] must be a real number, got "
                            f"{type(weight).__name__} {weight!r:.40}")
        values.append(float(weight))
    if len(values) != count:
        raise ValueError(f"weights must have one weight per input ({count}), "
                         f"got {len(values)}")
    if any(not np.isfinite(w) or w < 0 for w in values) or max(values) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {values}")
    top = max(values)
    scaled = [w / top for w in values]  # (in [0, 1]: their sum cannot overflow)
    total = sum(scaled)
    # Rounded, so that weights equal up to float error ([0.6, 0.3, 0.1] and [6, 3, 1]) make
    # the same mix: the same draws and the same fingerprint.
    return tuple(_rounded(w / total) for w in scaled)


def _rounded(share: float) -> float:
    """``share`` to 12 significant digits: a positive share never rounds to 0."""
    return float(f"{share:.12g}")
