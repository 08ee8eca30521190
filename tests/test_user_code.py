"""User code that fails in unusual ways: every failure reaches the consumer as a
PipelineError naming the stage and the element, nothing hangs, the worker survives."""

from __future__ import annotations

import socket
import textwrap
import threading
import time
import warnings

import pytest
from service import service, status

from zloader import FingerprintWarning, Loader, Pipeline, PipelineError, ZloaderError

BASE_EXCEPTIONS = [SystemExit, KeyboardInterrupt, GeneratorExit]


def _raise_at(kind: type[BaseException], at: int):
    def fn(x):
        if x == at:
            raise kind("user code gave up")
        return x
    return fn


def _generate_raising(kind: type[BaseException]):
    def fn(split):
        yield split
        raise kind("user generator gave up")
    return fn


def _pipelines(kind: type[BaseException]) -> dict[str, Pipeline]:
    """One pipeline per place user code runs, each raising ``kind``."""
    return {
        "map(boom)": Pipeline.range(8).map(_raise_at(kind, 5), name="map(boom)"),
        "map(pool)": Pipeline.range(8).map(_raise_at(kind, 5), num_parallel_calls=3,
                                           name="map(pool)"),
        "gen": Pipeline.from_generator(_generate_raising(kind), 4, name="gen"),
    }


def _consume(loader: Loader) -> PipelineError:
    with pytest.raises(PipelineError) as info:
        list(loader)
    return info.value


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_base_exceptions_in_user_code_arrive_as_pipeline_errors_naming_the_stage():
    # In this process: SystemExit and GeneratorExit are the stage's failures; a
    # KeyboardInterrupt on the main thread may be Ctrl-C and stays one (raised by a map's
    # thread it cannot be, so it is the stage's failure too).
    for kind in BASE_EXCEPTIONS:
        for stage, pipeline in _pipelines(kind).items():
            if kind is KeyboardInterrupt and stage != "map(pool)":
                with pytest.raises(KeyboardInterrupt):
                    list(pipeline)
                continue
            with pytest.raises(PipelineError) as info:
                list(pipeline)
            assert info.value.stage == stage and kind.__name__ in info.value.exc_type
    # Embedded workers: each kind, each place, in one Loader per kind.
    for kind in BASE_EXCEPTIONS:
        for stage, pipeline in _pipelines(kind).items():
            with Loader(pipeline, num_workers=1, timeout=30) as loader:
                start = time.monotonic()
                error = _consume(loader)
                assert error.stage == stage and error.exc_type == kind.__name__
                assert "gave up" in error.message and time.monotonic() - start < 30
    # Through a broker: the worker process survives and serves the next job.
    with service(workers=1) as (address, procs):
        with Loader(_pipelines(SystemExit)["map(boom)"], broker=address,
                    timeout=30) as loader:
            assert _consume(loader).stage == "map(boom)"
        with Loader(Pipeline.range(8), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(8))
        assert procs[0].poll() is None and len(status(address)["workers"]) == 1


@pytest.mark.timeout(90)
def test_base_exceptions_in_a_torch_dataset_arrive_as_pipeline_errors():
    torch = pytest.importorskip("torch")
    import zloader.torch as zt

    class Quits(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int):
            if i == 5:
                raise SystemExit("dataset gave up")
            return i

    loader = zt.DataLoader(Quits(), batch_size=2, num_workers=2)
    try:
        with pytest.raises(PipelineError) as info:
            list(loader)
        assert info.value.stage == "dataset" and "index 5" in str(info.value)
        assert info.value.exc_type == "SystemExit"
    finally:
        loader.close()


def _fail_at_13(x):
    if x == 13:
        raise ValueError("thirteen")
    return x


_RAISE_LINE = _fail_at_13.__code__.co_firstlineno + 2


class _Items:
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        return i


def _lines(path: str):
    with open(path) as handle:
        for line in handle:
            yield int(line)


def test_worker_errors_name_the_failing_elements_source_and_the_users_line(tmp_path):
    files = []
    for name, numbers in (("a.txt", range(0, 10)), ("b.txt", range(10, 20))):
        files.append(tmp_path / name)
        files[-1].write_text("".join(f"{n}\n" for n in numbers))
    cases = [  # (pipeline, Loader options, what the error must say)
        (Pipeline.range(20, split_size=5).map(_fail_at_13), {}, "split 2, index 3"),
        (Pipeline.range(20, split_size=5).shuffle(8, seed=1).map(_fail_at_13), {},
         "split 2, index 3"),
        (Pipeline.range(20, split_size=5).map(_fail_at_13), {"exactly_once": False},
         "split 2, index 3"),
        (Pipeline.range(20, split_size=5).map(_fail_at_13, num_parallel_calls=4),
         {"exactly_once": False}, "split 2, index 3"),
        (Pipeline.from_files(sorted(map(str, files)), _lines).map(_fail_at_13), {},
         f"file {files[1]}, index 3"),
        (Pipeline.from_torch(_Items(), split_size=4).map(_fail_at_13), {},
         "dataset index 13"),
    ]
    for pipeline, options, where in cases:
        with pytest.raises(ValueError) as in_process:
            list(pipeline)
        assert where in str(in_process.value) or "shuffle" in repr(pipeline)
        with Loader(pipeline, num_workers=1, timeout=30, **options) as loader:
            error = _consume(loader)
        assert where in error.context and where in str(error)
        assert error.stage == "map(_fail_at_13)"
        assert f'File "{__file__}", line {_RAISE_LINE}, in _fail_at_13' in error.traceback
        assert "<dynamic-code>" not in error.traceback


def _set_at_13(x):
    return {x} if x == 13 else x  # a set: the codec cannot send it


def test_elements_that_cannot_be_encoded_are_skipped_or_named_by_their_source():
    pipeline = Pipeline.range(20, split_size=5).map(_set_at_13, name="to_set")
    for options in ({}, {"exactly_once": False}):
        with Loader(pipeline, num_workers=1, on_error="skip", timeout=30, **options) as loader:
            for _ in range(2):  # every epoch, and the job goes on after the skip
                assert sorted(loader) == [x for x in range(20) if x != 13]
                assert loader.stats()["skipped"] == 1  # counted per epoch
        with Loader(pipeline, num_workers=1, timeout=30, **options) as loader:
            error = _consume(loader)
        assert error.stage == "to_set" and isinstance(error, ValueError)
        assert "split 2, index 3" in error.context and "builtins.set" in error.message
        assert "element[" not in error.message  # not its position in a record


def _user_module_pipeline(code: str, **namespace) -> Pipeline:
    """Run ``code`` as a user module of its own (its functions travel by value)."""
    ns = {"__name__": "user_pipeline", "Pipeline": Pipeline, **namespace}
    exec(compile(textwrap.dedent(code), "user.py", "exec"), ns)
    return ns["pipeline"]


def test_an_unpicklable_pipeline_names_the_stage_and_the_captured_value():
    lock = threading.Lock()

    def guarded(x):
        with lock:
            return x

    with socket.socket() as sock:
        cases = [  # (pipeline, what the error must name)
            (Pipeline.range(4).map(abs).map(guarded, name="locked"),
             ["stage 2", "'locked'", "map", "closure variable 'lock'", "_thread.lock"]),
            (_user_module_pipeline(
                "pipeline = Pipeline.range(4).filter(lambda x: SOCK.fileno() or x)",
                SOCK=sock),
             ["stage 1", "filter(<lambda>)", "global 'SOCK'", "socket.socket"]),
            (_user_module_pipeline(
                "def f(x, numbers=(i for i in range(3))):\n    return x\n"
                "pipeline = Pipeline.range(4).map(f)"),
             ["stage 1", "'map(f)'", "default 'numbers'", "generator"]),
            (Pipeline.from_generator(lambda split: guarded([split]), 2, name="gen"),
             ["source", "'gen'", "from_generator", "closure variable 'lock'"]),
        ]
        for pipeline, names in cases:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FingerprintWarning)
                with pytest.raises(TypeError) as info:  # spawned workers need it pickled
                    Loader(pipeline, num_workers=1, timeout=30, start_method="spawn")
            assert isinstance(info.value, ZloaderError)
            for name in names:
                assert name in str(info.value)
