"""Padding never changes a row's estimates: every estimator on a left-padded batch of a bidirectional
family double (through ``MaskedLM.from_hf``) equals a naive reference that builds each row's masked input
WITHOUT its padding and takes ``log_softmax`` of the model's own full logits (shifted for Dream); and the
sampler gives a left-padded prompt the completion of the prompt alone."""
import copy

import pytest
import torch
from support import assert_no_worse_than_torch

from daca_kernels import rollout
from daca_kernels.likelihood import (
    coupled_logprob,
    elbo_sample_mask,
    elbo_samples,
    masked_logprob,
    one_step_logprob,
    stratified_logprob,
)
from daca_kernels.masked_lm import MaskedLM
from daca_kernels.ops import stratified_mask
from daca_kernels.ops.ratio_masks import coupled_split
from families import dream, llada, llada_moe

DOUBLES = {"llada": llada, "llada_moe": llada_moe, "dream": dream}
PADS = (0, 2, 5)  # left padding of each row
LENGTH, PROMPT = 12, 6  # completion: columns PROMPT..LENGTH-1
SEED = 11
# The estimator runs the padded batch, the plain reference each row alone: the same float32 model in
# two batch layouts, whose roundings differ by far less than this on log-probabilities of size ~4.
TOL = 1e-4


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    # What is checked here is the model adapter; the ops' kernels are checked against the references
    # elsewhere, and the Triton interpreter would make these whole-model runs minutes long.
    monkeypatch.setenv("DACA_BACKEND", "torch")


def full_logits(model, ids):
    """The model's own ``[L, V]`` logits for one unpadded row ``ids [L]`` (its released call)."""
    kwargs = {"use_cache": False} if isinstance(model, llada.LLaDAModelLM) else {}
    return model(ids[None], **kwargs).logits[0]


def naive(model, shift, input_ids, attention_mask, passes):
    """``sum_passes weight * log_softmax(logits of the row's masked copy, padding stripped)[target]``.

    passes: ``(masked_ids [B, L], scored bool [B, L], weight [B, L] or None)``. Returns ``[B, L]`` in the
    model's dtype, 0 where nothing is scored.
    """
    dtype = next(model.parameters()).dtype
    out = torch.zeros(input_ids.shape, dtype=dtype)
    keep = attention_mask.bool()
    with torch.no_grad():
        for masked, scored, weight in passes:
            for b in range(input_ids.shape[0]):
                if not scored[b].any():
                    continue
                cols = keep[b].nonzero().squeeze(1)
                logp = torch.log_softmax(full_logits(model, masked[b, cols]).to(dtype), -1)
                if shift:
                    logp = torch.cat([logp[:1], logp[:-1]])
                values = logp.gather(-1, input_ids[b, cols, None]).squeeze(-1)
                w = 1.0 if weight is None else weight[b, cols].to(dtype)
                out[b, cols] += torch.where(scored[b, cols], w * values, 0.0)
    return out


def make_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 58, (len(PADS), LENGTH), generator=g)
    attention_mask = torch.ones_like(ids)
    for b, pad in enumerate(PADS):
        attention_mask[b, :pad] = 0
        ids[b, :pad] = 59  # a padding id that is not the mask id
    completion = torch.zeros(ids.shape, dtype=torch.bool)
    completion[:, PROMPT:] = True
    loss_mask = completion.clone()
    loss_mask[2, -1] = False  # an answer shorter than the generated region
    return ids, attention_mask, completion, loss_mask


def build(name):
    model = DOUBLES[name].tiny()
    lm = MaskedLM.from_hf(model, mask_id=DOUBLES[name].MASK_ID)
    return model, lm


def estimator_cases(lm, ids, completion, loss_mask):
    """name -> (call(lm, attention_mask) -> [n?, B, L] values, passes of the naive reference)."""
    mask_id = lm.mask_id
    cases = {}
    for name, k, p in (("one_step", 1, 0.3), ("stratified", 2, 0.2)):
        masks = stratified_mask(ids, completion, k, SEED, mask_id, prompt_mask_prob=p)
        passes = [(masks.input_ids[j], (masks.strata == j) & loss_mask, None) for j in range(k)]
        if name == "one_step":
            call = lambda lm_, am, p=p: one_step_logprob(lm_, ids, completion, seed=SEED, prompt_mask_prob=p,
                                                         attention_mask=am, loss_mask=loss_mask)
        else:
            call = lambda lm_, am, k=k, p=p: stratified_logprob(lm_, ids, completion, num_strata=k, seed=SEED,
                                                                prompt_mask_prob=p, attention_mask=am,
                                                                loss_mask=loss_mask)
        cases[name] = (call, [passes])
    split = coupled_split(completion, SEED)
    cases["coupled"] = (
        lambda lm_, am: coupled_logprob(lm_, ids, completion, seed=SEED, attention_mask=am, loss_mask=loss_mask),
        [[(ids.masked_fill(split.strata == j, mask_id), (split.strata == j) & loss_mask, split.weights)
          for j in range(2)]],
    )
    samples = [elbo_sample_mask(completion, seed=SEED, index=j, num_samples=2, loss_mask=loss_mask,
                                prompt_mask_prob=0.25) for j in range(2)]
    cases["elbo_samples"] = (
        lambda lm_, am: elbo_samples(lm_, ids, completion, num_samples=2, seed=SEED, attention_mask=am,
                                     loss_mask=loss_mask, prompt_mask_prob=0.25).logprob,
        [[(ids.masked_fill(s.masked, mask_id), s.scored, None)] for s in samples],
    )
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(ids.shape, generator=g) < 0.5) & (completion | (torch.rand(ids.shape, generator=g) < 0.2))
    mask[:, PROMPT] = True
    if lm.shift:
        mask[:, 0] = False
    scored = mask & loss_mask
    cases["masked_logprob"] = (
        lambda lm_, am: masked_logprob(lm_, ids, mask, loss_mask=scored, attention_mask=am),
        [[(ids.masked_fill(mask, mask_id), scored, None)]],
    )
    return cases


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_every_estimator_on_a_left_padded_batch_equals_each_row_alone(name):
    model, lm = build(name)
    model64 = copy.deepcopy(model).double()
    ids, attention_mask, completion, loss_mask = make_batch()
    for estimator, (call, sample_passes) in estimator_cases(lm, ids, completion, loss_mask).items():
        with torch.no_grad():
            got = call(lm, attention_mask)
        plain = torch.stack([naive(model, lm.shift, ids, attention_mask, p) for p in sample_passes])
        ref = torch.stack([naive(model64, lm.shift, ids, attention_mask, p) for p in sample_passes])
        got = got.reshape(plain.shape)
        assert (plain != 0).any(), estimator
        assert_no_worse_than_torch(got, plain, ref, TOL, what=f"{name} {estimator}")


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_greedy_rollout_of_left_padded_prompts_matches_each_prompt_alone(name):
    _, lm = build(name)
    ids, attention_mask, _, _ = make_batch()
    prompts, prompt_mask = ids[:, :PROMPT], attention_mask[:, :PROMPT].bool()
    kwargs = dict(gen_length=8, steps=8, block_length=4, temperature=0.0, seed=0)
    batch = rollout.generate(lm, prompts, prompt_mask=prompt_mask, **kwargs).sequences
    for b, pad in enumerate(PADS):
        alone = rollout.generate(lm, prompts[b:b + 1, pad:], **kwargs).sequences[0]
        assert torch.equal(batch[b, PROMPT:], alone[PROMPT - pad:]), f"row {b}"
