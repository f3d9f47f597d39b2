"""Static performance model of the hot ops on an H100, from their kernels' compiled SASS and a
host-side trace of their launchers; no GPU needed. Each op gets a range, not a point.

    python -m daca_kernels.tools.roofline [--json model.json]

**The kernels.** Each hot kernel is compiled for sm_90 at the settings its CUDA launcher chooses
for LLaDA's head (V = 126,464, bfloat16 logits; ``ahead_of_time`` captures the launch and compiles
it, ptxas's ``-v`` report gives the registers), the cubin is disassembled with the ``nvdisasm``
bundled with triton and the loop over the vocabulary is found: the body of the outermost backward
branch whose body holds a 128-bit global load (any global load for rows not on 16 bytes). Its
instructions are counted by mnemonic; a check that the body's loads read exactly ``BLOCK_V``
elements per iteration catches a loop the compiler unrolled or a wrong loop. Every instruction of
the body is counted once per iteration, so a body must have one branch, the loop's own
(``model_kernel`` refuses others); the instructions outside the loops run once per program.

**One warp-iteration's demands** (``KernelModel.demands``), in clocks of the units of the one
scheduler (of four per SM) the warp stays on: ``issue``, one slot per instruction; the pipes of
``PIPES`` (Hopper per SM: 128 FP32 lanes, so 1 clock per warp instruction; 64 lanes of integer
multiply-add and 64 of the ALU (logic, shifts, compares, min/max, selects, moves), 2 clocks; 16 of
MUFU and conversions, 8 clocks); ``memory``, the warp-iteration's DRAM bytes at a quarter of the
SM's share of the copy bandwidth (3.0 TB/s over 132 SMs at 1.98 GHz). Each iteration's loads are
waited for once (the loop body issues them and uses them; nothing is prefetched across
iterations): a delay of one DRAM latency, 600 clocks unloaded to 1,200 loaded (about 300 and 600
ns; assumptions, not measurements).

**The combination rule.** The warps resident on a scheduler (registers, shared memory, the 64
warps of an SM) are the customers of a closed queueing network whose stations are the units above
plus the latency delay. The slow end of the range is its exact mean value analysis (M. Reiser and
S. S. Lavenberg, "Mean-value analysis of closed multichain queuing networks", J. ACM 27(2), 1980;
E. D. Lazowska et al., *Quantitative System Performance*, 1984, ch. 6): a warp waits in the queue
of every unit it uses, so two units near saturation cannot both be kept busy (with two customers
and two balanced stations, two thirds of either's rate), and too few warps to cover the latency
shows as latency-bound. Each unit is taken with exponential service and a warp with no overlap
of its own instructions, both pessimistic: this end is the one to bet on. The fast end is the
asymptotic bounds of the same network (ibid., ch. 5): no unit busier than always (the classic
roofline's hard minimum over resources), no warp faster than its own demands plus the unloaded
latency.

**An op** (``OpModel``) is every launch its launcher makes at N = 8,192 rows, found by running the
op's implementation on meta tensors as on CUDA (``trace_launches``: Triton kernels caught at their
launch, aten operations by a dispatch mode, views and allocations left out), and each launch
costs 2 to 4 us of launch overhead (an assumption) plus its work: a row kernel, one program per
row, in waves of its resident blocks on the 132 SMs, the partial last wave with the busiest SM's
blocks and so fewer warps to hide the latency; a kernel over ``[N]``-sized vectors (the
fused head's merge of a chunk's statistics), its tensors' bytes at the copy bandwidth; a library GEMM, the larger of its FLOPs at 989
TFLOP/s (the bars' measured matmul rate is taken at the datasheet's peak: the fixed costs weigh
most there) and its bytes at the copy bandwidth; any other operation, its tensors' bytes at the
copy bandwidth. The ceiling is the op's useful work (each logit read once, each gradient written
once; ``2*N*V*H`` FLOPs forward, ``4*N*V*H`` backward) over its predicted time, as a fraction of
the copy bandwidth or of the matmul rate.

**The fused head's GEMM kernels** (``GemmModel``) are modelled from their sm_90 SASS: the loop over
H is the outermost backward branch around a warpgroup MMA (``HGMMA``; the MMAs of one step must do
the tile's ``2 * BLOCK_N * BLOCK_V * BLOCK_H`` FLOPs); each step takes the larger of those FLOPs
at the matmul rate and its instructions at the issue rate, the instructions outside the loop are
added once per tile at the issue rate. Triton's GEMM rate against the library's is an assumption
until a Triton GEMM benchmark is measured on the GPU: the fast end takes it at the library's
rate, the slow end at 80 % of it (``Machine.triton_gemm_fraction``). ``--triton-gemm-fraction F``
puts a measured fraction in its place at the slow end: the share of the matmul ceiling of the
``head_gemm`` benchmark's ``daca`` row (``benchmarks/bench_logprob.py``, run by ``make
gpu-report``), the fused forward's kernel on one vocabulary chunk against the library's GEMM of
the same product. That rate includes the kernel's epilogue, which the model adds again: a
measured fraction errs low.
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
from dataclasses import asdict, dataclass, field, replace
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
    schedulers: int = 4  # warp schedulers (sub-partitions) per SM; a warp stays on one
    # DRAM latency of a load, in clocks: (unloaded, loaded); the fast and the slow end of the range.
    dram_latency_clocks: tuple = (600, 1200)
    # Device time a launch adds to an op, in seconds: (fast, slow).
    launch_seconds: tuple = (2e-6, 4e-6)
    # The fused head's Triton GEMMs against the library's rate: (fast, slow); an assumption until
    # a Triton GEMM benchmark is measured on the GPU (module docstring).
    triton_gemm_fraction: tuple = (1.0, 0.8)

    @property
    def copy_bytes_per_clock(self) -> float:
        """DRAM bytes per clock per SM at the copy bandwidth."""
        return self.copy_bytes_per_s / (self.sms * self.clock_hz)


H100 = Machine("H100 SXM", sms=132, clock_hz=1.98e9, issue_per_clock=4, mufu_per_clock=16,
               copy_bytes_per_s=3.0e12, matmul_flops_per_s=989e12, registers_per_sm=65536, max_warps_per_sm=64)

# Clocks one warp instruction keeps its unit of one scheduler busy (Hopper, per SM: 128 FP32
# lanes, 64 of integer multiply-add, 64 of the ALU, 16 of MUFU and conversions). Instructions not
# listed use the issue slot alone (memory, control, uniform datapath).
PIPES = {
    "fma": {**dict.fromkeys(("FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2", "FSWZADD"), 1),
            **dict.fromkeys(("IMAD", "IMUL"), 2)},
    "alu": dict.fromkeys(("IADD3", "IADD", "VIADD", "LEA", "LOP3", "LOP", "SHF", "SHL", "SHR", "ISETP", "IMNMX",
                          "VIMNMX", "IABS", "BMSK", "SGXT", "PLOP3", "P2R", "R2P", "FMNMX", "FSETP", "FSEL", "FSET",
                          "FCHK", "SEL", "PRMT", "MOV", "I2FP", "F2FP", "HMNMX2", "HSETP2", "HSET2", "POPC", "FLO",
                          "BREV"), 2),
    "xu": dict.fromkeys(("MUFU", "F2F", "F2I", "I2F", "FRND", "I2I"), 8),
}


def mean_value_analysis(demands: list[float], think: float, customers: int) -> float:
    """Throughput (visits per clock) of a closed network of ``customers`` over load-independent
    queueing stations with these service ``demands`` and a delay station of ``think`` clocks:
    exact mean value analysis (Reiser and Lavenberg, 1980)."""
    queues, throughput = [0.0] * len(demands), 0.0
    for n in range(1, customers + 1):
        residence = [d * (1 + q) for d, q in zip(demands, queues)]
        throughput = n / (think + sum(residence))
        queues = [throughput * r for r in residence]
    return throughput


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


_LOAD_BYTES = {".128": 16, ".64": 8, ".U16": 2, ".S16": 2, ".U8": 1, ".S8": 1}


def load_bytes(instruction: Instruction) -> int:
    """Bytes one thread reads with a global load (``LDG``), 0 for any other instruction."""
    if instruction.opcode != "LDG":
        return 0
    return next((n for suffix, n in _LOAD_BYTES.items() if instruction.modifiers.endswith(suffix)), 4)


def find_vocab_loops(instructions: list[Instruction], labels: dict[str, int],
                     vector: bool = True) -> list[list[Instruction]]:
    """The bodies of the loops over the vocabulary: each from the target of a backward branch to the
    branch, whose body holds a 128-bit global load (any global load when not ``vector``: rows not
    on 16 bytes), the outermost ones only (a kernel may split its row into several such loops).
    ValueError if there is none."""
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
        if any(_is_vector_load(i) if vector else i.opcode == "LDG" for i in body):
            loops.append(body)
    if not loops:
        kind = "a 128-bit global load" if vector else "a global load"
        raise ValueError(f"no backward branch encloses {kind}: no vocabulary loop found")
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
    opcodes: dict = field(default_factory=dict)  # the loop body's instructions by mnemonic

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

    def demands(self) -> dict[str, float]:
        """Clocks one warp-iteration of the loop (``block / warps`` elements) keeps each station of its
        scheduler busy: ``issue`` (every instruction; those outside the loop spread over the row's
        iterations), the pipes of ``PIPES`` and ``memory`` (the scheduler's share of the copy
        bandwidth)."""
        m = self.machine
        iterations = math.ceil(self.row_length / self.block) if self.row_length else 0
        demands = {"issue": self.body + (self.outside / iterations if iterations else 0.0)}
        for pipe, clocks in PIPES.items():
            demands[pipe] = float(sum(n * clocks.get(opcode, 0) for opcode, n in self.opcodes.items()))
        demands["memory"] = self.block / self.warps * self.dram_bytes / (m.copy_bytes_per_clock / m.schedulers)
        return demands

    def throughput(self, warps_per_scheduler: int, slow: bool) -> float:
        """Warp-iterations per clock on one scheduler holding this many warps. ``slow``: the mean
        value analysis of the closed network (the warps cycling through the stations of ``demands``
        and the loaded DRAM latency); else the asymptotic bounds (no station busier than always, no
        warp faster than its own demands and the unloaded latency)."""
        demands = self.demands()
        fast_latency, slow_latency = self.machine.dram_latency_clocks
        if slow:
            return mean_value_analysis(list(demands.values()), slow_latency, warps_per_scheduler)
        return min(1 / max(demands.values()), warps_per_scheduler / (sum(demands.values()) + fast_latency))

    @property
    def warps_per_scheduler(self) -> int:
        return max(1, self.resident_warps // self.machine.schedulers)

    def fraction(self, slow: bool) -> float:
        """DRAM bytes per second over the copy bandwidth with every SM full, no launch, no tail."""
        m = self.machine
        n = self.warps_per_scheduler
        elements = self.throughput(n, slow) * self.block / self.warps * m.schedulers * m.sms * m.clock_hz
        return elements * self.dram_bytes / m.copy_bytes_per_s

    def bound(self) -> str:
        """The station with the largest demand, or ``latency`` where too few warps are resident to
        keep it busy at the loaded latency."""
        demands = self.demands()
        if self.warps_per_scheduler / (sum(demands.values()) + self.machine.dram_latency_clocks[1]) < 1 / max(
                demands.values()):
            return "latency"
        return max(demands, key=demands.get)

    def seconds(self, programs: int, slow: bool) -> float:
        """Seconds of one launch of ``programs`` programs, each over a row of ``row_length``: full
        waves of the resident blocks on every SM, then the partial last wave (the busiest SM's
        blocks, fewer warps to hide the latency)."""
        m = self.machine
        blocks = self.resident_warps // self.warps
        iterations = math.ceil(self.row_length / self.block)
        full, rest = divmod(programs, m.sms * blocks)
        clocks = 0.0
        for waves, per_sm in ((full, blocks), (1 if rest else 0, math.ceil(rest / m.sms))):
            if waves:
                n = max(1, per_sm * self.warps // m.schedulers)
                clocks += waves * n * iterations / self.throughput(n, slow)
        return clocks / m.clock_hz


def model_kernel(call, dram_bytes: float, name: str, row_length: int, machine: Machine = H100,
                 capability: int = 90, vector: bool = True) -> KernelModel:
    """Compile the one kernel launch that ``call`` (a launcher call on rows of ``row_length``) makes
    and model it; ``vector``: the row is read with 16-byte loads (else: rows not on 16 bytes)."""
    from daca_kernels.tools import ahead_of_time

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
    loops = find_vocab_loops(instructions, labels, vector)
    body = max(loops, key=len)
    last_exit = max(i.address for i in instructions if i.opcode == "EXIT")
    outside = sum(1 for i in instructions if i.address <= last_exit) - sum(map(len, loops))
    branches = sum(i.opcode == "BRA" for i in body)
    if branches != 1:
        raise ValueError(f"{launch.kernel}: the vocabulary loop holds {branches - 1} branches besides its own; "
                         "the model counts every instruction of the body once per iteration")
    streamed = sum(load_bytes(i) for i in body if not vector or _is_vector_load(i)) * 32 * launch.num_warps
    if streamed != block * element_bytes:
        raise ValueError(f"{launch.kernel}: the loop's loads read {streamed} bytes per iteration, "
                         f"not BLOCK_V * {element_bytes} = {block * element_bytes}: unrolled, or not the vocabulary loop")
    config = ", ".join([element] + [f"{k}={v}" for k, v in flags.items() if k not in ("ACC", "BLOCK_V")])
    opcodes = {}
    for instruction in body:
        opcodes[instruction.opcode] = opcodes.get(instruction.opcode, 0) + 1
    return KernelModel(name, config, block, launch.num_warps, registers, compiled.metadata.shared, element_bytes,
                       dram_bytes, len(body), count_classes(body), outside, row_length, machine, opcodes)


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
    from daca_kernels.tools import ahead_of_time

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
    from daca_kernels.tools.ahead_of_time import check_compiler_internals

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
    def sample(logits):
        return partial(sampling.sample_step_forward, logits, torch.arange(rows), 1.0, 0.7, 1, 2, 3, 126_336, False)

    unaligned = torch.empty(rows, head.vocab + 1, dtype=bf16)[:, 1:]  # rows not on 16 bytes (a prologue first)
    specs = {  # name: (launcher call, DRAM bytes per element, rows read with 16-byte loads)
        "gather fwd bf16": (gather(bf16, False), 2, True),
        "gather bwd bf16": (gather(bf16, True), 4, True),
        "sample_step bf16": (sample(torch.empty(rows, head.vocab, dtype=bf16)), 2, True),
        "sample_step bf16 unaligned": (sample(unaligned), 2, True),
        "gather fwd fp32": (gather(fp32, False), 4, True),
        "gather bwd fp32": (gather(fp32, True), 8, True),
    }
    return {name: model_kernel(call, dram, name, head.vocab, machine, vector=vector)
            for name, (call, dram, vector) in specs.items()}


def head_gemms(head: Head = LLADA, machine: Machine = H100) -> dict[str, GemmModel]:
    """``linear_logprob``'s kernels for one vocabulary chunk (bfloat16 head, no bias, no entropy):
    the forward's statistics and the backward's ``d logits``, launched as the op launches them on a
    GPU."""
    import torch

    from daca_kernels.kernels import linear_logprob
    from daca_kernels.tools.ahead_of_time import check_compiler_internals

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


# ---------------------------------------------------------------------------------------------
# Every launch of an op: a host-side trace of its launcher on meta tensors

# aten operations that launch nothing on a GPU: views and allocations.
FREE_OPS = frozenset({
    "aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty_strided",
    "aten.slice", "aten.select", "aten.squeeze", "aten.unsqueeze", "aten.view", "aten._unsafe_view",
    "aten.permute", "aten.t", "aten.transpose", "aten.expand", "aten.as_strided", "aten.unbind", "aten.alias",
    "aten.detach", "aten.split", "aten.narrow", "aten.lift_fresh", "aten._reshape_alias",
})
GEMM_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})


@dataclass
class Traced:
    """One launch an op makes: a Triton kernel (``kind="triton"``, its programs), a library GEMM
    (``"gemm"``, its FLOPs) or another aten operation (``"small"``); ``bytes``: its tensors'
    bytes (inputs and outputs, each tensor once)."""

    kind: str
    name: str
    programs: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    shapes: tuple = ()


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(tensors) -> float:
    unique = {id(t): t for t in tensors}
    return float(sum(t.numel() * t.element_size() for t in unique.values()))


def trace_launches(fn) -> list[Traced]:
    """Every launch ``fn`` (an op's implementation called on meta tensors as on CUDA ones) makes:
    Triton kernels caught at ``JITFunction.run`` (nothing is compiled or launched), aten operations
    caught by a dispatch mode (views and allocations left out). Index ranges are guarded on the
    device, as on CUDA."""
    import importlib
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.jit import JITFunction

    launches = []

    def record(kernel, *args, grid, warmup, **kwargs):
        grid = grid(kwargs) if callable(grid) else grid
        tensors = _tensors(args)
        launches.append(Traced("triton", kernel.__name__, programs=math.prod(grid), bytes=_nbytes(tensors),
                               shapes=tuple(tuple(t.shape) for t in tensors)))

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket)
            if name in FREE_OPS:
                return out
            tensors = _tensors(args) + _tensors(kwargs or {}) + _tensors(out)
            if name in GEMM_OPS:
                a, b = [t for t in _tensors(args) if t.dim() == 2][-2:]
                launches.append(Traced("gemm", name, flops=2.0 * a.shape[0] * a.shape[1] * b.shape[1],
                                       bytes=_nbytes(tensors)))
            else:
                launches.append(Traced("small", name, bytes=_nbytes(tensors)))
            return out

    def module(name, device):
        return importlib.import_module(f"daca_kernels.kernels.{name}")

    head_module = importlib.import_module("daca_kernels.ops.linear_logprob")
    shared = importlib.import_module("daca_kernels.ops.shared")

    class CudaHead(shared.LMHead):
        """The head as on CUDA: half-precision GEMMs writing float32, no upcast copy."""

        def __init__(self, weight, bias):
            self.acc, self.dtype = shared.accumulation_dtype(weight.dtype), weight.dtype
            self.fp32_out_gemm, self.weight = weight.dtype != self.acc, weight
            self.bias = None if bias is None else bias.to(self.acc)

    with mock.patch.object(JITFunction, "run", record), \
            mock.patch("daca_kernels.ops.dispatch.triton_module", module), \
            mock.patch.object(head_module, "triton_module", module), \
            mock.patch.object(head_module, "LMHead", CudaHead), \
            mock.patch("daca_kernels.validation.GUARDED_ON_DEVICE", ("cuda", "meta")), Mode():
        fn()
    return launches


@dataclass
class OpModel:
    """One op call at LLaDA's head: its launches and the models of its Triton kernels."""

    op: str
    unit: str  # "copy" (useful DRAM bytes) or "matmul" (useful FLOPs)
    useful: float
    launches: list
    kernels: dict  # Triton kernel name -> KernelModel, GemmModel or None (its tensors' bytes)
    machine: Machine = H100

    def launch_seconds(self, launch: Traced, slow: bool) -> float:
        """Modelled seconds of one launch, without the launch's own overhead."""
        m = self.machine
        if launch.kind == "gemm":
            return max(launch.flops / m.matmul_flops_per_s, launch.bytes / m.copy_bytes_per_s)
        if launch.kind == "small":
            return launch.bytes / m.copy_bytes_per_s
        model = self.kernels[launch.name]
        if model is None:  # a kernel over [N]-sized vectors: its tensors' bytes
            return launch.bytes / m.copy_bytes_per_s
        if isinstance(model, KernelModel):
            return model.seconds(launch.programs, slow)
        (n, h), (v, _) = launch.shapes[:2]
        loop, rest = model.seconds(n, v, h)
        return max(loop / m.triton_gemm_fraction[slow], launch.bytes / m.copy_bytes_per_s) + rest

    def seconds(self, slow: bool) -> float:
        overhead = self.machine.launch_seconds[slow]
        return sum(self.launch_seconds(launch, slow) + overhead for launch in self.launches)

    def shares(self, slow: bool) -> dict[str, float]:
        """Seconds by kind of launch (``triton``, ``gemm``, ``small``) and ``launch`` overheads."""
        out = {"triton": 0.0, "gemm": 0.0, "small": 0.0, "launch": 0.0}
        for launch in self.launches:
            out[launch.kind] += self.launch_seconds(launch, slow)
            out["launch"] += self.machine.launch_seconds[slow]
        return out

    def ceiling(self, slow: bool) -> float:
        rate = self.machine.copy_bytes_per_s if self.unit == "copy" else self.machine.matmul_flops_per_s
        return self.useful / self.seconds(slow) / rate


def op_models(kernels: dict[str, KernelModel], gemms: dict[str, GemmModel], head: Head = LLADA,
              machine: Machine = H100) -> dict[str, OpModel]:
    """The modelled ops, each traced as its launcher runs on CUDA (``trace_launches``)."""
    import importlib

    import torch

    gather = importlib.import_module("daca_kernels.ops.gather_logprob")
    sampler = importlib.import_module("daca_kernels.ops.sample_step")
    linear = importlib.import_module("daca_kernels.ops.linear_logprob")
    n, v, h, meta, bf16 = head.rows, head.vocab, head.hidden, "meta", torch.bfloat16
    logits = torch.empty(n, v, dtype=bf16, device=meta)
    targets = torch.empty(n, dtype=torch.int64, device=meta)
    per_row, stats = torch.empty(n, device=meta), torch.empty(n, 2, device=meta)
    no_entropy = torch.empty(0, device=meta)

    def gather_forward():
        gather._gather_logprob_op._init_fn(logits, targets, None, 1.0, False, False, "triton")

    def gather_backward():
        gather._gather_logprob_backward_op._init_fn(per_row, None, logits, targets, None, stats, no_entropy, 1.0,
                                                    "triton")

    def sample(rows):
        return lambda: sampler._sample_step_op._init_fn(rows, None, 0.7, 1, 2, 126_336, False, "triton")

    hidden = torch.empty(n, h, dtype=bf16, device=meta)
    weight = torch.empty(v, h, dtype=bf16, device=meta)

    def head_forward():
        linear._linear_logprob_op._init_fn(hidden, weight, targets, None, 1.0, False, 0, head.vocab_chunk, "triton")

    def head_backward():
        linear._linear_logprob_backward_op._init_fn(per_row, None, hidden, weight, targets, None, stats, no_entropy,
                                                    1.0, 0, head.vocab_chunk, True, True, False, "triton")

    unaligned = torch.empty(n, v + 1, dtype=bf16, device=meta)[:, 1:]
    row_kernels = {"_logprob_fwd_kernel": kernels["gather fwd bf16"], "_logprob_bwd_kernel": kernels["gather bwd bf16"]}
    head_kernels = {"_head_stats_kernel": gemms["head stats bf16"], "_head_dlogits_kernel": gemms["head d logits bf16"],
                    "_merge_chunk_kernel": None}
    specs = {  # op: (unit, useful bytes or FLOPs, launcher calls, kernel models)
        "gather fwd": ("copy", 2 * n * v, [gather_forward], row_kernels),
        "gather fwd+bwd": ("copy", 6 * n * v, [gather_forward, gather_backward], row_kernels),
        "sample_step": ("copy", 2 * n * v, [sample(logits)], {"_sample_step_kernel": kernels["sample_step bf16"]}),
        "sample_step unaligned": ("copy", 2 * n * v, [sample(unaligned)],
                                  {"_sample_step_kernel": kernels["sample_step bf16 unaligned"]}),
        "linear_logprob fwd": ("matmul", 2 * n * v * h, [head_forward], head_kernels),
        "linear_logprob fwd+bwd": ("matmul", 6 * n * v * h, [head_forward, head_backward], head_kernels),
    }
    return {op: OpModel(op, unit, float(useful), [launch for call in calls for launch in trace_launches(call)],
                        models, machine)
            for op, (unit, useful, calls, models) in specs.items()}


@dataclass
class Ceiling:
    """A predicted ceiling of one op as a range (fractions of ``unit``'s peak) against its bar."""

    op: str
    unit: str  # "copy" or "matmul"
    low: float
    high: float
    bar: float
    launches: int
    detail: str

    @property
    def meets_bar(self) -> bool:
        return self.low >= self.bar


BARS = {"gather fwd": 0.90, "gather fwd+bwd": 0.85, "sample_step": 0.80, "sample_step unaligned": 0.80,
        "linear_logprob fwd+bwd": 0.70}


def ceilings(ops: dict[str, OpModel]) -> list[Ceiling]:
    """The predicted range of each modelled op (slow end first), with its bar."""
    rows = []
    for op in ops.values():
        slow, fast = op.seconds(True), op.seconds(False)
        shares = op.shares(True)
        counts = {}
        for launch in op.launches:
            counts[launch.kind] = counts.get(launch.kind, 0) + 1
        detail = (f"{slow * 1e3:.2f}-{fast * 1e3:.2f} ms; launches: "
                  + ", ".join(f"{counts[k]} {k}" for k in ("triton", "gemm", "small") if k in counts)
                  + "; slow end's time: " + ", ".join(f"{k} {t / slow:.0%}" for k, t in shares.items() if t))
        if op.unit == "matmul":  # the slow end with the fused head's Triton GEMMs at the library's rate
            library = replace(op, machine=replace(op.machine, triton_gemm_fraction=(1.0, 1.0)))
            detail += f"; slow end {library.ceiling(True):.1%} with Triton's GEMMs at the library's rate"
        rows.append(Ceiling(op.op, op.unit, op.ceiling(True), op.ceiling(False), BARS.get(op.op, math.nan),
                            len(op.launches), detail))
    return rows


def _table(header: tuple, lines: list[tuple]) -> str:
    table = [header] + lines
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)


def format_kernels(kernels: dict[str, KernelModel]) -> str:
    classes = ("fp32", "int", "move", "mufu", "conversion", "memory", "uniform", "control")
    lines = []
    for k in kernels.values():
        per = {name: k.classes.get(name, 0) / k.elements_per_thread for name in classes}
        other = k.body / k.elements_per_thread - sum(per.values())
        demands = k.demands()
        lines.append((k.name, k.block, k.warps, k.registers, f"{k.occupancy:.0%}",
                      f"{k.instructions_per_element:.2f}", *(f"{per[c]:.2f}" for c in classes), f"{other:.2f}",
                      f"{k.outside_per_element:.2f}", *(f"{demands[s]:.0f}" for s in STATIONS), k.bound(),
                      f"{k.fraction(True):.1%}-{k.fraction(False):.1%}"))
    header = ("kernel", "BLOCK_V", "warps", "regs", "occup.", "instr/elem", *classes, "other", "outside",
              *(f"{s} clk" for s in STATIONS), "bound", "full SMs")
    return _table(header, lines) + "\n\n" + "\n".join(f"{k.name}: {k.config}" for k in kernels.values())


STATIONS = ("issue", "fma", "alu", "xu", "memory")


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
    lines = [(r.op, f"{r.low:.1%}-{r.high:.1%} of {r.unit}", "-" if math.isnan(r.bar) else f">= {r.bar:.0%}",
              "-" if math.isnan(r.bar) else ("meets" if r.meets_bar else "BELOW"), r.launches, r.detail) for r in rows]
    return _table(("op", "predicted range", "bar", "low end", "launches", "detail"), lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=str, default=None, help="also write the kernels and ceilings here")
    parser.add_argument("--triton-gemm-fraction", type=float, default=None, metavar="F",
                        help="the rate of Triton's GEMM against the library's, measured (the head_gemm benchmark's "
                             "daca row, as a fraction of its matmul ceiling), in (0, 2]: the slow end's in place of "
                             f"the assumed {H100.triton_gemm_fraction[1]}")
    args = parser.parse_args(argv)
    machine = H100
    if args.triton_gemm_fraction is not None:
        if not 0 < args.triton_gemm_fraction <= 2:
            parser.error(f"--triton-gemm-fraction must be in (0, 2], got {args.triton_gemm_fraction}")
        measured = args.triton_gemm_fraction
        machine = replace(H100, triton_gemm_fraction=(max(1.0, measured), measured))
    from daca_kernels.tools.ahead_of_time import check_not_interpreted, compiler_internals_missing

    check_not_interpreted()
    if (reason := compiler_internals_missing()) is not None:
        print(f"roofline: {reason}", file=sys.stderr)
        return 2
    kernels, gemms = hot_kernels(machine=machine), head_gemms(machine=machine)
    ops = op_models(kernels, gemms, machine=machine)
    rows = ceilings(ops)
    fast, slow = machine.triton_gemm_fraction
    source = "measured" if args.triton_gemm_fraction is not None else "an assumption"
    print(f"{machine.name}, sm_90, V = {LLADA.vocab}, N = {LLADA.rows} rows: loop-body SASS per vocabulary element "
          "(thread instructions), each station's clocks per warp-iteration, the range with every SM full; "
          f"Triton's GEMMs at {slow:.0%}-{fast:.0%} of the library's rate ({source})\n")
    print(format_kernels(kernels))
    print()
    print(format_gemms(gemms))
    print()
    print(format_ceilings(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": [{**asdict(k), "instructions_per_element": k.instructions_per_element,
                                    "mufu_per_element": k.mufu_per_element, "occupancy": k.occupancy,
                                    "demands": k.demands(), "bound": k.bound(),
                                    "full": [k.fraction(True), k.fraction(False)]} for k in kernels.values()],
                       "ops": {op.op: {"launches": [asdict(launch) for launch in op.launches],
                                       "seconds": [op.seconds(True), op.seconds(False)]} for op in ops.values()},
                       "gemms": [{**asdict(g), "epilogue_per_element": g.epilogue_per_element} for g in gemms.values()],
                       "ceilings": [{**asdict(r), "meets_bar": r.meets_bar} for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
