"""Group-relative advantages: each completion's reward compared with the other completions of its prompt."""
from __future__ import annotations

from torch import Tensor

from daca_kernels.losses.checks import compute_dtype
from daca_kernels.validation import FLOAT_DTYPES, check_bool, check_choice, check_float, check_int, check_tensor

ADVANTAGE_SCALES = ("group", "batch", "none")


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: str = "group",
    leave_one_out: bool = False,
    eps: float = 1e-4,
) -> Tensor:
    """Advantages of ``B = num_groups * group_size`` completions, groups stored consecutively.

    rewards: floating ``[B]``; rows ``g * group_size ... (g + 1) * group_size - 1`` are the
    completions of prompt g. Returns ``[B]`` in float32 (float64 for float64 rewards).

    - baseline: the group mean, or with ``leave_one_out`` the mean of the *other* completions of
      the group (RLOO), which makes the centred reward ``group_size / (group_size - 1)`` times larger;
    - ``scale="group"``: divided by ``std + eps`` over the group (GRPO), ``"batch"``: by
      ``std + eps`` over all B rewards, ``"none"``: not divided (Dr. GRPO, RLOO).

    The standard deviation is the sample one (Bessel's correction, ``N - 1`` degrees of freedom;
    ``0`` for a single value), and ``eps = 1e-4`` is added to it, as TRL does: a group whose rewards
    are all equal gets advantage 0, never NaN. The result is differentiable in ``rewards`` (rarely
    wanted: rewards usually carry no gradient).
    """
    check_tensor(rewards, "rewards", ndim=1, dtypes=FLOAT_DTYPES)
    group_size = check_int(group_size, "group_size", low=1)
    check_choice(scale, "scale", ADVANTAGE_SCALES)
    check_bool(leave_one_out, "leave_one_out")
    eps = check_float(eps, "eps", minimum=0.0)
    batch = rewards.shape[0]
    if batch == 0:
        raise ValueError("rewards must not be empty")
    if batch % group_size:
        raise ValueError(f"group_size must divide the number of rewards, got group_size={group_size} for {batch} rewards")
    if leave_one_out and group_size < 2:
        raise ValueError(f"group_size must be >= 2 with leave_one_out=True (no other completion to compare with), got {group_size}")

    grouped = rewards.to(compute_dtype(rewards)).reshape(batch // group_size, group_size)
    if leave_one_out:
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    else:
        baseline = grouped.mean(dim=1, keepdim=True)
    centred = grouped - baseline
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True, correction=min(1, group_size - 1)) + eps)
    elif scale == "batch":
        centred = centred / (grouped.std(correction=min(1, batch - 1)) + eps)
    return centred.reshape(batch)
