"""The README and docs/: links that resolve, every ```python block runs (or says why not), the README
stays short, the API reference lists every op."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
QUICK_START = "## Quick start: one GRPO step on CPU"
MAX_README_LINES = 250

PAGES = [README, *DOCS]
# [text](target) and ![alt](target); a target ends at whitespace or ')', an optional "title" after it.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (code may hold brackets that are not links)."""
    return "".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def _relative_targets(path: Path) -> list[str]:
    targets = LINK.findall(_prose(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"index.md", "ops.md", "estimators.md", "families.md", "sampler.md", "objectives.md", "trl.md",
            "loop.md", "measurements.md", "layout.md"} <= names


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    targets = _relative_targets(path)
    missing = [t for t in targets if not (path.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files: {missing}"


def test_link_pattern_sees_links_and_images():
    text = "[a](x.md) ![b](img/c.png) [d](https://e.org) [f](#g) [h](y.md#z)\n```\n[i](not/a/link.md)\n```\n"
    assert LINK.findall(_prose(text)) == ["x.md", "img/c.png", "https://e.org", "#g", "y.md#z"]


def test_every_docs_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    assert {p.name for p in DOCS if p.name != "index.md"} <= set(LINK.findall(index))


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def _quick_start_code() -> str:
    text = README.read_text()
    assert QUICK_START in text, f"the README lost its {QUICK_START!r} heading"
    after = text.split(QUICK_START, 1)[1]
    block = re.search(r"^```python\n(.*?)^```", after, flags=re.M | re.S)
    assert block is not None, "no ```python block after the quick-start heading"
    return block.group(1)


# A ```python block, and the HTML comment right before it that says why it is not run, if any.
PYTHON_BLOCK = re.compile(r"(?:<!-- not run: (?P<reason>[^>]*?) -->\n)?^```python\n(?P<code>.*?)^```", flags=re.M | re.S)
# The blocks that are not run, page by page: a new one must be added here on purpose.
NOT_RUN = {"README.md": 1}


def _python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason)`` of each ```python block of ``path``; ``reason`` is None for a block
    that runs and the text of its ``<!-- not run: ... -->`` comment otherwise."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start("code")), m.group("code"), m.group("reason"))
            for m in PYTHON_BLOCK.finditer(text)]


def _run_page(path: Path) -> dict:
    """Runs the ```python blocks of ``path`` that are not marked, in order and in one namespace (a
    block may use what an earlier one defined), as a reader would paste them; the namespace."""
    namespace = {"__name__": f"docs_{path.stem}"}
    for line, code, reason in _python_blocks(path):
        if reason is None:
            # Padded with newlines so that a traceback gives the block's line in the page.
            exec(compile("\n" * line + code, str(path.relative_to(ROOT)), "exec"), namespace)
    return namespace


def test_python_block_pattern_sees_marks():
    text = "a\n```python\nx = 1\n```\n<!-- not run: needs a GPU -->\n```python\ny = 2\n```\n```bash\nz\n```\n"
    blocks = [(m.group("code"), m.group("reason")) for m in PYTHON_BLOCK.finditer(text)]
    assert blocks == [("x = 1\n", None), ("y = 2\n", "needs a GPU")]


def test_not_run_blocks_are_few_and_say_why():
    marked = {}
    for path in PAGES:
        text = path.read_text()
        reasons = [reason for _, _, reason in _python_blocks(path) if reason is not None]
        assert all(len(reason.split()) >= 3 for reason in reasons), f"{path.name}: a not-run mark needs a reason"
        # Every mark is the comment right before a python block (a mark anywhere else is a typo).
        marks = re.findall(r"^<!-- not run:", text, flags=re.M)
        assert len(marks) == len(reasons), f"{path.name}: a not-run mark before no python block"
        if reasons:
            marked[path.relative_to(ROOT).as_posix()] = len(reasons)
    assert marked == NOT_RUN


@pytest.mark.parametrize("path", [p for p in DOCS if any(r is None for _, _, r in _python_blocks(p))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_python_blocks_run(path, torch_path_one_thread, tmp_path, monkeypatch):
    """Each page's examples as printed, on the tiny models they build (files they write go to a
    temporary directory)."""
    monkeypatch.chdir(tmp_path)
    _run_page(path)


def test_readme_quick_start_runs(torch_path_one_thread, tmp_path, monkeypatch):
    """The README's blocks as printed, and what the quick start promises: one rollout, an SML
    estimate, GRPO's loss and its backward on CPU."""
    code = _quick_start_code()
    # The call the README promises, with the attention mask passed positionally.
    assert "estimate_logprob(lm, out.sequences, completion, completion, out.attention_mask," in code
    assert any(block == code and reason is None for _, block, reason in _python_blocks(README))
    monkeypatch.chdir(tmp_path)
    namespace = _run_page(README)
    torch = namespace["torch"]
    out, loss, lm = namespace["out"], namespace["loss"], namespace["lm"]
    assert out.attention_mask is not None and not out.attention_mask[:4, :2].any()
    assert torch.isfinite(loss)
    grads = [p.grad for p in lm.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_api_reference_lists_every_op():
    """docs/api/ops.md lists the ops one by one (a listing of the package would miss those that
    share their module's name): every name of ``daca_kernels.ops.__all__``."""
    import daca_kernels.ops

    page = (ROOT / "docs" / "api" / "ops.md").read_text()
    listed = {name.rsplit(".", 1)[1] for name in re.findall(r"^::: (daca_kernels\.ops\.\S+)$", page, flags=re.M)}
    assert listed == set(daca_kernels.ops.__all__)


def test_api_reference_pages_are_in_the_site():
    """Every page of docs/api/ is in mkdocs.yml's nav, and every nav entry is a file."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.findall(r"^\s+- (?:[^:\n]+|\"[^\"]+\"): (\S+\.md)$", config, flags=re.M)
    assert {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "api").glob("*.md")} <= set(nav)
    assert all((ROOT / entry).is_file() for entry in nav)


SPHINX_ROLE = re.compile(r":(func|class|mod|meth|attr|data|exc|obj):`")


def test_docstrings_cross_reference_with_links_the_site_checks():
    """Docstrings refer to the package's objects as ``[`title`][full.path]`` (mkdocstrings' links,
    which a strict build resolves), never with Sphinx roles, which the site renders as raw text."""
    found = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
             for top in ("daca_kernels", "integration") for path in sorted((ROOT / top).rglob("*.py"))
             for text in [path.read_text()] for m in SPHINX_ROLE.finditer(text)]
    assert not found, "Sphinx roles left: " + ", ".join(found[:20])


@pytest.mark.slow
def test_a_broken_cross_reference_fails_the_site_build(tmp_path):
    """The strict build of a copy of the repository with one docstring link to a name that does not
    exist fails and names the missing target (and the unchanged copy builds)."""
    import shutil
    import subprocess
    import sys

    mkdocs = pytest.importorskip("mkdocs")
    del mkdocs
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv*", "site", "runs", "__pycache__",
                                                             "wheels"))

    def build() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                              cwd=copy, capture_output=True, text=True, timeout=600)

    assert build().returncode == 0
    credit = copy / "daca_kernels" / "credit.py"
    text = credit.read_text()
    planted = text.replace('"""Per-token DPS weights of a rollout.',
                           '"""Per-token DPS weights of a rollout ([`nowhere`][daca_kernels.credit.no_such_function]).', 1)
    assert planted != text
    credit.write_text(planted)
    run = build()
    assert run.returncode != 0
    assert "daca_kernels.credit.no_such_function" in run.stdout + run.stderr
