"""Block-wise decoding with the KV cache of committed blocks against recomputing the prefix each
step: rollout time, backbone calls and token columns run, at equal outputs.

    python benchmarks/block_rollout.py [--prompt 64] [--gen 128] [--block 16] [--steps 8] [--batch 4] [--threads 1]

The models are the repository's SDAR and LLaDA2 test doubles (``tests/families``: the released
interfaces and cache protocols) scaled to hidden 256, 4 layers, vocabulary 4096, random weights;
left-padded prompts (row ``b`` padded by ``3 * b`` tokens), sampled at temperature 0.8 with the
confidence threshold 0.5. Each mode is asserted to give the same sequences before it is timed
(``timing.measure``). Prints a markdown table; writes no rows.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from families import llada2, sdar  # noqa: E402
from results import device_name  # noqa: E402
from timing import measure  # noqa: E402

from daca_kernels.models.masked_lm import MaskedLM  # noqa: E402
from daca_kernels.rollout import generate  # noqa: E402

MASK_ID, VOCAB = 60, 4096
SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)


def models(block: int) -> dict[str, MaskedLM]:
    sdar_model = sdar.tiny(seed=0, block_size=block, **SHAPE)
    llada2_model = llada2.tiny(seed=0, use_cache=False, moe_intermediate_size=128, **SHAPE)
    return {
        "SDAR": MaskedLM.from_hf(sdar_model),
        "LLaDA2": MaskedLM.from_hf(llada2_model, mask_id=MASK_ID, block_size=block),
    }


def prompts(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, MASK_ID, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b in range(batch):
        mask[b, : 3 * b] = False
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matrices: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    ids, mask = prompts(args.batch, args.prompt)
    print(f"{device_name(device)}, {torch.get_num_threads()} threads; B={args.batch}, P={args.prompt}, "
          f"G={args.gen}, block {args.block}, {args.steps} steps per block, temperature 0.8, threshold 0.5\n")
    print("| model | KV cache | rollout ms (median) | backbone calls | token columns run | steps |")
    print("|---|---|---:|---:|---:|---:|")
    for name, lm in models(args.block).items():
        options = dict(gen_length=args.gen, steps=args.steps, seed=0, temperature=0.8, threshold=0.5, prompt_mask=mask)
        runs = {cache: generate(lm, ids, kv_cache=cache, **options) for cache in (True, False)}
        if not torch.equal(runs[True].sequences, runs[False].sequences):
            raise SystemExit(f"{name}: the cached and recomputed rollouts differ")
        for cache, rollout in runs.items():
            timing = measure(lambda: generate(lm, ids, kv_cache=cache, **options), device,
                             target_ms=1000.0, min_reps=3, max_ms=20000.0)
            print(f"| {name} | {'yes' if cache else 'no'} | {timing.median_ms:.0f} | {rollout.nfe} | "
                  f"{rollout.forward_tokens} | {rollout.num_steps} |")


if __name__ == "__main__":
    main()
