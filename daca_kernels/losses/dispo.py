"""DiSPO's step loss: credit for the tokens filled at one intermediate denoising state.

At a branch state s (a partially masked completion reached by the rollout), Z fillings of the
currently masked positions are resampled from the rollout's cached logits and scored with the task
reward. Their group-relative advantages (within the Z fillings of the same state) drive a one-step
clipped surrogate over the **newly filled positions only**: every other position is context.
Combined with a terminal-reward objective through [`mixed_objective`][daca_kernels.losses.dispo.mixed_objective].
"""
from __future__ import annotations

from torch import Tensor

from daca_kernels.losses.advantages import group_advantages
from daca_kernels.losses.grpo import grpo_loss
from daca_kernels.validation import (
    FLOAT_DTYPES,
    check_bool_tensor,
    check_float,
    check_float_tensor,
    check_int,
    check_same_device,
    check_tensor,
)


def dispo_step_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    filled_mask: Tensor,
    rewards: Tensor,
    num_fillings: int,
    *,
    token_weights: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    scale: str = "group",
    loss_type: str = "dapo",
    num_items_in_batch: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The step loss at a batch of branch states.

    Layout: ``R = num_states * num_fillings`` rows, the Z fillings of each state consecutive
    (rows ``s * Z ... s * Z + Z - 1`` belong to state s), the same layout as
    [`group_advantages`][daca_kernels.losses.advantages.group_advantages]' groups and as
    [`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob]'s rows.
    From a [`daca_kernels.rollout.Branch`][daca_kernels.rollout.sampler.Branch] ``fills``::

        logp = branch_logprob(lm, fills.state, fills.fillings, fills.fillings_filled,
                              attention_mask=fills.attention_mask)
        loss, metrics = dispo_step_loss(logp, fills.fillings_old_logprob, fills.fillings_filled,
                                        rewards, fills.num_fillings)

    with ``rewards[b * Z + z]`` the reward of ``fills.fillings[b * Z + z]``. The loss reads no
    tensor values, so it cannot tell a ``[Z, B, L]`` tensor flattened in ``z * B + b`` order from
    the right one; ``branch_logprob`` refuses such fillings.

    Args:
        logp: floating ``[R, L]``, ``log pi_theta(filled token | branch state)`` per position
            (one forward of the current policy at the state; differentiable).
        old_logp: ``[R, L]``, the same under the rollout policy (``Branch.fillings_old_logprob``,
            cached at the branch step under the full softmax as ``branch_logprob`` computes it, so
            the ratio is 1 on-policy), or None for ``logp.detach()``.
        filled_mask: bool ``[R, L]``, the positions this filling newly filled (masked at the state).
        rewards: floating ``[R]``, the reward of each filling's completed sequence.
        num_fillings: Z >= 2 fillings per state.
        token_weights: ``[R, L]`` per-token weights (DPS) or None.
        epsilon: the lower clip range, as [`grpo_loss`][daca_kernels.losses.grpo.grpo_loss].
        epsilon_high: the upper clip range, as [`grpo_loss`][daca_kernels.losses.grpo.grpo_loss].
        scale: advantage scaling within the Z fillings (``"group"``, ``"batch"`` or ``"none"``).
        loss_type: normalisation as [`grpo_loss`][daca_kernels.losses.grpo.grpo_loss]; the default ``"dapo"`` divides the sum over
            filled tokens by the number of filled tokens in the batch (or ``num_items_in_batch``),
            so every filled token weighs the same whichever state it belongs to.

    Returns ``(loss, metrics)`` as [`grpo_loss`][daca_kernels.losses.grpo.grpo_loss] (clip fractions and mean ratio over the
    filled tokens), plus ``advantage_abs_mean`` (detached).
    """
    check_tensor(logp, "logp", ndim=2, dtypes=FLOAT_DTYPES)
    num_fillings = check_int(num_fillings, "num_fillings", low=2)
    rows = logp.shape[0]
    if rows % num_fillings:
        raise ValueError(f"num_fillings must divide the number of rows of logp, got num_fillings={num_fillings} for {rows} rows")
    same = (logp, "logp")
    check_bool_tensor(filled_mask, "filled_mask", logp.shape, "[R, L]", same)
    if old_logp is not None:
        check_float_tensor(old_logp, "old_logp", logp.shape, "[R, L]", same)
    if token_weights is not None:
        check_float_tensor(token_weights, "token_weights", logp.shape, "[R, L]", same)
    check_float_tensor(rewards, "rewards", (rows,), "[R]", same)
    advantages = group_advantages(rewards.detach(), num_fillings, scale=scale)
    loss, metrics = grpo_loss(
        logp,
        old_logp,
        advantages,
        filled_mask,
        token_weights=token_weights,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        num_items_in_batch=num_items_in_batch,
    )
    metrics["advantage_abs_mean"] = advantages.abs().mean()
    return loss, metrics


def mixed_objective(base_loss: Tensor, step_loss: Tensor, *, alpha_base: float = 1.0, alpha_step: float = 1.0) -> Tensor:
    """``alpha_base * base_loss + alpha_step * step_loss``: DiSPO's mixture of a terminal-reward
    loss (e.g. [`grpo_loss`][daca_kernels.losses.grpo.grpo_loss]) and [`dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss]
    computed from the same rollouts.

    Both losses are floating 0-d tensors on the same device; the weights are floats >= 0.
    """
    check_tensor(base_loss, "base_loss", ndim=0, dtypes=FLOAT_DTYPES)
    check_tensor(step_loss, "step_loss", ndim=0, dtypes=FLOAT_DTYPES)
    check_same_device(base_loss, "base_loss", step_loss=step_loss)
    alpha_base = check_float(alpha_base, "alpha_base", minimum=0.0)
    alpha_step = check_float(alpha_step, "alpha_step", minimum=0.0)
    return alpha_base * base_loss + alpha_step * step_loss
