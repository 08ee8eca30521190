"""Message records (zloader/transport/messages.py): every body round-trips through its
record and the wire, and each kind of bad body is refused with a ProtocolError that names
the command and the field; a live worker refuses one the same way."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.service import service, status, wait_for
from zloader._byfields import ByFields, FrozenByFields
from zloader.lineage import pack
from zloader.options import JobOptions
from zloader.transport import messages
from zloader.transport.messages import RECORDS
from zloader.transport.protocol import (
    MAX_BODY_DEPTH,
    PACKED,
    Command,
    Message,
    ProtocolError,
    decode,
    encode,
)

ERROR = {"stage": "map", "exc_type": "ValueError", "builtin": "ValueError",
         "message": "bad", "traceback": "Traceback ...", "context": "split 3"}
WORKER = {"worker": "w1", "task": "t1", "endpoint": "tcp://127.0.0.1:5600",
          "host_id": "h", "index": 0, "pid": 42, "host": "node1", "plain_data": False,
          "doing": {"epoch": 0, "split": 2, "stage": "pipeline"}}
OPTIONS = {"sharding": "dynamic", "deterministic": False, "on_error": "skip", "num_workers": 2,
           "balanced": 0, "num_consumers": 0, "share": None, "exactly_once": True,
           "weight": 1.0, "objects": False, "shards": 0}
FENCE = {"id": "f1", "worker": "w2", "task": "t2", "splits": [[[0], 3], [[0, 1], 4]],
         "waiting": ["c1"]}

# One full body per command, as its sender makes it (docs/protocol.md).
SAMPLES: dict[Command, dict] = {
    Command.READY: {"worker": "w1", "host": "node1", "host_id": "h", "pid": 42,
                    "endpoint": "tcp://127.0.0.1:5600", "prefer": None, "plain_data": False,
                    "holds": ["fp"]},
    Command.ACK: {"heartbeat": 1.0, "task": None},
    Command.TASK: {"task": "t1", "job": "j1", "options": OPTIONS, "index": 0, "width": 2,
                   "entropy": 2**63,
                   "source_data": {"endpoint": "ipc:///tmp/x/source", "kind": "arrays"},
                   "fingerprint": "fp",
                   "pipeline": {"endpoint": "tcp://h:1", "sha256": "ab", "bytes": 10}},
    Command.TASK_FAILED: {"task": "t1", "error": ERROR},
    Command.SPLIT_REQ: {"task": "t1", "pass": [0, 1], "have": 3},
    Command.SPLIT: {"task": "t1", "pass": [0], "split": 7, "have": 3, "origin": [0],
                    "skip": pack([1, 5]), "expect": [10, 2**63]},
    Command.PASS_DONE: {"task": "t1", "pass": [2]},
    Command.WEIGHED: {"task": "t1", "pass": [2], "at": 1024, "weights": [0.25, 0.75]},
    Command.RELEASE: {"task": "t1"},
    Command.HANDOVER: {"task": "t1", "segments": [
        {"n": 0, "epoch": 2, "index": 1, "pass": [2, 0], "splits": [5, 3, 9],
         "served": ["c1"], "had": {"c2": 40, "c3": [[0, 4], [9, 12]]},
         "switches": [[[2], 0, [0.5, 0.5]], [[2], 1024, [0.1, 0.9]]], "last": True}],
        "held": [2]},
    Command.BRANCH: {"task": "t1", "branch": 2, "tap": 1, "fingerprint": "fp2"},
    Command.CONSUMER_GONE: {"task": "t1", "consumer": "c1", "replaced": True},
    Command.ROUND_REQ: {"task": "t1", "epoch": 0, "members": ["c1", "c2"]},
    Command.ROUND: {"task": "t1", "epoch": 0, "round": None},
    Command.REGISTER: {"consumer": "c1", "fingerprint": "fp", "job_name": "train",
                       "options": {"sharding": "static", "deterministic": True,
                                   "on_error": "raise", "num_workers": 2, "balanced": 2,
                                   "num_consumers": 2,
                                   "share": {"window_bytes": 1024, "lag": "block",
                                             "block_seconds": 1.0},
                                   "exactly_once": False, "weight": 2.5,
                                   "objects": True, "shards": 3},
                       "source": {"num_splits": 4, "seed": 1}, "host_id": "h", "pid": 42,
                       "consumer_index": 0, "pipeline": {"inherited": True},
                       "source_data": {"endpoint": "tcp://h:2", "kind": "items"},
                       "resume": {"epoch": 1, "delivered": [[[1], "x"]]}, "entropy": 5,
                       "job": "j1"},
    Command.JOB: {"job": "j1", "workers": [WORKER], "failed": [{"split": 3, "message": "x"}],
                  "error": None, "heartbeat": 0.5, "consumers": 1, "busy_elsewhere": 0,
                  "pending": {"0": 2}, "share": None, "epoch": 0, "width": 1,
                  "entropy": 9, "stages": {"map": 0.5}, "state": "running",
                  "rounds": {"size": 2, "issued": {"0": 3}}, "fences": [FENCE],
                  "fencing": {"0": 2}, "joined": {"epoch": 0, "round": 2, "missed": 2},
                  "read": [[[0], "x"]]},
    Command.EPOCH: {"job": "j1", "epoch": 3},
    Command.RECEIVED: {"epoch": 0, "rounds": [0, 1]},
    Command.COMMIT: {"epoch": 0, "rounds": [0], "lost": [1], "total_lost": 1},
    Command.DELIVERED: {"job": "j1", "fence": "f1", "splits": [[[0], 3, {"all": True}]],
                        "shared": {"epoch": 1, "done": False, "count": 5,
                                   "ranges": [[0, 2], [7, 10]]}},
    Command.LOG: {"lines": [[20, "hello"]], "host": "node1", "pid": 42},
    Command.BYE: {},
    Command.HEARTBEAT: {"stats": {"elements": 10}, "doing": {"epoch": 0, "split": None,
                                                             "stage": "splits"},
                        "stuck": [{"worker": "w1", "task": "t1", "seconds": 5}],
                        "reread": [[[0], 3, {"have": ""}]]},
    Command.STATUS: {"workers": [], "jobs": [], "rejected": 0},
    Command.UNKNOWN: {"reason": "not registered"},
    Command.ERROR: {"message": "job_name 'x' runs another pipeline"},
    Command.OPEN: {"job": "j1", "task": "t1", "consumer": "c1", "epoch": 0, "credits": 8,
                   "rerun": 1, "ring": "zloader-ring", "consumer_index": 1,
                   "weights": [0.25, 0.75]},
    Command.CREDIT: {"epoch": 0, "credits": 4, "mapped": ["zloader-seg"], "part": 2},
    Command.WEIGHTS: {"weights": [0.5, 0.5]},
    Command.DISPATCH: {"epoch": 1, "items": [4, 7]},
    Command.DATA: messages.Data(epoch=0, count=3, skipped=1, ring=(64, 128, "zloader-ring"),
                                segment=("zloader-seg", 99), full=True, shared=True,
                                lagged=2, round=4, origins=True, after=5,
                                part=3, first=40).to_body(),
    Command.END: {"epoch": 0, "skipped": 0, "dropped": 1, "rerun": 2, "lagged": 0,
                  "replayed": 3, "origins": True, "part": 1},
    Command.FAIL: {"epoch": 0, "error": ERROR},
    Command.RING: {"ring": "zloader-ring"},
    Command.CLOSE: {},
    Command.FETCH: {"what": "pipeline"},
    Command.SOURCE: {"kind": "items"},
}


def wire(command: Command, body: dict) -> Message:
    """``body`` sent as ``command`` and parsed again, as a receiver gets it."""
    return decode(encode(command, body))


def test_a_mix_input_number_past_the_inputs_a_mix_may_have_is_refused():
    for command, body in ((Command.CREDIT, {"epoch": 0, "credits": 1, "part": 4096}),
                          (Command.END, {"epoch": 0, "part": -1})):
        with pytest.raises(ProtocolError, match="part"):
            messages.decode(wire(command, body))
    data = messages.Data(epoch=0, count=1, skipped=0, ring=None, part=4096).to_body()
    with pytest.raises(ProtocolError, match="part"):
        messages.decode(wire(Command.DATA, data))


def test_every_command_has_a_record():
    assert set(RECORDS) == set(Command) == set(SAMPLES)
    assert all(cls.COMMAND is command for command, cls in RECORDS.items())


@pytest.mark.parametrize("command", list(Command), ids=lambda c: c.name)
def test_every_record_round_trips_through_the_wire(command):
    record = messages.decode(wire(command, SAMPLES[command]))
    assert isinstance(record, RECORDS[command])
    assert messages.encode(record) == SAMPLES[command]
    again = messages.decode(wire(command, messages.encode(record)))
    assert again == record


def test_optional_fields_keep_their_documented_defaults():
    opened = messages.decode(wire(Command.OPEN, {"job": "j", "consumer": "c", "epoch": 0,
                                                 "credits": 8}))
    assert isinstance(opened, messages.Open)
    assert (opened.task, opened.rerun, opened.ring, opened.consumer_index) == (None, 0, None,
                                                                              None)
    task = messages.Task.from_body({"task": "t", "job": "j", "options": OPTIONS, "index": 0,
                                    "width": 1, "entropy": 1})
    assert (task.source_data, task.fingerprint, task.pipeline) == (None, None, None)
    options = JobOptions()  # the Loader's defaults, as the protocol doc gives them
    assert (options.sharding, options.on_error, options.balanced, options.num_consumers,
            options.exactly_once, options.share, options.weight) == \
        ("dynamic", "raise", 0, 0, False, None, 1.0)
    assert messages.Fetch.from_body({}).what == "source"
    register = messages.Register.from_body(
        {k: v for k, v in SAMPLES[Command.REGISTER].items() if k != "consumer_index"}
        | {"options": {**OPTIONS, "weight": 1}})
    assert register.options.weight == 1.0 and register.consumer_index is None
    # Absent optional fields stay absent on the wire: their absence means something.
    data = messages.Data(epoch=0, count=1, skipped=0, ring=None)
    assert messages.decode(wire(Command.DATA, messages.encode(data))) == data
    assert len(messages.encode(data)) == 26  # epoch, count, skipped, flags (u16)


DEEP: object = 1
for _ in range(MAX_BODY_DEPTH // 2):
    DEEP = [DEEP]

BAD = [  # command, field, body change: each kind of bad body
    (Command.OPEN, "credits", {"credits": "8"}),  # wrong type
    (Command.TASK, "pipeline", {"pipeline": "inline"}),
    (Command.TASK, "options.share", {"options": {**OPTIONS, "share": {"lag": "block"}}}),
    (Command.OPEN, "credits", {"credits": -1}),  # out of range
    (Command.SPLIT_REQ, "pass", {"pass": [-1]}),
    (Command.ACK, "heartbeat", {"heartbeat": 3600}),
    (Command.REGISTER, "options.weight", {"options": {**OPTIONS, "weight": 0}}),
    (Command.TASK, "options.sharding", {"options": {**OPTIONS, "sharding": "sideways"}}),
    (Command.LOG, "lines", {"lines": [[99, "x"]]}),
    (Command.READY, "endpoint", {"endpoint": "x" * 5000}),  # too long
    (Command.JOB, "workers", {"workers": [{"worker": "w1"}]}),  # nested shape
    (Command.JOB, "fences", {"fences": [{**FENCE, "splits": [[[], 3]]}]}),
    (Command.JOB, "pending", {"pending": {"zero": 1}}),
    (Command.SPLIT, "skip", {"skip": "not a packed set"}),
    (Command.SPLIT, "expect", {"expect": [1]}),
    (Command.TASK, "source_data", {"source_data": {"endpoint": "tcp://h:1", "kind": "?"}}),
    (Command.FAIL, "error", {"error": {"message": 3}}),
    (Command.HEARTBEAT, "stats", {"stats": {"deep": DEEP}}),  # too deep
    (Command.REGISTER, "resume", {"resume": {"delivered": DEEP}}),
    # every record the broker takes (BYE has no field)
    (Command.READY, "endpoint", {"endpoint": "udp://h:1"}),
    (Command.READY, "holds", {"holds": ["fp"] * 65}),
    (Command.READY, "pid", {"pid": -1}),
    (Command.REGISTER, "options", {"options": None}),
    (Command.REGISTER, "options.share", {"options": {**OPTIONS, "share": {
        "window_bytes": 0, "lag": "block", "block_seconds": 1.0}}}),
    (Command.REGISTER, "options.share", {"options": {**OPTIONS, "share": {
        "window_bytes": 1, "lag": "wait", "block_seconds": 1.0}}}),
    (Command.REGISTER, "options.num_consumers", {"options": {**OPTIONS, "num_consumers": -1}}),
    (Command.REGISTER, "options.balanced", {"options": {**OPTIONS, "balanced": 1 << 17}}),
    (Command.REGISTER, "options.sharding", {"options": {**OPTIONS, "sharding": "sideways"}}),
    (Command.REGISTER, "options.exactly_once", {"options": {**OPTIONS, "exactly_once": 1}}),
    (Command.REGISTER, "options.deterministic", {"options": {**OPTIONS,
                                                             "deterministic": None}}),
    (Command.REGISTER, "options.on_error", {"options": {**OPTIONS, "on_error": "retry"}}),
    (Command.REGISTER, "options.num_workers", {"options": {**OPTIONS, "num_workers": "2"}}),
    (Command.REGISTER, "consumer_index", {"consumer_index": -1}),
    (Command.REGISTER, "source", {"source": {"num_splits": -1}}),
    (Command.REGISTER, "source", {"source": {"num_splits": 1, "seed": "x"}}),
    (Command.REGISTER, "source", {"source": {"num_splits": 4, "inputs": [[3, False, None]]}}),
    (Command.REGISTER, "source", {"source": {"num_splits": 0, "inputs": []}}),
    (Command.REGISTER, "source", {"source": {"num_splits": 2, "inputs": [[2, 0, None]]}}),
    (Command.REGISTER, "source", {"source": {"num_splits": 1 << 13,
                                             "inputs": [[2, False, None]] * 4097}}),
    (Command.STATUS, "workers", {"workers": {}}),
    (Command.HEARTBEAT, "stuck", {"stuck": [{"worker": "w1", "task": "t1"}]}),
    (Command.HEARTBEAT, "reread", {"reread": [[[], 3, {}]]}),
    (Command.HEARTBEAT, "reread", {"reread": [[[0], 3]]}),
    (Command.HEARTBEAT, "handover", {"handover": [{"n": 0, "epoch": 0}]}),
    (Command.HANDOVER, "segments", {"task": "t1", "segments": [
        {"n": 0, "epoch": 0, "index": 0, "pass": [0], "splits": [-1], "served": [],
         "had": {}, "switches": [], "last": True}]}),
    (Command.HANDOVER, "segments", {"task": "t1", "segments": [
        {"n": 0, "epoch": 0, "index": 0, "pass": [0], "splits": [1], "served": [],
         "had": {"c1": -3}, "switches": [], "last": True}]}),
    (Command.HANDOVER, "held", {"task": "t1", "segments": [], "held": [-1]}),
    (Command.BRANCH, "branch", {"task": "t1", "branch": 0, "tap": 1, "fingerprint": "f"}),
    (Command.BRANCH, "tap", {"task": "t1", "branch": 1, "tap": 0, "fingerprint": "f"}),
    (Command.OPEN, "branch", {"branch": -1}),
    (Command.REGISTER, "prefixes", {"prefixes": ["a"] * 2000}),
    (Command.REGISTER, "first_tap", {"first_tap": 0}),
    (Command.DELIVERED, "shared", {"shared": {"epoch": 0, "done": "no", "count": 3}}),
    (Command.DELIVERED, "shared", {"shared": {"epoch": 0, "done": False, "count": 3,
                                              "ranges": [[5, 7], [2, 3]]}}),
    (Command.DELIVERED, "shared", {"shared": {"epoch": 0, "done": False, "count": 3,
                                              "ranges": [[4, 4]]}}),
    (Command.HANDOVER, "segments", {"task": "t1", "segments": [
        {"n": 0, "epoch": 0, "index": 0, "pass": [0], "splits": [1], "served": [],
         "had": {"c1": [[3, 1]]}, "switches": [], "last": True}]}),
    (Command.HANDOVER, "segments", {"task": "t1", "segments": [
        {"n": 0, "epoch": 0, "index": 0, "pass": [0], "splits": [1], "served": [],
         "had": {}, "switches": [[[0], -1, [1.0]]], "last": True}]}),
    (Command.SPLIT_REQ, "have", {"have": "3"}),
    (Command.PASS_DONE, "pass", {"pass": []}),
    (Command.WEIGHED, "weights", {"weights": [0.5, 1.5]}),
    (Command.TASK_FAILED, "error", {"error": "boom"}),
    (Command.EPOCH, "epoch", {"epoch": -1}),
    (Command.ROUND_REQ, "members", {"members": []}),
    (Command.RECEIVED, "rounds", {"rounds": [-1]}),
    (Command.DELIVERED, "splits", {"splits": [[[0], 3, "all"]]}),
    (Command.DELIVERED, "splits", {"splits": [[0, 3, {}]]}),
    (Command.LOG, "task", {"task": 5}),
    (Command.WEIGHTS, "weights", {"weights": []}),
    (Command.WEIGHTS, "weights", {"weights": [0.5, 1.5]}),
    (Command.WEIGHTS, "weights", {"weights": [float("nan")]}),
    (Command.OPEN, "weights", {"weights": [-0.5]}),
    (Command.DISPATCH, "items", {"items": [3, -1]}),
    (Command.DISPATCH, "items", {"items": [True]}),
    (Command.DISPATCH, "items", {"items": list(range(1 << 16 + 1))}),
]


@pytest.mark.parametrize("command,field,change", BAD,
                         ids=[f"{c.name}.{f}-{i}" for i, (c, f, _) in enumerate(BAD)])
def test_a_bad_body_is_refused_naming_the_command_and_field(command, field, change):
    msg = wire(command, {**SAMPLES[command], **change})
    with pytest.raises(ProtocolError, match=rf"^{command.name}: field '{field}' "):
        messages.decode(msg)


def test_a_bad_packed_data_body_is_refused_saying_what_is_wrong():
    good = SAMPLES[Command.DATA]
    name = b"zloader-ring"
    for body, why in [
        (b"", "at least 26"),
        (good[:25], "at least 26"),
        (struct.pack("<QQQH", 0, 1, 0, 1 << 11), "unknown bits"),
        (good[:-4], "ends inside its fields"),
        (good + b"x", "1 bytes after its fields"),
        (good.replace(name, "zloader-rïng".encode()[:len(name)]), "not ASCII"),
        (b'{"epoch": 0, "count": 1, "skipped": 0, "ring": null}', "ends|after|unknown bits"),
    ]:
        with pytest.raises(ProtocolError, match=rf"^DATA: .*({why})"):
            messages.decode(wire(Command.DATA, body))
    too_long = messages.Data(epoch=0, count=1, ring=(0, 8, "r" * 5000)).to_body()
    with pytest.raises(ProtocolError, match="field 'ring' has a name of 5000 bytes"):
        messages.decode(wire(Command.DATA, too_long))


@pytest.mark.parametrize("command", [Command.REGISTER, Command.TASK], ids=lambda c: c.name)
def test_job_options_round_trip_and_a_missing_option_is_refused_by_name(command):
    body = SAMPLES[command]
    record = messages.decode(wire(command, body))
    assert isinstance(record, (messages.Register, messages.Task))
    assert isinstance(record.options, JobOptions)
    assert JobOptions.from_body(record.options.to_body()) == record.options
    assert messages.encode(record)["options"] == body["options"]
    for name in body["options"]:
        options = {k: v for k, v in body["options"].items() if k != name}
        with pytest.raises(ProtocolError, match=rf"^{command.name}: field 'options.{name}' "
                                                "is missing"):
            messages.decode(wire(command, {**body, "options": options}))


def test_job_options_apply_the_exactly_once_rule():
    asked = JobOptions(exactly_once=True)
    assert asked.applied() is asked  # dynamic, not shared, balanced, coordinated or ordered
    for change in ({"sharding": "static"}, {"deterministic": True}, {"balanced": 2},
                   {"num_consumers": 2},
                   {"share": {"window_bytes": 1, "lag": "skip", "block_seconds": 0.0}}):
        assert not dataclasses.replace(asked, **change).applied().exactly_once, change


def test_a_consumers_register_as_it_builds_it_is_one_the_broker_takes():
    from zloader.client.link import registration

    options = JobOptions(sharding="static", num_workers=2, num_consumers=2, weight=2.0)
    sent = registration(fingerprint="fp", job_name="train", options=options,
                        consumer_index=1, source={"num_splits": 4, "shuffle_splits": False,
                                                  "seed": None},
                        inherited=True, resume={"epoch": 1, "delivered": [], "entropy": 7})
    body = messages.encode(sent)
    got = messages.decode(decode(encode(Command.REGISTER, body, [b""])))
    assert got == sent and isinstance(got, messages.Register) and got.options == options
    assert body["options"] == options.to_body() and body["consumer_index"] == 1


def test_the_broker_keeps_the_leniency_the_protocol_promises():
    """docs/protocol.md: a malformed HEARTBEAT.doing is ignored; a consumer may send EPOCH
    before it knows its job; a coordinated worker's group may name a vacant index."""
    beat = messages.decode(wire(Command.HEARTBEAT, {"stats": {"elements": 1},
                                                    "doing": {"epoch": -1, "stage": "?"}}))
    assert isinstance(beat, messages.Heartbeat)
    assert beat.doing is None and beat.stats == {"elements": 1}
    assert messages.encode(beat) == {"stats": {"elements": 1}}
    epoch = messages.decode(wire(Command.EPOCH, {"job": None, "epoch": None}))
    assert isinstance(epoch, messages.Epoch) and (epoch.job, epoch.epoch) == (None, None)
    members = messages.decode(wire(Command.ROUND_REQ, {"task": "t", "epoch": 0,
                                                       "members": ["c0", None]}))
    assert isinstance(members, messages.RoundReq) and members.members == ("c0", None)


def test_register_carries_its_payload_frame_as_the_blob():
    body = SAMPLES[Command.REGISTER]
    register = messages.decode(decode(encode(Command.REGISTER, body, [b"pickled"])))
    assert isinstance(register, messages.Register) and register.blob == b"pickled"
    assert messages.encode(register) == body  # the blob is a frame, not a field


def required(command: Command) -> list[str]:
    """The fields of ``command``'s body that have no default."""
    return [wire_name for _, wire_name, _, default, _ in RECORDS[command].spec()
            if default is dataclasses.MISSING]


@pytest.mark.parametrize("command", [c for c in Command if required(c) and c not in PACKED],
                         ids=lambda c: c.name)
def test_a_missing_field_is_refused_by_name(command):
    for wire_name in required(command):
        body = {k: v for k, v in SAMPLES[command].items() if k != wire_name}
        with pytest.raises(ProtocolError, match=rf"^{command.name}: field '{wire_name}' is "
                                                "missing"):
            messages.decode(wire(command, body))


def test_a_body_deeper_than_the_protocol_allows_is_refused_before_any_record():
    deep = json.dumps({"stats": json.loads("[" * 40 + "]" * 40)}).encode()
    with pytest.raises(ProtocolError, match="nested deeper"):
        decode([encode(Command.HEARTBEAT)[0], bytes((Command.HEARTBEAT,)), deep])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=10)


@given(st.sampled_from(list(Command)), st.dictionaries(
    st.sampled_from(sorted({k for body in SAMPLES.values() if isinstance(body, dict)
                            for k in body})), json_values,
    max_size=8))
@settings(max_examples=300, derandomize=True, deadline=None)
def test_records_refuse_any_body_only_with_protocol_error(command, body):
    try:
        record = messages.decode(wire(command, body))
    except ProtocolError as exc:
        assert str(exc).startswith(f"{command.name}: ")
        return
    assert messages.decode(wire(command, messages.encode(record))) == record


@given(st.binary(max_size=80) | st.builds(
    lambda cut, noise: SAMPLES[Command.DATA][:cut] + noise, st.integers(0, 80),
    st.binary(max_size=12)))
@settings(max_examples=300, derandomize=True, deadline=None)
def test_packed_data_refuses_any_body_only_with_protocol_error(body):
    try:
        record = messages.decode(wire(Command.DATA, body))
    except ProtocolError as exc:
        assert str(exc).startswith("DATA: ")
        return
    assert messages.encode(record) == body


def test_a_worker_refuses_a_malformed_open_naming_the_field():
    with service(1) as (address, _):
        wait_for(lambda: len((status(address) or {}).get("workers", [])) == 1,
                 what="the worker's registration")
        (worker,) = status(address)["workers"]
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(worker["endpoint"])
            sock.send_multipart(encode(Command.OPEN, {**SAMPLES[Command.OPEN], "credits": -8}))
            assert sock.poll(10_000), "the worker did not answer the malformed OPEN"
            answer = decode(sock.recv_multipart())
        finally:
            sock.close(0)
            context.term()
    assert answer.command is Command.ERROR
    assert "OPEN: field 'credits' must be an integer >= 0" in answer.body["message"]


_FIELDS = [("a", int), ("b", object, dataclasses.field(default=None)),
           ("hidden", int, dataclasses.field(default=0, repr=False)),
           ("ignored", int, dataclasses.field(default=0, compare=False)),
           ("unhashed", int, dataclasses.field(default=0, hash=False))]
# The same fields, their methods compiled by @dataclass, and from zloader._byfields.
_Compiled = dataclasses.make_dataclass("_Compiled", _FIELDS, frozen=True)
_ByFields = dataclasses.make_dataclass("_ByFields", _FIELDS, bases=(FrozenByFields,),
                                       eq=False, repr=False)


@dataclasses.dataclass(eq=False, repr=False)
class _Mutable(ByFields):
    a: int


_VALUES = st.builds(dict, a=st.integers(-2, 2), b=st.sampled_from([None, 1, (1, 2), "x"]),
                    hidden=st.integers(0, 1), ignored=st.integers(0, 1),
                    unhashed=st.integers(0, 1))


@settings(max_examples=200, deadline=None)
@given(_VALUES, _VALUES)
def test_eq_hash_and_repr_by_the_fields_are_the_dataclass_s_own(one, two):
    """The dataclasses declared ``eq=False, repr=False`` over zloader._byfields behave as
    those whose methods @dataclass compiles: which fields compare, hash and show; a
    frozen one's fields are set once."""
    compiled = _Compiled(**one), _Compiled(**two)
    mine = _ByFields(**one), _ByFields(**two)
    assert (mine[0] == mine[1]) == (compiled[0] == compiled[1])
    assert hash(mine[0]) == hash(compiled[0])
    assert repr(mine[0]) == repr(compiled[0]).replace("_Compiled", "_ByFields")
    assert mine[0] != compiled[0] and mine[0] == _ByFields(**one)
    with pytest.raises(TypeError):
        hash(_Mutable(1))
    assert _Mutable(1) == _Mutable(1) != _Mutable(2)
    for value in (compiled[0], mine[0]):
        for name in ("a", "other"):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(value, name, 1)
        with pytest.raises(dataclasses.FrozenInstanceError):
            del value.a
        assert dataclasses.replace(value, a=9).a == 9 and value.a == one["a"]


def test_a_segment_with_many_switches_of_weights_takes_entries_that_fit_a_message():
    """A trainer that sets a mix's weights at every step: a moved or dead worker's
    segment carries thousands of switches, spread over its entries (HANDOVER_SWITCHES
    each, more on entries of no split), each a HANDOVER within the message bounds, and
    read back in order."""
    from zloader._defaults import HANDOVER_SWITCHES
    from zloader.sharing.handover import Segment, from_wire, to_wire

    switched = [(at * 7, (0.125, 0.25, 0.625)) for at in range(5000)]
    segment = Segment(3, 1, {(3, 1 << 20): [5, 2], (3, (1 << 20) + 1): [9]}, {"c1"},
                      switches={(3,): switched})
    entries = to_wire([segment])
    assert len(entries) == -(-5000 // HANDOVER_SWITCHES)  # (2 of splits, 3 of none)
    for entry in entries:  # (each within MAX_BODY_BYTES: wire() checks the frames)
        handover = messages.decode(wire(Command.HANDOVER, {"task": "t1", "segments": [entry]}))
        assert handover.segments == (entry,)
    (back,) = from_wire(entries)
    assert back.switches == {(3,): switched}
    assert back.splits == {(3, 1 << 20): [5, 2], (3, (1 << 20) + 1): [9]}


def test_handovers_a_task_was_handed_before_it_began_are_handed_on_as_one():
    """A task that drains while its pipeline loads hands on what it was handed meanwhile:
    two handovers' entries (each numbering its segments from 0, the broker's ``last``
    ending each) become one handover whose segments are those of both, each whole, and a
    handover whose last entry had not come yet is kept too."""
    from zloader.sharing.handover import Segment, from_wire, rehanded, to_wire

    first = to_wire([Segment(0, 1, {(0,): [4, 7]}, {"a"}),
                     Segment(1, 1, {(1,): [2]}, set(), {"b": 3})])
    second = to_wire([Segment(0, 2, {(0,): [5]}, set(), {"a": [[0, 2]]})])
    partial = to_wire([Segment(1, 3, {(1,): [8, 9]})])
    first[-1]["last"] = second[-1]["last"] = True
    entries = rehanded([first[:1], first[1:], second, partial])
    assert not any(entry["last"] for entry in entries)
    back = [(s.epoch, s.index, s.splits, s.served, s.had) for s in from_wire(entries)]
    assert back == [(0, 1, {(0,): [4, 7]}, {"a"}, {}), (1, 1, {(1,): [2]}, set(), {"b": 3}),
                    (0, 2, {(0,): [5]}, set(), {"a": [[0, 2]]}),
                    (1, 3, {(1,): [8, 9]}, set(), {})]
    assert rehanded([]) == []


_JSON = st.recursive(
    st.none() | st.integers(-5, 5) | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=4), children, max_size=3),
    max_leaves=40)


def _nested(depth: int, inner: object) -> object:
    for _ in range(depth):
        inner = [inner]
    return inner


@settings(max_examples=300, deadline=None)
@given(st.integers(0, MAX_BODY_DEPTH + 3), _JSON)
def test_the_quick_depth_check_of_a_body_agrees_with_the_walk(depth, value):
    """A body's depth is checked from its text at C speed (brackets in strings ignored;
    unsure, and so walked, where a string has an escape): never shallow when the walk
    finds it deeper than MAX_BODY_DEPTH, and shallow whenever the walk finds it is and
    the text has no escape."""
    from zloader.transport.protocol import _depth, _without_strings
    from zloader.transport.protocol import _shallow as shallow_text

    def _shallow(raw: bytes) -> bool:
        return shallow_text(_without_strings(raw))

    body = {"stats": _nested(depth, value)}
    raw = json.dumps(body).encode()
    deep = _depth(body) > MAX_BODY_DEPTH
    assert not (_shallow(raw) and deep)
    if b"\\" not in raw:
        assert _shallow(raw) == (not deep)
    if deep and raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH:
        with pytest.raises(ProtocolError, match="nested deeper"):
            decode([encode(Command.HEARTBEAT)[0], bytes((Command.HEARTBEAT,)), raw])


_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(10**19 - 5, 10**19 + 5),
    st.integers(2**64 - 3, 2**64 + 3), st.integers(-(2**64) - 3, -(2**64) + 3),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet='0123456789e.+-"\\', max_size=30),
    st.text(alphabet="0123456789", min_size=20, max_size=30))  # (a string of digits)


@settings(max_examples=400, deadline=None)
@given(st.lists(_NUMBERS, max_size=8), st.sampled_from(["[{}]", "{{\"k\": {}}}",
                                                         "[1e{}]", "[1.{}]", "[-{}]"]))
def test_long_integers_are_checked_as_the_parser_would(values, shape):
    """A body with an integer of 20 digits or more (a state's entropy) has its long
    integers checked at C speed outside its strings, not every integer by a Python call:
    the body decodes, or is refused, exactly as with the call per integer."""
    from zloader.transport.protocol import _body, _int
    raw = json.dumps({"values": values}).encode()
    extra = shape.format("".join(str(v) for v in values if isinstance(v, int))[:60] or "1")
    for text in (raw, raw[:-1] + b', "x": ' + extra.encode() + b"}"):
        try:
            expected: object = json.loads(text, parse_int=_int)
        except ProtocolError:
            expected = ProtocolError
        except ValueError:
            continue  # (not JSON: refused either way)
        try:
            got: object = _body(Command.HEARTBEAT, text)
        except ProtocolError as exc:
            got = ProtocolError if "not JSON" not in str(exc) else exc
        assert got == expected, text[:200]
