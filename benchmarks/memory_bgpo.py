"""Peak memory of BGPO's backward: sample by sample (``bgpo_backward``) against all samples at once.

    python benchmarks/memory_bgpo.py [--batch 8 --length 256 --vocab 2048 --hidden 128 --ffn 512]

A small real model (embedding -> MLP -> vocabulary logits, every position seeing the sequence mean)
scores each Monte-Carlo sample: its own random mask, one forward, the per-token log-probabilities of
the masked tokens summed into the sample's ELBO score. Each sample keeps ``[B, L, V]`` logits and
their log-softmax alive until its backward, so building all n graphs at once grows linearly in n,
while ``bgpo_backward`` frees each sample's graph before the next: its peak must not grow with n.
Each case runs in a fresh process (CPU: peak RSS above the inputs; CUDA: allocator peak). Prints a
table, writes result rows, and exits 1 if the sample-by-sample peak at the largest n exceeds 1.5x
its peak at n = 1.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peak_memory import measure_cpu_subprocess, measure_in_this_process  # noqa: E402
from results import device_dir, environment_stamp, write_rows  # noqa: E402

from daca_kernels import bgpo_backward, bgpo_loss, elbo_sample_scores  # noqa: E402

SAMPLE_COUNTS = (1, 4, 16)


class TinyDiffusionScorer(nn.Module):
    """Masked tokens in, per-token log-probabilities of the clean tokens out (``[B, L]``)."""

    def __init__(self, vocab: int, hidden: int, ffn: int):
        super().__init__()
        self.mask_id = vocab
        self.embed = nn.Embedding(vocab + 1, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, vocab))

    def forward(self, tokens: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        h = self.embed(torch.where(masked, self.mask_id, tokens))
        h = h + h.mean(dim=1, keepdim=True)
        logp = torch.log_softmax(self.mlp(h), dim=-1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1)


def _inputs(n, batch, length, vocab, hidden, ffn, device="cpu"):
    def setup():
        torch.manual_seed(0)
        model = TinyDiffusionScorer(vocab, hidden, ffn).to(device)
        g = torch.Generator(device=device).manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, length), generator=g, device=device)
        ratios = torch.rand(n, batch, generator=g, device=device).clamp(min=0.05)
        masks = torch.rand(n, batch, length, generator=g, device=device) < ratios[..., None]
        advantages = torch.randn(batch, generator=g, device=device)
        with torch.no_grad():
            old = torch.stack([elbo_sample_scores(model(tokens, masks[j]), masks[j], ratios[j]) for j in range(n)])
            old += 0.1 * torch.randn(old.shape, generator=g, device=device)
        return model, tokens, masks, ratios, advantages, old

    return setup


def _sample_fn(model, tokens, masks, ratios):
    return lambda j: elbo_sample_scores(model(tokens, masks[j]), masks[j], ratios[j])


def _sample_by_sample(model, tokens, masks, ratios, advantages, old):
    bgpo_backward(_sample_fn(model, tokens, masks, ratios), masks.shape[0], old, advantages)


def _all_at_once(model, tokens, masks, ratios, advantages, old):
    score = _sample_fn(model, tokens, masks, ratios)
    loss, _ = bgpo_loss(torch.stack([score(j) for j in range(masks.shape[0])]), old, advantages)
    loss.backward()


CASES = {
    "sample_by_sample": lambda **a: (_inputs(**a), _sample_by_sample),
    "all_at_once": lambda **a: (_inputs(**a), _all_at_once),
}


def measure(n: int, batch: int, length: int, vocab: int, hidden: int, ffn: int, device: str = "cpu") -> dict:
    """Peak MB above the inputs for each way of back-propagating n samples."""
    args = {"n": n, "batch": batch, "length": length, "vocab": vocab, "hidden": hidden, "ffn": ffn, "device": device}
    if device == "cpu":
        tiny = {**args, "n": 2, "batch": 2, "length": 8, "vocab": 16, "hidden": 8, "ffn": 8}
        return {name: measure_cpu_subprocess("memory_bgpo", name, None, args, tiny) for name in CASES}
    return {name: measure_in_this_process(*CASES[name](**args)) for name in CASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = parser.parse_args()
    dims = {"batch": a.batch, "length": a.length, "vocab": a.vocab, "hidden": a.hidden, "ffn": a.ffn, "device": a.device}
    peaks = {n: measure(n, **dims) for n in SAMPLE_COUNTS}
    logits_mb = a.batch * a.length * a.vocab * 4 / 2**20
    print(f"BGPO backward peak memory above inputs, B={a.batch} L={a.length} V={a.vocab} H={a.hidden} F={a.ffn} float32 on {a.device}")
    print(f"  (one sample's [B, L, V] logits = {logits_mb:.0f} MB)")
    print(f"  {'n':>3s} {'sample_by_sample':>17s} {'all_at_once':>12s}")
    for n, p in peaks.items():
        print(f"  {n:3d} {p['sample_by_sample']:14.1f} MB {p['all_at_once']:9.1f} MB")
    growth = peaks[SAMPLE_COUNTS[-1]]["sample_by_sample"] / peaks[SAMPLE_COUNTS[0]]["sample_by_sample"]
    print(f"  sample_by_sample peak at n={SAMPLE_COUNTS[-1]} / n={SAMPLE_COUNTS[0]} = {growth:.2f} ({'within' if growth <= 1.5 else 'ABOVE'} 1.5x)")
    device = torch.device(a.device)
    stamp = environment_stamp(device)
    rows = [
        {"op": "bgpo_backward", "mode": "fwd+bwd memory", "provider": name, "dtype": "float32", "peak_mb": round(mb, 1),
         "shape": f"n={n},B={a.batch},L={a.length},V={a.vocab},H={a.hidden},F={a.ffn}",
         "peak_formula": "peak bytes above inputs (CPU: process RSS high-water mark)", **stamp}
        for n, p in peaks.items() for name, mb in p.items()
    ]
    print(f"  rows written to {write_rows(rows, device_dir(device))}")
    if growth > 1.5:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
