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

# Lower layers never import higher ones (style: layers follow the data).
LAYERS = {
    "_version": 0, "_defaults": 0, "errors": 0, "_check": 0, "_seeding": 0, "_command": 0,
    "codec": 1, "collate": 1, "fingerprint": 1, "rounds": 1, "journal": 1, "lineage": 1,
    "metrics": 1, "autoscale": 1, "forward": 1, "blobs": 1, "pool": 1, "_status": 6, "actuator": 7,
    "ray": 8, "shipping": 5,
    "_host": 0, "sources": 2, "stages": 2,
    "pipeline": 3, "plan": 4, "demo": 4, "_pickling": 4,
    "state": 5, "broker": 6, "worker": 6, "_process": 7,
    "loader": 8, "torch": 9, "tf": 9, "cli": 10, "__init__": 11,
    # The client package (layer 6), in the order its modules may import each other;
    # "client" is its __init__.
    "client.stats": 6.0, "client.session": 6.0, "client.items": 6.0, "client.arguments": 6.0,
    "client.rounds": 6.1, "client.exactly_once": 6.1, "client.peers": 6.2,
    "client.link": 6.2, "client.epoch_end": 6.3, "client.packing": 6.3, "client.receive": 6.4,
    "client.thread": 6.5, "client.merging": 6.6, "client": 6.7,
    # The transport package: keys, shared memory and framing below everything that uses
    # them (the journal checks directories with keys.py); records over the codec, message
    # records over their fields, the fields over lineage's packed sets, the socket helper over
    # the keys.
    "transport.keys": 0.5, "transport.shm": 0.5, "transport.protocol": 0.5,
    "transport.ring": 0.6, "transport.records": 1.5, "transport.fields": 1.5,
    "transport.messages": 1.6, "transport.sockets": 1.5, "transport": 1.7,
}
SUBPACKAGES = ("client", "transport")


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


def imported_modules(path: pathlib.Path) -> set[str]:
    """The zloader modules ``path`` imports: ``client.peers`` for a module of a
    subpackage in SUBPACKAGES, else the top-level name (``transport``, ``codec``)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zloader"):
            names.add(node.module.removeprefix("zloader").lstrip("."))
            if node.module == "zloader":
                names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("zloader.") for a in node.names
                         if a.name.startswith("zloader."))
    return {n if n.split(".")[0] in SUBPACKAGES else n.split(".")[0] for n in names if n}


def package_modules() -> dict[str, pathlib.Path]:
    """Each module's name in LAYERS and its file: top-level modules and SUBPACKAGES'."""
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    for sub in SUBPACKAGES:
        for path in (PACKAGE / sub).glob("*.py"):
            modules[sub if path.stem == "__init__" else f"{sub}.{path.stem}"] = path
    return modules


def test_layers_follow_the_data():
    modules = package_modules()
    unknown = set(modules) - set(LAYERS)
    assert not unknown, f"give new modules a layer: {unknown}"
    for module, path in modules.items():
        for imported in imported_modules(path):
            if imported in LAYERS:
                assert LAYERS[imported] < LAYERS[module] or imported == module, (
                    f"{path.relative_to(ROOT)} (layer {LAYERS[module]}) imports {imported} "
                    f"(layer {LAYERS[imported]})")


# Inside the worker (zloader/worker/, and the shared delivery it runs from zloader/sharing/):
# the producer and what sends to consumers at the bottom, the delivery modes on the protocol
# they follow, the task above them, the process on top.
WORKER_LAYERS = {
    "worker.producer": 0, "worker.streams": 0, "worker.broker_link": 0, "worker.links": 1,
    "worker.delivery": 2, "worker.credit": 3, "worker.rounds": 4, "sharing.delivery": 4,
    "worker.task": 5, "worker.consumers": 6, "worker.process": 7, "worker.__init__": 8,
}


def runtime_imports(path: pathlib.Path) -> set[str]:
    """The zloader modules ``path`` imports (``"worker.task"``, ``"codec"``), leaving out
    those imported for type checking only."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zloader"):
            module = node.module.removeprefix("zloader").lstrip(".")
            if module:
                names.add(module)
            else:
                names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("zloader.") for a in node.names
                         if a.name.startswith("zloader."))
    return names


def test_worker_modules_follow_the_data():
    # (__main__ is the command line, above everything, like cli.py)
    modules = {f"worker.{p.stem}" for p in (PACKAGE / "worker").glob("*.py")} - {
        "worker.__main__"}
    missing = modules - set(WORKER_LAYERS)
    assert not missing, f"give new modules a layer: {missing}"
    for module, layer in WORKER_LAYERS.items():
        for imported in runtime_imports(PACKAGE / (module.replace(".", "/") + ".py")):
            if imported in WORKER_LAYERS:
                assert WORKER_LAYERS[imported] < layer, (
                    f"{module} (layer {layer}) imports {imported} "
                    f"(layer {WORKER_LAYERS[imported]})")
            elif imported.split(".")[0] in LAYERS:
                assert LAYERS[imported.split(".")[0]] < LAYERS["worker"], (
                    f"{module} imports {imported}, a layer above the worker")


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


def test_status_command_against_a_running_broker():
    from tests.service import service

    with service(workers=1) as (address, _):
        done = run(bin_path("zloader"), "status", "--broker", address, "--json")
        assert done.returncode == 0, done.stderr
        import json
        body = json.loads(done.stdout)
        assert set(body) == {"workers", "jobs"} and len(body["workers"]) == 1
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
