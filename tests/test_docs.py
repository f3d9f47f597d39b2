"""The README and docs/: links that resolve, the README's quick start runs, the README stays short."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
QUICK_START = "## Quick start: one GRPO step on CPU"
MAX_README_LINES = 250

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


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
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


def test_readme_quick_start_runs(torch_path_one_thread):
    """The example as printed: one rollout, an SML estimate, GRPO's loss and its backward on CPU."""
    code = _quick_start_code()
    # The call the README promises, with the attention mask passed positionally.
    assert "estimate_logprob(lm, out.sequences, completion, completion, out.attention_mask," in code
    namespace = {"__name__": "readme_quick_start"}
    exec(compile(code, "README.md (quick start)", "exec"), namespace)
    torch = namespace["torch"]
    out, loss, lm = namespace["out"], namespace["loss"], namespace["lm"]
    assert out.attention_mask is not None and not out.attention_mask[:4, :2].any()
    assert torch.isfinite(loss)
    grads = [p.grad for p in lm.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
