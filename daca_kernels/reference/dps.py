"""Readable references for Denoising Progress Scores (defined in ``daca_kernels.credit``).

Notation: ``c_s[j]`` is the confidence of position j at step s (defined while j is masked at the
start of step s), ``U_s`` the positions still masked after step s commits, ``n_s`` the number of
tokens committed at step s. The functions here work from the full history ``[B, S, L]`` that a
sampler must not keep; they are the oracle for the online computation.
"""
from __future__ import annotations

import torch


def confidence_delta(current: torch.Tensor, previous: torch.Tensor, still_masked: torch.Tensor) -> torch.Tensor:
    """``out[b] = sum_j still_masked[b, j] * (current[b, j] - previous[b, j])`` in float64.

    ``current``, ``previous`` float ``[B, L]``; ``still_masked`` bool ``[B, L]``. Entries outside
    ``still_masked`` are never used (they may hold anything, NaN included).
    """
    delta = current.double() - previous.double()
    return torch.where(still_masked, delta, torch.zeros_like(delta)).sum(dim=1)


def step_gain_from_history(confidences: torch.Tensor, commit_step: torch.Tensor) -> torch.Tensor:
    """``step_gain[b, s] = sum_{j in U_s} (c_{s+1}[j] - c_s[j])``, float64 ``[B, S]``.

    ``confidences`` ``[B, S, L]`` holds ``c_s[j]`` wherever j is masked at the start of step s;
    ``commit_step`` long ``[B, L]`` is the step at which each position was committed (-1 for the
    prompt), so ``U_s = {j : commit_step[j] > s}``. The last step leaves nothing masked: its gain is 0.
    """
    batch, steps, _ = confidences.shape
    gain = torch.zeros(batch, steps, dtype=torch.float64, device=confidences.device)
    for b in range(batch):
        for s in range(steps - 1):
            still_masked = commit_step[b] > s
            gain[b, s] = (confidences[b, s + 1, still_masked] - confidences[b, s, still_masked]).double().sum()
    return gain


def dps_weights(
    commit_confidence: torch.Tensor,
    commit_step: torch.Tensor,
    step_gain: torch.Tensor,
    completion_mask: torch.Tensor,
    variant: str = "progress",
    scale: float = 0.5,
    clip: tuple[float, float] | None = (0.2, 5.0),
) -> torch.Tensor:
    """The DPS weights of ``daca_kernels.credit``, one row at a time, in float64 ``[B, L]`` (0 outside the completion).

    ``commit_confidence [B, L]`` is ``c_s[i]`` at each token's commit step ``commit_step[i] = s``;
    ``step_gain [B, S]``. Raw score ``d_i = (1 - c_s[i]) + step_gain[s] / n_s`` ("progress"),
    only the first term ("self") or only the second ("lookahead"). Weight
    ``clip(1 + scale * (d_i - mean d) / (std d + 1e-6))`` over the row's completion tokens (std
    with divisor n), then divided by its mean over those tokens.
    """
    out = torch.zeros(commit_step.shape, dtype=torch.float64, device=commit_step.device)
    for b in range(commit_step.shape[0]):
        tokens = completion_mask[b].nonzero().flatten().tolist()
        if not tokens:
            continue
        raw = []
        for i in tokens:
            s = int(commit_step[b, i])
            committed_with_i = int((commit_step[b] == s).sum())
            own = 1.0 - float(commit_confidence[b, i])
            lookahead = float(step_gain[b, s]) / committed_with_i
            raw.append({"progress": own + lookahead, "self": own, "lookahead": lookahead}[variant])
        d = torch.tensor(raw, dtype=torch.float64)
        w = 1.0 + scale * (d - d.mean()) / (d.std(correction=0) + 1e-6)
        if clip is not None:
            w = w.clamp(clip[0], clip[1])
        out[b, tokens] = w / w.mean()
    return out
