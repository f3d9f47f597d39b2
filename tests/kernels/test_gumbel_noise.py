"""The sampler's fast (GPU) Gumbel noise against the exact noise, over every uniform the hash can give.

``daca_kernels.kernels.gumbel.fast_noise`` runs under the interpreter with ``tl.log2`` in place of
the hardware's ``lg2.approx``; the hardware's documented error is then added to each of its two
logarithms, in float64, to check the bound the module states.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from daca_kernels.kernels import gumbel
from daca_kernels.kernels.launch import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="runs fast_noise without the hardware logarithm")

GRID = 1 << 23  # the uniforms (k + 1/2) / 2**23


@triton.jit
def _fast_noise_kernel(u_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, gumbel.fast_noise(tl.load(u_ptr + offs), False))


@pytest.fixture(scope="module")
def every_uniform():
    """float64 uniforms of the grid, the software fast noise (float32, in units of log 2) and the
    exact ``t = -log2(u)``."""
    u32 = (torch.arange(GRID, dtype=torch.float64) + 0.5).div(GRID).float()
    out = torch.empty_like(u32)
    block = 1 << 16
    _fast_noise_kernel[(GRID // block,)](u32, out, BLOCK=block)
    u = u32.double()
    return u, out.double(), -torch.log2(u)


def test_the_software_formula_is_within_its_series_error(every_uniform):
    # tl.log2 is accurate: what is left is the quadratic's relative error on t and float32 rounding.
    u, fast, t = every_uniform
    error = (fast - (-torch.log2(t))).abs() * math.log(2)  # nats
    assert error.max().item() < 3e-6
    series = (1 - u) < 1 / 16
    assert error[~series].max().item() < 3e-7  # float32 rounding alone outside the series


def test_the_hardware_error_stays_within_the_stated_bound(every_uniform):
    # lg2.approx.f32: absolute error 2**-22 for inputs in [1/2, 2], else 2 units in the last place.
    u, fast, t = every_uniform

    def hardware_error(x, result):
        ulp = torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(result.abs().clamp_min(1e-30))))
        return torch.where((x >= 0.5) & (x <= 2), torch.full_like(x, 2.0**-22), 2 * ulp)

    series = (1 - u) < 1 / 16
    t_error = torch.where(series, torch.zeros_like(t), hardware_error(u, -t))  # of t = -log2(u)
    inner = (torch.log2(t + t_error) - torch.log2(t)).abs()
    outer = hardware_error(t, torch.log2(t))
    software = (fast - (-torch.log2(t))).abs()
    worst = ((inner + outer + software) * math.log(2)).max().item()
    assert worst < 5.5e-6, worst  # the bound the module states
    assert torch.isfinite(fast).all()
