"""Parity of the fused and reference backends on one batch: same loss, same parameter gradients.

For every objective and estimator of the loop, with DPS off and on: two trainers (fused and
reference) start from the same SFT checkpoint and collect the same step-0 batch (rollouts,
old-policy and reference-policy values; the advantages, and DiSPO's filling rewards, are then
replaced by fixed random values so that every row carries a gradient); the parameters then move by a fixed small
perturbation, so ratios differ from 1 and clipping and the KL term are active, and the loss of the
second inner iteration is differentiated. The fused backend uses the library's estimators, DPS and
objectives; the reference backend only ``daca_kernels.reference`` with full logits.
"""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from integration.config import RunConfig
from integration.trainer import Trainer

PERTURBATION = 0.02

# (objective, estimator, extra settings); each runs with DPS off and on.
CASES = [("grpo", estimator, {}) for estimator in ("one_step", "coupled", "stratified", "elbo")] + [
    ("bgpo", "elbo", {}), ("bgpo", "stratified", {}),
    ("spg", "elbo", {}), ("spg", "elbo", {"mask_block_length": 2, "spg_bound": "eubo", "prompt_mask_prob": 0.3}), ("spg", "stratified", {}),
    ("dispo", "one_step", {}), ("dispo", "stratified", {}),
]


@dataclass(frozen=True)
class ParityRow:
    objective: str
    estimator: str
    dps: bool
    settings: str
    loss_fused: float
    loss_reference: float
    max_grad_error: float
    """max over parameters of |g_fused - g_ref| / max |g_ref|"""
    grad_scale: float
    tolerance: float

    @property
    def ok(self) -> bool:
        loss_ok = abs(self.loss_fused - self.loss_reference) <= self.tolerance * (1 + abs(self.loss_reference))
        return loss_ok and self.grad_scale > 0 and self.max_grad_error <= self.tolerance


def _loss_and_grads(config: RunConfig, cache_dir: Path) -> tuple[float, list[torch.Tensor]]:
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir, cache_dir=cache_dir, progress=False)
    batch = trainer.collect(0)
    generator = torch.Generator().manual_seed(config.seed + 1)
    # Fixed random advantages (both signs) and branch rewards: every row carries a gradient and
    # every branch of the objectives (A >= 0, A < 0) is exercised whatever the checkpoint earns.
    batch.advantages = torch.randn(batch.advantages.shape, generator=generator)
    if batch.branch is not None:
        batch.branch = dataclasses.replace(batch.branch, rewards=torch.rand(batch.branch.rewards.shape,
                                                                             generator=generator))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(PERTURBATION * p.abs().mean() * torch.randn(p.shape, generator=generator))
    loss, _ = trainer.loss_gradients(batch, 1)
    return loss, [p.grad.detach().clone() for p in trainer.model.parameters()]


def parity_check(base: RunConfig, cache_dir: str | Path, *, tolerance: float = 1e-4, prompts: int = 4,
                 cases=CASES) -> list[ParityRow]:
    """Fused vs reference on one batch of ``base.task`` for every case, DPS off and on."""
    base = base.replace(prompts_per_step=prompts, inner_iterations=2, beta=0.04, epsilon=0.1)
    rows = []
    for objective, estimator, extra in cases:
        for dps in (False, True):
            config = base.replace(objective=objective, estimator=estimator, dps=dps, **extra)
            loss_f, grads_f = _loss_and_grads(config.replace(backend="fused"), Path(cache_dir))
            loss_r, grads_r = _loss_and_grads(config.replace(backend="reference"), Path(cache_dir))
            scale = max(float(g.abs().max()) for g in grads_r)
            error = max(float((a - b).abs().max()) for a, b in zip(grads_f, grads_r)) / max(scale, 1e-30)
            settings = ", ".join(f"{k}={v}" for k, v in extra.items())
            rows.append(ParityRow(objective, estimator, dps, settings, loss_f, loss_r, error, scale, tolerance))
    return rows


def parity_table(rows: list[ParityRow]) -> str:
    lines = ["| objective | estimator | settings | DPS | loss (fused) | loss (reference) | max grad error (relative) | ok |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.objective} | {r.estimator} | {r.settings} | {'on' if r.dps else 'off'} | {r.loss_fused:.6f} | "
                     f"{r.loss_reference:.6f} | {r.max_grad_error:.2e} | {'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)
