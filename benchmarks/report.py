"""Render benchmark rows as ``REPORT.md`` and PNG charts, and refuse rows that cannot be trusted.

    python benchmarks/report.py [--results benchmarks/results/<device-slug>] [--allow-dirty] [--allow-over-ceiling]

Reads ``rows.jsonl`` of each device folder (by default every folder under ``benchmarks/results``
that has one) and writes ``REPORT.md`` there: device, commit, date and the measured ceilings at the
top, then one table per (op, mode) with each row's counting formula, and one chart per (op, mode)
of the achieved GB/s or TFLOP/s per provider and shape against the ceiling.

A row above 100 % of its ceiling (a mis-counted formula or a mis-measured ceiling) or from a tree
with uncommitted changes is marked loudly in the report, and the script names it and exits with
status 1, unless ``--allow-over-ceiling`` / ``--allow-dirty`` accepts that kind of row.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS_DIR, ROWS_FILE, load_rows  # noqa: E402

PROVIDER_ORDER = ["daca", "daca_torch", "eager", "compile", "liger", "cce", "llada", "reference",
                  "one_step_eager", "one_step", "sml_k4"]
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


def _memory_table(rows: list[dict]) -> list[str]:
    lines = ["| shape | dtype | provider | peak MB | |", "|---|---|---|---:|---|"]
    for r in sorted(rows, key=lambda r: (_shape_key(r["shape"]), _provider_key(r["provider"]))):
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['provider']} | {_fmt(r['peak_mb'], 1)} | {_flags(r)} |")
    return lines


def _table(rows: list[dict]) -> list[str]:
    if all(r.get("ms") is None for r in rows):
        return _memory_table(rows)
    lines = ["| shape | dtype | provider | median ms | p20-p80 ms | GB/s | TFLOP/s | % of ceiling | peak MB | |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (_shape_key(r["shape"]), _provider_key(r["provider"]))):
        spread = f"{_fmt(r['ms_p20'], 3)}-{_fmt(r['ms_p80'], 3)}" if r.get("ms_p20") is not None else ""
        extra = f"{_fmt(r['ms_per_step'], 3)} ms per step" if r.get("ms_per_step") else ""
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['provider']} | {_fmt(r.get('ms'), 3)} | {spread} | {_fmt(r.get('gbps'), 1)} | "
            f"{_fmt(r.get('tflops'), 3)} | {_fmt(r.get('pct_of_ceiling'), 1)} | {_fmt(r.get('peak_mb'), 1)} | "
            f"{' '.join(x for x in (extra, _flags(r)) if x)} |"
        )
    return lines


def _chart(rows: list[dict], ceiling: dict, title: str, path: Path) -> None:
    metric = "gbps" if rows[0].get("gbps") is not None else "tflops"
    shapes = sorted({r["shape"] for r in rows}, key=_shape_key)
    providers = sorted({r["provider"] for r in rows}, key=_provider_key)
    width = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(shapes)), 4))
    for i, provider in enumerate(providers):
        values = [next((r[metric] for r in rows if r["shape"] == s and r["provider"] == provider), 0) for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], values, width, label=provider)
    unit = "GB/s" if metric == "gbps" else "TFLOP/s"
    ax.axhline(ceiling[metric], color="black", linestyle="--", linewidth=1,
               label=f"ceiling: {ceiling['provider']} {ceiling[metric]:.3g} {unit}")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=15, fontsize=7)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(folder: Path) -> tuple[Path, dict[str, list[str]]]:
    """Write ``folder/REPORT.md`` and the charts from ``folder/rows.jsonl``; returns the report's
    path and its problem rows."""
    rows = load_rows(folder / ROWS_FILE)
    if not rows:
        raise ValueError(f"{folder / ROWS_FILE} holds no rows")
    for old in folder.glob("*.png"):
        old.unlink()
    found = problems(rows)
    ceilings = {r["provider"]: r for r in rows if r["op"] == "ceiling"}
    commits = sorted({f"{r['commit']}{' (dirty)' if r.get('dirty', True) else ''}" for r in rows})
    dates = sorted(r["timestamp"] for r in rows)
    sizes = sorted({r["size"] for r in rows if "size" in r})
    first = rows[0]
    lines = [f"# Benchmark results: {first['device']}", "",
             f"Commit {', '.join(commits)}; torch {first['torch']}, triton {first['triton']}; "
             f"measured {dates[0]} to {dates[-1]}; `benchmarks/run.py --size {'/'.join(sizes)}` and the memory scripts. "
             f"Made by `python benchmarks/report.py` from `{ROWS_FILE}`.", ""]
    if found["over_ceiling"] or found["dirty"]:
        lines += [f"> {OVER}: {len(found['over_ceiling'])} rows; {DIRTY}: {len(found['dirty'])} rows. "
                  "These rows cannot be trusted.", ""]
    lines += ["## Ceilings (measured in the same run)", "", "| ceiling | shape | dtype | median ms | p20-p80 ms | rate |",
              "|---|---|---|---:|---:|---:|"]
    for name, c in sorted(ceilings.items()):
        rate = f"{c['gbps']:.1f} GB/s ({c['bytes_formula']})" if "gbps" in c else f"{c['tflops']:.3f} TFLOP/s ({c['flops_formula']})"
        lines.append(f"| {name} | {c['shape']} | {c['dtype']} | {_fmt(c['ms'], 3)} | {_fmt(c['ms_p20'], 3)}-{_fmt(c['ms_p80'], 3)} | {rate} |")
    lines += ["", "A row counted in bytes is judged against `copy`, a row counted in FLOPs against `matmul`.", ""]
    groups = defaultdict(list)
    for r in rows:
        if r["op"] != "ceiling" and "skipped" not in r:
            groups[(r["op"], r["mode"])].append(r)
    for (op, mode), group in sorted(groups.items()):
        formulas = sorted({r.get("bytes_formula") or r.get("flops_formula") or r.get("peak_formula", "") for r in group})
        lines += [f"## {op}: {mode}", "", "Counted as: " + "; ".join(f"`{f}`" for f in formulas), ""]
        lines += _table(group) + [""]
        timed = [r for r in group if r.get("gbps") is not None or r.get("tflops") is not None]
        if timed and ceilings:
            ceiling = ceilings["copy" if timed[0].get("gbps") is not None else "matmul"]
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
    parser.add_argument("--allow-dirty", action="store_true", help="accept rows from a tree with uncommitted changes")
    parser.add_argument("--allow-over-ceiling", action="store_true", help="accept rows above 100%% of their ceiling")
    args = parser.parse_args()
    folders = args.results or sorted(p.parent for p in RESULTS_DIR.glob(f"*/{ROWS_FILE}"))
    if not folders:
        sys.exit(f"no {ROWS_FILE} under {RESULTS_DIR}: run benchmarks/run.py first")
    refused = []
    for folder in folders:
        path, found = render(folder)
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
