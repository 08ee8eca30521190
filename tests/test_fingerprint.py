"""Fingerprints: stable across processes, sensitive to every kind of semantic change,
insensitive to identity, keyword order and source locations, and never a false match."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import cloudpickle
import numpy as np
import pytest

from zloader import FingerprintWarning, Pipeline


def build(source: str, **namespace) -> Pipeline:
    """Run user code as if from a module of its own and return its ``pipeline``."""
    ns = {"__name__": "user_pipeline", "Pipeline": Pipeline, "np": np, **namespace}
    exec(compile(textwrap.dedent(source), "user.py", "exec"), ns)
    return ns["pipeline"]


def differ(a: str, b: str, **namespace) -> bool:
    return build(a, **namespace).fingerprint != build(b, **namespace).fingerprint


# --- sensitivity -----------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [
    # a constant inside a lambda
    ("pipeline = Pipeline.range(10).map(lambda x: x + 1)",
     "pipeline = Pipeline.range(10).map(lambda x: x + 2)"),
    # the operation
    ("pipeline = Pipeline.range(10).map(lambda x: x + 1)",
     "pipeline = Pipeline.range(10).map(lambda x: x - 1)"),
    # a closure value
    ("def make(k):\n    return Pipeline.range(10).map(lambda x: x + k)\npipeline = make(1)",
     "def make(k):\n    return Pipeline.range(10).map(lambda x: x + k)\npipeline = make(2)"),
    # a default
    ("pipeline = Pipeline.range(10).map(lambda x, k=1: x + k)",
     "pipeline = Pipeline.range(10).map(lambda x, k=2: x + k)"),
    # a keyword-only default
    ("def f(x, *, k=1):\n    return x + k\npipeline = Pipeline.range(3).map(f)",
     "def f(x, *, k=3):\n    return x + k\npipeline = Pipeline.range(3).map(f)"),
    # a referenced global
    ("OFFSET = 1\npipeline = Pipeline.range(10).map(lambda x: x + OFFSET)",
     "OFFSET = 2\npipeline = Pipeline.range(10).map(lambda x: x + OFFSET)"),
    # a global reached through a helper function
    ("def helper(x):\n    return x * 2\npipeline = Pipeline.range(3).map(lambda x: helper(x))",
     "def helper(x):\n    return x * 3\npipeline = Pipeline.range(3).map(lambda x: helper(x))"),
    # a global used only inside a nested comprehension
    ("K = 1\npipeline = Pipeline.range(3).map(lambda x: [K for _ in range(x)])",
     "K = 2\npipeline = Pipeline.range(3).map(lambda x: [K for _ in range(x)])"),
    # a partial's argument
    ("import functools, operator\n"
     "pipeline = Pipeline.range(3).map(functools.partial(operator.add, 1))",
     "import functools, operator\n"
     "pipeline = Pipeline.range(3).map(functools.partial(operator.add, 2))"),
    # a callable object's attribute
    ("class Scale:\n    def __init__(self, k):\n        self.k = k\n"
     "    def __call__(self, x):\n        return x * self.k\n"
     "pipeline = Pipeline.range(3).map(Scale(2))",
     "class Scale:\n    def __init__(self, k):\n        self.k = k\n"
     "    def __call__(self, x):\n        return x * self.k\n"
     "pipeline = Pipeline.range(3).map(Scale(3))"),
    # a method's code in a user class
    ("class Scale:\n    def __call__(self, x):\n        return x * 2\n"
     "pipeline = Pipeline.range(3).map(Scale())",
     "class Scale:\n    def __call__(self, x):\n        return x * 4\n"
     "pipeline = Pipeline.range(3).map(Scale())"),
    # a library function
    ("pipeline = Pipeline.range(3).map(np.sqrt)", "pipeline = Pipeline.range(3).map(np.cbrt)"),
    ("import math\npipeline = Pipeline.range(3).map(math.sqrt)",
     "import math\npipeline = Pipeline.range(3).map(math.exp)"),
    # seeds
    ("pipeline = Pipeline.range(10).shuffle(4, seed=1)",
     "pipeline = Pipeline.range(10).shuffle(4, seed=2)"),
    ("pipeline = Pipeline.range(10).shuffle(4, seed=1)",
     "pipeline = Pipeline.range(10).shuffle(4)"),
    ("pipeline = Pipeline.range(10, shuffle_splits=True, seed=1)",
     "pipeline = Pipeline.range(10, shuffle_splits=True, seed=2)"),
    # stage arguments, kinds and order
    ("pipeline = Pipeline.range(10).batch(2)", "pipeline = Pipeline.range(10).batch(3)"),
    ("pipeline = Pipeline.range(10).batch(2)",
     "pipeline = Pipeline.range(10).batch(2, drop_remainder=True)"),
    ("pipeline = Pipeline.range(10).take(2)", "pipeline = Pipeline.range(10).skip(2)"),
    ("pipeline = Pipeline.range(10).take(2).skip(1)",
     "pipeline = Pipeline.range(10).skip(1).take(2)"),
    ("pipeline = Pipeline.range(10).shuffle(4, 1, True)",
     "pipeline = Pipeline.range(10).shuffle(4, 1, False)"),
    # source contents and splits
    ("pipeline = Pipeline.range(10)", "pipeline = Pipeline.range(11)"),
    ("pipeline = Pipeline.range(10)", "pipeline = Pipeline.range(10, split_size=3)"),
    ("pipeline = Pipeline.from_items([1, 2, 3])", "pipeline = Pipeline.from_items([1, 2, 4])"),
    ("pipeline = Pipeline.from_items([1, 2, 3])",
     "pipeline = Pipeline.from_items([1, 2, 3.0])"),
    ("pipeline = Pipeline.from_arrays(np.arange(5))",
     "pipeline = Pipeline.from_arrays(np.arange(5) * 2)"),
    ("pipeline = Pipeline.from_arrays(np.arange(5, dtype=np.int32))",
     "pipeline = Pipeline.from_arrays(np.arange(5, dtype=np.int64))"),
    ("pipeline = Pipeline.from_generator(lambda s: [s], ['a', 'b'])",
     "pipeline = Pipeline.from_generator(lambda s: [s], ['a', 'c'])"),
    # a global read by a class body (LOAD_NAME) inside the function
    ("K = 1\ndef f(x):\n    class C:\n        k = K\n    return x + C.k\n"
     "pipeline = Pipeline.range(3).map(f)",
     "K = 2\ndef f(x):\n    class C:\n        k = K\n    return x + C.k\n"
     "pipeline = Pipeline.range(3).map(f)"),
    # a global that shares its name with an attribute the code also uses
    ("upper = 1\npipeline = Pipeline.from_items(['a']).map(lambda s: s.upper() * upper)",
     "upper = 2\npipeline = Pipeline.from_items(['a']).map(lambda s: s.upper() * upper)"),
    # a function's own name (code can read it: registries, fn.__name__ in messages)
    ("def add_one(x):\n    return x + 1\npipeline = Pipeline.range(3).map(add_one)",
     "def plus_one(x):\n    return x + 1\npipeline = Pipeline.range(3).map(plus_one)"),
])
def test_semantic_changes_change_the_fingerprint(a, b):
    assert differ(a, b)


def test_file_content_changes_the_fingerprint(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("1\n2\n")
    source = "pipeline = Pipeline.from_files(PATH, lambda p: open(p).read().split())"
    before = build(source, PATH=str(path)).fingerprint
    assert build(source, PATH=str(path)).fingerprint == before
    path.write_text("1\n2\n3\n")
    assert build(source, PATH=str(path)).fingerprint != before


def test_a_moved_file_with_the_same_name_changes_the_fingerprint(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for sub in ("a", "b"):
        (tmp_path / sub / "data.txt").write_text("same")
    os.utime(tmp_path / "a" / "data.txt", ns=(1, 1))
    os.utime(tmp_path / "b" / "data.txt", ns=(1, 1))
    source = "pipeline = Pipeline.from_files(PATH, lambda p: [p])"
    a = build(source, PATH=str(tmp_path / "a" / "data.txt")).fingerprint
    b = build(source, PATH=str(tmp_path / "b" / "data.txt")).fingerprint
    assert a != b


def test_user_module_attributes_are_hashed(tmp_path, monkeypatch):
    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    monkeypatch.syspath_prepend(str(module_dir))
    fingerprints = []
    for factor, name in [(2, "usermod_a"), (3, "usermod_b"), (2, "usermod_c")]:
        (module_dir / f"{name}.py").write_text(f"def scale(x):\n    return x * {factor}\n")
        source = f"import {name} as m\npipeline = Pipeline.range(3).map(lambda x: m.scale(x))"
        fingerprints.append(build(source).fingerprint)
        sys.modules.pop(name, None)
    assert fingerprints[0] != fingerprints[1]
    assert fingerprints[0] == fingerprints[2]  # module name is not identity; its code is


# --- insensitivity ---------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [
    # object identity: the same definition built twice
    ("pipeline = Pipeline.range(10).map(lambda x: x + 1).batch(2)",
     "pipeline = Pipeline.range(10).map(lambda x: x + 1).batch(2)"),
    # the line a function is defined on, and the file it is in
    ("def f(x):\n    return x + 1\npipeline = Pipeline.range(3).map(f)",
     "\n\n\n# moved down\n\ndef f(x):\n    return x + 1\n\n\npipeline = Pipeline.range(3).map(f)"),
    # keyword argument order, in a stage call and in a partial
    ("pipeline = Pipeline.range(10).shuffle(seed=1, buffer_size=4)",
     "pipeline = Pipeline.range(10).shuffle(buffer_size=4, seed=1)"),
    ("import functools\ndef f(x, a, b):\n    return x + a - b\n"
     "pipeline = Pipeline.range(3).map(functools.partial(f, a=1, b=2))",
     "import functools\ndef f(x, a, b):\n    return x + a - b\n"
     "pipeline = Pipeline.range(3).map(functools.partial(f, b=2, a=1))"),
    # callable objects' attribute order
    ("class C:\n    def __call__(self, x):\n        return x + self.a + self.b\n"
     "c = C()\nc.a = 1\nc.b = 2\npipeline = Pipeline.range(3).map(c)",
     "class C:\n    def __call__(self, x):\n        return x + self.a + self.b\n"
     "c = C()\nc.b = 2\nc.a = 1\npipeline = Pipeline.range(3).map(c)"),
    # display names
    ("pipeline = Pipeline.range(3).map(lambda x: x, name='one')",
     "pipeline = Pipeline.range(3).map(lambda x: x, name='two')"),
    # aliasing: one object referenced twice hashes like two equal copies
    ("A = [1, 2]\nB = A\npipeline = Pipeline.range(3).map(lambda x: (A, B))",
     "A = [1, 2]\nB = [1, 2]\npipeline = Pipeline.range(3).map(lambda x: (A, B))"),
])
def test_irrelevant_changes_keep_the_fingerprint(a, b):
    assert not differ(a, b)


def test_fingerprint_survives_a_cloudpickle_round_trip():
    pipeline = build("""
        import functools
        SCALE = np.float32(0.5)
        def normalize(x, shift):
            return (x - shift) * SCALE
        pipeline = (Pipeline.from_arrays({"x": np.arange(12.0).reshape(6, 2)})
                    .map(lambda e: e["x"]).map(functools.partial(normalize, shift=1.0))
                    .shuffle(3, seed=4).batch(2))
    """)
    copy = cloudpickle.loads(cloudpickle.dumps(pipeline))
    assert copy.fingerprint == pipeline.fingerprint


def test_recursive_functions_and_cyclic_data_are_hashed():
    source = """
        def fact(n):
            return 1 if n <= 1 else n * fact(n - 1)
        CYCLE = [1]
        CYCLE.append(CYCLE)
        pipeline = Pipeline.range(5).map(lambda x: (fact(x), CYCLE[0]))
    """
    assert build(source).fingerprint == build(source).fingerprint
    assert build(source).shareable


@pytest.mark.parametrize("code", [
    "pipeline = Pipeline.from_items(['a']).map(lambda s: s.upper())",  # a method call
    "pipeline = Pipeline.from_items([{1: 2}]).map(lambda d: list(d.items()))",
    "pipeline = Pipeline.from_items(['a']).map(lambda s: s.upper)",  # a plain attribute
    "def f(x):\n    x.items = 1\n    return x\npipeline = Pipeline.range(3).map(f)",
    "def f(x):\n    del x.items\n    return x\npipeline = Pipeline.range(3).map(f)",
    # nested code: a comprehension, a nested function, a class body
    "pipeline = Pipeline.from_items([['a']]).map(lambda xs: [s.upper() for s in xs])",
    "def f(x):\n    def g(y):\n        return y.items()\n    return g(x)\n"
    "pipeline = Pipeline.from_items([{}]).map(f)",
    "def f(x):\n    class C:\n        v = x.items\n    return C.v\n"
    "pipeline = Pipeline.from_items([{}]).map(f)",
])
def test_attribute_names_are_not_global_lookups(code):
    """A global that merely shares its name with an attribute (``upper``, ``items``) is not
    a dependency: an unhashable one neither warns nor stops sharing, a changed one keeps
    the fingerprint."""
    name = "upper" if "upper" in code else "items"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FingerprintWarning)
        locked = build(code, **{name: threading.Lock()})
        assert locked.shareable
        assert build(code, **{name: 1}).fingerprint == build(code, **{name: 2}).fingerprint


# --- unshareable pipelines and version= ------------------------------------------------------

def test_unhashable_closure_value_warns_and_makes_the_pipeline_unshareable():
    def make():
        lock = threading.Lock()
        return Pipeline.range(3).map(lambda x: lock.locked() or x, name="guarded")

    first, second = make(), make()
    with pytest.warns(FingerprintWarning, match="guarded > closure variable 'lock'"):
        assert not first.shareable
    with pytest.warns(FingerprintWarning, match="lock"):
        assert first.fingerprint != second.fingerprint  # random: never a match
    assert len(first.fingerprint) == 64
    assert list(first) == [0, 1, 2]  # still runs


def _decode(x: int) -> int:
    return x * 2


def test_pipelines_that_begin_alike_have_equal_prefix_fingerprints():
    """Equal source and first stages, equal prefix fingerprints that far (what trainers
    have in common); then they differ; the last is the whole pipeline's fingerprint."""
    a = Pipeline.range(100).map(_decode).map(lambda x: x + 1).batch(10)
    b = Pipeline.range(100).map(_decode).shuffle(64, seed=7).batch(25)
    c = Pipeline.range(101).map(_decode)
    assert len(a.prefix_fingerprints) == 4 and a.prefix_fingerprints[-1] == a.fingerprint
    assert a.prefix_fingerprints[:2] == b.prefix_fingerprints[:2]
    assert a.prefix_fingerprints[2] != b.prefix_fingerprints[2]
    assert not set(c.prefix_fingerprints) & set(a.prefix_fingerprints)  # another source
    # a prefix's fingerprint is that pipeline's own
    assert a.prefix_fingerprints[1] == Pipeline.range(100).map(_decode).fingerprint
    assert Pipeline.range(3).prefix_fingerprints == (Pipeline.range(3).fingerprint,)


def test_prefix_fingerprints_are_sound_up_to_the_part_that_cannot_be_hashed():
    def make():
        lock = threading.Lock()
        return Pipeline.range(3).map(_decode).map(lambda x: lock.locked() or x, name="g")

    first, second = make(), make()
    with pytest.warns(FingerprintWarning, match="lock"):
        head, last = first.prefix_fingerprints[:2], first.prefix_fingerprints[2]
    with pytest.warns(FingerprintWarning, match="lock"):
        assert second.prefix_fingerprints[:2] == head  # sound before it
        assert second.prefix_fingerprints[2] != last  # random from it on
    assert last == first.fingerprint and not first.shareable


def test_unhashable_global_names_the_culprit():
    with open(os.devnull) as handle:
        pipeline = build("pipeline = Pipeline.range(3).map(lambda x: HANDLE.closed or x)",
                         HANDLE=handle)
        with pytest.warns(FingerprintWarning, match="global 'HANDLE'"):
            assert not pipeline.shareable


def test_generator_closure_is_unshareable():
    numbers = (i for i in range(3))
    pipeline = Pipeline.range(3).map(lambda x: next(numbers))
    with pytest.warns(FingerprintWarning, match="generator"):
        assert not pipeline.shareable


def test_version_pins_a_stage_identity():
    lock = threading.Lock()
    a = Pipeline.range(3).map(lambda x: lock.locked() or x, version="augment-v1")
    b = Pipeline.range(3).map(lambda x: x * 100, version="augment-v1")
    c = Pipeline.range(3).map(lambda x: x, version="augment-v2")
    assert a.shareable
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_version_on_a_source_skips_its_data():
    a = Pipeline.from_arrays(np.zeros(4), version="v1")
    b = Pipeline.from_arrays(np.ones(4), version="v1")
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != Pipeline.from_arrays(np.zeros(4)).fingerprint


def test_fingerprint_is_computed_once():
    calls = []

    class Counted:
        def __reduce_ex__(self, protocol):
            calls.append(protocol)
            return (Counted, ())

        def __call__(self, x):
            return x

    pipeline = Pipeline.range(3).map(Counted())
    assert pipeline.fingerprint == pipeline.fingerprint
    assert len(calls) == 1


# --- across processes ------------------------------------------------------------------------

SCRIPT = """
import functools, json, sys, zlib
import numpy as np
import torch
from zloader import Pipeline

TABLE = {"a": 1, "b": [2.5, None], "c": np.arange(4)}

class Scale:
    def __init__(self, k):
        self.k = k
    def __call__(self, x):
        return x * self.k

def decode(blob, shape):
    return np.frombuffer(zlib.decompress(blob), np.uint8).reshape(shape)

pipelines = {
    "lambda": Pipeline.range(100).map(lambda x: x + TABLE["a"]).filter(lambda x: x % 2),
    "closure": (lambda k: Pipeline.range(10).map(lambda x: x * k))(3),
    "objects": Pipeline.from_items([{"k": i} for i in range(5)]).map(Scale(2.0)).batch(2),
    "arrays": Pipeline.from_arrays({"x": np.arange(20.0).reshape(10, 2), "y": np.arange(10)})
                      .shuffle(4, seed=9).batch(3, drop_remainder=True),
    "partial": Pipeline.from_items([zlib.compress(bytes(12))])
                       .map(functools.partial(decode, shape=(2, 2, 3))),
    "files": Pipeline.from_files(sys.argv[1], lambda p: open(p).read().split()),
    "torch": Pipeline.from_torch(torch.utils.data.TensorDataset(torch.arange(6.0))),
    "numpy": Pipeline.range(4).map(np.sqrt).map(np.float32),
}
print(json.dumps({k: (p.fingerprint, p.shareable) for k, p in pipelines.items()}))
"""


def run_script(tmp_path, script: str, data_file, hash_seed: str) -> dict:
    path = tmp_path / f"script_{hash_seed}.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, str(path), str(data_file)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    import json
    return json.loads(done.stdout)


@pytest.mark.slow
def test_fingerprints_are_stable_across_interpreters(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("x y z")
    first = run_script(tmp_path, SCRIPT, data, "1")
    # Another process, another string-hash seed, and every definition on other lines.
    shifted = "\n# a comment\n\n" + SCRIPT.replace("\nclass Scale", "\n\n\n\nclass Scale")
    second = run_script(tmp_path, shifted, data, "2")
    assert first == second
    assert all(shareable for _, shareable in first.values())
    assert len({fp for fp, _ in first.values()}) == len(first)


def test_partial_and_method_identity_in_process():
    def f(x, a):
        return x + a

    class Holder:
        def __init__(self, a):
            self.a = a

        def add(self, x):
            return x + self.a

    p1 = Pipeline.range(3).map(functools.partial(f, a=1))
    p2 = Pipeline.range(3).map(functools.partial(f, a=1))
    assert p1.fingerprint == p2.fingerprint
    assert (Pipeline.range(3).map(Holder(1).add).fingerprint
            != Pipeline.range(3).map(Holder(2).add).fingerprint)


def test_bucket_by_length_arguments_are_part_of_the_fingerprint():
    def length(x):
        return x

    base = Pipeline.range(10).bucket_by_length(length, [3, 6], [2, 2, 2])
    same = Pipeline.range(10).bucket_by_length(length, (3, 6), (2, 2, 2))
    assert base.fingerprint == same.fingerprint
    for other in (Pipeline.range(10).bucket_by_length(length, [3, 7], [2, 2, 2]),
                  Pipeline.range(10).bucket_by_length(length, [3, 6], [2, 2, 3]),
                  Pipeline.range(10).bucket_by_length(length, [3, 6], [2, 2, 2], pad_value=1),
                  Pipeline.range(10).bucket_by_length(length, [3, 6], [2, 2, 2],
                                                      drop_remainder=True),
                  Pipeline.range(10).bucket_by_length(lambda x: x + 1, [3, 6], [2, 2, 2])):
        assert other.fingerprint != base.fingerprint
