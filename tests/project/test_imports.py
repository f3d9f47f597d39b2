"""The package's import rules, read from the source with ``ast``: layers import only downward, the
references stay independent of the code they check, and there is no import cycle."""
import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("daca_kernels", "integration")
REFERENCE = "daca_kernels.reference"

# Layer of every module (by longest matching prefix): a module imports only from its own layer or
# lower ones. ``hashing`` (the counter hash and its stream constants) is the leaf that production
# code and references share; ``validation`` (the argument checks) is the leaf every public entry
# point checks with; ``kernels`` and ``reference`` sit beside them, ``ops`` uses all of them.
LAYERS = {
    "daca_kernels._optional": 0,
    "daca_kernels.hashing": 0,
    "daca_kernels.precision": 0,
    "daca_kernels.presets": 0,
    "daca_kernels.validation": 0,
    "daca_kernels.kernels": 0,
    "daca_kernels.tools": 3,
    "daca_kernels.reference": 1,
    "daca_kernels.ops": 2,
    "daca_kernels.models": 2,
    "daca_kernels.models.activation_checkpointing": 1,
    "daca_kernels.models.released_code": 1,
    "daca_kernels.likelihood": 3,
    "daca_kernels.losses": 3,
    "daca_kernels.rollout": 3,
    "daca_kernels.credit": 3,
    "daca_kernels.objectives": 3,
    "daca_kernels": 4,
    "daca_kernels.trl": 5,
    "integration": 6,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for top in TOPS for p in sorted((ROOT / top).rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, ast.AST]]:
    """The project modules ``name`` imports (at module level or inside functions), with the node.

    ``from package import x`` counts as an import of ``package.x`` when that is a module, else of
    ``package``.
    """
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found += [(t, node) for t in targets if t.split(".")[0] in TOPS]
    return found


def _layer(name: str) -> int:
    prefixes = [p for p in LAYERS if name == p or name.startswith(p + ".")]
    assert prefixes, f"{name} belongs to no layer: add it to LAYERS in {Path(__file__).name}"
    return LAYERS[max(prefixes, key=len)]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_project_module_is_found():
    assert {"daca_kernels.hashing", "daca_kernels.likelihood.ratio_masks", "daca_kernels.reference.masking",
            "integration.trainer"} <= MODULES.keys()
    assert all(_imports(name) is not None for name in MODULES)  # every file parses


def test_imports_go_downward():
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name in MODULES
        for target, _ in _imports(name)
        if _layer(target) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_leaf_kernels_and_references_import_nothing_else_of_the_project():
    allowed = {
        "daca_kernels.hashing": (),
        "daca_kernels.validation": (),
        "daca_kernels.kernels": ("daca_kernels.kernels",),
        REFERENCE: (REFERENCE, "daca_kernels.hashing"),
    }
    bad = []
    for name in MODULES:
        for prefix, permitted in allowed.items():
            if _within(name, prefix):
                bad += [f"{name} imports {t}" for t, _ in _imports(name) if not any(_within(t, p) for p in permitted)]
    assert not bad, "\n".join(bad)


REFERENCE_BACKEND = "daca_kernels.ops.reference_backend"


def test_only_the_reference_backend_imports_the_references():
    """Outside ``reference/``: ``ops/reference_backend.py`` (the ``reference`` backend of every op)
    and ``integration/`` (the loop's reference backend) may import the ``daca_kernels.reference``
    package as a whole; nothing imports its modules (``reference.hashing``, ``reference.masking``,
    ...) directly."""
    bad = []
    for name in MODULES:
        if _within(name, REFERENCE):
            continue
        for target, node in _imports(name):
            if not _within(target, REFERENCE):
                continue
            whole_package = target == REFERENCE and isinstance(node, ast.ImportFrom) and node.module == "daca_kernels"
            if not (whole_package and (name == REFERENCE_BACKEND or _within(name, "integration"))):
                bad.append(f"{name}:{node.lineno} imports {target}")
    assert not bad, "\n".join(bad)


def test_only_the_dispatch_picks_the_reference_backend():
    """Production code never computes with a reference: the reference backend is reached only
    through ``ops.dispatch.run``."""
    importers = {name for name in MODULES for target, _ in _imports(name) if target == REFERENCE_BACKEND}
    assert importers == {"daca_kernels.ops.dispatch"}


def test_no_module_of_the_package_imports_a_private_name_of_another():
    """What several modules share is public (e.g. ``ops/shared.py``), not borrowed from one of them."""
    bad = [
        f"{name}:{node.lineno} imports {alias.name} from {node.module}"
        for name in MODULES
        if _within(name, "daca_kernels")
        for _, node in _imports(name)
        if isinstance(node, ast.ImportFrom) and node.module != name
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not bad, "\n".join(sorted(set(bad)))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None when it is acyclic."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = {name: {t for t, _ in _imports(name) if t in MODULES and t != name} for name in MODULES}
    assert graph["daca_kernels.rollout"], "the graph must hold the package's imports"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _third_party_imports() -> list[str]:
    """``module`` or ``module:name`` of every import of another distribution in the project."""
    found = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] not in TOPS}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] not in TOPS:
                found |= {f"{node.module}:{a.name}" for a in node.names}
    return sorted(found)


# The packages of the optional extras (pyproject.toml) that project modules import: a module that
# needs one of them is left out, with a line naming it, where that package is not installed (a GPU
# image has only torch, triton, transformers and their dependencies).
OPTIONAL = ("accelerate", "matplotlib", "tqdm", "trl")

# Third-party modules are imported once, then every project module is imported first in a child
# forked from that state, so each one is the first project module of its interpreter.
_IMPORT_EACH = textwrap.dedent('''
    import gc, importlib, os, sys, traceback
    preload, optional, modules = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3:]
    for item in preload:
        module, _, name = item.partition(":")
        try:
            getattr(importlib.import_module(module), name) if name else importlib.import_module(module)
        except Exception:
            pass  # optional dependencies; the child reports what it needs
    assert not [m for m in sys.modules if m.split(".")[0] in ("daca_kernels", "integration")]
    gc.freeze()
    running, failed = {}, []
    for name in modules + [None] * os.cpu_count():
        if name is not None:
            pid = os.fork()
            if pid == 0:
                try:
                    importlib.import_module(name)
                except BaseException as error:
                    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in optional:
                        print(f"left out {name}: needs {error.name} (not installed)", flush=True)
                        os._exit(2)
                    traceback.print_exc()
                    os._exit(1)
                os._exit(0)
            running[pid] = name
        if running and (name is None or len(running) >= os.cpu_count()):
            pid, status = os.wait()
            if os.waitstatus_to_exitcode(status) not in (0, 2):
                failed.append(running[pid])
            del running[pid]
    print("FAILED", *failed)
    sys.exit(1 if failed else 0)
''')


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_first_in_a_fresh_interpreter():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, ",".join(_third_party_imports()), ",".join(OPTIONAL), *sorted(MODULES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    # Only the TRL trainer and the reference loop may need an optional package.
    left_out = [line.split()[2].rstrip(":") for line in run.stdout.splitlines() if line.startswith("left out ")]
    assert all(name.startswith(("daca_kernels.trl", "integration")) for name in left_out), left_out


def test_the_layout_page_names_every_layer_of_the_table():
    """docs/layout.md is the one description of the layout: it names every module and package of
    :data:`LAYERS` (``hashing.py``, ``rollout/``, ...), and every module or package it names at the
    head of a line of its ``daca_kernels/`` block exists."""
    page = (ROOT / "docs" / "layout.md").read_text()
    block = page[page.index("daca_kernels/\n"):page.index("\nexamples/")]
    missing = []
    for name in LAYERS:
        if not _within(name, "daca_kernels") or name == "daca_kernels":
            continue
        leaf = name.rsplit(".", 1)[-1]
        entry = f"{leaf}/" if _is_package(name) else f"{leaf}.py"
        if entry not in block:
            missing.append(f"{name} ({entry})")
    assert not missing, "docs/layout.md does not name: " + ", ".join(missing)
    named = re.findall(r"^  ([\w.]+(?:\.py|/))", block, flags=re.M)
    assert named, "the page's daca_kernels block names nothing"
    absent = [entry for entry in named if not (ROOT / "daca_kernels" / entry.rstrip("/")).exists()]
    assert not absent, "docs/layout.md names what does not exist: " + ", ".join(absent)
