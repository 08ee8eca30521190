"""The cache in a hostile or damaged folder: what another user of a shared cache folder
plants there (symbolic links, a FIFO, entries with a valid checksum that do not decode), an
entry truncated under its reader, entries larger than the limit, and ``zloader cache`` on a
folder or fingerprint that is not there. Files are planted by a second process and the
command line runs as users run it, in a process of its own."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import numpy as np
import pytest

from tests.service import BIN
from zloader import Loader, Pipeline
from zloader.cachefile import Store

N = 40
SPLIT = 10
OLD = time.time() - 7200  # older than any --older-than used here


def zloader(*args: str) -> subprocess.CompletedProcess[str]:
    """``zloader ARGS`` in a process of its own."""
    return subprocess.run([os.path.join(BIN, "zloader"), *args], capture_output=True,
                          text=True, timeout=60)


def plant(code: str, *args: str) -> None:
    """Run ``code`` (with ``args`` as sys.argv[1:]) in a second process: another user of
    the shared folder."""
    subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], check=True,
                   timeout=30)


def tree(folder: pathlib.Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (symbolic links not followed), with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


@pytest.fixture
def shared(tmp_path: pathlib.Path) -> pathlib.Path:
    """A cache folder shared the way teams share one: mode 1777."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    return root


@pytest.fixture
def private(tmp_path: pathlib.Path) -> pathlib.Path:
    """The operator's private folder, with files named the way the cache names its own."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    (folder / "thesis.tex").write_text("years of work")
    (folder / "split-0.zlc").write_bytes(b"not a cache entry")
    temp = folder / "split-1.zlc.tmp-host-1-abcd0123"
    temp.write_bytes(b"not a temporary file either")
    os.utime(temp, (OLD, OLD))
    return folder


def test_rm_and_ls_never_follow_symlinks_planted_in_a_shared_folder(shared, private):
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs).cache(shared)
    assert sorted(pipeline) == list(range(N))
    key = pipeline.source.key
    planted = "ab" * 32  # a fingerprint-like name
    plant("""
        import os, sys
        root, key, planted, private = sys.argv[1:]
        os.symlink(private, os.path.join(root, planted))
        temp = ".zlc.tmp-host-1-abcd0123"
        for name, target in [("split-9.zlc", "split-0.zlc"),
                             ("split-8" + temp, "split-1" + temp)]:
            link = os.path.join(root, key, name)
            os.symlink(os.path.join(private, target), link)
            os.utime(link, (0, 0), follow_symlinks=False)
        with open(os.path.join(root, key, "notes.txt"), "w") as file:
            file.write("not the cache's")
    """, str(shared), key, planted, str(private))
    before = tree(private)

    listed = zloader("cache", "ls", str(shared), "--json")
    assert listed.returncode == 0, listed.stderr
    assert '"splits": 4' in listed.stdout and planted not in listed.stdout
    assert '"temporary": 0' in listed.stdout  # the planted temporary-like link is not counted

    stale = zloader("cache", "rm", str(shared), "--stale", "--older-than", "1")
    assert stale.returncode == 0, stale.stderr
    by_planted = zloader("cache", "rm", str(shared), "--fingerprint", planted[:8])
    assert by_planted.returncode != 0 and planted[:8] in by_planted.stderr
    assert tree(private) == before
    everything = zloader("cache", "rm", str(shared), "--all")
    assert everything.returncode == 0, everything.stderr
    assert "removed 4 files" in everything.stdout

    assert tree(private) == before  # nothing of the operator's was touched
    assert (shared / planted).is_symlink()
    left = sorted(p.name for p in (shared / key).iterdir())
    assert left == ["notes.txt", "split-8.zlc.tmp-host-1-abcd0123", "split-9.zlc"]


def test_a_fifo_named_like_an_entry_is_recomputed_not_waited_on(tmp_path, caplog):
    root = tmp_path / "cache"
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs).cache(root)
    expected = list(pipeline.iter(0))
    entry = root / pipeline.source.key / "split-1.zlc"
    plant("import os, sys; os.unlink(sys.argv[1]); os.mkfifo(sys.argv[1])", str(entry))
    got: list[int] = []
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        reader = threading.Thread(target=lambda: got.extend(pipeline.iter(0)), daemon=True)
        reader.start()
        reader.join(30)
        if reader.is_alive():  # release it (a writer's open ends its wait), then fail
            os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(30)
            pytest.fail("reading the cache waited on a FIFO named like an entry")
    assert got == expected
    warned = [r.getMessage() for r in caplog.records if str(entry) in r.getMessage()]
    assert warned and "not a regular file" in warned[0]
    assert stat.S_ISREG(entry.lstat().st_mode)  # the entry was written again, as a file


def test_a_fifo_named_like_an_entry_does_not_stall_a_loader(tmp_path):
    root = tmp_path / "cache"
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs).cache(root)
    key = pipeline.source.key
    (root / key).mkdir(parents=True)
    plant("import os, sys; os.mkfifo(sys.argv[1])", str(root / key / "split-2.zlc"))
    with Loader(pipeline, num_workers=1, timeout=20) as loader:
        assert sorted(loader) == list(range(N))
    assert stat.S_ISREG((root / key / "split-2.zlc").lstat().st_mode)


def test_links_named_like_a_folder_or_an_entry_are_not_followed_when_reading(tmp_path,
                                                                            caplog):
    elsewhere, shared, other = tmp_path / "elsewhere", tmp_path / "shared", tmp_path / "other"
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs)
    key = pipeline.cache(elsewhere).source.key
    list(pipeline.cache(elsewhere))
    before = tree(elsewhere)
    shared.mkdir()
    (other / key).mkdir(parents=True)
    plant("""
        import os, sys
        elsewhere, shared, other, key = sys.argv[1:]
        os.symlink(os.path.join(elsewhere, key), os.path.join(shared, key))
        os.symlink(os.path.join(elsewhere, key, "split-0.zlc"),
                   os.path.join(other, key, "split-0.zlc"))
    """, str(elsewhere), str(shared), str(other), key)
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        assert list(pipeline.cache(shared).iter(0)) == list(range(N))
        assert list(pipeline.cache(other).iter(0)) == list(range(N))
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(shared / key) in m and "symbolic link" in m for m in messages)
    assert any(str(other / key / "split-0.zlc") in m and "symbolic link" in m
               for m in messages)
    assert tree(elsewhere) == before  # neither read through nor written through
    assert (shared / key).is_symlink()  # the split was read uncached
    assert not (other / key / "split-0.zlc").is_symlink()  # replaced by the entry


def crafted(index: int):
    """The element of split ``index``: a long bytes value, a short str and an array whose
    encodings the test then alters (a tag, the text, the shape)."""
    return [{"pickled": b"P" * 2000}, {"text": "caf\u00e9!"},
            {"array": np.zeros(12345, np.uint8)}][index]


def recrc(data: bytes) -> bytes:
    """``data`` (an entry) with its trailer's checksum made right again (the trailer is
    ``END count:u64 body:u64 crc32:u32``, zloader/cachefile.py)."""
    trailer = struct.Struct("<8sQQI")
    end, count, body, _ = trailer.unpack_from(data, len(data) - trailer.size)
    return data[:body] + trailer.pack(end, count, body, zlib.crc32(data[:body]))


def test_entries_with_a_valid_checksum_that_do_not_decode_are_recomputed(tmp_path, caplog):
    root = tmp_path / "cache"
    pipeline = Pipeline.range(3, split_size=1).map(crafted).cache(root)
    expected = list(pipeline.iter(0))
    key = pipeline.source.key
    changes = [(b"pickledB", b"pickledo"),  # a pickled node
               ("caf\u00e9".encode(), b"caf\xff\xfe"),  # not UTF-8
               (b"\x01" + struct.pack("<Q", 12345),  # ndim 1, then the shape
                b"\x01" + struct.pack("<Q", 1 << 40))]  # a 1 TiB array
    paths = [root / key / f"split-{split}.zlc" for split in range(3)]
    for path, (old, new) in zip(paths, changes, strict=True):
        data = path.read_bytes()
        assert data.count(old) == 1
        path.write_bytes(recrc(data.replace(old, new)))
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        got = list(pipeline.iter(0))
    assert [list(e) for e in got] == [list(e) for e in expected]
    assert got[0]["pickled"] == expected[0]["pickled"] and got[1] == expected[1]
    assert np.array_equal(got[2]["array"], expected[2]["array"])
    messages = [r.getMessage() for r in caplog.records]
    for path, reason in zip(paths, ["pickled", "UTF-8", "needs 1099511627776 bytes"],
                            strict=True):
        assert any(str(path) in m and reason in m for m in messages), (path, messages)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        assert len(list(pipeline.iter(0))) == 3
    assert not caplog.records  # rewritten whole


READER = """
import os, sys, time
import numpy as np
from zloader import Pipeline

root, started, truncated = sys.argv[1:]
pipeline = Pipeline.range(8, split_size=8).map(
    lambda i: np.full((1 << 20) // 8, i, np.float64)).cache(root)
list(pipeline)  # written
elements = pipeline.iter(0)  # read back
first = next(elements)
open(started, "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(truncated) and time.monotonic() < deadline:
    time.sleep(0.01)
sums = [float(first.sum())] + [float(e.sum()) for e in elements]
print(sums == [i * (1 << 20) / 8 for i in range(8)])
"""


def test_an_entry_truncated_while_it_is_read_does_not_kill_the_reader(tmp_path):
    root = tmp_path / "cache"
    started, truncated = tmp_path / "started", tmp_path / "truncated"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(root), str(started),
                               str(truncated)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and reader.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started.exists(), "the reader did not start"
        [entry] = root.glob("*/split-0.zlc")
        os.truncate(entry, 100)  # another process cuts the entry under the reader
        truncated.touch()
        out, _ = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, f"the reader died: {reader.returncode}"
    assert out.strip() == "True"  # it read the entry as it was when it opened it


def test_an_entry_larger_than_the_limit_is_refused_without_reading_it(tmp_path, caplog):
    root = tmp_path / "cache"
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs).cache(root)
    entry = root / pipeline.source.key / "split-0.zlc"
    entry.parent.mkdir(parents=True)
    with open(entry, "wb") as file:  # 64 GiB, sparse: it costs no disk
        file.truncate(64 << 30)
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        assert list(pipeline.iter(0)) == list(range(N))
    [message] = [r.getMessage() for r in caplog.records if str(entry) in r.getMessage()]
    assert "max_entry_bytes" in message
    assert entry.stat().st_size < 4096  # written again, small


def test_a_split_larger_than_max_entry_bytes_is_read_uncached(tmp_path, caplog):
    root = tmp_path / "cache"

    def kib(x: int) -> bytes:
        return bytes([x]) * 1024

    small = Pipeline.range(N, split_size=SPLIT).map(kib).cache(root, max_entry_bytes=4096)
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        assert list(small.iter(0)) == [kib(x) for x in range(N)]
    assert list(root.glob("*/*")) == []  # no entry, and no temporary file left
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "max_entry_bytes" in messages and "4096" in messages
    large = Pipeline.range(N, split_size=SPLIT).map(kib).cache(root)
    assert large.fingerprint == small.fingerprint  # the limit is not part of the key
    assert list(large.iter(0)) == [kib(x) for x in range(N)]
    assert len(list(root.glob("*/split-*.zlc"))) == N // SPLIT
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        assert list(small.iter(0)) == [kib(x) for x in range(N)]  # over its limit: computed
    assert "max_entry_bytes" in " ".join(r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="max_entry_bytes"):
        Pipeline.range(4).cache(root, max_entry_bytes=0)


def test_a_frame_claiming_more_than_the_file_holds_is_refused(tmp_path, caplog):
    root = tmp_path / "cache"
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs).cache(root)
    list(pipeline)
    entry = root / pipeline.source.key / "split-3.zlc"
    data = entry.read_bytes()
    start = data.index(b"ZLCACHE") + struct.calcsize("<7sBQH") + 64
    frame = struct.pack("<IQ", 1, 1 << 62)  # one buffer of 4 EiB
    entry.write_bytes(recrc(data[:start] + frame + data[start + len(frame):]))
    with caplog.at_level(logging.WARNING, logger="zloader.cache"):
        assert list(pipeline.iter(0)) == list(range(N))
    assert any(str(entry) in r.getMessage() and "overruns" in r.getMessage()
               for r in caplog.records)


@pytest.mark.slow  # (about 7-10 s; the suite keeps under 6 min on 2 cores)
def test_cli_on_a_missing_folder_or_fingerprint_fails_naming_it(tmp_path):
    missing = tmp_path / "no-such-cache"
    for args in (["ls"], ["rm", "--all"], ["rm", "--fingerprint", "ab12"]):
        done = zloader("cache", args[0], str(missing), *args[1:])
        assert done.returncode != 0, (args, done.stdout)
        assert str(missing) in done.stderr and "removed" not in done.stdout
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    done = zloader("cache", "ls", str(a_file))
    assert done.returncode != 0 and str(a_file) in done.stderr
    root = tmp_path / "cache"
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs).cache(root)
    list(pipeline)
    done = zloader("cache", "rm", str(root), "--fingerprint", "0123abcd")
    assert done.returncode != 0 and "0123abcd" in done.stderr and str(root) in done.stderr
    assert len(Store(str(root)).files()) == N // SPLIT  # nothing removed
    done = zloader("cache", "rm", str(root), "--fingerprint", pipeline.source.key[:10])
    assert done.returncode == 0 and f"removed {N // SPLIT} files" in done.stdout
    done = zloader("cache", "ls", str(root))  # the folder is there, with nothing in it
    assert done.returncode == 0 and "no cache entries" in done.stdout


SPARSE_READER = """
import json, resource, sys
from zloader import Pipeline

pipeline = Pipeline.range(40, split_size=10).map(abs).cache(sys.argv[1])


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


baseline = peak()
got = list(pipeline.iter(0))
print(json.dumps({"growth": peak() - baseline, "good": got == list(range(40))}))
"""


def test_planted_sparse_entries_are_refused_from_their_ends_without_reading_them(tmp_path):
    root = tmp_path / "cache"
    pipeline = Pipeline.range(N, split_size=SPLIT).map(abs).cache(root)
    folder = root / pipeline.source.key
    folder.mkdir(parents=True)
    head = struct.pack("<7sBQH", b"ZLCACHE", 1, 3, 64) + pipeline.source.key.encode()
    for split in range(N // SPLIT):  # 512 MiB each, under max_entry_bytes; no disk taken
        with open(folder / f"split-{split}.zlc", "wb") as file:
            if split == 3:  # a right header, then holes and no trailer
                file.write(head)
            file.truncate(512 << 20)
    done = subprocess.run([sys.executable, "-c", SPARSE_READER, str(root)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["good"], done.stderr[-2000:]
    assert result["growth"] < 64 << 20, result  # the old reader read each whole: 512 MiB
    assert done.stderr.count("not a cache entry (bad magic)") == 3, done.stderr[-2000:]
    assert "split-3.zlc: truncated or unfinished" in done.stderr, done.stderr[-2000:]
    assert all(p.stat().st_size < 4096 for p in folder.iterdir())  # computed and rewritten
