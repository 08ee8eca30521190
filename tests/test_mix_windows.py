"""A mix read by several workers keeps its weights in every window of what a trainer sees,
and each stop rule means what it means in one process (docs/semantics.md, "Mixing"): the
consumer draws, as ``Pipeline.iter`` draws, from one stream per input that the workers
make, whatever the number of workers and however few splits an input has."""

from __future__ import annotations

import collections
import functools
import math
import threading
import time
import warnings

import numpy as np
import pytest

from bench.mix_windows import chi_square_p
from tests.service import read_together, run_together, service
from zloader import Loader, Pipeline
from zloader.errors import MixWindowWarning
from zloader.options import JobOptions
from zloader.plan import draws_at_consumer, plan, repeats_moved

WEIGHTS = [0.6, 0.3, 0.1]
BASES = (0, 100_000, 200_000)  # input k's elements are BASES[k] + i


def slowly(value: int) -> int:
    """About 50 us of work: every worker gets a share of the splits."""
    until = time.perf_counter() + 50e-6
    while time.perf_counter() < until:
        pass
    return value


def corpora(splits_c: int = 1, slow: bool = False) -> list[Pipeline]:
    """Three inputs: many splits, 4 splits, and ``splits_c`` splits (a small corpus in
    one shard lands on one worker); the first made ``slowly``."""
    first = Pipeline.range(BASES[0], BASES[0] + 4000, split_size=100)
    return [first.map(slowly) if slow else first,
            Pipeline.range(BASES[1], BASES[1] + 2000, split_size=500),
            Pipeline.range(BASES[2], BASES[2] + 700, split_size=-(-700 // splits_c))]


def which(values: list[int]) -> list[int]:
    return [int(v) // 100_000 for v in values]


def repacked(batch: object) -> object:
    """A map between a batch and its unbatch that keeps the elements (each place's input
    stays known) and makes its rows a group's, as a packer's are."""
    return np.asarray(batch).copy()


def assert_every_window_holds(inputs: list[int], until: int, label: object) -> None:
    """Every window of 1,000 of ``inputs`` (each place's input) before ``until`` holds
    WEIGHTS at chi-square p >= 0.001."""
    for start in range(0, until, 1000):
        window = inputs[start:start + 1000]
        counts = [window.count(k) for k in range(3)]
        assert chi_square_p(counts, WEIGHTS) >= 0.001, (label, start, counts)


def flat(batches: object) -> list[int]:
    return [int(x) for batch in batches for x in np.asarray(batch).reshape(-1)]


def test_the_chi_square_helper_agrees_with_known_values() -> None:
    # (two categories, stat 10: p = 0.00157; three, 2 degrees of freedom: p = e^(-stat/2))
    assert chi_square_p([550, 450], [0.5, 0.5]) == pytest.approx(0.00157, rel=0.01)
    assert chi_square_p([600, 300, 100], WEIGHTS) == pytest.approx(1.0)
    assert chi_square_p([650, 250, 100], WEIGHTS) == pytest.approx(math.exp(-6.25))
    assert chi_square_p([660, 240, 100], WEIGHTS) < 0.001


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_every_window_of_1000_holds_the_weights_with_any_number_of_workers(
        workers: int) -> None:
    mix = Pipeline.mix(corpora(1, slow=True), WEIGHTS, seed=11).batch(8)
    with Loader(mix, num_workers=workers, timeout=60) as loader:
        got = flat(loader)
        # (several made some: the streams met; on 2 cores not all 8 may get a split)
        assert len(loader.stats()["per_worker"]) >= min(workers, 2)
    assert sorted(got) == sorted(flat(mix.iter(0)))
    inputs = which(got)
    # The draws are iter()'s whatever the workers: the same input at every place.
    assert inputs == which(flat(mix.iter(0)))
    # Before any input runs out (the 10% one, 700 elements, near draw 7,000):
    assert_every_window_holds(inputs, 5000, workers)


@pytest.mark.parametrize("workers", [2, 8])
def test_first_exhausted_ends_the_mix_when_its_first_input_ends_across_workers(
        workers: int) -> None:
    mix = Pipeline.mix(corpora(4), WEIGHTS, seed=5, stop="first_exhausted")
    sizes = {0: 4000, 1: 2000, 2: 700}
    with Loader(mix, num_workers=workers, timeout=60) as loader:
        for epoch in range(2):  # (the second epoch starts on workers the first left)
            want = [int(v) for v in mix.iter(epoch)]
            got = [int(v) for v in loader]
            assert len(got) == len(want), epoch
            assert which(got) == which(want)  # (so as many of each input)
            assert len(set(got)) == len(got)
            # The input whose end ended the mix is taken whole; the others' elements
            # are as many, but with several workers not the same ones: each input's
            # stream comes in another order, as any stream does.
            (first,) = [k for k in sizes if which(want).count(k) == sizes[k]]
            assert sorted(v for v in got if v // 100_000 == first) == \
                sorted(v for v in want if v // 100_000 == first)


@pytest.mark.parametrize("workers", [2, 8])
def test_a_deterministic_mix_holds_its_weights_in_every_window_and_resumes_exactly(
        workers: int) -> None:
    # Drawn here over each input's shards in turn: iter()'s draws, the same stream on
    # every run, and a state that resumes it exactly with another number of workers.
    mix = Pipeline.mix(corpora(1, slow=True), WEIGHTS, seed=11).batch(8)
    assert draws_at_consumer(mix, JobOptions(deterministic=True, shards=workers))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixWindowWarning)
        with Loader(mix, num_workers=workers, deterministic=True, timeout=60) as loader:
            whole = flat(loader)
    assert which(whole) == which(flat(mix.iter(0)))
    assert sorted(whole) == sorted(flat(mix.iter(0)))
    assert_every_window_holds(which(whole), 5000, workers)
    with Loader(mix, num_workers=workers, deterministic=True, timeout=60) as loader:
        batches = iter(loader)
        head = flat([next(batches) for _ in range(300)])
        state = loader.state_dict()
    assert state["order"] == {"shards": workers, "outputs": 300}
    with Loader(mix, num_workers=3, deterministic=True, timeout=60, state=state) as loader:
        rest = flat(loader)
    assert head + rest == whole


def test_a_deterministic_mix_ends_at_its_first_input_s_end_across_its_shards() -> None:
    mix = Pipeline.mix(corpora(4), WEIGHTS, seed=5, stop="first_exhausted")
    want = which([int(v) for v in mix.iter(0)])
    with Loader(mix, num_workers=4, deterministic=True, timeout=60) as loader:
        got = [int(v) for v in loader]
    assert which(got) == want and len(set(got)) == len(got)  # (as many of each input)


def test_balanced_consumers_each_draw_the_mix_with_its_weights_in_every_window() -> None:
    # balanced=N (what zloader.torch.IterableDataset sets under torch.distributed): each
    # input's records are dealt round-robin, and each consumer draws from what it is
    # dealt, as iter() draws, so every rank's stream holds the weights.
    mix = Pipeline.mix(corpora(1, slow=True), WEIGHTS, seed=11)
    assert draws_at_consumer(mix, JobOptions(balanced=2))
    with service(workers=2) as (address, _):
        loaders = [Loader(mix, broker=address, job_name="dealt-mix", balanced=2,
                          timeout=60) for _ in range(2)]
        try:
            (first,), (second,) = read_together(loaders, element=int)
        finally:
            for loader in loaders:
                loader.close()
    assert sorted(first + second) == sorted(int(v) for v in mix.iter(0))
    want = which([int(v) for v in mix.iter(0)])
    for got in (first, second):
        assert which(got)[:2000] == want[:2000]  # (before its share of an input ends)
        assert_every_window_holds(which(got), 3000, "balanced")


def test_balanced_consumers_in_step_one_opening_late_learn_of_every_input_s_end() -> None:
    # The ranks of a DDP run step together (one element each, then wait for the other).
    # One opens the epoch late: a worker that has none of an input ends it at once, and
    # that END went only to the Loader that had opened; the late one waited for it for
    # ever (its draw of that input), and the other for it (the step). An input's END
    # now waits, as its records do, for every balanced consumer to open the epoch.
    small = Pipeline.range(BASES[2], BASES[2] + 300, split_size=300)  # (ends early)
    mix = Pipeline.mix([*corpora(1)[:2], small], WEIGHTS, seed=11)
    out: list[list[int]] = [[], []]
    step = threading.Barrier(2)
    with service(workers=2) as (address, _):
        loaders = [Loader(mix, broker=address, job_name="dealt-late", balanced=2,
                          timeout=20) for _ in range(2)]

        def read(i: int) -> None:
            try:
                if i == 1:
                    time.sleep(1.0)  # (opens the epoch after every worker has begun it)
                elements = iter(loaders[i])
                try:
                    for value in elements:
                        out[i].append(int(value))
                        step.wait(30)
                except threading.BrokenBarrierError:  # (the other one ended: read alone)
                    out[i].extend(int(value) for value in elements)
            finally:
                step.abort()

        try:
            run_together([functools.partial(read, i) for i in range(2)], 90)
        finally:
            for loader in loaders:
                loader.close()
    assert sorted(out[0] + out[1]) == sorted(int(v) for v in mix.iter(0))


@pytest.mark.slow
def test_balanced_consumers_whose_draws_part_ways_are_not_held_up_by_each_other() -> None:
    # One of two balanced Loaders changes its weights mid-epoch: from then on the two
    # draw the inputs in other proportions. Dealt strictly in turn, each waited for a
    # record of an input the other held back (a deadlock, then Timeout); now a consumer
    # whose turn it is but that takes none of an input lately is passed over.
    mix = Pipeline.mix(corpora(1, slow=True), WEIGHTS, seed=11)
    out: list[list[int]] = [[], []]
    with service(workers=2) as (address, _):
        loaders = [Loader(mix, broker=address, job_name="dealt-apart", balanced=2,
                          timeout=30) for _ in range(2)]

        def read(i: int) -> None:
            for value in loaders[i]:
                out[i].append(int(value))
                if i == 0 and len(out[0]) == 500:
                    loaders[0].set_weights([0.1, 0.1, 0.8])

        try:
            run_together([functools.partial(read, i) for i in range(2)], 60)
        finally:
            for loader in loaders:
                loader.close()
    assert sorted(out[0] + out[1]) == sorted(int(v) for v in mix.iter(0))
    assert which(out[0][600:900]).count(2) > 150  # (its new weights, 0.8 for input 2)


def test_never_draws_for_ever_with_workers_and_a_take_ends_it() -> None:
    mix = Pipeline.mix(corpora(1), WEIGHTS, seed=3, stop="never").take(9000)
    with Loader(mix, num_workers=4, timeout=60) as loader:
        got = [int(v) for v in loader]
    assert len(got) == 9000
    assert which(got) == which([int(v) for v in mix.iter(0)])
    small = [v for v in got if v >= BASES[2]]
    assert len(small) > 700  # (the small input started over: a new pass of it)


def test_a_weight_set_to_0_mid_epoch_applies_from_the_next_draw() -> None:
    mix = Pipeline.mix(corpora(1), WEIGHTS, seed=2)
    with Loader(mix, num_workers=2, timeout=60) as loader:
        got = []
        for value in loader:
            got.append(int(value))
            if len(got) == 1000:
                loader.set_weights([0.5, 0.5, 0.0])
    after = which(got[1000:])
    assert 2 not in after  # (drawn here: no prefetched record of the old weights)
    assert set(which(got[:1000])) == {0, 1, 2}
    assert len(got) == 6000 + sum(1 for k in which(got[:1000]) if k == 2)


def test_a_state_counts_exactly_what_was_yielded_through_a_filter_and_a_batch() -> None:
    # Drawn here, then filtered and batched here: a state taken mid-epoch must count the
    # elements the filter dropped before the last batch and leave out those of the batch
    # being filled (and a resume of that resume too).
    mix = Pipeline.mix(corpora(4), WEIGHTS, seed=9).map(lambda v: v).filter(
        lambda v: v % 7 != 3).batch(5)
    assert draws_at_consumer(mix, JobOptions(exactly_once=True))
    want = sorted(flat(mix.iter(0)))
    out: list[int] = []
    state = None
    for stop_after in (150, 333):
        with Loader(mix, num_workers=2, timeout=60, state=state) as loader:
            batches = iter(loader)
            for _ in range(stop_after):
                out += flat([next(batches)])
            state = loader.state_dict()
    with Loader(mix, num_workers=2, timeout=60, state=state) as loader:
        out += flat(loader)
    assert sorted(out) == want


def test_a_worker_killed_while_the_draws_wait_for_its_input_loses_and_repeats_nothing() -> None:
    # The 10% input in one split: one worker reads it; killed mid-epoch, its split is read
    # again by the other (the draws meanwhile go on with what they have).
    mix = Pipeline.mix(corpora(1), WEIGHTS, seed=4).batch(8)
    with Loader(mix, num_workers=2, timeout=60) as loader:
        batches = iter(loader)
        out = flat([next(batches) for _ in range(200)])
        loader._processes[0].kill()
        out += flat(batches)
    assert sorted(out) == sorted(flat(mix.iter(0)))


def test_the_loaders_of_a_job_name_each_draw_and_share_every_element_once() -> None:
    import threading

    from tests.service import service

    mix = Pipeline.mix(corpora(1), WEIGHTS, seed=6)
    got: list[list[int]] = [[], []]
    with service(workers=2) as (address, _procs):
        loaders = [Loader(mix, broker=address, timeout=60, job_name="pair") for _ in range(2)]
        try:
            threads = [threading.Thread(target=lambda i=i: got[i].extend(
                int(v) for v in loaders[i]), daemon=True) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert not any(thread.is_alive() for thread in threads)
        finally:
            for loader in loaders:
                loader.close()
    assert sorted(got[0] + got[1]) == sorted(int(v) for v in mix.iter(0))
    for mine in got:  # each Loader's own stream holds the weights (its own draws)
        head = which(mine)[:1000]
        assert chi_square_p([head.count(k) for k in range(3)], WEIGHTS) >= 0.001


def vectorised(batch: object) -> object:
    return np.asarray(batch) * 2 + 1


def test_a_state_taken_through_a_shuffle_after_the_mix_over_groups_of_groups_resumes() -> None:
    # Drawn here and shuffled here: records are yielded out of the order they came, so a
    # record naming groups of rows of groups another record named may be noted first
    # (tests/test_generated.py seed 41: rows repeated, or the epoch ended short).
    rows = Pipeline.from_arrays(np.arange(198, dtype=np.int64) + 7, split_size=16).map(int) \
        .batch(10).map(vectorised).unbatch().map(int) \
        .batch(8).map(vectorised).unbatch().map(int)
    mix = Pipeline.choose([rows, Pipeline.range(100_000, 100_300, split_size=7)],
                          [0, 0, 0, 1]).shuffle(30, seed=1)
    assert draws_at_consumer(mix, JobOptions(exactly_once=True))
    want = sorted(int(v) for v in mix.iter(0))
    for cut in (150, 288, 480):
        with Loader(mix, num_workers=2, timeout=30) as loader:
            elements = iter(loader)
            out = [int(next(elements)) for _ in range(cut)]
            state = loader.state_dict()
        with Loader(mix, num_workers=2, timeout=30, state=state) as loader:
            out += [int(v) for v in loader]
        assert sorted(out) == want, cut


def test_a_mix_drawn_on_several_workers_says_why_its_windows_may_drift() -> None:
    """An endless repeat after a first_exhausted mix, two repeats after a mix that cannot
    move, or a deterministic job without fixed shards keep the workers drawing it: the
    Loader warns (naming the stage or the option) when several workers will; never for
    a mix the consumer draws (packing after it, a repeat moved onto its inputs or drawn
    pass by pass included, also over an input that repeats itself) or for one worker."""
    inputs = [Pipeline.range(0, 40, split_size=10), Pipeline.range(100, 140, split_size=10)]
    first = Pipeline.mix(inputs, weights=[1, 1], seed=3, stop="first_exhausted")
    with pytest.warns(MixWindowWarning, match=r"stage 'repeat\(None\)' follows the mix"
                      r".*first_exhausted' ends each worker's mix"):
        with Loader(first.repeat().take(100), num_workers=2) as loader:
            assert len(list(loader)) == 100
    batched = Pipeline.mix(inputs, weights=[1, 1], seed=3).batch(4)
    twice = batched.repeat(2).map(list).repeat(2)  # (two repeats: neither moves)
    with pytest.warns(MixWindowWarning, match=r"stage 'repeat\(2\)' follows the mix"
                      r".*whole\)\. docs/semantics"):  # (all_exhausted: nothing on the stop)
        with Loader(twice, num_workers=2) as loader:
            assert sorted(flat(loader)) == sorted(flat(twice.iter()))
    with pytest.warns(MixWindowWarning, match=r"deterministic=True without fixed shards"):
        with Loader(batched, num_workers=2, deterministic=True, sharding="static") as loader:
            assert sorted(flat(loader)) == sorted(flat(batched.iter()))
    repeated = Pipeline.mix(inputs, weights=[1, 1], seed=3).repeat(2)
    packing = Pipeline.mix(inputs, weights=[1, 1], seed=3).batch(4).map(list).unbatch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixWindowWarning)
        with Loader(packing, num_workers=2) as loader:
            assert sorted(loader) == sorted(packing.iter())
        with Loader(repeated, num_workers=2) as loader:
            assert sorted(loader) == sorted(repeated.iter())
        nested = Pipeline.mix([inputs[0].repeat(2), inputs[1]], weights=[1, 1], seed=3)
        for again in (nested.repeat(2), nested.batch(4).repeat(2)):  # (moved, pass by pass)
            with Loader(again, num_workers=2) as loader:
                assert sorted(flat(loader)) == sorted(flat(again.iter()))
        for passes in (batched.repeat(2), first.repeat(2)):  # (drawn pass by pass)
            with Loader(passes, num_workers=2) as loader:
                got = flat(loader)
            # (the same draws; first_exhausted: of the input that had not ended, as many
            # others of its elements, as any stream of two workers)
            assert [v // 100 for v in got] == [v // 100 for v in flat(passes.iter())]
        with Loader(twice, num_workers=1) as loader:  # (one worker: iter()'s stream)
            assert flat(loader) == flat(twice.iter())
        with Loader(batched, num_workers=2) as loader:
            assert sum(len(b) for b in loader) == 80


@pytest.mark.parametrize("workers", [2, 4])
def test_a_repeat_the_consumer_draws_pass_by_pass_keeps_iter_s_draws_and_stop_rule(
        workers: int) -> None:
    """A repeat after a first_exhausted mix, or after a packer, cannot move onto the
    inputs: the consumer draws each pass of it over each input's stream of that pass. The
    draws are iter()'s place by place with any number of workers, so each pass ends
    where its first input ends (as many elements of each input as iter()), and every
    window holds the weights."""
    first = Pipeline.mix(corpora(1, slow=True), WEIGHTS, seed=6,
                         stop="first_exhausted").map(int).repeat(3)
    packed = Pipeline.mix(corpora(4), WEIGHTS, seed=2).batch(7).map(repacked).unbatch() \
        .repeat(2)
    for mix in (first, packed):
        assert plan(mix, JobOptions()).passes in (2, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", MixWindowWarning)
            with Loader(mix, num_workers=workers, timeout=60) as loader:
                got = flat(loader)
        want = flat(mix.iter(0))
        assert which(got) == which(want)
        if mix is packed:
            assert sorted(got) == sorted(want)
    inputs = which(got)
    assert_every_window_holds(inputs, 12_000, workers)


def test_a_repeat_drawn_pass_by_pass_resumes_and_survives_a_worker_kill() -> None:
    """Exactly-once through a repeat drawn pass by pass (a packer before it): a state in
    the second pass, its resume's state resumed, and a worker SIGKILLed mid-epoch."""
    mix = Pipeline.mix(corpora(2), WEIGHTS, seed=4).batch(5).map(repacked).unbatch() \
        .repeat(2)
    assert plan(mix, JobOptions()).passes == 2
    resumed_twice_and_killed(mix)


def resumed_twice_and_killed(mix: Pipeline) -> None:
    """``mix`` through 2 workers: stopped at element 9,000, its state resumed and stopped
    2,000 later, that state resumed to the end; then a worker SIGKILLed at element 7,000:
    each time, the multiset of ``iter()``."""
    want = sorted(flat(mix.iter(0)))
    out: list[int] = []
    state = None
    for cut in (9000, 2000):
        with Loader(mix, num_workers=2, timeout=60, state=state) as loader:
            elements = iter(loader)
            out += [int(next(elements)) for _ in range(cut)]
            state = loader.state_dict()
    with Loader(mix, num_workers=2, timeout=60, state=state) as loader:
        out += [int(v) for v in loader]
    assert sorted(out) == want
    with Loader(mix, num_workers=2, timeout=60) as loader:
        elements = iter(loader)
        out = [int(next(elements)) for _ in range(7000)]
        loader._processes[0].kill()
        out += [int(v) for v in elements]
    assert sorted(out) == want


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_a_repeat_after_the_mix_is_drawn_by_the_consumer_and_every_window_holds(
        workers: int) -> None:
    """``mix.map.repeat(2)`` runs as a mix of repeated inputs: every element twice, as
    ``iter()`` yields them, the weights in every window of 1,000 with any number of
    workers, the same draws with any number (those of the moved pipeline's ``iter()``),
    and no warning."""
    mix = Pipeline.mix(corpora(1, slow=True), WEIGHTS, seed=11).map(int).repeat(2).batch(8)
    moved = repeats_moved(mix, JobOptions())
    assert [len(p.stages) for p in moved.source.inputs] == [2, 1, 1]  # (each + repeat)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixWindowWarning)
        with Loader(mix, num_workers=workers, timeout=60) as loader:
            got = flat(loader)
    assert sorted(got) == sorted(flat(mix.iter(0)))  # (each element twice)
    inputs = which(got)
    assert inputs == which(flat(moved.iter(0)))
    # Before any input runs out (each near draw 13,000 of 13,400):
    assert_every_window_holds(inputs, 12_000, workers)


def test_a_repeat_moved_onto_the_inputs_resumes_and_survives_a_worker_kill() -> None:
    """Exactly-once through the moved repeat: a state taken in the second pass, resumed
    (and that resume's state resumed), and a worker SIGKILLed mid-epoch."""
    mix = Pipeline.mix(corpora(2), WEIGHTS, seed=4).filter(lambda x: x % 7).repeat(2)
    resumed_twice_and_killed(mix)


def test_a_repeat_after_a_mix_whose_input_repeats_itself_resumes_and_survives_a_kill(
) -> None:
    """Passes within passes (an input's own repeat, the one after the mix moved onto it):
    exactly-once through resumes and a worker's SIGKILL. The broker kept one origin per
    (pass, split), so a pass that read another pass's re-queued split and then its own
    copy of it sent its own as the other's, its first element skipped: lost."""
    inputs = corpora(2)
    mix = Pipeline.mix([inputs[0].repeat(2), *inputs[1:]], WEIGHTS, seed=4).repeat(2)
    assert [len(p.stages) for p in repeats_moved(mix, JobOptions()).source.inputs] == [2, 1, 1]
    resumed_twice_and_killed(mix)


def documents_of(k: int) -> Pipeline:
    """Input ``k``'s documents: 1 to 9 tokens each, padded with -1 to 9 (so that they
    batch), each token ``BASES[k] + 10 * document + place``."""
    def document(i: object) -> np.ndarray:
        i = int(i)  # type: ignore[call-overload]
        out = np.full(9, -1, np.int64)
        out[:1 + i % 9] = [BASES[k] + 10 * i + t for t in range(1 + i % 9)]
        return out
    sizes = (600, 300, 100)
    return Pipeline.range(sizes[k], split_size=(50, 100, 100)[k]).map(document)


def pack(docs: object) -> np.ndarray:
    """The batch's tokens, in order, cut into rows of 8 (the last padded with -1)."""
    tokens = [int(t) for doc in np.asarray(docs) for t in doc if t >= 0]
    rows = np.full((-(-len(tokens) // 8), 8), -1, np.int64)
    rows.reshape(-1)[:len(tokens)] = tokens
    return rows


def packed_mix() -> Pipeline:
    """Three corpora mixed 0.6/0.3/0.1, then packed: the packer after the mix."""
    return (Pipeline.mix([documents_of(k) for k in range(3)], weights=WEIGHTS, seed=7)
            .batch(5).map(pack).unbatch())


def tokens_of(rows: object) -> list[int]:
    return [int(t) for row in rows for t in np.asarray(row) if t >= 0]  # type: ignore[attr-defined]


def documents_in_order(rows: object) -> list[int]:
    """Each document's input, in the order its first token comes."""
    seen: dict[int, None] = {}
    for token in tokens_of(rows):
        seen.setdefault(token // 10, None)
    return [document * 10 // 100_000 for document in seen]


@pytest.mark.parametrize("workers", [2, 4])
def test_packing_after_the_mix_keeps_iter_s_draws_with_any_number_of_workers(workers) -> None:
    """A packer after the mix (how mixed pretraining data is packed) no longer makes each
    worker draw the mix among its own splits: the consumer draws, so the inputs of the
    documents packed come in iter()'s order, place by place, and every token once."""
    pipeline = packed_mix()
    reference = list(pipeline.iter())
    assert draws_at_consumer(pipeline, JobOptions())
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixWindowWarning)
        with Loader(pipeline, num_workers=workers, timeout=30) as loader:
            rows = list(loader)
    assert sorted(tokens_of(rows)) == sorted(tokens_of(reference))
    assert documents_in_order(rows) == documents_in_order(reference)


@pytest.mark.parametrize("cuts", [(23,), (57, 31)])
def test_a_state_taken_mid_group_after_the_mix_resumes_every_token_once(cuts) -> None:
    """A state taken while a packed group's rows are partly yielded names the group: the
    resumed Loader makes the rows left (reading the group's documents again in this
    process, the split they anchor handed out again), and a resume of that resume too."""
    pipeline = packed_mix()
    want = sorted(tokens_of(pipeline.iter()))
    got: list[int] = []
    state = None
    for cut in cuts:
        with Loader(pipeline, num_workers=2, timeout=30, state=state) as loader:
            elements = iter(loader)
            got += tokens_of(next(elements) for _ in range(cut))
            state = loader.state_dict()
    with Loader(pipeline, num_workers=2, timeout=30, state=state) as loader:
        got += tokens_of(loader)
    assert sorted(got) == want


def test_a_worker_killed_while_the_consumer_packs_after_the_mix_loses_nothing() -> None:
    """The groups are made by the consumer: a worker's death loses none of their rows,
    and its documents read again are packed once."""
    pipeline = packed_mix()
    with Loader(pipeline, num_workers=2, timeout=30) as loader:
        elements = iter(loader)
        rows = [next(elements) for _ in range(40)]
        loader._processes[0].kill()
        rows += list(elements)
    assert sorted(tokens_of(rows)) == sorted(tokens_of(pipeline.iter()))


def test_job_name_consumers_packing_after_the_mix_resume_every_token_once() -> None:
    """Two consumers of one job each draw and pack; resumed (both from the list of both
    states), a group left partly yielded has its missing rows made by one consumer: the
    one that gets the record of the worker that reads its anchor again."""
    import threading

    from tests.service import service

    pipeline = packed_mix()
    got: list[list[int]] = [[], []]
    with service(workers=2) as (address, _procs):
        def run(states: object, cut: int | None) -> list[object]:
            loaders = [Loader(pipeline, broker=address, timeout=60, job_name="pack",
                              state=states) for _ in range(2)]
            try:
                def read(i: int) -> None:
                    elements = iter(loaders[i])
                    for row in (elements if cut is None else
                                (next(elements) for _ in range(cut))):
                        got[i].extend(tokens_of([row]))
                threads = [threading.Thread(target=read, args=(i,), daemon=True)
                           for i in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(120)
                assert not any(thread.is_alive() for thread in threads)
                return [loader.state_dict() for loader in loaders]
            finally:
                for loader in loaders:
                    loader.close()
        states = run(None, 17)
        run(states, None)
    assert sorted(got[0] + got[1]) == sorted(tokens_of(pipeline.iter()))


def test_a_job_name_loader_that_ended_a_first_exhausted_mix_keeps_what_it_drew() -> None:
    """A first_exhausted mix drawn here ends with records of its other input partly
    drawn. A Loader of a job_name that ended the epoch so has a state naming what it drew
    of them: a Loader resumed from it and from the state of another that stopped
    mid-epoch repeats none of them (before: they were left out, and yielded again)."""
    from tests.service import service

    mix = Pipeline.mix([Pipeline.range(5), Pipeline.range(1000, 3000, split_size=100)],
                       [1, 99], seed=4, stop="first_exhausted")
    got: dict[str, list[int]] = {"stopped": [], "ended": []}
    with service(workers=2) as (address, _procs):
        loaders = {name: Loader(mix, broker=address, timeout=60, job_name="ended")
                   for name in got}
        try:
            reader = threading.Thread(target=lambda: got["ended"].extend(
                int(v) for v in loaders["ended"]), daemon=True)
            reader.start()
            elements = iter(loaders["stopped"])
            got["stopped"] += [int(next(elements)) for _ in range(20)]
            states = [loaders["stopped"].state_dict()]
            loaders["stopped"].close()  # (mid-epoch, as the other reads on)
            reader.join(120)
            assert not reader.is_alive()
            states.append(loaders["ended"].state_dict())
        finally:
            for loader in loaders.values():
                loader.close()
        with Loader(mix, broker=address, timeout=60, job_name="ended-resumed",
                    state=states) as resumed:
            rest = [int(v) for v in resumed]
    every = got["stopped"] + got["ended"] + rest
    assert set(range(5)) <= set(every)  # (the input that ended, whole)
    repeated = [v for v, n in collections.Counter(every).items() if n > 1]
    assert not repeated, f"{len(repeated)} yielded again after the resume: {repeated[:8]}"
    assert rest  # (the draws after the resume reach the other input)
