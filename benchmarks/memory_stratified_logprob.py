"""Peak memory of SML (``stratified_logprob``, K strata) against the one-step estimator computed the
naive way (full ``[B, L, V]`` logits, ``log_softmax``, gather), on a bidirectional Llama model.

    python benchmarks/memory_stratified_logprob.py [--vocab 32000 --hidden 256 --batch 4 --length 256 --strata 4]

Providers: ``one_step_eager`` (the naive one-step estimator), ``one_step`` (``one_step_logprob``),
``stratified`` (``stratified_logprob``, K forward passes kept for backward) and
``stratified_checkpoint`` (the same with ``checkpoint=True``: one pass's activations at a time).
Modes: ``fwd`` (no grad: an old-policy or reference pass) and ``fwd+bwd``. Each case runs in a
fresh process (CPU: peak RSS above the model and inputs; CUDA: allocator peak). The script fails
if SML takes more memory than the naive one-step estimator.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peak_memory import measure_cpu_subprocess, measure_in_this_process  # noqa: E402
from results import device_dir, environment_stamp, write_rows  # noqa: E402

from daca_kernels import one_step_logprob, stratified_logprob  # noqa: E402
from daca_kernels.models.masked_lm import MaskedLM  # noqa: E402

PROMPT_FRACTION = 0.25


def _inputs(vocab, hidden, batch, length, layers=2, device="cpu"):
    def setup():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(length, 16),
            is_causal=False, tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config).to(device)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab - 1, (batch, length), generator=g).to(device)
        completion = torch.zeros(batch, length, dtype=torch.bool, device=device)
        completion[:, int(length * PROMPT_FRACTION):] = True
        return MaskedLM.from_hf(model, mask_id=vocab - 1, verify=False), ids, completion

    return setup


def _finish(per_token, lm, grad):
    if grad:
        per_token.sum().backward()
        lm.module.zero_grad(set_to_none=False)


def _eager_one_step(strata, grad):
    def run(lm, ids, completion):
        with torch.set_grad_enabled(grad):
            masked = ids.masked_fill(completion, lm.mask_id)
            logits = lm.module(input_ids=masked).logits
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)
            _finish(logp * completion, lm, grad)

    return run


def _one_step(strata, grad):
    def run(lm, ids, completion):
        with torch.set_grad_enabled(grad):
            _finish(one_step_logprob(lm, ids, completion, seed=0), lm, grad)

    return run


def _stratified(strata, grad, checkpoint=False):
    def run(lm, ids, completion):
        with torch.set_grad_enabled(grad):
            _finish(stratified_logprob(lm, ids, completion, num_strata=strata, seed=0, checkpoint=checkpoint), lm, grad)

    return run


PROVIDERS = {
    "one_step_eager": _eager_one_step,
    "one_step": _one_step,
    "stratified": _stratified,
    "stratified_checkpoint": lambda strata, grad: _stratified(strata, grad, checkpoint=True),
}
MODES = ("fwd", "fwd+bwd")


def _case(provider: str, grad: bool):
    def build(strata, **model_args):
        return _inputs(**model_args), PROVIDERS[provider](strata, grad)

    return build


CASES = {f"{provider}:{mode}": _case(provider, mode == "fwd+bwd") for provider in PROVIDERS for mode in MODES}


def measure(args: dict, strata: int, device: str) -> dict:
    """Peak MB above the model and inputs for each (provider, mode)."""
    peaks = {}
    for case in CASES:
        if case == "stratified_checkpoint:fwd":
            continue  # without gradients checkpointing changes nothing
        if device == "cpu":
            # The chunked PyTorch path: the Triton interpreter would be the wrong thing to measure.
            env = {"DACA_BACKEND": "torch", "TRITON_INTERPRET": "0"}
            tiny = {**args, "vocab": 64, "hidden": 16, "batch": 1, "length": 8}
            peaks[case] = measure_cpu_subprocess(
                "memory_stratified_logprob", case, env, {**args, "strata": strata}, {**tiny, "strata": strata}
            )
        else:
            peaks[case] = measure_in_this_process(*CASES[case](strata, **args, device=device))
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--strata", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = parser.parse_args()
    args = {"vocab": a.vocab, "hidden": a.hidden, "batch": a.batch, "length": a.length, "layers": a.layers}
    peaks = measure(args, a.strata, a.device)

    logits_mb = a.batch * a.length * a.vocab * 4 / 2**20
    print(
        f"Peak memory above model and inputs: Llama (bidirectional) V={a.vocab} H={a.hidden} layers={a.layers}, "
        f"B={a.batch} L={a.length} (completion {a.length - int(a.length * PROMPT_FRACTION)}), K={a.strata}, on {a.device}"
    )
    print(f"  (one float32 [B, L, V] logits tensor = {logits_mb:.0f} MB)")
    print(f"  {'provider':24s} {'fwd MB':>10s} {'fwd+bwd MB':>12s}")
    for name in PROVIDERS:
        fwd = peaks.get(f"{name}:fwd")
        both = peaks[f"{name}:fwd+bwd"]
        print(f"  {name:24s} {'' if fwd is None else f'{fwd:10.1f}':>10s} {both:12.1f}")
    naive = peaks["one_step_eager:fwd+bwd"]
    worst = max(peaks["stratified:fwd+bwd"], peaks["stratified_checkpoint:fwd+bwd"])
    fwd_ok = peaks["stratified:fwd"] <= peaks["one_step_eager:fwd"]
    ok = worst <= naive and fwd_ok
    print(f"  SML (K={a.strata}) / naive one-step, fwd+bwd: {peaks['stratified:fwd+bwd'] / naive:.3f} "
          f"(checkpointed {peaks['stratified_checkpoint:fwd+bwd'] / naive:.3f}); "
          f"fwd: {peaks['stratified:fwd'] / peaks['one_step_eager:fwd']:.3f} -> {'OK' if ok else 'ABOVE the naive one-step estimator'}")

    device = torch.device(a.device)
    stamp = environment_stamp(device)
    shape = f"B={a.batch},L={a.length},V={a.vocab},H={a.hidden},layers={a.layers},K={a.strata}"
    rows = [
        {"op": "stratified_logprob", "mode": f"{case.split(':')[1]} memory", "provider": case.split(":")[0], "shape": shape,
         "dtype": "float32", "peak_mb": round(mb, 1),
         "peak_formula": "peak bytes above model and inputs (CPU: process RSS high-water mark)", **stamp}
        for case, mb in peaks.items()
    ]
    print(f"  rows written to {write_rows(rows, device_dir(device))}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
