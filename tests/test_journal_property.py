"""A broker state rebuilt from its journal equals the live state, after any sequence of
events: workers coming and dying, consumers registering and leaving, splits asked for and
passes done (the double re-queue fixed in 4f102c2 is the kind of bug this finds). The
broker is driven as plain calls (tests/test_state.py); hypothesis draws the sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_state import ready, record, register
from zloader.broker.journal import Journal
from zloader.broker.state import State
from zloader.transport.protocol import Command

WORKERS = ("w1", "w2", "w3")
CONSUMERS = ("c1", "c2", "c3")

split = st.tuples(st.just("split"), st.sampled_from(WORKERS), st.integers(0, 3))
step = st.one_of(  # (splits asked for most: what a worker's death re-queues)
    st.tuples(st.just("ready"), st.sampled_from(WORKERS)),
    st.tuples(st.just("register"), st.sampled_from(CONSUMERS), st.sampled_from((None, "j")),
              st.integers(1, 8)),
    split, split, split,
    st.tuples(st.just("pass_done"), st.sampled_from(WORKERS)),
    st.tuples(st.just("bye"), st.sampled_from(CONSUMERS)),
    st.tuples(st.just("silent"), st.sampled_from(WORKERS)),  # it dies: the others beat on
    st.tuples(st.just("tick"), st.floats(0.1, 5.0)),
)
START = [("ready", "w1"), ("ready", "w2"), ("register", "c1", None, 6)]
"""Every sequence starts with two workers and a job (what the steps then act on)."""


def run(state: State, steps: list[tuple], now: float = 0.0) -> float:
    """Apply ``steps`` to ``state``; returns the time reached."""
    silent: set[str] = set()
    for op, *args in steps:
        if op == "ready":
            silent.discard(args[0])
            ready(state, args[0], now=now)
        elif op == "register":
            consumer, name, splits = args
            register(state, consumer, now=now, job_name=name, splits=splits)
        elif op in ("split", "pass_done"):
            worker = state.workers.get(args[0])
            if worker is None or worker.task is None:
                continue
            if op == "split":
                state.split_request(args[0].encode(), record(Command.SPLIT_REQ, {
                    "task": worker.task, "pass": [0], "have": args[1]}), now)
            else:
                state.pass_done(args[0].encode(), record(Command.PASS_DONE, {
                    "task": worker.task, "pass": [0]}), now)
        elif op == "bye":
            state.bye(args[0].encode(), now)
        elif op == "silent":
            silent.add(args[0])
        else:
            now += args[0]
            for peer in [*state.workers, *state.consumers]:
                if peer not in silent:
                    state.seen(peer.encode(), now)
            state.tick(now)
    return now


@given(st.lists(step, min_size=1, max_size=40))
@settings(max_examples=80, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_a_state_rebuilt_from_its_journal_equals_the_live_one(tmp_path_factory, steps):
    folder = tmp_path_factory.mktemp("journal")
    live = State(heartbeat=1.0, journal=Journal(folder))
    now = run(live, START + steps)
    expected = live.snapshot()
    live.journal.close()
    again = State(heartbeat=1.0, journal=Journal(folder))
    again.restore(now=now)
    assert again.snapshot() == expected
    again.journal.close()
