"""File-format sources: files written by the reference writers (TensorFlow, webdataset,
pyarrow, Pillow), read by zloader and compared element by element with the reference
readers; corrupt records, streaming reads, parallel reads."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from zloader import Loader, Pipeline, PipelineError
from zloader._defaults import READ_BLOCK_BYTES
from zloader.formats import decode_image, parse_example
from zloader.formats.base import interleave
from zloader.formats.tfrecord import read_records
from zloader.formats.webdataset import read_samples
from zloader.runs import Context, RunSettings


@pytest.fixture(scope="module")
def tf():
    """TensorFlow, imported once for the module (its import takes seconds)."""
    return pytest.importorskip("tensorflow")


def policy(skip: bool = True) -> Context:
    """A run's context as a source sees it (its error policy and tally)."""
    return Context(RunSettings(entropy=0, skip_errors=skip))


# --- TFRecord ------------------------------------------------------------------------------

def examples(count: int, offset: int = 0) -> list[dict]:
    rng = np.random.default_rng(offset)
    return [{"name": [f"item-{offset + i}".encode(), bytes(rng.integers(0, 256, i % 5,
                                                                          dtype=np.uint8))],
             "ids": [offset + i, -i, 2 ** 40 + i][: 1 + i % 3],
             "score": rng.random(i % 4).astype(np.float32).tolist()}
            for i in range(count)]


def write_tfrecord(path, rows, compression=None) -> list[bytes]:
    tf = pytest.importorskip("tensorflow")
    records = []
    with tf.io.TFRecordWriter(str(path), options=compression) as writer:
        for row in rows:
            feature = {
                "name": tf.train.Feature(bytes_list=tf.train.BytesList(value=row["name"])),
                "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=row["ids"])),
                "score": tf.train.Feature(float_list=tf.train.FloatList(value=row["score"])),
            }
            record = tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString()
            writer.write(record)
            records.append(record)
    return records


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_tfrecord_matches_tensorflow(tmp_path, compression, tf):
    paths = [tmp_path / f"part-{i}.tfrecord" for i in range(3)]
    for i, path in enumerate(paths):
        write_tfrecord(path, examples(7, 100 * i), compression)
    pipeline = Pipeline.from_tfrecord(str(tmp_path / "part-*.tfrecord"), compression)
    assert pipeline.source.num_splits == 3
    ours = list(pipeline)
    reference = [r.numpy() for r in tf.data.TFRecordDataset([str(p) for p in paths],
                                                             compression_type=compression)]
    assert ours == reference
    spec = {"name": tf.io.VarLenFeature(tf.string), "ids": tf.io.VarLenFeature(tf.int64),
            "score": tf.io.VarLenFeature(tf.float32)}
    for record in ours:
        parsed = parse_example(record)
        expected = tf.io.parse_single_example(record, spec)
        assert parsed["name"] == list(expected["name"].values.numpy())
        assert parsed["ids"].dtype == np.int64
        np.testing.assert_array_equal(parsed["ids"], expected["ids"].values.numpy())
        assert parsed["score"].dtype == np.float32
        np.testing.assert_array_equal(parsed["score"], expected["score"].values.numpy())


def flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_tfrecord_names_file_and_offset_or_is_skipped(tmp_path):
    path = tmp_path / "bad.tfrecord"
    records = write_tfrecord(path, examples(5))
    second = 16 + len(records[0])  # the offset of record 1: header 12 + data + footer 4
    flip_byte(path, second + 12 + 3)  # a byte of record 1's data
    pipeline = Pipeline.from_tfrecord([path])
    with pytest.raises(PipelineError, match=rf"bad\.tfrecord: corrupt record at offset "
                                            rf"{second}") as info:
        list(pipeline)
    assert info.value.exc_type == "zloader.formats.tfrecord.CorruptRecord"
    assert isinstance(info.value, ValueError)
    run = policy()
    assert list(pipeline.source.read(0, run)) == records[:1] + records[2:]
    assert run.tally.skipped == 1
    assert next(iter(Pipeline.from_tfrecord([path], verify=False))) == records[0]
    with Loader(pipeline, num_workers=1, on_error="skip", timeout=30) as loader:
        assert sorted(loader) == sorted(records[:1] + records[2:])
        assert loader.stats()["skipped"] == 1


def test_tfrecord_corrupt_length_or_truncation_ends_the_file(tmp_path):
    path = tmp_path / "cut.tfrecord"
    records = write_tfrecord(path, examples(4))
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the last record loses its end
    with pytest.raises(PipelineError, match=r"cut\.tfrecord: truncated record at offset"):
        list(Pipeline.from_tfrecord([path]))
    run = policy()
    assert list(Pipeline.from_tfrecord([path]).source.read(0, run)) == records[:3]
    assert run.tally.skipped == 1
    flip_byte(path, 2)  # the first record's length
    with pytest.raises(PipelineError, match=r"corrupt record length at offset 0"):
        list(Pipeline.from_tfrecord([path]))


PARSE_WITHOUT_TF = """
import sys
sys.modules["tensorflow"] = None  # importing it now fails
import numpy as np
from zloader.formats import parse_example
parsed = parse_example(open(sys.argv[1], "rb").read())
print(parsed["name"], parsed["ids"].tolist(), parsed["score"].tolist())
print(sorted(m for m, v in sys.modules.items()
             if v is not None and m.startswith(("tensorflow", "google.protobuf"))))
"""


def test_parse_example_works_without_tensorflow(tmp_path, tf):
    feature = {"name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"a", b"\x00"])),
               "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=[-5, 2 ** 62])),
               "score": tf.train.Feature(float_list=tf.train.FloatList(value=[0.5]))}
    record = tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
    (tmp_path / "record").write_bytes(record)
    done = subprocess.run([sys.executable, "-c", PARSE_WITHOUT_TF, str(tmp_path / "record")],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.splitlines() == ["[b'a', b'\\x00'] [-5, 4611686018427387904] [0.5]",
                                        "[]"]


def test_parse_example_reads_unpacked_lists():
    # Hand-encoded: Example{features{feature{"i": int64_list{value: 3, value: -1}}
    # feature{"f": float_list{value: 1.5, value: 2.0}}}} with one varint / fixed32 per value
    # (the unpacked encoding older writers use), and an unknown field (99) to skip.
    def message(number: int, payload: bytes) -> bytes:
        return bytes([number << 3 | 2, len(payload)]) + payload

    ints = b"\x08\x03" + b"\x08" + b"\xff" * 9 + b"\x01"
    floats = b"\x0d" + np.float32(1.5).tobytes() + b"\x0d" + np.float32(2.0).tobytes()
    entry_i = message(1, b"i") + message(2, message(3, ints))
    entry_f = message(1, b"f") + message(2, message(2, floats))
    unknown = bytes([99 << 3 & 0xFF | 0x80, 99 >> 4, 7])  # field 99, varint 7
    record = message(1, message(1, entry_i) + message(1, entry_f)) + unknown
    parsed = parse_example(record)
    assert parsed["i"].tolist() == [3, -1]
    assert parsed["f"].tolist() == [1.5, 2.0]


class CountingFile(io.RawIOBase):
    """A real file that counts the bytes read from it."""

    def __init__(self, path) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        size = self.file.readinto(buffer)
        self.count += size
        return size

    def close(self) -> None:
        self.file.close()
        super().close()


def test_tfrecord_and_webdataset_reads_stream(tmp_path, tf):
    wds = pytest.importorskip("webdataset")
    big = bytes(READ_BLOCK_BYTES // 2)
    path = tmp_path / "big.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(6):  # 3 MiB: three read blocks
            writer.write(big)
    counting = CountingFile(path)
    records = read_records(io.BufferedReader(counting, READ_BLOCK_BYTES), str(path))
    assert next(records) == big
    assert counting.count <= 2 * READ_BLOCK_BYTES < path.stat().st_size
    records.close()
    counting.close()
    shard = tmp_path / "big.tar"
    with wds.TarWriter(str(shard), encoder=False) as writer:
        for i in range(6):
            writer.write({"__key__": f"s{i}", "bin": big})
    counting = CountingFile(shard)
    samples = read_samples(io.BufferedReader(counting, READ_BLOCK_BYTES), str(shard))
    assert next(samples)["bin"] == big
    assert counting.count <= 2 * READ_BLOCK_BYTES < shard.stat().st_size
    samples.close()
    counting.close()


# --- WebDataset ----------------------------------------------------------------------------

def write_shards(tmp_path) -> list[str]:
    wds = pytest.importorskip("webdataset")
    pattern = str(tmp_path / "shard-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=4, encoder=False) as writer:
        for i in range(10):
            sample = {"__key__": f"set.v1/sample.{i:03d}" if i % 3 else f"set.v1/s{i:03d}",
                      "jpg": bytes([i]) * (i + 1), "cls": str(i % 3).encode(),
                      "seg.png": b"png" * i, "txt.gz": gzip.compress(f"text {i}".encode())}
            writer.write(sample)
    with wds.TarWriter(str(tmp_path / "shard-9999.tar.gz"), encoder=False,
                       compress=True) as writer:
        writer.write({"__key__": "zipped", "json": b"{}", "TXT": b"upper"})
    return sorted(str(p) for p in tmp_path.glob("shard-*"))


def test_webdataset_matches_the_webdataset_package(tmp_path):
    wds = pytest.importorskip("webdataset")
    urls = write_shards(tmp_path)
    pipeline = Pipeline.from_webdataset(urls)
    assert pipeline.source.num_splits == len(urls) == 4
    ours = list(pipeline)
    reference = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert len(ours) == len(reference) == 9
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine == {k: v for k, v in theirs.items() if k != "__local_path__"}
    # a key is the name up to the first dot of its last part: "sample.001.cls" and
    # "sample.002.cls" are one sample "set.v1/sample" with extensions "001.cls", "002.cls"
    assert {"__key__": "set.v1/sample", "__url__": urls[0]}.items() <= ours[1].items()
    assert {"001.cls", "002.seg.png", "002.txt.gz"} <= set(ours[1])
    assert gzip.decompress(ours[0]["txt.gz"]) == b"text 0"
    assert ours[-1]["txt"] == b"upper"  # extensions are lower-cased, as webdataset does


# --- Parquet -------------------------------------------------------------------------------

def write_parquet(tmp_path) -> list[str]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    paths = []
    for f in range(2):
        n = 23 + f
        table = pa.table({"id": np.arange(n) + 100 * f, "x": np.linspace(0, 1, n),
                          "text": [f"row {i}" for i in range(n)],
                          "tags": [[i] * (i % 3) for i in range(n)]})
        path = tmp_path / f"part-{f}.parquet"
        pq.write_table(table, path, row_group_size=5)
        paths.append(str(path))
    return paths


def test_parquet_rows_match_pyarrow(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    paths = write_parquet(tmp_path)
    pipeline = Pipeline.from_parquet(paths)
    groups = [pq.ParquetFile(p).num_row_groups for p in paths]
    assert groups == [5, 5]
    assert pipeline.source.num_splits == sum(groups)
    reference = [row for p in paths for row in pq.read_table(p).to_pylist()]
    assert list(pipeline) == reference
    assert list(pipeline.source.read(6)) == pq.ParquetFile(paths[1]).read_row_group(1) \
        .to_pylist()
    narrow = list(Pipeline.from_parquet(str(tmp_path / "*.parquet"), columns=["id", "text"]))
    assert narrow == [{"id": r["id"], "text": r["text"]} for r in reference]


def test_parquet_batches_stay_within_row_groups(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    paths = write_parquet(tmp_path)
    batches = list(Pipeline.from_parquet(paths, batch_rows=3))
    sizes = [len(b["id"]) for b in batches]
    assert sizes[:4] == [3, 2, 3, 2]  # row groups of 5 rows: 3 + 2 each
    assert all(isinstance(b["id"], np.ndarray) and b["id"].dtype == np.int64 for b in batches)
    table = pq.read_table(paths[0])
    first = batches[:9]  # 23 rows: row groups of 5, 5, 5, 5, 3
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in first]),
                                  table.column("x").to_numpy())
    assert [t for b in first for t in b["text"]] == table.column("text").to_pylist()
    assert [t for b in first for t in b["tags"]] == table.column("tags").to_pylist()


# --- JSON lines ----------------------------------------------------------------------------

def test_jsonl_plain_gzip_and_zstd(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    rows = [{"i": i, "text": "é" * i, "list": list(range(i))} for i in range(9)]
    text = "".join(json.dumps(r) + "\n" for r in rows[:3]) + "\n"
    (tmp_path / "a.jsonl").write_text(text)
    (tmp_path / "b.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in rows[3:6]).encode()))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps(r) + "\n" for r in rows[6:]).encode()))
    pipeline = Pipeline.from_jsonl(str(tmp_path / "*.jsonl*"))
    assert pipeline.source.num_splits == 3
    assert list(pipeline) == rows
    (tmp_path / "a.jsonl").write_text(text + "{oops\n" + json.dumps({"i": 99}) + "\n")
    with pytest.raises(PipelineError, match=r"a\.jsonl: line 5 is not JSON"):
        list(Pipeline.from_jsonl([tmp_path / "a.jsonl"]))
    run = policy()
    source = Pipeline.from_jsonl([tmp_path / "a.jsonl"]).source
    assert list(source.read(0, run)) == [*rows[:3], {"i": 99}]
    assert run.tally.skipped == 1


# --- image folders -------------------------------------------------------------------------

def write_image(path, value: int, size=(5, 4)) -> np.ndarray:
    image_module = pytest.importorskip("PIL.Image")
    array = np.full((size[1], size[0], 3), value, np.uint8)
    array[0, 0] = (value, 255 - value, 7)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_module.fromarray(array).save(path)
    return array


def test_image_folder_follows_torchvision_rules(tmp_path):
    root = tmp_path / "root"
    write_image(root / "dog" / "b.png", 1)
    write_image(root / "dog" / "a.PNG", 2)
    write_image(root / "dog" / "inner" / "c.png", 3)
    write_image(root / "dog" / "z.png", 4)
    write_image(root / "cat.v2" / "x.bmp", 5)
    write_image(root / "ant" / "y.png", 6)
    (root / "ant" / "notes.txt").write_text("not an image")
    (root / "loose.png").write_bytes(b"not in a class")
    pipeline = Pipeline.from_image_folder(root, split_size=2)
    source = pipeline.source
    assert source.classes == ("ant", "cat.v2", "dog")  # sorted folder names
    out = list(pipeline)
    # torchvision: by class; within a class, a sorted os.walk (folder by folder, names
    # sorted); label = the class's index
    names = [(o["path"].removeprefix(str(root) + "/"), o["label"]) for o in out]
    assert names == [("ant/y.png", 0), ("cat.v2/x.bmp", 1), ("dog/a.PNG", 2),
                     ("dog/b.png", 2), ("dog/z.png", 2), ("dog/inner/c.png", 2)]
    assert source.num_splits == 3
    assert out[0]["image"] == (root / "ant" / "y.png").read_bytes()
    torchvision = _torchvision()
    if torchvision is not None:
        reference = torchvision.datasets.ImageFolder(str(root))
        assert [(p, label) for p, label in reference.samples] == \
            [(o["path"], o["label"]) for o in out]
    decoded = list(Pipeline.from_image_folder(root, decode=True))
    assert decoded[5]["image"].shape == (4, 5, 3)
    np.testing.assert_array_equal(decoded[5]["image"], decode_image(
        (root / "dog" / "inner" / "c.png").read_bytes()))
    (root / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no image in class folder\(s\) \['empty'\]"):
        Pipeline.from_image_folder(root)


def _torchvision():
    try:
        import torchvision
    except Exception:  # absent, or built for another torch
        return None
    return torchvision


def test_decode_image_gives_hwc_uint8(tmp_path):
    array = write_image(tmp_path / "i.png", 9, size=(6, 3))
    out = decode_image((tmp_path / "i.png").read_bytes())
    assert out.dtype == np.uint8 and out.shape == (3, 6, 3)
    np.testing.assert_array_equal(out, array)
    assert decode_image((tmp_path / "i.png").read_bytes(), mode="L").shape == (3, 6, 1)
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"nonsense")


# --- parallel reads ------------------------------------------------------------------------

def write_jsonl_files(tmp_path, count: int = 7) -> str:
    for f in range(count):
        (tmp_path / f"{f:02d}.jsonl").write_text(
            "".join(json.dumps([f, i]) + "\n" for i in range(3 + f)))
    return str(tmp_path / "*.jsonl")


def test_parallel_reads_interleave_and_give_the_same_elements(tmp_path):
    pattern = write_jsonl_files(tmp_path)
    serial = list(Pipeline.from_jsonl(pattern))
    parallel = Pipeline.from_jsonl(pattern, parallel_reads=3)
    assert parallel.source.num_splits == 3  # 7 files, 3 at a time
    first = list(parallel)
    assert sorted(first) == sorted(serial)
    assert first[:6] == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]  # in turn
    assert list(parallel) == first  # deterministic: the same order every run
    loose = list(Pipeline.from_jsonl(pattern, parallel_reads=3, deterministic=False))
    assert sorted(loose) == sorted(serial)
    assert parallel.fingerprint != Pipeline.from_jsonl(pattern).fingerprint
    with Loader(parallel, num_workers=2, timeout=30) as loader:
        assert sorted(loader) == sorted(serial)


@pytest.mark.parametrize("deterministic", [True, False])
def test_parallel_reads_overlap(deterministic):
    readers = 4
    barrier = threading.Barrier(readers, timeout=20)  # breaks (raises) unless all wait at once

    def reader(index: int):
        def read():
            barrier.wait()
            yield from range(index * 10, index * 10 + 3)
        return read

    out = list(interleave([reader(i) for i in range(readers)], deterministic))
    assert sorted(out) == sorted(i * 10 + j for i in range(readers) for j in range(3))


def test_parallel_reads_carry_a_reader_error_and_stop_their_threads():
    def good():
        yield from range(1000)

    def bad():
        yield 1
        raise OSError("disk on fire")

    before = threading.active_count()
    with pytest.raises(OSError, match="disk on fire"):
        list(interleave([good, bad, good]))
    taken = interleave([good, good])
    assert next(taken) == 0
    taken.close()  # abandoned early: its threads end
    assert threading.active_count() <= before + 1
