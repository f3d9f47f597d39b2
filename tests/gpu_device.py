"""The device and sizes of the CUDA tests (the ``gpu``-marked tests: ``tests/gpu/`` and a few in
other modules).

They run on CUDA at full size (LLaDA's vocabulary, more than 2**31 logits). Every test body takes its
device from ``DEVICE`` and its large sizes from ``sized``, so that, as a development aid on a machine
without CUDA, ``DACA_GPU_TESTS_ON_CPU=1`` runs the same bodies on CPU under the Triton interpreter
with small sizes (``conftest.py`` then does not skip them; the cases with more than 2**31 elements
run at a small size too)::

    DACA_GPU_TESTS_ON_CPU=1 python -m pytest -m gpu -q

A CPU run checks the tests' logic, not the CUDA kernels: comparisons "CUDA against CPU" then compare
the CPU with itself. The interpreter truncates bfloat16 stores (CUDA rounds them); the tolerances
allow one bfloat16 unit either way.
"""
import copy
import os

import pytest
import torch

ON_CPU = os.environ.get("DACA_GPU_TESTS_ON_CPU", "") == "1"
DEVICE = torch.device("cpu" if ON_CPU else "cuda")
CPU = torch.device("cpu")

LLADA_VOCAB = 126_464
LLADA_MASK_ID = 126_336


def sized(on_gpu: int, on_cpu: int) -> int:
    """``on_gpu`` on CUDA, ``on_cpu`` in a CPU run of the CUDA tests."""
    return on_cpu if ON_CPU else on_gpu


def llada_vocab() -> int:
    """LLaDA's vocabulary on CUDA; 1,976 (126,464 / 64, not a power of two either) in a CPU run."""
    return sized(LLADA_VOCAB, LLADA_VOCAB // 64)


def mask_id_for(vocab: int) -> int:
    """LLaDA's mask id at LLaDA's vocabulary (the same position in a CPU run's smaller one)."""
    return LLADA_MASK_ID * vocab // LLADA_VOCAB


def generator(seed: int, device: torch.device = DEVICE) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def huge_logits(seed: int) -> torch.Tensor:
    """bfloat16 logits ``[17,000, 126,464]``: 2,149,888,000 elements, more than 2**31, so the
    element offsets of rows 16,982 and later need int64 (4.3 GB). ``[40, 1,976]`` in a CPU run.

    Skips the test when the GPU has less free memory than the tensor and its gradient need.
    """
    rows, vocab = sized(17_000, 40), llada_vocab()
    if not ON_CPU:
        needed = 2 * rows * vocab * 2 + (1 << 30)  # the logits, their gradient, 1 GiB of slack
        free, _ = torch.cuda.mem_get_info(DEVICE)
        if free < needed:
            pytest.skip(f"needs {needed / 1e9:.1f} GB of free GPU memory, {free / 1e9:.1f} GB free")
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, device=DEVICE, generator=generator(seed))
    assert ON_CPU or logits.numel() > 2**31
    return logits.mul_(3.0)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal values on ``DEVICE``, scaled, then rounded to ``dtype``."""
    return (torch.randn(*shape, device=DEVICE, generator=generator(seed)) * scale).to(dtype)


def tiny_lm_on_cpu_and_device(**kwargs):
    """The same float64 tiny bidirectional Llama (``tiny_models.tiny_masked_lm(**kwargs)``) as a
    ``MaskedLM`` on CPU and on ``DEVICE``: one set of weights, so that the two differ only by
    rounding, which float64 keeps far below any near-tie of the sampler or the estimators."""
    # Imported here: conftest.py imports this module and must not pull in transformers.
    from tiny_models import tiny_masked_lm

    from daca_kernels.models.masked_lm import MaskedLM

    on_cpu = tiny_masked_lm(dtype=torch.float64, **kwargs)
    module = copy.deepcopy(on_cpu.module).to(DEVICE)
    return on_cpu, MaskedLM.from_hf(module, mask_id=on_cpu.mask_id, shift=on_cpu.shift)
