"""The package's shape: public surface, import weight, layering, packaging files, commands."""

from __future__ import annotations

import ast
import configparser
import pathlib
import subprocess
import sys

import pytest

import zloader

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zloader"

# Every module, top-level and in the subpackages, has a layer: a module imports only modules
# of lower layers (style: layers follow the data), so the import graph has no cycle. A
# subpackage's modules are named "client.thread"; the package itself ("client") is its
# __init__.
LAYERS = {
    "_defaults": -1,  # the tunables: imports nothing, imported by any layer
    "_defaults.pipeline": -2, "_defaults.client": -2, "_defaults.broker": -2,
    "_defaults.worker": -2, "_defaults.transport": -2,  # (its parts, by role)
    "_byfields": -0.5,  # eq, hash and repr by the fields, for dataclasses of any layer
    "_hash": -0.5,  # sha256, hashlib imported at first use, for any layer
    "_version": 0, "errors": 0, "_check": 0, "_seeding": 0,
    "_command": 0,
    "_host": 0,
    "transport": 0, "transport.keys": 0, "transport.shm": 0.5, "transport.protocol": 0.5,
    "transport.prefault": 0.55, "transport.ring": 0.6, "transport.notice": 0.6,
    "transport.records": 1.5,
    "transport.fields": 1.5,
    "transport.sockets": 1.5, "options": 1.55, "transport.shapes": 1.55,
    "transport.messages": 1.6,
    "sharing": 0, "sharing.window": 0, "sharing.handover": 0.5, "sharing.options": 0.5,
    "sharing.store": 1.6, "sharing.prefix": 0.5,
    "packed": 0.8,  # lists packed for forked workers (fingerprint reads them)
    "handoff": 0.85,  # ... packed after the fork, handed to the workers
    "codec_torch": 0.9,  # torch tensors in the codec, torch imported lazily
    "codec": 1, "collate": 1.1, "fingerprint": 1,
    # lineage: sets of ints, the tags, the origin block, the ledger; the package on top
    "lineage.intsets": 0.9, "lineage.tags": 0.95, "lineage.ranges": 0.96, "lineage.ledger": 0.97,
    "lineage.wire": 0.98, "lineage": 1,
    "forward": 1, "blobs": 1,
    "formats._crc32c": 1, "formats.example": 1, "formats.image": 1, "formats": 1.2,
    "formats.compressed": 1,
    "storage": 1.5, "cachefile": 1.6,
    "runs": 1.95,  # a run: its settings, tally, Context and Coverage
    "sources": 2, "formats.base": 2.2, "formats.tfrecord": 2.4, "formats.webdataset": 2.4,
    "formats.parquet": 2.4, "formats.jsonl": 2.4, "formats.image_folder": 2.4,
    "formats.build": 2.6, "chunks": 1.8, "_core": 1.82, "_native": 1.85, "groups": 1.9,
    "stages": 2, "cache": 2.5, "mixing": 2.8,
    "pipeline": 3, "plan": 4, "sharing.branches": 4.5,
    "demo": 4,
    "_pickling": 4, "shipping": 5,
    # the broker: records and the pool's policy, the concerns one above the other (each
    # calls only those below it), the journal's replay on them, the facade, the loop
    "broker.rounds": 5.8, "broker.journal": 5.8, "broker.metrics": 5.8,
    "broker.autoscale": 5.8,
    "broker.records": 6.0, "broker.pool": 6.0, "broker.admission": 6.1,
    "broker.events": 6.05, "broker.splits": 6.1, "broker.coordinated": 6.1,
    "broker.views": 6.15, "broker.failures": 6.2, "broker.placement": 6.22,
    "broker.status": 6.24, "broker.peers": 6.26, "broker.jobs": 6.28,
    "broker.history": 6.3, "broker.state": 6.32, "broker.descriptors": 6.35,
    "broker.loop": 6.4, "broker": 6.5,
    # the worker: what sends to consumers and the producer at the bottom, the delivery modes
    # on the interface they implement, the task above them, the process on top
    "worker.dispatched": 5.9,  # (a consumer's work items, taken by the producer)
    "worker.outgoing": 5.9,  # (what a producer hands on: a record and its head, an END)
    "worker.spec": 5.95,  # (what a producer is given and speaks in)
    "worker.memory": 6.0, "worker.permits": 5.9, "worker.producer": 6.0, "worker.streams": 6.0,
    "worker.broker_link": 6.0,
    "worker.links": 6.1, "worker.delivery": 6.2, "worker.credit": 6.3, "worker.rounds": 6.4,
    "worker.shared": 6.4, "worker.task": 6.5, "worker.consumers": 6.6,
    "worker.process": 6.7, "worker": 6.8,
    # the client, in the order its modules may import each other
    "client.session": 5.95,  # (the epoch input that client.items carries)
    "client.stats": 6.0, "client.items": 6.0,
    "client.budget": 6.05,
    "client.rounds": 6.1, "client.exactly_once": 6.1, "client.turn": 6.1, "client.peers": 6.2,
    "client.link": 6.2, "client.epoch_end": 6.3, "client.shipment": 6.3, "client.receive": 6.4,
    "client.loop": 6.45, "client.thread": 6.5, "client.draw": 6.55, "client.merging": 6.6,
    "client": 6.7,
    "_status": 6, "_process": 7, "actuator": 7,
    "client.arguments": 7.2,  # (a Loader's arguments, checked: above the start methods)
    "embedded": 7.5, "loader": 8, "ray": 8, "tf": 9,
    # the torch adapter: conversion and seeding, then what runs on workers and the
    # iterators, the DataLoader, the package's public names
    "torch.tensors": 9.0, "torch.seeding": 9.0, "torch.failures": 9.0, "torch.states": 9.05,
    "torch.dataset": 9.1, "torch.permutation": 9.0, "torch.feed": 9.06,
    "torch.source": 9.1, "torch.passes": 9.1, "torch.dataloader": 9.2, "torch": 9.3,
    "_cache_cli": 9.5, "cli": 10, "broker.__main__": 10.5, "worker.__main__": 10.5, "__init__": 11,
}
RUNTIME = ("broker", "client", "worker", "sharing")
"""The runtime's subpackages: their modules share public names only."""


def test_all_is_sorted_and_complete():
    assert zloader.__all__ == sorted(zloader.__all__)
    for name in zloader.__all__:
        assert hasattr(zloader, name)


def test_import_zloader_imports_neither_torch_nor_tensorflow():
    code = ("import sys, zloader; p = zloader.Pipeline.range(3).map(abs).batch(2); list(p);"
            "p.fingerprint; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'tensorflow')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_only_the_torch_adapter_imports_torch():
    """zloader/torch/ is the only place that imports torch (zloader/tf.py tensorflow)."""
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "torch":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level \
                else []
            assert not any(n.split(".")[0] == "torch" for n in names), \
                f"{path.relative_to(ROOT)} imports torch"


def module_name(path: pathlib.Path) -> str:
    """``client.thread`` for zloader/client/thread.py, ``client`` for its __init__."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_imports(path: pathlib.Path) -> set[str]:
    """The zloader modules ``path`` imports when it runs (``client.peers``, ``codec``; what
    is imported for type checking only is left out), each as its key in LAYERS."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] == "zloader":
            module = node.module.removeprefix("zloader").lstrip(".")
            for alias in node.names:  # "from zloader.broker import pool" names a module
                inner = f"{module}.{alias.name}" if module else alias.name
                names.add(inner if inner in LAYERS else module)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("zloader.") for a in node.names
                         if a.name.startswith("zloader."))
    return {name for name in names if name}


def package_modules() -> dict[str, pathlib.Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def test_layers_follow_the_data():
    modules = package_modules()
    unknown = set(modules) - set(LAYERS)
    assert not unknown, f"give new modules a layer: {unknown}"
    for module, path in modules.items():
        for imported in runtime_imports(path) - {module}:
            assert imported in LAYERS, f"{path.relative_to(ROOT)} imports {imported}"
            assert LAYERS[imported] < LAYERS[module], (
                f"{path.relative_to(ROOT)} (layer {LAYERS[module]}) imports {imported} "
                f"(layer {LAYERS[imported]})")


def test_the_three_planes_never_import_each_other():
    """broker/, client/ and worker/ meet only on the wire (transport/) and in the records
    below them: none imports another, not even for type checking."""
    planes = ("broker", "client", "worker")
    for module, path in package_modules().items():
        plane = module.split(".")[0]
        if plane not in planes:
            continue
        tree = ast.parse(path.read_text())
        imported = {node.module.removeprefix("zloader.").split(".")[0]
                    for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").startswith("zloader.")}
        imported |= {alias.name.removeprefix("zloader.").split(".")[0]
                     for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names if alias.name.startswith("zloader.")}
        others = imported & set(planes) - {plane}
        assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}"


def test_delivery_modes_see_their_task_only_through_its_port():
    """worker/delivery.py's TaskPort is all a delivery mode knows of its task: no mode
    imports worker.task, not even for type checking, nor reaches for ``.task``."""
    for module in ("worker.delivery", "worker.credit", "worker.rounds", "worker.shared"):
        path = package_modules()[module]
        text = path.read_text()
        assert "worker.task" not in text and "self.task" not in text, \
            f"{path.relative_to(ROOT)} reaches past its TaskPort"


def test_nothing_below_the_broker_loop_touches_sockets():
    for module, path in package_modules().items():
        if module.startswith("broker.") and LAYERS[module] < LAYERS["broker.loop"]:
            assert "import zmq" not in path.read_text(), f"{path.relative_to(ROOT)}"


def test_no_runtime_module_reaches_into_another_s_private_state():
    """``x._name`` only on ``self`` (or ``cls``) in the runtime's subpackages: their
    modules share public names only."""
    for sub in RUNTIME:
        for path in (PACKAGE / sub).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                        and not node.attr.startswith("__") \
                        and not (isinstance(node.value, ast.Name)
                                 and node.value.id in ("self", "cls")):
                    raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} reads "
                                         f".{node.attr}")


# The numbers a module may define outside zloader/_defaults/: facts of a format or of a
# domain, not settings (changing one breaks compatibility or correctness, it trades nothing).
FORMAT_CONSTANTS = {
    "packed": {"_MARSHAL_VERSION", "_INT32"},  # marshal format 2, and its small ints
    "handoff": {"_FIELDS", "_FLAT", "_LEFT", "_PENDING", "_READY", "_TUPLE"},  # its table
    "torch.permutation": {"_LIMIT", "_STATE_WORDS"},  # torch's kernel and generator state
    "_process": {"_FORKED", "_PREPARED", "_ENDED"},  # the kinds of the forker's reports
    "codec": {"VERSION",  # the encoded element's format version
              "_I64_MIN", "_I64_MAX"},  # the range of the int64 tag
    "fingerprint": {"SCHEME",  # the hashing rules' version
                    "FLAT_MIN_ITEMS"},  # picks the hashed encoding: part of the rules
    "lineage.tags": {"DIGEST_BYTES", "DIGEST_GROUP",  # what the digest covers: resumed
                     "DIGEST_MARK",  # states compare digests; the mark tells the two ways
                     "INDEX_BITS", "MAX_PASS_ID", "MAX_READ", "MAX_KEY_LENGTH"},
    "lineage.wire": {"_HEAD"},  # the origin block
    "transport.messages": {"_DATA_FLAGS_ALL"},  # the packed DATA body's flags
    "transport.notice": {"FRAME_ALIGN"},  # where a framed record's buffers start
    "broker.journal": {"VERSION"},  # the journal's schema version
    "client.exactly_once": {"STATE_VERSION"},  # the version of Loader.state_dict()
    "transport.ring": {"ALIGN", "DATA_OFFSET", "_HEADER_WORDS",  # the ring's memory layout
                       "_CAPACITY", "_TAIL", "_HEAD",  # indices of its header words
                       "_CREDITS", "_STARVING", "_TAKEN",
                       "_COUNT_BITS", "COUNT_MASK",  # a credits word's fields
                       "_POSITION_LIMIT"},  # its positions are u64
    "transport.prefault": {"MADV_POPULATE_WRITE",  # linux/mman.h
                           "LOWEST_PRIORITY"},  # the kernel's nice range ends at 19
    "transport.records": {"ALIGN"},  # a record's buffer alignment (its layout)
    "transport.shm": {"KIND_MAX",  # the segment name format
                      "_MIB"},  # a unit, for messages
    "transport.protocol": {"MAX_BODY_INT"},  # integers on the wire are 64-bit
    "torch.seeding": {"_MT_WORDS"},  # the size of a Mersenne Twister state
    "torch.failures": {"FIELDS"},  # the strings of a failed batch's record
    "torch.states": {"VERSION"},  # the layout of a DataLoader's state_dict
    "_check": {"_SEED_LIMIT"},  # seeds are 64-bit
    "broker.pool": {"UNBOUNDED"},  # a sentinel: a job that can use any number of workers
    "formats._crc32c": {"_POLYNOMIAL"},  # CRC-32C's polynomial
    "cachefile": {"VERSION", "ALIGN"},  # a cache entry's format version and buffer alignment
    "formats.example": {"_VARINT", "_FIXED64", "_LENGTH", "_FIXED32"},  # protobuf wire types
    "worker.memory": {"_M_TRIM_THRESHOLD", "_M_MMAP_THRESHOLD",  # glibc's mallopt
                      "_M_ARENA_MAX"},  # parameter numbers (malloc.h)
}


def _numeric(node: ast.expr) -> bool:
    """An int/float literal, simple arithmetic of them, or a tuple of such."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    return False


def numeric_constants(path: pathlib.Path) -> set[str]:
    """The module-level names ``path`` binds to numbers (``A = 1``, ``A, B = 1, 2``)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and _numeric(value):
                found.add(target.id)
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                found |= {t.id for t, v in zip(target.elts, value.elts, strict=False)
                          if isinstance(t, ast.Name) and _numeric(v)}
    return found


def test_every_tunable_lives_in_defaults():
    """Timeouts, sizes, limits, counts and ratios are defined in zloader/_defaults/ only
    (style: tunables are named constants in one place); other modules import them."""
    misplaced = {}
    for module, path in package_modules().items():
        if module.split(".")[0] != "_defaults":
            extra = numeric_constants(path) - FORMAT_CONSTANTS.get(module, set())
            if extra:
                misplaced[str(path.relative_to(ROOT))] = sorted(extra)
    assert not misplaced, f"move these to zloader/_defaults/: {misplaced}"


def test_pyproject_holds_only_the_build_system():
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert list(data) == ["build-system"]


def test_setup_cfg_declares_what_the_project_promises():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["options"]["python_requires"] == ">=3.10"
    requires = config["options"]["install_requires"]
    for package in ("numpy", "pyzmq", "psutil", "cloudpickle"):
        assert package in requires
    extras = config["options.extras_require"]
    assert {"torch", "tf", "test", "bench"} <= set(extras)
    assert "torch>=2.1" in extras["torch"]
    scripts = config["options.entry_points"]["console_scripts"]
    for command in ("zloader =", "zloader-broker =", "zloader-worker ="):
        assert command in scripts
    assert "torch==2.13.0" in (ROOT / "constraints-dev.txt").read_text()


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def bin_path(name: str) -> str:
    return str(pathlib.Path(sys.executable).parent / name)


def test_demo_runs_and_reports_throughput():
    done = run(bin_path("zloader"), "demo", "--images", "300", "--batch-size", "64")
    assert done.returncode == 0, done.stderr
    assert "images/s with 2 workers" in done.stdout and "in this process alone" in done.stdout
    assert "300/300 images" in done.stderr  # the progress bar


def test_demo_rejects_bad_arguments():
    done = run(bin_path("zloader"), "demo", "--images", "0")
    assert done.returncode == 2 and "must be >= 1" in done.stderr


def test_fingerprint_command(tmp_path):
    (tmp_path / "mypipe.py").write_text(
        "from zloader import Pipeline\npipeline = Pipeline.range(10).map(lambda x: x + 1)\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from zloader.cli import main;"
            "sys.exit(main(['fingerprint', 'mypipe:pipeline']))")
    first = run(sys.executable, "-c", code, str(tmp_path))
    second = run(sys.executable, "-c", code, str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.strip()) == 64 and first.stdout == second.stdout
    bad = run(sys.executable, "-c", code.replace("mypipe:pipeline", "mypipe"), str(tmp_path))
    assert bad.returncode == 2 and "MODULE:NAME" in bad.stderr


@pytest.mark.parametrize("command", ["zloader-broker", "zloader-worker"])
def test_service_commands_have_help(command):
    done = run(bin_path(command), "--help")
    assert done.returncode == 0 and "--log-level" in done.stdout


def test_python_m_zloader_worker_runs_the_worker_command():
    done = run(sys.executable, "-m", "zloader.worker", "--help")
    assert done.returncode == 0 and "zloader-worker" in done.stdout and "--broker" in done.stdout


def test_worker_requires_a_broker_address():
    done = run(bin_path("zloader-worker"))
    assert done.returncode == 2 and "--broker" in done.stderr


@pytest.mark.slow  # (6 s: a broker and workers; status is tested fast in test_service)
def test_status_command_against_a_running_broker():
    from tests.service import service

    with service(workers=1) as (address, _):
        done = run(bin_path("zloader"), "status", "--broker", address, "--json")
        assert done.returncode == 0, done.stderr
        import json
        body = json.loads(done.stdout)
        assert set(body) == {"summary", "workers", "jobs", "left_off", "next"}
        assert len(body["workers"]) == 1 and body["next"] is None
        table = run(bin_path("zloader"), "status", "--broker", address)
        assert "workers (1)" in table.stdout and "jobs (0)" in table.stdout
        from zloader import Loader, Pipeline

        with Loader(Pipeline.range(10**6), broker=address, job_name="shown") as loader:
            next(iter(loader))
            table = run(bin_path("zloader"), "status", "--broker", address)
        header, row = table.stdout.split("jobs (1)\n")[1].splitlines()[:2]
        assert header.split() == ["job", "name", "consumers", "workers", "share", "wanted",
                                  "starved", "elements", "bytes", "fingerprint"]
        assert row.split()[1:5] == ["shown", "1", "1", "1.0"] and row.split()[6].endswith("%")
    silent = run(bin_path("zloader"), "status", "--broker", address, "--timeout", "0.5")
    assert silent.returncode == 1 and "no answer" in silent.stderr


def test_broker_work_dir_holds_its_log_and_address(tmp_path):
    import signal as _signal

    from tests.service import free_port, status, wait_for

    address = f"tcp://127.0.0.1:{free_port()}"
    work = tmp_path / "broker"
    process = subprocess.Popen([bin_path("zloader-broker"), "--bind", address, "--work-dir",
                                str(work)], stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: status(address, 1.0) is not None, what="the broker")
        import json
        info = json.loads((work / "broker.json").read_text())
        assert info["address"] == address and info["pid"] == process.pid
    finally:
        process.send_signal(_signal.SIGTERM)
        assert process.wait(10) == 0
    assert "listening on" in (work / "broker.log").read_text()


def test_modules_and_functions_stay_readable():
    """No module of zloader/ over 800 lines, and at most 15 functions over 50 (from their
    ``def`` to their last line): the per-record paths that stay long are few and named in
    the message when one more joins them."""
    long_modules = {str(path.relative_to(ROOT)): n for path in PACKAGE.rglob("*.py")
                    if (n := len(path.read_text().splitlines())) > 800}
    assert not long_modules, f"split these modules: {long_modules}"
    long_functions = sorted(
        (node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}: {node.name}")
        for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > 50)
    assert len(long_functions) <= 15, f"functions over 50 lines: {long_functions}"
