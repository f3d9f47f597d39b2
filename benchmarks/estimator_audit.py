"""Estimator audit: every likelihood estimator against the exact likelihood of a tiny model.

    python benchmarks/estimator_audit.py [--seeds 200 --steps 600]

A masked diffusion LM samples a completion by unmasking one position at a time in a uniformly
random order sigma, so the likelihood of a completion y (length C) given the prompt is

    log p(y) = log mean_sigma prod_k p(y_sigma_k | y_sigma_<k, prompt)

and the masked-diffusion ELBO is ``mean_sigma sum_k log p(y_sigma_k | y_sigma_<k, prompt)``. For
C <= 6 both are computed exactly: the conditionals only depend on the set of revealed positions, so
one forward pass per subset (2^C of them) gives every factor, and a recursion over subsets sums
the C! orders. Both are differentiable, which gives the exact gradient too.

The model is a tiny bidirectional Llama trained here for a few hundred steps (masked-diffusion
loss) on a synthetic task with strong dependencies inside the completion (a random model is
nearly uniform and would make every estimator look unbiased): the prompt is P random symbols, the
completion repeats ``a`` on even and ``b`` on odd positions, ``a`` and ``b`` drawn uniformly from the
first four prompt symbols, each completion symbol replaced by a uniform one with probability 0.1.

For each estimator and each of ``--seeds`` seeds (the masks' seed) on a fixed batch of
completions, the script records the sequence-level estimate ``sum_i out[b, i]`` and the gradient of
``sum_b A_b * estimate_b`` (fixed random advantages A, as in a policy-gradient step). It reports
the bias and the standard deviation over seeds against the exact log-likelihood, the bias against
the exact ELBO, the mean cosine between a single draw's gradient and the exact gradient of
``sum_b A_b log p(y_b)``, and the cosine of the gradient averaged over seeds. It writes
``benchmarks/results/estimator_audit.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import RESULTS_DIR, environment_stamp  # noqa: E402

from daca_kernels import coupled_logprob, elbo_samples, one_step_logprob, stratified_logprob  # noqa: E402
from daca_kernels.models.masked_lm import MaskedLM  # noqa: E402
from integration import provenance  # noqa: E402

SYMBOLS = 12
MASK_ID = SYMBOLS
PROMPT = 6
COMPLETION = 6
NOISE = 0.1
CHOICES = 4  # a and b are drawn from the first CHOICES prompt symbols


# ----------------------------------------------------------------------------- the task and model
def sample_task(n: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, P + C]`` ids: prompt, then a completion alternating two prompt symbols (with noise)."""
    prompt = torch.randint(0, SYMBOLS, (n, PROMPT), generator=generator)
    which = torch.randint(0, CHOICES, (n, 2), generator=generator)
    a, b = prompt.gather(1, which[:, :1]), prompt.gather(1, which[:, 1:])
    completion = torch.where(torch.arange(COMPLETION) % 2 == 0, a, b)
    noisy = torch.rand(n, COMPLETION, generator=generator) < NOISE
    completion = torch.where(noisy, torch.randint(0, SYMBOLS, (n, COMPLETION), generator=generator), completion)
    return torch.cat([prompt, completion], dim=1)


def task_logprob(ids: torch.Tensor) -> torch.Tensor:
    """``[n]``: log-probability of each completion under the task's own distribution."""
    prompt, completion = ids[:, :PROMPT], ids[:, PROMPT:]
    even = torch.arange(COMPLETION) % 2 == 0
    terms = []
    for i in range(CHOICES):
        for j in range(CHOICES):
            target = torch.where(even, prompt[:, i:i + 1], prompt[:, j:j + 1])
            p = (1 - NOISE) * (completion == target) + NOISE / SYMBOLS
            terms.append(p.log().sum(1) - 2 * math.log(CHOICES))
    return torch.logsumexp(torch.stack(terms), dim=0)


def build_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=SYMBOLS + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=16, is_causal=False,
    )
    return LlamaForCausalLM(config)


def train(model, steps: int, batch: int, seed: int) -> list[float]:
    """Masked-diffusion training: mask each completion position with probability t ~ U(0, 1)
    (at least one), cross-entropy on the masked positions."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    prompt = torch.zeros(batch, PROMPT, dtype=torch.bool)
    losses = []
    model.train()
    for _ in range(steps):
        ids = sample_task(batch, generator)
        t = torch.rand(batch, 1, generator=generator)
        masked = torch.rand(batch, COMPLETION, generator=generator) < t
        empty = ~masked.any(1)
        masked[empty, torch.randint(0, COMPLETION, (int(empty.sum()),), generator=generator)] = True
        masked = torch.cat([prompt, masked], dim=1)
        logits = model(input_ids=ids.masked_fill(masked, MASK_ID)).logits
        loss = torch.nn.functional.cross_entropy(logits[masked], ids[masked])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses


# ----------------------------------------------------------------------------- exact quantities
def exact_loglik_and_elbo(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``log p(y)`` and ELBO ``[B]`` of the completions of ``ids`` (differentiable).

    State S (a bitmask over completion positions) = the revealed positions. One forward pass per
    state gives ``log p(y_i | S)`` for every i; ``Z(S)`` sums, over the orders revealing S, the
    product of the factors: ``Z(S) = sum_{i in S} Z(S - i) p(y_i | S - i)`` and
    ``p(y) = Z(all) / C!``. The ELBO weights ``log p(y_i | S)`` by the probability that a random
    order reveals exactly S and then i: ``|S|! (C - |S| - 1)! / C!``.
    """
    batch, states = ids.shape[0], 1 << COMPLETION
    revealed = torch.tensor([[(s >> i) & 1 for i in range(COMPLETION)] for s in range(states)], dtype=torch.bool)
    inputs = ids[:, None, :].repeat(1, states, 1)
    inputs[:, :, PROMPT:] = inputs[:, :, PROMPT:].masked_fill(~revealed[None], MASK_ID)
    logits = model(input_ids=inputs.view(-1, ids.shape[1])).logits.view(batch, states, ids.shape[1], -1)
    logp = torch.log_softmax(logits[:, :, PROMPT:].float(), dim=-1)
    logp = logp.gather(-1, ids[:, None, PROMPT:, None].expand(-1, states, -1, 1)).squeeze(-1)  # [B, 2^C, C]

    log_z = [None] * states
    log_z[0] = torch.zeros(batch)
    elbo = torch.zeros(batch)
    for s in sorted(range(states), key=lambda v: bin(v).count("1")):
        size = bin(s).count("1")
        if s:
            log_z[s] = torch.logsumexp(
                torch.stack([log_z[s ^ (1 << i)] + logp[:, s ^ (1 << i), i] for i in range(COMPLETION) if s >> i & 1]), dim=0
            )
        if size < COMPLETION:
            weight = math.factorial(size) * math.factorial(COMPLETION - size - 1) / math.factorial(COMPLETION)
            elbo = elbo + weight * sum(logp[:, s, i] for i in range(COMPLETION) if not s >> i & 1)
    return log_z[states - 1] - math.lgamma(COMPLETION + 1), elbo


# ----------------------------------------------------------------------------- estimators
def _elbo_mc(num_samples):
    return lambda lm, ids, c, seed: elbo_samples(lm, ids, c, num_samples=num_samples, seed=seed).elbo().mean(0)


def _sum(fn):
    return lambda lm, ids, c, seed: fn(lm, ids, c, seed).sum(-1)


# name -> (forward passes, sequence-level estimate [B])
ESTIMATORS = {
    "one-step (d1)": (1, _sum(lambda lm, ids, c, s: one_step_logprob(lm, ids, c, seed=s))),
    "one-step, prompt masked p=0.15 (d1)": (1, _sum(lambda lm, ids, c, s: one_step_logprob(lm, ids, c, seed=s, prompt_mask_prob=0.15))),
    "coupled, t in [0.2, 0.8]": (2, _sum(lambda lm, ids, c, s: coupled_logprob(lm, ids, c, seed=s))),
    "SML K=2": (2, _sum(lambda lm, ids, c, s: stratified_logprob(lm, ids, c, num_strata=2, seed=s))),
    "SML K=3": (3, _sum(lambda lm, ids, c, s: stratified_logprob(lm, ids, c, num_strata=3, seed=s))),
    f"SML K=C={COMPLETION}": (COMPLETION, _sum(lambda lm, ids, c, s: stratified_logprob(lm, ids, c, num_strata=COMPLETION, seed=s))),
    "ELBO-MC n=1": (1, _elbo_mc(1)),
    "ELBO-MC n=2": (2, _elbo_mc(2)),
    f"ELBO-MC n={COMPLETION}": (COMPLETION, _elbo_mc(COMPLETION)),
}


def _flat_grad(scalar, params):
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(scalar, params)])


def _cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def audit(lm, ids, completion, advantages, exact_logp, exact_elbo, exact_grad, seeds):
    params = [p for p in lm.module.parameters() if p.requires_grad]
    rows = {}
    for name, (passes, estimate) in ESTIMATORS.items():
        values, cosines, grad_sum = [], [], torch.zeros_like(exact_grad)
        for seed in range(seeds):
            value = estimate(lm, ids, completion, seed)
            grad = _flat_grad((advantages * value).sum(), params)
            values.append(value.detach())
            cosines.append(_cosine(grad, exact_grad))
            grad_sum += grad
        values = torch.stack(values)  # [seeds, B]
        error = values - exact_logp
        rows[name] = {
            "forward_passes": passes,
            "bias": float(error.mean(0).mean()),
            "std": float(values.std(0, unbiased=True).mean()) if seeds > 1 else 0.0,
            "rmse": float(error.pow(2).mean().sqrt()),
            "bias_vs_elbo": float((values - exact_elbo).mean(0).mean()),
            "grad_cosine": sum(cosines) / len(cosines),
            "mean_grad_cosine": _cosine(grad_sum / seeds, exact_grad),
        }
    return rows


# ----------------------------------------------------------------------------- report
def markdown_table(rows: dict) -> str:
    lines = [
        "| estimator | forward passes | bias vs log p | std over seeds | RMSE | bias vs ELBO | grad cosine (one draw) | grad cosine (mean of draws) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['forward_passes']} | {r['bias']:+.3f} | {r['std']:.3f} | {r['rmse']:.3f} | "
            f"{r['bias_vs_elbo']:+.3f} | {r['grad_cosine']:.3f} | {r['mean_grad_cosine']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=200, help="mask seeds per estimator")
    parser.add_argument("--steps", type=int, default=600, help="training steps of the tiny model")
    parser.add_argument("--batch", type=int, default=128, help="training batch size")
    parser.add_argument("--sequences", type=int, default=16, help="audited completions")
    parser.add_argument("--seed", type=int, default=0, help="model, data and advantages seed")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "estimator_audit")
    a = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors: more threads only add contention
    start = time.time()

    model = build_model(a.seed)
    losses = train(model, a.steps, a.batch, a.seed)
    trained_s = time.time() - start
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID)

    ids = sample_task(a.sequences, torch.Generator().manual_seed(a.seed + 1))
    completion = torch.zeros_like(ids, dtype=torch.bool)
    completion[:, PROMPT:] = True
    advantages = torch.randn(a.sequences, generator=torch.Generator().manual_seed(a.seed + 2))
    advantages = (advantages - advantages.mean()) / advantages.std()
    params = [p for p in model.parameters() if p.requires_grad]
    exact_logp, exact_elbo = exact_loglik_and_elbo(model, ids)
    exact_grad = _flat_grad((advantages * exact_logp).sum(), params)
    exact_logp, exact_elbo = exact_logp.detach(), exact_elbo.detach()
    rows = audit(lm, ids, completion, advantages, exact_logp, exact_elbo, exact_grad, a.seeds)
    elapsed = time.time() - start

    command = "python benchmarks/estimator_audit.py" + (
        "" if (a.seeds, a.steps, a.batch, a.sequences, a.seed) == (200, 600, 128, 16, 0)
        else f" --seeds {a.seeds} --steps {a.steps} --batch {a.batch} --sequences {a.sequences} --seed {a.seed}"
    )
    summary = {
        "exact_logp_mean": float(exact_logp.mean()),
        "exact_elbo_mean": float(exact_elbo.mean()),
        "task_logp_mean": float(task_logprob(ids).mean()),
        "final_training_loss": sum(losses[-50:]) / len(losses[-50:]),
    }
    table = markdown_table(rows)
    setup = (
        f"Tiny bidirectional Llama (2 layers, H=64, V={SYMBOLS + 1}) trained {a.steps} steps (batch {a.batch}, "
        f"final loss {summary['final_training_loss']:.3f}) on the alternating-symbols task; {a.sequences} completions "
        f"of C={COMPLETION} tokens after a {PROMPT}-token prompt; {a.seeds} mask seeds per estimator.\n"
        f"Exact log p(y) (mean over completions): {summary['exact_logp_mean']:.3f} nats; exact ELBO: "
        f"{summary['exact_elbo_mean']:.3f}; the task's own log-likelihood of the same completions: "
        f"{summary['task_logp_mean']:.3f}.\n"
        "Bias, std and RMSE are in nats per completion (sum over its tokens), averaged over the completions; "
        "gradients are those of sum_b A_b * estimate_b with fixed random advantages A."
    )
    print(setup)
    print(table)
    print(f"command: {command}   ({elapsed:.0f} s, of which training {trained_s:.0f} s)")

    stamp = environment_stamp(torch.device("cpu"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text(
        "# Estimator audit\n\n"
        f"{provenance.stamp_line(command, provenance.BENCH_SOURCE)}\n\n"
        f"{elapsed:.0f} s on {stamp['device']}, torch {stamp['torch']}.\n\n"
        f"{setup}\n\n{table}\n"
    )
    a.out.with_suffix(".json").write_text(
        json.dumps({**stamp, "command": command, "seconds": round(elapsed, 1), "summary": summary, "estimators": rows}, indent=2) + "\n"
    )
    print(f"written to {a.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
