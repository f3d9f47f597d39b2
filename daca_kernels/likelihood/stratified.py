"""d1's one-step estimator and Stratified Masking Likelihood (SML).

SML partitions each completion into K strata ([`daca_kernels.stratified_mask`][daca_kernels.ops.stratified_mask]) and runs K
forward passes, pass k masking only stratum k, so every token is predicted with (K-1)/K of the
completion visible. Summed over a row,

    sum_i out[b, i] = sum_k sum_{i in S_k} log p(y_i | prompt, y outside S_k),

which is the mean of K single-mask ELBO estimates at ratio t = |S_k| / n over complementary masks.
K = 1 is d1's one-step (mean-field) estimator: the whole completion masked in one pass.

Block-causal models (``lm.attention == ("block", S)``): the strata are drawn within each block
([`daca_kernels.likelihood.block_masks.block_stratified_mask`][daca_kernels.likelihood.block_masks.block_stratified_mask]) and pass k
predicts stratum k of
every block from that block with its stratum masked and the clean blocks before it, all blocks in
one forward pass ([`daca_kernels.MaskedLM.block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden]). Summed over a row,

    sum_i out[b, i] = sum_c sum_k sum_{i in S_ck} log p(y_i | prompt, y_<c, y_c outside S_ck),

SML applied to each factor of ``log p(y) = sum_c log p(y_c | prompt, y_<c)``; K = 1 masks every
block whole (one-step per block). Prompt positions drawn by ``prompt_mask_prob`` are hidden from
every prediction, as for a bidirectional model.

``completion_mask`` is the generated region (every position the sampler wrote, the padding after an
end-of-sequence token included): the strata partition it, so each pass masks its stratum of the
whole region. ``loss_mask`` (default: ``completion_mask``) is the subset that is scored, e.g. the
answer up to and including its first EOS; only those rows reach the LM head. The masks do not
depend on ``loss_mask``, so passes that score different subsets see the same masked inputs.

Compared with d1's released diffu-GRPO trainer (``diffu-grpo/diffu_grpo_trainer.py``:
``DiffuGRPOTrainer.forward_process`` and ``_get_per_token_logps``): it masks every completion
column (the whole generated region, EOS padding included), masks each prompt column with
probability ``p_mask_prompt`` (left padding included), runs the model without an attention mask,
and its loss counts the completion up to and including the first EOS.
``one_step_logprob(lm, ids, generated, loss_mask=answer, prompt_mask_prob=p)`` is that estimator;
pass ``prompt`` with the padding included and no ``attention_mask`` for d1's exact inputs (the
prompt-masking draws are this library's counter hash, not torch's RNG).
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.likelihood.block_masks import block_stratified_mask
from daca_kernels.likelihood.masked_passes import (
    check_estimator_inputs,
    check_positions,
    logprob_by_stratum,
    nan_where_unchecked,
)
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops.stratified_mask import check_mask_settings, stratified_mask_unchecked
from daca_kernels.validation import check_disjoint_prompt


def stratified_logprob(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    *,
    num_strata: int,
    seed: int,
    scheme: str = "random",
    prompt_mask_prob: float = 0.0,
    prompt: Tensor | None = None,
    checkpoint: bool = False,
    row_offset: int = 0,
) -> Tensor:
    """SML per-token log-probabilities of the completion.

    Args:
        lm: the model.
        input_ids: int64/int32 ``[B, L]`` prompt + completion ids in ``[0, V)``, with ``L`` at most
            ``lm.max_length`` when the model has one (a ValueError naming ``input_ids`` otherwise).
        completion_mask: bool ``[B, L]``: the generated region, the positions the strata partition
            (masked, each in one pass).
        num_strata: K >= 1 (K larger than a row's completion leaves strata empty; a stratum no
            row uses costs no forward pass).
        seed: int; the masks are exactly ``stratified_mask(input_ids, completion_mask, K, seed,
            lm.mask_id, scheme=..., prompt=..., prompt_mask_prob=..., row_offset=...)`` (for a
            block-causal model ``block_stratified_mask`` with ``lm``'s block size and
            ``attention_mask``), so
            old-policy, reference and current passes with the same seed see the same masks.
        scheme: ``"random"`` or ``"interleave"`` (see [`daca_kernels.stratified_mask`][daca_kernels.ops.stratified_mask]).
        prompt_mask_prob: d1-style masking of prompt positions, drawn afresh per pass.
        prompt: bool ``[B, L]`` outside ``completion_mask``: positions eligible for prompt masking
            (default: every position outside it); checked whenever given, a position in both is a
            ValueError naming ``prompt`` (the rule of [`daca_kernels.stratified_mask`][daca_kernels.ops.stratified_mask]).
        attention_mask: ``[B, L]`` passed to ``lm.hidden`` (1 = attend), or None.
        checkpoint: recompute each pass during backward instead of keeping its activations
            (peak memory of one forward pass; one extra forward per pass).
        row_offset: global index of row 0 of this call, for sharded batches; masks depend on
            ``(seed, row_offset + b, position)``, so a data-parallel process that passes the index
            of its first row gets the masks (and values) of those rows in the whole batch.
        loss_mask: bool ``[B, L]``, the positions scored, a subset of ``completion_mask`` (a
            ValueError otherwise); None scores all of ``completion_mask``. The masks do not depend
            on it.

    Returns:
        float32 ``[B, L]`` (float64 for a float64 model): ``log p(y_i | copy strata[b, i])`` on
        ``loss_mask``, 0 elsewhere; differentiable through the model.
    """
    loss_mask = check_estimator_inputs(lm, input_ids, completion_mask, attention_mask, loss_mask)
    if prompt is not None:
        check_positions(prompt, "prompt", input_ids)
        check_disjoint_prompt(prompt, completion_mask, "completion_mask")
    num_strata, prompt_mask_prob, row_offset = check_mask_settings(num_strata, seed, scheme, prompt_mask_prob,
                                                                   row_offset, rows=input_ids.shape[0])
    return stratified_logprob_unchecked(lm, input_ids, completion_mask, loss_mask, num_strata=num_strata, seed=seed,
                               scheme=scheme, prompt_mask_prob=prompt_mask_prob, prompt=prompt,
                               attention_mask=attention_mask, checkpoint=checkpoint, row_offset=row_offset)


def stratified_logprob_unchecked(lm: MaskedLM, input_ids: Tensor, completion_mask: Tensor, loss_mask: Tensor, *, num_strata: int,
                        seed: int, prompt_mask_prob: float, prompt: Tensor | None, attention_mask: Tensor | None,
                        row_offset: int, scheme: str = "random", checkpoint: bool = False) -> Tensor:
    """[`stratified_logprob`][daca_kernels.likelihood.stratified.stratified_logprob] without its checks (``loss_mask`` given), for
    callers that
    checked the arguments."""
    settings = dict(scheme=scheme, prompt=prompt, prompt_mask_prob=prompt_mask_prob, row_offset=row_offset)
    if lm.block_size is None:
        masks = stratified_mask_unchecked(input_ids, completion_mask, num_strata, seed, lm.mask_id, **settings)
    else:
        masks = block_stratified_mask(input_ids, completion_mask, num_strata, seed, lm.mask_id, lm.block_size,
                                      attention_mask=attention_mask, **settings)
    values = logprob_by_stratum(
        lm, input_ids, torch.where(loss_mask, masks.strata, -1), masks.num_strata, masks.input_ids.__getitem__,
        attention_mask=attention_mask, checkpoint=checkpoint,
    )
    return nan_where_unchecked(values, lm, completion_mask, loss_mask)

def one_step_logprob(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    *,
    seed: int,
    prompt_mask_prob: float = 0.0,
    prompt: Tensor | None = None,
    row_offset: int = 0,
) -> Tensor:
    """d1's one-step estimator: the whole generated region ``completion_mask`` masked (and the
    prompt masked with ``prompt_mask_prob``), one forward pass, the positions of ``loss_mask``
    scored. Same arguments (``row_offset``: global index of row 0 of this call, for sharded
    batches; prompt masks depend on ``(seed, row_offset + b, position)``) and result (float32
    ``[B, L]``, 0 outside ``loss_mask``) as [`stratified_logprob`][daca_kernels.likelihood.stratified.stratified_logprob] with
    ``num_strata=1``.
    """
    return stratified_logprob(
        lm, input_ids, completion_mask, num_strata=1, seed=seed, prompt_mask_prob=prompt_mask_prob,
        prompt=prompt, attention_mask=attention_mask, row_offset=row_offset, loss_mask=loss_mask,
    )
