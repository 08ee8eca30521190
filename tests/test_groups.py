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
    out: list[Any] = []
    with Loader(pipeline, num_workers=2, timeout=30) as loader:
        elements = iter(loader)
        out += itertools.islice(elements, 300)
        loader._processes[0].kill()
        out += list(elements)
    # Every token once: each row of the epoch once, though the dead worker's groups
    # were cut in other places (packed again from their documents)
    assert tokens(out) == reference


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
