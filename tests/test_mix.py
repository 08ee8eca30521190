"""``Pipeline.mix`` and ``Pipeline.choose``: elements drawn from several input pipelines
by weight or in a pattern, each input keeping its own splits, shuffles and maps; in one
process (the reference) and through Loaders, where one worker reads what ``iter`` reads and
a killed worker loses and repeats nothing of any input."""

from __future__ import annotations

import collections
import itertools
import signal
import threading

import numpy as np
import pytest

from tests.fakes import FakeMerger
from tests.service import service
from zloader import Loader, Pipeline


def tagged(name: str):
    return lambda x: (name, int(x))


def inputs() -> list[Pipeline]:
    a = Pipeline.range(1000, split_size=50).map(tagged("a"))
    b = (Pipeline.range(500, split_size=50, shuffle_splits=True, seed=3).map(tagged("b"))
         .shuffle(50, seed=1))
    c = Pipeline.range(100, split_size=25).map(tagged("c"))
    return [a, b, c]


def names(elements) -> collections.Counter:
    return collections.Counter(name for name, _ in elements)


def as_tuples(elements) -> list[tuple[str, int]]:
    return [(str(name), int(x)) for name, x in elements]


def test_all_exhausted_reads_every_input_whole_and_draws_by_weight_while_all_last():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7)
    out = list(mix.iter(0))
    assert names(out) == {"a": 1000, "b": 500, "c": 100}
    assert sorted(out) == sorted(itertools.chain(*(p.iter(0) for p in inputs())))
    head = names(out[:300])  # all three inputs still last: about 60/30/10
    assert 130 <= head["a"] <= 230 and 50 <= head["b"] <= 130 and 10 <= head["c"] <= 60
    # each input's own order is kept: input a's elements come in its order
    assert [x for name, x in out if name == "a"] == list(range(1000))


def test_a_seeded_mix_repeats_per_epoch_and_differs_between_epochs_and_seeds():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7)
    assert list(mix.iter(0)) == list(mix.iter(0))
    assert list(mix.iter(0)) != list(mix.iter(1))
    assert list(mix.iter(0)) != list(Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=8).iter(0))


def test_first_exhausted_ends_with_the_first_input_to_end():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7, stop="first_exhausted")
    out = list(mix.iter(0))
    counts = names(out)
    assert counts["c"] == 100 and counts["a"] < 1000 and counts["b"] < 500


def test_never_repeats_each_input_and_holds_the_weights():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7, stop="never")
    counts = names(itertools.islice(mix.iter(0), 100_000))
    assert abs(counts["a"] / 100_000 - 0.6) < 0.01
    assert abs(counts["b"] / 100_000 - 0.3) < 0.01
    assert abs(counts["c"] / 100_000 - 0.1) < 0.01


def test_never_ends_when_every_input_is_empty_and_drops_an_empty_one():
    empty = Pipeline.range(0)
    assert list(Pipeline.mix([empty, empty], stop="never").iter(0)) == []
    out = list(itertools.islice(Pipeline.mix([empty, Pipeline.range(3)], stop="never")
                                .iter(0), 7))
    assert [int(x) for x in out] == [0, 1, 2, 0, 1, 2, 0]


def test_a_zero_weight_input_is_never_read():
    def boom(x):
        raise AssertionError("read")
    mix = Pipeline.mix([Pipeline.range(10), Pipeline.range(10).map(boom)], [1, 0], seed=1)
    assert sorted(int(x) for x in mix.iter(0)) == list(range(10))


def test_choose_takes_the_inputs_in_its_pattern():
    a, _, c = inputs()
    out = list(Pipeline.choose([a, c], [0, 0, 1]).iter(0))
    assert out[:6] == [("a", 0), ("a", 1), ("c", 0), ("a", 2), ("a", 3), ("c", 1)]
    assert names(out) == {"a": 1000, "c": 100}  # all_exhausted: a goes on alone
    first = list(Pipeline.choose([a, c], [0, 0, 1], stop="first_exhausted").iter(0))
    assert names(first) == {"a": 202, "c": 100}  # a, a, then c has none: the end


def test_stages_after_the_mix_see_the_mixed_stream():
    mix = Pipeline.mix(inputs(), seed=2).map(lambda pair: pair[0]).batch(100)
    batches = list(mix.iter(0))
    assert [len(b) for b in batches] == [100] * 16
    assert collections.Counter(str(v) for b in batches for v in b) == {
        "a": 1000, "b": 500, "c": 100}


def test_equal_mixes_have_equal_fingerprints():
    one = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7)
    assert one.fingerprint == Pipeline.mix(inputs(), [6, 3, 1], seed=7).fingerprint
    assert one.fingerprint != Pipeline.mix(inputs(), [5, 3, 1], seed=7).fingerprint
    assert one.fingerprint != Pipeline.mix(inputs()[::-1], [0.1, 0.3, 0.6], seed=7).fingerprint
    assert one.fingerprint != Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=8).fingerprint


@pytest.mark.parametrize("call, error, match", [
    (lambda: Pipeline.mix([]), ValueError, "at least one"),
    (lambda: Pipeline.mix([Pipeline.range(3), [1, 2]]), TypeError, "input 1 must be"),
    (lambda: Pipeline.mix([Pipeline.range(3)], [1, 2]), ValueError, "one weight per input"),
    (lambda: Pipeline.mix([Pipeline.range(3)] * 2, [1, -1]), ValueError, ">= 0"),
    (lambda: Pipeline.mix([Pipeline.range(3)] * 2, [0, 0]), ValueError, "not all 0"),
    (lambda: Pipeline.mix([Pipeline.range(3)] * 2, [1, float("nan")]), ValueError, "finite"),
    (lambda: Pipeline.mix([Pipeline.range(3)], stop="shortest"), ValueError, "stop must be"),
    (lambda: Pipeline.choose([Pipeline.range(3)], [0, 1]), ValueError, "pattern must name"),
    (lambda: Pipeline.choose([Pipeline.range(3)], []), ValueError, "pattern must name"),
    (lambda: Pipeline.mix([Pipeline.mix([Pipeline.range(3)])]), ValueError, "itself a mix"),
    (lambda: Pipeline.mix([Pipeline.range(3).take(2)]), ValueError, "take/skip"),
    (lambda: Pipeline.mix([Pipeline.range(3)]).cache(), ValueError, "cache each input"),
])
def test_bad_mixes_are_refused_with_what_to_change(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_one_worker_reads_what_iter_reads_and_two_read_the_same_elements():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7)
    reference = as_tuples(mix.iter(0))
    with Loader(mix, num_workers=1, timeout=30) as loader:
        assert as_tuples(loader) == reference
    with Loader(mix, num_workers=2, timeout=30) as loader:
        assert sorted(as_tuples(loader)) == sorted(reference)


def test_an_endless_mix_through_two_workers_holds_the_weights():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7, stop="never")
    with Loader(mix.take(20_000), num_workers=2, timeout=30) as loader:
        counts = names(loader)
    assert abs(counts["a"] / 20_000 - 0.6) < 0.03 and abs(counts["c"] / 20_000 - 0.1) < 0.02


def test_first_exhausted_through_loaders_ends_as_iter_does_and_reads_nothing_twice():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7, stop="first_exhausted")
    reference = as_tuples(mix.iter(0))
    with Loader(mix, num_workers=1, timeout=30) as loader:
        assert as_tuples(loader) == reference
    # Two workers, each stopping with its first input to end: the other inputs' splits it
    # was handed are read to their end and dropped, so exactly-once reads none again;
    # one worker is killed on the way (its splits go to the other, or are dropped there).
    with service(workers=2) as (address, procs):
        with Loader(mix.map(slow), broker=address, timeout=30) as loader:
            got = []
            for i, element in enumerate(as_tuples(loader)):
                got.append(element)
                if i == 300:
                    procs[0].send_signal(signal.SIGKILL)
            stats = loader.stats()
    assert len(set(got)) == len(got), "an element came twice"
    counts = names(got)
    assert counts["c"] == 100 and counts["a"] < 1000 and counts["b"] < 500
    assert stats["elements"] == len(got)


def slow(pair):
    import time
    time.sleep(0.002)
    return pair


def test_a_killed_worker_loses_and_repeats_nothing_of_any_input():
    mix = Pipeline.mix(inputs(), [0.6, 0.3, 0.1], seed=7).map(slow)
    with service(workers=2) as (address, procs):
        seen: collections.Counter = collections.Counter()
        with Loader(mix, broker=address, timeout=30) as loader:
            for i, element in enumerate(as_tuples(loader)):
                seen[element] += 1
                if i == 300:
                    procs[0].send_signal(signal.SIGKILL)
    expected = collections.Counter(as_tuples(itertools.chain(*(p.iter(0) for p in inputs()))))
    assert seen == expected


def test_an_endless_mix_goes_on_past_a_killed_worker_reading_each_pass_once():
    a = Pipeline.range(600, split_size=50).map(tagged("a"))
    b = Pipeline.range(200, split_size=25).map(tagged("b"))
    mix = Pipeline.mix([a, b], [0.7, 0.3], seed=1, stop="never").map(slow)
    with service(workers=2) as (address, procs):
        seen: collections.Counter = collections.Counter()
        with Loader(mix.take(2000), broker=address, timeout=30) as loader:
            for i, element in enumerate(as_tuples(loader)):
                seen[element] += 1
                if i == 300:
                    procs[0].send_signal(signal.SIGKILL)
    assert sum(seen.values()) == 2000
    for name, size in (("a", 600), ("b", 200)):
        counts = [seen[(name, x)] for x in range(size)]
        # each element once per pass; at the cut one worker may be a pass ahead of the
        # other, whose pass may still hold the dead worker's re-queued splits: <= 2 apart
        assert max(counts) - min(counts) <= 2, (name, collections.Counter(counts))
        assert min(counts) >= 1


def two_inputs() -> list[Pipeline]:
    return [Pipeline.range(5000, split_size=100).map(tagged("a")),
            Pipeline.range(5000, split_size=100).map(tagged("b"))]


def test_set_weights_changes_a_running_mix_from_the_elements_made_after_it():
    mix = Pipeline.mix(two_inputs(), [0.9, 0.1], seed=1, stop="never")
    with Loader(mix, num_workers=2, timeout=30) as loader:
        elements = iter(loader)
        before = names(as_tuples(itertools.islice(elements, 4000)))
        loader.set_weights([1, 9])
        # made before the change: in flight (up to the prefetch's records of each worker)
        list(itertools.islice(elements, 6000))
        after = names(as_tuples(itertools.islice(elements, 3000)))
    assert before["a"] > 0.85 * 4000
    assert after["b"] > 0.8 * 3000


def test_weights_set_before_a_state_is_taken_hold_after_each_resume_and_nothing_is_lost():
    mix = Pipeline.mix(two_inputs(), [0.9, 0.1], seed=1)
    seen: list[tuple[str, int]] = []
    with Loader(mix, num_workers=2, timeout=30) as loader:
        elements = iter(loader)
        seen += as_tuples(itertools.islice(elements, 2000))
        loader.set_weights([0.2, 0.8])
        state = loader.state_dict()
    assert state["weights"] == [0.2, 0.8]
    with Loader(mix, num_workers=2, timeout=30, state=state) as loader:  # a resume
        elements = iter(loader)
        part = as_tuples(itertools.islice(elements, 2000))
        seen += part
        state = loader.state_dict()
    assert names(part)["b"] > 0.7 * 2000
    assert state["weights"] == [0.2, 0.8]
    with Loader(mix, num_workers=2, timeout=30, state=state) as loader:  # of a resume
        seen += as_tuples(loader)
    assert collections.Counter(seen) == collections.Counter(
        as_tuples(itertools.chain(*(p.iter(0) for p in two_inputs()))))


def test_set_weights_is_refused_where_there_are_no_weights_to_set():
    with Loader(Pipeline.range(10), num_workers=1) as loader:
        with pytest.raises(ValueError, match=r"Pipeline\.mix"):
            loader.set_weights([1])
    with Loader(Pipeline.choose(two_inputs(), [0, 1]), num_workers=1) as loader:
        with pytest.raises(ValueError, match="pattern"):
            loader.set_weights([1, 1])
    with Loader(Pipeline.mix(two_inputs()), num_workers=1) as loader:
        with pytest.raises(ValueError, match="one weight per input"):
            loader.set_weights([1, 1, 1])
        assert sorted(as_tuples(loader)) == sorted(
            as_tuples(itertools.chain(*(p.iter(0) for p in two_inputs()))))
    with pytest.raises(RuntimeError, match="closed"):
        loader.set_weights([1, 1])


def array_tagged(tag: int):
    return lambda x: {"input": np.int64(tag), "x": np.int64(x)}


def array_mix() -> Pipeline:
    return Pipeline.mix([Pipeline.range(300, split_size=50).map(array_tagged(0)),
                         Pipeline.range(100, split_size=25).map(array_tagged(1))],
                        [0.7, 0.3], seed=4)


def pairs(elements) -> collections.Counter:
    return collections.Counter((int(e["input"]), int(e["x"])) for e in elements)


def test_a_mix_through_the_torch_and_tf_adapters_yields_its_elements():
    import torch

    import zloader.torch as zt

    expected = pairs(array_mix().iter(0))
    dataset = zt.IterableDataset(array_mix(), num_workers=2)
    try:
        assert pairs(torch.utils.data.DataLoader(dataset, batch_size=None)) == expected
    finally:
        dataset.close()
    ztf = pytest.importorskip("zloader.tf")
    assert pairs(ztf.to_dataset(array_mix()).as_numpy_iterator()) == expected


def test_two_trainers_sharing_a_mix_each_get_all_of_it():
    expected = pairs(array_mix().iter(0))
    with service(workers=2) as (address, _procs):
        got: list[collections.Counter] = [collections.Counter(), collections.Counter()]

        def trainer(i: int) -> None:
            with Loader(array_mix().map(slow), broker=address, share=True,
                        timeout=30) as loader:
                got[i] = pairs(loader)

        threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert got == [expected, expected]


def fails_at_b_40(pair):
    if pair == ("b", 40):
        raise ValueError("bad record b 40")
    return pair


def test_an_input_s_error_comes_at_its_draw_after_what_was_drawn_before_it():
    """In-process the mix reads each input ahead by a chunk of draws; an error one input
    raises still comes after exactly the elements drawn before its element, as a worker
    (which reads each element as it is drawn) yields them."""
    a, b, c = inputs()
    whole = as_tuples(Pipeline.mix([a, b, c], [0.6, 0.3, 0.1], seed=7).iter(0))
    before = whole[:whole.index(("b", 40))]
    broken = Pipeline.mix([a, b.map(fails_at_b_40), c], [0.6, 0.3, 0.1], seed=7)
    got = []
    with pytest.raises(ValueError, match="bad record b 40"):
        for element in broken.iter(0):
            got.append(element)
    assert as_tuples(got) == before
    with Loader(broken, num_workers=1, timeout=30) as loader:  # the elements of the
        got = []                                                # failed record are lost
        with pytest.raises(ValueError, match="bad record b 40"):
            for element in loader:
                got.append(element)
    assert as_tuples(got) == before[:len(got)]


@pytest.mark.parametrize("weights", [[1e308, 1e308], [1e-13, 1], [1, 1e-300]])
def test_weights_too_large_to_add_or_too_small_to_round_lose_no_input(weights):
    pair = [Pipeline.range(100).map(tagged("a")), Pipeline.range(100).map(tagged("b"))]
    out = as_tuples(Pipeline.mix(pair, weights, seed=1).iter(0))
    assert sorted(out) == sorted(as_tuples(itertools.chain(*(p.iter(0) for p in pair))))


@pytest.mark.parametrize("weights, seed, error, match", [
    ("12", 1, TypeError, "weights must be a sequence"),
    (b"12", 1, TypeError, "weights must be a sequence"),
    ([1, "2"], 1, TypeError, r"weights\[1\] must be a real number"),
    ([True, 1], 1, TypeError, r"weights\[0\] must be a real number"),
    ([1, 1], "7", TypeError, "seed must be an int"),
    ([1, 1], -1, ValueError, "seed must be >= 0"),
    ([1, 1], 2**64, ValueError, "seed must be < 2"),
])
def test_weights_and_seeds_of_the_wrong_kind_are_refused_naming_them(weights, seed, error,
                                                                     match):
    with pytest.raises(error, match=match):
        Pipeline.mix([Pipeline.range(3)] * 2, weights, seed=seed)


def test_a_weight_set_to_zero_mid_epoch_ends_the_epoch_reading_nothing_twice():
    mix = Pipeline.mix(two_inputs(), [0.5, 0.5], seed=1)
    with Loader(mix, num_workers=2, timeout=30) as loader:
        elements = iter(loader)
        seen = as_tuples(itertools.islice(elements, 1000))
        loader.set_weights([0, 1])
        seen += as_tuples(elements)  # (before: never ended, and the timeout never fired)
    assert len(set(seen)) == len(seen), "an element came twice"
    assert {x for name, x in seen if name == "b"} == set(range(5000))
    assert names(seen)["a"] < 5000


def test_first_exhausted_over_an_endless_input_ends_on_every_worker():
    endless = Pipeline.range(1000, split_size=50).map(tagged("a")).repeat()
    finite = Pipeline.range(300, split_size=50).map(tagged("b"))
    mix = Pipeline.mix([endless, finite], [0.5, 0.5], seed=3, stop="first_exhausted")
    with Loader(mix, num_workers=2, timeout=30) as loader:
        # (before: each worker sent the broker a PASS_DONE per empty repetition until its
        # queue filled, and died of "BrokerRefused: ... the broker wants CURVE keys")
        seen = as_tuples(loader)
        again = as_tuples(loader)  # the workers are alive: a second epoch runs
    for epoch in (seen, again):
        assert names(epoch)["b"] >= 1
        b = [x for name, x in epoch if name == "b"]
        assert len(set(b)) == len(b)


def test_each_consumer_of_a_job_draws_with_its_own_weights_and_a_resume_takes_the_last_set():
    from zloader.client.exactly_once import resume_from

    mix = Pipeline.mix(two_inputs(), [0.5, 0.5], seed=1)
    opened = threading.Event()  # the second consumer has begun epoch 1
    epochs: list[list[list]] = [[], []]
    errors: list[BaseException] = []

    def read(which: int, loader: Loader) -> None:
        try:
            for epoch in (0, 1):
                if (which, epoch) == (0, 1):  # the first opens epoch 1 after the second
                    assert opened.wait(30)
                got = []
                for pair in loader:
                    got.append(tuple(pair))
                    if (which, epoch) == (1, 1):
                        opened.set()
                epochs[which].append(got)
        except BaseException as exc:
            errors.append(exc)
            opened.set()

    with service(workers=2) as (address, _procs):
        first = Loader(mix, broker=address, timeout=30, job_name="rule")
        second = Loader(mix, broker=address, timeout=30, job_name="rule")
        try:
            first.set_weights([0.9, 0.1])
            second.set_weights([0.1, 0.9])  # (set last: it wins, whoever opens later)
            threads = [threading.Thread(target=read, args=(i, loader), daemon=True)
                       for i, loader in enumerate((first, second))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not errors and not any(t.is_alive() for t in threads), errors
            states = [second.state_dict(), first.state_dict()]
        finally:
            first.close()
            second.close()
    # The mix is drawn where the streams meet: each Loader's own draws, with its own
    # weights, in every epoch (before: the workers drew, and epoch 1 followed the weights
    # of the consumer that opened it last; a resume, those of the last state in the list).
    for which, favoured in ((0, "a"), (1, "b")):
        for epoch in epochs[which]:
            head = epoch[:300]
            assert names(head)[favoured] > 0.75 * len(head), (which, names(head))
    assert resume_from(states, mix.fingerprint, True)["weights"] == [0.1, 0.9]


def _draws(live, switches, offers: dict[int, tuple[float, ...]]) -> list[int]:
    """A worker's draws of a two-input mix, pass (0,), over inputs 0..2999 and 3000..5999,
    with ``offers[n]`` set on ``live`` after the n-th element (as Loader.set_weights
    reaches a worker while its producer draws)."""
    from zloader.mixing import drawn
    from zloader.runs import Context, RunSettings

    mix = Pipeline.mix([Pipeline.range(3000), Pipeline.range(3000, 6000)], [1, 1], seed=5)
    ctx = Context(RunSettings(entropy=0, mix_weights=live, mix_switches=switches))
    out = []
    for n, element in enumerate(drawn(mix.source, lambda: [iter(range(3000)),
                                                          iter(range(3000, 6000))], (0,), ctx)):
        out.append(element)
        if n + 1 in offers:
            live.offer(offers[n + 1], float(n + 1))
    return out


def test_a_replay_draws_with_the_weights_the_first_draws_switched_to_where_they_did():
    """A shared job's worker notes when its mix takes new weights (the broker is told
    before any element drawn with them leaves it); the replay of its splits (a late
    trainer's, a dead worker's: zloader/sharing/handover.py) switches at the same draws,
    whatever the weights are when it runs, and so names each element by the same place."""
    from zloader.mixing import LiveWeights, Switches

    live, log, told = LiveWeights(), {}, []
    live.offer((0.25, 0.75), 0.5)  # (set before the epoch: the first switch is at draw 0)
    first = _draws(live, Switches(log, confirm=lambda *switch: told.append(switch)),
                   {700: (0.9, 0.1), 1900: (0.5, 0.5), 1901: (0.1, 0.9)})
    assert sorted(first) == list(range(6000))
    assert [at for at, _ in log[(0,)]] == [0, 700, 1900, 1901]
    assert told == [((0,), at, weights) for at, weights in log[(0,)]]

    now = LiveWeights()
    now.offer((0.6, 0.4), 9.0)  # (the weights when the replay runs: not those of the first)
    assert _draws(now, Switches(log, replay=True), {}) == first
    # Without the switches the replay differs (what a dead worker's replay did before).
    assert _draws(now, None, {}) != first
    # No switch noted: the mix's own weights, not the live ones.
    plain = _draws(LiveWeights(), Switches({}), {})
    assert _draws(now, Switches({}, replay=True), {}) == plain


def test_a_replay_switches_where_the_first_draws_did_when_weights_come_as_an_input_ends():
    """Weights that arrive while an input's end is being found (a worker waits for the
    broker's answer about its next split), and weights that arrive while the broker is
    being told of others: the first run takes them only after its next yield, as a
    replay sees them, so the replay still draws the same sequence (before: it parted at
    the next element, and two switches at one draw were noted as one)."""
    from zloader.mixing import LiveWeights, Switches, drawn
    from zloader.runs import Context, RunSettings

    mix = Pipeline.mix([Pipeline.range(10)] * 3, [1, 1, 1], seed=3)

    def streams(live, arrive):
        def short():  # input 2: 5 elements, then new weights arrive as its end is found
            yield from range(200, 205)
            if arrive:
                live.offer((0.2, 0.5, 0.3), 2.0)
        return lambda: [iter(range(300)), iter(range(1000, 1300)), short()]

    def run(live, switches, arrive):
        ctx = Context(RunSettings(entropy=0, mix_weights=live, mix_switches=switches))
        return list(drawn(mix.source, streams(live, arrive), (0,), ctx))

    live, log = LiveWeights(), {}

    def told(key, at, weights):  # more weights while the broker is told of the first
        if weights == (0.2, 0.5, 0.3):
            live.offer((0.6, 0.3, 0.1), 3.0)

    first = run(live, Switches(log, confirm=told), True)
    ats = [at for at, _ in log[(0,)]]
    assert len(ats) == 2 and ats[0] < ats[1]  # (each at a draw of its own)
    again = LiveWeights()
    again.offer((0.5, 0.4, 0.1), 9.0)
    assert run(again, Switches(log, replay=True), False) == first


def test_the_rest_of_a_mix_drawn_here_keeps_what_came_for_one_input_before_the_epoch_s_end():
    """After the draws ended (every input ended on the workers then serving), a worker
    that joined has not ended input 1: its stream waits there and pulls what comes for
    input 0 too (a dead worker's splits read again), then the epoch's Done. Those
    elements are the epoch's too (before, the rest ended at the Done with them still
    queued: 3 to 471 rows lost in the generated pause mode, about 1 run in 30 under
    load)."""
    from zloader.client.draw import Inputs
    from zloader.client.items import Data, Done, End, InputEnd

    items = FakeMerger([End(0, "w0", 0), InputEnd(0, "w1", 1, 0),
                    Data(0, "w0", 0, [1, 2], part=0), Data(0, "w0", 0, [3], part=1),
                    Data(0, "w0", 0, [4, 5], part=0), Done(0)], serving=(0, 1))
    drawn = Inputs(items, 0, 2, track=False)  # type: ignore[arg-type]
    drawn.pull()  # (the draws' last pull: worker 0 ended both inputs)
    assert sorted(drawn.rest()) == [1, 2, 3, 4, 5]
    assert not items.items
