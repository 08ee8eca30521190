"""The worker's delivery modes through their seam (tests/fakes.py): who gets a record, when
an epoch's END goes, what a finished epoch's leftovers become. Milliseconds each: the
modes are driven as plain calls, as tests/test_state.py drives the broker."""

from __future__ import annotations

import pytest

from tests.fakes import FakePort, FakeProducer, record
from zloader.sharing.window import WindowSettings
from zloader.transport.protocol import ProtocolError
from zloader.worker.credit import CreditDelivery
from zloader.worker.outgoing import EndOut
from zloader.worker.permits import Pool
from zloader.worker.rounds import RoundsDelivery
from zloader.worker.shared import SharedDelivery


def credit_mode(balanced: int = 0) -> tuple[FakePort, CreditDelivery]:
    port = FakePort()
    delivery = CreditDelivery(port, balanced=balanced)
    port.attach(delivery)
    return port, delivery


PRODUCER = FakeProducer(0, None, {})
"""The task's producer (a shared job's replays come from producers the mode started)."""


def produce(delivery, epoch: int = 0, count: int = 1, size: int = 8) -> None:
    """The producer hands the mode one record of ``epoch``."""
    delivery.on_record(PRODUCER, record(count, size, epoch))


def end(delivery, epoch: int = 0, skipped: int = 0) -> None:
    """The producer ends ``epoch`` here."""
    delivery.on_end(PRODUCER, EndOut(epoch, skipped))


def grant(delivery, stream, credits: int) -> None:
    """CREDIT, as the task handles it: the credits, then a delivery."""
    delivery.credit(stream, credits)
    delivery.deliver()


def kinds(port: FakePort, consumer: str) -> list[str]:
    return [sent.kind for sent in port.outlet.to(consumer)]


def test_a_record_goes_to_the_consumer_with_the_most_credit():
    port, delivery = credit_mode()
    port.join("a", credits=1)
    port.join("b", credits=3)
    for _ in range(3):
        produce(delivery)
    # b (3 credits) first, then whoever has more left: b again (2 > 1), then a or b (1, 1)
    assert [s.consumer for s in port.outlet.log[:2]] == ["b", "b"]
    assert len(port.outlet.to("a", "DATA")) + len(port.outlet.to("b", "DATA")) == 3


def test_a_record_without_credit_waits_for_it_and_keeps_its_order():
    port, delivery = credit_mode()
    stream = port.join("a", credits=0)
    produce(delivery, count=1)
    produce(delivery, count=2)
    assert port.outlet.log == [] and len(delivery.pending) == 2
    grant(delivery, stream, 1)
    assert [s.count for s in port.outlet.to("a")] == [1]
    grant(delivery, stream, 5)
    assert [s.count for s in port.outlet.to("a")] == [1, 2]


def test_an_epoch_s_end_goes_only_after_its_records():
    port, delivery = credit_mode()
    stream = port.join("a", credits=0)
    produce(delivery)
    end(delivery, skipped=2)
    assert port.outlet.log == [] and 0 not in port.finished  # the END waits behind it
    grant(delivery, stream, 1)
    assert kinds(port, "a") == ["DATA", "END"]
    assert port.outlet.to("a", "END")[0].record.skipped == 2 and 0 in port.finished


def test_balanced_deals_round_robin_once_every_consumer_opened():
    port, delivery = credit_mode(balanced=2)
    port.join("a", credits=10)
    for _ in range(2):
        produce(delivery)
    assert port.outlet.log == []  # one of two consumers: nothing dealt yet
    port.join("b", credits=10)
    for _ in range(2):
        produce(delivery)
    assert [s.consumer for s in port.outlet.log] == ["a", "b", "a", "b"]


def test_balanced_holds_the_deal_for_a_consumer_without_credit():
    port, delivery = credit_mode(balanced=2)
    port.join("a", credits=10)
    b = port.join("b", credits=0)
    for _ in range(3):
        produce(delivery)
    assert [s.consumer for s in port.outlet.log] == ["a"]  # b's turn: it has no credit
    grant(delivery, b, 1)
    assert [s.consumer for s in port.outlet.log] == ["a", "b", "a"]


def test_a_finished_epoch_s_leftovers_are_let_go_of():
    port, delivery = credit_mode()
    port.join("a", credits=0)
    outgoing = record()
    outgoing.gathered = True  # (the producer waits for its taken event)
    outgoing.__post_init__()
    delivery.on_record(PRODUCER, outgoing)
    port.finished.add(0)  # the epoch was abandoned meanwhile
    delivery.deliver()
    assert not delivery.pending and outgoing.taken is not None and outgoing.taken.is_set()
    assert port.outlet.log == []


def test_overdraw_sends_without_credit_when_the_worker_drains():
    port, delivery = credit_mode()
    port.join("a", credits=0)
    produce(delivery)
    assert port.outlet.log == []
    delivery.overdraw()
    assert kinds(port, "a") == ["DATA"]


def test_an_epoch_finished_here_ends_at_once_for_a_late_opener():
    port, delivery = credit_mode()
    port.join("a", credits=1)
    end(delivery)
    assert kinds(port, "a") == ["END"] and 0 in port.finished
    port.join("b", epoch=0, credits=1)
    assert kinds(port, "b") == ["END"]


@pytest.fixture
def shared():
    port = FakePort()
    delivery = SharedDelivery(port, WindowSettings(1 << 20, "block", 10.0))
    port.attach(delivery)
    yield port, delivery
    delivery.close()


def test_shared_every_trainer_gets_every_record_then_the_end(shared):
    port, delivery = shared
    port.join("a", credits=10)
    port.join("b", credits=10)
    for count in (2, 3):
        produce(delivery, count=count)
    end(delivery)
    for trainer in "ab":
        assert kinds(port, trainer) == ["DATA", "DATA", "END"]
        assert [s.count for s in port.outlet.to(trainer, "DATA")] == [2, 3]


def test_shared_a_trainer_without_credit_holds_nobody_else(shared):
    port, delivery = shared
    port.join("a", credits=10)
    slow = port.join("b", credits=0)
    for _ in range(3):
        produce(delivery)
    assert len(port.outlet.to("a", "DATA")) == 3 and port.outlet.to("b") == []
    grant(delivery, slow, 2)
    assert len(port.outlet.to("b", "DATA")) == 2  # from the window, in order


def test_shared_a_late_joiner_gets_the_window_then_a_replay_of_what_left_it():
    port = FakePort()
    # room for two 8-byte records: older ones leave the window
    delivery = SharedDelivery(port, WindowSettings(16, "skip", 0.0))
    port.attach(delivery)
    try:
        port.join("a", credits=100)
        for _ in range(5):
            produce(delivery, count=1)
        late = port.join("b", credits=100)
        got = port.outlet.to("b", "DATA")
        assert 0 < len(got) < 5  # what is still in the window
        missed = 5 - len(got)
        (replayer,) = port.started  # what it missed, made again by a replay producer
        assert (replayer.options["replay"], replayer.options["skip"]) == (missed, 0)
        assert delivery.replaying == (late.identity, 0)
        end(delivery)  # the epoch ends in the window: a gets its END, b its replay next
        assert kinds(port, "a")[-1] == "END" and kinds(port, "b")[-1] == "DATA"
        for _ in range(missed):
            delivery.on_record(replayer, record(1))
        delivery.on_end(replayer, EndOut(0))
        assert kinds(port, "b") == ["DATA"] * 5 + ["END"]
        assert port.outlet.to("b", "END")[0].record.replayed == missed
        assert port.dropped == [replayer]
    finally:
        delivery.close()


def test_shared_a_trainer_forgotten_past_its_grace_gets_only_what_it_had_not():
    """A trainer the worker forgot (silent past its grace) opens its epoch again saying
    how many elements it had from here: the window's records it had are skipped, and of
    those that left the window only the ones it had not are made again."""
    port = FakePort()
    delivery = SharedDelivery(port, WindowSettings(24, "skip", 0.0))  # three 8-byte records
    port.attach(delivery)
    try:
        port.join("a", credits=100)
        stream = port.join("b", credits=2)  # it takes two, then stops
        for _ in range(6):
            produce(delivery)
        assert len(port.outlet.to("b", "DATA")) == 2
        port.remove_stream(stream)  # forgotten (CONSUMER_GONE after its grace)
        port.join("b", credits=100, had=2)  # back: records 4-6 in the window, 1-3 left it
        assert len(port.outlet.to("b", "DATA")) == 2 + 3
        (replayer,) = port.started
        assert (replayer.options["skip"], replayer.options["replay"]) == (2, 3)  # the 3rd
        again = port.join("c", credits=100, had=5)  # one that had 5: only the 6th is sent
        assert len(port.outlet.to("c", "DATA")) == 1 and delivery.window.cursors[
            again.identity].missed == 0
    finally:
        delivery.close()


class TreeProducer:
    """A shared job's producer with branches: it adds those asked for while ``room``."""

    def __init__(self, room: bool) -> None:
        self.room = room
        self.pool = Pool()
        self.attached: set[int] = {0}
        self.asked: list[int] = []

    def attach(self, branch) -> None:
        self.asked.append(branch)
        if self.room:
            self.attached.add(1)


def branched(room: bool) -> tuple[FakePort, SharedDelivery, TreeProducer]:
    """A shared job with branches 0 and 1; branch 1's trainer comes while epoch 0 runs
    and its producer makes only branch 0 (``room``: it can add branch 1 from the start)."""
    port = FakePort()
    delivery = SharedDelivery(port, WindowSettings(1 << 20, "block", 10.0))
    port.attach(delivery)
    port.join("a", credits=10)
    delivery.new_epoch(0)  # (as the task does: its producer runs branch 0 alone)
    port.producer = TreeProducer(room)
    port.branches[1] = "branch 1"
    produce(delivery, count=2)
    return port, delivery, port.producer


def test_shared_branches_each_trainer_gets_its_branch_s_records_and_every_end(shared):
    port, delivery = shared
    port.branches[1] = "branch 1"
    delivery.made[0] = {0, 1}  # (as new_epoch has it once trainers of both read)
    port.join("a", credits=10)
    port.join("b", credits=10, branch=1)
    port.join("c", credits=10, branch=1)
    for count, branch in ((2, 0), (3, 1), (4, 1), (5, 0)):
        delivery.on_record(PRODUCER, record(count, branch=branch))
    end(delivery)
    assert [s.count for s in port.outlet.to("a", "DATA")] == [2, 5]
    for trainer in "bc":
        assert [s.count for s in port.outlet.to(trainer, "DATA")] == [3, 4]
    assert all(kinds(port, t)[-1] == "END" for t in "abc") and not port.started
    assert delivery.stats()["trainers"]["b"]["branch"] == 1
    assert delivery.new_epoch(1)["splits"] == {} and delivery.branches_for(1) == {0, 1}
    for trainer in (b"b", b"c"):  # branch 1's trainers leave: it is no longer made
        port.remove_stream(port.streams[trainer])
    delivery.new_epoch(2)
    assert delivery.branches_for(2) == {0}


def test_shared_a_branch_added_to_the_epoch_under_way_gets_it_from_the_producer():
    port, delivery, producer = branched(room=True)
    try:
        port.join("b", credits=10, branch=1)
        assert producer.asked == ["branch 1"]
        delivery.on_record(PRODUCER, record(7, branch=1))  # its records, from the start
        end(delivery)
        assert [s.count for s in port.outlet.to("b", "DATA")] == [7]
        assert kinds(port, "b")[-1] == "END" and not port.started  # nothing made again
    finally:
        delivery.close()


def test_shared_a_branch_too_late_for_the_epoch_gets_it_made_once_it_is_read_here():
    port, delivery, _ = branched(room=False)
    try:
        port.join("b", credits=10, branch=1)
        assert not port.started  # the epoch's splits are not all read here yet
        end(delivery)
        port.finish_epoch(0)
        port.maybe_produce()
        (replayer,) = port.started
        assert replayer.options["branch"] == 1 and replayer.options["skip"] == 0
        assert replayer.options["replay"] > 10**9  # all of it
        delivery.on_record(replayer, record(6, branch=1))
        delivery.on_end(replayer, EndOut(0))
        assert [s.count for s in port.outlet.to("b", "DATA")] == [6]
        (done,) = port.outlet.to("b", "END")
        assert done.record.replayed == 6 and done.record.lagged == 0
    finally:
        delivery.close()


def rounds_mode(size: int = 2) -> tuple[FakePort, RoundsDelivery]:
    port = FakePort()
    delivery = RoundsDelivery(port, size)
    port.attach(delivery)
    return port, delivery


def test_rounds_a_group_is_numbered_once_every_consumer_has_credit_then_dealt_by_index():
    port, delivery = rounds_mode()
    port.join("b", credits=1, index=1)
    a = port.join("a", credits=0, index=0)
    for _ in range(2):
        produce(delivery)
    assert port.rounds_asked == []  # consumer 0 has no credit for the round
    grant(delivery, a, 1)
    assert port.rounds_asked == [(0, ("a", "b"))]
    assert port.outlet.log == []  # nothing goes before the broker numbers the round
    delivery.on_round(0, 7)
    assert [(s.consumer, s.record.round) for s in port.outlet.log] == [("a", 7), ("b", 7)]


def test_rounds_the_end_waits_for_the_rounds_and_an_incomplete_group_is_dropped():
    port, delivery = rounds_mode()
    port.join("a", credits=5, index=0)
    port.join("b", credits=5, index=1)
    for _ in range(3):  # one round, and one element of a second
        produce(delivery)
    end(delivery)
    assert kinds(port, "a") == []  # the END waits behind the round asked for
    delivery.on_round(0, 0)
    assert kinds(port, "a") == ["DATA", "END"] and kinds(port, "b") == ["DATA", "END"]
    assert port.outlet.to("a", "END")[0].record.dropped == 1 and 0 in port.finished


def test_rounds_a_refused_number_gives_the_credits_back():
    port, delivery = rounds_mode()
    a = port.join("a", credits=1, index=0)
    port.join("b", credits=1, index=1)
    for _ in range(2):
        produce(delivery)
    assert a.credits == 0  # reserved for the round asked for
    delivery.on_round(0, None)  # the broker refused to number it: the round is lost
    assert a.credits == 1 and port.outlet.log == [] and not delivery.groups


def test_rounds_an_open_without_its_consumer_index_is_refused():
    port, _ = rounds_mode()
    with pytest.raises(ProtocolError, match="consumer_index"):
        port.join("a", credits=1)


def test_a_replay_leaves_out_what_a_trainer_had_by_count_or_by_place():
    from zloader.worker.producer import _kept

    made = list(range(20))
    assert list(_kept(iter(made), 5, 12)) == list(range(5, 12))
    assert list(_kept(iter(made), [[0, 3], [6, 10]], 1 << 62)) == [3, 4, 5, *range(10, 20)]
    assert list(_kept(iter(made), [[2, 4]], 8)) == [0, 1, 4, 5, 6, 7]
    assert list(_kept(iter(made), [], 4)) == [0, 1, 2, 3]


def test_shared_records_say_their_place_and_a_replay_s_follow_what_it_skips():
    port = FakePort()
    delivery = SharedDelivery(port, WindowSettings(16, "skip", 0.0))  # two 8-byte records
    port.attach(delivery)
    try:
        port.join("a", credits=100)
        for count in (3, 2, 4, 1):
            produce(delivery, count=count)
        port.join("b", credits=100)
        assert [s.record.first for s in port.outlet.to("a", "DATA")] == [0, 3, 5, 9]
        assert [s.record.first for s in port.outlet.to("b", "DATA")] == [5, 9]
        (replayer,) = port.started
        end(delivery)
        for count in (2, 3):
            delivery.on_record(replayer, record(count))
        assert [s.record.first for s in port.outlet.to("b", "DATA")] == [5, 9, 0, 2]
    finally:
        delivery.close()


def test_shared_a_branch_that_cannot_be_loaded_fails_its_trainers_not_the_others(shared):
    port, delivery = shared
    port.join("a", credits=10)
    port.join("b", credits=10, branch=1)  # (branch 1's pipeline is on its way)
    error = {"exc_type": "ModuleNotFoundError", "builtin": True, "stage": "worker start-up",
             "message": "No module named 'augment'", "traceback": "", "context": ""}
    delivery.branch_failed(1, error)
    (failed,) = port.outlet.to("b", "FAIL")
    assert failed.record.error["message"] == "No module named 'augment'"
    port.join("c", epoch=0, credits=10, branch=1)  # a trainer of it that comes later
    assert len(port.outlet.to("c", "FAIL")) == 1 and not port.started
    produce(delivery)
    assert len(port.outlet.to("a", "DATA")) == 1 and port.outlet.to("a", "FAIL") == []


def test_shared_a_dead_worker_s_splits_handed_over_before_a_trainer_opens_are_fenced_in_its_end():
    """A HANDOVER of a dead worker's splits (under the broker's fence) that reaches the
    taker before a trainer opens the epoch there: the trainer's END after the segment is
    made again for it names the fence (it waits for that before its epoch ends: tests/
    test_generated.py seed 47 of shared-prefix-late hung on it)."""
    from zloader.sharing.handover import Segment, to_wire

    port = FakePort()
    delivery = SharedDelivery(port, WindowSettings(1 << 20, "block", 0.0))
    port.attach(delivery)
    try:
        entries = to_wire([Segment(0, 1, {(0,): [4, 7]}, set(), {"a": 3})])
        entries[-1]["last"] = True
        delivery.adopt(tuple(entries), held=(0,), fence="f00d")
        assert not port.started  # (no trainer reads the epoch here yet)
        port.join("a", credits=100)
        (remake,) = port.started  # the dead worker's splits, made again for a
        delivery.on_record(remake, record(2))
        delivery.on_end(remake, EndOut(0))
        produce(delivery)
        delivery.adopt((), held=())  # (the broker lets the epoch's end go)
        end(delivery)
        (ended,) = port.outlet.to("a", "END")
        assert ended.record.fences == ("f00d",)
    finally:
        delivery.close()


def test_shared_a_trainer_without_credits_left_gets_its_end(shared):
    """The END takes no credit: a trainer that spent its last credit on the epoch's last
    record gets it (before, it waited for a credit it had no reason to send, and a worker
    draining to move handed its splits on without counting it as served)."""
    port, delivery = shared
    port.join("a", credits=1)
    produce(delivery)
    end(delivery)
    assert kinds(port, "a") == ["DATA", "END"]


def test_shared_a_drained_worker_names_its_task_to_trainers_it_did_not_serve(shared):
    """A worker hands its splits of epoch 0 on (it drained to move): a trainer that had
    opened epoch 1 here, which it never made, gets its END now (no name: nothing of epoch
    1 was handed on); a trainer whose OPEN of epoch 0 comes after the handover gets an END
    naming this task (the taker makes epoch 0's part for it and names the task in its
    END, which the trainer waits for), and the one it served is not asked to wait. (Before,
    the first waited for an END that never came.)"""
    from types import SimpleNamespace

    from zloader.sharing.handover import from_wire

    port, delivery = shared
    port.spec = SimpleNamespace(index=3)
    port.join("a", credits=10)
    delivery.new_epoch(0)["splits"][(0,)] = [5, 2]  # (as its producer notes them)
    produce(delivery)
    end(delivery)
    port.join("b", epoch=1, credits=10)
    (segment,) = from_wire(delivery.handover())
    assert segment.epoch == 0 and segment.index == 3
    assert segment.served == {"a", "b"}  # (b reads a later epoch: it started after)
    (ended,) = port.outlet.to("b", "END")
    assert ended.record.epoch == 1 and ended.record.handed is None
    port.join("c", epoch=0, credits=10)
    (crossed,) = port.outlet.to("c", "END")
    assert crossed.record.handed == "task-0" and port.outlet.to("c", "DATA") == []
    assert [e.record.handed for e in port.outlet.to("a", "END")] == [None]
    assert delivery.handed() == {0}


def test_shared_a_trainer_ended_before_a_drained_worker_s_splits_came_gets_them_then_an_end(
        shared):
    """The taker had ended trainer ``c``'s epoch 0 (its OPEN came before the broker's
    hold) when the drained worker's splits come, under its task's id: ``c`` gets them
    made again, then an END naming that task (before, nothing: it missed them). A
    trainer that opens epoch 1 here meanwhile drops what was still to be made for it of
    epoch 0 (its replay would wait for credits that never come, and hold every other
    trainer's replay back)."""
    from zloader.sharing.handover import Segment, to_wire

    port, delivery = shared
    port.join("c", credits=100)
    produce(delivery)
    end(delivery)
    assert kinds(port, "c") == ["DATA", "END"]
    entries = to_wire([Segment(0, 1, {(0,): [4, 7]}, {"a"})])
    entries[-1]["last"] = True
    delivery.adopt(tuple(entries), fence="moved-task")
    (remake,) = port.started
    delivery.on_record(remake, record(2))
    delivery.on_end(remake, EndOut(0))
    assert kinds(port, "c") == ["DATA", "END", "DATA", "END"]
    assert port.outlet.to("c", "END")[-1].record.fences == ("moved-task",)
    port.join("d", credits=100)  # (a trainer it owes the segment to, paused)
    port.streams[b"d"].credits = 0
    (_, again) = port.started
    port.join("d", epoch=1, credits=100)  # (it moved on to epoch 1)
    assert again in port.dropped and not delivery.replays and delivery.replay is None
