"""Torch tensors as elements: the codec carries them as the arrays they are (any dtype
torch has but the quantized ones, non-contiguous ones, nested tensors), without pickle,
and they arrive as tensors; through a real Loader, zloader.torch.IterableDataset and
zloader.torch.DataLoader."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import zloader
import zloader.torch as zt
from zloader import CodecError, codec

DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)
                 and not str(d).startswith(("torch.qint", "torch.quint"))}, key=str)


PLAIN = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare tensors of dtypes without ``torch.equal`` (or copies)."""
    plain = tensor.detach().resolve_conj().view(PLAIN[tensor.dtype.itemsize])
    return plain.contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Equal tensors of one dtype and shape (bit for bit), in equal containers."""
    if isinstance(a, torch.Tensor):
        if not (type(b) is type(a) and a.dtype == b.dtype and a.is_nested == b.is_nested):
            return False
        if a.is_nested:
            return a.layout == b.layout and same(list(a.unbind()), list(b.unbind()))
        return a.shape == b.shape and torch.equal(bits(a), bits(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Tensors(torch.utils.data.Dataset):
    """Samples of tensors of several dtypes and memory layouts."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        grid = torch.arange(12, dtype=torch.int16).reshape(3, 4) * (i + 1)
        return {
            "i": i,
            "bf16": torch.linspace(0, 1, 5, dtype=torch.bfloat16) + i,
            "transposed": grid.t(),  # not contiguous
            "strided": torch.arange(20.0)[i % 3::3],
            "f8": torch.full((2, 2), i / 4).to(torch.float8_e4m3fn),
            "u16": torch.tensor([i, 65535 - i], dtype=torch.uint16),
            "flags": torch.tensor([i % 2 == 0, True]),
            "complex": torch.tensor([i + 1j]).conj(),  # a conjugate view
            "scalar": torch.tensor(float(i)),
            "empty": torch.zeros(0, 3, dtype=torch.float64),
            "pair": (torch.tensor([i]), np.arange(i, i + 2)),
        }


def _expected(element: dict[str, Any]) -> dict[str, Any]:
    """What a sample arrives as: its tensors as they are, numpy arrays as arrays."""
    return Tensors()[element["i"]]


def _check(elements: list[Any], numpy_arrives_as_tensor: bool) -> None:
    assert sorted(e["i"] for e in elements) == list(range(12))
    for element in elements:
        expected = _expected(element)
        array = expected["pair"][1]
        got_array = element["pair"][1]
        if numpy_arrives_as_tensor:  # the torch adapter converts arrays, as torch's collate
            assert torch.equal(got_array, torch.from_numpy(array))
        else:
            assert isinstance(got_array, np.ndarray) and np.array_equal(got_array, array)
        del expected["pair"], element["pair"]
        assert same(expected, element)


def test_a_torch_dataset_s_tensors_arrive_as_tensors_through_a_loader():
    pipeline = zloader.Pipeline.from_torch(Tensors(), split_size=3)
    with zloader.Loader(pipeline, num_workers=2) as loader:  # objects=False: no pickle
        elements = list(loader)
    _check(elements, numpy_arrives_as_tensor=False)


def test_a_torch_dataset_s_tensors_arrive_as_tensors_through_the_iterable_dataset():
    dataset = zt.IterableDataset(zloader.Pipeline.from_torch(Tensors(), split_size=3),
                                 num_workers=2)
    try:
        elements = list(dataset)
    finally:
        dataset.close()
    _check(elements, numpy_arrives_as_tensor=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(dtype):
    raw = (torch.arange(4 * 6 * dtype.itemsize) % (2 if dtype == torch.bool else 256)
           ).to(torch.uint8)
    value = raw.view(dtype).reshape(4, 6)  # a bit pattern: compared as bytes
    for tensor in (value, value.t(), value[1:, ::2], value[0, 0], value[:0]):
        out = codec.decode(codec.encode([tensor]))[0]
        assert same(tensor, out), (dtype, tensor.shape, tensor.stride())


def test_decoded_tensors_share_writable_memory_and_copy_read_only_memory():
    tensor = torch.arange(6, dtype=torch.bfloat16)
    header, data = codec.encode(tensor)
    writable = bytearray(bytes(data))
    shared = codec.decode([header, writable])
    shared[0] = 7  # the tensor is a view over the received memory
    assert torch.frombuffer(writable, dtype=torch.bfloat16)[0] == 7
    read_only = bytes(data)
    copied = codec.decode([header, read_only])
    copied[0] = 9  # never the sender's memory
    assert torch.frombuffer(bytearray(read_only), dtype=torch.bfloat16)[0] == 0


def test_nested_tensors_round_trip_in_both_layouts():
    strided = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    jagged = torch.nested.nested_tensor([torch.ones(2, 4), torch.zeros(5, 4)],
                                        layout=torch.jagged, dtype=torch.bfloat16)
    out = codec.decode(codec.encode({"s": strided, "j": jagged}))
    assert same(strided, out["s"]) and same(jagged, out["j"])


def test_tensors_the_codec_does_not_carry_are_refused_naming_the_fix_or_pickled_if_allowed():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(CodecError, match=r"element\['s'\].*to_dense\(\)"):
        codec.encode({"s": sparse})
    out = codec.decode(codec.encode([sparse], objects=True), objects=True)[0]
    assert out.is_sparse and torch.equal(out.to_dense(), torch.eye(3))
    with pytest.raises(CodecError, match=r"element\[0\]\[1\]: a tensor .* on meta"):
        codec.encode([(1, torch.ones(2, device="meta"))])


def _tensor_header(name: bytes, shape: tuple[int, ...]) -> bytes:
    dims = b"".join(d.to_bytes(8, "little") for d in shape)
    return codec.MAGIC + b"t" + bytes([len(name)]) + name + bytes([len(shape)]) + dims


@pytest.mark.parametrize("buffers, match", [
    ([_tensor_header(b"qint8", (2,)), bytes(2)], "unsupported tensor dtype 'qint8'"),
    ([_tensor_header(b"Tensor", (2,)), bytes(2)], "unsupported tensor dtype 'Tensor'"),
    ([_tensor_header(b"__class__", (1,)), bytes(1)], "unsupported tensor dtype"),
    ([_tensor_header(b"bfloat16", (3,)), bytes(5)], "needs 6 bytes"),
    ([codec.MAGIC + b"j\x07strided\x07float32\x01\x00\x00\x00N"], "is not a tensor"),
    ([codec.MAGIC + b"j\x04flat\x07float32\x00\x00\x00\x00"], "layout 'flat'"),
])
def test_malformed_tensor_headers_raise_codec_errors(buffers, match):
    with pytest.raises(CodecError, match=match):
        codec.decode(buffers)


def test_the_codec_imports_torch_only_to_decode_a_tensor():
    header, data = codec.encode(torch.arange(4, dtype=torch.bfloat16))
    code = (
        "import sys, numpy as np\n"
        "from zloader import codec\n"
        "codec.decode(codec.encode({'a': np.arange(3), 'b': [1, 'x', None]}))\n"
        "assert 'torch' not in sys.modules, 'encoding imported torch'\n"
        f"out = codec.decode([{bytes(header)!r}, {bytes(data)!r}])\n"
        "assert type(out).__name__ == 'Tensor' and str(out.dtype) == 'torch.bfloat16'\n"
        "print(out.float().tolist())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[0.0,", "1.0,", "2.0,", "3.0]"]


# --- zloader.torch.DataLoader: batches holding tensors numpy cannot hold ------------------

def _listed(samples: list[Any]) -> list[Any]:
    return [sample.clone() for sample in samples]


NESTED = [torch.nested.nested_tensor([torch.randn(5), torch.randn(i + 1)]) for i in range(6)]


def test_nested_tensors_returned_by_workers_are_torchs():
    got = []
    loader = zt.DataLoader(NESTED, batch_size=1, num_workers=2, collate_fn=_listed)
    try:
        for batch in loader:
            got.append(batch[0])
    finally:
        loader.close()
    assert len(got) == len(NESTED)
    assert all(same(a, b) for a, b in zip(NESTED, got, strict=True))


def _first_error(loader: Any) -> str:
    try:
        next(iter(loader))
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("the first batch did not raise")


def test_a_failing_collate_names_the_batch_s_indices_and_the_worker():
    # torch's default collate cannot stack nested tensors: torch's own message (torch's
    # loader is left out: its workers take 10 s to stop after this error)
    loader = zt.DataLoader(NESTED, batch_size=2, num_workers=2)
    try:
        ours = _first_error(loader)
    finally:
        loader.close()
    assert "not currently supported by the default collate_fn" in ours
    assert "raised RuntimeError at indices [0, 1] in DataLoader worker process 0" in ours


def test_bfloat16_batches_travel_as_tensors_without_pickle():
    batches = [torch.arange(4, dtype=torch.bfloat16) * i for i in range(4)]
    got = []
    loader = zt.DataLoader(batches, batch_size=None, num_workers=2)
    try:
        got = list(loader)
    finally:
        loader.close()
    assert all(same(a, b) for a, b in zip(batches, got, strict=True))
    assert zt.to_numpy({"b": batches[1]})["b"] is batches[1]  # left for the codec


def _full(i: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.full((2,), float(i), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_pipeline_batch_of_tensors_is_a_tensor_of_their_dtype(dtype):
    import functools

    pipeline = zloader.Pipeline.range(8).map(functools.partial(_full, dtype=dtype)).batch(4)
    expected = [torch.stack([_full(i, dtype) for i in range(b, b + 4)]) for b in (0, 4)]
    assert all(same(a, b) for a, b in zip(pipeline.iter(), expected, strict=True))
    with zloader.Loader(pipeline, num_workers=1, timeout=30) as loader:
        got = list(loader)
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))
    rows = list(pipeline.unbatch().iter())
    assert all(same(a, _full(i, dtype)) for i, a in enumerate(rows))


def test_tensors_of_different_lengths_are_padded_by_bucket_by_length():
    pipeline = zloader.Pipeline.range(1, 5).map(lambda n: torch.arange(n, dtype=torch.bfloat16))
    (batch,) = pipeline.bucket_by_length(len, [10], [4, 4], pad_value=-1).iter()
    assert isinstance(batch, torch.Tensor) and batch.dtype == torch.bfloat16
    assert batch.shape == (4, 4) and float(batch[0, 1]) == -1 and float(batch[3, 3]) == 3
