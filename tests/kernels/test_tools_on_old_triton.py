"""The ahead-of-time compile and the roofline model need triton >= 3.4 (its compiler internals): on an
older triton they exit with status 2 and say why instead of failing on an import."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from daca_kernels.tools import ahead_of_time

ROOT = Path(__file__).resolve().parents[2]


def test_the_reason_names_the_floor_and_the_installed_release(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    reason = ahead_of_time.compiler_internals_missing()
    assert "triton 3.4 and later" in reason and "installed triton is 3.2.0" in reason
    with pytest.raises(RuntimeError, match="triton >= 3.4"):
        ahead_of_time.check_compiler_internals()
    for version in ("3.4.0", "3.7.1", "3.8.0+git1234"):
        monkeypatch.setattr(triton, "__version__", version)
        assert ahead_of_time.compiler_internals_missing() is None


@pytest.mark.skipif(ahead_of_time.compiler_internals_missing() is None, reason="triton is new enough for the tools")
@pytest.mark.parametrize("tool", ["ahead_of_time", "roofline"])
def test_the_tools_say_why_they_cannot_run(tool):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", f"daca_kernels.tools.{tool}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"{tool}: the ahead-of-time compile and the roofline model" in run.stderr
    assert "Traceback" not in run.stderr
