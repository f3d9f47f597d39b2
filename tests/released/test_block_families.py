"""Conformance of the block-causal families (SDAR / TraDo, LLaDA2) on their released modeling code.

Each family is a hub-style checkpoint of its released files (``hub.write_checkpoint``, block size 4) loaded the
way a user loads it, and wrapped with ``MaskedLM.from_hf(model)`` and no options. Checked here:

- every estimator on a left-padded batch whose padding is not a whole number of blocks, against a reference
  that runs each row alone without its padding: for every forward pass the estimator makes
  (``likelihood.estimator_masks``), every scored block ``c`` of the row is the input ``[context blocks < c ;
  noisy block c]`` run through ``model(...)`` with a block-causal mask built here (blocks from the row's first
  token) in the form the family's code takes, then ``log_softmax`` and a gather;
- one partition: a padded row's estimate equals the row alone for every pad length, and a rollout is scored
  under the block partition it was decoded under;
- the sampler (``rollout.generate``) against a plain re-implementation of the released decoders (SDAR's
  ``block_diffusion_generate``, LLaDA2's ``generate``), greedy and seeded, equal and left-padded prompts;
- ``DiffusionGRPOTrainer`` with TRL's defaults: 2 steps of ``train()`` (a reference model, ``beta > 0``,
  activation checkpointing on), ``save_model``, reload, and a resumed run equal to an uninterrupted one.

Nothing here uses transformers-5-only behaviour: the same tests run on the transformers 4 line.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from families.test_block_sampler import HashedDraws
from torch import nn

from daca_kernels.likelihood import elbo_samples, estimate_logprob, estimator_masks
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.reference import masking
from daca_kernels.rollout import generate
from released import hub

NAMES = ("sdar", "llada2")
S = 4  # the block size of the tiny checkpoints (config.block_size)
MASK = hub.FAMILIES["sdar"].mask_id
PADS = (0, 1, 2, 3, 5, 6)  # pads that are not whole blocks (and two that span one)
LENGTH, PROMPT = 15, 7  # completion: columns 7..14
SEED = 11
EPS32 = torch.finfo(torch.float32).eps

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> a loader ``(dtype) -> model`` of the family's checkpoint (written once per module)."""
    directories = {name: hub.write_checkpoint(name, tmp_path_factory.mktemp(name), seed=2) for name in NAMES}

    def load(name, dtype=torch.float32):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return hub.load(directories[name], name, dtype=dtype)

    return load


def block_mask(model, name, n):
    """The ``[1, 1, n, n]`` block-causal mask (blocks ``j // S``) in the form the family's code takes: SDAR a bool
    mask, LLaDA2 an additive one in the model's dtype."""
    block = torch.arange(n) // S
    keep = block[None, :] <= block[:, None]
    if name == "sdar":
        return keep[None, None]
    dtype = next(model.parameters()).dtype
    return torch.zeros(1, 1, n, n, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def row_logprobs(model, name, seq):
    """float64 ``[n, V]``: ``log_softmax`` of ``model(seq)``'s logits for one unpadded row ``seq [n]``."""
    n = seq.shape[0]
    logits = model(seq[None], attention_mask=block_mask(model, name, n), position_ids=torch.arange(n)[None],
                   use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def reference(model, name, ids, attention_mask, passes):
    """``sum_p weight * log p(y_i | context blocks < c, noisy block c)``, each row alone (padding dropped)."""
    out = torch.zeros(ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for p in passes:
            for b in range(ids.shape[0]):
                pad = int((attention_mask[b] == 0).sum())
                scored = p.scored[b].nonzero().squeeze(1)
                for c in sorted({(int(i) - pad) // S for i in scored}):
                    start, end = pad + c * S, min(pad + c * S + S, ids.shape[1])
                    seq = torch.cat([p.context_ids[b, pad:start], p.input_ids[b, start:end]])
                    logp = row_logprobs(model, name, seq)
                    for i in range(start, end):
                        if p.scored[b, i]:
                            out[b, i] += p.weight[b, i] * logp[i - pad, ids[b, i]]
    return out


def assert_normwise_close(got, plain, ref, what):
    """``|got - ref| <= |plain - ref| + 1e3 eps32 (1 + |ref|)`` in the 2-norm (quantities accumulated through a
    model, DESIGN 7): the library in float32 no worse than the plain float32 reference, up to float32 rounding."""
    got, plain, ref = got.double(), plain.double(), ref.double()
    err, allowed = (got - ref).norm(), (plain - ref).norm() + 1e3 * EPS32 * (1 + ref.norm())
    assert err <= allowed, f"{what}: |got - ref| = {err:.3e} > {allowed:.3e}"


def padded_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, MASK - 3, (len(PADS), LENGTH), generator=g)
    attention_mask = torch.ones_like(ids)
    for b, pad in enumerate(PADS):
        attention_mask[b, :pad] = 0
        ids[b, :pad] = hub.FAMILIES["sdar"].pad_id
    completion = torch.zeros(ids.shape, dtype=torch.bool)
    completion[:, PROMPT:] = True
    loss_mask = completion.clone()
    loss_mask[1, -3:] = False  # answers shorter than the generated region
    loss_mask[4, -1:] = False
    return ids, attention_mask, completion, loss_mask


ESTIMATORS = {  # name -> estimate_logprob settings
    "one_step": dict(estimator="one_step"),
    "one_step, prompt masking": dict(estimator="one_step", prompt_mask_prob=0.3),
    "stratified (SML)": dict(estimator="stratified", num_strata=3, prompt_mask_prob=0.2),
    "coupled": dict(estimator="coupled"),
    "elbo": dict(estimator="elbo", elbo_samples=3, prompt_mask_prob=0.25),
}


@pytest.mark.parametrize("name", NAMES)
def test_from_hf_needs_no_options(checkpoints, name):
    lm = MaskedLM.from_hf(checkpoints(name))
    assert lm.attention == ("block", S) and lm.mask_id == MASK and not lm.shift and lm.has_hidden_with_keep


@pytest.mark.parametrize("name", NAMES)
def test_every_estimator_on_a_left_padded_batch_equals_each_row_alone(checkpoints, name):
    model, model64 = checkpoints(name), checkpoints(name, torch.float64)
    lm = MaskedLM.from_hf(model)
    per_block = MaskedLM(lm.hidden_fn, lm.head_weight, lm.head_bias, lm.mask_id, attention=lm.attention)
    ids, attention_mask, completion, loss_mask = padded_batch()
    for what, settings in ESTIMATORS.items():
        masks = estimator_masks(ids, completion, loss_mask, attention_mask, seed=SEED, mask_id=lm.mask_id,
                                attention=lm.attention, **settings)
        with torch.no_grad():
            got = estimate_logprob(lm, ids, completion, loss_mask, attention_mask, seed=SEED, **settings)
            got_per_block = estimate_logprob(per_block, ids, completion, loss_mask, attention_mask, seed=SEED,
                                             **settings)
        plain = reference(model, name, ids, attention_mask, masks.passes)
        ref = reference(model64, name, ids, attention_mask, masks.passes)
        covered = torch.stack([p.scored for p in masks.passes]).any(0)
        assert not bool((covered & ~loss_mask).any()) and bool((ref[covered] != 0).all()), what
        assert int(covered.sum()) >= len(PADS) * 2 and not bool(got[~covered].any()), what
        assert_normwise_close(got, plain, ref, f"{name} {what}")
        # The block-wise form without hidden_with_keep (one forward per block, rows moved to start a block).
        assert_normwise_close(got_per_block, plain, ref, f"{name} {what}, one forward per block")
    # ELBO samples one by one: each is its pass of estimator_masks, unweighted.
    with torch.no_grad():
        samples = elbo_samples(lm, ids, completion, num_samples=3, seed=SEED, attention_mask=attention_mask,
                               loss_mask=loss_mask, prompt_mask_prob=0.25)
    masks = estimator_masks(ids, completion, loss_mask, attention_mask, seed=SEED, mask_id=lm.mask_id,
                            attention=lm.attention, **ESTIMATORS["elbo"])
    for j, p in enumerate(masks.passes):
        assert torch.equal(samples.mask[j], p.scored)
        unweighted = p._replace(weight=p.scored.double())
        assert_normwise_close(samples.logprob[j], reference(model, name, ids, attention_mask, [unweighted]),
                              reference(model64, name, ids, attention_mask, [unweighted]), f"{name} sample {j}")
        torch.testing.assert_close(1 / (3 * samples.t[j].double()), p.weight[:, PROMPT:].amax(1).where(
            p.scored.any(1), 1 / 3.0), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="^mask_block_length"):
        estimate_logprob(lm, ids, completion, loss_mask, attention_mask, estimator="elbo", seed=0,
                         mask_block_length=2)


@pytest.mark.parametrize("name", NAMES)
def test_stratified_and_coupled_masks_are_drawn_within_each_rows_own_blocks(checkpoints, name):
    ids, attention_mask, completion, loss_mask = padded_batch()
    common = dict(seed=SEED, mask_id=MASK, attention=("block", S))
    strata = estimator_masks(ids, completion, loss_mask, attention_mask, estimator="stratified", num_strata=3,
                             **common)
    coupled = estimator_masks(ids, completion, loss_mask, attention_mask, estimator="coupled", **common)
    pads = torch.tensor(PADS)
    row_block = (torch.arange(LENGTH)[None, :] - pads[:, None]).div(S, rounding_mode="floor")
    assert torch.equal(strata.blocks, row_block)
    for c in range(LENGTH // S + 1):
        region = completion & (row_block == c)
        want = masking.strata(region, 3, SEED)
        for k, p in enumerate(strata.passes):
            assert torch.equal(p.input_ids[region] == MASK, (want == k)[region])
        halves, _, weights = masking.coupled_split(region, SEED)
        for k, p in enumerate(coupled.passes):
            assert torch.equal(p.input_ids[region] == MASK, (halves == k)[region])
            assert torch.equal(p.weight[region & p.scored], weights[region & p.scored])


@pytest.mark.parametrize("name", NAMES)
def test_a_padded_rows_estimate_is_the_row_alone_for_every_pad_length(checkpoints, name):
    lm = MaskedLM.from_hf(checkpoints(name))
    g = torch.Generator().manual_seed(5)
    row = torch.randint(0, MASK - 3, (1, 12), generator=g)
    completion = torch.zeros(row.shape, dtype=torch.bool)
    completion[:, 5:] = True
    with torch.no_grad():
        alone = estimate_logprob(lm, row, completion, completion, None, estimator="one_step", seed=0)[0]
        for pad in range(1, 2 * S + 1):
            longer = torch.randint(0, MASK - 3, (1, 12 + pad), generator=g)
            ids = torch.cat([longer, torch.cat([torch.full((1, pad), 61), row], dim=1)])
            attention_mask = torch.ones_like(ids)
            attention_mask[1, :pad] = 0
            region = torch.zeros(ids.shape, dtype=torch.bool)
            region[:, -7:] = True
            got = estimate_logprob(lm, ids, region, region, attention_mask, estimator="one_step", seed=0)[1, pad:]
            assert (got - alone).norm() <= 1e2 * EPS32 * (1 + alone.norm()), f"pad {pad}"


@pytest.mark.parametrize("name", NAMES)
def test_a_rollout_is_scored_under_the_partition_it_was_decoded_under(checkpoints, name):
    lm = MaskedLM.from_hf(checkpoints(name))
    g = torch.Generator().manual_seed(6)
    pads = [0, 1, 3, 6]
    prompt = torch.randint(0, MASK - 3, (len(pads), 9), generator=g)
    prompt_mask = torch.ones(prompt.shape, dtype=torch.bool)
    for b, pad in enumerate(pads):
        prompt_mask[b, :pad] = False
    options = dict(gen_length=9, steps=2, seed=4, temperature=0.9, threshold=0.5)
    rollout = generate(lm, prompt, prompt_mask=prompt_mask, **options)
    completion = rollout.completion_mask
    masks = estimator_masks(rollout.sequences, completion, completion, rollout.attention_mask, estimator="one_step",
                            seed=0, mask_id=lm.mask_id, attention=lm.attention)
    # The scoring's blocks are the decode's: a block's tokens are committed after every earlier block's.
    for b in range(len(pads)):
        blocks = masks.blocks[b][completion[b]].tolist()
        steps = rollout.commit_step[b][completion[b]].tolist()
        for c in set(blocks):
            later = [s for blk, s in zip(blocks, steps) if blk > c]
            assert not later or max(s for blk, s in zip(blocks, steps) if blk == c) < min(later), f"row {b}"
    with torch.no_grad():
        scored = estimate_logprob(lm, rollout.sequences, completion, completion, rollout.attention_mask,
                                  estimator="one_step", seed=0)
        for b, pad in enumerate(pads):
            alone = generate(lm, prompt[b:b + 1, pad:], row_offset=b, **options)
            assert torch.equal(alone.sequences[0], rollout.sequences[b, pad:]), f"row {b}"
            own = estimate_logprob(lm, alone.sequences, alone.completion_mask, alone.completion_mask, None,
                                   estimator="one_step", seed=0)[0]
            assert (scored[b, pad:] - own).norm() <= 1e2 * EPS32 * (1 + own.norm()), f"row {b}"


# ---------------------------------------------------------------- the sampler against the released decoders

def with_biased_head(model):
    """The float64 model with a random head bias whose mask-id entry is -1e4: the released decoders let the mask
    id compete, the library never proposes it; at probability 0 both propose the same tokens."""
    weight = model.lm_head.weight.detach()
    model.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=True, dtype=weight.dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(weight)
        model.lm_head.bias.copy_(torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(8),
                                             dtype=weight.dtype))
        model.lm_head.bias[MASK] = -1e4
    return model.eval()


def transfer_schedule(steps):
    """Tokens committed at each step of a block: the even split, remainder first (both released decoders)."""
    return [S // steps + (1 if j < S % steps else 0) for j in range(steps)]


def released_decode(model, name, prompt, draws, *, gen_length, steps, temperature, top_k, top_p, threshold):
    """The released block decoders of one unpadded prompt ``[1, P]``, written plainly: the completion all mask,
    blocks of ``S`` from the one holding the first completion position, at each step of a block the model's
    logits of the prefix up to the block's end (block-causal mask, positions from the prompt's first token),
    SDAR's / LLaDA2's sampling (temperature, top-k, top-p, ``multinomial``) and commit rule (``threshold`` None:
    the ``k`` most confident, SDAR's static rule; else every position above it when there are ``k`` of them,
    SDAR's dynamic rule and LLaDA2's), ``k`` from :func:`transfer_schedule` capped at the masked count. Every
    block is decoded (no stop at EOS). LLaDA2's forward casts its logits to float32, so the head is applied here
    to the backbone's float64 states."""
    length = prompt.shape[1]
    total = -(-(length + gen_length) // S) * S
    x = torch.full((1, total), MASK, dtype=torch.long)
    x[:, :length] = prompt
    for block in range(length // S, total // S):
        start, end = block * S, block * S + S
        for count in transfer_schedule(steps):
            active = x[0, start:end] == MASK
            if not active.any():
                break
            states = model.model(input_ids=x[:, :end], attention_mask=block_mask(model, name, end),
                                 position_ids=torch.arange(end)[None], use_cache=False).last_hidden_state
            logits = model.lm_head(states[0, start:end])
            if temperature > 0 and temperature != 1:
                logits = logits / temperature
            if top_k:
                logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[:, -1:], float("-inf"))
            if top_p is not None and top_p < 1:
                ordered, order = torch.sort(logits, descending=True)
                drop = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1) > top_p
                drop[:, 1:] = drop[:, :-1].clone()
                drop[:, 0] = False
                logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            draws.at(start)
            token = torch.multinomial(probs, num_samples=1)
            confidence = torch.where(active, probs.gather(-1, token).squeeze(-1), -torch.inf)
            count = min(count, int(active.sum()))
            high = confidence > (math.inf if threshold is None else threshold)
            if int(high.sum()) >= count:
                transfer = high
            else:
                transfer = torch.zeros_like(active)
                transfer[torch.topk(confidence, count).indices] = True
            x[0, start:end][transfer] = token.squeeze(-1)[transfer]
    return x[0, :length + gen_length]


SAMPLER_CASES = {  # name -> (temperature, top_k, top_p, threshold)
    "greedy, static": (0.0, None, None, None),
    "greedy, threshold": (0.0, None, None, 0.3),
    "seeded, threshold, top-k and top-p": (0.8, 7, 0.9, 0.2),
    "seeded, static": (1.2, None, None, None),
}


@pytest.fixture(scope="module")
def decoders(checkpoints):
    """name -> (float64 model with the biased head, its MaskedLM)."""
    out = {}
    for name in NAMES:
        model = with_biased_head(checkpoints(name, torch.float64))
        out[name] = model, MaskedLM.from_hf(model)
    return out


@pytest.mark.parametrize("pads", [(0, 0), (0, 3, 6, 1)], ids=["equal prompts", "left-padded"])
@pytest.mark.parametrize("case", list(SAMPLER_CASES))
@pytest.mark.parametrize("name", NAMES)
def test_the_sampler_equals_the_released_decoder(decoders, monkeypatch, name, case, pads):
    temperature, top_k, top_p, threshold = SAMPLER_CASES[case]
    model, lm = decoders[name]
    gen_length, steps, seed = 9, 2 if threshold is None else 3, 7
    prompt = torch.randint(0, MASK - 3, (len(pads), 9), generator=torch.Generator().manual_seed(len(pads)))
    prompt_mask = torch.ones(prompt.shape, dtype=torch.bool)
    for b, pad in enumerate(pads):
        prompt_mask[b, :pad] = False
    rollout = generate(lm, prompt, prompt_mask=prompt_mask if any(pads) else None, gen_length=gen_length,
                       steps=steps, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, threshold=threshold)
    for b, pad in enumerate(pads):
        row = prompt[b:b + 1, pad:]
        # Row b's noise is the library's row id b * (G + S) + r: the draws' prompt length absorbs the offset.
        draws = HashedDraws(seed, row.shape[1] - b * (gen_length + S), greedy=temperature == 0)
        with monkeypatch.context() as patch, torch.no_grad():
            patch.setattr(torch, "multinomial", draws.multinomial)
            want = released_decode(model, name, row, draws, gen_length=gen_length, steps=steps,
                                   temperature=temperature, top_k=top_k, top_p=top_p, threshold=threshold)
        assert torch.equal(rollout.sequences[b, pad:], want), f"{case}, row {b}"
