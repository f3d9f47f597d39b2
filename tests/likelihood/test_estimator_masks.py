"""``estimator_masks``: every estimator's forward passes through the public API, so that an estimate can be
rebuilt outside the library. Here on bidirectional models (the block families' rebuild, block by block, is in
tests/released/test_block_families.py): each pass's masked input through plain ``model(...)`` logits,
``log_softmax`` and a gather, weighted and summed, equals ``estimate_logprob``; and the passes are those of the
mask functions each estimator is documented to use."""
import copy

import pytest
import torch
from tiny_models import MASK_ID, MODELS, VOCAB

from daca_kernels.likelihood import (
    elbo_sample_mask,
    estimate_logprob,
    estimator_masks,
    monte_carlo_masks,
    prompt_positions,
)
from daca_kernels.likelihood.ratio_masks import coupled_split
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops import stratified_mask

SEED = 5
SETTINGS = {
    "one_step": dict(estimator="one_step"),
    "one_step, prompt masking": dict(estimator="one_step", prompt_mask_prob=0.4),
    "stratified": dict(estimator="stratified", num_strata=3, prompt_mask_prob=0.2),
    "coupled": dict(estimator="coupled"),
    "elbo": dict(estimator="elbo", elbo_samples=3, prompt_mask_prob=0.3),
    "elbo, SPG blocks": dict(estimator="elbo", elbo_samples=2, mask_block_length=3, mask_block_choice="spg"),
}

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


def batch():
    """A left-padded batch (pads 0, 2, 5) of 14 columns, the last 8 generated, one answer shorter."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (3, 14), generator=g)
    attention_mask = torch.ones_like(ids)
    for b, pad in enumerate((0, 2, 5)):
        attention_mask[b, :pad] = 0
    completion = torch.zeros(ids.shape, dtype=torch.bool)
    completion[:, 6:] = True
    loss_mask = completion.clone()
    loss_mask[2, -3:] = False
    return ids, attention_mask, completion, loss_mask


def rebuilt(model, shift, ids, attention_mask, passes):
    """``sum_p weight * log_softmax(model(input_ids_p, attention_mask).logits)[target]`` at the scored positions."""
    out = torch.zeros(ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for p in passes:
            logits = model(input_ids=p.input_ids, attention_mask=attention_mask).logits.double()
            if shift:  # position i - 1 predicts token i
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
            out += torch.where(p.scored, p.weight * logp, 0.0)
    return out


# The library's own bidirectional model on every transformers version; transformers' Llama and Qwen3 where
# is_causal=False is honoured (tiny_models.MODELS holds them only there).
@pytest.mark.parametrize("model_name", ["bidirectional", "bidirectional-tied-shift"]
                         + [name for name in ("llama", "qwen3-tied-shift") if name in MODELS])
def test_an_estimate_is_rebuilt_from_its_masks_with_plain_model_calls(model_name):
    build, shift = MODELS[model_name]
    model = build().eval()
    model64 = copy.deepcopy(model).double()
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID, shift=shift)
    ids, attention_mask, completion, loss_mask = batch()
    for what, settings in SETTINGS.items():
        masks = estimator_masks(ids, completion, loss_mask, attention_mask, seed=SEED, mask_id=MASK_ID, **settings)
        assert masks.blocks is None
        with torch.no_grad():
            got = estimate_logprob(lm, ids, completion, loss_mask, attention_mask, seed=SEED, **settings).double()
        plain = rebuilt(model, shift, ids, attention_mask, masks.passes)
        ref = rebuilt(model64, shift, ids, attention_mask, masks.passes)
        covered = torch.stack([p.scored for p in masks.passes]).any(0)
        assert int(covered.sum()) >= 6 and not bool((covered & ~loss_mask).any()), what
        assert bool((got[covered] != 0).all()) and not bool(got[~covered].any()), what
        # Norm-wise (a quantity accumulated through a model): no worse than plain float32, up to its rounding.
        allowed = (plain - ref).norm() + 1e3 * torch.finfo(torch.float32).eps * (1 + ref.norm())
        assert (got - ref).norm() <= allowed, f"{model_name} {what}"


def test_the_passes_are_the_documented_masks():
    ids, attention_mask, completion, loss_mask = batch()
    prompt = prompt_positions(completion, attention_mask)
    common = dict(seed=SEED, mask_id=MASK_ID)
    strata = estimator_masks(ids, completion, loss_mask, attention_mask, estimator="stratified", num_strata=3,
                             prompt_mask_prob=0.2, **common)
    want = stratified_mask(ids, completion, 3, SEED, MASK_ID, prompt=prompt, prompt_mask_prob=0.2)
    drawn = monte_carlo_masks(ids, completion, loss_mask, attention_mask, estimator="stratified", num_strata=3,
                              **common)
    for k, p in enumerate(strata.passes):
        assert torch.equal(p.input_ids, want.input_ids[k]) and torch.equal(p.scored, (want.strata == k) & loss_mask)
        assert torch.equal(p.context_ids, torch.where(p.scored, ids, p.input_ids))
        assert torch.equal(p.weight, p.scored.double()) and torch.equal(p.scored, drawn[k].scored)
    coupled = estimator_masks(ids, completion, loss_mask, attention_mask, estimator="coupled", **common)
    split = coupled_split(completion, SEED)
    for k, p in enumerate(coupled.passes):
        assert torch.equal(p.input_ids, ids.masked_fill(split.strata == k, MASK_ID))
        assert torch.equal(p.weight, torch.where(p.scored, split.weights, 0.0))
    elbo = estimator_masks(ids, completion, loss_mask, attention_mask, estimator="elbo", elbo_samples=2,
                           prompt_mask_prob=0.3, **common)
    samples = monte_carlo_masks(ids, completion, loss_mask, attention_mask, estimator="elbo", elbo_samples=2,
                                prompt_mask_prob=0.3, **common)
    for j, (p, sample) in enumerate(zip(elbo.passes, samples)):
        mask = elbo_sample_mask(completion, seed=SEED, index=j, num_samples=2, loss_mask=loss_mask,
                                prompt_mask_prob=0.3, prompt=prompt)
        assert torch.equal(p.input_ids, ids.masked_fill(mask.masked, MASK_ID)) and torch.equal(p.scored, sample.scored)
        torch.testing.assert_close(p.weight, torch.where(p.scored, 1 / (2 * sample.t[:, None]), 0.0), rtol=0, atol=0)


def test_bad_input_is_refused_by_name():
    ids, attention_mask, completion, loss_mask = batch()
    common = dict(seed=SEED, mask_id=MASK_ID)
    cases = [
        (dict(estimator="nope"), ValueError, "^estimator"),
        (dict(estimator=1), TypeError, "^estimator"),
        (dict(estimator="one_step", attention=("block", 0)), ValueError, "^attention"),
        (dict(estimator="elbo", attention=("block", 4), mask_block_length=2), ValueError, "^mask_block_length"),
        (dict(estimator="stratified", num_strata=0), ValueError, "^num_strata"),
    ]
    for extra, error, match in cases:
        with pytest.raises(error, match=match):
            estimator_masks(ids, completion, loss_mask, attention_mask, **{**common, **extra})
    with pytest.raises(ValueError, match="^loss_mask must be a subset of completion_mask"):
        estimator_masks(ids, completion, loss_mask | ~completion, attention_mask, estimator="one_step", **common)
    with pytest.raises(ValueError, match="^mask_id"):
        estimator_masks(ids, completion, loss_mask, attention_mask, estimator="one_step", seed=0, mask_id=-1)
