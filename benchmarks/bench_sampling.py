"""sample_step and a whole rollout against eager PyTorch and LLaDA's sampler, and what the DPS
bookkeeping costs per step (see ``providers.py`` for the providers).

Counted explicitly (``s`` = bytes per logit element):
- ``sample_step``: one read of the N selected rows, ``N*V*s`` (ids and outputs are O(N), left
  out; read only: held to the read ceiling). The eager and LLaDA recipes make several passes over ``[N, V]`` but are credited with the
  same useful bytes.
- ``sample_step_linear``: ``2*N*V*H`` FLOPs (the head); eager and LLaDA form ``hidden @ W.T`` in full.
- ``rollout``: a whole ``generate`` call on a bidirectional Llama (``daca``: the library's sampler
  with the DPS bookkeeping on; ``llada``: LLaDA's loop with full logits), counted as the useful head
  FLOPs ``2*V*H*sum_s N_s`` (``N_s`` rows still masked at step s; LLaDA's loop also multiplies the
  prompt and committed rows, and the backbone is not counted). The row also gives ms per step.
- ``dps_bookkeeping``: what the sampler adds per step for DPS: the scatter of N confidences into
  the dense ``[B, L]`` buffer (``N*24`` bytes: value, two int64 indices, write) and
  ``confidence_delta`` over the two float32 buffers and the mask (``B*L*9`` bytes).
"""
from __future__ import annotations

import torch
from case import Case, Work, head_gemms, pick
from providers import STEP, STEP_LINEAR, TEMPERATURE, available, llada_generate
from transformers import LlamaConfig, LlamaForCausalLM

from daca_kernels import confidence_delta
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rollout import generate
from daca_kernels.rollout.remasking import transfer_counts

STEP_PROVIDERS = ("daca", "eager", "compile", "llada")
# Eager and LLaDA at 32k rows of V = 126,464 would hold several float32/float64 copies of 16 GB.
BASELINE_MAX_ELEMENTS = 16384 * 126464


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _step_setup(fn, n, vocab, dtype, device):
    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(n, vocab, generator=g, device=device) * 3).to(dtype)
        return lambda: fn(logits, vocab - 1)

    return setup


def _step_linear_setup(fn, n, vocab, hidden_size, dtype, device):
    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(n, hidden_size, generator=g, device=device).to(dtype)
        weight = (torch.randn(vocab, hidden_size, generator=g, device=device) / hidden_size**0.5).to(dtype)
        return lambda: fn(hidden, weight, vocab - 1)

    return setup


def _rollout_setup(provider, config, dtype, device):
    batch, prompt_length, gen_length, steps, block_length, hidden_size, layers, vocab = config

    def setup():
        llama = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=layers,
            num_attention_heads=max(1, hidden_size // 128), num_key_value_heads=max(1, hidden_size // 128),
            max_position_embeddings=prompt_length + gen_length, is_causal=False,
        )
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(llama).to(dtype).eval()
        lm = MaskedLM.from_hf(model, mask_id=vocab - 1, verify=False)
        prompt = torch.randint(0, vocab - 1, (batch, prompt_length), device=device)
        schedule = dict(gen_length=gen_length, steps=steps, block_length=block_length)
        if provider == "daca":
            return lambda: generate(lm, prompt, temperature=TEMPERATURE, seed=0, **schedule)
        return lambda: llada_generate(lm, prompt, mask_id=vocab - 1, **schedule)

    return setup


def _masked_rows_per_step(config) -> list[int]:
    """``N_s``, the rows still masked at each step of the rollout (every block starts fully masked)."""
    batch, _, gen_length, steps, block_length, _, _, _ = config
    steps_per_block = steps // (gen_length // block_length)
    schedule = transfer_counts(block_length, steps_per_block)
    remaining, counts = gen_length, []
    for s in range(steps):
        counts.append(batch * remaining)
        remaining -= schedule[s % steps_per_block]
    return counts


def _bookkeeping_setup(batch, prompt_length, gen_length, steps, device):
    def setup():
        length = prompt_length + gen_length
        g = torch.Generator(device=device).manual_seed(0)
        masked = torch.zeros(batch, length, dtype=torch.bool, device=device)
        masked[:, prompt_length + gen_length // 2:] = True  # mid-rollout: half of the completion masked
        b_idx, pos = masked.nonzero(as_tuple=True)
        confidence = torch.rand(b_idx.shape[0], generator=g, device=device)
        current = torch.rand(batch, length, generator=g, device=device)
        previous = torch.rand(batch, length, generator=g, device=device)
        step_gain = torch.zeros(batch, steps, device=device)

        def call():
            current[b_idx, pos] = confidence
            step_gain[:, 1] = confidence_delta(current, previous, masked)

        return call

    return setup


def cases(size: str, device: torch.device) -> list[Case]:
    dtype = _dtype(device)
    name = str(dtype).removeprefix("torch.")
    element = torch.empty((), dtype=dtype).element_size()
    smoke = size == "smoke"
    step_shapes = pick(size, smoke=[(16, 512)], quick=[(512, 32000), (2048, 32000)],
                       full=[(n, 126464) for n in (4096, 16384, 32768)] + [(4096, 32000), (4096, 152064)])
    linear_shapes = pick(size, smoke=[(16, 512, 32)], quick=[(512, 32000, 256)],
                         full=[(n, 126464, 4096) for n in (4096, 16384)])
    # (B, P, G, S, block, H, layers, V)
    rollout = pick(size, smoke=(2, 8, 16, 8, 16, 32, 1, 512), quick=(4, 32, 64, 32, 32, 64, 2, 4096),
                   full=(8, 128, 256, 128, 32, 4096, 2, 126464))
    out = []
    for rank, (n, vocab) in enumerate(step_shapes):
        for provider in STEP_PROVIDERS:
            if not available(provider, device, smoke=smoke) or (provider != "daca" and n * vocab > BASELINE_MAX_ELEMENTS):
                continue
            out.append(Case("sample_step", "fwd", provider, f"N={n},V={vocab}", name,
                            _step_setup(STEP[provider], n, vocab, dtype, device),
                            bytes=Work("N*V*s", n * vocab * element, read_only=True), priority=rank + 0.3))
    for rank, (n, vocab, hidden_size) in enumerate(linear_shapes):
        for provider in STEP_PROVIDERS:
            if not available(provider, device, smoke=smoke):
                continue
            out.append(Case("sample_step_linear", "fwd", provider, f"N={n},V={vocab},H={hidden_size}", name,
                            _step_linear_setup(STEP_LINEAR[provider], n, vocab, hidden_size, dtype, device),
                            flops=Work("2*N*V*H", 2 * n * vocab * hidden_size), priority=rank + 0.35,
                            gemms=head_gemms(n, vocab, hidden_size, "fwd")))
    batch, prompt_length, gen_length, steps, block_length, hidden_size, layers, vocab = rollout
    shape = f"B={batch},P={prompt_length},G={gen_length},S={steps},block={block_length},H={hidden_size},layers={layers},V={vocab}"
    for provider in ("daca", "llada"):
        out.append(Case("rollout", "generate", provider, shape, name, _rollout_setup(provider, rollout, dtype, device),
                        flops=Work("2*V*H*sum_s N_s (head only)", 2 * vocab * hidden_size * sum(_masked_rows_per_step(rollout))),
                        priority=0.4, steps_per_call=steps,
                        gemms=head_gemms(max(_masked_rows_per_step(rollout)), vocab, hidden_size, "fwd")))
    length = prompt_length + gen_length
    n = batch * (gen_length - gen_length // 2)
    out.append(Case("dps_bookkeeping", "per_step", "daca", f"B={batch},L={length},N={n}", "float32",
                    _bookkeeping_setup(batch, prompt_length, gen_length, steps, device),
                    bytes=Work("B*L*9 + N*24", batch * length * 9 + n * 24), priority=0.45))
    return out
