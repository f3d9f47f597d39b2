"""DiSPO's one-step likelihood: the log-probability of each filling's tokens given its branch state.

A branch state is a partially masked sequence reached by a rollout (``Branch.state``); its Z
fillings complete the masked positions ([`daca_kernels.rollout.branch`][daca_kernels.rollout.sampler.branch]). The step loss of
[`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss] trains ``log p(filled token | state)``: one forward pass of
the backbone on each state, shared by its Z fillings, and only the filled positions of each filling
go through the LM head ([`daca_kernels.linear_logprob`][daca_kernels.ops.linear_logprob]).

Layout: ``R = B * Z`` rows grouped by state, row ``b * Z + z`` being filling z of state b, as
[`daca_kernels.rollout.Branch.fillings`][daca_kernels.rollout.sampler.Branch.fillings] and ``Branch.fillings_filled`` give them (and as
[`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss] groups its rows). ``Branch.sequences`` is ``[Z, B, L]``:
flattened with ``reshape(-1, L)`` its rows come in ``z * B + b`` order, which is refused here
whenever it can be told apart (a row that differs from its state outside the filled positions).
The values are log-probabilities under the model's full softmax (the mask id included), which is
what ``Branch.old_logprob`` caches, so on-policy the ratio of the two is 1.

Block-causal models (SDAR / TraDo, LLaDA2): the state is run once through the model's block-causal
attention over the whole sequence, each row's blocks counted from its first attended position
([`daca_kernels.MaskedLM.hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden], as
[`daca_kernels.rollout.blockwise`][daca_kernels.rollout.blockwise] decodes a
left-padded row), which is the forward that gives a block decoder's branch states their cache: a
later, fully masked block is predicted given the noisy current one.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.likelihood.masked_passes import check_model_inputs, check_predictable, check_subset, output_dtype
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops.linear_logprob import linear_logprob_unchecked
from daca_kernels.validation import (
    INDEX_DTYPES,
    check_index_range,
    check_same_device,
    check_shape,
    check_tensor,
    reads_values,
)


def branch_logprob(
    lm: MaskedLM,
    state: Tensor,
    fillings: Tensor,
    filled: Tensor,
    *,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """``log p(fillings[r, i] | state[r // Z])`` at the filled positions of every filling.

    Args:
        lm: the model, bidirectional or block-causal (module docstring; ``shift=True`` block models are
            refused).
        state: int64/int32 ``[B, L]``, the branch states (``lm.mask_id`` at the positions to fill).
        fillings: int64/int32 ``[R, L]`` with ``R = B * Z``: the completed sequences, filling z of
            state b in row ``b * Z + z`` (``Branch.fillings``); ids in ``[0, V)``, equal to the
            state outside ``filled`` and not ``lm.mask_id`` at ``filled``.
        filled: bool ``[R, L]``, the positions each filling filled (``Branch.fillings_filled``);
            masked in its state, and under ``lm.shift`` False in column 0.
        attention_mask: ``[B, L]`` passed to ``lm.hidden`` with the states (1 = attend), or None; for
            a block-causal model it must describe left padding (``Branch.attention_mask`` does).

    Returns:
        float32 ``[R, L]`` (float64 for a float64 model): the log-probabilities at ``filled``, 0
        elsewhere; differentiable through the model. One forward pass per state.
    """
    check_model_inputs(lm, state, attention_mask, positions={}, ids_name="state")
    if lm.block_size is not None and attention_mask is not None:
        attend = attention_mask != 0
        if bool((attend[:, 1:].long() < attend[:, :-1].long()).any()):
            raise ValueError("attention_mask must describe left padding for a block-causal model (a sampler's "
                             "branch state): in each row, 0 only before the row's tokens")
    check_tensor(fillings, "fillings", ndim=2, dtypes=INDEX_DTYPES)
    batch, length = state.shape
    if batch == 0 or fillings.shape[0] % batch or fillings.shape[1] != length:
        raise ValueError(f"fillings must have shape [B * Z, L] with [B, L] = {tuple(state.shape)} (from state), got "
                         f"{tuple(fillings.shape)}")
    check_same_device(state, "state", fillings=fillings)
    if reads_values(fillings):  # elsewhere: the filled ids are guarded by linear_logprob (NaN), no other is read
        check_index_range(fillings, lm.vocab_size, "fillings")
    check_tensor(filled, "filled", ndim=2, dtypes=(torch.bool,))
    check_shape(filled, "filled", fillings.shape, "[R, L] (from fillings)")
    check_same_device(state, "state", filled=filled)
    num_fillings = fillings.shape[0] // batch
    states = torch.arange(fillings.shape[0], device=state.device) // num_fillings
    masked = state[states] == lm.mask_id
    check_subset(filled, "filled", masked, "(state == lm.mask_id)")
    check_predictable(lm, filled, "filled")
    if reads_values(fillings):
        _check_fillings_of_their_states(fillings, state[states], filled, num_fillings, lm.mask_id)
    out = torch.zeros(filled.shape, dtype=output_dtype(lm), device=state.device)
    r, i = filled.nonzero(as_tuple=True)
    if r.numel() == 0:
        return out
    hidden = lm.hidden(state, attention_mask)
    values = linear_logprob_unchecked(hidden[states[r], i - int(lm.shift)], lm.head_weight, fillings[r, i], bias=lm.head_bias)
    out = out.index_put((r, i), values.to(out.dtype))
    if reads_values(out):
        return out
    # The checks above that read values did not run: NaN where they would have raised.
    strays = ((fillings != state[states]) & ~filled).any(dim=1, keepdim=True)
    unchecked = filled & (~masked | strays | (fillings == lm.mask_id))
    if lm.shift:
        unchecked = unchecked | (filled & (torch.arange(length, device=filled.device) == 0))
    return torch.where(unchecked, torch.full_like(out, float("nan")), out)


def _check_fillings_of_their_states(fillings: Tensor, states: Tensor, filled: Tensor, num_fillings: int,
                                    mask_id: int) -> None:
    """Row r of ``fillings`` must complete ``states[r]`` (the state of row r): equal outside
    ``filled``, a real token at ``filled``. A ``[Z, B, L]`` tensor flattened state by filling
    instead of filling by state breaks the first rule as soon as two states differ."""
    differs = (fillings != states) & ~filled
    if bool(differs.any()):
        r, i = differs.nonzero()[0].tolist()
        raise ValueError(
            f"fillings must equal their state outside filled, row b * Z + z holding filling z of state b "
            f"(Branch.fillings; Branch.sequences.reshape(-1, L) is in z * B + b order): fillings[{r}, {i}] = "
            f"{int(fillings[r, i])} but state[{r // num_fillings}, {i}] = {int(states[r, i])}"
        )
    holes = filled & (fillings == mask_id)
    if bool(holes.any()):
        r, i = holes.nonzero()[0].tolist()
        raise ValueError(f"fillings must hold a token other than lm.mask_id at filled positions: fillings[{r}, {i}] "
                         f"is the mask id")
