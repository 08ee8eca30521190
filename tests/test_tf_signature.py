"""How ``zloader.tf.dataset`` learns its ``output_signature``: by running a few elements
through the stages in the trainer, with shuffle and batch buffers bypassed, never by
filling them; or not at all when ``output_signature=`` is given."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import zloader.tf
from zloader import Pipeline


def counted_decode(calls: list[int]):
    """A map that records each call in this process (worker processes record in their own
    copy, so ``calls`` counts only what the trainer ran)."""
    def decode(i):
        calls.append(int(i))
        return {"image": np.full((3, 2), i, np.float32), "label": np.int64(i)}
    return decode


def test_the_signature_is_learned_without_filling_the_shuffle_buffer():
    calls: list[int] = []
    pipeline = Pipeline.range(600).map(counted_decode(calls)).shuffle(10000, seed=1).batch(256)
    ds = zloader.tf.dataset(pipeline, num_workers=1, timeout=30)
    try:
        assert len(calls) <= 5, f"{len(calls)} map calls in the trainer to learn the signature"
        assert ds.element_spec["image"] == tf.TensorSpec([None, 3, 2], tf.float32)
        assert ds.element_spec["label"] == tf.TensorSpec([None], tf.int64)
        batches = list(ds.as_numpy_iterator())
        assert [len(b["label"]) for b in batches] == [256, 256, 88]
        labels = np.concatenate([b["label"] for b in batches])
        assert sorted(labels.tolist()) == list(range(600))
        for batch in batches:
            np.testing.assert_array_equal(batch["image"][:, 1, 1], batch["label"])
    finally:
        zloader.tf.close(ds)


def test_a_batch_that_drops_its_remainder_gives_a_known_leading_dimension():
    calls: list[int] = []
    pipeline = (Pipeline.range(600).map(counted_decode(calls)).shuffle(10000, seed=1)
                .batch(256, drop_remainder=True))
    spec = zloader.tf.infer_signature(pipeline)
    assert len(calls) <= 5
    assert spec == {"image": tf.TensorSpec([256, 3, 2], tf.float32),
                    "label": tf.TensorSpec([256], tf.int64)}
    ds = zloader.tf.to_dataset(pipeline, spec)
    assert [b["image"].shape for b in ds.as_numpy_iterator()] == [(256, 3, 2)] * 2


def test_shapes_that_follow_the_batch_size_after_a_batch_are_scaled_and_others_kept():
    calls: list[int] = []
    pipeline = (Pipeline.range(40).map(counted_decode(calls)).shuffle(1000, seed=2)
                .batch(8, drop_remainder=True)
                .map(lambda b: {"flat": b["image"].reshape(-1), "sum": b["image"].sum(0)}))
    spec = zloader.tf.infer_signature(pipeline)
    assert len(calls) <= 5
    assert spec == {"flat": tf.TensorSpec([48], tf.float32),
                    "sum": tf.TensorSpec([3, 2], tf.float32)}
    got = list(zloader.tf.to_dataset(pipeline, spec).as_numpy_iterator())
    assert len(got) == 5 and got[0]["flat"].shape == (48,)


def test_dimensions_that_differ_between_elements_are_unknown():
    pipeline = (Pipeline.range(1, 30).map(lambda n: np.ones((n, 2), np.int32))
                .shuffle(1000, seed=0).unbatch().batch(3))
    assert zloader.tf.infer_signature(pipeline) == tf.TensorSpec([None, 2], tf.int32)
    ragged = Pipeline.range(1, 30).map(lambda n: np.ones(n, np.int32)).bucket_by_length(
        len, [5, 10], [4, 4, 4])
    assert zloader.tf.infer_signature(ragged) == tf.TensorSpec([None, None], tf.int32)


def test_code_that_needs_the_real_batch_size_falls_back_to_full_batches_with_a_warning():
    calls: list[int] = []
    pipeline = (Pipeline.range(40).map(counted_decode(calls)).batch(8, drop_remainder=True)
                .map(lambda b: b["label"].reshape(2, 4)))
    with pytest.warns(UserWarning, match="output_signature="):
        spec = zloader.tf.infer_signature(pipeline)
    assert spec == tf.TensorSpec([2, 4], tf.int64)


def test_an_output_signature_given_skips_inference_and_is_checked():
    calls: list[int] = []
    pipeline = Pipeline.range(20).map(counted_decode(calls)).shuffle(100, seed=1).batch(8)
    signature = {"image": tf.TensorSpec([None, 3, 2], tf.float32),
                 "label": tf.TensorSpec([None], tf.int64)}
    ds = zloader.tf.dataset(pipeline, output_signature=signature, num_workers=1, timeout=30)
    try:
        assert calls == [] and ds.element_spec == signature
        assert sum(len(b["label"]) for b in ds.as_numpy_iterator()) == 20
    finally:
        zloader.tf.close(ds)
    with pytest.raises(TypeError, match=r"output_signature\['label'\].*tf\.TensorSpec"):
        zloader.tf.dataset(pipeline, output_signature={"image": signature["image"],
                                                       "label": "int64"})
    with pytest.raises(TypeError, match=r"spec.*tf\.TensorSpec"):
        zloader.tf.to_dataset(pipeline, spec=[3, 2])
    assert calls == []


def _varying(i: int) -> np.ndarray:
    return np.arange(5 if i < 2 else 3 + i % 7, dtype=np.float32)


def test_an_element_that_breaks_the_inferred_signature_names_output_signature():
    # The first two elements share a length, so inference fixes it; a later one differs.
    ds = zloader.tf.dataset(Pipeline.range(20, split_size=20).map(_varying), num_workers=1,
                            timeout=30)
    try:
        with pytest.raises(Exception, match="output_signature=") as raised:
            for _ in ds:
                pass
        assert "has shape (6,)" in str(raised.value)
    finally:
        zloader.tf.close(ds)
    given = zloader.tf.dataset(Pipeline.range(20, split_size=20).map(_varying),
                               output_signature=tf.TensorSpec([None], tf.float32),
                               num_workers=1, timeout=30)
    try:
        assert sum(1 for _ in given) == 20
    finally:
        zloader.tf.close(given)
