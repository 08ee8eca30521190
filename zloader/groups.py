"""Groups: rows that a stage made of a batch in another number, kept exactly-once.

Pipelines that pack, chunk or tokenize write ``batch(k).map(f).unbatch()`` with ``f``
returning any number of rows. Under exactly-once (zloader/lineage/) the unbatch cannot
give each row one source element's origin; instead the batch's elements become a
:class:`~zloader.lineage.Group`:

- each row's origin is its own: row ``j`` of the group, in a pass of the group's own
  (:attr:`Group.rows_key`); the group itself (its elements, in the batch's order, and its
  number of rows) rides with every record that holds a row of it (``RunTally.block``),
  and with none other, so whichever consumer gets a row knows the group;
- a consumer holds the group's elements from when it learns of the group, and keeps the
  split of its first element (its *anchor*) open until every row is held;
- a row that never arrives (its worker died) or was not yielded when a state was taken is
  made again: the anchor's split is handed out again with the group and the rows to leave
  out, and the worker reading it reads the group's elements from the source, runs them
  through the stages before the batch (maps and filters; shuffles and repeats only move
  them), makes the batch and runs the map again, then sends the rows missing
  (:func:`rebuilt`), through the rest of the pipeline.

That asks of the user's code what exactly-once already asks of a split (docs/reliability.md):
the stages up to the unbatch give the same rows each time (a map that draws at random
before a packer would make other rows). A group made again with another number of rows is
reported. A group whose elements are rows of other groups (a packer after a batched
tokenizer) names those rows, and is made again from those groups, made again first. What
cannot be made again is refused when the Loader is made (:func:`refusal`): a batch before
such a stage that no unbatch undoes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zloader import collate
from zloader._byfields import FrozenByFields
from zloader._defaults import GROUP_KEY, MIX_KEY
from zloader._seeding import Key
from zloader.errors import PipelineError
from zloader.lineage import (
    INDEX_BITS,
    INDEX_MASK,
    Group,
    MemberRuns,
    gather,
    group_of_rows,
    runs_of_list,
)

__all__ = ["Section", "announce", "kept", "pipeline_refusal", "rebuilt", "refusal", "sections",
           "tag"]

_ELEMENTWISE = frozenset(("map", "filter"))  # (between a batch and its unbatch)
_GROUPING = frozenset(("batch", "bucket_by_length"))


@dataclass(eq=False, repr=False)
class Section(FrozenByFields):
    """An ``unbatch`` and what comes before it, as a group's rows are made again: ``head``
    (the batch it undoes, or None: it splits elements as they come), ``between`` (the
    batch's maps and filters), ``before`` (the stages before the batch, or before the
    unbatch without one, in the same run, the first at position ``first``) and
    ``after_mix`` (the run is the stages after a mix: each element first runs its
    input's stages, ``Context.input_stages``)."""

    head: Any
    between: tuple[Any, ...]
    before: tuple[Any, ...]
    first: int
    after_mix: bool
    unbatch: Any = None

    def keeps_rows(self, elements: int, rows: int) -> bool:
        """Whether ``rows`` rows made of ``elements`` elements are those elements, one
        each (each row then keeps its element's origin), rather than a group: as many,
        and no map between the batch and the unbatch that could have made others (any
        map could: one that tokenizes a batch or one that packs it look alike)."""
        return elements == rows and not any(stage.kind == "map" for stage in self.between)


def kept(section: Section | None, origin: Any, rows: int) -> bool:
    """Whether the ``rows`` rows an unbatch (of ``section``) made of a batch whose
    elements hold ``origin`` keep their elements' origins, one each."""
    return section.keeps_rows(len(origin), rows) if section is not None \
        else len(origin) == rows


def sections(stages: Sequence[Any], first_position: int,
             after_mix: bool = False) -> dict[int, Section]:
    """The sections of ``stages`` (positions from ``first_position``; ``after_mix``: the
    stages after a mix), by the position of their unbatch."""
    found: dict[int, Section] = {}
    for at, stage in enumerate(stages):
        if stage.kind != "unbatch":
            continue
        head = at - 1
        while head >= 0 and stages[head].kind in _ELEMENTWISE:
            head -= 1
        if head >= 0 and stages[head].kind in _GROUPING:
            found[first_position + at] = Section(stages[head], tuple(stages[head + 1:at]),
                                                 tuple(stages[:head]), first_position,
                                                 after_mix, stage)
        else:
            found[first_position + at] = Section(None, (), tuple(stages[:at]),
                                                 first_position, after_mix, stage)
    return found


def refusal(stages: Sequence[Any], inputs: Sequence[Sequence[Any]] = ()) -> str | None:
    """Why an unbatch of ``stages`` (the stages after a mix of ``inputs``' stages, or a
    pipeline's) could not have its rows made again, naming the stage; None when every
    one can."""
    for index, section in sections(stages, 1).items():
        blocking = _blocking(section.before)
        for which, own in enumerate(inputs):
            blocking = blocking or _blocking(own, f" (in mix input {which})")
        if blocking:
            return (f"exactly-once cannot follow the rows of {stages[index - 1].name!r}: "
                    f"{blocking} before its batch groups elements that no unbatch gives "
                    "back, so a row lost with its worker could not be made again; move "
                    "it, or pass exactly_once=False")
    return None


def pipeline_refusal(pipeline: Any) -> str | None:
    """:func:`refusal` for a whole pipeline: its stages, and a mix's inputs' (each alone,
    then the stages after the mix with all of them)."""
    inputs = [p.stages for p in getattr(pipeline.source, "inputs", None) or ()]
    for own in inputs:
        found = refusal(own)
        if found:
            return found
    return refusal(pipeline.stages, inputs)


def _blocking(stages: Sequence[Any], where: str = "") -> str | None:
    """The first stage of ``stages`` that a group's element cannot be run through alone
    (a batch no unbatch undoes)."""
    for at, stage in enumerate(stages):
        if stage.kind in _GROUPING and _undone(stages, at) is None:
            return f"{stage.name!r}{where}"
    return None


def _undone(stages: Sequence[Any], head: int) -> int | None:
    """The position in ``stages`` of the unbatch that undoes the batch at ``head``."""
    at = head + 1
    while at < len(stages) and stages[at].kind in _ELEMENTWISE:
        at += 1
    return at if at < len(stages) and stages[at].kind == "unbatch" else None


# --- on a worker: making groups, and making their rows again ----------------------------------


def tag(ctx: Any, stage: Any, rows: list[Any], origin: Any, position: int) -> Iterator[Any]:
    """The rows an unbatch made of a batch whose elements hold ``origin`` (codes), when
    they are not one per element: each tagged as row ``j`` of a new group, which goes
    with every record holding a row of it (``RunTally.block``).

    Its elements may be rows of other groups (a packer after a batched tokenizer): its
    members then name those rows.
    """
    if ctx.regroup is not None:  # (a consumer drawing a mix: its origins are handles)
        return ctx.regroup.tag(rows, origin, position) if rows else iter(())
    tally = ctx.tally
    codes = origin if isinstance(origin, np.ndarray) else gather(list(origin))
    if not len(codes) or not rows:
        return iter(())
    anchor = int(codes[0])
    pass_id, split = tally.reads[anchor >> INDEX_BITS]
    runs = runs_of_list(codes.tolist(), tally.reads)
    flat = list(itertools.chain.from_iterable(runs))  # (pass id, split, first, length, ...)
    ids = flat[0::4]
    # as a block holds it (_wire), made at once: a shuffled batch's runs are its elements
    wire = [pass_id, split, anchor & INDEX_MASK, position, len(rows), len(runs), *flat]
    flat[0::4] = map(tally.keys.__getitem__, ids)
    group = Group(tally.keys[pass_id], split, anchor & INDEX_MASK, position, len(rows),
                  MemberRuns(tuple(flat)))
    inner: list[list[int]] = []  # (the groups of rows it holds, and theirs, as blocks hold them)
    if any(group_of_rows(tally.keys[number], 0) for number in set(ids)):
        for read in np.unique(codes >> INDEX_BITS).tolist():
            if read in tally.group_reads:
                inner += [tally.group_reads[read], *tally.group_inner.get(read, ())]
    return _tagged(tally, group, rows, range(len(rows)), inner, wire)


def _tagged(tally: Any, group: Group, rows: list[Any], which: Sequence[int],
            inner: list[list[int]], wire: list[int] | None = None) -> Iterator[Any]:
    """``rows`` (rows ``which`` of ``group``), each with its own origin; ``group`` and
    ``inner`` (the groups whose rows it holds, and theirs) go with every record holding
    a row of it, and with no other. So a consumer knows a group only if it holds rows of
    it, or of a group holding its rows: one that got none of its rows (they went to
    another consumer of a ``job_name``) claims none of its elements, and one that gets
    packed rows, and not the record of the group they were packed from, can have them
    made again. Rows that no consumer got (their worker died) leave the group's elements
    unclaimed: read again, they make the rows again. ``wire``: ``group`` as a block holds
    it, when made already."""
    rows_read = len(tally.reads)
    tally.reads.append((tally.pass_id(group.rows_key), group.split))
    tally.group_reads[rows_read] = wire if wire is not None else _wire(tally, group)
    if inner:
        tally.group_inner[rows_read] = inner
    base = rows_read << INDEX_BITS
    return zip(rows, ((base | j,) for j in which), strict=True)


def announce(tally: Any, group: Group) -> None:
    """Put ``group`` in the next record: a group the consumer made (it draws the mix)
    whose anchor this worker reads again; the consumer that gets the record makes its
    rows."""
    tally.groups.append(_wire(tally, group))


def _wire(tally: Any, group: Group) -> list[int]:
    """``group`` as an origin block holds it (its keys as ``tally``'s pass ids)."""
    wire = [tally.pass_id(group.key), group.split, group.index, group.position, group.rows,
            len(group.members)]
    for key, split, first, length in group.members:
        wire += (tally.pass_id(key), split, first, length)
    return wire


def rebuilt(ctx: Any, stage: Any, position: int, key: Key) -> Iterator[Any]:
    """The rows to make again of the groups handed to this worker (``ctx.rebuilds``, put
    there as their anchor's split is read) that the unbatch ``stage`` at ``position``
    made, tagged as they were the first time.

    Raises:
        PipelineError: a group made again gave another number of rows, or holds rows of
            a group it was not handed with.
    """
    section = ctx.sections.get((id(stage), position))
    if section is None:
        return
    mine = _input(key)
    # Taken out of the list before any row is yielded: while this generator waits, the
    # run's other unbatches (a mix's inputs') take theirs, and splits read add more.
    taken = [entry for entry in ctx.rebuilds if entry[0].position == position
             and (section.after_mix or _input(entry[0].key) == mine)]
    for entry in taken:
        ctx.rebuilds.remove(entry)
    read: dict[int, list[Any]] = {}  # (splits read for these groups: often the same ones)
    for group, skip in taken:
        try:
            rows = _made(ctx, section, group, {one.id: one for one in group.inner}, read)
        except Exception as exc:  # (a PipelineError passes as it is)
            where = ("a group made again in the trainer's process, which reads its elements "
                     "from the source (docs/semantics.md, 'Mixing')"
                     if ctx.regroup is not None else "a group made again")
            raise PipelineError.from_exception(exc, stage.name, where) from exc
        if len(rows) != group.rows:
            raise PipelineError.create(
                stage.name, "RuntimeError",
                f"a group made again gave {len(rows)} rows, {group.rows} the first time: "
                "exactly-once makes rows lost with a worker again, which needs the stages "
                "up to this unbatch to give the same rows each time (seed randomness per "
                "element); pass exactly_once=False to accept losses instead",
                builtin="RuntimeError")
        which = [j for j in range(group.rows) if j not in skip]
        picked = [rows[j] for j in which]
        yield from (ctx.regroup.rows(group, picked, which) if ctx.regroup is not None
                    else _tagged(ctx.tally, group, picked, which,
                                 [_wire(ctx.tally, one) for one in group.inner]))


def _input(key: Key) -> int | None:
    """The mix input whose pass ``key`` is (zloader.mixing.input_of), a group's rows'
    pass (``GROUP_KEY + position``) included."""
    return next((part - MIX_KEY for part in reversed(key) if MIX_KEY <= part < GROUP_KEY),
                None)


def _made(ctx: Any, section: Section, group: Group,
          inner: dict[tuple[Key, int, int, int], Group],
          read: dict[int, list[Any]]) -> list[Any]:
    """The rows of ``group`` (of ``section``), made again: its elements read from the
    source (``read``: the splits read so far, by number) and run through the stages
    before the batch, or for rows of ``inner`` groups, those groups made again first."""
    values = []
    for key, split, first, length in group.members:
        gid = group_of_rows(key, split)
        if gid is None:
            if split not in read:
                read[split] = list(ctx.source.read(split, ctx))
            path = [*_input_stages(ctx, section, key), *section.before]
            taken = read[split][first:first + length]
        else:
            own = inner.get(gid)
            if own is None:
                raise PipelineError.create(
                    "unbatch", "RuntimeError", "a group holding rows of another group was "
                    "handed out without it: its rows cannot be made again",
                    builtin="RuntimeError")
            below = _section_at(ctx, own)
            taken = _made(ctx, below, own, inner, read)[first:first + length]
            path = _after(ctx, below, section)
        for value in taken:
            value = _through(value, path)
            if value is not _DROPPED:
                values.append(value)
    if section.head is None:  # (an unbatch of elements as they come: one element)
        return [row for value in values for row in collate.split(value)]
    if section.head.kind == "bucket_by_length":
        batch = collate.stack(values, section.head.pad_value)
    else:
        batch = collate.stack(values)
    batch = _through(batch, section.between)
    return [] if batch is _DROPPED else list(collate.split(batch))


def _input_stages(ctx: Any, section: Section, key: Key) -> tuple[Any, ...]:
    """The stages of the mix input an element of pass ``key`` went through before the
    stages after the mix (none when ``section`` is not after a mix)."""
    return ctx.input_stages[_input(key)] if section.after_mix else ()


def _section_at(ctx: Any, group: Group) -> Section:
    """The section whose unbatch made ``group`` (at its position; in a mix, of the input
    its elements came from, or after the mix)."""
    found = [section for (_, position), section in ctx.sections.items()
             if position == group.position]
    own = ctx.input_stages.get(_input(group.key), ())
    for section in found:
        if len(found) == 1 or any(stage is section.unbatch for stage in own):
            return section
    raise PipelineError.create("unbatch", "RuntimeError", "no unbatch at position "
                               f"{group.position} made the group to make again",
                               builtin="RuntimeError")


def _after(ctx: Any, below: Section, section: Section) -> list[Any]:
    """The stages between the unbatch of section ``below`` and the batch of ``section``
    (which follows it in the run, or after the mix ``below`` is an input of)."""
    if section.after_mix and not below.after_mix:
        for stages in ctx.input_stages.values():  # (the input that holds ``below``)
            at = _index(stages, below.unbatch)
            if at >= 0:
                return [*stages[at + 1:], *section.before]
    return list(section.before[_index(section.before, below.unbatch) + 1:])


def _index(stages: Sequence[Any], stage: Any) -> int:
    """Where ``stage`` (the very object) is in ``stages``; -1: not there."""
    return next((at for at, one in enumerate(stages) if one is stage), -1)


_DROPPED = object()


def _through(value: Any, stages: Sequence[Any]) -> Any:
    """``value`` run alone through ``stages`` (maps and filters; a batch undone by an
    unbatch as a batch of one; an unbatch of a map's rows, with no batch before it, as the
    one row it made of this element the first time: more, and it would have made a group;
    shuffles and repeats pass it on), or _DROPPED.

    Raises:
        RuntimeError: an unbatch with no batch before it made other than one row of it.
    """
    at = 0
    while at < len(stages) and value is not _DROPPED:
        stage = stages[at]
        if stage.kind == "unbatch":
            rows = list(collate.split(value))
            if len(rows) != 1:
                raise RuntimeError(
                    f"an element made again gave {len(rows)} rows at an unbatch, one the "
                    "first time: exactly-once makes rows lost with a worker again, which "
                    "needs the stages up to the unbatch to give the same rows each time "
                    "(seed randomness per element); pass exactly_once=False to accept "
                    "losses instead")
            value = rows[0]
        elif stage.kind == "map":
            value = stage.fn(value)
        elif stage.kind == "filter":
            value = value if stage.predicate(value) else _DROPPED
        elif stage.kind in _GROUPING:
            end = _undone(stages, at)
            assert end is not None  # (refusal() refused the others)
            pad = stage.pad_value if stage.kind == "bucket_by_length" else None
            batch = _through(collate.stack([value], pad), stages[at + 1:end])
            rows = [] if batch is _DROPPED else list(collate.split(batch))
            value = rows[0] if len(rows) == 1 else _DROPPED
            at = end
        at += 1
    return value
