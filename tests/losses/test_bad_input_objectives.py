"""Bad input to the objectives' helpers, the estimators' entry points and the model adapter: a
clear error naming the argument (TypeError for a type or dtype, ValueError for a shape, value or
device), inputs left untouched, and no silently wrong number where a value cannot be checked."""
import inspect

import pytest
import torch
from support import assert_unchanged, snapshot

from daca_kernels import MaskedLM, elbo_sample_scores, eubo_scores, k3_kl, spg_loss
from daca_kernels.likelihood import estimate_logprob, monte_carlo_masks, prompt_positions

VOCAB, HIDDEN, MASK_ID = 11, 4, 10
RATIO_MESSAGE = r"mask_ratios must lie in \(0, 1\] \(0 only for a sample that masks nothing\), got mask_ratios\[1, 2\] = "


def make_samples(dtype=torch.float64):
    """Three samples of four sequences: sample 1 masks tokens of row 2 (whose t the cases spoil),
    sample 0 masks nothing of row 0 and says t = 0 (valid)."""
    g = torch.Generator().manual_seed(0)
    logp = -(torch.rand(3, 4, 5, generator=g, dtype=torch.float64) * 3 + 0.05)
    masks = torch.rand(3, 4, 5, generator=g) < 0.5
    masks[1, 2, :2] = True
    masks[0, 0] = False
    ratios = masks.double().mean(-1).clamp(min=0.2)
    ratios[0, 0] = 0.0
    completion = torch.ones(4, 5, dtype=torch.bool)
    advantages = torch.tensor([0.5, -0.4, -0.8, 0.3], dtype=torch.float64)
    cast = [t.to(dtype) for t in (logp, ratios, advantages)]
    return cast[0].requires_grad_(), masks, cast[1], completion, cast[2]


def spoiled(ratios, value):
    out = ratios.clone()
    out[1, 2] = value
    return out


BAD_RATIOS = {"negative": -0.25, "NaN": float("nan"), "zero for a sample that masks tokens": 0.0, "above one": 1.5}


@pytest.mark.parametrize("case", list(BAD_RATIOS))
def test_elbo_sample_scores_refuses_a_mask_ratio_outside_its_range(case):
    logp, masks, ratios, _, _ = make_samples()
    bad = spoiled(ratios, BAD_RATIOS[case])
    before = snapshot(logp, masks, bad)
    with pytest.raises(ValueError, match=RATIO_MESSAGE):
        elbo_sample_scores(logp, masks, bad)
    with pytest.raises(ValueError, match=r"mask_ratios must lie in \(0, 1\].*got mask_ratios\[2\] = "):
        elbo_sample_scores(logp[1], masks[1], bad[1])  # one sample, [B, L]
    assert_unchanged(before, logp, masks, bad)
    # The valid t = 0 of a sample that masks nothing still scores 0.
    assert elbo_sample_scores(logp, masks, ratios)[0, 0].item() == 0.0


@pytest.mark.parametrize("case", list(BAD_RATIOS))
def test_spg_loss_and_eubo_scores_refuse_a_mask_ratio_outside_its_range(case):
    logp, masks, ratios, completion, advantages = make_samples()
    bad = spoiled(ratios, BAD_RATIOS[case])
    before = snapshot(logp, masks, bad, completion, advantages)
    for negative_bound in ("eubo", "mix", "elbo"):
        with pytest.raises(ValueError, match=RATIO_MESSAGE):
            spg_loss(logp, masks, bad, completion, advantages, negative_bound=negative_bound)
    with pytest.raises(ValueError, match=RATIO_MESSAGE):
        eubo_scores(logp, masks, bad, 1.5, completion_mask=completion)
    with pytest.raises(ValueError, match=RATIO_MESSAGE):
        eubo_scores(logp, masks, bad, 1.0, uncovered="zero")
    assert_unchanged(before, logp, masks, bad, completion, advantages)


def test_a_mask_ratio_that_cannot_be_checked_under_compile_gives_nan():
    """Under torch.compile the ratios are not read: a bad one makes its sample's score, its row's
    upper bound and so the loss NaN (value and gradient) instead of a finite wrong number. t = 1.5
    would give finite numbers (1 / t, log t) if it were not caught."""
    torch._dynamo.reset()
    logp, masks, ratios, completion, advantages = make_samples(torch.float32)
    bad = spoiled(ratios, 1.5)
    assert advantages[2] < 0, "row 2 scores with the upper bound"

    def scores(lp, t):
        return elbo_sample_scores(lp, masks, t)

    def loss(lp, t):
        return spg_loss(lp, masks, t, completion, advantages, negative_bound="eubo")[0]

    compiled_scores = torch.compile(scores, fullgraph=True, backend="aot_eager")
    compiled_loss = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled_scores(logp, bad)
    assert torch.isnan(got[1, 2]) and torch.isfinite(got[[0, 2]]).all()
    torch.testing.assert_close(got[0], scores(logp, ratios)[0])
    (grad,) = torch.autograd.grad(got[1, 2], logp)
    assert torch.isnan(grad[1, 2, :2]).all(), "the gradient is NaN too"
    assert torch.isnan(compiled_loss(logp, bad))
    torch.testing.assert_close(compiled_loss(logp, ratios), loss(logp, ratios))


def test_spg_loss_documents_its_default_bound_and_the_trainers():
    default = inspect.signature(spg_loss).parameters["negative_bound"].default
    assert default == "eubo"
    assert '``"eubo"`` (the default' in spg_loss.__doc__
    assert 'default to ``"mix"`` instead' in spg_loss.__doc__
    pytest.importorskip("trl")
    from daca_kernels.trl import DiffusionGRPOConfig

    assert DiffusionGRPOConfig.__dataclass_fields__["spg_bound"].default == "mix"


K3_CASES = {
    "ref not a tensor": (lambda r, p: (r.tolist(), p), TypeError, "ref_logp must be a torch.Tensor, got list"),
    "integer ref": (lambda r, p: (r.long(), p), TypeError, "ref_logp must have dtype"),
    "logp not a tensor": (lambda r, p: (r, 0.5), TypeError, "logp must be a torch.Tensor, got float"),
    "integer logp": (lambda r, p: (r, p.long()), TypeError, "logp must have dtype"),
    "shape": (lambda r, p: (r, p[:, :2]), ValueError, r"logp must have shape of ref_logp = \(3, 4\), got \(3, 2\)"),
    "broadcastable shape": (lambda r, p: (r, p[:1]), ValueError, r"logp must have shape of ref_logp"),
    "device": (lambda r, p: (r, p.to("meta")), ValueError, "logp is on meta but ref_logp is on cpu"),
}


@pytest.mark.parametrize("case", list(K3_CASES))
def test_k3_kl_rejects(case):
    make, error, message = K3_CASES[case]
    g = torch.Generator().manual_seed(1)
    ref_logp, logp = -torch.rand(3, 4, generator=g), -torch.rand(3, 4, generator=g)
    before = snapshot(ref_logp, logp)
    with pytest.raises(error, match=message):
        k3_kl(*make(ref_logp, logp))
    assert_unchanged(before, ref_logp, logp)
    delta = ref_logp - logp
    torch.testing.assert_close(k3_kl(ref_logp, logp), torch.exp(delta) - delta - 1, rtol=0, atol=0)


def embedding_lm(**overrides):
    """A MaskedLM whose hidden states are an embedding lookup (no transformers model)."""
    g = torch.Generator().manual_seed(2)
    embedding = torch.randn(VOCAB, HIDDEN, generator=g)
    args = dict(hidden_fn=lambda ids, mask: embedding[ids], head_weight=torch.randn(VOCAB, HIDDEN, generator=g),
                head_bias=torch.randn(VOCAB, generator=g), mask_id=MASK_ID)
    args.update(overrides)
    return MaskedLM(**args)


WEIGHT = torch.zeros(VOCAB, HIDDEN)
MASKED_LM_CASES = {
    "shift as a string": ({"shift": "False"}, TypeError, "shift must be a bool, got str"),
    "shift as an int": ({"shift": 1}, TypeError, "shift must be a bool, got int"),
    "shift as a tensor": ({"shift": torch.tensor(True)}, TypeError, "shift must be a bool, got Tensor"),
    "head weight as a list": ({"head_weight": WEIGHT.tolist()}, TypeError, "head_weight must be a torch.Tensor, got list"),
    "integer head weight": ({"head_weight": WEIGHT.long()}, TypeError, "head_weight must have dtype"),
    "1-D head weight": ({"head_weight": WEIGHT[:, 0]}, ValueError, "head_weight must be 2-D"),
    "empty vocabulary": ({"head_weight": WEIGHT[:0], "mask_id": 0}, ValueError, r"head_weight must have at least one row"),
    "head bias as a list": ({"head_bias": [0.0] * VOCAB}, TypeError, "head_bias must be a torch.Tensor, got list"),
    "head bias shape": ({"head_bias": torch.zeros(VOCAB + 1)}, ValueError, r"head_bias must have shape \[V\] \(from head_weight\) = \(11,\)"),
    "2-D head bias": ({"head_bias": torch.zeros(1, VOCAB)}, ValueError, r"head_bias must have shape \[V\]"),
    "head bias dtype": ({"head_bias": torch.zeros(VOCAB, dtype=torch.float64)}, TypeError, r"head_bias must have dtype in \(float32\)"),
    "head bias device": ({"head_bias": torch.zeros(VOCAB, device="meta")}, ValueError, "head_bias is on meta but head_weight is on cpu"),
    "mask id = V": ({"mask_id": VOCAB}, ValueError, r"mask_id must be in \[0, 11\), got 11"),
    "negative mask id": ({"mask_id": -1}, ValueError, r"mask_id must be in \[0, 11\), got -1"),
    "bool mask id": ({"mask_id": True}, TypeError, "mask_id must be an int, got bool"),
    "float mask id": ({"mask_id": 3.0}, TypeError, "mask_id must be an int, got float"),
    "hidden function": ({"hidden_fn": None}, TypeError, "hidden_fn must be callable, got NoneType"),
    "module": ({"module": "model"}, TypeError, "module must be an nn.Module or None, got str"),
    "zero max length": ({"max_length": 0}, ValueError, "max_length must be >= 1, got 0"),
    "float max length": ({"max_length": 16.0}, TypeError, "max_length must be an int, got float"),
    "bool max length": ({"max_length": True}, TypeError, "max_length must be an int, got bool"),
}


@pytest.mark.parametrize("case", list(MASKED_LM_CASES))
def test_masked_lm_rejects(case):
    overrides, error, message = MASKED_LM_CASES[case]
    with pytest.raises(error, match=message):
        embedding_lm(**overrides)


def test_masked_lm_keeps_valid_arguments():
    lm = embedding_lm(shift=True, head_bias=None, module=torch.nn.Linear(2, 2))
    assert lm.shift is True and lm.head_bias is None and lm.mask_id == MASK_ID and lm.vocab_size == VOCAB
    assert lm.max_length is None and embedding_lm(max_length=7).max_length == 7


def make_batch():
    """Two rows of 7: prompt of 3 (row 1 left-padded by one), completion of 4, answer of 3."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, MASK_ID, (2, 7), generator=g)
    completion = torch.zeros(2, 7, dtype=torch.bool)
    completion[:, 3:] = True
    answer = completion.clone()
    answer[:, -1] = False
    attention = torch.ones(2, 7, dtype=torch.long)
    attention[1, 0] = 0
    return ids, completion, answer, attention


OPTION_CASES = {
    "zero elbo samples": ({"elbo_samples": 0}, ValueError, "elbo_samples must be >= 1, got 0"),
    "float elbo samples": ({"elbo_samples": 2.0}, TypeError, "elbo_samples must be an int, got float"),
    "zero strata": ({"num_strata": 0}, ValueError, "num_strata must be >= 1, got 0"),
    "bool strata": ({"num_strata": True}, TypeError, "num_strata must be an int, got bool"),
    "prompt probability above one": ({"prompt_mask_prob": 1.5}, ValueError, r"prompt_mask_prob must be a finite number in \[0, 1\]"),
    "prompt probability as a string": ({"prompt_mask_prob": "0.1"}, TypeError, "prompt_mask_prob must be a float"),
    "zero block length": ({"mask_block_length": 0}, ValueError, "mask_block_length must be >= 1, got 0"),
    "float block length": ({"mask_block_length": 4.0}, TypeError, "mask_block_length must be an int, got float"),
    "unknown block choice": ({"mask_block_choice": "first"}, ValueError, "mask_block_choice must be one of"),
    "negative seed": ({"seed": -1}, ValueError, r"seed must lie in \[0, 2\*\*64\)"),
    "seed past 64 bits": ({"seed": 2**64}, ValueError, r"seed must lie in \[0, 2\*\*64\)"),
    "float seed": ({"seed": 1.0}, TypeError, "seed must be an int, got float"),
    "negative row offset": ({"row_offset": -1}, ValueError, "row_offset must be >= 0, got -1"),
    "float row offset": ({"row_offset": 0.0}, TypeError, "row_offset must be an int, got float"),
    "estimator name": ({"estimator": "exact"}, ValueError, "estimator must be one of .*, got 'exact'"),
    "estimator type": ({"estimator": None}, TypeError, "estimator must be a str, got NoneType"),
}


@pytest.mark.parametrize("estimator", ["one_step", "coupled", "stratified", "elbo"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_estimate_logprob_checks_every_option_whatever_the_estimator(case, estimator):
    overrides, error, message = OPTION_CASES[case]
    ids, completion, answer, attention = make_batch()
    before = snapshot(ids, completion, answer, attention)
    options = {"estimator": estimator, "seed": 0, **overrides}
    with pytest.raises(error, match=message):
        estimate_logprob(embedding_lm(), ids, completion, answer, attention, **options)
    assert_unchanged(before, ids, completion, answer, attention)


@pytest.mark.parametrize("estimator", ["one_step", "coupled", "stratified", "elbo"])
def test_estimate_logprob_refuses_an_input_past_the_models_max_length(backend, estimator):
    ids, completion, answer, attention = make_batch()  # L = 7
    before = snapshot(ids, completion, answer, attention)
    with pytest.raises(ValueError, match=r"^input_ids: the length L of input_ids \[B, L\] = 7 positions, more than "
                                         r"the model accepts \(lm.max_length = 6"):
        estimate_logprob(embedding_lm(max_length=6), ids, completion, answer, attention, estimator=estimator, seed=0)
    assert_unchanged(before, ids, completion, answer, attention)
    fits = estimate_logprob(embedding_lm(max_length=7), ids, completion, answer, attention, estimator=estimator, seed=0)
    assert fits.isfinite().all() and (fits[answer] < 0).all()


def test_the_entry_points_need_the_attention_mask_named():
    # No default: a left-padded batch cannot be scored without its mask by accident.
    ids, completion, answer, _ = make_batch()
    with pytest.raises(TypeError, match="attention_mask"):
        estimate_logprob(embedding_lm(), ids, completion, answer, estimator="one_step", seed=0)
    with pytest.raises(TypeError, match="attention_mask"):
        monte_carlo_masks(ids, completion, answer, estimator="elbo", seed=0, mask_id=MASK_ID)


@pytest.mark.parametrize("estimator", ["stratified", "elbo"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_monte_carlo_masks_checks_every_option_whatever_the_estimator(case, estimator):
    overrides, error, message = OPTION_CASES[case]
    ids, completion, answer, attention = make_batch()
    before = snapshot(ids, completion, answer, attention)
    options = {"estimator": estimator, "seed": 0, "mask_id": MASK_ID, **overrides}
    with pytest.raises(error, match=message):
        monte_carlo_masks(ids, completion, answer, attention, **options)
    assert_unchanged(before, ids, completion, answer, attention)


OUTSIDE = r"loss_mask must be a subset of completion_mask: loss_mask\[0, 2\] is True but completion_mask\[0, 2\] is False"
MASK_CASES = {
    "loss mask shape": (lambda i, c, a, m: (i, c, a[:, 1:], m), ValueError, r"loss_mask must have shape \[B, L\]"),
    "loss mask rows": (lambda i, c, a, m: (i, c, a[:1], m), ValueError, r"loss_mask must have shape \[B, L\]"),
    "integer loss mask": (lambda i, c, a, m: (i, c, a.long(), m), TypeError, "loss_mask must have dtype"),
    "loss mask not a tensor": (lambda i, c, a, m: (i, c, None, m), TypeError, "loss_mask must be a torch.Tensor"),
    "loss mask device": (lambda i, c, a, m: (i, c, a.to("meta"), m), ValueError, "loss_mask is on meta but input_ids is on cpu"),
    "loss mask outside the completion": (
        lambda i, c, a, m: (i, c, a.index_fill(1, torch.tensor([2]), True), m), ValueError, OUTSIDE,
    ),
    "completion mask shape": (lambda i, c, a, m: (i, c[:, :-1], a, m), ValueError, r"completion_mask must have shape \[B, L\]"),
    "integer completion mask": (lambda i, c, a, m: (i, c.int(), a, m), TypeError, "completion_mask must have dtype"),
    "attention mask shape": (lambda i, c, a, m: (i, c, a, m[:, 1:]), ValueError, r"attention_mask must have shape \[B, L\]"),
    "1-D attention mask": (lambda i, c, a, m: (i, c, a, m[0]), ValueError, "attention_mask must be 2-D"),
    "attention mask device": (lambda i, c, a, m: (i, c, a, m.to("meta")), ValueError, "attention_mask is on meta"),
    "float ids": (lambda i, c, a, m: (i.float(), c, a, m), TypeError, "input_ids must have dtype"),
    "1-D ids": (lambda i, c, a, m: (i[0], c, a, m), ValueError, "input_ids must be 2-D"),
}


@pytest.mark.parametrize("estimator", ["stratified", "elbo"])
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_monte_carlo_masks_checks_its_tensors_on_every_path(case, estimator):
    make, error, message = MASK_CASES[case]
    ids, completion, answer, attention = make_batch()
    before = snapshot(ids, completion, answer, attention)
    with pytest.raises(error, match=message):
        monte_carlo_masks(*make(ids, completion, answer, attention), estimator=estimator, seed=0, mask_id=MASK_ID)
    assert_unchanged(before, ids, completion, answer, attention)


@pytest.mark.parametrize("case", ["negative", "float"])
def test_monte_carlo_masks_checks_mask_id_on_every_path(case):
    value, error = (-1, ValueError) if case == "negative" else (1.5, TypeError)
    ids, completion, answer, attention = make_batch()
    for estimator in ("stratified", "elbo"):
        with pytest.raises(error, match="mask_id must be"):
            monte_carlo_masks(ids, completion, answer, attention, estimator=estimator, seed=0, mask_id=value)


@pytest.mark.parametrize("estimator", ["one_step", "coupled", "sml", 3])
def test_monte_carlo_masks_names_the_estimators_it_supports(estimator):
    ids, completion, answer, attention = make_batch()
    error = TypeError if estimator == 3 else ValueError
    message = "estimator must be a str" if estimator == 3 else (
        f"estimator must be one of stratified, elbo for Monte-Carlo mask samples, got '{estimator}'"
    )
    with pytest.raises(error, match=message):
        monte_carlo_masks(ids, completion, answer, attention, estimator=estimator, seed=0, mask_id=MASK_ID)


def test_monte_carlo_masks_accepts_valid_input_on_both_paths():
    ids, completion, answer, attention = make_batch()
    for estimator, count in (("stratified", 3), ("elbo", 2)):
        samples = monte_carlo_masks(ids, completion, answer, attention, estimator=estimator, seed=4, mask_id=MASK_ID,
                                    num_strata=3, elbo_samples=2)
        assert len(samples) == count
        for sample in samples:
            assert not (sample.scored & ~answer).any()
            assert ((sample.t > 0) & (sample.t <= 1)).all()


PROMPT_CASES = {
    "completion mask not a tensor": (lambda c, m: (c.tolist(), m), TypeError, "completion_mask must be a torch.Tensor"),
    "integer completion mask": (lambda c, m: (c.long(), m), TypeError, "completion_mask must have dtype"),
    "1-D completion mask": (lambda c, m: (c[0], m), ValueError, "completion_mask must be 2-D"),
    "attention mask not a tensor": (lambda c, m: (c, m.tolist()), TypeError, "attention_mask must be a torch.Tensor"),
    "attention mask shape": (lambda c, m: (c, m[:, :3]), ValueError, r"attention_mask must have shape \[B, L\] \(from completion_mask\)"),
    "attention mask rows": (lambda c, m: (c, m[:1]), ValueError, r"attention_mask must have shape \[B, L\]"),
    "3-D attention mask": (lambda c, m: (c, m[None]), ValueError, "attention_mask must be 2-D"),
    "attention mask device": (lambda c, m: (c, m.to("meta")), ValueError, "attention_mask is on meta but completion_mask is on cpu"),
}


@pytest.mark.parametrize("case", list(PROMPT_CASES))
def test_prompt_positions_rejects(case):
    make, error, message = PROMPT_CASES[case]
    _, completion, _, attention = make_batch()
    before = snapshot(completion, attention)
    with pytest.raises(error, match=message):
        prompt_positions(*make(completion, attention))
    assert_unchanged(before, completion, attention)
    want = ~completion & (attention == 1)
    assert torch.equal(prompt_positions(completion, attention), want)
    assert torch.equal(prompt_positions(completion, None), ~completion)
