"""Every estimator on a left-padded batch of each full-attention family's released code equals a plain
reference that runs each row ALONE, without its padding, through the model's own forward (full logits,
``log_softmax``, gather; Dream's shifted convention), for ``MaskedLM.from_hf(model)`` with no options.

The reference calls the released model directly with the arguments its own scripts pass (below), never
through :class:`MaskedLM` or the library's family table; the estimators' masks come from the public mask
functions with the estimator's seed (what is checked is how the masked inputs are scored).
"""
import copy
import warnings

import pytest
import torch
from support import assert_no_worse_than_torch

from daca_kernels.likelihood import (
    coupled_logprob,
    elbo_sample_mask,
    elbo_samples,
    masked_logprob,
    one_step_logprob,
    stratified_logprob,
)
from daca_kernels.likelihood.ratio_masks import coupled_split
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops import stratified_mask
from released import hub

FULL = ("llada", "llada_dllm", "lladamoe", "dream", "dream_dllm")
SHIFTED = {"dream", "dream_dllm"}
PADS = (0, 3, 6, 1)  # left padding of each row: lengths 13, 10, 7, 12 (two rows share no length)
LENGTH, PROMPT = 13, 7  # completion: columns PROMPT..LENGTH-1
SEED = 17
PAD_ID = hub.FAMILIES["llada"].pad_id
# The padded batch and the row alone are the same float32 computation in two batch layouts (and, for
# the families served without a mask, in other batch groupings): their roundings differ by a few units
# of float32's epsilon on each of the ~H * layers terms a logit sums. The rule is the project's for op
# outputs, against a float64 copy of the model: no worse than plain float32 torch on the row alone, plus
# 64 epsilons relative to the log-probability's size (a wrong mask, a padding token attended or a
# shifted position moves a log-probability by more than 1e-2, a thousand times more).
TOL_EPS = 64 * torch.finfo(torch.float32).eps


def released_call(name: str) -> dict:
    """The keyword arguments each family's own scripts pass for an unpadded row: the released LLaDA code
    reads ``config.use_cache`` (which transformers 5 drops), dllm's Dream refuses ``attention_mask=None``."""
    if name.startswith("llada"):
        return {"use_cache": False}
    return {"attention_mask": "full"} if name == "dream_dllm" else {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One hub-style checkpoint directory per family (written once for the module)."""
    root = tmp_path_factory.mktemp("released")
    return {name: hub.write_checkpoint(name, root / name, seed=5) for name in FULL if hub.require(name)}


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    # The adapter is checked here; the ops' kernels are checked against references elsewhere, and the
    # Triton interpreter would make these whole-model runs minutes long.
    monkeypatch.setenv("DACA_BACKEND", "torch")


def load(checkpoints, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hub.load(checkpoints[name], name)


def row_alone(model, name, input_ids, attention_mask, passes):
    """``sum_passes weight * log_softmax(model(masked row, padding stripped).logits)[target]``.

    passes: ``(masked_ids [B, L], scored bool [B, L], weight [B, L] or None)``. Returns ``[B, L]`` in the
    model's dtype, 0 where nothing is scored.
    """
    dtype = next(model.parameters()).dtype
    out = torch.zeros(input_ids.shape, dtype=dtype)
    with torch.no_grad():
        for masked, scored, weight in passes:
            for b in range(input_ids.shape[0]):
                cols = attention_mask[b].bool().nonzero().squeeze(1)
                logits = model(masked[b, cols][None], **released_call(name)).logits[0]
                logp = torch.log_softmax(logits.to(dtype), -1)
                if name in SHIFTED:  # position i - 1 predicts token i
                    logp = torch.cat([logp[:1], logp[:-1]])
                values = logp.gather(-1, input_ids[b, cols, None]).squeeze(-1)
                w = 1.0 if weight is None else weight[b, cols].to(dtype)
                out[b, cols] += torch.where(scored[b, cols], w * values, 0.0)
    return out


def left_padded_batch(vocab_top: int):
    """Random ids below ``vocab_top`` (so no special id) with rows left-padded by ``PADS``; a
    completion region of ``LENGTH - PROMPT`` columns; a loss mask shorter than it in one row."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab_top, (len(PADS), LENGTH), generator=g)
    attention_mask = torch.ones_like(ids)
    for b, pad in enumerate(PADS):
        attention_mask[b, :pad] = 0
        ids[b, :pad] = PAD_ID
    completion = torch.zeros(ids.shape, dtype=torch.bool)
    completion[:, PROMPT:] = True
    loss_mask = completion.clone()
    loss_mask[2, -2:] = False
    return ids, attention_mask, completion, loss_mask


def cases(lm, ids, completion, loss_mask):
    """estimator -> (call(attention_mask) -> values [n?, B, L], passes of the reference per sample)."""
    out = {}
    for label, k, p in (("one_step", 1, 0.0), ("one_step_prompt_masked", 1, 0.3), ("stratified", 3, 0.0),
                        ("stratified_prompt_masked", 2, 0.25)):
        masks = stratified_mask(ids, completion, k, SEED, lm.mask_id, prompt_mask_prob=p)
        passes = [(masks.input_ids[j], (masks.strata == j) & loss_mask, None) for j in range(k)]
        if k == 1:
            def call(am, p=p):
                return one_step_logprob(lm, ids, completion, seed=SEED, prompt_mask_prob=p, attention_mask=am,
                                        loss_mask=loss_mask)
        else:
            def call(am, k=k, p=p):
                return stratified_logprob(lm, ids, completion, num_strata=k, seed=SEED, prompt_mask_prob=p,
                                          attention_mask=am, loss_mask=loss_mask)
        out[label] = (call, [passes])
    split = coupled_split(completion, SEED)
    out["coupled"] = (
        lambda am: coupled_logprob(lm, ids, completion, seed=SEED, attention_mask=am, loss_mask=loss_mask),
        [[(ids.masked_fill(split.strata == j, lm.mask_id), (split.strata == j) & loss_mask, split.weights)
          for j in range(2)]],
    )
    samples = [elbo_sample_mask(completion, seed=SEED, index=j, num_samples=3, loss_mask=loss_mask,
                                prompt_mask_prob=0.2) for j in range(3)]
    out["elbo_samples"] = (
        lambda am: elbo_samples(lm, ids, completion, num_samples=3, seed=SEED, attention_mask=am,
                                loss_mask=loss_mask, prompt_mask_prob=0.2).logprob,
        [[(ids.masked_fill(s.masked, lm.mask_id), s.scored, None)] for s in samples],
    )
    g = torch.Generator().manual_seed(8)
    mask = (torch.rand(ids.shape, generator=g) < 0.5) & (completion | (torch.rand(ids.shape, generator=g) < 0.2))
    mask[:, PROMPT] = True
    if lm.shift:
        mask[:, 0] = False
    scored = mask & loss_mask
    out["masked_logprob"] = (lambda am: masked_logprob(lm, ids, mask, loss_mask=scored, attention_mask=am),
                             [[(ids.masked_fill(mask, lm.mask_id), scored, None)]])
    return out


@pytest.mark.parametrize("name", FULL)
def test_every_estimator_on_a_left_padded_batch_equals_each_row_alone(name, checkpoints):
    model = load(checkpoints, name)
    lm = MaskedLM.from_hf(model)
    assert lm.mask_id == hub.FAMILIES[name].mask_id and lm.shift == (name in SHIFTED)
    model64 = copy.deepcopy(model).double()
    ids, attention_mask, completion, loss_mask = left_padded_batch(hub.FAMILIES[name].pad_id)
    for estimator, (call, sample_passes) in cases(lm, ids, completion, loss_mask).items():
        with torch.no_grad():
            got = call(attention_mask)
        plain = torch.stack([row_alone(model, name, ids, attention_mask, p) for p in sample_passes])
        ref = torch.stack([row_alone(model64, name, ids, attention_mask, p) for p in sample_passes])
        got = got.reshape(plain.shape)
        assert (plain != 0).sum() >= len(PADS), f"{name} {estimator}: too few scored positions"
        assert_no_worse_than_torch(got, plain, ref, TOL_EPS * (1 + ref.abs()), what=f"{name} {estimator}")


@pytest.mark.parametrize("name", FULL)
def test_the_reference_sees_a_padding_token_that_is_attended(name, checkpoints):
    # The comparison above can fail: the same row scored with its padding attended (no mask) differs
    # from the row alone by over a hundred times the tolerance (measured on these tiny models: 0.04 to
    # 0.19 nats in the row's largest difference, against a tolerance of about 4e-5).
    model = load(checkpoints, name)
    ids, attention_mask, completion, loss_mask = left_padded_batch(hub.FAMILIES[name].pad_id)
    lm = MaskedLM.from_hf(model)
    call, (passes,) = cases(lm, ids, completion, loss_mask)["one_step"]
    ref = row_alone(model, name, ids, attention_mask, passes)
    attended = row_alone(model, name, ids, torch.ones_like(attention_mask), passes)
    padded_rows = torch.tensor(PADS) > 0
    gap = (attended - ref).abs().amax(-1)
    assert bool((gap[padded_rows] > 100 * TOL_EPS * (1 + ref.abs().max())).all()), gap
