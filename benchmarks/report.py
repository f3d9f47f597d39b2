"""Render benchmark rows as ``REPORT.md`` and PNG charts, and refuse rows that cannot be trusted.

    python benchmarks/report.py [--results benchmarks/results/<device-slug>] [--allow-dirty] [--allow-over-ceiling]
    python benchmarks/report.py --benchmark-json run.json [--out folder]

Reads ``rows.jsonl`` of each device folder (by default every folder under ``benchmarks/results``
that has one), or pytest-benchmark files (``test_suites.py``; the report goes to ``--out``, by
default a folder named after the file beside it), and writes ``REPORT.md``: device, commit, date
and the ceilings at the top, then one table per (op, mode) with each row's counting formula and the
ceiling it is held to (``copy``, ``read`` or ``matmul``, measured beside it), and one chart per
(op, mode) of the achieved GB/s or TFLOP/s per provider and shape against that ceiling. Without
matplotlib the report is written without charts, and says so.

A row above 100 % of its ceiling (a mis-counted formula or a mis-measured ceiling) or from a tree
with uncommitted changes is marked loudly in the report, and the script names it and exits with
status 1, unless ``--allow-over-ceiling`` / ``--allow-dirty`` accepts that kind of row.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS_DIR, ROWS_FILE, load_rows, rows_from_benchmark_json  # noqa: E402

PROVIDER_ORDER = ["daca", "daca_torch", "eager", "compile", "liger", "cce", "trl", "llada", "reference",
                  "one_step_eager", "one_step", "sml_k4"]
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # a GPU image may lack it: the report is then written without charts
    plt = None
OVER = "**ABOVE CEILING**"
DIRTY = "**DIRTY TREE**"


def _fmt(value, digits=2):
    if value is None:
        return ""
    return f"{value:.{digits}f}" if abs(value) >= 10 ** -digits else f"{value:.2g}"


def _shape_key(shape: str):
    return tuple(int(x) for x in re.findall(r"\d+", shape))


def _provider_key(provider: str):
    return (PROVIDER_ORDER.index(provider) if provider in PROVIDER_ORDER else 99, provider)


def _row_name(r: dict) -> str:
    return f"{r['op']} {r['mode']} {r['provider']} {r['shape']} {r['dtype']}"


def problems(rows: list[dict]) -> dict[str, list[str]]:
    """The rows above 100 % of their ceiling and the rows from a dirty tree, by name."""
    return {
        "over_ceiling": [_row_name(r) for r in rows if (r.get("pct_of_ceiling") or 0) > 100],
        "dirty": [_row_name(r) for r in rows if r.get("dirty", True)],
    }


def _flags(r: dict) -> str:
    return " ".join(([OVER] if (r.get("pct_of_ceiling") or 0) > 100 else []) + ([DIRTY] if r.get("dirty", True) else []))


def _held_to(r: dict) -> str:
    """The ceiling a row is held to (rows written before the read ceiling existed: copy or matmul)."""
    return r.get("ceiling") or ("copy" if r.get("gbps") is not None else "matmul")


def _ceiling_cell(r: dict) -> str:
    if r.get("ceiling_rate") is None:
        return _held_to(r)
    return f"{r['ceiling']} {_fmt(r['ceiling_rate'], 3 if r['ceiling'] == 'matmul' else 1)}"


def _memory_table(rows: list[dict]) -> list[str]:
    lines = ["| shape | dtype | provider | peak MB | |", "|---|---|---|---:|---|"]
    for r in sorted(rows, key=lambda r: (_shape_key(r["shape"]), _provider_key(r["provider"]))):
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['provider']} | {_fmt(r['peak_mb'], 1)} | {_flags(r)} |")
    return lines


def _table(rows: list[dict]) -> list[str]:
    if all(r.get("ms") is None for r in rows):
        return _memory_table(rows)
    lines = ["| shape | dtype | provider | median ms | p20-p80 ms | GB/s | TFLOP/s | ceiling | % of ceiling | peak MB | |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (_shape_key(r["shape"]), _provider_key(r["provider"]))):
        spread = f"{_fmt(r['ms_p20'], 3)}-{_fmt(r['ms_p80'], 3)}" if r.get("ms_p20") is not None else ""
        extra = f"{_fmt(r['ms_per_step'], 3)} ms per step" if r.get("ms_per_step") else ""
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['provider']} | {_fmt(r.get('ms'), 3)} | {spread} | {_fmt(r.get('gbps'), 1)} | "
            f"{_fmt(r.get('tflops'), 3)} | {_ceiling_cell(r)} | {_fmt(r.get('pct_of_ceiling'), 1)} | {_fmt(r.get('peak_mb'), 1)} | "
            f"{' '.join(x for x in (extra, _flags(r)) if x)} |"
        )
    return lines


def _chart(rows: list[dict], ceiling: tuple[str, float], title: str, path: Path) -> None:
    metric = "gbps" if rows[0].get("gbps") is not None else "tflops"
    shapes = sorted({r["shape"] for r in rows}, key=_shape_key)
    providers = sorted({r["provider"] for r in rows}, key=_provider_key)
    width = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(shapes)), 4))
    for i, provider in enumerate(providers):
        values = [next((r[metric] for r in rows if r["shape"] == s and r["provider"] == provider), 0) for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], values, width, label=provider)
    unit = "GB/s" if metric == "gbps" else "TFLOP/s"
    name, rate = ceiling
    ax.axhline(rate, color="black", linestyle="--", linewidth=1, label=f"ceiling: {name} {rate:.3g} {unit}")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=15, fontsize=7)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ceiling_line(c: dict) -> str:
    unit, digits, formula = ("GB/s", 1, c.get("bytes_formula")) if "gbps" in c else ("TFLOP/s", 3, c.get("flops_formula"))
    rate = c.get("rate_median", c.get("gbps", c.get("tflops")))
    spread = (f"{_fmt(c['rate_min'], digits)}-{_fmt(c['rate_max'], digits)} ({c['measurements']} measurements)"
              if "measurements" in c else "1 measurement")
    return (f"| {c['provider']} | {c['shape']} | {c['dtype']} | {_fmt(c['ms'], 3)} | {_fmt(c['ms_p20'], 3)}-"
            f"{_fmt(c['ms_p80'], 3)} | {_fmt(rate, digits)} {unit} ({formula}) | {spread} |")


def _chart_ceiling(timed: list[dict], ceilings: dict) -> tuple[str, float] | None:
    """The ceiling line of a chart: the median of the ceilings measured beside its rows (rows
    without one: the run's ceiling row)."""
    name = _held_to(timed[0])
    beside = [r["ceiling_rate"] for r in timed if r.get("ceiling_rate") is not None]
    if beside:
        return name, statistics.median(beside)
    if name in ceilings:
        c = ceilings[name]
        return name, c.get("gbps", c.get("tflops"))
    return None


def render(folder: Path, rows: list[dict], source: str) -> tuple[Path, dict[str, list[str]]]:
    """Write ``folder/REPORT.md`` and its charts from ``rows`` (read from ``source``); returns the
    report's path and its problem rows."""
    if not rows:
        raise ValueError(f"{source} holds no rows")
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    found = problems(rows)
    ceilings = {r["provider"]: r for r in rows if r["op"] == "ceiling"}
    commits = sorted({f"{r['commit']}{' (dirty)' if r.get('dirty', True) else ''}" for r in rows})
    dates = sorted(r["timestamp"] for r in rows)
    sizes = sorted({r["size"] for r in rows if "size" in r})
    first = rows[0]
    lines = [f"# Benchmark results: {first['device']}", ""]
    for commit in sorted({(r["commit"], bool(r.get("dirty", True))) for r in rows}):
        made = [r for r in rows if (r["commit"], bool(r.get("dirty", True))) == commit]
        commands = "; ".join(sorted({r.get("command", "command unrecorded") for r in made}))
        lines.append(f"Made by `{commands}` at commit `{commit[0]}{'-dirty' if commit[1] else ''}` "
                     f"({len(made)} rows).")
    lines += ["", f"Commit {', '.join(commits)}; torch {first['torch']}, triton {first['triton']}; "
              f"measured {dates[0]} to {dates[-1]}; sizes {'/'.join(sizes) or 'unrecorded'}. "
              f"This report: `python benchmarks/report.py` from `{source}`.", ""]
    if found["over_ceiling"] or found["dirty"]:
        lines += [f"> {OVER}: {len(found['over_ceiling'])} rows; {DIRTY}: {len(found['dirty'])} rows. "
                  "These rows cannot be trusted.", ""]
    if plt is None:
        lines += ["Charts left out: matplotlib is not installed where this report was made.", ""]
    lines += ["## Ceilings (measured beside the rows they judge)", "",
              "| ceiling | shape | dtype | median ms | p20-p80 ms | rate (median) | range |",
              "|---|---|---|---:|---:|---:|---|"]
    lines += [_ceiling_line(c) for _, c in sorted(ceilings.items())]
    lines += ["", "A row counted in FLOPs is held to `matmul`; a row counted in bytes that are only read to `read`, "
              "other byte rows to `copy`. Each row's ceiling column gives the rate measured right after it.", ""]
    groups = defaultdict(list)
    for r in rows:
        if r["op"] != "ceiling" and "skipped" not in r:
            groups[(r["op"], r["mode"])].append(r)
    for (op, mode), group in sorted(groups.items()):
        formulas = sorted({r.get("bytes_formula") or r.get("flops_formula") or r.get("peak_formula", "") for r in group})
        lines += [f"## {op}: {mode}", "", "Counted as: " + "; ".join(f"`{f}`" for f in formulas), ""]
        lines += _table(group) + [""]
        timed = [r for r in group if r.get("gbps") is not None or r.get("tflops") is not None]
        ceiling = _chart_ceiling(timed, ceilings) if timed else None
        if ceiling is not None and plt is not None:
            png = f"{op}-{mode}.png".replace("+", "_")
            _chart(timed, ceiling, f"{op} {mode} on {first['device']}", folder / png)
            lines += [f"![{op} {mode}]({png})", ""]
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        lines += ["## Not measured", "", "| op | mode | provider | shape | dtype | why |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['mode']} | {r['provider']} | {r['shape']} | {r['dtype']} | {r['skipped']} |" for r in skipped]
        lines.append("")
    out = folder / "REPORT.md"
    out.write_text("\n".join(lines))
    return out, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, nargs="*",
                        help="device folders holding rows.jsonl (default: every one under benchmarks/results)")
    parser.add_argument("--benchmark-json", type=Path, nargs="*", default=[],
                        help="pytest-benchmark files (--benchmark-json, or saved runs under .benchmarks/) to report on")
    parser.add_argument("--out", type=Path, help="with one --benchmark-json file: the report's folder")
    parser.add_argument("--allow-dirty", action="store_true", help="accept rows from a tree with uncommitted changes")
    parser.add_argument("--allow-over-ceiling", action="store_true", help="accept rows above 100%% of their ceiling")
    args = parser.parse_args()
    if args.out is not None and len(args.benchmark_json) != 1:
        parser.error("--out needs exactly one --benchmark-json file")
    sources = [(args.out or path.with_suffix(""), rows_from_benchmark_json(path), str(path)) for path in args.benchmark_json]
    if args.results or not sources:
        folders = args.results or sorted(p.parent for p in RESULTS_DIR.glob(f"*/{ROWS_FILE}"))
        if not folders:
            sys.exit(f"no {ROWS_FILE} under {RESULTS_DIR}: run benchmarks/run.py first")
        sources += [(folder, load_rows(folder / ROWS_FILE), ROWS_FILE) for folder in folders]
    if plt is None:
        print("matplotlib is not installed: the reports are written without charts", file=sys.stderr)
    refused = []
    for folder, rows, source in sources:
        path, found = render(folder, rows, source)
        print(f"report written to {path}")
        if not args.allow_over_ceiling:
            refused += [f"above 100% of its ceiling: {name}" for name in found["over_ceiling"]]
        if not args.allow_dirty:
            refused += [f"from a dirty tree: {name}" for name in found["dirty"]]
    if refused:
        print("refused rows (marked in the report):\n  " + "\n  ".join(refused), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
