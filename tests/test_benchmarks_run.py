"""The benchmark suites and the report still run (smoke mode: one small shape, one round)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_suites_and_report_run(tmp_path):
    env = {**os.environ, "DACA_BENCH_SMOKE": "1", "DACA_BENCH_RESULTS": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)  # benchmarks measure the CPU fallback path, not the interpreter
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "-q", "-p", "no:cacheprovider", "-o", "python_files=bench_*.py"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (jsonl,) = tmp_path.glob("*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    ops = {r["op"] for r in rows}
    assert {"gather_logprob", "linear_logprob", "sample_step", "sample_step_linear", "rollout", "dps_bookkeeping", "stratified_mask"} <= ops
    for r in rows:
        assert r["ms"] > 0 and r["device"] and r["torch"] and r["commit"]
        assert (r.get("gbps") or 0) > 0 or (r.get("tflops") or 0) > 0
    report = subprocess.run(
        [sys.executable, "benchmarks/report.py", "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "REPORT.md").read_text()
    assert "gather_logprob" in text and list(tmp_path.glob("*.png"))
