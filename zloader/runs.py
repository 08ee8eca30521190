"""One run of a pipeline: what it is given (:class:`RunSettings`), what it counts as it
goes (:class:`RunTally`), and the :class:`Context` its stages share, made of the two and
of where the run is; :class:`Coverage` tells a worker's endless repeat an empty input from
a repetition other workers read. Sources see the context as the ``policy`` of
``Source.read(split, policy)`` (``policy.settings``, ``policy.tally``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zloader import _native, collate, groups
from zloader._byfields import ByFields, FrozenByFields
from zloader._defaults import ORIGINS_NAMED
from zloader._seeding import Key, make_rng
from zloader.chunks import Chunk, chunks_of
from zloader.lineage import INDEX_BITS, INDEX_MASK, Origin, gather, untag
from zloader.lineage import encode_origins as _pure_encode_origins

if TYPE_CHECKING:
    from zloader.stages import Stage

__all__ = ["Context", "Coverage", "RunSettings", "RunTally"]

encode_origins = _native.pick("encode_origins", _pure_encode_origins)
"""A record's origin block written: compiled where built (zloader/_native.py)."""


@dataclass(eq=False, repr=False)
class RunSettings(FrozenByFields):
    """How a run goes, fixed when it starts.

    Attributes:
        entropy: random bits for stages with ``seed=None`` (drawn per run, or per job).
        worker: index of the worker running this part; workers other than 0 mix it into
            their random draws so they do not repeat worker 0's.
        workers: how many workers run this part (1 in-process).
        skip_errors: drop elements whose user code raises (``on_error="skip"``) instead of
            raising; each drop adds one to ``RunTally.skipped``.
        track: elements are ``(value, origin)`` pairs (:data:`~zloader.lineage.Tagged`; a
            worker part run for exactly-once epochs); stages apply user code to their
            values.
        round_size: the consumers of a coordinated job (``num_consumers``), which read
            ``round_size`` consecutive elements per round; ``bucket_by_length`` then emits
            its batches ``round_size`` at a time from one bucket. 1 otherwise.
        epoch_input: what the consumer sent with this epoch (adapters use it to hand
            workers the epoch's sampled batches); None for plain pipelines.
        mix_weights: a worker's :class:`~zloader.mixing.LiveWeights`: a mix's weights as
            its consumer last set them (None: the mix's own).
        mix_switches: a shared job's worker's :class:`~zloader.mixing.Switches`: where
            it notes when its mix took new weights, or whence a replay takes them.
        dispatched: on a worker, what returns the next work item its consumer dispatched
            (``Loader.dispatch``; waits for one; None once none will follow), for a
            source whose ``dispatched`` is True; None in-process. Called with a count
            ``n``, a list of the next ``n`` items (fewer only when none follow them).
    """

    entropy: int
    worker: int = 0
    workers: int = 1
    skip_errors: bool = False
    track: bool = False
    round_size: int = 1
    epoch_input: Any = None
    mix_weights: Any = None
    mix_switches: Any = None
    dispatched: Callable[..., Any] | None = None


@dataclass(eq=False, repr=False)
class RunTally(ByFields):
    """What a run counts and collects as it goes, for the records it sends.

    Attributes:
        skipped: elements dropped because their user code raised (``skip_errors``).
        dropped: elements dropped to keep rounds whole (a bucket's last, incomplete round).
        loose: origins (codes) of elements dropped on the way, sent with the next record
            so the consumer counts them as accounted for.
        ends: ``[pass id, split, count, digest]`` of each split read, for the next record.
        pass_keys: the pass ids used in origins, by pass key (:meth:`pass_id`), and
        keys: the pass keys by pass id.
        reads: (pass id, split) of each split reading, by the read number in the origin
            codes (zloader/lineage/tags.py: ``code``).
        groups: the groups named to the next record whatever its rows (a group the
            consumer makes, whose anchor was read again: zloader/groups.py ``announce``),
            as the origin block holds them.
        group_reads: each group's as the block holds it, by the read number that names
            its rows: a record holding rows of a group holds the group too, so that
            whichever consumer gets a row knows the group (a ``job_name``'s consumers
            share a worker's records).
        group_inner: by the same read number, the groups whose rows that group holds,
            and theirs, as the block holds them: they ride with its rows too.
    """

    skipped: int = 0
    dropped: int = 0
    loose: list[int] = field(default_factory=list)
    ends: list[list[int]] = field(default_factory=list)
    pass_keys: dict[Key, int] = field(default_factory=dict)
    keys: list[Key] = field(default_factory=list)
    reads: list[tuple[int, int]] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    group_reads: dict[int, list[int]] = field(default_factory=dict)
    group_inner: dict[int, list[list[int]]] = field(default_factory=dict)

    def pass_id(self, key: Key) -> int:
        """The pass id of pass ``key`` in origins, given on first use (a group's rows
        have a pass of their own, so there are as many as groups in a run)."""
        number = self.pass_keys.get(key)
        if number is None:
            number = self.pass_keys[key] = len(self.keys)
            self.keys.append(key)
        return number

    def block(self, origins: Sequence[Origin]) -> bytes:
        """The origin block of a record whose elements hold ``origins``, with the loose
        codes, split ends and groups collected since the last block (then emptied), and
        the groups of the rows it holds."""
        groups = self.groups
        if self.group_reads:
            codes = gather(origins) if origins else np.empty(0, np.int64)
            if self.loose:
                codes = np.concatenate((codes, np.array(self.loose, np.int64)))
            reads = np.unique(codes >> INDEX_BITS).tolist()
            held = [group for read in reads if read in self.group_reads
                    for group in (self.group_reads[read], *self.group_inner.get(read, ()))]
            if held:
                named = set(map(id, groups))
                groups = list(groups)
                for group in held:
                    if id(group) not in named:
                        named.add(id(group))
                        groups.append(group)
        block = encode_origins(origins, self.loose, self.reads, self.pass_keys, self.ends,
                               groups, self.keys)
        self.loose, self.ends, self.groups = [], [], []
        return block


class Coverage:
    """Which splits a run that reads only the splits it is handed (a dynamically sharded
    worker) has read afresh, so that an endless ``repeat`` can tell an empty input from a
    repetition whose splits other workers took.

    In one process every repetition reads every split, so one that yields nothing shows
    the input empty. A worker's repetition may yield nothing only because the other
    workers were handed that pass's splits: ending its repeat then would end its epoch,
    and once those workers die, the whole epoch, short and without an error. So a worker
    ends an endless repeat only when its repetitions since the last element together read
    every split of the source afresh (a whole pass's worth of empty splits), when the
    source has no splits, or when it is leaving (``leaving()``: its passes end at once).

    A run may also end a pass early (:meth:`end`: a mix that stops with its first input to
    end): the worker then asks for no more of that pass's splits, and reads to their end
    the splits it was handed, which the run drops (so that exactly-once counts them).
    """

    def __init__(self, num_splits: int | Callable[[Key], int],
                 leaving: Callable[[], bool]) -> None:
        # the splits of a pass: as many for every pass, or per pass key (a mix's inputs)
        self.splits_of = num_splits if callable(num_splits) else (lambda key: num_splits)
        self.leaving = leaving
        self._fresh: dict[Key, set[int]] = {}  # pass key -> splits read afresh in it
        self._ended: set[Key] = set()  # passes (and the passes under them) ended early

    def read(self, key: Key, split: int, fresh: bool) -> None:
        """The run read ``split`` in pass ``key``; ``fresh``: whole, in its own pass (not
        a re-queued split of another pass, nor one with elements to skip)."""
        if fresh:
            self._fresh.setdefault(key, set()).add(split)

    def end(self, key: Key) -> None:
        """End pass ``key`` and the passes under it early: no more splits are asked for."""
        self._ended.add(key)

    def ended(self, key: Key) -> bool:
        """Whether pass ``key`` was ended early (it, or a pass it is under)."""
        return bool(self._ended) and any(key[:len(ended)] == ended for ended in self._ended)

    def close(self, key: Key) -> set[int]:
        """The splits read afresh in repetition ``key`` and the passes under it; they are
        handed on to the repetition above (a repeat nested in another)."""
        found: set[int] = set()
        for under in [k for k in self._fresh if k[:len(key)] == key]:
            found |= self._fresh.pop(under)
        if found and len(key) > 1:
            self._fresh.setdefault(key[:-1], set()).update(found)
        return found


@dataclass(eq=False, repr=False)
class Context(ByFields):
    """What one run of a pipeline shares between its stages: its :class:`RunSettings`
    (fixed), its :class:`RunTally` (counted as it goes) and where it is.

    Attributes:
        settings: how the run goes (seeds, worker, error policy, tracking, inputs).
        tally: what it counted (skipped, dropped, origins) for the records it sends.
        source: the source being read (its splits name elements in error messages).
        at: (split, index) of the element the source yielded last (untracked runs).
        aligned: the last stage position whose input still comes in the source's order,
            one element at a time, so that ``at`` names the element it works on.
        coverage: the splits read afresh, for a run that reads only the splits it is
            handed (a dynamically sharded worker); None when every pass reads them all.
        records_from: the position of the stage whose elements become records as they
            come (a worker part's last), where a ``batch`` leaves large arrays to the
            record's copy (``collate.stack(later=True)``); 0: none (an in-process run).
        sections: the unbatches that undo a batch, by (stage id, position), to make a
            group's rows again (zloader/groups.py).
        rebuilds: the groups whose rows this run is to make again, with the rows to
            leave out, put there as their anchor's split is read.
        input_stages: a mix's inputs' stages, by input.
        regroup: where the consumer draws a mix, what tags the rows of the groups its
            unbatches make (their origins are its handles: zloader/client/draw.py
            ``Regroup``); None on a worker.
    """

    settings: RunSettings
    tally: RunTally = field(default_factory=RunTally)
    source: Any = None
    at: tuple[int, int] | None = None
    aligned: int = 0
    coverage: Coverage | None = None
    records_from: int = 0
    sections: dict[tuple[int, int], groups.Section] = field(default_factory=dict)
    rebuilds: list[Any] = field(default_factory=list)
    input_stages: dict[int | None, tuple[Stage, ...]] = field(default_factory=dict)
    regroup: Any = None

    def note_sections(self, stages: Sequence[Stage], first_position: int,
                      after_mix: bool = False) -> None:
        """Keep the unbatches of ``stages`` (positions from ``first_position``) that undo a
        batch, so that a group's rows can be made again (:attr:`sections`)."""
        for position, section in groups.sections(stages, first_position, after_mix).items():
            self.sections[(id(stages[position - first_position]), position)] = section

    def value(self, element: Any) -> Any:
        """An element's value: itself, or a tracked element's value (its origin left)."""
        return element[0] if self.settings.track else element

    def values_of(self, elements: list[Any]) -> list[Any]:
        """The values of ``elements`` (the list itself when untracked)."""
        return [tagged[0] for tagged in elements] if self.settings.track else elements

    def rng(self, seed: int | None, position: int, key: Key) -> Any:
        if self.settings.worker:
            key = (*key, self.settings.worker)
        return make_rng(seed, self.settings.entropy, position, key)

    def drop(self, element: Any) -> None:
        """``element`` goes no further: keep its origins (when tracked) as loose ones."""
        if self.settings.track:
            origin = element[1]
            self.tally.loose.extend(origin.tolist() if isinstance(origin, np.ndarray) else origin)

    def drop_chunk(self, origins: Any) -> None:
        """The elements holding ``origins`` (a :class:`Chunk`'s) go no further."""
        if origins is not None and len(origins):
            self.tally.loose.extend(gather(origins).tolist())

    def values(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` as it applies to the elements of this run (to a tagged element's value,
        keeping the tag, when tracked)."""
        if not self.settings.track:
            return fn
        return lambda tagged: (fn(tagged[0]), tagged[1])

    def input_empty(self, key: Key, empty: set[int]) -> bool:
        """Whether repetition ``key`` of an endless repeat, which yielded nothing, shows
        its input empty (:class:`Coverage`). ``empty``: the splits read afresh in the
        repetitions since the repeat's last element, to which this one's are added."""
        coverage = self.coverage
        if coverage is None:
            return True
        empty |= coverage.close(key)
        return coverage.leaving() or len(empty) >= coverage.splits_of(key)

    def read(self, split: int) -> Iterator[Any]:
        """The elements of ``split`` of :attr:`source`, noting in :attr:`at` where each
        came from."""
        for index, element in enumerate(self.source.read(split, self)):
            self.at = (split, index)
            yield element

    def read_chunks(self, split: int, size: int = 0) -> Iterator[Chunk]:
        """The elements of ``split`` of :attr:`source` in chunks of ``size``
        (:func:`chunks_of`), for a first stage that takes chunks: it reorders or groups
        them, so :attr:`at` names none of them and is not kept."""
        return chunks_of(iter(self.source.read(split, self)), False, size)

    def where(self, element: Any, position: int, at: tuple[int, int] | None = None) -> str:
        """Where in the input ``element``, met by the stage at ``position``, came from
        (``"split 2, index 3"``), or ``""`` when that is not known: an untracked element
        after a stage that reorders or groups elements. ``at`` overrides :attr:`at` (the
        position when the element was taken, for work done later)."""
        if self.source is None:
            return ""
        if self.settings.track:
            return self._origins(element[1])
        at = at if at is not None else self.at
        if position > self.aligned or at is None:
            return ""
        return str(self.source.locate(*at))

    def _origins(self, origin: Origin) -> str:
        places = [self._place(code) for code in map(int, origin[:ORIGINS_NAMED])]
        count = len(origin)
        if count <= 1:
            return "".join(places)
        more = f"; and {count - len(places)} more" if count > len(places) else ""
        return f"{count} elements: " + "; ".join(places) + more

    def _place(self, code: int) -> str:
        """Where the element of origin ``code`` came from: its source element, or for a
        row of a group (zloader/groups.py) the batch it was made of."""
        read = code >> INDEX_BITS
        pass_id, split = self.tally.reads[read]
        if read in self.tally.group_reads:
            key = self.tally.keys[pass_id]
            return (f"row {code & INDEX_MASK} made of the batch that begins at "
                    f"{self.source.locate(split, key[-1])}")
        return str(self.source.locate(split, code & INDEX_MASK))

    def stack(self, elements: list[Any], pad_value: Any = None) -> Any:
        """``collate.stack`` of ``elements``; a tracked batch holds its rows' origins as
        one int64 array (:func:`~zloader.lineage.gather`)."""
        if not self.settings.track:
            return collate.stack(elements, pad_value)
        values, codes = untag(elements)
        return collate.stack(values, pad_value), codes
