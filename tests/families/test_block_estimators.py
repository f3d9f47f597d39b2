"""Block-wise estimators on the block-causal doubles (SDAR / TraDo, LLaDA2) through ``MaskedLM.from_hf``.

The naive reference here builds, for every scored block ``c`` of every row, the input ``[clean blocks < c ;
noisy block c]`` with the row's padding stripped, an explicit block-causal ``[n, n]`` mask (in the form the
family's released code takes: 4-D bool for SDAR, 4-D additive for LLaDA2), runs the model's own full logits and
takes ``log_softmax``; its masks come from ``daca_kernels.reference.masking`` drawn block by block. It shares no
code with ``MaskedLM.block_hidden`` or ``likelihood.block_masks``.

Padding: a row's blocks count from its first token (as the sampler decodes it and the released decoders see the
unpadded prompt), so a row with ``p`` left padding positions is scored as the row alone for every ``p``. The
reference strips the padding and counts the blocks of the row alone; the padding tokens themselves never matter.
"""
import copy
import dataclasses

import pytest
import torch
from support import assert_close_reduced, assert_model_gradients_close, assert_no_worse_than_torch

from daca_kernels.likelihood import (
    coupled_logprob,
    elbo_sample_mask,
    elbo_samples,
    estimate_logprob,
    masked_logprob,
    monte_carlo_masks,
    one_step_logprob,
    stratified_logprob,
)
from daca_kernels.likelihood.block_masks import block_coupled_split, block_stratified_mask
from daca_kernels.models import families
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.reference import masking
from families import llada2, sdar

DOUBLES = {"sdar": sdar, "llada2": llada2}
S = 4  # block size of both doubles here (SDAR's config; LLaDA2 through from_hf(block_size=4))
PADS = (0, 4, 3)  # row 1: one whole block of padding, row 2: a block boundary moved by the padding
LENGTH, PROMPT = 14, 6  # completion: columns 6..13 (block 1 holds the prompt's tail, the last block is short)
SEED = 7
TOL = 1e-4  # as in test_estimators_families.py: the same float32 model in two layouts
REDUCTION = 64  # the doubles' MLP width: their longest reduction (support.reduction_tolerance)


@pytest.fixture(autouse=True)
def one_thread(torch_path_one_thread):
    # The model adapter is what is checked; the kernels are checked elsewhere (and interpreted they are slow).
    yield


def build(name, dtype=torch.float32):
    model = DOUBLES[name].tiny().to(dtype)
    lm = MaskedLM.from_hf(model, mask_id=DOUBLES[name].MASK_ID, block_size=S)
    return model, lm


def per_block(lm):
    """The same model as a plain hidden_fn: no hidden_with_keep, so one forward pass per block."""
    return MaskedLM(lm.hidden, lm.head_weight, lm.head_bias, lm.mask_id, attention=lm.attention)


def make_batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 58, (len(PADS), LENGTH), generator=g)
    attention_mask = torch.ones_like(ids)
    for b, pad in enumerate(PADS):
        attention_mask[b, :pad] = 0
        ids[b, :pad] = 59
    completion = torch.zeros(ids.shape, dtype=torch.bool)
    completion[:, PROMPT:] = True
    loss_mask = completion.clone()
    loss_mask[2, -2:] = False  # an answer shorter than the generated region
    return ids, attention_mask, completion, loss_mask


def explicit_mask(model, n):
    """The ``[1, 1, n, n]`` block-causal mask with blocks ``j // S``, in the family's released form."""
    block = torch.arange(n) // S
    keep = block[None, :] <= block[:, None]
    if isinstance(model, sdar.SDARForCausalLM):
        return keep[None, None]
    dtype = next(model.parameters()).dtype
    return torch.zeros(1, 1, n, n, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def naive(model, input_ids, attention_mask, passes, grad=False):
    """``sum_passes weight * log p(y_i | clean blocks < c, noisy block c)`` per scored position.

    passes: ``(noisy [B, L], scored bool [B, L], weight [B, L] or None)``; the clean blocks are the noisy copy
    with the scored positions restored. Full logits of ``[context[:c S] ; noisy block c]`` (padding stripped),
    one forward per (row, block). Returns ``[B, L]`` in the model's dtype.
    """
    dtype = next(model.parameters()).dtype
    out = torch.zeros(input_ids.shape, dtype=dtype)
    with torch.set_grad_enabled(grad):
        for noisy, scored, weight in passes:
            context = torch.where(scored, input_ids, noisy)
            for b in range(input_ids.shape[0]):
                pad = int((attention_mask[b] == 0).sum())
                for c in sorted(set(((scored[b].nonzero().squeeze(1) - pad) // S).tolist())):
                    start, end = pad + c * S, min(pad + c * S + S, input_ids.shape[1])
                    seq = torch.cat([context[b, pad:start], noisy[b, start:end]])
                    logits = model(seq[None], attention_mask=explicit_mask(model, len(seq)),
                                   position_ids=torch.arange(len(seq))[None], use_cache=False).logits[0]
                    logp = torch.log_softmax(logits.to(dtype), -1)
                    for i in range(start, end):
                        if scored[b, i]:
                            w = 1.0 if weight is None else weight[b, i].to(dtype)
                            out[b, i] = out[b, i] + w * logp[i - pad, input_ids[b, i]]
    return out


def block_regions(completion, attention_mask=None):
    """Each block's part of ``completion``, the blocks of a row counted from its first attended column."""
    pads = [0] * len(completion) if attention_mask is None else (attention_mask == 0).sum(1).tolist()
    for c in range(-1, LENGTH // S + 1):
        region = torch.zeros_like(completion)
        for b, pad in enumerate(pads):
            lo, hi = max(pad + c * S, 0), max(pad + c * S + S, 0)
            region[b, lo:hi] = completion[b, lo:hi]
        if region.any():
            yield region


def reference_block_strata(completion, k, attention_mask):
    strata = torch.full(completion.shape, -1)
    for region in block_regions(completion, attention_mask):
        strata = torch.where(region, masking.strata(region, k, SEED), strata)
    return strata


def reference_block_split(completion, attention_mask):
    strata = torch.full(completion.shape, -1)
    weights = torch.zeros(completion.shape, dtype=torch.float64)
    for region in block_regions(completion, attention_mask):
        s, _, w = masking.coupled_split(region, SEED)
        strata, weights = torch.where(region, s, strata), torch.where(region, w, weights)
    return strata, weights


def cases(ids, completion, loss_mask, mask_id, attention_mask):
    """name -> (call(lm, attention_mask) -> [n, B, L], [n lists of passes of the naive reference])."""
    out = {}
    prompt = ~completion
    for name, k, p in (("one_step", 1, 0.3), ("stratified_2", 2, 0.2), ("stratified_3", 3, 0.0)):
        strata = reference_block_strata(completion, k, attention_mask)
        copies = []
        for j in range(k):
            masked = (strata == j) | (masking.prompt_masked(prompt, j, SEED, p) if p > 0 else False)
            copies.append((ids.masked_fill(masked, mask_id), (strata == j) & loss_mask, None))
        if k == 1:
            call = lambda lm, am, p=p: one_step_logprob(lm, ids, completion, seed=SEED, prompt_mask_prob=p,
                                                        attention_mask=am, loss_mask=loss_mask)[None]
        else:
            call = lambda lm, am, k=k, p=p: stratified_logprob(lm, ids, completion, num_strata=k, seed=SEED,
                                                               prompt_mask_prob=p, attention_mask=am,
                                                               loss_mask=loss_mask)[None]
        out[name] = (call, [copies])
    strata, weights = reference_block_split(completion, attention_mask)
    out["coupled"] = (
        lambda lm, am: coupled_logprob(lm, ids, completion, seed=SEED, attention_mask=am, loss_mask=loss_mask)[None],
        [[(ids.masked_fill(strata == j, mask_id), (strata == j) & loss_mask, weights) for j in range(2)]],
    )
    samples = [elbo_sample_mask(completion, seed=SEED, index=j, num_samples=2, loss_mask=loss_mask,
                                prompt_mask_prob=0.25) for j in range(2)]
    out["elbo_samples"] = (
        lambda lm, am: elbo_samples(lm, ids, completion, num_samples=2, seed=SEED, attention_mask=am,
                                    loss_mask=loss_mask, prompt_mask_prob=0.25).logprob,
        [[(ids.masked_fill(s.masked, mask_id), s.scored, None)] for s in samples],
    )
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(ids.shape, generator=g) < 0.6) & (completion | (torch.rand(ids.shape, generator=g) < 0.3))
    scored = mask & loss_mask & (torch.rand(ids.shape, generator=g) < 0.8)
    out["masked_logprob"] = (
        lambda lm, am: masked_logprob(lm, ids, mask, loss_mask=scored, attention_mask=am)[None],
        [[(ids.masked_fill(mask, mask_id), scored, None)]],
    )
    return out


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_every_estimator_equals_the_naive_block_reference_on_a_left_padded_batch(name):
    model, lm = build(name)
    model64 = copy.deepcopy(model).double()
    ids, attention_mask, completion, loss_mask = make_batch()
    before = ids.clone(), completion.clone(), loss_mask.clone(), attention_mask.clone()
    fallback = per_block(lm)
    for estimator, (call, samples) in cases(ids, completion, loss_mask, lm.mask_id, attention_mask).items():
        with torch.no_grad():
            got = call(lm, attention_mask)
            got_per_block = call(fallback, attention_mask)
        plain = torch.stack([naive(model, ids, attention_mask, passes) for passes in samples])
        ref = torch.stack([naive(model64, ids, attention_mask, passes) for passes in samples])
        assert (plain != 0).sum() >= 8, estimator
        assert_no_worse_than_torch(got, plain, ref, TOL, what=f"{name} {estimator}")
        # The noisy/clean layout (one forward of 2L) equals one forward per block.
        assert_no_worse_than_torch(got_per_block, plain, ref, TOL, what=f"{name} {estimator} per block")
        assert torch.allclose(got, got_per_block, atol=TOL, rtol=0), estimator
    for kept, now in zip(before, (ids, completion, loss_mask, attention_mask)):
        assert torch.equal(kept, now)


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_padding_tokens_do_not_matter_and_a_block_aligned_row_is_the_row_alone(name):
    _, lm = build(name)
    ids, attention_mask, completion, loss_mask = make_batch()
    kwargs = dict(estimator="stratified", seed=SEED, num_strata=2, prompt_mask_prob=0.2)
    with torch.no_grad():
        got = estimate_logprob(lm, ids, completion, loss_mask, attention_mask, **kwargs)
        repadded = ids.masked_fill(attention_mask == 0, 17)
        assert_close_reduced(estimate_logprob(lm, repadded, completion, loss_mask, attention_mask, **kwargs), got,
                             n=REDUCTION)
        # Every row's noisy/clean states are those of the row alone (blocks and positions from its first token),
        # whether its padding is a whole block (row 1) or moves a column block boundary (row 2).
        states = lm.block_hidden(ids.masked_fill(completion, lm.mask_id), ids, attention_mask)
        for b, pad in enumerate(PADS):
            alone = lm.block_hidden(ids[b:b + 1, pad:].masked_fill(completion[b:b + 1, pad:], lm.mask_id),
                                    ids[b:b + 1, pad:])
            assert torch.allclose(states[b, pad:], alone[0], atol=1e-4, rtol=0), f"row {b}"


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_estimate_logprob_and_monte_carlo_masks_dispatch_on_the_block_structure(name):
    _, lm = build(name)
    ids, attention_mask, completion, loss_mask = make_batch()
    common = dict(attention_mask=attention_mask, loss_mask=loss_mask)
    with torch.no_grad():
        direct = {
            "one_step": one_step_logprob(lm, ids, completion, seed=SEED, prompt_mask_prob=0.1, **common),
            "stratified": stratified_logprob(lm, ids, completion, num_strata=3, seed=SEED, prompt_mask_prob=0.1,
                                             **common),
            "coupled": coupled_logprob(lm, ids, completion, seed=SEED, **common),
        }
        samples = elbo_samples(lm, ids, completion, num_samples=2, seed=SEED, prompt_mask_prob=0.1, **common)
        direct["elbo"] = (samples.logprob / samples.t[..., None]).sum(0) / 2
        for estimator, value in direct.items():
            got = estimate_logprob(lm, ids, completion, loss_mask, attention_mask, estimator=estimator, seed=SEED,
                                   num_strata=3, elbo_samples=2, prompt_mask_prob=0.1)
            assert_close_reduced(got, value, n=REDUCTION, what=estimator)
    strata = reference_block_strata(completion, 3, attention_mask)
    drawn = monte_carlo_masks(ids, completion, loss_mask, attention_mask, estimator="stratified", seed=SEED,
                              mask_id=lm.mask_id, num_strata=3, attention=lm.attention)
    for k, sample in enumerate(drawn):
        assert torch.equal(sample.masked, strata == k)
        assert torch.equal(sample.scored, (strata == k) & loss_mask)
    # Every block holds each stratum floor or ceil(n_c / K) times (a row-wide draw would not).
    for region in block_regions(completion, attention_mask):
        counts = torch.stack([(s.masked & region).sum(1) for s in drawn])
        assert (counts.amax(0) - counts.amin(0) <= 1).all()
    elbo = monte_carlo_masks(ids, completion, loss_mask, attention_mask, estimator="elbo", seed=SEED,
                             mask_id=lm.mask_id, elbo_samples=2, attention=lm.attention)
    for j, sample in enumerate(elbo):
        assert torch.equal(sample.scored, samples.mask[j])


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_gradients_flow_through_the_block_layout(name):
    model, lm = build(name)
    model64 = copy.deepcopy(model).double()
    ids, attention_mask, completion, loss_mask = make_batch()
    call, samples = cases(ids, completion, loss_mask, lm.mask_id, attention_mask)["coupled"]
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    def grads(m, value):
        m.zero_grad()
        (value * weights.to(value.dtype)).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    fused = grads(model, call(lm, attention_mask)[0])
    plain = grads(model, naive(model, ids, attention_mask, samples[0], grad=True))
    ref = grads(model64, naive(model64, ids, attention_mask, samples[0], grad=True))
    assert fused.keys() == ref.keys() and any(g.abs().sum() > 0 for g in fused.values())
    assert_model_gradients_close(fused, ref, plain, what=f"{name} coupled")
    per_block_grads = grads(model, call(per_block(lm), attention_mask)[0])
    assert_model_gradients_close(per_block_grads, fused, what=f"{name} per block")
    recomputed = grads(model, coupled_logprob(lm, ids, completion, seed=SEED, attention_mask=attention_mask,
                                              loss_mask=loss_mask, checkpoint=True))
    assert_model_gradients_close(recomputed, fused, what=f"{name} checkpointed")


def test_block_masks_of_a_shard_are_those_rows_of_the_whole_batch_and_of_the_reference():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 58, (5, 23), generator=g)
    completion = torch.rand(ids.shape, generator=g) < 0.7
    whole = block_stratified_mask(ids, completion, 3, SEED, 60, 5, prompt_mask_prob=0.3)
    whole_split = block_coupled_split(completion, SEED, 5)
    shard = block_stratified_mask(ids[2:4], completion[2:4], 3, SEED, 60, 5, prompt_mask_prob=0.3, row_offset=2)
    shard_split = block_coupled_split(completion[2:4], SEED, 5, row_offset=2)
    assert torch.equal(shard.strata, whole.strata[2:4]) and torch.equal(shard.input_ids, whole.input_ids[:, 2:4])
    assert all(torch.equal(a, b[2:4]) for a, b in zip(shard_split, whole_split))
    # Completions with holes, a block size that does not divide the length: each block's strata and split
    # are the reference's of that block alone.
    block = torch.arange(23) // 5
    for c in range(5):
        region = completion & (block == c)
        assert torch.equal(torch.where(region, whole.strata, -1), masking.strata(region, 3, SEED))
        strata, _, weights = masking.coupled_split(region, SEED)
        assert torch.equal(torch.where(region, whole_split[0], -1), strata)
        assert torch.equal(torch.where(region, whole_split[1], 0.0), weights)
    # Left padding: a row's blocks start at its first attended column, in the shard as in the whole batch.
    pads = torch.tensor([0, 3, 1, 7, 2])
    attention_mask = (torch.arange(23)[None, :] >= pads[:, None]).long()
    real = completion & attention_mask.bool()
    whole = block_stratified_mask(ids, real, 3, SEED, 60, 5, prompt_mask_prob=0.3, attention_mask=attention_mask)
    whole_split = block_coupled_split(real, SEED, 5, attention_mask=attention_mask)
    shard = block_stratified_mask(ids[2:4], real[2:4], 3, SEED, 60, 5, prompt_mask_prob=0.3, row_offset=2,
                                  attention_mask=attention_mask[2:4])
    shard_split = block_coupled_split(real[2:4], SEED, 5, row_offset=2, attention_mask=attention_mask[2:4])
    assert torch.equal(shard.strata, whole.strata[2:4]) and torch.equal(shard.input_ids, whole.input_ids[:, 2:4])
    assert all(torch.equal(a, b[2:4]) for a, b in zip(shard_split, whole_split))
    row_block = (torch.arange(23)[None, :] - pads[:, None]).div(5, rounding_mode="floor")
    for c in range(5):
        region = real & (row_block == c)
        assert torch.equal(torch.where(region, whole.strata, -1), masking.strata(region, 3, SEED))
        strata, _, weights = masking.coupled_split(region, SEED)
        assert torch.equal(torch.where(region, whole_split[0], -1), strata)
        assert torch.equal(torch.where(region, whole_split[1], 0.0), weights)


def test_bad_input():
    model, lm = build("sdar")
    ids, attention_mask, completion, loss_mask = make_batch()
    shifted = MaskedLM(lm.hidden, lm.head_weight, None, lm.mask_id, shift=True, attention=lm.attention)
    with pytest.raises(ValueError, match="^lm: .*shift=True"):
        one_step_logprob(shifted, ids, completion, seed=0, loss_mask=loss_mask)
    with pytest.raises(ValueError, match="^mask_block_length"):
        estimate_logprob(lm, ids, completion, loss_mask, None, estimator="one_step", seed=0, mask_block_length=4)
    with pytest.raises(ValueError, match="^mask_block_length"):
        elbo_samples(lm, ids, completion, num_samples=1, seed=0, block_length=4)
    with pytest.raises(ValueError, match="^mask_block_length"):
        monte_carlo_masks(ids, completion, loss_mask, None, estimator="elbo", seed=0, mask_id=60, mask_block_length=4,
                          attention=("block", 4))
    with pytest.raises(ValueError, match="^attention"):
        monte_carlo_masks(ids, completion, loss_mask, None, estimator="stratified", seed=0, mask_id=60, attention="block")
    with pytest.raises(ValueError, match="^attention"):
        monte_carlo_masks(ids, completion, loss_mask, None, estimator="stratified", seed=0, mask_id=60,
                          attention=("block", 0))
    positions = torch.arange(LENGTH).expand(3, LENGTH)
    keep = torch.ones(3, LENGTH, LENGTH, dtype=torch.bool)
    with pytest.raises(TypeError, match="^position_ids"):
        lm.hidden_with_keep(ids, positions.int(), keep)
    with pytest.raises(ValueError, match="^keep"):
        lm.hidden_with_keep(ids, positions, keep[:, 1:])
    with pytest.raises(TypeError, match="^keep"):
        lm.hidden_with_keep(ids, positions, keep.long())
    keyless = keep.clone()
    keyless[:, 0] = False
    with pytest.raises(ValueError, match="^keep must keep"):
        lm.hidden_with_keep(ids, positions, keyless)
    with pytest.raises(ValueError, match="^clean_ids"):
        lm.block_hidden(ids, ids[:, 1:])
    with pytest.raises(ValueError, match="^lm: this MaskedLM has no hidden_with_keep"):
        per_block(lm).hidden_with_keep(ids, positions, keep)
    with pytest.raises(ValueError, match="^hidden_with_keep_fn"):
        MaskedLM(lm.hidden, lm.head_weight, None, lm.mask_id, hidden_with_keep_fn=lm.hidden_with_keep)
    full = MaskedLM(lm.hidden, lm.head_weight, None, lm.mask_id)
    with pytest.raises(ValueError, match="^lm: block_hidden"):
        full.block_hidden(ids, ids)


def test_from_hf_refuses_a_family_call_that_ignores_the_layout_position_ids(monkeypatch):
    model = sdar.tiny()
    ignoring = dataclasses.replace(families.SDAR, keep_kwargs=lambda keep, positions, dtype: {
        "attention_mask": keep[:, None], "use_cache": False})
    monkeypatch.setattr(families, "recognise", lambda _: ignoring)
    with pytest.raises(ValueError, match="does not honour the 4-D mask and position ids"):
        MaskedLM.from_hf(model, mask_id=sdar.MASK_ID)
