"""A stage that changes the number of elements (``batch(k).map(f).unbatch()`` with ``f``
returning any number of rows: packing, chunking) loses and repeats nothing under
exactly-once: on a resume from a state taken mid-group, on a resume of that resume, on a
worker SIGKILL, inside a mix and with shuffles and batches around it (zloader/groups.py).
What cannot be made exact is refused, naming the stage and ``exactly_once=False``."""

from __future__ import annotations

import collections
import itertools
import os
from typing import Any

import numpy as np
import pytest

from zloader import Loader, Pipeline, PipelineError
from zloader.broker.splits import skip
from zloader.lineage import (
    INDEX_BITS,
    Assigned,
    Group,
    Ledger,
    decode_origins,
    group_of_rows,
    merge_info,
    unpack,
)
from zloader.lineage import pack as packed_set
from zloader.plan import plan
from zloader.runs import Context, RunSettings

TOKENS = 5  # a packed row's length


def document(x: Any) -> np.ndarray:
    """A document of 1 to 9 tokens, each naming the document and its place (padded with
    -1 to 9, so that documents batch)."""
    x = int(x)
    out = np.full(9, -1, np.int64)
    out[:1 + x % 9] = [x * 100 + t for t in range(1 + x % 9)]
    return out


def pack(documents: Any) -> np.ndarray:
    """The batch's documents' tokens, concatenated, cut into rows of TOKENS (the last
    padded with -1): a packer, whose rows depend on which documents share a batch."""
    tokens = [int(t) for doc in np.asarray(documents) for t in doc if t >= 0]
    rows = np.full((-(-len(tokens) // TOKENS), TOKENS), -1, np.int64)
    rows.reshape(-1)[:len(tokens)] = tokens
    return rows


def expand(batch: Any) -> list[int]:
    """Each element of the batch becomes 0, 1 or 2 rows (rows that do not depend on the
    batch, so that any number of workers gives ``iter``'s multiset)."""
    return [int(x) for x in np.asarray(batch).reshape(-1) for _ in range(int(x) % 3)]


def packed(n: int = 1200, split_size: int = 50) -> Pipeline:
    return (Pipeline.range(n, split_size=split_size).map(document).batch(6).map(pack)
            .unbatch().map(as_row))


def as_row(row: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in row if t >= 0)


def expanded(n: int = 3000, split_size: int = 50) -> Pipeline:
    return Pipeline.range(n, split_size=split_size).batch(7).map(expand).unbatch().map(int)


def tokens(rows: Any) -> collections.Counter:
    return collections.Counter(t for row in rows for t in row)


def resumed(pipeline: Pipeline, cuts: list[int], **kwargs: Any) -> list[Any]:
    """What ``pipeline`` yields through Loaders stopped after each of ``cuts`` elements
    and resumed from their state (a chain of resumes), then read to the end."""
    out: list[Any] = []
    state = None
    for cut in cuts:
        with Loader(pipeline, timeout=30, state=state, **kwargs) as loader:
            out += itertools.islice(loader, cut)
            state = loader.state_dict()
    with Loader(pipeline, timeout=30, state=state, **kwargs) as loader:
        out += list(loader)
    return out


def killed_at(pipeline: Pipeline, count: int) -> list[Any]:
    """What ``pipeline`` yields through a Loader of 2 workers, the first SIGKILLed once
    ``count`` elements came."""
    out: list[Any] = []
    with Loader(pipeline, num_workers=2, timeout=30) as loader:
        elements = iter(loader)
        out += itertools.islice(elements, count)
        loader._processes[0].kill()
        out += list(elements)
    return out


def test_a_packer_resumed_mid_group_yields_the_epoch_s_rows_once_in_order():
    pipeline = packed()
    reference = list(pipeline.iter(0))
    # one worker: the very sequence iter yields, across a cut inside a group (before:
    # the group's unsent rows were lost)
    assert resumed(pipeline, [101], num_workers=1) == reference
    assert resumed(pipeline, [101, 57], num_workers=1) == reference  # a resume of a resume


def test_a_map_that_changes_the_number_of_rows_resumes_exactly_with_two_workers():
    pipeline = expanded()
    reference = collections.Counter(pipeline.iter(0))
    for cuts in ([1001], [333, 777]):
        got = collections.Counter(resumed(pipeline, cuts, num_workers=2))
        assert got == reference, (cuts, sum((reference - got).values()),
                                  sum((got - reference).values()))


def test_a_packer_survives_a_worker_sigkill_mid_group():
    pipeline = packed(2400)
    reference = tokens(pipeline.iter(0))
    # Every token once: each row of the epoch once, though the dead worker's groups
    # were cut in other places (packed again from their documents)
    assert tokens(killed_at(pipeline, 300)) == reference


def tokenized(batch: Any) -> list[list[int]]:
    """A batched tokenizer as users write it: each element's tokens, a list each, of
    1 to 3 tokens (rows of different lengths, in a plain list)."""
    return [[int(x) * 10 + t for t in range(1 + int(x) % 3)] for x in np.asarray(batch)]


def test_a_tokenizer_s_list_of_ragged_lists_is_its_rows_through_resumes_and_a_kill():
    """``batch(k).map(f).unbatch()`` with ``f`` returning a list of token lists yields each
    list as a row (it raised: 'element[1] has 2 rows, others have 1'), exactly once
    through a resume of a resume and a worker SIGKILL."""
    pipeline = (Pipeline.range(3000, split_size=50).batch(8).map(tokenized).unbatch()
                .map(tuple))
    reference = collections.Counter(pipeline.iter(0))
    assert len(reference) == 3000 and max(map(len, reference)) == 3
    assert collections.Counter(resumed(pipeline, [700, 900], num_workers=2)) == reference
    assert collections.Counter(killed_at(pipeline, 1100)) == reference



@pytest.mark.parametrize("cut", [150, pytest.param(900, marks=pytest.mark.slow)])
def test_shuffles_and_batches_around_the_stage_and_a_mix_lose_and_repeat_nothing(cut):
    corpus_a = (Pipeline.range(900, split_size=30).shuffle(40, seed=1).batch(5)
                .map(expand).unbatch().map(int).shuffle(25, seed=2))
    corpus_b = (Pipeline.range(900, split_size=45).map(lambda x: int(x) + 10_000).batch(4)
                .map(expand).unbatch().map(int))
    pipeline = Pipeline.mix([corpus_a, corpus_b], [0.7, 0.3], seed=3).batch(8)
    reference = collections.Counter(int(x) for b in pipeline.iter(0) for x in b)
    for kill in (False, True):
        out: list[Any] = []
        state = None
        with Loader(pipeline, num_workers=2, timeout=30) as loader:
            elements = iter(loader)
            out += itertools.islice(elements, cut // 8)
            if kill:
                loader._processes[1].kill()
                out += list(elements)
            else:
                state = loader.state_dict()
        if state is not None:
            with Loader(pipeline, num_workers=2, timeout=30, state=state) as loader:
                out += list(loader)
        got = collections.Counter(int(x) for b in out for x in b)
        assert got == reference, (kill, sum((reference - got).values()),
                                  sum((got - reference).values()))


def test_a_batched_tokenizer_before_a_packer_keeps_its_rows_origins():
    """A batch-level map that gives one row per element (a batched tokenizer) before a
    packer: its rows keep their elements' origins, and the packer's groups are exact."""
    def tokenize(batch: Any) -> np.ndarray:
        return np.stack([document(x) for x in batch])

    pipeline = (Pipeline.range(1200, split_size=50).batch(10).map(tokenize).unbatch()
                .batch(6).map(pack).unbatch().map(as_row))
    assert resumed(pipeline, [140], num_workers=1) == list(pipeline.iter(0))


@pytest.mark.parametrize("cut", [100, pytest.param(700, marks=pytest.mark.slow)])
def test_two_stages_that_change_the_number_of_rows_in_a_row_resume_exactly(cut):
    pipeline = (Pipeline.range(1500, split_size=50).batch(4).map(expand).unbatch()
                .map(int).batch(3).map(expand).unbatch().map(int))
    reference = collections.Counter(pipeline.iter(0))
    for workers in (1, 2):
        got = collections.Counter(resumed(pipeline, [cut, cut // 3], num_workers=workers))
        assert got == reference, (workers, sum((reference - got).values()),
                                  sum((got - reference).values()))


def test_a_batch_no_unbatch_undoes_before_the_stage_is_refused_when_the_loader_is_made():
    pipeline = Pipeline.range(200).batch(4).batch(2).map(lambda b: [1, 2, 3]).unbatch()
    with pytest.raises(ValueError, match=r"'batch\(4\)'.*exactly_once=False"):
        Loader(pipeline, num_workers=1)
    with Loader(pipeline, num_workers=1, timeout=30, exactly_once=False) as loader:
        assert len(list(loader)) == len(list(pipeline.iter(0)))


def test_a_group_that_makes_other_rows_when_made_again_is_reported(tmp_path):
    marker = str(tmp_path / "later")

    def unsteady(batch: Any) -> list[int]:  # one row more once the marker exists
        return [0] * (6 if os.path.exists(marker) else 5)

    pipeline = Pipeline.range(400, split_size=50).batch(5).map(unsteady).unbatch()
    with Loader(pipeline, num_workers=1, timeout=30) as loader:
        elements = iter(loader)
        next(elements)  # the first row of the first group: the rest are owed
        state = loader.state_dict()
    open(marker, "w").close()
    with Loader(pipeline, num_workers=1, timeout=30, state=state) as loader:
        with pytest.raises(PipelineError, match="made again gave"):
            list(loader)


def _chunks(batch: Any) -> list[Any]:
    """1 or 2 rows of 3 of each padded element (a bucket's batch)."""
    return [row[:3] for row in np.asarray(batch) for _ in range(1 + int(row[0]) % 2)]


def _flat(value: Any) -> tuple[int, ...]:
    return tuple(np.asarray(value).reshape(-1).tolist())


@pytest.mark.parametrize("shape", ["lists", "bucket"])
def test_an_unbatch_of_elements_as_they_come_and_a_bucket_s_rows_resume_exactly(shape):
    if shape == "lists":  # (lists a source yields, unbatched: no batch before the unbatch)
        pipeline = (Pipeline.from_items([list(range(i * 10, i * 10 + i % 4))
                                         for i in range(300)], split_size=20)
                    .unbatch().map(_flat))
    else:  # (a bucket's padded batches, made again padded as they were)
        pipeline = (Pipeline.range(600, split_size=50)
                    .map(lambda x: np.full(1 + int(x) % 5, int(x)))
                    .bucket_by_length(len, [3], [4, 4], pad_value=-1)
                    .map(_chunks).unbatch().map(_flat))
    # (the rows of each element once; after the cut, groups the stopped Loader had
    # learned of come first, made again, then the rest in order)
    assert collections.Counter(resumed(pipeline, [101], num_workers=1)) == \
        collections.Counter(pipeline.iter(0))


# --- groups of other groups' rows, their records split between a job_name's consumers -----


def _nested() -> tuple[Group, Group, Group]:
    """Two groups of split 2's six source elements (a tokenizer's batches of three) and a
    group of the second's three rows (a packer's batch), anchored on split 2 as well."""
    first = Group((0,), 2, 0, 4, 3, (((0,), 2, 0, 3),))
    second = Group((0,), 2, 3, 4, 3, (((0,), 2, 3, 3),))
    packed = Group(second.rows_key, 2, 0, 8, 5, ((second.rows_key, 2, 0, 3),))
    return first, second, packed


def test_states_merged_keep_a_split_open_for_a_group_listed_after_the_elements_that_fill_it():
    """One consumer yielded the first group's rows; the other learned of the second and
    of the packed group made of its rows, and yielded none of the packed rows. The second
    group's elements are the last the split lacked: merged in either order, the split
    must stay open for the packed group (before, merged in the states' order it closed
    first and the packed rows were never made again: 22-56 rows lost in the generated
    split mode)."""
    first, second, packed = _nested()
    one, other = Ledger(), Ledger()
    one.end((0,), 2, 6, 99)
    one.define(first, range(3))
    other.define(second)
    other.define(packed)
    for order in [(one, other), (other, one)]:
        merged = Ledger()
        for ledger in order:
            merged.merge_json(ledger.to_json())
        info = merged.info((0,), 2)
        assert not info.get("all")
        assert [group[:5] for group in skip(info)["groups"]] == \
            [[list(packed.key), 2, 0, 8, 5]]


def test_a_group_one_consumer_holds_whole_through_packed_groups_is_not_made_again():
    """A dead worker's split is read again less what every consumer holds. A group's rows
    were packed into two groups; one consumer got the first rows of the first packed
    group, the other got its last rows and all of the second: the first knows the
    group with two of its rows, the second with all three. Merged in either order, nothing
    is to be made again (before, the second's word did not list the group, whole there,
    and the first's had its third row made again, and so the second packed group's rows:
    repeats)."""
    second = Group((0,), 2, 3, 4, 3, (((0,), 2, 3, 3),))
    packed = Group(second.rows_key, 2, 0, 8, 4, ((second.rows_key, 2, 0, 2),))
    last = Group(second.rows_key, 2, 2, 8, 2, ((second.rows_key, 2, 2, 1),))
    one, other = Ledger(), Ledger()
    one.define_all([(second, second.id, ()), (packed, packed.id, (0, 1))])
    other.define_all([(second, second.id, ()), (packed, packed.id, (2, 3)),
                      (last, last.id, (0, 1))])
    assert other.info((0,), 2)["whole"] == [[[], 4, packed_set({3})]]
    for order in [(one, other), (other, one)]:
        merged = None
        for ledger in order:
            merged = merge_info(merged, ledger.info((0,), 2), ((0,), 2))
        assert merged is not None and "groups" not in skip(merged)
        assert unpack(skip(merged)["skip"]) == {3, 4, 5}
    for bad in [[[[], 4]], [[[1], 4, packed_set({3})]], [[[-1], 4, ""]], "x", [[[], 4, "?"]]]:
        with pytest.raises(ValueError):
            merge_info(None, {"have": "", "whole": bad}, ((0,), 2))


def test_a_record_names_the_groups_of_its_rows_and_no_other():
    """A group goes with the records that hold its rows (a shuffle after the unbatch
    keeps most rows back): a consumer of a ``job_name`` that got none of its rows must not
    claim its elements, or, told of it and holding no row, its word would have all of the
    group's rows made again while another consumer held them (before, every group went
    with the next record too: repeats after a worker's death)."""
    pipeline = Pipeline.range(60, split_size=30).batch(3).map(expand).unbatch().shuffle(30)
    ctx = Context(RunSettings(entropy=3, track=True))
    out = list(plan(pipeline).run_worker(lambda key: (Assigned(s, key) for s in range(2)),
                                         0, ctx))
    for _, origin in out[:5]:
        (code,) = origin
        pass_id, split = ctx.tally.reads[code >> INDEX_BITS]
        origins = decode_origins(ctx.tally.block([origin]), 1)
        assert [group.id for group in origins.groups or ()] == \
            [group_of_rows(ctx.tally.keys[pass_id], split)]


def test_a_record_holding_rows_of_a_group_of_another_group_s_rows_names_both():
    """A job_name's consumers share a worker's records: the one that gets packed rows may
    never get the record that named the group they were packed from, and must know it to
    have them made again (before: 'a group holding rows of another group was handed out
    without it')."""
    pipeline = (Pipeline.range(60, split_size=30).batch(3).map(expand).unbatch()
                .batch(4).map(expand).unbatch())
    ctx = Context(RunSettings(entropy=3, track=True))
    out = list(plan(pipeline).run_worker(lambda key: (Assigned(s, key) for s in range(2)),
                                         0, ctx))
    ctx.tally.block([])  # (the groups made so far go with a record of no rows)
    origins = decode_origins(ctx.tally.block([out[-1][1]]), 1)
    assert origins.groups is not None
    positions = sorted({group.position for group in origins.groups})
    assert len(positions) == 2  # (the tokenizer's unbatch, then the packer's)
    packed = [group for group in origins.groups if group.position == positions[1]]
    assert len(packed) == 1
    assert {group_of_rows(key, split) for key, split, _, _ in packed[0].members} \
        <= {group.id for group in origins.groups if group.position == positions[0]}


def test_a_group_whole_only_over_two_consumers_stays_whole_when_one_s_word_comes_again():
    """Two ``job_name`` consumers each got some rows of one group; a worker died and both
    answered its fence (their rows together: the group whole), and one of them had also
    left, its state's word merged in after (failures._with_left). The group must stay
    whole: before, the second word opened it again with that consumer's rows only, and
    the other's rows were made again (9-17 rows repeated in the generated split mode,
    about 1 run in 80 under load)."""
    group = Group((0,), 2, 0, 4, 3, (((0,), 2, 0, 3),))
    one, other = Ledger(), Ledger()
    one.define(group, (0,))
    other.define(group, (1, 2))
    for words in [(one, other, other), (other, one, other), (one, other, one)]:
        merged = None
        for ledger in words:
            merged = merge_info(merged, ledger.info((0,), 2), ((0,), 2))
        assert merged is not None and "groups" not in skip(merged), words
    merged = merge_info(merge_info(None, one.info((0,), 2), ((0,), 2)),
                        one.info((0,), 2), ((0,), 2))
    assert [g[:5] for g in skip(merged)["groups"]] == [[[0], 2, 0, 4, 3]]  # (still open)
