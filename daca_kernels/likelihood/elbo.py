"""Monte-Carlo ELBO samples (BGPO, SPG, VRPO-style objectives), one forward pass per sample.

Sample j of n masks ``m`` of the row's ``n_b`` completion positions, ``t = m / n_b``
(:func:`daca_kernels.ops.ratio_masks.elbo_mask`), and

    ELBO_j = 1/t * sum_{i masked} log p(y_i | y unmasked)

is an unbiased estimate of the masked-diffusion ELBO ``E_sigma sum_k log p(y_sigma_k | y_sigma_<k)``
when ``m`` is uniform on ``{1, .., n_b}``; the n ratios are stratified over (0, 1), so the mean of
the n samples is unbiased and every sample masks at least one position.

Masking an exact count instead of each position independently with probability t keeps every
sample non-empty without biasing it, and bounds the weight 1/t by n_b.

Constant memory in n: call :func:`elbo_sample` for one sample at a time and back-propagate each
before the next (the sum over samples of their gradients is the gradient of the sum).

Block-wise masking (SPG; ``block_length=l``, :func:`daca_kernels.ops.ratio_masks.block_elbo_mask`)
follows semi-autoregressive decoding in blocks of ``l``: each sample selects one block of the
completion uniformly, keeps the blocks before it clean, masks every block after it, and masks
``m`` of the selected block's ``s`` positions as above. Only those ``m`` positions are scored, and
with ``t = m / (K s)`` (``K`` blocks; ``m / n_b`` when every block is full)

    ELBO_j = 1/t * sum_{i scored} log p(y_i | earlier blocks, unmasked part of the block)

averaged over the n samples is an unbiased estimate of the sum over blocks of the block ELBOs
(each block's ELBO conditioned on the clean blocks before it, the blocks after it masked).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.likelihood.masked_passes import check_estimator_inputs, masked_pass_logprob, output_dtype
from daca_kernels.masked_lm import MaskedLM
from daca_kernels.ops.ratio_masks import block_elbo_mask, elbo_mask
from daca_kernels.ops.validation import check_int


@dataclass(frozen=True)
class ElboSamples:
    """ELBO Monte-Carlo samples; ``...`` is ``[n]`` for :func:`elbo_samples`, empty for :func:`elbo_sample`.

    Attributes:
        logprob: float32 ``[..., B, L]``: ``log p(y_i | unmasked)`` at the scored completion
            positions, 0 elsewhere (unweighted).
        mask: bool ``[..., B, L]``: the scored positions: the masked positions, or with block-wise
            masking those of the selected block (the later blocks are masked in the model input
            but not scored).
        t: float32 ``[..., B]``: the ratio ``1 / t`` weights the scored sum by: the realised mask
            ratio ``m / n_b``, or ``m / (K_b s_b)`` with block-wise masking (1 for an empty row).
    """

    logprob: Tensor
    mask: Tensor
    t: Tensor

    def elbo(self) -> Tensor:
        """``[..., B]``: the 1/t-weighted sum over the row, one ELBO estimate per sample."""
        return self.logprob.sum(-1) / self.t


def elbo_sample(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    *,
    seed: int,
    index: int = 0,
    num_samples: int = 1,
    attention_mask: Tensor | None = None,
    row_offset: int = 0,
    block_length: int | None = None,
) -> ElboSamples:
    """Sample ``index`` of ``num_samples`` (one forward pass), with ``[B, L]`` / ``[B]`` fields.

    lm, input_ids, completion_mask, attention_mask: as in
    :func:`daca_kernels.likelihood.stratified_logprob`. The mask is
    ``elbo_mask(completion_mask, seed, index, num_samples, row_offset=row_offset)``: the same seed
    and index give the same mask in every pass (old policy, reference, current). row_offset:
    global index of row 0 of this call, for sharded batches; masks depend on ``(seed,
    row_offset + b, position)``. block_length: None, or an int >= 1 for SPG's block-wise masking:
    the masks are then ``block_elbo_mask(completion_mask, seed, index, num_samples,
    block_length, row_offset=row_offset)``, the model input is masked at its ``masked``
    positions, the log-probabilities are kept at its ``scored`` positions (the returned
    ``mask``) and ``t`` is its ``t``.
    """
    check_estimator_inputs(lm, input_ids, completion_mask, attention_mask)
    if block_length is None:
        masked, t = elbo_mask(completion_mask, seed, index, num_samples, row_offset=row_offset)
        scored = masked
    else:
        block = block_elbo_mask(completion_mask, seed, index, num_samples, block_length, row_offset=row_offset)
        masked, scored, t = block.masked, block.scored, block.t
    logprob = masked_pass_logprob(lm, input_ids, masked, scored, attention_mask=attention_mask)
    return ElboSamples(logprob=logprob, mask=scored, t=t.to(output_dtype(lm)))


def elbo_samples(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    seed: int,
    attention_mask: Tensor | None = None,
    row_offset: int = 0,
    block_length: int | None = None,
) -> ElboSamples:
    """All ``num_samples`` samples stacked: ``logprob [n, B, L]``, ``mask [n, B, L]``, ``t [n, B]``.

    Keeps every sample's graph for backward; use :func:`elbo_sample` in a loop for constant memory.
    row_offset: global index of row 0 of this call, for sharded batches; masks depend on
    ``(seed, row_offset + b, position)``; block_length: None or an int >= 1 for SPG's block-wise
    masking (both as in :func:`elbo_sample`).
    """
    num_samples = check_int(num_samples, "num_samples", low=1)
    samples = [
        elbo_sample(
            lm, input_ids, completion_mask, seed=seed, index=j, num_samples=num_samples,
            attention_mask=attention_mask, row_offset=row_offset, block_length=block_length,
        )
        for j in range(num_samples)
    ]
    return ElboSamples(
        logprob=torch.stack([s.logprob for s in samples]),
        mask=torch.stack([s.mask for s in samples]),
        t=torch.stack([s.t for s in samples]),
    )
