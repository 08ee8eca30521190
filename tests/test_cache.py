"""Pipeline.cache: values equal to the uncached pipeline's epoch after epoch, the prefix run
once per element over epochs and jobs (counted across processes in a file), a worker
SIGKILLed mid-write leaving only complete entries, corrupt entries recomputed, refused
placements, ``zloader cache ls|rm``, and a cache in object storage (a real S3 server)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import signal
import threading
import time

import numpy as np
import pytest

from zloader import Loader, Pipeline, PipelineError, WorkerExited, cli
from zloader.cache import location, summaries
from zloader.cachefile import BadEntry, Store, entry_frames

N = 60
SPLIT = 10


def element(x: int):
    """A value of every kind the codec carries."""
    return {"x": np.arange(x % 7, dtype=np.float32) * x, "name": f"e{x}", "long": b"z" * (x * 40),
            "pair": (x, None), "np": np.int16(x), "f": x / 3, "grid": np.ones((2, 3)) * x}


def logged(folder: str):
    """``element`` that appends one line to ``folder``/calls per call (in any process)."""
    def make(x: int):
        with open(os.path.join(folder, "calls"), "a") as file:
            file.write(f"{x}\n")
        return element(x)
    return make


def calls(folder) -> list[int]:
    path = pathlib.Path(folder) / "calls"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def canonical(value):
    """A comparable form of an element (arrays by dtype, shape and values)."""
    if isinstance(value, dict):
        return tuple((k, canonical(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canonical(v) for v in value))
    if isinstance(value, (np.ndarray, np.generic)):
        return (str(value.dtype), np.shape(value), np.asarray(value).tobytes())
    return (type(value).__name__, value)


def same(a, b) -> bool:
    return [canonical(x) for x in a] == [canonical(x) for x in b]


def keep(e) -> bool:
    return e["pair"][0] % 4 != 1


def prefix(folder, **source) -> Pipeline:
    return Pipeline.range(N, split_size=SPLIT, **source).map(logged(str(folder))).filter(keep)


def entries(root) -> list[pathlib.Path]:
    return sorted(pathlib.Path(root).glob("*/split-*.zlc"))


def test_cached_values_equal_the_uncached_pipeline_epoch_after_epoch(tmp_path):
    uncached = prefix(tmp_path, shuffle_splits=True, seed=3)
    cached = uncached.cache(tmp_path / "cache").map(lambda e: e["name"]).batch(4)
    plain = uncached.map(lambda e: e["name"]).batch(4)
    expected = [list(uncached.iter(epoch)) for epoch in range(3)]
    names = [list(plain.iter(epoch)) for epoch in range(3)]
    (tmp_path / "calls").unlink()
    for epoch in range(3):
        assert same(cached.iter(epoch), names[epoch])
        assert same(uncached.cache(tmp_path / "cache").iter(epoch), expected[epoch])
    assert sorted(calls(tmp_path)) == list(range(N))  # the first epoch only
    assert len(entries(tmp_path / "cache")) == N // SPLIT
    arrays = next(uncached.cache(tmp_path / "cache").iter(0))
    assert not arrays["x"].flags.writeable  # read-only views over the entry


def test_fingerprint_names_the_prefix_not_the_path(tmp_path):
    a = prefix(tmp_path).cache(tmp_path / "a")
    b = prefix(tmp_path).cache(tmp_path / "b")
    assert a.fingerprint == b.fingerprint != prefix(tmp_path).fingerprint
    assert a.source.key == prefix(tmp_path).fingerprint
    other = Pipeline.range(N, split_size=SPLIT).map(lambda x: x + 1).cache(tmp_path / "a")
    assert other.source.key != a.source.key
    assert a.source.root == str(tmp_path / "a") and location("file:///x/y") == "/x/y"


def test_an_abandoned_split_leaves_nothing(tmp_path):
    pipeline = prefix(tmp_path).cache(tmp_path / "cache")
    iterator = pipeline.iter(0)
    for _ in range(SPLIT + 3):  # split 0 whole, split 1 begun
        next(iterator)
    iterator.close()
    files = sorted(p.name for p in (tmp_path / "cache").glob("*/*"))
    assert files == ["split-0.zlc"]  # no entry and no temporary file of split 1


def test_through_a_loader_the_map_runs_once_per_element_over_two_epochs_and_two_jobs(
        tmp_path):
    pipeline = prefix(tmp_path).cache(tmp_path / "cache")
    expected = sorted((canonical(e) for e in prefix(tmp_path)), key=repr)
    (tmp_path / "calls").unlink()
    with Loader(pipeline, num_workers=2, timeout=30, exactly_once=True) as loader:
        for _ in range(2):
            assert sorted((canonical(e) for e in loader), key=repr) == expected
    with Loader(pipeline, num_workers=2, timeout=30) as loader:
        assert sorted((canonical(e) for e in loader), key=repr) == expected
    assert sorted(calls(tmp_path)) == list(range(N))
    assert len(entries(tmp_path / "cache")) == N // SPLIT


def doubled(x: int) -> int:
    return 2 * x


def test_state_dict_resumes_a_cached_pipeline_mid_epoch_exactly(tmp_path):
    pipeline = Pipeline.range(600, split_size=20).map(doubled).cache(tmp_path) \
        .shuffle(50).batch(4)
    seen: list[int] = []
    with Loader(pipeline, num_workers=2, timeout=30, exactly_once=True) as loader:
        for i, batch in enumerate(loader):
            seen += np.asarray(batch).tolist()
            if i == 40:
                state = loader.state_dict()
                break
    with Loader(pipeline, num_workers=2, timeout=30, state=state) as loader:
        for batch in loader:
            seen += np.asarray(batch).tolist()
    assert sorted(seen) == list(range(0, 1200, 2))  # each once: none lost, none repeated


def blocking(folder: str, at: int):
    """``element`` that logs each call and, the first time it meets ``at``, writes its pid
    to ``folder``/blocked and waits there to be killed."""
    def make(x: int):
        with open(os.path.join(folder, "calls"), "a") as file:
            file.write(f"{x}\n")
        if x == at:
            try:
                fd = os.open(os.path.join(folder, "blocked"), os.O_CREAT | os.O_EXCL
                             | os.O_WRONLY)
            except FileExistsError:
                return element(x)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            time.sleep(60)
        return element(x)
    return make


def test_a_worker_killed_mid_write_leaves_only_complete_splits(tmp_path):
    at = 2 * SPLIT + 4  # split 2, midway
    pipeline = Pipeline.range(N, split_size=SPLIT).map(blocking(str(tmp_path), at)) \
        .cache(tmp_path / "cache")
    marker = tmp_path / "blocked"
    killed = []

    def kill() -> None:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        with pytest.raises(WorkerExited, match="SIGKILL"), \
                Loader(pipeline, num_workers=1, timeout=30) as loader:
            for _ in loader:
                pass
    finally:
        killer.join()
    assert killed
    store = Store(str(tmp_path / "cache"))
    key = pipeline.source.key
    committed = {f.split for f in store.files() if f.split is not None}
    assert 2 not in committed and committed <= {0, 1}
    assert {f.name.partition(".tmp-")[0] for f in store.files() if f.temporary} == \
        {"split-2.zlc"}  # the killed writer's leftover, ignored by readers
    for split in committed:
        frames = entry_frames(store.load(key, split), key, split)
        assert len(frames) == SPLIT  # whole
    before = calls(tmp_path)
    with Loader(pipeline, num_workers=2, timeout=30) as loader:
        got = sorted((canonical(e) for e in loader), key=repr)
    assert got == sorted((canonical(element(x)) for x in range(N)), key=repr)
    again = calls(tmp_path)[len(before):]
    assert not set(again) & {x for s in committed for x in range(s * SPLIT, (s + 1) * SPLIT)}
    assert len(entries(tmp_path / "cache")) == N // SPLIT


def test_a_truncated_or_corrupt_entry_is_recomputed_with_a_warning(tmp_path, caplog):
    pipeline = prefix(tmp_path).cache(tmp_path / "cache")
    expected = list(pipeline.iter(0))
    files = entries(tmp_path / "cache")
    files[0].write_bytes(files[0].read_bytes()[:-9])  # truncated
    data = bytearray(files[1].read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit flipped
    files[1].write_bytes(bytes(data))
    files[2].write_bytes(b"")  # empty
    files[3].write_bytes(b"not a cache entry at all, but long enough to be looked at" * 2)
    (tmp_path / "calls").unlink()
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        assert same(pipeline.iter(1), expected)
    reasons = " ".join(r.getMessage() for r in caplog.records)
    for reason in ("truncated", "checksum", "short file", "bad magic"):
        assert reason in reasons
    assert sorted(calls(tmp_path)) == list(range(4 * SPLIT))  # the four bad splits only
    key = pipeline.source.key
    for split in range(N // SPLIT):  # rewritten whole
        entry_frames(Store(str(tmp_path / "cache")).load(key, split), key, split)
    with pytest.raises(BadEntry, match="not split 1"):
        entry_frames(files[0].read_bytes(), key, 1)


def test_placements_that_mix_splits_are_refused_naming_the_stage(tmp_path):
    base = Pipeline.range(N, split_size=SPLIT)
    for pipeline, stage in [(base.shuffle(8), "shuffle(8)"), (base.batch(4), "batch(4)"),
                            (base.repeat(2), "repeat(2)"), (base.take(5), "take(5)")]:
        name = re.escape(repr(stage))
        with pytest.raises(ValueError, match=rf"stage {name} comes before \.cache\(\).*"
                                             rf"; move \.cache\(\) before {name}"):
            pipeline.cache(tmp_path)
    base.map(abs).cache(tmp_path).shuffle(8).batch(4)  # after the cache: anything
    lock = threading.Lock()
    with pytest.raises(ValueError, match=r"cannot be fingerprinted.*version="):
        base.map(lambda x: (lock, x)[1]).cache(tmp_path)
    rows = base.batch(3).unbatch(name="rows")
    with pytest.raises(ValueError, match="stage 'batch\\(3\\)'"):
        rows.cache(tmp_path)
    split_rows = Pipeline.range(12, split_size=4).map(lambda x: [x, -x]).unbatch()
    assert list(split_rows.cache(tmp_path).iter(0)) == list(split_rows.iter(0))


def test_an_element_the_codec_cannot_store_fails_naming_what_to_change(tmp_path):
    pipeline = Pipeline.range(4).map(lambda x: {"when": object()}).cache(tmp_path)
    with pytest.raises(PipelineError, match=r"cache\(range\).*never pickles.*objects=True"):
        list(pipeline)
    assert list(tmp_path.glob("*/*")) == []


def test_a_split_with_skipped_errors_is_not_committed(tmp_path):
    def fails_on_13(x):
        if x == 13:
            raise ValueError("bad")
        return x

    pipeline = Pipeline.range(N, split_size=SPLIT).map(fails_on_13).cache(tmp_path)
    with Loader(pipeline, num_workers=1, timeout=30, on_error="skip") as loader:
        assert sorted(loader) == [x for x in range(N) if x != 13]
        assert loader.stats()["skipped"] == 1
    assert sorted(p.name for p in tmp_path.glob("*/*.zlc")) == \
        sorted(f"split-{s}.zlc" for s in range(N // SPLIT) if s != 1)
    with pytest.raises(PipelineError, match="bad"):
        list(pipeline)  # the error is seen again where on_error says so


def test_cli_lists_and_removes_real_entries(tmp_path, capsys):
    root = tmp_path / "cache"
    first = Pipeline.range(N, split_size=SPLIT).map(abs).cache(root)
    second = Pipeline.range(20, split_size=SPLIT).map(str).cache(root)
    list(first)
    list(second)
    stale = root / first.source.key / "split-9.zlc.tmp-host-1-dead"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert cli.main(["cache", "ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert first.source.key in out and second.source.key in out
    listed = {s.fingerprint: s for s in summaries(Store(str(root)))}
    assert listed[first.source.key].splits == N // SPLIT
    assert listed[first.source.key].temporary == 1
    assert listed[second.source.key].splits == 2
    assert cli.main(["cache", "rm", str(root), "--stale"]) == 0
    assert not stale.exists() and len(entries(root)) == N // SPLIT + 2
    assert cli.main(["cache", "rm", str(root), "--fingerprint", second.source.key[:12]]) == 0
    assert {s.fingerprint for s in summaries(Store(str(root)))} == {first.source.key}
    assert cli.main(["cache", "rm", str(root), "--fingerprint", "zz"]) == 2
    assert cli.main(["cache", "rm", str(root), "--all"]) == 0
    assert entries(root) == []
    capsys.readouterr()
    assert cli.main(["cache", "ls", str(root), "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"
    with pytest.raises(SystemExit):
        cli.main(["cache", "rm", str(root)])  # one of --fingerprint, --all, --stale


def test_the_default_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ZLOADER_CACHE_DIR", str(tmp_path / "mine"))
    assert location() == str(tmp_path / "mine")
    monkeypatch.delenv("ZLOADER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert location() == str(tmp_path / "xdg" / "zloader" / "cache")
    assert Pipeline.range(3).cache().source.root == location()


def test_a_cache_in_object_storage_is_shared_by_workers(tmp_path, capsys):
    pytest.importorskip("s3fs")
    from test_formats_storage import BUCKET, S3Server

    server = S3Server()
    server.start()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/cache"
        pipeline = prefix(tmp_path).cache(url, storage_options=server.options)
        expected = sorted((canonical(e) for e in prefix(tmp_path)), key=repr)
        (tmp_path / "calls").unlink()
        with Loader(pipeline, num_workers=2, timeout=30) as loader:
            for _ in range(2):
                assert sorted((canonical(e) for e in loader), key=repr) == expected
        assert sorted(calls(tmp_path)) == list(range(N))
        [summary] = summaries(Store(url, server.options))
        assert summary.splits == N // SPLIT and summary.temporary == 0
        assert same(pipeline.iter(0), prefix(tmp_path).iter(0))
        assert sorted(calls(tmp_path)) == sorted([*range(N), *range(N)])  # the 2nd: uncached
        options = ["--storage-options", json.dumps(server.options)]
        assert cli.main(["cache", "ls", url, *options, "--json"]) == 0
        [listed] = json.loads(capsys.readouterr().out)
        assert listed["fingerprint"] == pipeline.source.key and listed["splits"] == N // SPLIT
        assert cli.main(["cache", "rm", url, *options, "--all"]) == 0
        capsys.readouterr()
        # in object storage a folder is there only while it holds files
        assert cli.main(["cache", "ls", url, *options]) == 2
        assert f"no cache folder at {url}" in capsys.readouterr().err
    finally:
        server.stop()


def double(x: int) -> int:
    return 2 * x


def test_a_large_in_memory_source_under_a_cache_is_served_not_pickled(tmp_path):
    """A from_arrays source over INLINE_SOURCE_BYTES under .cache(), through a broker: its
    data is fetched from the Loader (as at the top of a pipeline), not sent through the
    broker inside the pickled pipeline, and the values are right."""
    from service import start_broker, start_worker, status, stop, wait_for

    from zloader._defaults import INLINE_SOURCE_BYTES
    from zloader.client.shipment import strip_source

    table = np.arange(INLINE_SOURCE_BYTES // 8 * 2, dtype=np.int64).reshape(-1, 256)  # 2 MiB
    pipeline = (Pipeline.from_arrays(table, split_size=len(table) // 8).map(double)
                .cache(str(tmp_path / "c")))
    stripped, served = strip_source(pipeline)
    assert served is not None and served[0] == "arrays"
    assert stripped.source.innermost().structure is None
    broker, address = start_broker()
    workers = start_worker(address)
    try:
        wait_for(lambda: len((status(address, 1.0) or {}).get("workers", ())) == 1,
                 what="a worker")
        with Loader(pipeline, broker=address, timeout=60) as loader:
            for _ in range(2):  # computed and written, then read from the cache
                got = sorted((np.asarray(row).copy() for row in loader), key=lambda r: r[0])
                assert np.array_equal(np.stack(got), table * 2)
            assert loader.stats()["served"] == {"source": 1}
    finally:
        stop(workers)
        stop(broker)
