"""The benchmark harness: every suite still runs (smoke size, by run.py and under pytest-benchmark),
each row is held to a ceiling measured beside it, the report refuses rows it cannot trust and reads
pytest-benchmark files, the dirty check looks only at the measured source, the committed rows are
trustworthy, and the GPU entry points behave on a CPU machine."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import download_wheels  # noqa: E402
from results import RESULTS_DIR, ROWS_FILE, commit_and_dirty, device_dir, load_rows  # noqa: E402

OPS = {"gather_logprob", "linear_logprob", "sample_step", "sample_step_linear", "rollout", "dps_bookkeeping",
       "stratified_mask", "estimator_head"}


def _python(*args, env=None):
    # A child pytest that sees xdist's worker variables would take itself for a worker.
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)


def test_every_suite_runs_and_the_report_renders(tmp_path):
    run = _python("benchmarks/run.py", "--size", "smoke", "--results", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (folder,) = [p.parent for p in tmp_path.glob(f"*/{ROWS_FILE}")]
    rows = load_rows(folder / ROWS_FILE)
    failed = [r for r in rows if "skipped" in r and r["provider"] not in ("liger", "cce")]  # third-party APIs may move
    assert not failed, failed
    assert OPS <= {r["op"] for r in rows}
    ceilings = {r["provider"]: r for r in rows if r["op"] == "ceiling"}
    assert set(ceilings) == {"copy", "read", "matmul"}
    cases = [r for r in rows if r["op"] != "ceiling"]
    for r in rows:
        assert r["device"] and r["torch"] and r["commit"] and isinstance(r["dirty"], bool)
        assert 0 < r["ms_p20"] <= r["ms"] <= r["ms_p80"], r
        counted = [k for k in ("bytes", "flops") if r.get(k)]
        assert len(counted) == 1 and r[f"{counted[0]}_formula"], r
    for r in cases:
        # Each row is held to its own ceiling, measured beside it: flops to matmul, bytes only read
        # (a forward gather, a sampling step) to read, other bytes to copy.
        expected = "matmul" if r.get("flops") else ("read" if r["mode"] == "fwd" and r["op"] in ("gather_logprob", "sample_step") else "copy")
        assert r["ceiling"] == expected, r
        rate = r["tflops" if expected == "matmul" else "gbps"]
        assert r["pct_of_ceiling"] == pytest.approx(100 * rate / r["ceiling_rate"]), r
        assert r.get("command", "").startswith("python benchmarks/run.py --size smoke"), r
    for name, c in ceilings.items():
        assert c["measurements"] == sum(r["ceiling"] == name for r in cases)  # one beside every row it judges
        assert c["rate_min"] <= c["rate_median"] <= c["rate_max"]
    trl = {"trl"} if importlib.util.find_spec("trl") else set()  # TRL's chunked head, where installed
    assert {r["provider"] for r in cases if r["op"] == "linear_logprob"} >= {"daca", "eager"} | trl
    report = _python("benchmarks/report.py", "--results", str(folder), "--allow-dirty", "--allow-over-ceiling")
    assert report.returncode == 0, report.stderr
    text = (folder / "REPORT.md").read_text()
    assert rows[0]["device"] in text and rows[0]["commit"] in text and "## Ceilings" in text
    assert all(f"## {op}" in text for op in OPS)
    assert "| read " in text and "measurements)" in text
    if importlib.util.find_spec("matplotlib"):
        assert len(list(folder.glob("*.png"))) >= len(OPS)
    else:  # tables only, and the report says so
        assert not list(folder.glob("*.png")) and "Charts left out: matplotlib is not installed" in text


def test_the_matmul_ceiling_is_the_best_of_squares_and_the_case_s_products_measured_around_it(monkeypatch):
    import ceilings
    from case import Case, Work, head_gemms

    gemms = head_gemms(8, 40, 16, "fwd+bwd")
    assert gemms == ((8, 40, 16), (8, 16, 40), (40, 16, 8))
    cpu = torch.device("cpu")
    assert ceilings.matmul_shapes(cpu, "quick", gemms) == [(1024, 1024, 1024), (2048, 2048, 2048), *gemms]
    measured = ceilings.measure_ceiling("matmul", cpu, "smoke", gemms)
    assert set(measured["candidates"]) == {"m=256,n=256,k=256", "m=8,n=40,k=16", "m=8,n=16,k=40", "m=40,n=16,k=8"}
    assert measured["tflops"] == max(measured["candidates"].values())
    assert measured["shape"] in measured["candidates"] and measured["flops"] > 0
    # Around a case: once before, once after, the better kept.
    case = Case("op", "fwd", "daca", "N=8", "float32", lambda: None, flops=Work("2*N*V*H", 1), gemms=gemms)
    calls, rates = [], iter([2.0, 3.0])

    def fake(name, device, size, shapes):
        assert (name, shapes) == ("matmul", gemms)
        calls.append("ceiling")
        return {"provider": "matmul", "tflops": next(rates)}

    monkeypatch.setattr(ceilings, "measure_ceiling", fake)
    value, ceiling = ceilings.around(case, cpu, "quick", lambda: calls.append("case") or "timed")
    assert value == "timed" and calls == ["ceiling", "case", "ceiling"]
    assert ceiling["tflops"] == 3.0 and ceiling["around"] == [2.0, 3.0]
    with pytest.raises(ValueError, match="gemms apply to rows counted in FLOPs"):
        Case("op", "fwd", "daca", "N=8", "float32", lambda: None, bytes=Work("N", 1), gemms=gemms)


def test_the_gpu_benchmarks_time_triton_s_gemm_against_the_library_s_on_a_chunk_of_the_modelled_head():
    # The head_gemm rows (a GPU only) give the fraction the static model assumes: the fused
    # forward's kernel on one vocabulary chunk of the head it models, and the library's GEMM of
    # the same product, both held to a matmul ceiling that includes that product; timed early.
    import bench_logprob

    from daca_kernels.kernels.linear_logprob import BLOCK_V
    from daca_kernels.ops.linear_logprob import default_vocab_chunk
    from daca_kernels.tools.roofline import LLADA

    cases = bench_logprob.cases("full", torch.device("cuda"))
    rows = [c for c in cases if c.op == "head_gemm"]
    chunk = default_vocab_chunk(LLADA.vocab, LLADA.hidden, torch.bfloat16)
    assert chunk == LLADA.vocab_chunk and {c.provider for c in rows} == {"daca", "library"}
    for c in rows:
        assert (c.mode, c.dtype, c.shape) == ("fwd", "bfloat16", f"N={LLADA.rows},C={chunk},H={LLADA.hidden}")
        assert c.flops.value == 2 * LLADA.rows * chunk * LLADA.hidden
        assert c.gemms == ((LLADA.rows, chunk, LLADA.hidden),)
        assert c.priority < min(o.priority for o in cases if o.op == "linear_logprob")
    assert not [c for c in bench_logprob.cases("quick", torch.device("cpu")) if c.op == "head_gemm"]
    # Both providers compute the same product (here under the interpreter, at a toy shape): the
    # kernel's block maxima are the maxima of the library's logits, to the library's bfloat16 output.
    n, chunk, hidden_size = 5, 200, 32
    cpu = torch.device("cpu")
    logits = bench_logprob._head_gemm_setup("library", n, chunk, hidden_size, torch.bfloat16, cpu)()()
    parts = bench_logprob._head_gemm_setup("daca", n, chunk, hidden_size, torch.bfloat16, cpu)()()
    blocks = logits.float().split(BLOCK_V, dim=1)
    assert logits.shape == (n, chunk) and parts.shape == (3, len(blocks), n)
    for b, block in enumerate(blocks):
        torch.testing.assert_close(parts[1, b], block.max(-1).values, rtol=2**-7, atol=1e-3)


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


def test_report_accepts_a_read_only_row_faster_than_a_copy(tmp_path):
    # On an H100 a kernel that only reads streams faster than a read+write copy: legitimate when
    # held to the read ceiling, refused when above it.
    rows = [
        _row("ceiling", "copy", bytes=2 * 10**6, bytes_formula="2*bytes", gbps=2.0),
        _row("ceiling", "read", bytes=10**6, bytes_formula="bytes", gbps=4.0),
        _row("gather_logprob", "daca", bytes=3 * 10**6, bytes_formula="N*V*s", gbps=3.0, ceiling="read",
             ceiling_rate=4.0, pct_of_ceiling=75.0),
    ]
    (tmp_path / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    accepted = _python("benchmarks/report.py", "--results", str(tmp_path))
    assert accepted.returncode == 0, accepted.stderr
    assert "| read 4.0 | 75.0 |" in (tmp_path / "REPORT.md").read_text()
    rows[2].update(gbps=5.0, pct_of_ceiling=125.0)
    (tmp_path / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused = _python("benchmarks/report.py", "--results", str(tmp_path))
    assert refused.returncode == 1 and "above 100% of its ceiling: gather_logprob" in refused.stderr


def test_report_without_matplotlib_writes_the_tables_and_says_so(tmp_path):
    broken = tmp_path / "site" / "matplotlib"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    folder = tmp_path / "results"
    folder.mkdir()
    rows = [_row("ceiling", "matmul", flops=10**9, flops_formula="2*n^3", tflops=1.0),
            _row("linear_logprob", "daca", flops=10**8, flops_formula="2*N*V*H", tflops=0.1, pct_of_ceiling=10.0)]
    (folder / ROWS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _python("benchmarks/report.py", "--results", str(folder), env={**os.environ, "PYTHONPATH": str(broken.parent)})
    assert result.returncode == 0, result.stderr
    assert "without charts" in result.stderr
    text = (folder / "REPORT.md").read_text()
    assert "## linear_logprob: fwd" in text and "matplotlib is not installed" in text
    assert not list(folder.glob("*.png"))


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_dirty_flag_looks_only_at_the_measured_source(tmp_path, monkeypatch):
    monkeypatch.delenv("DACA_BENCH_COMMIT", raising=False)
    for path in ("daca_kernels/op.py", "benchmarks/run.py", "benchmarks/results/cpu/rows.jsonl", "README.md",
                 "integration/results/demo.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "x")
    assert commit_and_dirty(tmp_path)[1] is False
    # What `make demo` and the benchmarks themselves write, and edits outside the measured source.
    (tmp_path / "integration/results/demo.md").write_text("new run\n")
    (tmp_path / "integration/results/curves.png").write_text("new\n")
    (tmp_path / "benchmarks/results/cpu/rows.jsonl").write_text("new rows\n")
    (tmp_path / "README.md").write_text("edited\n")
    assert commit_and_dirty(tmp_path)[1] is False
    (tmp_path / "benchmarks/new_suite.py").write_text("untracked\n")
    assert commit_and_dirty(tmp_path)[1] is True
    (tmp_path / "benchmarks/new_suite.py").unlink()
    (tmp_path / "daca_kernels/op.py").write_text("edited\n")
    assert commit_and_dirty(tmp_path)[1] is True


@pytest.mark.skipif(importlib.util.find_spec("pytest_benchmark") is None, reason="pytest-benchmark is not installed")
def test_pytest_benchmark_runs_saves_compares_and_reports(tmp_path):
    pick = ["-k", "linear_logprob-fwd-trl or gather_logprob-fwd-eager", "--bench-size", "smoke"]
    common = ["-m", "pytest", "benchmarks/test_suites.py", "--benchmark-only", "-p", "no:cacheprovider", "-q",
              f"--benchmark-storage=file://{tmp_path / 'storage'}", *pick]
    first = _python(*common, "--benchmark-autosave", f"--benchmark-json={tmp_path / 'run.json'}")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    data = json.loads((tmp_path / "run.json").read_text())
    rows = {b["extra_info"]["provider"]: b["extra_info"] for b in data["benchmarks"]}
    assert set(rows) == {"trl", "eager"}
    assert rows["trl"]["flops_formula"] == "2*N*V*H" and rows["trl"]["ceiling"] == "matmul"
    assert rows["eager"]["bytes_formula"] == "N*V*s" and rows["eager"]["ceiling"] == "read"
    for b in data["benchmarks"]:
        assert b["extra_info"]["ms"] == pytest.approx(b["stats"]["median"] * 1e3)
        assert b["stats"]["rounds"] >= 1
    second = _python(*common, "--benchmark-compare")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "0001" in second.stdout + second.stderr  # compared against the first, saved run
    report = _python("benchmarks/report.py", "--benchmark-json", str(tmp_path / "run.json"), "--out", str(tmp_path / "report"),
                     "--allow-dirty", "--allow-over-ceiling")
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report" / "REPORT.md").read_text()
    assert "## linear_logprob: fwd" in text and "## gather_logprob: fwd" in text and "| read " in text


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


def test_gpu_report_cpu_check_runs_the_steps_on_cpu(tmp_path, monkeypatch):
    # --cpu-check: the gpu test bodies on CPU without a deadline, smoke benchmarks on CPU into the
    # given folder, its report accepting a dirty tree; the committed results are never written.
    import gpu_report

    ran = []
    monkeypatch.setattr(gpu_report, "_step", lambda title, command, timeout_s=None, env=None: ran.append((title, command, timeout_s, env)) or 0)
    assert gpu_report.report(9.0, torch.device("cpu"), tmp_path) == 0
    (tests, tests_cmd, timeout, env), (bench, bench_cmd, _, _), (report, report_cmd, _, _) = ran
    assert (tests, bench, report) == ("gpu tests", "benchmarks", "report")
    assert env == {"DACA_GPU_TESTS_ON_CPU": "1"} and timeout is None
    assert tests_cmd[1:5] == ["-m", "pytest", "-m", "gpu"] and "tests/gpu/test_gpu_logprob.py" in tests_cmd
    assert bench_cmd[1:] == ["benchmarks/run.py", "--size", "smoke", "--device", "cpu", "--results", str(tmp_path)]
    assert report_cmd[-3:] == ["--results", str(device_dir(torch.device("cpu"), tmp_path)), "--allow-dirty"]


def test_gpu_install_and_wheel_download_commands():
    import gpu_report

    # The project is never installed (it runs from PYTHONPATH); only local wheels are.
    wheel = Path("benchmarks/wheels/liger_kernel-0.0-py3-none-any.whl")
    (wheels,) = gpu_report.install_commands([wheel])
    assert wheels[2:] == ["pip", "install", "--no-deps", "--no-index", str(wheel)]
    assert gpu_report.install_commands([]) == []
    command = download_wheels.download_command(Path("dest"))
    assert command[2:6] == ["pip", "download", "--no-deps", "--only-binary=:all:"]
    assert command[-4:] == ["--dest", "dest", "liger-kernel", "cut-cross-entropy"]


def test_gpu_report_leaves_out_test_files_whose_imports_are_missing(tmp_path):
    import gpu_report

    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text("import pytest\nimport torch\nimport helper_ok\n")
    (tests / "helper_ok.py").write_text("import torch\n")
    (tests / "helper_optional.py").write_text("import not_installed_plotting\n")
    (tests / "package_ok").mkdir()
    (tests / "package_ok" / "__init__.py").write_text("import torch\n")
    (tests / "gpu").mkdir()
    marked = "\n@pytest.mark.gpu\ndef test_x():\n    pass\n"
    (tests / "gpu" / "test_gpu_fine.py").write_text("import pytest\nfrom daca_kernels import gather_logprob\n"
                                                    "import helper_ok\nfrom package_ok import x\n" + marked)
    (tests / "gpu" / "test_gpu_helper_needs.py").write_text("import pytest\nimport helper_optional\n" + marked)
    (tests / "test_marked.py").write_text("import pytest\nfrom not_installed_hypothesis import given\n" + marked)
    (tests / "test_cpu_only.py").write_text("import not_installed_other\n")
    files, left_out = gpu_report.gpu_test_files(tests)
    assert files == [tests / "gpu" / "test_gpu_fine.py"]
    assert left_out == {tests / "gpu" / "test_gpu_helper_needs.py": ["not_installed_plotting"],
                        tests / "test_marked.py": ["not_installed_hypothesis"]}
