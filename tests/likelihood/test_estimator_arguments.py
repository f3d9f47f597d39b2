"""The per-estimator functions take ``loss_mask`` and ``attention_mask`` as ``estimate_logprob`` does:
positionally after ``completion_mask`` (or by name, as before), with the same result either way."""
import pytest
import torch
from tiny_models import tiny_masked_lm

from daca_kernels.likelihood import coupled_logprob, elbo_samples, one_step_logprob, stratified_logprob

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")

CASES = {
    "one_step": (one_step_logprob, dict(seed=3)),
    "stratified": (stratified_logprob, dict(seed=3, num_strata=2)),
    "coupled": (coupled_logprob, dict(seed=3)),
    "elbo": (elbo_samples, dict(seed=3, num_samples=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_masks_positionally_or_by_name(name):
    fn, settings = CASES[name]
    lm = tiny_masked_lm(seed=4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.mask_id, (2, 9), generator=g)
    completion = torch.zeros(2, 9, dtype=torch.bool)
    completion[:, 4:] = True
    loss_mask = completion.clone()
    loss_mask[1, 7:] = False
    attention = torch.ones(2, 9, dtype=torch.long)
    attention[0, 0] = 0
    positional = fn(lm, ids, completion, loss_mask, attention, **settings)
    by_name = fn(lm, ids, completion, loss_mask=loss_mask, attention_mask=attention, **settings)
    if name == "elbo":  # ElboSamples: every tensor of it
        positional, by_name = [(positional.logprob, positional.mask, positional.t),
                               (by_name.logprob, by_name.mask, by_name.t)]
    else:
        positional, by_name = [(positional,), (by_name,)]
    for a, b in zip(positional, by_name):
        assert torch.equal(a, b)  # the same call replayed: exact
