"""A deterministic Loader is reproducible and resumable together: the same stream on every
run, and a state that resumes exactly the rest of it, batch by batch, with the same or
another number of workers (docs/semantics.md, "Resuming")."""

from __future__ import annotations

import random
import signal
import time
from typing import Any

import numpy as np
import pytest

from tests.service import service, start_worker
from zloader import Loader, Pipeline


def pipeline(mixed: bool = True) -> Pipeline:
    """A mix (drawn by the consumer over each input's shards), or its first input alone
    (each shard's stream made whole on a worker)."""
    words = Pipeline.range(2000, split_size=40, shuffle_splits=True, seed=3) \
        .map(lambda x: x * 3).filter(lambda x: x % 7 != 1).shuffle(50, seed=2)
    if not mixed:
        return words.batch(6)
    other = Pipeline.range(100_000, 100_600, split_size=100).shuffle(20, seed=4)
    return Pipeline.mix([words, other], [0.7, 0.3], seed=5).batch(6)


def outputs(order: dict[str, Any]) -> int:
    """The outputs a state's order says were yielded."""
    return order["outputs"] if "outputs" in order else sum(order["yielded"])


def batches(loader: Any, stop: int | None = None) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(np.asarray(batch).tolist())
        if stop is not None and len(out) == stop:
            break
    return out


def run(workers: int, state: Any = None, stop: int | None = None, epochs: int = 1,
        mixed: bool = True) -> tuple[list[list[list[int]]], dict[str, Any]]:
    with Loader(pipeline(mixed), num_workers=workers, deterministic=True, state=state,
                timeout=60) as loader:
        got = [batches(loader, stop) for _ in range(epochs)]
        return got, loader.state_dict()


@pytest.mark.parametrize("mixed", [True, False], ids=["mix", "plain"])
def test_two_runs_give_the_same_batches_and_a_whole_epoch_resumes_at_the_next(
        mixed: bool) -> None:
    (first, second), state = run(3, epochs=2, mixed=mixed)
    (again, again_second), _ = run(3, epochs=2, mixed=mixed)
    assert first == again and second == again_second and len(first) > 100
    assert first != second  # (the next epoch draws anew)
    assert state["epoch"] == 2 and outputs(state["order"]) == 0
    assert ("outputs" in state["order"]) == mixed  # (a mix: drawn by the consumer)
    (third,), _ = run(3, state=state, mixed=mixed)
    assert third == run(3, epochs=3, mixed=mixed)[0][2]


@pytest.mark.parametrize("mixed", [True, False], ids=["mix", "plain"])
@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_a_state_resumes_the_exact_stream_with_another_number_of_workers(
        workers: int, mixed: bool) -> None:
    (whole,), _ = run(3, mixed=mixed)
    cut = random.Random(workers).randrange(1, len(whole) - 1)
    (head,), state = run(3, stop=cut, mixed=mixed)
    assert state["order"]["shards"] == 3 and outputs(state["order"]) == len(head)
    (rest,), _ = run(workers, state=state, mixed=mixed)
    assert head + rest == whole


def test_a_resume_of_a_resume_and_a_state_taken_at_once() -> None:
    (whole,), _ = run(2)
    out: list[list[int]] = []
    state = None
    for stop, workers in ((40, 2), (0, 4), (75, 1)):
        if stop == 0:  # (a state before any batch of the resumed run)
            with Loader(pipeline(), num_workers=workers, deterministic=True,
                        state=state) as loader:
                state = loader.state_dict()
            continue
        (part,), state = run(workers, state=state, stop=stop)
        out += part
    (rest,), _ = run(3, state=state)
    assert out + rest == whole


def test_states_of_the_other_kind_are_refused_by_name() -> None:
    (_,), ordered = run(2, stop=5)
    with pytest.raises(ValueError, match="deterministic=True"):
        Loader(pipeline(), num_workers=2, state=ordered)
    with Loader(pipeline(), num_workers=2) as loader:
        next(iter(loader))
        plain = loader.state_dict()
    with pytest.raises(ValueError, match="deterministic Loader"):
        Loader(pipeline(), num_workers=2, deterministic=True, state=plain)
    bad = {**ordered, "order": {**ordered["order"], "turn": 9}}
    with pytest.raises(ValueError, match="turn"):
        Loader(pipeline(), num_workers=2, deterministic=True, state=bad)


def test_a_mix_s_state_and_a_shard_order_s_are_not_taken_for_each_other() -> None:
    (_,), drawn = run(2, stop=5)  # (a mix drawn by the consumer: outputs)
    (_,), plain = run(2, stop=5, mixed=False)  # (one input: turn and yielded)
    assert set(drawn["order"]) == {"shards", "outputs"}
    assert set(plain["order"]) == {"shards", "turn", "yielded"}
    crossed = {**drawn, "fingerprint": plain["fingerprint"]}
    with pytest.raises(ValueError, match="drawn by the consumer, and this Loader's is drawn "
                                         "on the workers"):
        Loader(pipeline(False), num_workers=2, deterministic=True, state=crossed)
    crossed = {**plain, "fingerprint": drawn["fingerprint"]}
    with pytest.raises(ValueError, match="drawn on the workers, and this Loader's is drawn "
                                         "by the consumer"):
        Loader(pipeline(), num_workers=2, deterministic=True, state=crossed)
    for bad in (-1, True, "3", None):
        with pytest.raises(ValueError, match="'outputs' >= 0"):
            Loader(pipeline(), num_workers=2, deterministic=True,
                   state={**drawn, "order": {"shards": 2, "outputs": bad}})
    with pytest.raises(ValueError, match="'outputs' >= 0"):
        Loader(pipeline(), num_workers=2, deterministic=True,
               state={**drawn, "order": {"shards": 2, "outputs": 3, "turn": 0}})


def slowly(value: int) -> int:
    time.sleep(0.0005)
    return value


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [True, False], ids=["mix", "plain"])
def test_a_worker_killed_and_replaced_in_a_pool_leaves_the_stream_exactly_as_it_was(
        mixed: bool) -> None:
    # The dead worker's index goes to a new worker, which makes its shards again from the
    # epoch's start; the consumer drops what it had of them (by their place in each
    # shard's stream), so the stream is the uninterrupted run's, batch by batch.
    with service(workers=2) as (address, procs):
        def loader() -> Loader:
            return Loader(pipeline(mixed).map(slowly), broker=address, num_workers=2,
                          deterministic=True, timeout=60)

        with loader() as one:
            whole = batches(one)
        with loader() as one:
            got = []
            for batch in one:
                got.append(np.asarray(batch).tolist())
                if len(got) == 60:
                    procs[0].send_signal(signal.SIGKILL)
                    procs.append(start_worker(address))  # (takes the dead one's index)
    assert got == whole


@pytest.mark.parametrize("mixed", [True, False], ids=["mix", "plain"])
def test_a_state_that_counts_more_than_its_epoch_has_is_refused_by_its_field(
        mixed: bool) -> None:
    # A made-up count cannot be checked before the epoch is made again; once it is, the
    # Loader says which field was wrong instead of ending an empty epoch in silence.
    (_,), state = run(2, stop=5, mixed=mixed)
    order = dict(state["order"])
    if mixed:
        order["outputs"], field = 10**9, r"\['outputs'\]"
    else:
        order["yielded"], field = [order["yielded"][0], 10**9], r"\['yielded'\]\[1\]"
    with Loader(pipeline(mixed), num_workers=2, deterministic=True, timeout=60,
                state={**state, "order": order}) as loader:
        with pytest.raises(ValueError, match=field):
            list(loader)


TRAINER = """
import json, os, sys, time
import numpy as np
from tests.test_deterministic_state import pipeline, slowly
from zloader import Loader

checkpoint, log_path, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = json.load(open(checkpoint)) if os.path.exists(checkpoint) else None
with Loader(pipeline().map(slowly), num_workers=workers, deterministic=True, state=state,
            timeout=60) as loader, open(log_path, "a") as log:
    for i, batch in enumerate(loader):
        log.write(json.dumps(np.asarray(batch).tolist()) + "\\n")
        time.sleep(0.005)  # (a training step)
        if (i + 1) % 20 == 0:  # a checkpoint: the state and how much of the log it covers
            log.flush()
            json.dump({**loader.state_dict(), "logged": log.tell()}, open(checkpoint + ".new", "w"))
            os.replace(checkpoint + ".new", checkpoint)
"""


@pytest.mark.slow
def test_a_trainer_killed_twice_and_restarted_from_its_checkpoints_sees_one_stream(
        tmp_path) -> None:
    # A training script that checkpoints the Loader's state with its own progress, is
    # SIGKILLed twice and restarted from its last checkpoint with another number of
    # workers: what it consumed, checkpoint to checkpoint, is the uninterrupted stream.
    import json
    import os
    import subprocess
    import sys

    def trainer(name: str, workers: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path / f"{name}.json"),
                                 str(tmp_path / f"{name}.log"), str(workers)],
                                cwd=os.getcwd(), stderr=subprocess.PIPE)

    reference = trainer("whole", 2)
    assert reference.wait(120) == 0, reference.stderr.read()[-2000:] if reference.stderr else ""
    log = tmp_path / "run.log"
    for workers in (2, 3):  # (the first run's 2 workers fix the shards)
        run = trainer("run", workers)
        time.sleep(1.5)
        run.kill()
        run.wait(30)
        checkpoint = tmp_path / "run.json"
        kept = json.loads(checkpoint.read_text())["logged"]
        # (killed mid-epoch, past a checkpoint)
        assert 0 < kept < len((tmp_path / "whole.log").read_text())
        with open(log, "r+") as out:  # (past the checkpoint: undone by the restart)
            out.truncate(kept)
    last = trainer("run", 1)
    assert last.wait(120) == 0, last.stderr.read()[-2000:] if last.stderr else ""
    assert log.read_text().splitlines() == (tmp_path / "whole.log").read_text().splitlines()
