"""sample_step against eager PyTorch, and what the DPS bookkeeping costs within a rollout.

    DACA_BENCH_QUICK=1 pytest benchmarks/bench_sampling.py -s   # small CPU shapes
    pytest benchmarks/bench_sampling.py -s                      # LLaDA-like shapes (GPU)

Counted explicitly (``s`` = bytes per logit element):
- ``sample_step``: one read of the N selected rows, ``N*V*s`` (ids and outputs are O(N), left
  out). Eager is LLaDA's recipe: float32 softmax, Gumbel noise from ``torch.rand``, argmax of the
  noisy scores, gather of the candidate's probability; it makes several passes over ``[N, V]``
  but is credited with the same useful bytes.
- ``sample_step_linear``: ``2*N*V*H`` FLOPs (the head); eager forms ``hidden @ W.T`` in full.
- ``rollout``: a whole :func:`daca_kernels.rollout.generate` call on a bidirectional Llama with
  the DPS bookkeeping on; counted as the head FLOPs ``2*V*H*sum_s N_s`` (``N_s`` rows still masked
  at step s), the backbone is not counted.
- ``dps_bookkeeping``: what the sampler adds per step for DPS: the scatter of N confidences into
  the dense ``[B, L]`` buffer (``N*24`` bytes: value, two int64 indices, write) and
  ``confidence_delta`` over the two float32 buffers and the mask (``B*L*9`` bytes). Its row's
  formula also states its share of a rollout step (rollout time / S), which is printed too.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ceilings import median_ms
from conftest import DEVICE, QUICK, SMOKE, peak_mb, rounds, shapes, timed
from daca_kernels import confidence_delta, sample_step, sample_step_linear
from daca_kernels.masked_lm import MaskedLM
from daca_kernels.rollout import generate
from daca_kernels.reference.sampling import transfer_counts

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TEMPERATURE = 0.7

STEP_SHAPES = shapes(
    quick=[(64, 4096), (64, 32000)],
    full=[(n, 126464) for n in (4096, 16384, 32768)] + [(4096, 32000), (4096, 152064)],
)
LINEAR_SHAPES = shapes(quick=[(64, 4096, 256)], full=[(n, 126464, 4096) for n in (4096, 16384)])
# (B, P, G, S, block, H, layers, V)
if SMOKE:
    ROLLOUT = (2, 8, 16, 8, 16, 32, 1, 512)
elif QUICK:
    ROLLOUT = (4, 32, 64, 32, 32, 64, 2, 4096)
else:
    ROLLOUT = (8, 128, 256, 128, 32, 4096, 2, 126464)

PROVIDERS = ["daca", "eager"] + ([] if SMOKE else ["compile"])
# Eager at 32k rows of V = 126464 would hold ~4 float32 copies of 16 GB: left to the fused op.
EAGER_MAX_ELEMENTS = 16384 * 126464

_measured: dict[str, float] = {}


def eager_sample_step(logits, mask_id):
    x = logits.float().index_fill(1, torch.tensor([mask_id], device=logits.device), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    gumbel = -torch.log(-torch.log(torch.rand_like(x)))
    candidate = (x / TEMPERATURE + gumbel).argmax(dim=-1)
    return candidate, probs.gather(-1, candidate[:, None]).squeeze(-1)


def eager_sample_step_linear(hidden, weight, mask_id):
    return eager_sample_step(hidden @ weight.T, mask_id)


_compiled = {}


def compiled(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


def daca_step(logits, mask_id):
    return sample_step(logits, temperature=TEMPERATURE, seed=0, step=3, mask_id=mask_id)


def daca_step_linear(hidden, weight, mask_id):
    return sample_step_linear(hidden, weight, temperature=TEMPERATURE, seed=0, step=3, mask_id=mask_id)


STEP = {"daca": daca_step, "eager": eager_sample_step, "compile": lambda *a: compiled(eager_sample_step)(*a)}
LINEAR = {"daca": daca_step_linear, "eager": eager_sample_step_linear,
          "compile": lambda *a: compiled(eager_sample_step_linear)(*a)}


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n,vocab", STEP_SHAPES)
def test_sample_step(benchmark, record, provider, n, vocab):
    if provider != "daca" and n * vocab > EAGER_MAX_ELEMENTS:
        pytest.skip("eager would not fit in memory at this shape")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(n, vocab, generator=g, device=DEVICE) * 3).to(DTYPE)
    fn = STEP[provider]
    call = timed(lambda: fn(logits, vocab - 1))
    benchmark.pedantic(call, **rounds(quick=3, full=20))
    record.add(benchmark, op="sample_step", mode="fwd", provider=provider, shape=f"N={n},V={vocab}", dtype=DTYPE,
               bytes=n * vocab * logits.element_size(), formula="N*V*s", peak_mb=peak_mb(call))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n,vocab,hidden_size", LINEAR_SHAPES)
def test_sample_step_linear(benchmark, record, provider, n, vocab, hidden_size):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(n, hidden_size, generator=g, device=DEVICE).to(DTYPE)
    weight = (torch.randn(vocab, hidden_size, generator=g, device=DEVICE) / hidden_size**0.5).to(DTYPE)
    fn = LINEAR[provider]
    call = timed(lambda: fn(hidden, weight, vocab - 1))
    benchmark.pedantic(call, **rounds(quick=3, full=10))
    record.add(benchmark, op="sample_step_linear", mode="fwd", provider=provider,
               shape=f"N={n},V={vocab},H={hidden_size}", dtype=DTYPE, flops=2 * n * vocab * hidden_size,
               formula="2*N*V*H", peak_mb=peak_mb(call))


def _rollout_model():
    batch, prompt_length, gen_length, steps, block_length, hidden_size, layers, vocab = ROLLOUT
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden_size // 128), num_key_value_heads=max(1, hidden_size // 128),
        max_position_embeddings=prompt_length + gen_length, is_causal=False,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(DTYPE).eval()
    lm = MaskedLM.from_hf(model, mask_id=vocab - 1, verify=False)
    prompt = torch.randint(0, vocab - 1, (batch, prompt_length), device=DEVICE)
    kwargs = dict(gen_length=gen_length, steps=steps, block_length=block_length, temperature=TEMPERATURE, seed=0)
    return lm, prompt, kwargs


def _rollout_shape():
    batch, prompt_length, gen_length, steps, block_length, hidden_size, layers, vocab = ROLLOUT
    return f"B={batch},P={prompt_length},G={gen_length},S={steps},block={block_length},H={hidden_size},layers={layers},V={vocab}"


def _masked_rows_per_step():
    """``N_s``, the rows still masked at each step of the rollout (every block starts fully masked)."""
    batch, _, gen_length, steps, block_length, _, _, _ = ROLLOUT
    steps_per_block = steps // (gen_length // block_length)
    schedule = transfer_counts(block_length, steps_per_block)
    remaining, counts = gen_length, []
    for s in range(steps):
        counts.append(batch * remaining)
        remaining -= schedule[s % steps_per_block]
    return counts


def test_rollout(benchmark, record):
    lm, prompt, kwargs = _rollout_model()
    call = timed(lambda: generate(lm, prompt, **kwargs))
    benchmark.pedantic(call, **rounds(quick=3, full=3))
    _measured["rollout_ms"] = benchmark.stats.stats.median * 1e3
    _, _, _, _, _, hidden_size, _, vocab = ROLLOUT
    record.add(benchmark, op="rollout", mode="generate", provider="daca", shape=_rollout_shape(), dtype=DTYPE,
               flops=2 * vocab * hidden_size * sum(_masked_rows_per_step()),
               formula="2*V*H*sum_s N_s (head only; backbone not counted)")


def test_dps_bookkeeping(benchmark, record):
    batch, prompt_length, gen_length, steps, _, _, _, _ = ROLLOUT
    length = prompt_length + gen_length
    g = torch.Generator(device=DEVICE).manual_seed(0)
    # Mid-rollout: half of the completion still masked.
    masked = torch.zeros(batch, length, dtype=torch.bool, device=DEVICE)
    masked[:, prompt_length + gen_length // 2:] = True
    b_idx, pos = masked.nonzero(as_tuple=True)
    confidence = torch.rand(b_idx.shape[0], generator=g, device=DEVICE)
    current = torch.rand(batch, length, generator=g, device=DEVICE)
    previous = torch.rand(batch, length, generator=g, device=DEVICE)
    step_gain = torch.zeros(batch, steps, device=DEVICE)

    def bookkeeping():
        current[b_idx, pos] = confidence
        step_gain[:, 1] = confidence_delta(current, previous, masked)

    call = timed(bookkeeping)
    benchmark.pedantic(call, **rounds(quick=20, full=100))
    bookkeeping_ms = benchmark.stats.stats.median * 1e3
    if "rollout_ms" not in _measured:
        lm, prompt, kwargs = _rollout_model()
        _measured["rollout_ms"] = median_ms(lambda: generate(lm, prompt, **kwargs), DEVICE, warmup=1, repeats=3)
    step_ms = _measured["rollout_ms"] / steps
    share = 100 * bookkeeping_ms / step_ms
    print(f"\nDPS bookkeeping: {bookkeeping_ms:.4f} ms per step = {share:.3f}% of a rollout step "
          f"({step_ms:.3f} ms, {_rollout_shape()}, {DEVICE.type})")
    n = b_idx.shape[0]
    record.add(benchmark, op="dps_bookkeeping", mode="per_step", provider="daca",
               shape=f"B={batch},L={length},N={n}", dtype=torch.float32, bytes=batch * length * 9 + n * 24,
               formula=f"B*L*9 + N*24; {share:.3f}% of a rollout step ({step_ms:.3f} ms at {_rollout_shape()})")
