"""Authentication: CURVE keys from `zloader keygen`, on a real broker, workers and Loaders.
A peer without an authorized key can neither register a pipeline, nor read data, nor pose
as a worker."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import time

import pytest
import zmq

from tests.service import BIN, free_port, service, start_worker, status, stop, wait_for
from zloader import Loader, Pipeline, Timeout
from zloader.transport.keys import KEYS_ENV, Keys, KeysError, keygen, resolve
from zloader.transport.protocol import Command, decode, encode


@pytest.fixture
def keys(tmp_path) -> str:
    path = str(tmp_path / "keys")
    keygen(path)
    return path


def test_keygen_makes_a_private_directory_that_serves_every_role(tmp_path):
    path = tmp_path / "keys"
    done = subprocess.run([os.path.join(BIN, "zloader"), "keygen", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    names = sorted(p.name for p in path.iterdir())
    assert names == ["authorized", "client.key", "client.key_secret", "server.key",
                     "server.key_secret"]
    loaded = Keys.load(path)
    assert os.listdir(loaded.authorized) == ["client.key"]
    again = subprocess.run([os.path.join(BIN, "zloader"), "keygen", str(path)],
                           capture_output=True, text=True, timeout=30)
    assert again.returncode == 2 and "will not overwrite" in again.stderr


def test_keys_open_to_others_or_missing_are_refused_naming_the_fix(tmp_path, keys,
                                                                   monkeypatch):
    os.chmod(keys, 0o755)
    with pytest.raises(KeysError, match="chmod 700"):
        Keys.load(keys)
    with pytest.raises(KeysError, match="zloader keygen"):
        Keys.load(tmp_path / "nowhere")
    os.chmod(keys, 0o700)
    monkeypatch.setenv(KEYS_ENV, keys)
    assert resolve(None).path == os.path.realpath(keys)
    monkeypatch.delenv(KEYS_ENV)
    assert resolve(None) is None


def test_an_authenticated_service_serves_a_loader_with_the_keys(keys):
    with service(2, keys=keys) as (address, _):
        with Loader(Pipeline.range(200), broker=address, keys=keys, timeout=20) as loader:
            assert sorted(loader) == list(range(200))
        body = status(address, keys=keys)
        assert len(body["workers"]) == 2
        status_command = subprocess.run(
            [os.path.join(BIN, "zloader"), "status", "--broker", address, "--keys", keys],
            capture_output=True, text=True, timeout=30)
        assert status_command.returncode == 0 and "workers (2)" in status_command.stdout


@pytest.mark.slow
def test_a_loader_without_an_authorized_key_gets_nothing(keys, tmp_path):
    other = str(tmp_path / "other")
    keygen(other)
    with service(1, keys=keys) as (address, _):
        loaders = [Loader(Pipeline.range(10), broker=address, keys=k, timeout=2)
                   for k in (None, other)]  # no keys; keys the broker does not know
        try:
            for loader in loaders:
                with pytest.raises(Timeout, match="keys"):
                    list(loader)
        finally:
            for loader in loaders:
                loader.close()
        job_count = len(status(address, keys=keys)["jobs"])
    assert job_count == 0  # their pipelines never reached the broker


@pytest.mark.slow
def test_a_worker_without_the_keys_cannot_join(keys):
    with service(1, keys=keys) as (address, _):
        rogue = start_worker(address)
        try:
            time.sleep(2.0)
            assert len(status(address, keys=keys)["workers"]) == 1
        finally:
            stop(rogue)


def test_a_peer_without_keys_cannot_read_a_workers_data_port(keys):
    with service(1, keys=keys) as (address, _):
        with Loader(Pipeline.range(10**6), broker=address, keys=keys, timeout=20) as loader:
            next(iter(loader))
            (worker,) = status(address, keys=keys)["workers"]
            endpoint = worker["endpoint"]
            for with_keys in (False, True):
                context = zmq.Context()
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if with_keys:
                    Keys.load(keys).connect(sock)
                sock.connect(endpoint)
                # A command a worker refuses: it answers ERROR, if it hears it at all.
                sock.send_multipart(encode(Command.DATA, {}))
                answered = sock.poll(1500)
                if answered:
                    assert decode(sock.recv_multipart()).command is Command.ERROR
                sock.close(0)
                context.term()
                assert answered == with_keys


@pytest.mark.slow
def test_broker_refuses_a_public_bind_without_keys_and_warns_on_loopback(keys):
    port = free_port()
    public = subprocess.run([os.path.join(BIN, "zloader-broker"), "--bind",
                             f"tcp://0.0.0.0:{port}"], capture_output=True, text=True,
                            timeout=30)
    assert public.returncode == 2
    assert "--keys" in public.stderr and "--insecure" in public.stderr
    for args in (["--bind", f"tcp://0.0.0.0:{port}", "--insecure"],
                 ["--bind", f"tcp://127.0.0.1:{port}"]):
        broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), *args],
                                  stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: status(f"tcp://127.0.0.1:{port}", 1.0) is not None,
                     what="the broker")
        finally:
            stop(broker)
        assert "any user" in broker.stderr.read()
        broker.stderr.close()
    worker = subprocess.run([os.path.join(BIN, "zloader-worker"), "--broker",
                             f"tcp://127.0.0.1:{port}", "--advertise", "10.1.2.3"],
                            capture_output=True, text=True, timeout=30)
    assert worker.returncode == 2 and "--keys" in worker.stderr


@pytest.mark.slow
def test_plain_data_workers_serve_key_holders_only(keys):
    with service(0, keys=keys) as (address, _):
        worker = subprocess.Popen([os.path.join(BIN, "zloader-worker"), "--broker", address,
                                   "--keys", keys, "--plain-data"])
        try:
            wait_for(lambda: len(status(address, keys=keys)["workers"]) == 1,
                     what="the worker")
            with Loader(Pipeline.range(300), broker=address, keys=keys, timeout=20,
                        transport="tcp") as loader:
                assert sorted(loader) == list(range(300))
                (entry,) = status(address, keys=keys)["workers"]
            for password in (None, b"wrong"):
                context = zmq.Context()
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if password is not None:
                    sock.plain_username, sock.plain_password = b"zloader", password
                sock.connect(entry["endpoint"])
                sock.send_multipart(encode(Command.DATA, {}))
                assert not sock.poll(1000)  # refused: no answer
                sock.close(0)
                context.term()
        finally:
            stop(worker)
    no_keys = subprocess.run([os.path.join(BIN, "zloader-worker"), "--broker", address,
                              "--plain-data"], capture_output=True, text=True, timeout=30)
    assert no_keys.returncode == 2 and "--plain-data needs --keys" in no_keys.stderr


NOBODY = 65534  # another local user (the tests run as root, who may chown)


def _foreign(path: pathlib.Path, how: str) -> None:
    """Make ``path`` (a directory) one another local user could swap files in."""
    if how == "owner":
        os.chown(path, NOBODY, NOBODY)
    else:
        os.chmod(path, 0o777)


@pytest.mark.parametrize("how", ["owner", "mode"])
def test_directories_another_user_could_write_are_refused(tmp_path, how):
    """A keys directory or a --work-dir made beforehand by another local user (or open to
    every user) is refused, naming the directory, what is wrong and the fix: keygen exits
    non-zero, Keys.load raises, zloader-broker exits before it journals anything."""
    found, fix = ("uid 65534", "chown") if how == "owner" else ("mode 777", "chmod 700")
    made = tmp_path / "made"
    made.mkdir(mode=0o700)
    _foreign(made, how)
    done = subprocess.run([os.path.join(BIN, "zloader"), "keygen", str(made)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and not any(made.iterdir())
    assert str(made) in done.stderr and found in done.stderr and fix in done.stderr
    keys = tmp_path / "keys"
    keygen(keys)
    _foreign(keys, how)
    with pytest.raises(KeysError, match=f"{found}.*{fix}"):
        Keys.load(keys)
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    _foreign(work, how)
    broker = subprocess.run([os.path.join(BIN, "zloader-broker"), "--bind",
                             f"tcp://127.0.0.1:{free_port()}", "--work-dir", str(work)],
                            capture_output=True, text=True, timeout=20)
    assert broker.returncode == 2, broker.stderr
    assert str(work) in broker.stderr and found in broker.stderr and fix in broker.stderr
    assert not any(work.iterdir())


@pytest.mark.slow
def test_a_worker_refuses_a_remote_broker_without_keys_and_says_keys_when_refused(keys):
    """zloader-worker without keys refuses a non-loopback --broker (it would run whatever
    code answers there) unless --insecure, as zloader-broker refuses a non-loopback --bind
    or --metrics-bind; and a worker without keys against a keyed broker exits with a clear
    error saying it wants keys, not a bare zmq.Again."""
    remote = subprocess.run([os.path.join(BIN, "zloader-worker"), "--broker",
                             "tcp://10.1.2.3:5555"], capture_output=True, text=True, timeout=30)
    assert remote.returncode == 2
    assert "--broker tcp://10.1.2.3:5555" in remote.stderr and "--keys" in remote.stderr \
        and "--insecure" in remote.stderr
    metrics = subprocess.run([os.path.join(BIN, "zloader-broker"), "--bind",
                              f"tcp://127.0.0.1:{free_port()}", "--metrics-port",
                              str(free_port()), "--metrics-bind", "0.0.0.0"],
                             capture_output=True, text=True, timeout=30)
    assert metrics.returncode == 2
    assert "--metrics-bind 0.0.0.0" in metrics.stderr and "--insecure" in metrics.stderr
    with service(0, keys=keys) as (address, _):
        refused = subprocess.run([os.path.join(BIN, "zloader-worker"), "--broker", address],
                                 capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "CURVE keys" in refused.stderr and "--keys DIR" in refused.stderr
