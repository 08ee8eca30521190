"""Damaged and hostile files read by the format sources.

One bad element costs that element only: under ``on_error="skip"`` it is counted and the
reader goes on with the next line, record, sample or image; without it, the error names
the file and the place. No file makes a reader allocate what it only claims: each hostile
file is read in a child process whose peak memory is measured (a "does not blow up"
bound, far above what the read needs and far below what the file claims).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import re
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zlib

import pytest

from zloader import Loader, Pipeline, PipelineError
from zloader import storage as _storage
from zloader._defaults import MAX_IMAGE_PIXELS
from zloader.errors import CodecError
from zloader.formats import decode_image
from zloader.formats._crc32c import masked_crc32c
from zloader.runs import Context, RunSettings

MiB = 1 << 20
GROWTH_BOUND = 300 * MiB
"""Memory a hostile file may add to a reader's peak: the files below claim 512 MiB to 1 GiB
(and the 2**40 to 2**63 of the TFRecord lengths)."""


def policy() -> Context:
    """A run's context as a source sees it, skipping errors."""
    return Context(RunSettings(entropy=0, skip_errors=True))


def loader_read(pipeline: Pipeline) -> tuple[list, int]:
    """Everything two workers read under on_error="skip", and the skips they counted."""
    with Loader(pipeline, num_workers=2, on_error="skip", timeout=60) as loader:
        out = list(loader)
        return out, loader.stats()["skipped"]


PEAK = r"""
import json, resource, sys
import PIL.Image  # imported before the baseline, as the readers' other modules
from zloader import Pipeline
from zloader.formats import decode_image

kind, path = sys.argv[1], sys.argv[2]
read = {
    "webdataset": lambda: list(Pipeline.from_webdataset([path])),
    "jsonl": lambda: list(Pipeline.from_jsonl([path])),
    "tfrecord-gzip": lambda: list(Pipeline.from_tfrecord([path], "GZIP")),
    "tfrecord-zlib": lambda: list(Pipeline.from_tfrecord([path], "ZLIB")),
    "image": lambda: decode_image(open(path, "rb").read()),
}[kind]


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


baseline = peak()
try:
    read()
    error = None
except Exception as exc:
    error = {"type": type(exc).__name__, "exc_type": getattr(exc, "exc_type", ""),
             "message": str(exc).split("\n")[0]}
print(json.dumps({"growth": peak() - baseline, "error": error}))
"""


def peak_read(kind: str, path) -> dict:
    """Read ``path`` as ``kind`` in a child process: how much its peak memory grew, and the
    error it met."""
    done = subprocess.run([sys.executable, "-c", PEAK, kind, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ERRORS = r"""
import json, sys
from zloader import Pipeline

errors = {}
for path in sys.argv[1:]:
    try:
        list(Pipeline.from_webdataset([path]))
        errors[path] = None
    except Exception as exc:
        errors[path] = {"exc_type": exc.exc_type, "message": str(exc).split("\n")[0]}
print(json.dumps(errors))
"""


def read_errors(paths: list, timeout: float = 30) -> dict:
    """Read each shard of ``paths`` in a child process (a read that hangs fails the test
    after ``timeout`` seconds, and the child is killed): the error each met, by path."""
    done = subprocess.run([sys.executable, "-c", ERRORS, *map(str, paths)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def zeros_gzip(mebibytes: int) -> bytes:
    """``mebibytes`` MiB of zeros, gzipped: one member per MiB, as ``cat`` joins gzip files
    (a member of 1 MiB of zeros is about 1 KiB)."""
    return gzip.compress(b"\0" * MiB, compresslevel=9) * mebibytes


# --- JSON lines ----------------------------------------------------------------------------

def jsonl_lines(count: int = 1000) -> list[bytes]:
    return [json.dumps({"i": i, "text": "x" * (i % 7)}).encode() for i in range(count)]


def test_a_bad_jsonl_line_costs_that_line_only(tmp_path):
    lines = jsonl_lines()
    not_utf8, deep = list(lines), list(lines)
    not_utf8[4] = b'{"text": "caf\xe9"}'  # latin-1, not UTF-8
    deep[2] = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(not_utf8) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(b"\n".join(deep) + b"\n")
    good_a = [json.loads(x) for i, x in enumerate(lines) if i != 4]
    good_b = [json.loads(x) for i, x in enumerate(lines) if i != 2]
    for name, good, line in (("a.jsonl", good_a, 5), ("b.jsonl", good_b, 3)):
        pipeline = Pipeline.from_jsonl([tmp_path / name])
        run = policy()
        assert list(pipeline.source.read(0, run)) == good
        assert run.tally.skipped == 1
        with pytest.raises(PipelineError, match=rf"{name}: line {line} ") as info:
            list(pipeline)
        assert info.value.context == f"file {tmp_path / name}, line {line}"
    out, skipped = loader_read(Pipeline.from_jsonl(str(tmp_path / "*.jsonl")))
    assert sorted(out, key=lambda r: r["i"]) == sorted(good_a + good_b, key=lambda r: r["i"])
    assert skipped == 2


def test_a_jsonl_line_over_the_limit_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "bomb.jsonl.gz"  # 512 KiB holding a line of 512 MiB
    path.write_bytes(gzip.compress(b'{"i": 0}\n"') + zeros_gzip(512)
                     + gzip.compress(b'"\n{"i": 2}\n'))
    result = peak_read("jsonl", path)
    assert result["growth"] < GROWTH_BOUND, result
    assert result["error"]["exc_type"] == "zloader.errors.CodecError"
    assert "bomb.jsonl.gz: line 2 is longer than max_line_bytes=16777216" in \
        result["error"]["message"]
    small = tmp_path / "small.jsonl.gz"  # the same lines, with 1 MiB between the quotes
    small.write_bytes(gzip.compress(b'{"i": 0}\n"') + zeros_gzip(1)
                      + gzip.compress(b'"\n{"i": 2}\n'))
    run = policy()
    source = Pipeline.from_jsonl([small], max_line_bytes=64).source
    assert list(source.read(0, run)) == [{"i": 0}, {"i": 2}]
    assert run.tally.skipped == 1


# --- image folders and decode_image --------------------------------------------------------

@pytest.fixture(scope="module")
def bomb_png(tmp_path_factory) -> bytes:
    """A 12000 x 12000 one-bit PNG as Pillow writes it: 17 KiB that decode to 144 million
    pixels (over MAX_IMAGE_PIXELS, under the size at which Pillow itself refuses)."""
    image_module = pytest.importorskip("PIL.Image")
    out = io.BytesIO()
    image_module.new("1", (12000, 12000)).save(out, "PNG")
    return out.getvalue()


def png(value: int) -> bytes:
    image_module = pytest.importorskip("PIL.Image")
    out = io.BytesIO()
    image_module.new("RGB", (32, 24), (value, 255 - value, 7)).save(out, "PNG")
    return out.getvalue()


def test_decode_image_refuses_a_bomb_from_its_header_and_raises_value_errors(tmp_path,
                                                                               bomb_png):
    assert MAX_IMAGE_PIXELS < 12000 * 12000
    (tmp_path / "bomb.png").write_bytes(bomb_png)
    result = peak_read("image", tmp_path / "bomb.png")
    assert result["growth"] < GROWTH_BOUND, result
    assert result["error"]["type"] == "ValueError"
    assert "12000 x 12000 = 144000000 pixels, more than max_pixels=" in \
        result["error"]["message"]
    truncated = png(3)[:-30]
    with pytest.raises(ValueError, match=r"decode_image: cannot decode the image \(OSError"):
        decode_image(truncated)
    assert decode_image(png(3), max_pixels=32 * 24).shape == (24, 32, 3)
    with pytest.raises(ValueError, match="more than max_pixels=767"):
        decode_image(png(3), max_pixels=32 * 24 - 1)


@pytest.mark.filterwarnings("ignore:Image size .* could be decompression bomb")
def test_a_bad_image_costs_that_image_only(tmp_path, bomb_png):
    root = tmp_path / "root"
    paths = []
    for i in range(12):
        path = root / ("a" if i < 6 else "b") / f"{i:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png(i))
        paths.append(str(path))
    (root / "a" / "03.png").write_bytes(png(3)[:-30])  # truncated
    (root / "b" / "08.png").write_bytes(bomb_png)
    pipeline = Pipeline.from_image_folder(root, split_size=6, decode=True)
    good = [p for i, p in enumerate(paths) if i not in (3, 8)]
    run = policy()
    out = [e for split in range(2) for e in pipeline.source.read(split, run)]
    assert [e["path"] for e in out] == good
    assert run.tally.skipped == 2
    with pytest.raises(PipelineError, match=r"03\.png: decode_image: cannot decode") as info:
        list(pipeline)
    assert info.value.context == f"image {paths[3]}"
    out, skipped = loader_read(pipeline)
    assert sorted(e["path"] for e in out) == good
    assert skipped == 2


# --- WebDataset ----------------------------------------------------------------------------

def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def add_sparse_member(tar: tarfile.TarFile, name: str, size: int) -> None:
    """A member of ``size`` bytes, all holes but its last byte, as ``tar --sparse
    --format=pax`` writes it (GNU sparse format 1.0): a few hundred bytes in the shard."""
    sparse_map = f"1\n{size - 1}\n1\n".encode()
    body = sparse_map.ljust(512, b"\0") + b"x"
    info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
    info.size = len(body)
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                        "GNU.sparse.name": name, "GNU.sparse.realsize": str(size)}
    tar.addfile(info, io.BytesIO(body))


def test_a_sample_with_a_huge_sparse_member_costs_that_sample_only(tmp_path):
    shard = tmp_path / "shard.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        add_member(tar, "s0.txt", b"zero")
        add_member(tar, "s1.txt", b"one")
        add_sparse_member(tar, "s1.bin", 1 << 30)
        add_member(tar, "s2.txt", b"two")
        add_member(tar, "s2.cls", b"2")
        add_member(tar, "s2.cls", b"again")  # a repeated extension
        add_member(tar, "s3.txt", b"three")
    assert shard.stat().st_size < 16 << 10
    result = peak_read("webdataset", shard)
    assert result["growth"] < GROWTH_BOUND, result
    assert result["error"]["exc_type"] == "zloader.errors.CodecError"
    assert "shard.tar: member 's1.bin' is 1073741824 bytes, more than max_member_bytes=" \
        in result["error"]["message"]
    pipeline = Pipeline.from_webdataset([shard])
    run = policy()
    assert [s["__key__"] for s in pipeline.source.read(0, run)] == ["s0", "s3"]
    assert run.tally.skipped == 2
    out, skipped = loader_read(pipeline)
    assert sorted(s["txt"] for s in out) == [b"three", b"zero"]
    assert skipped == 2


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE, pax: dict | None = None,
           form: int = tarfile.GNU_FORMAT) -> bytes:
    """A tar header claiming ``size`` bytes (GNU base-256 past 8 GiB), with no data."""
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    if pax:
        info.pax_headers = pax
    return info.tobuf(format=form)


def member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    """A whole member: its header and its data."""
    return header(name, len(data), kind, form=tarfile.USTAR_FORMAT) + data \
        + bytes(-len(data) % 512)


def pax_record(key: str, value: str) -> bytes:
    """One PAX record, ``"%d %s=%s\\n"``, its length counting itself."""
    body = f" {key}={value}\n".encode()
    length = len(body)
    while length != len(body) + len(str(length)):
        length = len(body) + len(str(length))
    return str(length).encode() + body


def one_gzip(*parts: bytes | int) -> bytes:
    """``parts`` (bytes, or an int: that many MiB of zeros) compressed as one gzip member,
    the way ``tar -z`` writes a shard."""
    compress = zlib.compressobj(1, wbits=31)
    out = []
    for part in parts:
        for piece in [bytes(MiB)] * part if isinstance(part, int) else [part]:
            out.append(compress.compress(piece))
    return b"".join(out) + compress.flush()


def ten() -> bytes:
    """A shard of ten samples s0..s9, one member each, as tarfile writes it."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(10):
            add_member(tar, f"s{i}.cls", b"%d" % i)
    return out.getvalue()


def test_a_member_stored_past_the_shard_ends_it_at_once_not_after_hours(tmp_path):
    claim = 1 << 44  # 16 TiB: tarfile skipped it a 10 KiB block at a time, for hours
    tail = b"".join(member(f"s{i}.cls", b"%d" % i) for i in range(2, 6)) + bytes(1024)
    shards = {
        "pax.tar": header("s1.bin", 10, pax={"size": str(claim)}, form=tarfile.PAX_FORMAT)
        + b"x" * 10 + bytes(502),
        "file.tar": header("s1.bin", claim),
        "folder.tar": header("s1", claim, tarfile.DIRTYPE),  # folders store nothing
        "volume.tar": header("s1.bin", claim, b"V"),  # a type tarfile skips by its size
    }
    for name, hostile in shards.items():
        (tmp_path / name).write_bytes(member("s0.cls", b"0") + hostile + tail)
    inflated = member("s0.cls", b"0") + header("s1.bin", 1 << 40) + tail
    (tmp_path / "claim.tar.gz").write_bytes(gzip.compress(inflated))
    errors = read_errors([tmp_path / name for name in [*shards, "claim.tar.gz"]])
    for name in shards:
        error = errors[str(tmp_path / name)]
        assert error["exc_type"] == "zloader.formats.webdataset.CorruptShard"
        assert re.search(rf"{name}: member 's1(\.bin)?' \(header at offset 1024\) claims "
                         rf"{claim} bytes from offset (1536|2560), past the end of the shard "
                         rf"\({(tmp_path / name).stat().st_size} bytes\)", error["message"])
    error = errors[str(tmp_path / "claim.tar.gz")]
    assert error["exc_type"] == "zloader.formats.webdataset.CorruptShard"
    assert "claim.tar.gz: member 's1.bin' (header at offset 1024) claims 1099511627776 " \
           "bytes, more than max_member_bytes=268435456, and in a compressed shard" in \
        error["message"]
    (tmp_path / "good.tar").write_bytes(ten())
    pipeline = Pipeline.from_webdataset([tmp_path / "good.tar", tmp_path / "pax.tar"])
    out, skipped = loader_read(pipeline)  # the hostile shard is one skip, not a Timeout
    # (its sample s0, whose every member came before the forged header of s1's, first)
    assert sorted(s["cls"] for s in out) == sorted([b"0"] + [b"%d" % i for i in range(10)])
    assert skipped == 1


def test_a_member_over_max_member_bytes_costs_its_sample_unless_skipping_means_inflating(
        tmp_path):
    data = member("s0.cls", b"0") + member("s1.bin", b"x" * 5000) + member("s2.cls", b"2")
    (tmp_path / "plain.tar").write_bytes(data + bytes(1024))
    (tmp_path / "packed.tar.gz").write_bytes(gzip.compress(data + bytes(1024)))
    run = policy()
    source = Pipeline.from_webdataset([tmp_path / "plain.tar"], max_member_bytes=4096).source
    assert [s["__key__"] for s in source.read(0, run)] == ["s0", "s2"]
    assert run.tally.skipped == 1
    packed = Pipeline.from_webdataset([tmp_path / "packed.tar.gz"], max_member_bytes=4096)
    with pytest.raises(PipelineError, match=r"packed\.tar\.gz: member 's1\.bin' \(header at "
                                            r"offset 1024\) claims 5000 bytes, more than "
                                            r"max_member_bytes=4096") as info:
        list(packed)
    assert info.value.exc_type == "zloader.formats.webdataset.CorruptShard"
    assert [s["__key__"] for s in Pipeline.from_webdataset([tmp_path / "packed.tar.gz"])] \
        == ["s0", "s1", "s2"]  # under the default limit


def test_a_shard_that_does_not_end_as_an_archive_does_is_an_error_not_a_short_read(
        tmp_path):
    good = ten()
    flipped = bytearray(good)
    flipped[3 * 1024 + 100] ^= 0xFF  # member 3's header: a bad checksum
    lone = bytearray(good)
    lone[5 * 1024:5 * 1024 + 512] = bytes(512)  # member 5's header: a zero block
    cases = {
        "flipped.tar": (bytes(flipped), r"the header at offset 3072 is damaged \(bad "
                                        r"checksum\)", 2),
        "cut.tar": (good[:3 * 1024 + 100], r"the header at offset 3072 is damaged \("
                                           r"truncated, 100 bytes\)", 2),
        "lone.tar": (bytes(lone), r"the archive ends at offset 5120 \(a zero block\) but "
                                  r"data follows at offset 5632", 4),
        "joined.tar": (good + good, rf"the archive ends at offset 10240 \(a zero block\) "
                                    rf"but data follows at offset {len(good)}", 9),
    }
    for name, (data, message, kept) in cases.items():
        (tmp_path / name).write_bytes(data)
        pipeline = Pipeline.from_webdataset([tmp_path / name])
        with pytest.raises(PipelineError, match=rf"{name}: {message}") as info:
            list(pipeline)
        assert info.value.exc_type == "zloader.formats.webdataset.CorruptShard"
        run = policy()  # the samples before the damage, then one skip for the rest
        assert [s["cls"] for s in pipeline.source.read(0, run)] == \
            [b"%d" % i for i in range(kept)], name
        assert run.tally.skipped == 1
    ends = {"padded.tar": good + bytes(8192), "no-end.tar": good[:10 * 1024],
            "pieces.tar.gz": gzip.compress(good[:2048]) + gzip.compress(good[2048:])}
    for name, data in ends.items():  # an end, or a gzip in pieces (cat a.gz b.gz, bgzip)
        (tmp_path / name).write_bytes(data)
        assert [s["cls"] for s in Pipeline.from_webdataset([tmp_path / name])] == \
            [b"%d" % i for i in range(10)], name
    out, skipped = loader_read(Pipeline.from_webdataset(
        [tmp_path / "flipped.tar", tmp_path / "padded.tar"]))
    assert sorted(s["cls"] for s in out) == sorted([b"0", b"1"] + [b"%d" % i for i in
                                                                   range(10)])
    assert skipped == 1


def test_extended_headers_over_the_limit_end_the_shard_without_reading_them(tmp_path):
    for kind, name in ((tarfile.XHDTYPE, "pax"), (tarfile.GNUTYPE_LONGNAME, "longname")):
        path = tmp_path / f"{name}.tar.gz"  # 2.3 MiB whose header claims 512 MiB
        path.write_bytes(one_gzip(member("s0.cls", b"0") + header("x", 512 * MiB, kind), 512,
                                  member("s1.cls", b"1") + bytes(1024)))
        result = peak_read("webdataset", path)
        assert result["growth"] < GROWTH_BOUND, result
        assert result["error"]["exc_type"] == "zloader.formats.webdataset.CorruptShard"
        assert f"{name}.tar.gz: the headers of the member at offset 1024 take more than " \
               "1048576 bytes (MAX_TAR_HEADER_BYTES" in result["error"]["message"]
    records = b"4 a\n" * (16 << 10) + b"6 a=b\n"  # no "=": tarfile's parser went quadratic
    path = tmp_path / "records.tar"
    path.write_bytes(header("h", len(records), tarfile.XHDTYPE) + records
                     + bytes(-len(records) % 512) + member("s0.cls", b"0") + bytes(1024))
    with pytest.raises(PipelineError, match=r"records\.tar: the PAX header at offset 0: "
                                            r"the record at byte 0 is malformed"):
        list(Pipeline.from_webdataset([path]))
    path = tmp_path / "globals.tar"  # global headers: their keys add up for the whole shard
    path.write_bytes(b"".join(member(f"g{i}", pax_record(f"k{i}", "v" * (200 << 10)),
                                     tarfile.XGLTYPE) + member(f"s{i}.cls", b"%d" % i)
                              for i in range(8)) + bytes(1024))
    with pytest.raises(PipelineError, match=r"globals\.tar: the global PAX headers up to "
                                            r"offset \d+ take more than 1048576 bytes"):
        list(Pipeline.from_webdataset([path]))


# --- TFRecord ------------------------------------------------------------------------------

def framed(data: bytes) -> bytes:
    """One record as TensorFlow's writer frames it."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


def claimed(length: int) -> bytes:
    """A record header claiming ``length`` bytes, with the checksum a writer would give it."""
    header = struct.pack("<Q", length)
    return header + struct.pack("<I", masked_crc32c(header))


@pytest.mark.parametrize("length", [2 ** 63, 2 ** 62, 2 ** 40])
def test_a_tfrecord_length_over_the_limit_is_a_corrupt_record(tmp_path, length):
    path = tmp_path / "claims.tfrecord"
    path.write_bytes(framed(b"first") + claimed(length) + b"\0" * 64)
    with pytest.raises(PipelineError, match=r"claims\.tfrecord: record at offset 21 claims "
                                            rf"{length} bytes, more than max_record_bytes=") \
            as info:
        list(Pipeline.from_tfrecord([path], verify=False))
    assert info.value.exc_type == "zloader.formats.tfrecord.CorruptRecord"
    run = policy()
    assert list(Pipeline.from_tfrecord([path]).source.read(0, run)) == [b"first"]
    assert run.tally.skipped == 1


def test_a_compressed_tfrecord_claiming_a_huge_record_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "bomb.tfrecord.gz"  # 512 KiB holding a record of 512 MiB
    path.write_bytes(gzip.compress(framed(b"first") + claimed(512 * MiB))
                     + zeros_gzip(512) + gzip.compress(b"\0" * 4))
    result = peak_read("tfrecord-gzip", path)
    assert result["growth"] < GROWTH_BOUND, result
    assert result["error"]["exc_type"] == "zloader.formats.tfrecord.CorruptRecord"
    assert f"claims {512 * MiB} bytes, more than max_record_bytes=" in \
        result["error"]["message"]
    source = Pipeline.from_tfrecord([path], "GZIP", max_record_bytes=1024 * MiB).source
    assert source.max_record_bytes == 1024 * MiB


def test_a_zlib_tfrecord_inflates_a_block_at_a_time(tmp_path):
    path = tmp_path / "bomb.tfrecord.zlib"  # 96 MiB in about 400 KiB, one read block
    compress = zlib.compressobj(1)
    parts = [compress.compress(framed(b"first") + claimed(2 ** 40))]
    parts += [compress.compress(b"\0" * MiB) for _ in range(96)]
    path.write_bytes(b"".join(parts) + compress.flush())
    result = peak_read("tfrecord-zlib", path)
    assert result["growth"] < GROWTH_BOUND // 6, result  # the old reader inflated it whole
    assert f"claims {2 ** 40} bytes" in result["error"]["message"]
    records = [framed(b"first"), framed(bytes(range(256)) * (12 << 10)), framed(b"last")]
    path.write_bytes(zlib.compress(b"".join(records), 9))  # a block inflates to 3 MiB
    assert list(Pipeline.from_tfrecord([path], "ZLIB")) == \
        [b"first", bytes(range(256)) * (12 << 10), b"last"]


# --- Parquet -------------------------------------------------------------------------------

def test_a_parquet_footer_that_does_not_parse_is_corrupt_at_once(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"a": list(range(100))}), path)
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer
    data[start:start + 20] = bytes(b ^ 0xFF for b in data[start:start + 20])
    path.write_bytes(bytes(data))
    with pytest.raises(CodecError, match=r"from_parquet: .*bad\.parquet is corrupt or not a "
                                         r"Parquet file: its footer cannot be read") as info:
        Pipeline.from_parquet([path])
    assert "attempts" not in str(info.value)


# --- storage that does not answer ----------------------------------------------------------

class Silent:
    """A loopback TCP server that accepts connections and never answers."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.05)
        self.port = self.server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self.server.accept()
            except TimeoutError:
                continue
            self.accepted.append(connection)

    def close(self) -> None:
        """Stop listening and drop every connection: clients then fail at once."""
        self.stop.set()
        self.thread.join(5)
        self.server.close()
        for connection in self.accepted:
            connection.close()


def test_a_url_that_does_not_answer_is_named_in_a_warning_while_the_build_waits(
        caplog, monkeypatch):
    pytest.importorskip("aiohttp")
    pytest.importorskip("fsspec")
    monkeypatch.setattr(_storage, "STORAGE_WAIT_WARNING", 0.2)
    monkeypatch.setattr(_storage, "STORAGE_WAIT_REPEAT", 0.3)
    server = Silent()
    url = f"http://127.0.0.1:{server.port}/data/part-0.jsonl"
    failure: list[BaseException] = []

    def build() -> None:
        try:
            Pipeline.from_jsonl(url)
        except BaseException as exc:
            failure.append(exc)

    builder = threading.Thread(target=build, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="zloader.storage"):
            builder.start()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                warnings = [r.getMessage() for r in caplog.records
                            if r.name == "zloader.storage"]
                if len(warnings) >= 2:
                    break
                time.sleep(0.05)
    finally:
        server.close()
        builder.join(60)
    assert not builder.is_alive()
    assert len(warnings) >= 2, warnings  # a first warning, then a repeated one
    assert warnings[0].startswith(f"still waiting to stat {url} after ")
    assert "storage_options" in warnings[0]
    assert failure  # the server went away: the build failed, naming the URL
    assert url in str(failure[0])


def test_json_lines_cut_at_every_block_boundary_read_as_whole_lines(monkeypatch):
    """Lines are cut from blocks of READ_BLOCK_BYTES: with blocks of 1 to 9 bytes every line
    crosses them, and values, blank lines (CRLF, spaces), a line too long, its number and a
    last line without a newline all come as they do in whole."""
    from zloader.formats import jsonl

    data = ('\ufeff{"a": 1}\r\n\r\n   \n{"b": "' + "x" * 30 + '"}\n{"c": [1, 2]}\n\n'
            '{"d": 4}').encode()
    for block in range(1, 10):
        monkeypatch.setattr(jsonl, "READ_BLOCK_BYTES", block)
        got = list(jsonl.read_lines(io.BytesIO(data), "f.jsonl", max_line_bytes=20))
        values = [v for v in got if not isinstance(v, jsonl.Bad)]
        bad = [str(v.error) for v in got if isinstance(v, jsonl.Bad)]
        assert values == [{"a": 1}, {"c": [1, 2]}, {"d": 4}], block
        assert bad == ["f.jsonl: line 4 is longer than max_line_bytes=20: raise "
                       "from_jsonl(max_line_bytes=) if lines this long are meant"], block


def test_a_compressed_file_of_two_hundred_million_blank_lines_reads_without_stalling(tmp_path):
    """A gzip JSON lines file of 200 M blank lines (200 KB on disk) before its one value:
    blocks of blank lines are counted, not stepped through one line at a time (before, a
    worker spent about 90 s in them and the Loader's 60 s timeout took it for stuck)."""
    path = tmp_path / "blank.jsonl.gz"
    block = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as out:
        for _ in range(200):
            out.write(block.compress(b"\n" * (1 << 20)))
        out.write(block.compress(b'{"last": true}\n') + block.flush())
    with Loader(Pipeline.from_jsonl(str(path)), num_workers=1, timeout=60) as loader:
        assert list(loader) == [{"last": True}]
