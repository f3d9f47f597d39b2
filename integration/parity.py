"""Parity of the fused and reference backends on one batch: same loss, same parameter gradients.

For each estimator with DPS off and on, and each backend: the policy starts from the same
parameters, the old-policy log-probabilities are estimated, the parameters are moved by a fixed
small perturbation (so ratios differ from 1 and clipping and the KL term are active), and the
GRPO loss (with ``ref_logp`` = old values and ``beta > 0``) is differentiated. The fused backend
uses the library's estimators, DPS and loss; the reference backend only ``daca_kernels.reference``
with full logits. Rollouts come from one fused ``generate`` call shared by both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from daca_kernels import group_advantages, grpo_loss
from daca_kernels import reference
from daca_kernels.rollout import generate
from integration.config import ESTIMATORS, RunConfig
from integration.estimators import estimate_logprob, token_weights
from integration.model import as_masked_lm, build_model
from integration.tasks import get_task, vocab
from integration.trainer import completion_mask

PERTURBATION = 0.02


@dataclass(frozen=True)
class ParityRow:
    estimator: str
    dps: bool
    loss_fused: float
    loss_reference: float
    max_grad_error: float
    """max over parameters of |g_fused - g_ref| / max |g_ref|"""
    tolerance: float

    @property
    def ok(self) -> bool:
        loss_ok = abs(self.loss_fused - self.loss_reference) <= self.tolerance * (1 + abs(self.loss_reference))
        return loss_ok and self.max_grad_error <= self.tolerance


def _loss_and_grads(model, lm, config, batch, start, moved):
    ids, attention, mask, advantages, rollout = batch
    with torch.no_grad():
        for p, value in zip(model.parameters(), start):
            p.copy_(value)
        old = estimate_logprob(lm, config, ids, mask, attention, seed=config.seed)
        for p, value in zip(model.parameters(), moved):
            p.copy_(value)
    model.zero_grad(set_to_none=True)
    logp = estimate_logprob(lm, config, ids, mask, attention, seed=config.seed)
    loss_fn = reference.losses.grpo_loss if config.backend == "reference" else grpo_loss
    loss, _ = loss_fn(logp, old, advantages, mask, ref_logp=old, beta=0.04,
                      token_weights=token_weights(rollout, config, mask), eps_low=0.1)
    loss.backward()
    return loss.item(), [p.grad.detach().clone() for p in model.parameters()]


def parity_check(base: RunConfig, *, tolerance: float = 1e-4, num_prompts: int = 4) -> list[ParityRow]:
    """Fused vs reference on one batch of ``base.task`` for every estimator, DPS off and on."""
    task = get_task(base.task)
    model = build_model(base.model, base.seed)
    lm = as_masked_lm(model)
    prompts, examples = task.batch(num_prompts, seed=base.seed)
    prompts = prompts.repeat_interleave(base.group_size, dim=0)
    examples = [e for e in examples for _ in range(base.group_size)]
    model.eval()
    rollout = generate(lm, prompts, gen_length=task.completion_length, steps=task.completion_length,
                       block_length=task.completion_length, temperature=1.0, seed=base.seed,
                       prompt_mask=prompts != vocab.pad_id)
    rewards = task.rewards(rollout.sequences[:, prompts.shape[1]:], examples)
    # A fresh policy earns little reward: use random advantages so every row carries a gradient.
    advantages = group_advantages(rewards + torch.rand(len(examples), generator=torch.Generator().manual_seed(base.seed)), base.group_size)
    mask = completion_mask(rollout, prompts.shape[1])
    batch = (rollout.sequences, rollout.attention_mask, mask, advantages, rollout)
    start = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(base.seed + 1)
    moved = [p + PERTURBATION * p.abs().mean() * torch.randn(p.shape, generator=g) for p in start]
    rows = []
    for estimator in ESTIMATORS:
        for dps in (False, True):
            results = {}
            for backend in ("fused", "reference"):
                config = base.replace(estimator=estimator, dps=dps, backend=backend)
                results[backend] = _loss_and_grads(model, lm, config, batch, start, moved)
            (loss_f, grads_f), (loss_r, grads_r) = results["fused"], results["reference"]
            scale = max(float(g.abs().max()) for g in grads_r)
            error = max(float((a - b).abs().max()) for a, b in zip(grads_f, grads_r)) / scale
            rows.append(ParityRow(estimator, dps, loss_f, loss_r, error, tolerance))
    return rows


def parity_table(rows: list[ParityRow]) -> str:
    lines = ["| estimator | DPS | loss (fused) | loss (reference) | max grad error (relative) | ok |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.estimator} | {'on' if r.dps else 'off'} | {r.loss_fused:.6f} | {r.loss_reference:.6f} | "
                     f"{r.max_grad_error:.2e} | {'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)
