"""The consumer's ledger: what it received and what it yielded, by split, as disjoint
ranges (``Loader.state_dict()`` is the yielded ledger); and the broker's merge of what the
consumers hold of a dead worker's splits (:func:`merge_info`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from zloader._defaults import (
    GROUP_KEY,
    LEDGER_FOLD_RECORDS,
    LEDGER_FOLD_RUNS,
)
from zloader.lineage.intsets import pack, unpack
from zloader.lineage.ranges import Ranges, code_runs, index_runs, merge_runs
from zloader.lineage.tags import (
    INDEX_BITS,
    INDEX_MASK,
    MAX_KEY_LENGTH,
    Group,
    Key,
    anchor_split,
    flat_runs,
    group_of_rows,
    natural,
)

__all__ = ["Ledger", "merge_info"]


def merge_info(held: dict[str, Any] | None, info: Any,
               at: tuple[Key, int] | None = None) -> dict[str, Any]:
    """Add one consumer's :meth:`Ledger.info` for a split (``at``: its pass key and
    number) to what others said (``all``, or the union of the indices held, as a set,
    the first reading's ``expect``, and the groups whose rows are not all held anywhere).

    Raises:
        ValueError: ``info`` is malformed (or names whole groups and ``at`` is None).
    """
    if not isinstance(info, dict):
        raise ValueError("a split's info must be an object")
    if (held or {}).get("all") or info.get("all") is True:
        return {"all": True}
    expect = info.get("expect")
    if expect is not None and not (isinstance(expect, list) and len(expect) == 2
                                   and all(isinstance(v, int) for v in expect)):
        raise ValueError("expect must be [count, digest]")
    merged = dict(held or {"have": set()})
    merged["have"] = merged["have"] | unpack(info.get("have", ""))
    if expect is not None:
        merged["expect"] = expect
    if info.get("groups") is not None or info.get("whole") is not None:
        ledger = Ledger()  # (groups merged by id: the rows each consumer held, together)
        for whole in (merged.get("whole"), info.get("whole")):
            if whole is not None:  # (first: a group whole anywhere is made again nowhere)
                if at is None:
                    raise ValueError("whole groups need the split they are anchored in")
                ledger.mark_whole(*at, whole)
        ledger.merge_groups(merged.get("groups", []))
        ledger.merge_groups(info.get("groups") or [])
        merged["groups"] = ledger.open_groups()
        if at is not None:  # (every group whole here, the merge's own included: one
            # whose rows came from several consumers stays whole when a word of one of
            # them, a state that left, is merged in again)
            merged["whole"] = ledger._whole_inner(*at, every=True)
    return merged

# --- the consumer's ledger -------------------------------------------------------------------


class _Rows:
    """What a ledger holds of one :class:`Group`: the group (None while only rows of it
    came, a ``job_name`` consumer's) and the rows held."""

    __slots__ = ("group", "have")

    def __init__(self) -> None:
        self.group: Group | None = None
        self.have = Ranges()


class Ledger:
    """Origins of one epoch received (or yielded) by a consumer: per pass, the splits
    accounted for whole, and the :class:`Ranges` of indices held of the others; with each
    split's (count, digest) once its worker finished reading it.

    A :class:`Group`'s elements are held from when the group is known (a record names
    it); its split is not accounted for whole until every row of the group is held: a
    row missing is made again from the group's elements (:meth:`info` names it)."""

    def __init__(self, made_here: int = 0) -> None:
        # Groups whose unbatch is at this position or after are made by the consumer
        # that draws a mix (zloader/client/draw.py): a ledger of what it *received*
        # ignores them (their rows never come in a record); 0: none.
        self.made_here = made_here
        self._done: dict[Key, set[int]] = {}
        self._open: dict[tuple[Key, int], Ranges] = {}
        self._lengths: dict[tuple[Key, int], tuple[int, int]] = {}
        # Records' origins not yet added (:meth:`add` and :meth:`add_codes` keep them to
        # add many at once), and how many runs and codes they hold.
        self._pending: list[tuple[dict[int, Key], np.ndarray]] = []
        self._pending_codes: list[tuple[dict[int, Key], list[int], np.ndarray]] = []
        self._pending_runs = 0
        # Member runs of groups defined, not yet added (:meth:`define_all`), flat (key,
        # split, first, length, key, ...), and how many groups they are: added with the
        # records' origins, one merge per split.
        self._pending_members: list[Any] = []
        self._pending_groups = 0
        # Splits whose end came while origins were kept: closed once those are added
        # (an end does not fold them: a record of many short splits has an end each).
        self._closing: list[tuple[Key, int]] = []
        # (pass, split) by number, for codes made the ledger's own (:meth:`_fold_codes`)
        self._places: dict[tuple[Key, int], int] = {}
        self._place_of: list[tuple[Key, int]] = []
        # Groups whose rows are not all held, by id; the ids of those by their anchor's
        # split (which stays open meanwhile); those whose rows all came.
        self._groups: dict[tuple[Key, int, int, int], _Rows] = {}
        self._anchored: dict[tuple[Key, int], set[tuple[Key, int, int, int]]] = {}
        self._whole: set[tuple[Key, int, int, int]] = set()
        # Those by their anchor's split while it is open: a state lists them, so that a
        # state of another consumer that holds only some of their rows does not have
        # them made again when the two are resumed together.
        self._whole_at: dict[tuple[Key, int], set[tuple[Key, int, int, int]]] = {}
        # Every group known this epoch: a group holding rows of others is made again
        # from theirs (zloader/groups.py), whole or not.
        self._defs: dict[tuple[Key, int, int, int], Group] = {}
        # The groups whose rows another group holds (a tokenizer's, packed): a consumer
        # that holds some of those groups may hold only some of their rows, so a fence
        # answer lists the ones whose rows all are held here (:meth:`info`, ``whole``).
        self._inners: set[tuple[Key, int, int, int]] = set()

    @property
    def done(self) -> dict[Key, set[int]]:
        """The splits accounted for whole, by pass."""
        self._fold()
        return self._done

    @property
    def open(self) -> dict[tuple[Key, int], Ranges]:
        """The indices held of the splits not accounted for whole."""
        self._fold()
        return self._open

    def add(self, keys: dict[int, Key], runs: np.ndarray) -> None:
        """Note the origins ``runs`` ((pass id, split, first index, length) rows;
        ``keys[id]`` is the pass). They are kept and added LEDGER_FOLD_RECORDS records at
        a time (or when the ledger is read): one merge per split for many records; a
        record of one run (a lone element's) goes in at once, which is cheaper (a split's
        elements mostly come in order, and each run extends the split's last range)."""
        if len(runs) == 1:
            self._add_runs(keys, runs)
        elif len(runs):
            self._pending.append((keys, runs))
            self._kept(len(runs))

    def add_codes(self, keys: dict[int, Key], reads: list[int], codes: np.ndarray) -> None:
        """Note the origins ``codes`` (``read << INDEX_BITS | index``, each of a read that
        ``reads``, (read, pass id, split) flat, names), kept as :meth:`add` keeps runs."""
        if len(codes):
            self._pending_codes.append((keys, reads, codes))
            self._kept(len(codes))

    def _kept(self, runs: int) -> None:
        self._pending_runs += runs
        if len(self._pending) + len(self._pending_codes) + self._pending_groups \
                >= LEDGER_FOLD_RECORDS \
                or self._pending_runs >= LEDGER_FOLD_RUNS:
            self._fold()

    def _fold(self) -> None:
        """Add the records' origins kept by :meth:`add` and :meth:`add_codes`, and the
        elements of the groups defined meanwhile, then close the splits whose end came
        meanwhile (:meth:`end`) if they are whole."""
        pending, codes, members = self._pending, self._pending_codes, self._pending_members
        self._pending, self._pending_codes, self._pending_runs = [], [], 0
        self._pending_members, self._pending_groups = [], 0
        if members:
            pending.append(self._member_runs(members))
        if len(pending) == 1:
            self._add_runs(*pending[0])
        elif pending:
            self._fold_runs(pending)
        if codes:
            self._fold_codes(codes)
        if self._closing:
            closing, self._closing = self._closing, []
            for key, split in closing:
                self._close(key, split)

    def _fold_runs(self, pending: list[tuple[dict[int, Key], np.ndarray]]) -> None:
        """Add the runs of many records, their pass ids made one table."""
        table: dict[Key, int] = {}
        parts = []
        for keys, runs in pending:
            ids = {pass_id: table.setdefault(key, len(table)) for pass_id, key in keys.items()}
            if any(pass_id != number for pass_id, number in ids.items()):
                lookup = np.zeros(max(ids) + 1, np.int64)
                lookup[list(ids)] = list(ids.values())
                runs = np.column_stack((lookup[runs[:, 0]], runs[:, 1:]))
            parts.append(runs)
        self._add_runs({number: key for key, number in table.items()}, np.concatenate(parts))

    def _fold_codes(self, pending: list[tuple[dict[int, Key], list[int], np.ndarray]]) -> None:
        """Add the codes of many records. A record of one split reading (most) adds its
        indices to that split's, each split's sorted on its own (as 32-bit values where
        they fit: twice as quick); a record of several has its reads made the ledger's
        numbers for its (pass, split)s, and those are sorted together. The runs of
        consecutive indices are the ranges to add."""
        by_place: dict[int, list[np.ndarray]] = {}
        parts = []  # (records of several split readings)
        for keys, reads, codes in pending:
            if len(reads) == 3:
                by_place.setdefault(self._place(keys[reads[1]], reads[2]), []).append(codes)
                continue
            places = [self._place(keys[pass_id], split)
                      for pass_id, split in zip(reads[1::3], reads[2::3], strict=True)]
            ids = np.array(reads[0::3], np.int64)
            order = np.argsort(ids)
            at = np.searchsorted(ids[order], codes >> INDEX_BITS)
            parts.append(np.array(places, np.int64)[order][at] << INDEX_BITS
                         | codes & INDEX_MASK)
        for place, arrays in by_place.items():
            key, split = self._place_of[place]
            self._add_indices(key, split, arrays)
        if not parts:
            return
        merged = np.concatenate(parts) if len(parts) > 1 else parts[0]
        merged.sort()
        numbers, starts, ends = code_runs(merged)
        cuts = np.flatnonzero(np.diff(numbers)) + 1
        for at, stop in zip(np.concatenate(([0], cuts)).tolist(),
                            np.concatenate((cuts, [len(numbers)])).tolist(), strict=True):
            key, split = self._place_of[int(numbers[at])]
            self._add(key, split, starts[at:stop], ends[at:stop])

    def _place(self, key: Key, split: int) -> int:
        """The ledger's number for ``split`` of pass ``key``."""
        number = self._places.get((key, split))
        if number is None:
            number = self._places[(key, split)] = len(self._place_of)
            self._place_of.append((key, split))
        return number

    def _add_runs(self, keys: dict[int, Key], runs: np.ndarray) -> None:
        if len(runs) == 1:  # (consecutive elements of one split)
            pass_id, split, start, length = runs[0].tolist()
            key = keys[pass_id]
            held = self._open.get((key, split))
            if held is not None and held.add_run(start, start + length):
                self._close(key, split)
                return
            self._add(key, split, runs[:, 2], runs[:, 2] + length)
            return
        places, starts, ends = merge_runs(runs)
        cuts = np.flatnonzero(np.diff(places)) + 1
        for at, stop in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(places)].tolist(),
                            strict=True):
            place = int(places[at])
            self._add(keys[place >> INDEX_BITS], place & INDEX_MASK, starts[at:stop],
                      ends[at:stop])

    def _add_indices(self, key: Key, split: int, arrays: list[np.ndarray]) -> None:
        """:meth:`_add` for the codes of one split reading, any order (:meth:`_fold_codes`)."""
        held = self._held_open(key, split)
        if held is None:  # (rows of a group, or a split accounted for whole)
            self._add(key, split, *index_runs(arrays))
            return
        held.add_indices(arrays)
        self._close(key, split)

    def _add(self, key: Key, split: int, starts: np.ndarray, ends: np.ndarray) -> None:
        if len(key) > 2 and key[-2] >= GROUP_KEY:  # (rows of a group)
            self._rows(key, split, starts, ends)
            return
        held = self._held_open(key, split)
        if held is not None:
            held.add(starts, ends)
            self._close(key, split)

    def _held_open(self, key: Key, split: int) -> Ranges | None:
        """The ranges held of ``split`` of pass ``key`` (new and empty when none came yet);
        None for rows of a group, and for a split accounted for whole."""
        if (len(key) > 2 and key[-2] >= GROUP_KEY) or split in self._done.get(key, ()):
            return None
        held = self._open.get((key, split))
        if held is None:
            held = self._open[(key, split)] = Ranges()
        return held

    def define(self, group: Group, rows: Iterable[int] = ()) -> None:
        """Note ``group`` (a record named it): its elements are held, and its anchor's
        split stays open until all its rows are; ``rows``: rows of it held already. A
        group made from :attr:`made_here` on is left out."""
        self.define_all([(group, group.id, rows)])

    def define_groups(self, groups: Iterable[Group]) -> None:
        """:meth:`define_all` for ``groups`` as a record names them (no row held yet)."""
        self.define_all((group, group.id, ()) for group in groups)

    def define_all(self, groups: Iterable[tuple[Group | None, tuple[Key, int, int, int],
                                                Iterable[int]]]) -> None:
        """:meth:`define` each of ``groups`` (group, its id, rows of it held; a group None:
        only its rows are known), every one anchored first: the elements of one may be
        the last its anchor's split lacked, and that split must not close before a
        group on it that lacks rows is known. The elements of the groups new here are
        kept, and added with the records' origins (:meth:`_fold`): one merge per split
        for many groups (a tokenizer's record names a group or two; a state thousands)."""
        groups = [(group, gid, rows) for group, gid, rows in groups
                  if group is None or not (self.made_here and group.position >= self.made_here)]
        for _, gid, _ in groups:
            self._group(gid)
        members = self._pending_members
        before = len(members)
        for group, gid, _ in groups:
            if group is not None and self._know(group, gid):
                members.extend(flat_runs(group.members))
                self._pending_groups += 1
        if len(members) > before:
            self._kept((len(members) - before) // 4)
        for _, gid, rows in groups:
            held = self._group(gid)
            if held is not None:
                self._group_rows(gid, held, rows)

    def _know(self, group: Group, gid: tuple[Key, int, int, int]) -> bool:
        """Note ``group`` and the groups it holds rows of; whether it is new here (its
        elements are then to be added)."""
        held = self._groups.get(gid)
        if held is not None and held.group is not None:
            return False  # (known already: a record names the groups of every row it holds)
        for one in (group, *group.inner):
            self._defs.setdefault(one.id, one)
        if held is None:  # (its rows all came, or its split was accounted for whole)
            return False
        held.group = group
        return True

    def _member_runs(self, flat: list[Any]) -> tuple[dict[int, Key], np.ndarray]:
        """Groups' member runs (flat: key, split, first, length, key, ...) as a record's
        origins (pass ids and runs), made at C speed (a shuffled batch's members are
        single elements, thousands a fold), to be merged with the records' at a fold.
        Runs of rows of other groups (a packer's after a batched tokenizer) are held as
        a record's rows are (:meth:`_rows`), and those groups noted as held by others."""
        keys = list(dict.fromkeys(flat[0::4]))
        numbers = {key: number for number, key in enumerate(keys)}
        runs = np.empty((len(flat) // 4, 4), np.int64)
        runs[:, 0] = np.fromiter(map(numbers.__getitem__, flat[0::4]), np.int64, len(runs))
        runs[:, 1], runs[:, 2], runs[:, 3] = flat[1::4], flat[2::4], flat[3::4]
        rows_of = [number for key, number in numbers.items()
                   if len(key) > 2 and key[-2] >= GROUP_KEY]
        if rows_of:
            rows = runs[np.isin(runs[:, 0], rows_of)]
            for place in np.unique(rows[:, 0] << INDEX_BITS | rows[:, 1]).tolist():
                inner = group_of_rows(keys[place >> INDEX_BITS], place & INDEX_MASK)
                assert inner is not None
                self._inners.add(inner)
        return dict(enumerate(keys)), runs

    def _group(self, gid: tuple[Key, int, int, int]) -> _Rows | None:
        """What is held of the group ``gid``, made on first sight; None once all its rows
        came or its split was accounted for whole."""
        held = self._groups.get(gid)
        if held is None:
            anchor = anchor_split(gid[0], gid[1])
            if gid in self._whole or anchor[1] in self._done.get(anchor[0], ()):
                return None
            held = self._groups[gid] = _Rows()
            self._anchored.setdefault(anchor, set()).add(gid)
        return held

    def _rows(self, key: Key, split: int, starts: np.ndarray, ends: np.ndarray) -> None:
        """Rows of a group: ``key`` and ``split`` are its :attr:`Group.rows_key`."""
        gid = group_of_rows(key, split)
        assert gid is not None
        held = self._group(gid)
        if held is not None:
            held.have.add(starts, ends)
            self._group_rows(gid, held, ())

    def _group_rows(self, gid: tuple[Key, int, int, int], held: _Rows,
                    rows: Iterable[int]) -> None:
        """Add ``rows`` to the group ``gid``; close it once all its rows are held."""
        if rows:
            more = Ranges.of(rows)
            if more.starts:
                held.have.add(np.array(more.starts, np.int64), np.array(more.ends, np.int64))
        if held.group is None or held.have.count < held.group.rows:
            return
        del self._groups[gid]
        self._whole.add(gid)
        anchor = anchor_split(gid[0], gid[1])
        self._whole_at.setdefault(anchor, set()).add(gid)
        waiting = self._anchored.get(anchor)
        if waiting is not None:
            waiting.discard(gid)
            if not waiting:
                del self._anchored[anchor]
                self._close(*anchor)

    def groups(self, key: Key, split: int, whole: bool = False) -> list[list[Any]]:
        """The groups anchored in ``split`` of pass ``key`` whose rows are not all held,
        as :meth:`Group.to_json` gives them (``rows`` -1 and no members for a group of
        which only rows came); ``whole``: and those whose rows all are (a state's)."""
        self._fold()
        out = []
        for gid in sorted(self._whole_at.get((key, split), ())) if whole else ():
            group = self._defs.get(gid)
            if group is not None:
                out.append(group.to_json(range(group.rows)))
        for gid in sorted(self._anchored.get((key, split), ())):
            held = self._groups[gid]
            if held.group is not None:
                out.append(held.group.to_json(held.have.indices().tolist(),
                                              self._inner(held.group)))
            else:
                out.append([list(gid[0]), gid[1], gid[3], gid[2], -1, [],
                            pack(held.have.indices())])
        return out

    def _inner(self, group: Group) -> list[Group]:
        """The groups whose rows ``group`` holds, and theirs, as far as known."""
        found: dict[tuple[Key, int, int, int], Group] = {}
        waiting = [group]
        while waiting:
            for key, split, _, _ in waiting.pop().members:
                gid = group_of_rows(key, split)
                if gid is None or gid in found or gid not in self._defs:
                    continue
                found[gid] = self._defs[gid]
                waiting.append(found[gid])
        return list(found.values())

    def open_groups(self) -> list[list[Any]]:
        """:meth:`groups` of every split with a group whose rows are not all held."""
        return [group for key, split in sorted(self._anchored)
                for group in self.groups(key, split)]

    def merge_groups(self, groups: Any) -> None:
        """Add groups as :meth:`groups` gives them (of this ledger or another's).

        Raises:
            ValueError: ``groups`` is not such a value.
        """
        if not isinstance(groups, list):
            raise ValueError("a split's groups must be a list")
        self.define_all([Group.from_json(value) for value in groups])

    def add_indices(self, key: Key, split: int, indices: Iterable[int]) -> None:
        """Note indices of one split (from a packed set)."""
        self._fold()
        if split in self._done.get(key, ()):
            return
        held = Ranges.of(indices)
        ranges = self._open.setdefault((key, split), Ranges())
        if held.starts:
            ranges.add(np.array(held.starts, np.int64), np.array(held.ends, np.int64))
        self._close(key, split)

    def end(self, key: Key, split: int, count: int, crc: int) -> None:
        """The split's worker read ``count`` elements from it (with digest ``crc``). Whether
        that makes it whole is known once the origins kept are added: at the next fold
        (every reader of the ledger folds first)."""
        if split in self._done.get(key, ()):
            return
        self._lengths[(key, split)] = (count, crc)
        if self._pending or self._pending_codes or self._pending_members:
            self._closing.append((key, split))
        else:
            self._close(key, split)

    def missing(self, epoch: int, handed: Any) -> set[tuple[Key, int]]:
        """The splits of ``epoch`` not accounted for whole: begun here and not finished
        (fewer elements than their count), or handed out by the broker (``handed``: its
        ``JOB.read``, ``[[pass, packed splits], ...]``) and never finished here. Malformed
        entries of ``handed`` are ignored."""
        self._fold()
        missing = {at for at in self._open if at[0][0] == epoch}
        for entry in handed if isinstance(handed, list) else ():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                    and entry[0] and entry[0][0] == epoch):
                continue
            key = tuple(entry[0])
            try:
                missing |= {(key, split) for split in unpack(entry[1])
                            - self._done.get(key, set())}
            except ValueError:
                continue
        return missing

    def _close(self, key: Key, split: int) -> None:
        length = self._lengths.get((key, split))
        if length is not None and (key, split) not in self._anchored:
            held = self._open.get((key, split))
            if (held.count if held is not None else 0) >= length[0]:
                self._done.setdefault(key, set()).add(split)
                self._open.pop((key, split), None)
                self._lengths.pop((key, split), None)
                self._whole_at.pop((key, split), None)

    def held(self, key: Key, split: int) -> np.ndarray:
        """The indices of an open split held."""
        self._fold()
        ranges = self._open.get((key, split))
        return ranges.indices() if ranges is not None else np.empty(0, np.int64)

    def info(self, key: Key, split: int) -> dict[str, Any]:
        """What the broker needs to hand ``split`` out again: ``all`` when it is accounted
        for, else the indices held (``have``) and the first reading's ``expect``."""
        self._fold()
        if split in self._done.get(key, ()):
            return {"all": True}
        info: dict[str, Any] = {"have": pack(self.held(key, split))}
        if (key, split) in self._lengths:
            info["expect"] = list(self._lengths[(key, split)])
        groups = self.groups(key, split)
        if groups:
            info["groups"] = groups
        whole = self._whole_inner(key, split)
        if whole:
            info["whole"] = whole
        return info

    def _whole_inner(self, key: Key, split: int, every: bool = False) -> list[list[Any]]:
        """The groups anchored in ``split`` of pass ``key`` whose rows all are held here
        and whose rows other groups hold, as ``[[rest of their key, position, packed
        indices], ...]`` (a key's rest: after ``key``, empty for a group of source
        elements). Another consumer that got some of the groups holding their rows knows
        them with only those rows: told this, a fence does not have the others made again.
        A bitmap per position (and per group of groups of rows): a few bytes a split.
        ``every``: every group anchored there whose rows all are held (a merge's)."""
        by: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for gid in self._whole_at.get((key, split), ()):
            if every or gid in self._inners:
                by.setdefault((tuple(gid[0][len(key):]), gid[2]), []).append(gid[3])
        return [[list(rest), position, pack(indices)]
                for (rest, position), indices in sorted(by.items())]

    def mark_whole(self, key: Key, split: int, whole: Any) -> None:
        """Note groups :meth:`info` gave as ``whole`` (another consumer's): their rows
        are all held.

        Raises:
            ValueError: ``whole`` is not such a value.
        """
        if not isinstance(whole, list):
            raise ValueError("a split's whole groups must be a list")
        for entry in whole:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list)
                    and len(key) + len(entry[0]) <= MAX_KEY_LENGTH
                    and all(natural(v) for v in entry[0]) and natural(entry[1])):
                raise ValueError(f"bad whole groups entry: {entry!r:.80}")
            named = (*key, *entry[0])
            if anchor_split(named, split) != (key, split):
                raise ValueError(f"whole groups not anchored in split {split} of pass "
                                 f"{list(key)}: {entry!r:.80}")
            anchor = (key, split)
            for index in unpack(entry[2]):
                gid = (named, split, entry[1], index)
                held = self._groups.pop(gid, None)
                self._whole.add(gid)
                self._whole_at.setdefault(anchor, set()).add(gid)
                self._inners.add(gid)
                waiting = self._anchored.get(anchor)
                if held is not None and waiting is not None:
                    waiting.discard(gid)
                    if not waiting:
                        del self._anchored[anchor]
                        self._close(*anchor)

    def to_json(self) -> list[Any]:
        """Per pass: ``[pass, done splits, [[split, held indices, count, digest], ...]]``
        (count and digest -1 while unknown), and a fourth item, the groups anchored in
        the pass whose rows are not all held (:meth:`groups`), when there are any."""
        self._fold()
        keys = set(self._done) | {key for key, _ in self._open} | {k for k, _ in self._anchored} \
            | {k for k, _ in self._whole_at}
        out = []
        for key in sorted(keys):
            opened = [[split, pack(self.held(k, split)), *self._lengths.get((k, split), (-1, -1))]
                      for (k, split) in sorted(self._open) if k == key]
            entry = [list(key), pack(self._done.get(key, ())), opened]
            groups = [group for (k, split) in sorted(set(self._anchored) | set(self._whole_at))
                      if k == key for group in self.groups(k, split, whole=True)]
            if groups:
                entry.append(groups)
            out.append(entry)
        return out

    def copy(self) -> Ledger:
        """This ledger on its own (what a state notes a record partly yielded into):
        what ``merge_json(to_json())`` into a new one holds, without defining every group
        again."""
        self._fold()
        other = Ledger(self.made_here)
        other._done = {key: set(splits) for key, splits in self._done.items()}
        other._open = {at: ranges.copy() for at, ranges in self._open.items()}
        other._lengths = dict(self._lengths)
        other._places, other._place_of = dict(self._places), list(self._place_of)
        for gid, held in self._groups.items():
            rows = other._groups[gid] = _Rows()
            rows.group, rows.have = held.group, held.have.copy()
        other._anchored = {at: set(gids) for at, gids in self._anchored.items()}
        other._whole = set(self._whole)
        other._whole_at = {at: set(gids) for at, gids in self._whole_at.items()}
        other._defs = dict(self._defs)
        other._inners = set(self._inners)
        return other

    def merge_json(self, passes: Any) -> None:
        """Add what :meth:`to_json` returned (of this ledger or another's).

        Raises:
            ValueError: ``passes`` is not such a value.
        """
        self._fold()
        if not isinstance(passes, list):
            raise ValueError("the delivered origins must be a list of passes")
        for entry in passes:
            if not (isinstance(entry, list) and len(entry) in (3, 4)
                    and isinstance(entry[0], list)
                    and all(natural(k) for k in entry[0]) and isinstance(entry[2], list)):
                raise ValueError(f"bad pass entry in the delivered origins: {entry!r:.80}")
            key = tuple(entry[0])
            for split in unpack(entry[1]):
                self._done.setdefault(key, set()).add(split)
                self._open.pop((key, split), None)
                self._lengths.pop((key, split), None)
            if len(entry) == 4:  # (first: a split with a group open must not close below)
                self.merge_groups(entry[3])
            for item in entry[2]:
                if not (isinstance(item, list) and len(item) == 4 and natural(item[0])
                        and all(isinstance(v, int) for v in item[2:])):
                    raise ValueError(f"bad split entry in the delivered origins: {item!r:.80}")
                split = item[0]
                if split in self._done.get(key, ()):
                    continue
                if item[2] >= 0:
                    self._lengths[(key, split)] = (item[2], item[3])
                self.add_indices(key, split, unpack(item[1]))
                self._close(key, split)

