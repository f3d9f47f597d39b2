"""Static performance model of the hot kernels on an H100, from their compiled SASS; no GPU needed.

    python -m daca_kernels.kernels.roofline [--json model.json]

Each hot kernel is compiled for sm_90 at the settings its CUDA launcher chooses for LLaDA's head
(V = 126,464, bfloat16 logits; ``ahead_of_time`` captures the launch and compiles it, ptxas's
``-v`` report gives the registers), the cubin is disassembled with the ``nvdisasm`` bundled with
triton and the loop over the vocabulary is found: the body of the outermost backward branch
whose body holds a 128-bit global load (the row is read with 16-byte vector loads). Its SASS
instructions are counted by class and divided by the elements one warp handles per iteration
(``BLOCK_V / num_warps``); the result, times 32, is instructions per vocabulary element per
thread. A check that the body's 128-bit loads read exactly ``BLOCK_V`` elements per iteration
catches a loop the compiler unrolled or a wrong loop.

The machine (H100 SXM, ``H100``):
- 132 SMs at 1.98 GHz;
- issue: 4 warp instructions per clock per SM (one per scheduler), any instruction class;
- MUFU (ex2, lg2, rcp, ...): 16 operations per clock per SM (a warp instruction is 32 of them);
- memory: 3.0 TB/s, the copy bandwidth (bytes read plus bytes written per second); a kernel that
  only reads is assumed to read at the same rate;
- 64K 32-bit registers and at most 64 resident warps per SM (occupancy is reported; registers are
  allocated per warp in units of 256, i.e. 8 per thread).
- bfloat16 dense matmul: 989 TFLOP/s.

Assumptions: every SM is busy (N rows, one program per row, with N in the thousands) and enough
warps are resident to hide latency, so each of the three resources can run at its peak; the
kernel's time per element is the largest of its issue, MUFU and memory times, and its ceiling the
smallest of the three rates. Every instruction of the loop body is counted once per iteration, so
a body must have one branch, the loop's own (a forward branch would count as always taken, a
nested loop as running once: ``model_kernel`` refuses both). Other pipes (the half-rate
integer/compare ALU, conversions) are not modelled and could only lower a ceiling; the
instructions outside the loop (once per program: prologue, the final cross-lane reductions) and
the masked lanes of the last block are ignored: at V = 126,464 about 4 % of the bfloat16
forward's instructions (31 iterations of 204 against 268 outside), less for the backward and
sample_step kernels (62 iterations). DRAM traffic is the useful traffic
(each logit read once, each gradient written once); reads of the target ids and scalars hit the
caches.

Ceilings, as a fraction of the copy bandwidth (bytes moved per second at the predicted rate over
3.0 TB/s): ``gather_logprob`` forward (2 bytes read per element), forward + backward (the forward
plus a backward that reads 2 and writes 2 bytes of bfloat16 ``d logits``: 6 bytes in the two
passes' time), ``sample_step`` (Gumbel sampling with the mask id excluded, no entropy: 2 bytes).
``linear_logprob`` is a fraction of the matmul rate: its useful FLOPs (``2*N*V*H`` forward,
``4*N*V*H`` more backward) over the predicted time of every operation of its loop over vocabulary
chunks (``daca_kernels.ops.linear_logprob`` on CUDA with bfloat16 weights, N = 8,192 rows,
H = 4,096, its default chunk of 2,816 head rows, no bias): per chunk, forward: the fused kernel
computing the logits and writing the softmax statistics of each block of 128 columns
(``daca_kernels.kernels.linear_logprob``); backward: the fused kernel computing the logits again
and writing bfloat16 ``d logits``, the ``d hidden`` GEMM accumulated into a float32 ``[N, H]`` buffer (read and written per chunk) and
the ``d weight`` GEMM writing its bfloat16 slice once; per call: zeroing that buffer and casting
it to bfloat16. Each GEMM takes the larger of its FLOPs at the matmul rate and its bytes (operands
read once, output written, the accumulator read too) at the copy bandwidth; each cast or fill takes
its bytes at the copy bandwidth. Not counted: the operations on ``[N]`` and ``[blocks, N]``
vectors (each chunk's local target ids, the merges of the blocks' and the chunks' statistics), at
most 22 * N * 16 bytes against the chunk's N * 2,816 logits, and launch latencies. The backward
recomputes the logits, so four GEMMs do the work of three: 75 % of the matmul rate is this
algorithm's limit.

The fused kernels (``GemmModel``) are modelled from their sm_90 SASS too: the loop over H is the
outermost backward branch around a warpgroup MMA (``HGMMA``; the MMAs of one step must do the
tile's ``2 * BLOCK_N * BLOCK_V * BLOCK_H`` FLOPs). Each step takes the larger of those FLOPs at the
matmul rate (the peak the library GEMMs are given: an assumption for both, which a measurement on
the GPU must check; Triton's GEMMs often reach less of it than the library's) and its instructions
at the issue rate; the instructions outside the loop (address set-up and the epilogue: the
statistics and their reductions over the tile's columns, or the softmax gradient, the one-hot term,
the conversion and stores) are counted once per tile at the issue rate and added, as if no other
tile's MMAs overlapped them (with at most 128 registers two blocks fit on an SM, so they may). Like
the library GEMMs, the partial last wave of tiles is not modelled.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from functools import partial


@dataclass(frozen=True)
class Machine:
    """Peak rates of one GPU (see the module docstring)."""

    name: str
    sms: int
    clock_hz: float
    issue_per_clock: int  # warp instructions per clock per SM
    mufu_per_clock: int  # thread-level MUFU operations per clock per SM
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    registers_per_sm: int
    max_warps_per_sm: int
    register_unit: int = 256  # registers are allocated to a warp in units of this many
    max_blocks_per_sm: int = 32
    shared_bytes_per_sm: int = 228 * 1024


H100 = Machine("H100 SXM", sms=132, clock_hz=1.98e9, issue_per_clock=4, mufu_per_clock=16,
               copy_bytes_per_s=3.0e12, matmul_flops_per_s=989e12, registers_per_sm=65536, max_warps_per_sm=64)


@dataclass(frozen=True)
class Head:
    """The LM head whose calls are modelled: LLaDA's, with ``rows`` selected rows per call."""

    vocab: int = 126_464
    hidden: int = 4096
    rows: int = 8192
    vocab_chunk: int = 2816  # ``daca_kernels.ops.linear_logprob.default_vocab_chunk(vocab, hidden, bfloat16)``


LLADA = Head()

# ---------------------------------------------------------------------------------------------
# SASS: parsing, the vocabulary loop, instruction classes

_INSTRUCTION = re.compile(
    r"^\s*/\*(?P<address>[0-9a-f]+)\*/\s+(?P<predicate>@!?U?P[0-9T]+\s+)?(?P<opcode>[A-Z][A-Z0-9_]*)"
    r"(?P<modifiers>(?:\.[A-Z0-9_]+)*)(?P<operands>[^;]*);"
)
_LABEL = re.compile(r"^(?P<label>\.L\w+):")
_BRANCH_TARGET = re.compile(r"`\((?P<label>\.L\w+)\)")


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # the mnemonic without modifiers, e.g. ``LDG``
    modifiers: str  # e.g. ``.E.128``
    operands: str
    predicated: bool


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions (in address order) and labels (label -> address of the next instruction) of
    ``nvdisasm -c`` output."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group("label"))
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        address = int(match.group("address"), 16)
        for name in pending:
            labels[name] = address
        pending = []
        instructions.append(Instruction(address, match.group("opcode"), match.group("modifiers"),
                                        match.group("operands").strip(), match.group("predicate") is not None))
    return instructions, labels


def _is_vector_load(instruction: Instruction) -> bool:
    return instruction.opcode == "LDG" and instruction.modifiers.endswith(".128")


def find_vocab_loops(instructions: list[Instruction], labels: dict[str, int]) -> list[list[Instruction]]:
    """The bodies of the loops over the vocabulary: each from the target of a backward branch to the
    branch, whose body holds a 128-bit global load, the outermost ones only (a kernel may split its
    row into several such loops). ValueError if there is none."""
    loops = []
    for branch in instructions:
        if branch.opcode != "BRA":
            continue
        target = _BRANCH_TARGET.search(branch.operands)
        if target is None or target.group("label") not in labels:
            continue
        start = labels[target.group("label")]
        if start > branch.address:
            continue  # a forward branch
        body = [i for i in instructions if start <= i.address <= branch.address]
        if any(_is_vector_load(i) for i in body):
            loops.append(body)
    if not loops:
        raise ValueError("no backward branch encloses a 128-bit global load: no vocabulary loop found")
    spans = [(body[0].address, body[-1].address) for body in loops]
    return [body for body, (a, b) in zip(loops, spans)
            if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in spans)]


def find_vocab_loop(instructions: list[Instruction], labels: dict[str, int]) -> list[Instruction]:
    """The body of the loop over the vocabulary: the longest of ``find_vocab_loops``."""
    return max(find_vocab_loops(instructions, labels), key=len)


# Instruction classes by mnemonic; a mnemonic starting with U (and not listed) is the uniform datapath.
CLASSES = {
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FSWZADD"),
    "fp16": ("HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2", "HSET2"),
    "fp64": ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX"),
    "mufu": ("MUFU",),
    "int": ("IADD3", "IADD", "VIADD", "IMAD", "IMUL", "LEA", "LOP3", "LOP", "SHF", "SHL", "SHR", "ISETP",
            "IMNMX", "VIMNMX", "IABS", "POPC", "FLO", "BREV", "BMSK", "SGXT", "PLOP3", "P2R", "R2P"),
    "move": ("MOV", "SEL", "PRMT", "CS2R", "S2R", "S2UR"),
    "conversion": ("F2F", "F2I", "I2F", "I2FP", "F2FP", "FRND", "I2I"),
    "memory": ("LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "LDC", "ATOM", "ATOMG", "RED",
               "LDSM", "STSM", "LDGSTS", "SHFL"),
    "control": ("BRA", "EXIT", "BAR", "BSSY", "BSYNC", "WARPSYNC", "NOP", "RET", "CALL", "YIELD", "BREAK",
                "BMOV", "JMP", "VOTE"),
}
_CLASS_OF = {opcode: name for name, opcodes in CLASSES.items() for opcode in opcodes}


def instruction_class(opcode: str) -> str:
    """The class of a SASS mnemonic: a key of ``CLASSES``, ``uniform`` or ``other``."""
    if opcode in _CLASS_OF:
        return _CLASS_OF[opcode]
    return "uniform" if opcode.startswith("U") else "other"


def count_classes(body: list[Instruction]) -> dict[str, int]:
    counts = {}
    for instruction in body:
        name = instruction_class(instruction.opcode)
        counts[name] = counts.get(name, 0) + 1
    return counts


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin, by the ``nvdisasm`` bundled with triton."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        run = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", path], capture_output=True, text=True, check=True)
    return run.stdout


# ---------------------------------------------------------------------------------------------
# One kernel: instructions per element, occupancy, bounds


@dataclass
class KernelModel:
    """The model of one kernel configuration on ``machine``; rates in elements per second."""

    name: str
    config: str
    block: int
    warps: int
    registers: int
    shared_bytes: int
    element_bytes: int  # bytes of the streamed row per element (the 128-bit load check)
    dram_bytes: float  # DRAM bytes moved per element (read + written)
    body: int  # warp instructions in the loop body
    classes: dict = field(default_factory=dict)  # the loop body's instructions by class
    outside: int = 0  # warp instructions outside the vocabulary loops, run once per row
    row_length: int = 0  # the vocabulary the outside instructions are spread over (0: not counted)
    machine: Machine = H100

    @property
    def elements_per_thread(self) -> float:
        return self.block / (32 * self.warps)

    @property
    def outside_per_element(self) -> float:
        """Thread instructions outside the loops, per vocabulary element of a row."""
        return self.outside * 32 * self.warps / self.row_length if self.row_length else 0.0

    @property
    def instructions_per_element(self) -> float:
        """Thread instructions per vocabulary element: the loop body's and those outside it."""
        return self.body / self.elements_per_thread + self.outside_per_element

    @property
    def mufu_per_element(self) -> float:
        return self.classes.get("mufu", 0) / self.elements_per_thread

    @property
    def resident_warps(self) -> int:
        m = self.machine
        per_warp = math.ceil(self.registers * 32 / m.register_unit) * m.register_unit
        blocks = min(m.registers_per_sm // (per_warp * self.warps), m.max_warps_per_sm // self.warps,
                     m.max_blocks_per_sm,
                     m.shared_bytes_per_sm // self.shared_bytes if self.shared_bytes else m.max_blocks_per_sm)
        return blocks * self.warps

    @property
    def occupancy(self) -> float:
        return self.resident_warps / self.machine.max_warps_per_sm

    def rates(self) -> dict[str, float]:
        """Elements per second each resource allows: ``issue``, ``mufu``, ``memory``."""
        m = self.machine
        per_second = m.sms * m.clock_hz
        mufu = self.mufu_per_element
        return {
            "issue": per_second * m.issue_per_clock * 32 / self.instructions_per_element,
            "mufu": per_second * m.mufu_per_clock / mufu if mufu else math.inf,
            "memory": m.copy_bytes_per_s / self.dram_bytes,
        }

    def seconds_per_element(self) -> float:
        return 1.0 / min(self.rates().values())


def model_kernel(call, dram_bytes: float, name: str, row_length: int, machine: Machine = H100,
                 capability: int = 90) -> KernelModel:
    """Compile the one kernel launch that ``call`` (a launcher call on rows of ``row_length``) makes
    and model it."""
    from daca_kernels.kernels import ahead_of_time

    [(kernel, args, kwargs)] = ahead_of_time.capture_calls([call])
    launch = ahead_of_time.specialise(kernel, args, kwargs, capability)
    with ahead_of_time.fresh_compile_cache():
        compiled, log = ahead_of_time.compile_launch(launch, capability)
    report = ahead_of_time.parse_ptxas_report(log)
    if report is None:
        raise RuntimeError(f"{launch.kernel}: no ptxas -v report")
    registers, spill_stores, _ = report
    if spill_stores:
        raise RuntimeError(f"{launch.kernel} spills {spill_stores} bytes: the model assumes it does not")
    flags = launch.flags()
    block = flags["BLOCK_V"]
    element = next(t for t in launch.signature.values() if isinstance(t, str) and t.startswith("*"))[1:]
    element_bytes = int(re.sub(r"\D", "", element)) // 8
    instructions, labels = parse_sass(disassemble(compiled.asm["cubin"]))
    loops = find_vocab_loops(instructions, labels)
    body = max(loops, key=len)
    last_exit = max(i.address for i in instructions if i.opcode == "EXIT")
    outside = sum(1 for i in instructions if i.address <= last_exit) - sum(map(len, loops))
    branches = sum(i.opcode == "BRA" for i in body)
    if branches != 1:
        raise ValueError(f"{launch.kernel}: the vocabulary loop holds {branches - 1} branches besides its own; "
                         "the model counts every instruction of the body once per iteration")
    streamed = sum(16 for i in body if _is_vector_load(i)) * 32 * launch.num_warps
    if streamed != block * element_bytes:
        raise ValueError(f"{launch.kernel}: the loop's 128-bit loads read {streamed} bytes per iteration, "
                         f"not BLOCK_V * {element_bytes} = {block * element_bytes}: unrolled, or not the vocabulary loop")
    config = ", ".join([element] + [f"{k}={v}" for k, v in flags.items() if k not in ("ACC", "BLOCK_V")])
    return KernelModel(name, config, block, launch.num_warps, registers, compiled.metadata.shared, element_bytes,
                       dram_bytes, len(body), count_classes(body), outside, row_length, machine)


# ---------------------------------------------------------------------------------------------
# A GEMM kernel with an epilogue: the K loop at the matmul rate, the rest at the issue rate

_MMA_SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)")


def find_k_loop(instructions: list[Instruction], labels: dict[str, int]) -> list[Instruction]:
    """The body of a GEMM's loop over the inner dimension: from the target of a backward branch to
    the branch, the outermost such loop whose body holds a warpgroup MMA (``HGMMA``, sm_90).
    ValueError if there is none."""
    loops = []
    for branch in instructions:
        target = _BRANCH_TARGET.search(branch.operands)
        if branch.opcode != "BRA" or target is None or labels.get(target.group("label"), math.inf) > branch.address:
            continue
        body = [i for i in instructions if labels[target.group("label")] <= i.address <= branch.address]
        if any(i.opcode == "HGMMA" for i in body):
            loops.append(body)
    if not loops:
        raise ValueError("no backward branch encloses an HGMMA: no warpgroup-MMA loop found")
    return max(loops, key=len)


@dataclass
class GemmModel:
    """The model of one GEMM kernel with an elementwise epilogue (one ``[block_n, block_v]`` output
    tile per program, an inner loop of ``block_h`` per step) on ``machine``."""

    name: str
    config: str
    block_n: int
    block_v: int
    block_h: int
    warps: int
    registers: int
    shared_bytes: int
    loop_body: int  # warp instructions per step of the inner loop
    outside: int  # warp instructions outside the loop (up to the last EXIT), once per tile
    machine: Machine = H100

    @property
    def epilogue_per_element(self) -> float:
        """Thread instructions outside the loop per output element."""
        return self.outside * 32 * self.warps / (self.block_n * self.block_v)

    def seconds(self, rows: int, cols: int, inner: int) -> tuple[float, float]:
        """``(inner loop, rest)`` seconds of an ``[rows, cols]`` output over ``inner``, on every SM:
        per tile, each step takes the larger of its FLOPs at the matmul rate and its instructions
        at the issue rate, then the instructions outside the loop issue without overlapping the
        loop (of this tile or another)."""
        m = self.machine
        per_clock = m.sms * m.clock_hz
        tiles = math.ceil(rows / self.block_n) * math.ceil(cols / self.block_v)
        mma = 2 * self.block_n * self.block_v * self.block_h / (m.matmul_flops_per_s / per_clock)
        step = max(mma, self.loop_body * self.warps / m.issue_per_clock)
        loop = tiles * math.ceil(inner / self.block_h) * step / per_clock
        rest = tiles * self.outside * self.warps / m.issue_per_clock / per_clock
        return loop, rest


def model_gemm(call, name: str, machine: Machine = H100, capability: int = 90) -> GemmModel:
    """Compile the one GEMM kernel launch that ``call`` makes and model it (``GemmModel``)."""
    from daca_kernels.kernels import ahead_of_time

    [(kernel, args, kwargs)] = ahead_of_time.capture_calls([call])
    launch = ahead_of_time.specialise(kernel, args, kwargs, capability)
    with ahead_of_time.fresh_compile_cache():
        compiled, log = ahead_of_time.compile_launch(launch, capability)
    registers, spill_stores, _ = ahead_of_time.parse_ptxas_report(log)
    if spill_stores:
        raise RuntimeError(f"{launch.kernel} spills {spill_stores} bytes: the model assumes it does not")
    flags = launch.flags()
    instructions, labels = parse_sass(disassemble(compiled.asm["cubin"]))
    body = find_k_loop(instructions, labels)
    if sum(i.opcode == "BRA" for i in body) != 1:
        raise ValueError(f"{launch.kernel}: the inner loop holds branches besides its own")
    # Each warpgroup (4 warps) issues its HGMMAs: their FLOPs must be one step of the tile.
    flops = sum(2 * math.prod(map(int, _MMA_SHAPE.search(i.modifiers + i.operands).groups()))
                for i in body if i.opcode == "HGMMA") * launch.num_warps // 4
    tile_step = 2 * flags["BLOCK_N"] * flags["BLOCK_V"] * flags["BLOCK_H"]
    if flops != tile_step:
        raise ValueError(f"{launch.kernel}: the loop's HGMMAs do {flops} FLOPs per step, not the tile's {tile_step}")
    last_exit = max(i.address for i in instructions if i.opcode == "EXIT")
    outside = sum(1 for i in instructions if i.address <= last_exit) - len(body)
    config = ", ".join(f"{k}={v}" for k, v in flags.items() if not k.startswith("BLOCK") and k != "GROUP_N")
    return GemmModel(name, config, flags["BLOCK_N"], flags["BLOCK_V"], flags["BLOCK_H"], launch.num_warps,
                     registers, compiled.metadata.shared, len(body), outside, machine)


# ---------------------------------------------------------------------------------------------
# The hot kernels at LLaDA's head, and the ops built from them


def hot_kernels(head: Head = LLADA, machine: Machine = H100) -> dict[str, KernelModel]:
    """The kernels of the modelled ops, launched as the ops launch them on a GPU."""
    import torch

    from daca_kernels.kernels import logprob, sampling
    from daca_kernels.kernels.ahead_of_time import check_compiler_internals

    check_compiler_internals()

    rows = 4  # the kernels do not depend on the number of rows
    targets = torch.zeros(rows, dtype=torch.int64)

    def gather(dtype, backward: bool):
        logits = torch.empty(rows, head.vocab, dtype=dtype)
        per_row, stats = torch.empty(rows), torch.empty(rows, 2)
        if backward:
            return partial(logprob.logprob_backward, logits, None, True, targets, per_row, None, stats, per_row, 1.0,
                           torch.empty_like(logits))
        return partial(logprob.logprob_forward, logits, None, targets, 1.0, False)

    bf16, fp32 = torch.bfloat16, torch.float32
    # Sampling (noise scale > 0) with LLaDA's mask id excluded, as the sampler calls it.
    sample = partial(sampling.sample_step_forward, torch.empty(rows, head.vocab, dtype=bf16), torch.arange(rows),
                     1.0, 1.0, 1, 2, 3, 126_336, False)
    specs = {  # name: (launcher call, DRAM bytes per element)
        "gather fwd bf16": (gather(bf16, False), 2),
        "gather bwd bf16": (gather(bf16, True), 4),
        "sample_step bf16": (sample, 2),
        "gather fwd fp32": (gather(fp32, False), 4),
        "gather bwd fp32": (gather(fp32, True), 8),
    }
    return {name: model_kernel(call, dram, name, head.vocab, machine) for name, (call, dram) in specs.items()}


def head_gemms(head: Head = LLADA, machine: Machine = H100) -> dict[str, GemmModel]:
    """``linear_logprob``'s kernels for one vocabulary chunk (bfloat16 head, no bias, no entropy):
    the forward's statistics and the backward's ``d logits``, launched as the op launches them on a
    GPU."""
    import torch

    from daca_kernels.kernels import linear_logprob
    from daca_kernels.kernels.ahead_of_time import check_compiler_internals

    check_compiler_internals()

    rows, bf16 = 4, torch.bfloat16  # the compiled kernels do not depend on the sizes
    per_row, targets = torch.empty(rows), torch.zeros(rows, dtype=torch.int64)
    hidden = torch.empty(rows, head.hidden, dtype=bf16)
    weight = torch.empty(head.vocab, head.hidden, dtype=bf16)[: head.vocab_chunk]
    calls = {
        "head stats bf16": partial(linear_logprob.head_stats, hidden, weight, None, targets, 1.0, False),
        "head d logits bf16": partial(linear_logprob.head_dlogits, hidden, weight, None, targets, per_row, None,
                                      torch.empty(rows, 2), per_row, 1.0,
                                      torch.empty(rows, head.vocab_chunk, dtype=bf16)),
    }
    return {name: model_gemm(call, name, machine) for name, call in calls.items()}


@dataclass
class Ceiling:
    """A predicted ceiling of one op against its bar (both fractions of ``unit``'s peak)."""

    op: str
    unit: str  # "copy" or "matmul"
    ceiling: float
    bound: str
    bar: float
    detail: str

    @property
    def meets_bar(self) -> bool:
        return self.ceiling >= self.bar


BARS = {"gather fwd": 0.90, "gather fwd+bwd": 0.85, "sample_step": 0.80, "linear_logprob fwd+bwd": 0.70}


def _bound(*kernels: KernelModel) -> str:
    names = []
    for kernel in kernels:
        rates = kernel.rates()
        names.append(min(rates, key=rates.get))
    return "+".join(dict.fromkeys(names))


def linear_logprob_seconds(kernels: dict[str, KernelModel], gemms: dict[str, GemmModel], head: Head = LLADA,
                           machine: Machine = H100) -> tuple[float, float, dict[str, float]]:
    """Predicted ``(forward, backward)`` seconds of one ``linear_logprob`` call (module docstring)
    and the seconds of both that each resource limits (``matmul``, ``memory``, ``kernels``: the
    row kernels and the fused kernel's instructions outside its inner loop)."""
    v, h, n, c = head.vocab, head.hidden, head.rows, head.vocab_chunk
    bw, peak = machine.copy_bytes_per_s, machine.matmul_flops_per_s
    limited = {"matmul": 0.0, "memory": 0.0, "kernels": 0.0}

    def spend(seconds: dict[str, float]) -> float:
        resource = max(seconds, key=seconds.get)
        limited[resource] += seconds[resource]
        return seconds[resource]

    def gemm(rows, cols, inner, operand_bytes, out_bytes):
        return spend({"matmul": 2 * rows * cols * inner / peak, "memory": (operand_bytes + out_bytes) / bw})

    def kernel(name, elements):
        return spend({"kernels": elements * kernels[name].seconds_per_element()})

    chunks = [min(c, v - lo) for lo in range(0, v, c)]
    forward = backward = 0.0
    def fused(name, rows, cols, out_bytes):
        loop, rest = gemms[name].seconds(rows, cols, h)
        return spend({"matmul": loop, "memory": (2 * (rows * h + cols * h) + out_bytes) / bw}) + spend({"kernels": rest})

    for r in chunks:
        blocks = math.ceil(r / gemms["head stats bf16"].block_v)
        forward += fused("head stats bf16", n, r, 3 * 4 * blocks * n)  # three float32 statistics per block
        backward += fused("head d logits bf16", n, r, 2 * n * r)  # bfloat16 d logits
        backward += gemm(n, h, r, 2 * (n * r + r * h) + 4 * n * h, 4 * n * h)  # d hidden += (float32)
        backward += gemm(r, h, n, 2 * (n * r + n * h), 2 * r * h)  # d weight slice, written once
    backward += spend({"memory": (4 * n * h + (4 + 2) * n * h) / bw})  # zero the accumulator, cast it
    return forward, backward, limited


def ceilings(kernels: dict[str, KernelModel], gemms: dict[str, GemmModel], head: Head = LLADA,
             machine: Machine = H100) -> list[Ceiling]:
    """The predicted ceiling of each modelled op, with its bar."""
    bw = machine.copy_bytes_per_s
    fwd, bwd, sample = kernels["gather fwd bf16"], kernels["gather bwd bf16"], kernels["sample_step bf16"]
    rows = []
    t = fwd.seconds_per_element()
    rows.append(Ceiling("gather fwd", "copy", fwd.dram_bytes / t / bw, _bound(fwd), BARS["gather fwd"],
                        f"{fwd.instructions_per_element:.2f} instr/elem"))
    t = fwd.seconds_per_element() + bwd.seconds_per_element()
    rows.append(Ceiling("gather fwd+bwd", "copy", (fwd.dram_bytes + bwd.dram_bytes) / t / bw, _bound(fwd, bwd),
                        BARS["gather fwd+bwd"],
                        f"{fwd.instructions_per_element:.2f} + {bwd.instructions_per_element:.2f} instr/elem"))
    t = sample.seconds_per_element()
    rows.append(Ceiling("sample_step", "copy", sample.dram_bytes / t / bw, _bound(sample), BARS["sample_step"],
                        f"{sample.instructions_per_element:.2f} instr/elem"))
    forward, backward, limited = linear_logprob_seconds(kernels, gemms, head, machine)
    flops = 2 * head.rows * head.vocab * head.hidden
    total = forward + backward
    share = ", ".join(f"{name} {seconds / total:.0%}" for name, seconds in limited.items())
    where = f"N={head.rows}, H={head.hidden}, vocab chunk={head.vocab_chunk}"
    rows.append(Ceiling("linear_logprob fwd", "matmul", flops / forward / machine.matmul_flops_per_s, "-",
                        math.nan, f"{where}: {forward * 1e3:.1f} ms predicted"))
    rows.append(Ceiling("linear_logprob fwd+bwd", "matmul", 3 * flops / total / machine.matmul_flops_per_s,
                        max(limited, key=limited.get), BARS["linear_logprob fwd+bwd"],
                        f"{where}: {total * 1e3:.1f} ms predicted; time limited by {share}"))
    return rows


def _table(header: tuple, lines: list[tuple]) -> str:
    table = [header] + lines
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)


def format_kernels(kernels: dict[str, KernelModel]) -> str:
    classes = ("fp32", "int", "move", "mufu", "conversion", "memory", "uniform", "control")
    lines = []
    for k in kernels.values():
        rates = k.rates()
        per = {name: k.classes.get(name, 0) / k.elements_per_thread for name in classes}
        other = k.body / k.elements_per_thread - sum(per.values())
        lines.append((k.name, k.config, k.block, k.warps, k.registers, f"{k.occupancy:.0%}",
                      f"{k.instructions_per_element:.2f}", *(f"{per[c]:.2f}" for c in classes), f"{other:.2f}",
                      f"{k.outside_per_element:.2f}",
                      *(f"{rates[r] * k.dram_bytes / k.machine.copy_bytes_per_s:.0%}" for r in ("issue", "mufu", "memory"))))
    header = ("kernel", "config", "BLOCK_V", "warps", "regs", "occup.", "instr/elem", *classes, "other",
              "outside", "issue", "mufu", "memory")
    return _table(header, lines)


def format_gemms(gemms: dict[str, GemmModel]) -> str:
    lines = []
    for g in gemms.values():
        m = g.machine
        mma = 2 * g.block_n * g.block_v * g.block_h / (m.matmul_flops_per_s / (m.sms * m.clock_hz))
        lines.append((g.name, g.config, f"{g.block_n}x{g.block_v}x{g.block_h}", g.warps, g.registers, g.shared_bytes,
                      f"{mma:.0f}", f"{g.loop_body * g.warps / m.issue_per_clock:.0f}", f"{g.epilogue_per_element:.2f}"))
    header = ("GEMM kernel", "config", "tile", "warps", "regs", "smem B", "MMA clk/step", "issue clk/step",
              "outside-loop instr/elem")
    return _table(header, lines)


def format_ceilings(rows: list[Ceiling]) -> str:
    lines = [(r.op, f"{r.ceiling:.1%} of {r.unit}", r.bound, "-" if math.isnan(r.bar) else f">= {r.bar:.0%}",
              "-" if math.isnan(r.bar) else ("meets" if r.meets_bar else "BELOW"), r.detail) for r in rows]
    return _table(("op", "predicted ceiling", "bound", "bar", "", "detail"), lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=str, default=None, help="also write the kernels and ceilings here")
    args = parser.parse_args(argv)
    from daca_kernels.kernels.ahead_of_time import check_not_interpreted, compiler_internals_missing

    check_not_interpreted()
    if (reason := compiler_internals_missing()) is not None:
        print(f"roofline: {reason}", file=sys.stderr)
        return 2
    kernels, gemms = hot_kernels(), head_gemms()
    rows = ceilings(kernels, gemms)
    print(f"{H100.name}, sm_90, V = {LLADA.vocab}: loop-body SASS per vocabulary element (thread instructions), "
          "bounds as % of copy bandwidth\n")
    print(format_kernels(kernels))
    print()
    print(format_gemms(gemms))
    print()
    print(format_ceilings(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": [{**asdict(k), "instructions_per_element": k.instructions_per_element,
                                    "mufu_per_element": k.mufu_per_element, "occupancy": k.occupancy,
                                    "rates": k.rates()} for k in kernels.values()],
                       "gemms": [{**asdict(g), "epilogue_per_element": g.epilogue_per_element} for g in gemms.values()],
                       "ceilings": [{**asdict(r), "meets_bar": r.meets_bar} for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
