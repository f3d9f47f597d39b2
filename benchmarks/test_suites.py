"""The benchmark suites under pytest-benchmark: one test per case of ``bench_*.py``.

    pytest benchmarks/ --benchmark-only                            # quick shapes on CPU, full on CUDA
    pytest benchmarks/ --benchmark-only --benchmark-autosave       # the run saved under .benchmarks/
    pytest benchmarks/ --benchmark-only --benchmark-compare        # against the latest saved run
    pytest benchmarks/ --benchmark-only --benchmark-json=run.json  # then: python benchmarks/report.py --benchmark-json run.json

``--bench-size smoke|quick|full`` and ``--bench-device`` choose the cases; ``-k linear_logprob``
picks some. Each case is timed as ``run.py`` times it (``timing.py``): pedantic mode with the
plan's rounds, its clock (CUDA events on a GPU, waited for) and its L2 flush before every round;
the ceiling the case is held to is measured before and after it (``ceilings.py``). The case's row (counted work,
rate, ceiling, stamp) goes into ``extra_info``, so a saved file is all ``report.py`` needs.
"""
import pytest

pytest.importorskip("pytest_benchmark", reason="the benchmark suite needs pytest-benchmark (pip install pytest-benchmark)")

import run  # noqa: E402
import torch  # noqa: E402
from ceilings import better, held_to, judged, measure_ceiling  # noqa: E402
from conftest import bench_device, bench_size  # noqa: E402
from results import environment_stamp  # noqa: E402
from timing import Timing, budget, peak_mb, plan  # noqa: E402

_CASES: dict = {}


def pytest_generate_tests(metafunc):
    if "case_name" in metafunc.fixturenames:
        cases = run.cases(bench_size(metafunc.config), bench_device(metafunc.config))
        _CASES.update((c.name, c) for c in cases)
        metafunc.parametrize("case_name", [c.name for c in cases])


@pytest.fixture(scope="session")
def stamp(device, size) -> dict:
    return {**environment_stamp(device), "size": size}


def test_case(benchmark, case_name, device, size, stamp):
    case = _CASES[case_name]
    benchmark.group = f"{case.op} {case.mode} {case.shape}"
    before = None if benchmark.disabled else measure_ceiling(held_to(case), device, size, case.gemms)
    try:
        call = case.setup()
        if benchmark.disabled:  # --benchmark-disable: one call, a check that the case runs
            call()
            return
        p = plan(call, device, **budget(size))
        # pytest-benchmark reads its clock from this attribute (no public setter); on CUDA it must
        # be the device's timeline, not the host's.
        benchmark._timer = p.clock
        benchmark.pedantic(call, setup=p.flush, rounds=p.rounds)
        peak = peak_mb(call, device)
    except torch.cuda.OutOfMemoryError as error:
        pytest.skip(f"out of memory: {str(error).splitlines()[0]}")
    finally:
        call = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    timing = Timing.of_seconds(benchmark.stats.stats.data)
    ceiling = better(before, measure_ceiling(held_to(case), device, size, case.gemms))  # measured around the case
    benchmark.extra_info.update(judged(case, timing, ceiling, peak), **stamp, ceiling_measurement=ceiling)
