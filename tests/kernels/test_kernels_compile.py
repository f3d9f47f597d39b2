"""Every Triton kernel compiles for real NVIDIA targets (sm_80, sm_90) at every launch configuration,
without spilling, on a CPU machine.

The interpreter accepts kernels that no GPU compiler will, so the CPU suite also compiles them ahead
of time (``daca_kernels.tools.ahead_of_time``: PTX and cubins from the ptxas bundled with triton).
It runs in a subprocess because this process imported the kernels for the interpreter.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from daca_kernels.tools.ahead_of_time import compiler_internals_missing

pytestmark = pytest.mark.slow

# The compile drives triton's compiler internals of triton 3.4 and later; older releases skip with the reason.
needs_compiler_internals = pytest.mark.skipif(compiler_internals_missing() is not None,
                                              reason=str(compiler_internals_missing()))

ROOT = Path(__file__).resolve().parents[2]


def _compile_env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_compile_env(), capture_output=True, text=True)


@needs_compiler_internals
# One case per target, so that the two compile runs can go to different xdist workers.
@pytest.mark.parametrize("target", [80, 90], ids=["sm_80", "sm_90"])
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(tmp_path, target):
    report = tmp_path / "rows.json"
    run = _run(["-m", "daca_kernels.tools.ahead_of_time", "--targets", str(target), "--json", str(report)])
    print(run.stdout)  # one row per configuration: kernel, target, dtype, flags, block, warps, registers, spills, smem
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["problems"] == []
    rows = result["rows"]
    kernels = {r["kernel"] for r in rows}
    assert {"_logprob_fwd_kernel", "_logprob_bwd_kernel", "_head_stats_kernel", "_head_dlogits_kernel",
            "_sample_step_kernel", "_confidence_delta_kernel", "_stratified_mask_kernel"} <= kernels
    for kernel in kernels:
        mine = [r for r in rows if r["kernel"] == kernel]
        assert {r["target"] for r in mine} == {f"sm_{target}"}
        assert all(r["spill_stores"] == 0 and r["registers"] > 0 and r["error"] is None for r in mine)
    head_kernels = {"_head_stats_kernel", "_head_dlogits_kernel"}  # linear_logprob's, for half-precision heads
    # The fused head's chunk merge reads and writes float32 statistics whatever the head's dtype.
    merge_kernels = {"_merge_chunk_kernel"}
    assert merge_kernels <= kernels
    for kernel in kernels - {"_stratified_mask_kernel"} - head_kernels - merge_kernels:
        assert {r["dtype"] for r in rows if r["kernel"] == kernel} == {"fp16", "bf16", "fp32", "fp64"}, kernel
    for kernel in head_kernels:
        assert {r["dtype"] for r in rows if r["kernel"] == kernel} == {"fp16", "bf16"}, kernel
    for kernel in merge_kernels:
        assert {r["dtype"] for r in rows if r["kernel"] == kernel} == {"fp32"}, kernel


VECTOR_LOADS = """
import re
from functools import partial
from types import SimpleNamespace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from daca_kernels.kernels import logprob
from daca_kernels.tools import ahead_of_time

n, vocab = 4, 126464  # LLaDA's vocabulary, a multiple of 16
logits = torch.empty(2, n, vocab, dtype=torch.bfloat16)[1]  # rows of a larger tensor, offset by a whole row
rows, targets = torch.tensor([3, 0, 2, 2]), torch.zeros(n, dtype=torch.int64)
per_row, stats = torch.empty(n), torch.empty(n, 2)
cases = SimpleNamespace(cuda_launch_cases=lambda: [
    partial(logprob.logprob_forward, logits, rows, targets, 1.0, False),
    partial(logprob.logprob_backward, logits, rows, False, targets, per_row, None, stats, per_row, 1.0,
            torch.empty(3, vocab, dtype=torch.bfloat16)),
])
for kernel, args, kwargs in ahead_of_time.capture(cases):
    launch = ahead_of_time.specialise(kernel, args, kwargs, 90)
    compiled = triton.compile(ASTSource(kernel, launch.signature, launch.constexprs, launch.attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    loads = sorted(set(re.findall(r"ld\\.global[.\\w]*", compiled.asm["ptx"])))
    print(launch.kernel, loads)
"""


@needs_compiler_internals
def test_logprob_kernels_read_aligned_rows_with_vector_loads(tmp_path):
    # Row starts reach the kernel as (start, unit) so that Triton's divisibility specialisation of
    # ``unit`` tells the compiler every row is 16-byte aligned; a start loaded as a plain offset
    # compiles to one 2-byte load per element.
    script = tmp_path / "vector_loads.py"
    script.write_text(VECTOR_LOADS)
    run = _run([str(script)])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines())
    assert set(lines) == {"_logprob_fwd_kernel", "_logprob_bwd_kernel"}, run.stdout
    for kernel, loads in lines.items():
        assert "ld.global.v4.b32" in loads, (kernel, loads)


PLANTED = '''
"""Kernels with the defects the check must catch."""
import torch
import triton
import triton.language as tl

_PLAIN_GLOBAL = -1.0e30  # a plain Python global: the GPU compiler refuses to read it


@triton.jit
def _reads_plain_global_kernel(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.full([BLOCK], _PLAIN_GLOBAL, tl.float32))


@triton.jit
def _fine_kernel(out_ptr, FLAG: tl.constexpr, OTHER: tl.constexpr, BLOCK: tl.constexpr):
    x = tl.arange(0, BLOCK).to(tl.float32)
    if FLAG:
        x = x * 2
    if OTHER:
        x = x + 1
    tl.store(out_ptr + tl.arange(0, BLOCK), x)


@triton.jit
def _never_launched_kernel(out_ptr):
    tl.store(out_ptr, 1.0)


def cuda_launch_cases():
    out = torch.empty(64)
    yield lambda: _reads_plain_global_kernel[(1,)](out, BLOCK=64)
    # FLAG x OTHER launched as (F, F), (T, F), (F, T) only: (T, T) is missing.
    for flag, other in ((False, False), (True, False), (False, True)):
        yield lambda flag=flag, other=other: _fine_kernel[(1,)](out, FLAG=flag, OTHER=other, BLOCK=64)
'''


@needs_compiler_internals
def test_the_check_reports_what_a_gpu_compiler_refuses_and_what_no_case_reaches(tmp_path):
    (tmp_path / "planted_kernels.py").write_text(PLANTED)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import planted_kernels
        from daca_kernels.tools.ahead_of_time import check
        rows, problems = check((90,), jobs=1, modules=[planted_kernels])
        print(json.dumps(problems))
    """)
    run = _run(["-c", script])
    assert run.returncode == 0, run.stderr[-3000:]
    problems = json.loads(run.stdout.strip().splitlines()[-1])
    text = "\n".join(problems)
    assert "_reads_plain_global_kernel" in text and "does not compile" in text and "_PLAIN_GLOBAL" in text
    assert "_never_launched_kernel is reached by no launch case" in text
    assert "_fine_kernel: flag combinations never launched" in text and "('FLAG', True), ('OTHER', True)" in text
    assert len(problems) == 3, text


def test_the_check_refuses_to_run_under_the_interpreter():
    env = {**_compile_env(), "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "daca_kernels.tools.ahead_of_time"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "TRITON_INTERPRET" in run.stderr


@pytest.mark.parametrize("log, expected", [
    ("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 78 registers", (78, 0, 0)),
    ("    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\nptxas info    : Used 255 registers", (255, 8, 12)),
])
def test_ptxas_report_is_parsed(log, expected):
    from daca_kernels.tools.ahead_of_time import parse_ptxas_report

    assert parse_ptxas_report(log) == expected


REGISTER_CAP = """
from functools import partial
import torch
from daca_kernels.kernels import sampling
from daca_kernels.tools import ahead_of_time

wide = torch.empty(3, 4097, dtype=torch.bfloat16)
for name, logits in [("aligned", torch.empty(3, 4096, dtype=torch.bfloat16)), ("offset", wide[:, 1:]),
                     ("strided", torch.empty(3, 8192, dtype=torch.bfloat16)[:, ::2]),
                     ("float32", torch.empty(3, 4096)), ("float64", torch.empty(3, 64, dtype=torch.float64)[:, ::2])]:
    call = partial(sampling.sample_step_forward, logits, torch.arange(3), 1.0, 0.8, 1, 2, 3, 7, True)
    [(kernel, args, kwargs)] = ahead_of_time.capture_calls([call])
    print(name, ahead_of_time.specialise(kernel, args, kwargs, 90).maxnreg)
"""


@needs_compiler_internals
def test_a_launchers_register_cap_reaches_the_ahead_of_time_compile(tmp_path):
    # sample_step caps ptxas at 32 registers on contiguous 16-bit rows (64 warps per SM, without
    # spilling: the compile check fails on any spill), rows not on 16 bytes included (read in
    # vectors after a prologue), and at 128 where its loads are per token (strided rows: ptxas would
    # otherwise spill a few bytes for occupancy); none on contiguous float32 rows (they would spill
    # at 32) and float64. The compile check must compile each launch, cap included.
    script = tmp_path / "register_cap.py"
    script.write_text(REGISTER_CAP)
    run = _run([str(script)])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["aligned", "32", "offset", "32", "strided", "128", "float32", "None", "float64",
                                  "None"], run.stdout
