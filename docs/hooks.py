"""mkdocs hook: the site resolves links the way the repository does.

Every page is known to mkdocs by its path in the repository (``docs/loop.md``, ``README.md``), so a
relative link written for reading the markdown on disk (``../integration/results/demo.md``,
``docs/ops.md`` from the README) is the same link in the site. The files outside ``docs/`` that
the pages link to (the README, the changelog, the results pages and their figures) join the site,
found by following the links from ``docs/``; the ``docs/`` pages keep their URLs (``docs/ops.md``
is ``ops/``).
"""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# [text](target) and ![alt](target); the same pattern tests/project/test_docs.py checks the links with.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*$", flags=re.M)


def _linked_files(page: Path) -> set[Path]:
    """The files of the repository that the markdown page ``page`` links to by a relative link."""
    prose = "".join(part for i, part in enumerate(FENCE.split(page.read_text())) if i % 2 == 0)
    found = set()
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if path.is_file() and path.is_relative_to(ROOT):
            found.add(path)
    return found


def _repository_file(src_uri: str, config) -> File:
    """A file outside docs/ at its own path in the site: README.md too (mkdocs would make it index.html)."""
    dest_uri = None
    if src_uri.endswith(".md"):
        stem = src_uri[: -len(".md")]
        dest_uri = f"{stem}/index.html" if config.use_directory_urls else f"{stem}.html"
    return File(src_uri, str(ROOT), config.site_dir, config.use_directory_urls, dest_uri=dest_uri)


def on_files(files: Files, config) -> Files:
    site = Files([f for f in files if f.src_dir is None or Path(f.src_dir).resolve() != DOCS])
    pending = []
    for f in files:
        if f.src_dir is not None and Path(f.src_dir).resolve() == DOCS:
            site.append(File(f"docs/{f.src_uri}", str(ROOT), config.site_dir, config.use_directory_urls,
                             dest_uri=f.dest_uri, inclusion=f.inclusion))
            pending.append(DOCS / f.src_uri)
    seen = set(pending)
    while pending:
        page = pending.pop()
        if page.suffix != ".md":
            continue
        for path in _linked_files(page) - seen:
            seen.add(path)
            if not path.is_relative_to(DOCS):
                site.append(_repository_file(path.relative_to(ROOT).as_posix(), config))
            pending.append(path)
    return site
