"""The benchmark harness: every suite still runs (smoke size), the report refuses rows it cannot
trust, the committed rows are trustworthy, and the GPU entry points behave on a CPU machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import download_wheels  # noqa: E402
from results import RESULTS_DIR, ROWS_FILE, load_rows  # noqa: E402

OPS = {"gather_logprob", "linear_logprob", "sample_step", "sample_step_linear", "rollout", "dps_bookkeeping",
       "stratified_mask", "estimator_head"}


def _python(*args, env=None):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)


def test_every_suite_runs_and_the_report_renders(tmp_path):
    run = _python("benchmarks/run.py", "--size", "smoke", "--results", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (folder,) = [p.parent for p in tmp_path.glob(f"*/{ROWS_FILE}")]
    rows = load_rows(folder / ROWS_FILE)
    failed = [r for r in rows if "skipped" in r and r["provider"] not in ("liger", "cce")]  # third-party APIs may move
    assert not failed, failed
    assert OPS <= {r["op"] for r in rows}
    assert {r["provider"] for r in rows if r["op"] == "ceiling"} == {"copy", "matmul"}
    for r in rows:
        assert r["device"] and r["torch"] and r["commit"] and isinstance(r["dirty"], bool)
        assert 0 < r["ms_p20"] <= r["ms"] <= r["ms_p80"], r
        counted = [k for k in ("bytes", "flops") if r.get(k)]
        assert len(counted) == 1 and r[f"{counted[0]}_formula"], r
        if r["op"] != "ceiling":
            assert r["pct_of_ceiling"] > 0
    report = _python("benchmarks/report.py", "--results", str(folder), "--allow-dirty", "--allow-over-ceiling")
    assert report.returncode == 0, report.stderr
    text = (folder / "REPORT.md").read_text()
    assert rows[0]["device"] in text and rows[0]["commit"] in text and "## Ceilings" in text
    assert all(f"## {op}" in text for op in OPS)
    assert len(list(folder.glob("*.png"))) >= len(OPS)


def _row(op, provider, dirty=False, **fields):
    return {"op": op, "mode": "fwd", "provider": provider, "shape": "N=1", "dtype": "float32", "device": "CPU test",
            "torch": "t", "triton": "t", "commit": "abc123", "dirty": dirty, "timestamp": "2026-01-01T00:00:00Z",
            "ms": 1.0, "ms_p20": 0.9, "ms_p80": 1.1, **fields}


def test_report_refuses_rows_above_their_ceiling_and_from_a_dirty_tree(tmp_path):
    rows = [
        _row("ceiling", "copy", bytes=2 * 10**6, bytes_formula="2*bytes", gbps=2.0),
        _row("ceiling", "matmul", flops=10**9, flops_formula="2*n^3", tflops=1.0),
        _row("fast_op", "daca", bytes=3 * 10**6, bytes_formula="N*V*s", gbps=3.0, pct_of_ceiling=150.0),
        _row("dirty_op", "daca", dirty=True, flops=10**8, flops_formula="2*N*V*H", tflops=0.1, pct_of_ceiling=10.0),
    ]
    (tmp_path / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused = _python("benchmarks/report.py", "--results", str(tmp_path))
    assert refused.returncode == 1
    assert "above 100% of its ceiling: fast_op" in refused.stderr and "from a dirty tree: dirty_op" in refused.stderr
    text = (tmp_path / "REPORT.md").read_text()
    assert "**ABOVE CEILING**" in text and "**DIRTY TREE**" in text
    assert _python("benchmarks/report.py", "--results", str(tmp_path), "--allow-dirty").returncode == 1
    accepted = _python("benchmarks/report.py", "--results", str(tmp_path), "--allow-dirty", "--allow-over-ceiling")
    assert accepted.returncode == 0, accepted.stderr


def test_committed_rows_are_from_a_clean_tree_and_within_their_ceilings():
    folders = sorted(p.parent for p in RESULTS_DIR.glob(f"*/{ROWS_FILE}"))
    assert folders, "no committed benchmark rows"
    for folder in folders:
        rows = load_rows(folder / ROWS_FILE)
        measured = [r for r in rows if "skipped" not in r]
        assert measured and all(not r["dirty"] and r["commit"] != "unknown" for r in rows), folder
        assert all((r.get("pct_of_ceiling") or 0) <= 100 for r in measured), folder
        assert all(r.get("bytes_formula") or r.get("flops_formula") or r.get("peak_formula") for r in measured)
        text = (folder / "REPORT.md").read_text()
        assert rows[0]["device"] in text and rows[0]["commit"] in text and "ABOVE CEILING" not in text


def test_gpu_report_without_cuda_exits_2_with_a_message():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = _python("benchmarks/gpu_report.py", env=env)
    assert result.returncode == 2
    assert "needs a CUDA device" in result.stderr


def test_gpu_report_without_torch_exits_2_with_a_message():
    # `make gpu-report` runs the machine's own python3, which may have no torch (python -S: no site-packages).
    result = subprocess.run([sys.executable, "-S", "benchmarks/gpu_report.py"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "cannot import torch" in result.stderr and "GPU_PYTHON" in result.stderr


def test_gpu_install_and_wheel_download_commands():
    import gpu_report

    wheel = Path("benchmarks/wheels/liger_kernel-0.0-py3-none-any.whl")
    project, wheels = gpu_report.install_commands([wheel])
    assert project[2:] == ["pip", "install", "--no-deps", "--no-build-isolation", "-e", str(ROOT)]
    assert wheels[2:] == ["pip", "install", "--no-deps", "--no-index", str(wheel)]
    assert gpu_report.install_commands([]) == [project]
    command = download_wheels.download_command(Path("dest"))
    assert command[2:6] == ["pip", "download", "--no-deps", "--only-binary=:all:"]
    assert command[-4:] == ["--dest", "dest", "liger-kernel", "cut-cross-entropy"]
