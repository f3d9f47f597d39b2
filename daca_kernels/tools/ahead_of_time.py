"""Compile every Triton kernel of the package for NVIDIA GPUs ahead of time, on any machine.

    python -m daca_kernels.tools.ahead_of_time [--targets 80 90] [--jobs 2] [--json rows.json]

Each kernel module lists, in ``cuda_launch_cases()``, calls of its launchers that reach every
configuration the launchers can choose on a GPU (input dtypes, feature flags, block sizes). This
module runs those calls with the kernel launch intercepted, so the block sizes, ``num_warps`` and
constexpr flags are computed by the launchers' own code; Triton's JIT binder turns each captured
call into the specialisation a real launch would compile (signature, constexprs, alignment
attributes, options). Every distinct specialisation is compiled with ``triton.compile`` for each
target (PTX, then a cubin by the ``ptxas`` bundled with triton) and ptxas's ``-v`` report gives
registers and spills. No GPU is needed.

It fails (exit status 1) on a compile error, on any spill store, on a ``@triton.jit`` function
that no launch case reaches (neither launched nor called by a launched kernel: a new kernel whose
module has no ``cuda_launch_cases`` is caught here) and on a kernel whose boolean constexpr flags
were not launched in every combination. It must run in a process without ``TRITON_INTERPRET=1`` (the interpreter's
kernels cannot be compiled). It drives triton's compiler through the internals of triton 3.4 and later
(``triton.knobs``, the JIT binder); on an older triton it exits with status 2 and says so
([`check_compiler_internals`][daca_kernels.tools.ahead_of_time.check_compiler_internals]), as does the roofline model that builds on it.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import itertools
import json
import os
import pkgutil
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from unittest import mock

DEFAULT_TARGETS = (80, 90)
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class Launch:
    """One specialisation of a kernel, as a real launch with these arguments would compile it."""

    module: str
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # a launcher's register cap for ptxas, when it sets one

    def key(self) -> tuple:
        return (self.module, self.kernel, repr(sorted(self.signature.items())), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), self.num_warps, self.num_stages, self.maxnreg)

    def flags(self) -> dict:
        """The constexpr arguments by name (dtypes as their names)."""
        names = list(self.signature)
        return {names[path[0]]: (str(v) if not isinstance(v, (bool, int, float)) else v)
                for path, v in self.constexprs.items()}


@dataclass
class Row:
    kernel: str
    target: str
    dtype: str
    flags: str
    block: str
    warps: int
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    shared_bytes: int | None
    error: str | None = None


# The oldest triton whose compiler internals (``triton.knobs``, the JIT binder) this tool and the roofline use.
TOOLS_TRITON_FLOOR = (3, 4)


def compiler_internals_missing() -> str | None:
    """Why this tool cannot run with the installed triton (a sentence), or None when it can."""
    import triton

    try:
        version = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    if version >= TOOLS_TRITON_FLOOR:
        return None
    floor = ".".join(map(str, TOOLS_TRITON_FLOOR))
    return (f"the ahead-of-time compile and the roofline model drive triton's compiler through the internals of "
            f"triton {floor} and later (triton.knobs); the installed triton is {triton.__version__}. Install "
            f"triton >= {floor} (torch >= 2.8 pins one) to run them")


def check_compiler_internals() -> None:
    """A RuntimeError saying why when the installed triton is older than the tools need."""
    reason = compiler_internals_missing()
    if reason is not None:
        raise RuntimeError(reason)


def check_not_interpreted() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling the kernels needs TRITON_INTERPRET unset: interpreted kernels cannot be compiled")


def kernel_modules() -> list:
    """Every kernel module of ``daca_kernels.kernels`` (imported)."""
    import daca_kernels.kernels as package

    return [importlib.import_module(f"{package.__name__}.{info.name}")
            for info in pkgutil.iter_modules(package.__path__)]


def jit_functions(module) -> dict:
    """The ``@triton.jit`` functions defined in ``module``, by name."""
    from triton.runtime.jit import JITFunction

    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, JITFunction) and obj.module == module.__name__}


def callees(fn) -> set:
    """The ``@triton.jit`` functions ``fn`` calls, directly or through other jit functions."""
    from triton.runtime.jit import JITFunction

    found, pending = set(), [fn]
    while pending:
        current = pending.pop()
        for node in ast.walk(ast.parse(current.src)):
            target = None
            if isinstance(node, ast.Name):
                target = current.fn.__globals__.get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = getattr(current.fn.__globals__.get(node.value.id), node.attr, None)
            if isinstance(target, JITFunction) and target is not current and target not in found:
                found.add(target)
                pending.append(target)
    return found


def capture(module) -> list:
    """``(kernel, args, kwargs)`` of every launch the module's ``cuda_launch_cases()`` make;
    nothing is launched."""
    return capture_calls(module.cuda_launch_cases())


def capture_calls(calls) -> list:
    """``(kernel, args, kwargs)`` of every kernel launch the launcher ``calls`` (no-argument
    callables) make; nothing is launched."""
    from triton.runtime.jit import JITFunction

    launches = []

    def record(kernel, *args, grid, warmup, **kwargs):
        launches.append((kernel, args, kwargs))

    with mock.patch.object(JITFunction, "run", record):
        for call in calls:
            call()
    return launches


def specialise(kernel, args, kwargs, capability: int) -> Launch:
    """What a launch of ``kernel`` with these arguments compiles on a GPU of ``capability``,
    computed by Triton's own binder for that target."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**kwargs, "debug": kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return Launch(kernel.module, kernel.__name__, signature, constexprs, attrs, options.num_warps, options.num_stages,
                  options.maxnreg)


def compile_launch(launch: Launch, capability: int):
    """``triton.compile`` of one launch for ``sm_<capability>``: ``(compiled kernel, ptxas -v log)``.

    The log is empty on a cache hit: compile under ``fresh_compile_cache`` when it is needed."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(
            ASTSource(kernel, launch.signature, launch.constexprs, launch.attrs),
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": launch.num_warps, "num_stages": launch.num_stages,
                     **({"maxnreg": launch.maxnreg} if launch.maxnreg else {})},
        )
    return compiled, log.getvalue()


def _compile(job: tuple[Launch, int]) -> Row:
    launch, capability = job
    flags = launch.flags()
    block = ", ".join(f"{k}={v}" for k, v in flags.items() if k.startswith("BLOCK"))
    switches = ", ".join(f"{k}={v}" for k, v in flags.items() if not k.startswith("BLOCK"))
    dtype = next((t[1:] for t in launch.signature.values() if isinstance(t, str) and t.startswith("*")), "")
    row = Row(launch.kernel, f"sm_{capability}", dtype, switches, block, launch.num_warps, None, None, None, None)
    try:
        compiled, log = compile_launch(launch, capability)
    except Exception as error:  # a compile error is a result to report, not a crash of the check
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        # Triton's messages end with the cause (e.g. a NameError) after the offending source line.
        row.error = f"{type(error).__name__}: {lines[-1][:400] if lines else ''}"
        return row
    report = parse_ptxas_report(log)
    if report is None:
        row.error = "no ptxas -v report (a cached compile?)"
        return row
    row.registers, row.spill_stores, row.spill_loads = report
    row.shared_bytes = compiled.metadata.shared
    return row


def parse_ptxas_report(text: str) -> tuple[int, int, int] | None:
    """``(registers, spill store bytes, spill load bytes)`` from ptxas's ``-v`` output, or None."""
    registers, spills = _PTXAS_REGISTERS.search(text), _PTXAS_SPILLS.search(text)
    if registers is None or spills is None:
        return None
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def _fresh_cache(directory: str) -> None:
    # Every compile must run ptxas (a cache hit has no -v report), and nothing stale may answer.
    from triton import knobs

    knobs.cache.dir = directory


@contextlib.contextmanager
def fresh_compile_cache():
    """Compiles inside this context use an empty Triton cache (so ptxas runs and reports)."""
    from triton import knobs

    previous = knobs.cache.dir
    with tempfile.TemporaryDirectory() as cache:
        _fresh_cache(cache)
        try:
            yield
        finally:
            knobs.cache.dir = previous


def check(targets=DEFAULT_TARGETS, jobs: int | None = None, modules=None) -> tuple[list[Row], list[str]]:
    """Compile every launch configuration of ``modules`` (default: every module of
    ``daca_kernels.kernels``) for every target; returns the rows and the problems."""
    check_not_interpreted()
    check_compiler_internals()
    modules = kernel_modules() if modules is None else modules
    problems, launches, reached = [], {}, set()
    for module in modules:
        if not hasattr(module, "cuda_launch_cases"):
            continue  # device functions only: checked through the kernels that call them
        for kernel, args, kwargs in capture(module):
            reached.add(kernel)
            reached |= callees(kernel)
            for capability in targets:
                launch = specialise(kernel, args, kwargs, capability)
                launches.setdefault((launch.key(), capability), (launch, capability))
    for module in modules:
        for name, fn in jit_functions(module).items():
            if fn not in reached:
                problems.append(
                    f"{module.__name__}.{name} is reached by no launch case: launch it from the module's "
                    "cuda_launch_cases() (or call it from a kernel that is launched there)"
                )
    problems += _flag_combinations([launch for launch, _ in launches.values()])
    with tempfile.TemporaryDirectory() as cache:
        with ProcessPoolExecutor(max_workers=jobs or os.cpu_count(), initializer=_fresh_cache, initargs=(cache,)) as pool:
            rows = list(pool.map(_compile, launches.values(), chunksize=4))
    for row in rows:
        where = f"{row.kernel} [{row.target}, {row.dtype}, {row.flags}, {row.block}, {row.warps} warps]"
        if row.error:
            problems.append(f"{where} does not compile: {row.error}")
        elif row.spill_stores:
            problems.append(f"{where} spills {row.spill_stores} bytes")
    return rows, problems


def _flag_combinations(launches: list[Launch]) -> list[str]:
    """Kernels whose boolean constexpr flags were not launched in every combination."""
    problems = []
    by_kernel = {}
    for launch in launches:
        flags = {k: v for k, v in launch.flags().items() if isinstance(v, bool)}
        by_kernel.setdefault(f"{launch.module}.{launch.kernel}", set()).add(tuple(sorted(flags.items())))
    for kernel, combos in sorted(by_kernel.items()):
        names = [name for name, _ in next(iter(combos))]
        expected = {tuple(zip(names, values)) for values in itertools.product((False, True), repeat=len(names))}
        missing = expected - combos
        if missing:
            problems.append(f"{kernel}: flag combinations never launched by its cuda_launch_cases(): {sorted(missing)}")
    return problems


def format_rows(rows: list[Row]) -> str:
    header = ("kernel", "target", "dtype", "flags", "block", "warps", "regs", "spill st/ld", "smem B")
    table = [header] + [
        (r.kernel, r.target, r.dtype, r.flags, r.block, str(r.warps),
         "-" if r.registers is None else str(r.registers),
         "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}",
         "-" if r.shared_bytes is None else str(r.shared_bytes))
        for r in sorted(rows, key=lambda r: (r.kernel, r.target, r.dtype, r.flags, r.block))
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=int, nargs="+", default=list(DEFAULT_TARGETS),
                        help="compute capabilities (80 = A100, 90 = H100)")
    parser.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one per CPU)")
    parser.add_argument("--json", type=str, default=None, help="also write the rows and problems here")
    args = parser.parse_args(argv)
    check_not_interpreted()
    if (reason := compiler_internals_missing()) is not None:
        print(f"ahead_of_time: {reason}", file=sys.stderr)
        return 2
    rows, problems = check(tuple(args.targets), args.jobs)
    print(format_rows(rows))
    print(f"\n{len(rows)} compiled configurations; {len(problems)} problems")
    for problem in problems:
        print(f"  {problem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "problems": problems}, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
