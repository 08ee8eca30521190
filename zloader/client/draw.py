"""The consumer's side of a mix it draws (zloader/plan.py, docs/semantics.md "Mixing"):
the workers send one stream per input (each record holds elements of one input,
``Data.part``, and an input's END says a worker has no more of it); :class:`Inputs` keeps a
queue per input and hands the draws each input's stream, taking the I/O thread's items as
the draws need them.

An input has ended here when every worker serving the job said so (or the epoch is
done). A record's credit goes back (for its input) once the draws took its last element,
so each worker's records in flight are bounded per input, and a worker holding splits of
an input the draws wait for is never kept from sending it by records of another.

Exactly-once: each element drawn is tagged with a *handle* (its record's first handle
plus its place in the record), which the stages after the mix carry as they carry
origins on a worker; :class:`Handles` notes in the state's ledger the origins of the
elements in each output yielded (and of those the stages dropped), so that a state counts
exactly what was yielded, whatever those stages hold back (a shuffle's buffer, a batch
being filled).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zloader._seeding import Key
from zloader.client.items import Data, Done, End, InputEnd
from zloader.lineage import Group, Ledger, Origins, anchor_split, gather

if TYPE_CHECKING:
    from zloader.client.merging import Merger

__all__ = ["Handles", "Inputs", "MixOrder", "Order", "Regroup", "in_turn"]


@dataclass(eq=False)
class _Held:
    """A record of one input, in its queue until the draws took all of it."""

    data: Data
    base: int  # the handle of its first element
    at: int = 0  # its next element


@dataclass(eq=False)
class _Record:
    """A record some of whose elements are not yielded yet (exactly-once); or the rows
    of a group this consumer made (``origins`` a :class:`_Rows`)."""

    origins: Origins | _Rows
    size: int
    yielded: set[int] = field(default_factory=set)
    expanded: tuple[list[int], list[tuple[Key, int, int]]] | None = None  # (origins_of)


class _Rows:
    """The origins of rows ``which`` of ``group`` (a group this consumer made), noted as
    a record's :class:`~zloader.lineage.Origins` are."""

    groups = None

    def __init__(self, group: Group, which: Sequence[int]) -> None:
        self.group, self.which = group, list(which)

    def note(self, ledger: Ledger, elements: int | None = None) -> None:
        self._add(ledger, self.which if elements is None else self.which[:elements])

    def note_some(self, ledger: Ledger, elements: Sequence[int], size: int) -> None:
        self._add(ledger, [self.which[at] for at in elements])

    def expanded(self, size: int) -> tuple[list[int], list[tuple[Key, int, int]]]:
        key, split = self.group.rows_key, self.group.split
        return list(range(size + 1)), [(key, split, row) for row in self.which]

    def _add(self, ledger: Ledger, rows: list[int]) -> None:
        if rows:
            split = self.group.split
            ledger.add({0: self.group.rows_key},
                       np.array([[0, split, row, 1] for row in rows], np.int64))


class Handles:
    """The records whose elements are out, by the handle of their first element: what an
    output's handles name, noted in the ledger of what was yielded."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._bases: list[int] = []  # sorted: the order the records came in
        self._records: dict[int, _Record] = {}
        self._defined: set[int] = set()  # records whose groups the ledger knows

    def origins_of(self, handles: Sequence[int]) -> list[tuple[Key, int, int]]:
        """The origins (pass key, split, index) of the elements ``handles`` name, in
        order (an element may hold several, or none)."""
        found: list[tuple[Key, int, int]] = []
        for handle in handles:
            at = bisect.bisect_right(self._bases, handle) - 1
            record = self._records[self._bases[at]] if at >= 0 else None
            if record is None or not 0 <= handle - self._bases[at] < record.size:
                raise RuntimeError(f"an element of handle {handle} is not held here")
            if record.expanded is None:
                record.expanded = record.origins.expanded(record.size)
            starts, flat = record.expanded
            index = handle - self._bases[at]
            found.extend(flat[starts[index]:starts[index + 1]])
        return found

    def define_all(self) -> None:
        """Note in the ledger the groups the records held name (before a group whose
        elements may be rows of theirs)."""
        self._define(self.ledger, self._bases, self._defined)

    def add(self, base: int, origins: Origins | _Rows, size: int) -> None:
        """A record came whose elements are handles ``base`` .. ``base + size - 1``."""
        if size == 0:  # (only origins of elements dropped on the way, and split ends)
            origins.note(self.ledger)
            return
        self._bases.append(base)
        self._records[base] = _Record(origins, size)

    def yielded(self, handles: np.ndarray) -> None:
        """The elements of ``handles`` were yielded (or dropped by the stages after the
        mix): a record all of whose elements were is noted whole."""
        for handle in handles.tolist():
            at = bisect.bisect_right(self._bases, handle) - 1
            if at < 0:
                continue
            base = self._bases[at]
            record = self._records[base]
            record.yielded.add(handle - base)
            if len(record.yielded) == record.size:
                self._define(self.ledger, self._bases[:at], self._defined)
                record.origins.note(self.ledger)
                del self._records[base]
                del self._bases[at]
                self._defined.discard(base)

    def _define(self, ledger: Ledger, bases: list[int], done: set[int] | None = None) -> None:
        """Note in ``ledger`` the groups the records of ``bases`` name (not their
        elements): a record's groups may hold rows of groups an earlier record named
        (groups of groups' rows), which the ledger must know first, as it would had the
        records been yielded in the order they came (a shuffle after the mix yields
        them in another)."""
        for base in bases:
            if done is not None and base in done:
                continue
            groups = self._records[base].origins.groups
            if groups:
                ledger.define_groups(groups)
            if done is not None:
                done.add(base)

    def note_partial(self, ledger: Ledger) -> None:
        """Add to ``ledger`` (a copy of the state's) what was yielded of the records not
        yielded whole (the groups of all of them first, in the order they came)."""
        self._define(ledger, self._bases)
        for record in self._records.values():
            if not record.yielded:
                continue
            if len(record.yielded) == max(record.yielded) + 1:  # (the first ones)
                record.origins.note(ledger, len(record.yielded))
            else:
                record.origins.note_some(ledger, sorted(record.yielded), record.size)


class Regroup:
    """The groups that the unbatches after a mix this consumer draws make (rows of a
    batch in another number: zloader/groups.py), with the handles its elements carry
    (``Context.regroup``), and the rows of those groups to make again after a resume.

    A group made here is noted in the ledger as it is made (its elements are held from
    then on, its anchor's split stays open until every row is yielded); a state taken
    before all its rows were yielded names it and the rows yielded. A Loader resumed from
    that state makes the others again, in this process: the broker hands the group's
    anchor split out again with it, the worker reading the split names it in its next
    record, and the consumer that gets that record reads the group's elements from the
    source, runs them through their input's stages and the stages up to the unbatch,
    and yields the rows missing (one consumer: the split is handed once).

    Args:
        inputs: the epoch's input streams (their handles and the ledger).
        after: the position of the first stage after the mix (a group made here has its
            unbatch at or after it).
        rebuilds: where the groups to make again go (``Context.rebuilds``, which the
            unbatch reads), with the rows not to make.
    """

    def __init__(self, inputs: Inputs, after: int,
                 rebuilds: list[tuple[Group, frozenset[int]]]) -> None:
        self.inputs, self.after, self.rebuilds = inputs, after, rebuilds
        self._made_again: set[tuple[Key, int, int, int]] = set()

    @property
    def handles(self) -> Handles:
        assert self.inputs.handles is not None
        return self.inputs.handles

    def tag(self, rows: list[Any], origin: Any, position: int) -> Iterator[Any]:
        """``rows`` that an unbatch at ``position`` made of a batch of the elements
        ``origin`` names (handles), as a new group's rows, each with a handle."""
        codes = gather(list(origin)) if not isinstance(origin, np.ndarray) else origin
        runs: list[list[Any]] = []
        for key, split, index in self.handles.origins_of(codes.tolist()):
            if runs and runs[-1][0] == key and runs[-1][1] == split \
                    and runs[-1][2] + runs[-1][3] == index:
                runs[-1][3] += 1
            else:
                runs.append([key, split, index, 1])
        if not runs:
            raise RuntimeError("an unbatch after the mix made rows of elements with no "
                               "origins")
        key, split, index, _ = runs[0]
        group = Group(key, split, index, position, len(rows), tuple(map(tuple, runs)))
        self.handles.define_all()
        self.handles.ledger.define(group)  # (before its elements are: they are its)
        self.handles.yielded(codes)
        return self.rows(group, rows, range(len(rows)))

    def rows(self, group: Group, rows: list[Any], which: Sequence[int]) -> Iterator[Any]:
        """``rows`` (rows ``which`` of ``group``), each with a handle of its own."""
        base = self.inputs.allocate(len(rows))
        self.handles.add(base, _Rows(group, which), len(rows))
        return zip(rows, ((base + at,) for at in range(len(rows))), strict=True)

    def named(self, origins: Origins) -> None:
        """A record (or an END) came: a group made here that it names (its anchor was
        read again after a resume) has its missing rows made again
        (``Context.rebuilds``, which the unbatch reads), once."""
        ledger = self.handles.ledger
        for named in origins.groups or ():
            if named.position < self.after or named.id in self._made_again:
                continue
            for value in ledger.groups(*anchor_split(named.key, named.split)):
                group, gid, rows = Group.from_json(value)
                if group is not None and gid == named.id:
                    self._made_again.add(gid)
                    self.rebuilds.append((group, frozenset(rows)))


class Inputs:
    """The inputs' streams of one epoch of a mix this consumer draws.

    Args:
        merger: the consumer's merger (its items, credits and timeouts).
        epoch: the epoch.
        parts: the mix's number of inputs.
        track: tag each element with its handle (exactly-once), noting its record in
            ``handles``.
    """

    def __init__(self, merger: Merger, epoch: int, parts: int, track: bool,
                 skip: list[int] | None = None) -> None:
        self.merger, self.epoch, self.track = merger, epoch, track
        self.queues: list[deque[_Held]] = [deque() for _ in range(parts)]
        self.ended_by: list[set[int]] = [set() for _ in range(parts)]  # worker indices
        self.done = False  # the epoch's Done came: nothing more of it
        self.handles = Handles(merger.yielded.ledger) if track else None
        self.regroup: Regroup | None = None  # (set by the draws when tracked)
        self._next_handle = 0
        # A deterministic job's shards (each made by one worker, ended by its END): where
        # each part's stream is (its elements filed, or yielded before a resume), and
        # how far each worker's run of each part came (a dead worker's replacement makes
        # its parts again from the start: what this consumer has of them is dropped).
        self.shards = skip is not None
        self.skip = list(skip) if skip is not None else [0] * parts
        self.position = list(self.skip)
        self._runs: dict[tuple[int, str], int] = {}

    def allocate(self, count: int) -> int:
        """The first of ``count`` new handles."""
        base, self._next_handle = self._next_handle, self._next_handle + count
        return base

    def opened(self) -> list[Iterator[Any]]:
        """One stream per input, as the draws read them."""
        return [self._stream(part) for part in range(len(self.queues))]

    def _stream(self, part: int) -> Iterator[Any]:
        queue = self.queues[part]
        while True:
            if queue:
                yield self.take(part)
                continue
            if self.ended(part):
                return
            self.pull()

    def take(self, part: int) -> Any:
        """The next element of input ``part``'s queue (not empty), tagged with its handle
        when tracked; a record's credit goes back once its last element is taken."""
        queue = self.queues[part]
        held = queue[0]
        data = held.data
        element = data.elements[held.at]
        handle = held.base + held.at
        held.at += 1
        if held.at == len(data.elements):
            queue.popleft()
            self.merger.io.credit(data.worker, 1, part)
        return (element, (handle,)) if self.track else element

    def rest(self) -> Iterator[Any]:
        """After the draws ended with every input read to its end: the elements still to
        come until the epoch is done (an input taken for ended while a dead worker's
        splits were still to be read again), as they come. A stream that waits (an input a
        worker that joined has not ended) pulls what comes for the others too, the epoch's
        Done last: one more round after it takes what the other queues got meanwhile."""
        while True:
            for stream in self.opened():  # (each round anew: an ended one stays ended)
                yield from stream
            if self.done and not any(self.queues):
                return
            if not self.done:
                self.pull()

    def ended(self, part: int) -> bool:
        """Whether input ``part`` has no more elements this epoch, as far as known: the
        epoch is done, or every worker serving the job said so."""
        if self.done:
            return True
        if self.shards:  # (a shard is made by one worker: ended when it says so)
            return bool(self.ended_by[part])
        stats = self.merger.io.stats
        serving = set(stats.indices)
        if self.merger.io.settings.fixed:  # (every worker index reads splits of its own)
            serving |= set(range(stats.width))
        return bool(serving) and serving <= self.ended_by[part]

    def pull(self) -> None:
        """Take the next item of the epoch from the I/O thread and file it."""
        merger = self.merger
        item = merger.next_item(self.epoch, once=True)
        if isinstance(item, Data):
            part = item.part
            if part is None or not 0 <= part < len(self.queues):
                raise RuntimeError(f"a record of a mix drawn here names input {part} "
                                   f"(the mix has {len(self.queues)}): a worker of "
                                   "another version?")
            if self.shards:
                item.elements = self._unseen(part, item.worker, item.elements)
            base = self.allocate(len(item.elements))
            if self.handles is not None and item.origins is not None:
                if self.regroup is not None:
                    self.regroup.named(item.origins)
                self.handles.add(base, item.origins, len(item.elements))
            if item.elements:
                self.queues[part].append(_Held(item, base))
            else:
                merger.io.credit(item.worker, 1, part)
            merger.check_skipped()
        elif isinstance(item, InputEnd):
            if 0 <= item.part < len(self.queues):
                self.ended_by[item.part].add(item.index)
        elif isinstance(item, End):
            if not self.shards:  # (every input ended on that worker)
                for ended in self.ended_by:
                    ended.add(item.index)
            if self.regroup is not None and item.origins is not None:
                self.regroup.named(item.origins)
            merger.yielded.recorded(item.origins, self.epoch)
        elif isinstance(item, Done):
            self.done = True

    def short_parts(self) -> list[tuple[int, int, int]]:
        """The parts of a deterministic job that ended (the epoch over) with fewer
        elements than were to be dropped of them: (part, its elements, the count)."""
        made = [0] * len(self.position)
        for (part, _), count in self._runs.items():
            made[part] = max(made[part], count)
        return [(part, made[part], self.skip[part]) for part in range(len(made))
                if made[part] < self.skip[part]]

    def _unseen(self, part: int, worker: str, elements: list[Any]) -> list[Any]:
        """Of a deterministic job's record of ``part`` from ``worker``, the elements past
        where the part's stream is here: a part's stream is the same whichever worker
        makes it, so an element is known by its place in it, and one this consumer has
        (made before by a worker that died, or yielded before a resume) is dropped."""
        at = self._runs.get((part, worker), 0)  # the record's first element's place
        self._runs[part, worker] = at + len(elements)
        seen = self.position[part] - at
        self.position[part] = max(self.position[part], at + len(elements))
        return elements[seen:] if seen > 0 else elements

    def yielded(self, output: Any, ctx: Any) -> Any:
        """The value of a (tagged) output of the stages after the mix, its elements and
        those the stages dropped since the last one noted as yielded."""
        value, origin = output
        if self.handles is not None:
            codes = gather([origin])
            if ctx.tally.loose:
                codes = np.concatenate((codes, np.array(ctx.tally.loose, np.int64)))
                ctx.tally.loose = []
            self.handles.yielded(codes)
        return value

    def finish(self, ctx: Any) -> None:
        """The stages after the mix ended: what they dropped last is accounted for."""
        if self.handles is not None and ctx.tally.loose:
            self.handles.yielded(np.array(ctx.tally.loose, np.int64))
            ctx.tally.loose = []


class Order:
    """A deterministic job's order over its shards (zloader/plan.py): one element of each
    shard in turn, in shard order, passing over the shards that ended; and where it is,
    which is what a state of it holds: the epoch, the shard whose turn it is and the
    elements yielded of each. A resumed order's shards are made again from the epoch's
    start, dropping as they come the elements yielded before (:class:`Inputs` ``skip``).
    """

    def __init__(self, shards: int, resume: dict[str, Any] | None = None) -> None:
        self.shards = shards
        self.epoch: int | None = None  # the epoch being yielded, or the next one
        self.turn = 0
        self.yielded = [0] * shards
        self.iterating = False
        if resume is not None:
            self.epoch, self.turn = resume["epoch"], resume["turn"]
            self.yielded = list(resume["yielded"])

    def begin(self, epoch: int) -> list[int]:
        """``epoch`` starts: the elements of each shard to drop (yielded before a resume
        of it)."""
        if self.epoch != epoch:
            self.turn, self.yielded = 0, [0] * self.shards
        self.epoch, self.iterating = epoch, True
        return list(self.yielded)

    def elements(self, inputs: Inputs) -> Iterator[Any]:
        """The epoch's elements, in the order.

        Raises:
            ValueError: a resumed shard ended before the elements its state counted as
                yielded (a state of another epoch, or one made up).
        """
        for shard, element in in_turn(inputs, range(self.shards), self.turn):
            self.turn = (shard + 1) % self.shards
            self.yielded[shard] += 1
            yield element
        short = inputs.short_parts()
        if short:
            part, made, counted = short[0]
            raise ValueError(
                f"state= counted {counted} elements of shard {part} as yielded, but that "
                f"shard has {made} this epoch (state['order']['yielded'][{part}]): a state "
                "of another epoch or dataset, or one made up; nothing was yielded twice")
        self.iterating = False
        if self.epoch is not None:
            self.epoch += 1
        self.turn, self.yielded = 0, [0] * self.shards

    def state(self, next_epoch: int) -> dict[str, Any]:
        """``{epoch, order: {shards, turn, yielded}}``: where the next element is."""
        epoch = self.epoch if self.epoch is not None else next_epoch
        if not self.iterating and epoch < next_epoch:
            epoch = next_epoch
        return {"epoch": epoch, "order": {"shards": self.shards, "turn": self.turn,
                                          "yielded": list(self.yielded)}}


class MixOrder:
    """A deterministic job's mix drawn here (zloader/plan.py): input ``k``'s stream is
    one element of each of its shards' streams in turn (parts ``k * shards`` ..
    ``k * shards + shards - 1``, passing over those that ended), the draws and the
    stages after the mix run over those streams as in any mix drawn here; and where it
    is, which is what a state of it holds: the epoch and the outputs yielded of it. A
    resumed order draws its epoch again from the start (the workers make every shard
    again) and drops that many outputs: the stream is a function of the shards, the
    seeds and the job's entropy, so the rest is the uninterrupted run's.
    """

    def __init__(self, shards: int, resume: dict[str, Any] | None = None) -> None:
        self.shards = shards
        self.epoch: int | None = None  # the epoch being yielded, or the next one
        self.outputs = 0
        self.iterating = False
        if resume is not None:
            self.epoch, self.outputs = resume["epoch"], resume["outputs"]

    def begin(self, epoch: int) -> int:
        """``epoch`` starts: the outputs to drop (yielded before a resume of it)."""
        if self.epoch != epoch:
            self.outputs = 0
        self.epoch, self.iterating = epoch, True
        return self.outputs

    def opened(self, inputs: Inputs) -> list[Iterator[Any]]:
        """Each input's stream over its shards, as the draws read them."""
        shards = self.shards
        return [(element for _, element in in_turn(inputs, range(start, start + shards)))
                for start in range(0, len(inputs.queues), shards)]

    def outputs_of(self, outputs: Iterator[Any], drop: int) -> Iterator[Any]:
        """``outputs`` after the first ``drop``, counted as they are yielded.

        Raises:
            ValueError: the epoch has fewer than ``drop`` outputs (its state is of
                another epoch, or made up).
        """
        made = 0
        for made, output in enumerate(outputs, 1):
            if made <= drop:
                continue
            self.outputs = made
            yield output
        if made < drop:
            raise ValueError(
                f"state= counted {drop} outputs of this epoch as yielded, but it has {made} "
                "(state['order']['outputs']): a state of another epoch or dataset, or one "
                "made up; nothing was yielded twice")
        self.iterating = False
        if self.epoch is not None:
            self.epoch += 1
        self.outputs = 0

    def state(self, next_epoch: int) -> dict[str, Any]:
        """``{epoch, order: {shards, outputs}}``: where the next output is."""
        epoch = self.epoch if self.epoch is not None else next_epoch
        if not self.iterating and epoch < next_epoch:
            epoch = next_epoch
        return {"epoch": epoch, "order": {"shards": self.shards, "outputs": self.outputs}}


def in_turn(inputs: Inputs, parts: range, turn: int = 0) -> Iterator[tuple[int, Any]]:
    """One element of each of ``parts`` in turn, from the ``turn``-th, passing over the
    parts that ended, until all have: (its place in ``parts``, the element)."""
    queues, count = inputs.queues, len(parts)
    while True:
        for step in range(count):
            at = (turn + step) % count
            part = parts[at]
            while not queues[part] and not inputs.ended(part):
                inputs.pull()
            if queues[part]:
                break
        else:
            return
        turn = (at + 1) % count
        yield at, inputs.take(part)
