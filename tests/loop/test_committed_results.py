"""The committed results are those of the code beside them: every results file names the commit and
the command that made it, and the demo's parity table, recomputed, equals the committed one."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration import provenance
from integration.config import RunConfig
from integration.parity import parity_check, parity_table

ROOT = Path(__file__).resolve().parents[2]
RESULT_FOLDERS = (ROOT / "integration" / "results", ROOT / "benchmarks" / "results")
DEMO = ROOT / "integration" / "results" / "demo.md"
REGENERATE = "the committed results are not those of this code: run `make results` and commit them"
# The losses are printed with 6 decimals. Recomputed on another x86 CPU the SFT checkpoint's weights
# differ in their last float32 bits (another BLAS summation order over its training), which moves a
# loss by about 1e-6 relative; a change to the seeded computation (another noise, another mask)
# moves it by 1e-2 or more. LOSS_RTOL sits between the two.
LOSS_RTOL = 1e-4


def committed_results() -> list[Path]:
    """The results files the repository holds (charts aside: their reports name them)."""
    out = git("ls-files", "--", *(str(f.relative_to(ROOT)) for f in RESULT_FOLDERS)).splitlines()
    return [ROOT / p for p in out if not p.endswith((".png", "README.md"))]


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first markdown table after ``heading``, cells stripped."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    body = []
    for line in lines[2:]:  # header and separator
        body.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return body


def test_every_results_file_names_its_commit_and_command():
    files = committed_results()
    assert any(f.name == "demo.md" for f in files) and any(f.name == "rows.jsonl" for f in files)
    for path in files:
        text = path.read_text()
        if path.suffix == ".md":
            stamp = provenance.read_stamp(text)
            assert stamp is not None, f"{path.relative_to(ROOT)}: no 'Made by `command` at commit `sha`' line"
            assert stamp["commit"] != "unknown" and stamp["command"], path
        elif path.suffix == ".json":
            data = json.loads(text)
            assert data.get("commit") and data.get("command"), f"{path.relative_to(ROOT)}: no commit or command"
        elif path.suffix == ".jsonl":
            for row in map(json.loads, text.splitlines()):
                assert row.get("commit") and row.get("command"), f"{path.relative_to(ROOT)}: a row without its stamp"
        else:
            raise AssertionError(f"{path.relative_to(ROOT)}: a results file of an unknown kind")


def test_a_stamp_reads_back(monkeypatch):
    line = provenance.stamp_line("python -m integration.demo --seeds 0")
    stamp = provenance.read_stamp(f"# Title\n\n{line}\n")
    sha, dirty = provenance.commit_and_dirty()
    assert stamp == {"command": "python -m integration.demo --seeds 0", "commit": sha, "dirty": dirty}
    monkeypatch.setenv("DACA_RESULTS_COMMIT", "0123456789abcdef-dirty")
    assert provenance.stamp()["commit"] == "0123456789ab-dirty"
    assert "uncommitted changes" in provenance.stamp_line("x")
    assert provenance.read_stamp(provenance.stamp_line("x"))["dirty"] is True
    assert provenance.read_stamp("`x` at commit 1234567") is None


def test_the_command_is_the_one_typed(tmp_path):
    (tmp_path / "probe.py").write_text("from integration.provenance import command_line\nprint(command_line())\n")
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    as_module = subprocess.run([sys.executable, "-m", "probe", "--seeds", "0", "a b"], cwd=tmp_path, env=env,
                               capture_output=True, text=True)
    assert as_module.stdout.strip() == "python -m probe --seeds 0 'a b'", as_module.stderr
    as_script = subprocess.run([sys.executable, str(tmp_path / "probe.py"), "--quick"], cwd=tmp_path, env=env,
                               capture_output=True, text=True)
    assert as_script.stdout.strip() == f"python {tmp_path / 'probe.py'} --quick", as_script.stderr


@pytest.mark.slow
def test_the_demo_parity_table_is_the_committed_one(torch_path_one_thread, tmp_path):
    """``make demo``'s first table (about a minute: an SFT checkpoint and 44 batches). The losses
    within LOSS_RTOL, the rows, their settings and verdicts exactly; the gradient errors (rounding
    error, different on every CPU) are not compared."""
    committed = table_rows(DEMO.read_text(), "## Parity")
    rows = parity_check(RunConfig(task="sort", steps=RunConfig.steps), tmp_path)  # as integration.demo runs it
    fresh = table_rows("## Parity\n" + parity_table(rows), "## Parity")
    assert len(fresh) == len(committed), f"{len(fresh)} parity rows, {len(committed)} committed: {REGENERATE}"
    for got, want in zip(fresh, committed):
        label = " / ".join(got[:4])
        assert got[:4] == want[:4] and got[7] == want[7] == "yes", f"{label} vs {' / '.join(want[:4])}: {REGENERATE}"
        for column in (4, 5):
            new, old = float(got[column]), float(want[column])
            assert abs(new - old) <= 1e-6 + LOSS_RTOL * abs(old), f"{label}: loss {new} now, {old} committed: {REGENERATE}"
