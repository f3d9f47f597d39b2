"""Full-attention rollouts with and without Fast-dLLM's approximate KV cache and parallel decoding: forward
tokens, CPU wall-clock, greedy agreement with the exact sampler, and the sampling/scoring gap.

    python benchmarks/full_rollout.py [--prompt 128] [--gen 256] [--block 32] [--steps 256] [--batch 1]
                                      [--threads 1] [--families dream,llada,lladamoe] [--output FILE]

The models are the families' released modeling code (``../shared/released-models``, as a hub checkpoint
loads it) scaled to hidden 256, 4 layers, 8 heads, vocabulary 4096, random weights, in float32. Each row
is one greedy rollout (temperature 0, LLaDA's block-wise rule) of ``--batch`` prompts (after a short warm-up):

* ``forward tokens``: the token columns the backbone ran (``Rollout.forward_tokens``) and their ratio to
  the exact sampler's; ``wall``: seconds of one rollout (one run each) and the ratio.
* ``agree``: the fraction of completion tokens equal to the exact sampler's.
* ``gap``: the mean and the largest ``|rescored - sampled|`` log-probability of the committed tokens
  (``rescore_commits`` against ``Rollout.commit_logprob``); ``dps``: the mean absolute change of the DPS
  weights (``dps_weights``) when the tokens' commit confidences are the full forwards' instead of the
  sampler's (the same tokens, steps and step gains). Rows without a cache are not rescored: every token's
  row came from a full forward of its state, so their gap is 0 by construction
  (``tests/sampler/test_fast_decoding.py``).

``threshold`` rows use the exact rollout's median commit confidence as the threshold: with random weights
the confidences have no natural scale (a trained model's are near 1 for most tokens, where Fast-dLLM's
0.9 applies). LLaDA-8B's released attention cannot place a dual cache's queries
(``daca_kernels.rollout.prefix_cache``): its dual row says why; its prefix rows and every LLaDA-MoE row run
through the released blocks' own cache interface. Random weights make the models near-uniform, so the
agreement and the gap here are an upper bound on the approximation's effect, not a trained model's.
Prints a markdown table and writes it (stamped with the commit and the command) to ``--output`` if given.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from released import hub  # noqa: E402
from results import device_name  # noqa: E402

from daca_kernels.credit import dps_weights  # noqa: E402
from daca_kernels.models.masked_lm import MaskedLM  # noqa: E402
from daca_kernels.rollout import generate, rescore_commits  # noqa: E402
from integration.provenance import BENCH_SOURCE, stamp_line  # noqa: E402

VOCAB = 4096
SPECIAL = dict(mask_token_id=VOCAB - 1, eos_token_id=VOCAB - 2, pad_token_id=VOCAB - 3)
SHAPES = {
    "dream": dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=VOCAB - 2, initializer_range=0.02,
                  **SPECIAL),
    "llada": dict(d_model=256, n_heads=8, n_kv_heads=8, n_layers=4, mlp_hidden_size=512, max_sequence_length=4096,
                  vocab_size=VOCAB, embedding_size=VOCAB, init_std=0.02, **SPECIAL),
    "lladamoe": dict(vocab_size=VOCAB, hidden_size=256, dense_intermediate_size=512, expert_intermediate_size=128,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096,
                     moe_layer_freq=[1, 1, 1, 1], initializer_range=0.02, **SPECIAL),
}
TITLES = {"dream": "Dream / DiffuCoder", "llada": "LLaDA-8B (hub)", "lladamoe": "LLaDA-MoE"}


def load(name: str, directory: Path) -> MaskedLM:
    hub.write_checkpoint(name, directory, seed=0, **SHAPES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MaskedLM.from_hf(hub.load(directory, name))


def timed(lm, ids, options, args):
    start = time.perf_counter()
    rollout = generate(lm, ids, gen_length=args.gen, block_length=args.block, seed=0, **options)
    return rollout, time.perf_counter() - start


def dps_shift(lm, rollout) -> float:
    """Mean |change| of the DPS weights when the commit confidences are the full forwards'."""
    committed = rollout.commit_step >= 0
    sampled = dataclasses.replace(rollout, commit_confidence=torch.where(committed, rollout.commit_logprob.exp(), 0.0))
    rescored = rescore_commits(lm, rollout)
    scored = dataclasses.replace(rollout, commit_confidence=torch.where(committed, rescored.exp(), 0.0))
    gap = (rescored - rollout.commit_logprob)[committed].abs()
    moved = (dps_weights(scored) - dps_weights(sampled))[rollout.completion_mask].abs().mean()
    return float(gap.mean()), float(gap.max()), float(moved)


def rows_of(name: str, lm: MaskedLM, args) -> list[str]:
    ids = torch.randint(0, VOCAB - 4, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    steps = dict(steps=args.steps)
    generate(lm, ids[:, :8], gen_length=args.block, block_length=args.block, steps=4, seed=0)  # warm-up
    exact, exact_wall = timed(lm, ids, steps, args)
    completion = exact.completion_mask
    median = float(exact.commit_confidence[completion].median())
    modes = [("exact", steps), ("prefix", dict(steps, kv_cache="prefix")), ("dual", dict(steps, kv_cache="dual")),
             (f"threshold {median:.2g}", dict(steps, threshold=median)),
             ("threshold + prefix", dict(steps, threshold=median, kv_cache="prefix")),
             ("2 tokens / step", dict(tokens_per_step=2)),
             ("2 tokens / step + prefix", dict(tokens_per_step=2, kv_cache="prefix"))]
    rows = []
    for label, options in modes:
        if label == "exact":
            rollout, wall = exact, exact_wall
        else:
            try:
                rollout, wall = timed(lm, ids, options, args)
            except ValueError as refused:
                rows.append(f"| {TITLES[name]} | {label} | refused: {str(refused).split(':')[1].strip()} "
                            "| | | | | | |")
                print(rows[-1], flush=True)
                continue
        agree = float((rollout.sequences == exact.sequences)[completion].float().mean())
        if options.get("kv_cache") is None:
            # Every row came from a full forward of the state: no gap by construction (tested), not rescored.
            gaps = "0 (full forwards) | 0 | 0"
        else:
            gap_mean, gap_max, moved = dps_shift(lm, rollout)
            gaps = f"{gap_mean:.2e} | {gap_max:.2e} | {moved:.2e}"
        rows.append(f"| {TITLES[name]} | {label} | {rollout.nfe} | {rollout.forward_tokens} "
                    f"({rollout.forward_tokens / exact.forward_tokens:.3f}x) | {wall:.2f} ({wall / exact_wall:.3f}x) "
                    f"| {agree:.3f} | {gaps} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--families", default="dream,llada,lladamoe")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = ["| family | decoding | nfe | forward tokens | wall s | agree | gap mean | gap max | dps moved |",
              "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header), flush=True)
    rows = []
    # The tree measured: stamped when the run starts.
    made_by = stamp_line(measured=BENCH_SOURCE)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            rows += rows_of(name, load(name, Path(tmp) / name), args)
    if args.output:
        settings = (f"{device_name(torch.device('cpu'))}, {args.threads} thread(s); torch {torch.__version__}; "
                    f"P = {args.prompt}, G = {args.gen}, blocks of {args.block}, {args.steps} steps, batch {args.batch}; "
                    "greedy")
        Path(args.output).write_text("# Full-attention rollouts: cache and parallel decoding (CPU)\n\n"
                                     f"{made_by}\n\n{settings}. See the script's docstring for the columns; no GPU "
                                     "rows (no GPU was available for this measurement).\n\n"
                                     + "\n".join(header + rows) + "\n")


if __name__ == "__main__":
    main()
