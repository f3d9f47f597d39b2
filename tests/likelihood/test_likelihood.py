"""The estimators against a direct computation from full logits (``model(...).logits``,
``log_softmax``, gather) on the same masks: values and parameter gradients, on transformers models."""
import copy

import pytest
import torch
from gpu_device import DEVICE
from support import assert_model_gradients_close, assert_no_worse_than_torch, assert_unchanged, snapshot
from tiny_models import MASK_ID, MODELS, VOCAB, bert, bidirectional

from daca_kernels import (
    branch_logprob,
    coupled_logprob,
    elbo_sample,
    elbo_samples,
    masked_logprob,
    one_step_logprob,
    reference,
    stratified_logprob,
    stratified_mask,
)
from daca_kernels.likelihood import elbo_sample_mask, estimate_logprob, masked_passes, monte_carlo_masks
from daca_kernels.likelihood.ratio_masks import block_elbo_mask, coupled_split, elbo_mask
from daca_kernels.models.masked_lm import MaskedLM

SEED = 1234


def make_batch(seed=0, batch=3, length=13):
    """Prompt + completion ids, ragged completions (a row ends early), left padding on one row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (batch, length), generator=g)
    completion = torch.zeros(batch, length, dtype=torch.bool)
    completion[:, 5:] = True
    completion[1, 10:] = False
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[2, :2] = 0
    return ids, completion, attention_mask


def answer_of(completion):
    """The scored answer inside a generated region: rows 0 and 2 end two tokens early (the padding
    after their EOS stays in the region), row 1 uses all of it."""
    answer = completion.clone()
    last = completion.shape[1] - 1
    answer[0, last - 1:] = False
    answer[2, last - 1:] = False
    assert answer.any(1).all() and not torch.equal(answer, completion)
    return answer


def full_logits_fn(model, attention_mask):
    return lambda ids: model(input_ids=ids, attention_mask=attention_mask).logits


def copies_of(ids, strata, num_copies):
    return torch.stack([ids.masked_fill(strata == k, MASK_ID) for k in range(num_copies)])


def stratified_masks(ids, completion, num_strata, scored=None, **kw):
    """The SML copies of the generated region; positions outside ``scored`` (default: all) not read."""
    masks = stratified_mask(ids, completion, num_strata, SEED, MASK_ID, **kw)
    strata = masks.strata if scored is None else torch.where(scored, masks.strata, -1)
    return masks.input_ids, strata, None


def one_step_masks(ids, completion, prompt_mask_prob):
    if prompt_mask_prob == 0:
        # Built independently of stratified_mask: the whole completion masked.
        return ids.masked_fill(completion, MASK_ID)[None], torch.where(completion, 0, -1), None
    return stratified_masks(ids, completion, 1, prompt_mask_prob=prompt_mask_prob)


def coupled_masks(ids, completion, scored):
    split = coupled_split(completion, SEED)
    return copies_of(ids, split.strata, 2), torch.where(scored, split.strata, -1), split.weights


def elbo_masks(ids, completion, answer, index, num_samples):
    """SPG's regions by hand: the ratio mask drawn over the answer, the padding after it masked."""
    mask, _ = elbo_mask(answer, SEED, index, num_samples)
    return ids.masked_fill(mask | (completion & ~answer), MASK_ID)[None], torch.where(mask, 0, -1), None


def spg_block_masks(ids, completion, answer, index, num_samples, block_length, prompt_mask_prob):
    """SPG's scoring set read off the model input: every masked answer position."""
    masked = elbo_sample_mask(completion, seed=SEED, index=index, num_samples=num_samples, loss_mask=answer,
                              block_length=block_length, prompt_mask_prob=prompt_mask_prob).masked
    scored = masked & answer
    assert (masked & completion & ~answer).sum() == (completion & ~answer).sum(), "the padding is always masked"
    assert scored.sum() > block_elbo_mask(answer, SEED, index, num_samples, block_length).scored.sum(), (
        "SPG also scores later blocks"
    )
    return ids.masked_fill(masked, MASK_ID)[None], torch.where(scored, 0, -1), None


def input_and_scored(completion):
    """A model-input mask reaching into the prompt (column 0 of row 0 included) and a strict
    subset of its completion positions to score."""
    mask = completion.clone()
    mask[:, [1, 3]] = True
    mask[0, 0] = True
    scored = completion & (torch.arange(completion.shape[1], device=completion.device) % 3 != 0)
    assert scored.any() and not torch.equal(scored, completion)
    return mask, scored


def masked_logprob_masks(ids, completion):
    mask, scored = input_and_scored(completion)
    return ids.masked_fill(mask, MASK_ID)[None], torch.where(scored, 0, -1), None


# name -> (fused estimator, the masks it must use); each returns per-token [B, L].
ESTIMATORS = {
    "one_step": (
        lambda lm, ids, c, am: one_step_logprob(lm, ids, c, seed=SEED, attention_mask=am),
        lambda ids, c: one_step_masks(ids, c, 0.0),
    ),
    "one_step_prompt_masking": (
        lambda lm, ids, c, am: one_step_logprob(lm, ids, c, seed=SEED, prompt_mask_prob=0.3, attention_mask=am),
        lambda ids, c: one_step_masks(ids, c, 0.3),
    ),
    "stratified_k3_answer": (
        lambda lm, ids, c, am: stratified_logprob(lm, ids, c, num_strata=3, seed=SEED, attention_mask=am, loss_mask=answer_of(c)),
        lambda ids, c: stratified_masks(ids, c, 3, scored=answer_of(c)),
    ),
    "stratified_interleave_prompt": (
        lambda lm, ids, c, am: stratified_logprob(
            lm, ids, c, num_strata=2, seed=SEED, scheme="interleave", prompt_mask_prob=0.15, attention_mask=am
        ),
        lambda ids, c: stratified_masks(ids, c, 2, scheme="interleave", prompt_mask_prob=0.15),
    ),
    "coupled_answer": (
        lambda lm, ids, c, am: coupled_logprob(lm, ids, c, seed=SEED, attention_mask=am, loss_mask=answer_of(c)),
        lambda ids, c: coupled_masks(ids, c, answer_of(c)),
    ),
    "elbo_sample_1_of_3_answer": (
        lambda lm, ids, c, am: elbo_sample(
            lm, ids, c, seed=SEED, index=1, num_samples=3, attention_mask=am, loss_mask=answer_of(c)
        ).logprob,
        lambda ids, c: elbo_masks(ids, c, answer_of(c), 1, 3),
    ),
    "masked_logprob_subset": (
        lambda lm, ids, c, am: masked_logprob(
            lm, ids, input_and_scored(c)[0], loss_mask=input_and_scored(c)[1], attention_mask=am
        ),
        masked_logprob_masks,
    ),
    "elbo_sample_spg_blocks_of_3": (
        lambda lm, ids, c, am: elbo_sample(
            lm, ids, c, seed=SEED, index=0, num_samples=2, block_length=3, attention_mask=am, loss_mask=answer_of(c),
            prompt_mask_prob=0.4,
        ).logprob,
        lambda ids, c: spg_block_masks(ids, c, answer_of(c), 0, 2, 3, 0.4),
    ),
}


def values_and_grads(fn, model, upstream):
    model.zero_grad(set_to_none=True)
    out = fn(model)
    (out * upstream.to(out.dtype)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


# Every estimator on every model through the chunked torch head; the Triton head (interpreter,
# slower) on the library's bidirectional model.
CASES = [("torch", m, e) for m in MODELS for e in ESTIMATORS] + [("triton", "bidirectional", e) for e in ESTIMATORS]


def fused_plain_and_reference(backend_name, model_name, estimator, monkeypatch):
    """Values and parameter gradients of the fused estimator, of the direct computation from full
    logits on the same masks in float32 (plain) and in float64 (the reference)."""
    monkeypatch.setenv("DACA_BACKEND", backend_name)
    build, shift = MODELS[model_name]
    model = build()
    model64 = copy.deepcopy(model).double()
    ids, completion, attention_mask = make_batch(seed=len(model_name))
    fused_fn, masks_fn = ESTIMATORS[estimator]
    copies, strata, weights = masks_fn(ids, completion)
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    before = snapshot(ids, completion, attention_mask)

    fused = values_and_grads(
        lambda m: fused_fn(MaskedLM.from_hf(m, mask_id=MASK_ID, shift=shift), ids, completion, attention_mask), model, upstream
    )
    assert_unchanged(before, ids, completion, attention_mask)

    def direct(m):
        return reference.masked_copies_logprob(full_logits_fn(m, attention_mask), ids, copies, strata, weights, shift=shift)

    plain = values_and_grads(direct, model, upstream)
    ref = values_and_grads(direct, model64, upstream.double())
    return fused, plain, ref, completion, strata


@pytest.mark.parametrize("backend_name,model_name,estimator", CASES)
def test_estimator_matches_full_logits(monkeypatch, backend_name, model_name, estimator):
    fused, plain, ref, completion, strata = fused_plain_and_reference(backend_name, model_name, estimator, monkeypatch)
    assert fused[0].dtype == torch.float32
    assert (fused[0][~completion] == 0).all(), "0 outside the completion"
    assert (fused[0][strata >= 0] != 0).all()
    assert_no_worse_than_torch(fused[0], plain[0], ref[0], 1e-5 * (1 + ref[0].abs()), "logprob")
    # Gradients summed through the whole model: norm-wise per parameter (tests/support.py says why).
    assert_model_gradients_close(fused[1], ref[1], plain[1])
    assert any(g.abs().sum() > 0 for n, g in fused[1].items() if "layers.0." in n), "no gradient reached the backbone"


def test_the_gradient_rule_catches_a_planted_error_of_one_part_in_a_thousand(monkeypatch):
    fused, plain, ref, _, _ = fused_plain_and_reference("torch", "bidirectional-biased-head", "stratified_interleave_prompt", monkeypatch)
    assert_model_gradients_close(fused[1], ref[1], plain[1])
    planted = [name for name, g in ref[1].items() if g.abs().sum() > 0]
    assert len(planted) > 10 and any(ref[1][n].dim() == 1 for n in planted), "biases and norms included"
    for name in planted:
        wrong = {**fused[1], name: fused[1][name] * (1 + 1e-3)}
        with pytest.raises(AssertionError, match=f"d {name}: "):
            assert_model_gradients_close(wrong, ref[1], plain[1])
        wrong = {**fused[1], name: fused[1][name] + 1e-3 * fused[1][name].norm() * _unit_at_largest(fused[1][name])}
        with pytest.raises(AssertionError, match=f"d {name}: "):
            assert_model_gradients_close(wrong, ref[1], plain[1])


def _unit_at_largest(g):
    """A tensor of g's shape with a single 1 where |g| is largest (an error in one element)."""
    unit = torch.zeros_like(g).flatten()
    unit[g.abs().argmax()] = 1
    return unit.view_as(g)


@pytest.fixture(scope="module")
def tiny_lm():
    model = bidirectional(tied=False, seed=1)
    return MaskedLM.from_hf(model, mask_id=MASK_ID)


def test_one_stratum_is_the_one_step_estimator(backend, tiny_lm):
    ids, completion, am = make_batch(seed=4)
    for seed in (0, 7):
        sml = stratified_logprob(tiny_lm, ids, completion, num_strata=1, seed=seed, attention_mask=am)
        one = one_step_logprob(tiny_lm, ids, completion, seed=99, attention_mask=am)
        assert torch.equal(sml, one)


def test_head_sees_each_completion_row_once_and_empty_strata_cost_nothing(monkeypatch, tiny_lm):
    ids, completion, am = make_batch(seed=5)
    completion[:, 8:] = False  # at most 3 completion tokens per row
    head_rows, forwards = [], []
    real_linear = masked_passes.linear_logprob_unchecked
    monkeypatch.setattr(masked_passes, "linear_logprob_unchecked", lambda h, *a, **k: head_rows.append(h.shape[0]) or real_linear(h, *a, **k))
    real_hidden = tiny_lm._hidden_fn
    monkeypatch.setattr(tiny_lm, "_hidden_fn", lambda *a: forwards.append(1) or real_hidden(*a))
    out = stratified_logprob(tiny_lm, ids, completion, num_strata=6, seed=SEED, attention_mask=am)
    masks = stratified_mask(ids, completion, 6, SEED, MASK_ID)
    used = int((torch.bincount(masks.strata[completion], minlength=6) > 0).sum())
    assert used == 3 and len(forwards) == used, "a stratum no row uses must not cost a forward pass"
    assert sum(head_rows) == int(completion.sum()), "the head must see each completion row exactly once"
    direct = reference.masked_copies_logprob(
        full_logits_fn(tiny_lm.module, am), ids, masks.input_ids, masks.strata
    )
    torch.testing.assert_close(out, direct.detach(), rtol=1e-5, atol=1e-5)
    answer = completion & (torch.arange(ids.shape[1]) < 7)
    head_rows.clear()
    scored = stratified_logprob(tiny_lm, ids, completion, num_strata=6, seed=SEED, attention_mask=am, loss_mask=answer)
    assert sum(head_rows) == int(answer.sum()) < int(completion.sum()), "only the scored rows reach the head"
    torch.testing.assert_close(scored, torch.where(answer, out, 0.0), rtol=1e-6, atol=1e-6)


def test_a_loss_mask_scores_a_subset_of_the_same_masked_passes(monkeypatch, tiny_lm):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    ids, completion, am = make_batch(seed=20)
    answer = answer_of(completion)
    estimators = {
        "one_step": lambda loss: one_step_logprob(
            tiny_lm, ids, completion, seed=3, prompt_mask_prob=0.3, attention_mask=am, loss_mask=loss
        ),
        "coupled": lambda loss: coupled_logprob(tiny_lm, ids, completion, seed=3, attention_mask=am, loss_mask=loss),
    }
    with torch.no_grad():
        for name, estimate in estimators.items():
            whole, part = estimate(None), estimate(answer)
            assert ((part != 0) == answer).all(), name
            torch.testing.assert_close(part, torch.where(answer, whole, 0.0), rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("estimator", ["stratified", "coupled"])
def test_checkpointed_passes_give_the_same_values_and_gradients(estimator, tiny_lm):
    ids, completion, am = make_batch(seed=6)
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))

    def run(checkpoint):
        if estimator == "stratified":
            return stratified_logprob(tiny_lm, ids, completion, num_strata=3, seed=2, attention_mask=am, checkpoint=checkpoint)
        return coupled_logprob(tiny_lm, ids, completion, seed=2, attention_mask=am, checkpoint=checkpoint)

    plain = values_and_grads(lambda m: run(False), tiny_lm.module, upstream)
    checkpointed = values_and_grads(lambda m: run(True), tiny_lm.module, upstream)
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
    assert_model_gradients_close(checkpointed[1], plain[1])


def test_coupled_split_and_its_weights():
    _, completion, _ = make_batch(seed=7, batch=16, length=20)
    completion[3] = False
    completion[4] = False
    completion[4, 9] = True  # a one-token completion
    split = coupled_split(completion, 11, (0.2, 0.8))
    n = completion.sum(1)
    first, second = (split.strata == 0).sum(1), (split.strata == 1).sum(1)
    assert ((split.strata >= 0) == completion).all() and torch.equal(first + second, n)
    two = n >= 2
    assert ((first >= 1) & (second >= 1))[two].all(), "both masks non-empty when n >= 2"
    assert split.t.dtype == torch.float64 and torch.equal(split.t, first.double() / n.clamp(min=1))
    assert first[4] == 1 and second[4] == 0
    w = split.weights
    for b in range(16):
        if n[b] >= 2:
            assert torch.allclose(w[b][split.strata[b] == 0], 1 / (2 * split.t[b]))
            assert torch.allclose(w[b][split.strata[b] == 1], 1 / (2 * (1 - split.t[b])))
        elif n[b] == 1:
            assert w[b][completion[b]].item() == 1.0
    assert (w[~completion] == 0).all()
    assert not torch.equal(split.strata, coupled_split(completion, 12, (0.2, 0.8)).strata)


def test_coupled_at_one_half_is_sml_with_two_strata_on_that_split(tiny_lm):
    ids, _, am = make_batch(seed=8, length=14)
    completion = torch.zeros_like(ids, dtype=torch.bool)
    completion[:, 4:] = True  # n = 10: m = 5 exactly at t = 1/2
    completion[2, 12:] = False  # n = 8
    split = coupled_split(completion, 5, (0.5, 0.5))
    assert (split.weights[completion] == 1).all()
    out = coupled_logprob(tiny_lm, ids, completion, seed=5, t_range=(0.5, 0.5), attention_mask=am)
    sml_on_split = reference.masked_copies_logprob(
        full_logits_fn(tiny_lm.module, am), ids, copies_of(ids, split.strata, 2), split.strata
    )
    torch.testing.assert_close(out, sml_on_split.detach(), rtol=1e-5, atol=1e-5)


def test_diffucoder_estimate_is_coupled_plus_half_the_one_step_pass(tiny_lm):
    """DiffuCoder's coupled-GRPO, built by hand on this library's split: three passes (the whole
    generated region masked, the first mask, its complement) and per token
    ``(p_full + w * p_pair) / 2`` with ``w = 1 / t`` on the first mask and ``1 / (1 - t)`` on the
    second. That is ``coupled_logprob + one_step_logprob / 2``, not their sum."""
    ids, completion, am = make_batch(seed=21, length=14)
    answer = answer_of(completion)
    seed = 6
    split = coupled_split(completion, seed)
    assert (completion.sum(1) >= 2).all(), "both masks non-empty in every row"

    def logp_of(masked):
        logits = tiny_lm.module(input_ids=ids.masked_fill(masked, MASK_ID), attention_mask=am).logits
        return torch.log_softmax(logits.double(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)

    with torch.no_grad():
        full, first, second = logp_of(completion), logp_of(split.strata == 0), logp_of(split.strata == 1)
        t = split.t[:, None]
        pair = torch.where(split.strata == 0, first / t, second / (1 - t))
        want = torch.where(answer, (full + pair) / 2, 0.0)
        coupled = coupled_logprob(tiny_lm, ids, completion, seed=seed, attention_mask=am, loss_mask=answer)
        one_step = one_step_logprob(tiny_lm, ids, completion, seed=seed, attention_mask=am, loss_mask=answer)
    torch.testing.assert_close((coupled + one_step / 2).double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose((coupled + one_step).double(), want, rtol=1e-2, atol=1e-2)


def test_elbo_samples_masks_ratios_and_weighting(tiny_lm):
    ids, completion, am = make_batch(seed=9, length=12)
    completion[:, 5:] = True
    completion[1, 9:] = False  # n = 4 on row 1, 7 elsewhere
    n = completion.sum(1)
    samples = elbo_samples(tiny_lm, ids, completion, num_samples=7, seed=3, attention_mask=am)
    assert samples.logprob.shape == samples.mask.shape == (7, 3, 12) and samples.t.shape == (7, 3)
    counts = samples.mask.sum(-1)
    assert (counts >= 1).all() and (counts <= n).all() and not (samples.mask & ~completion).any()
    torch.testing.assert_close(samples.t, (counts / n).float())
    for b in (0, 2):  # 7 samples over 7 tokens: the stratified ratios hit every count once
        assert sorted(counts[:, b].tolist()) == list(range(1, 8))
    assert ((samples.logprob != 0) == samples.mask).all()
    torch.testing.assert_close(samples.elbo(), samples.logprob.sum(-1) / samples.t)
    for j in (0, 4):
        single = elbo_sample(tiny_lm, ids, completion, seed=3, index=j, num_samples=7, attention_mask=am)
        assert torch.equal(single.mask, samples.mask[j]) and torch.equal(single.logprob, samples.logprob[j])
        assert torch.equal(single.elbo(), samples.elbo()[j])


def test_elbo_sample_by_sample_backward_equals_the_stacked_gradient(tiny_lm):
    ids, completion, am = make_batch(seed=10)
    params = list(tiny_lm.module.parameters())
    stacked = elbo_samples(tiny_lm, ids, completion, num_samples=3, seed=4, attention_mask=am).elbo().sum()
    expected = torch.autograd.grad(stacked, params)
    tiny_lm.module.zero_grad(set_to_none=True)
    for j in range(3):
        elbo_sample(tiny_lm, ids, completion, seed=4, index=j, num_samples=3, attention_mask=am).elbo().sum().backward()
    assert_model_gradients_close([p.grad for p in params], expected)
    tiny_lm.module.zero_grad(set_to_none=True)


def test_rows_without_completion_and_empty_batches(tiny_lm):
    ids, completion, am = make_batch(seed=14)
    completion[1] = False
    per_token = {
        "one_step": lambda i, c, a: one_step_logprob(tiny_lm, i, c, seed=1, prompt_mask_prob=0.2, attention_mask=a),
        "stratified": lambda i, c, a: stratified_logprob(tiny_lm, i, c, num_strata=3, seed=1, attention_mask=a),
        "coupled": lambda i, c, a: coupled_logprob(tiny_lm, i, c, seed=1, attention_mask=a),
        "elbo": lambda i, c, a: elbo_sample(tiny_lm, i, c, seed=1, index=1, num_samples=2, attention_mask=a).logprob,
    }
    for name, estimate in per_token.items():
        out = estimate(ids, completion, am)
        assert torch.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).any(), name
        assert estimate(ids[:0], completion[:0], am[:0]).shape == (0, ids.shape[1]), name
    samples = elbo_samples(tiny_lm, ids, completion, num_samples=2, seed=1, attention_mask=am)
    assert (samples.t[:, 1] == 1).all() and (samples.elbo()[:, 1] == 0).all()


# name -> estimator(lm, ids, completion, attention_mask, seed, row_offset): values with rows at dim -2.
SHARDABLE = {
    "one_step_prompt_masking": lambda lm, i, c, a, seed, off: one_step_logprob(
        lm, i, c, seed=seed, prompt_mask_prob=0.3, attention_mask=a, row_offset=off
    ),
    "stratified_k3": lambda lm, i, c, a, seed, off: stratified_logprob(
        lm, i, c, num_strata=3, seed=seed, attention_mask=a, row_offset=off
    ),
    "stratified_interleave_prompt": lambda lm, i, c, a, seed, off: stratified_logprob(
        lm, i, c, num_strata=2, seed=seed, scheme="interleave", prompt_mask_prob=0.2, attention_mask=a, row_offset=off
    ),
    "coupled": lambda lm, i, c, a, seed, off: coupled_logprob(lm, i, c, seed=seed, attention_mask=a, row_offset=off),
    "elbo_sample": lambda lm, i, c, a, seed, off: elbo_sample(
        lm, i, c, seed=seed, index=1, num_samples=2, attention_mask=a, row_offset=off
    ).logprob,
    "elbo_samples": lambda lm, i, c, a, seed, off: (
        lambda s: torch.cat([s.logprob, s.t[..., None]], dim=-1)  # [n, B, L + 1]: values and ratios
    )(elbo_samples(lm, i, c, num_samples=2, seed=seed, attention_mask=a, row_offset=off)),
    "elbo_samples_blocks_prompt_masking": lambda lm, i, c, a, seed, off: (
        lambda s: torch.cat([s.logprob, s.t[..., None]], dim=-1)
    )(elbo_samples(lm, i, c, num_samples=2, seed=seed, attention_mask=a, row_offset=off, block_length=3,
                   prompt_mask_prob=0.3)),
}


# Every estimator through the torch path; the Triton kernels (interpreter, slower) on one.
SHARD_CASES = [("torch", e) for e in SHARDABLE] + [("triton", "stratified_interleave_prompt")]


@pytest.mark.parametrize("backend_name,estimator", SHARD_CASES)
def test_a_shard_with_its_row_offset_gets_the_values_of_its_rows(monkeypatch, tiny_lm, backend_name, estimator):
    # Rows of a bidirectional model are independent: a data-parallel shard that passes the index
    # of its first row must see the masks, hence the values, of those rows in the whole batch.
    monkeypatch.setenv("DACA_BACKEND", backend_name)
    estimate = SHARDABLE[estimator]
    ids, completion, am = make_batch(seed=15, batch=5)
    before = snapshot(ids, completion, am)
    with torch.no_grad():
        for seed, (lo, hi) in [(3, (0, 2)), (2**33 + 1, (2, 5)), (40, (1, 4))]:
            whole = estimate(tiny_lm, ids, completion, am, seed, 0)
            shard = estimate(tiny_lm, ids[lo:hi], completion[lo:hi], am[lo:hi], seed, lo)
            torch.testing.assert_close(shard, whole[..., lo:hi, :], msg=lambda m: f"seed {seed}, rows {lo}:{hi}: {m}")
        unshifted = estimate(tiny_lm, ids[2:], completion[2:], am[2:], 3, 0)
        assert not torch.allclose(unshifted, estimate(tiny_lm, ids, completion, am, 3, 0)[..., 2:, :]), (
            "without the offset a shard gets other masks"
        )
    assert_unchanged(before, ids, completion, am)


def test_half_precision_model_returns_float32(tiny_lm):
    lm16 = MaskedLM.from_hf(copy.deepcopy(tiny_lm.module).to(torch.bfloat16), mask_id=MASK_ID)
    ids, completion, am = make_batch(seed=11)
    out = stratified_logprob(lm16, ids, completion, num_strata=2, seed=0, attention_mask=am)
    ref = stratified_logprob(tiny_lm, ids, completion, num_strata=2, seed=0, attention_mask=am)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.1)


def _inputs():
    ids, completion, _ = make_batch(seed=12)
    return ids, completion


BAD_CASES = {
    "not a MaskedLM": (lambda lm, ids, c: stratified_logprob(lm.module, ids, c, num_strata=2, seed=0), TypeError, "lm must be a MaskedLM"),
    "float ids": (lambda lm, ids, c: one_step_logprob(lm, ids.float(), c, seed=0), TypeError, "input_ids must have dtype"),
    "id out of range": (lambda lm, ids, c: one_step_logprob(lm, ids.clone().fill_(VOCAB), c, seed=0), ValueError, r"input_ids must lie in \[0, 53\)"),
    "int completion mask": (lambda lm, ids, c: coupled_logprob(lm, ids, c.long(), seed=0), TypeError, "completion_mask must have dtype"),
    "completion mask shape": (lambda lm, ids, c: stratified_logprob(lm, ids, c[:, 1:], num_strata=2, seed=0), ValueError, "completion_mask must have shape"),
    "attention mask shape": (lambda lm, ids, c: one_step_logprob(lm, ids, c, seed=0, attention_mask=c[:1]), ValueError, "attention_mask must have shape"),
    "zero strata": (lambda lm, ids, c: stratified_logprob(lm, ids, c, num_strata=0, seed=0), ValueError, "num_strata must be >= 1"),
    "negative seed": (lambda lm, ids, c: coupled_logprob(lm, ids, c, seed=-2), ValueError, "seed must lie in"),
    "t range": (lambda lm, ids, c: coupled_logprob(lm, ids, c, seed=0, t_range=(0.0, 0.5)), ValueError, "t_range must satisfy"),
    "t range type": (lambda lm, ids, c: coupled_logprob(lm, ids, c, seed=0, t_range=0.5), TypeError, "t_range must be a pair"),
    "zero samples": (lambda lm, ids, c: elbo_samples(lm, ids, c, num_samples=0, seed=0), ValueError, "num_samples must be >= 1"),
    "sample index": (lambda lm, ids, c: elbo_sample(lm, ids, c, seed=0, index=3, num_samples=3), ValueError, "index must lie in"),
    "prompt probability": (lambda lm, ids, c: one_step_logprob(lm, ids, c, seed=0, prompt_mask_prob=-0.1), ValueError, r"prompt_mask_prob must be a finite number in \[0, 1\]"),
    "device mismatch": (lambda lm, ids, c: one_step_logprob(lm, ids.to("meta"), c, seed=0), ValueError, "completion_mask is on cpu"),
    "float row offset": (lambda lm, ids, c: stratified_logprob(lm, ids, c, num_strata=2, seed=0, row_offset=1.5), TypeError, "row_offset must be an int"),
    "negative row offset": (lambda lm, ids, c: coupled_logprob(lm, ids, c, seed=0, row_offset=-1), ValueError, "row_offset must be >= 0"),
    "row offset past 32 bits": (lambda lm, ids, c: elbo_samples(lm, ids, c, num_samples=2, seed=0, row_offset=2**32 - 2), ValueError, r"row_offset must keep row_offset \+ B <= 2\*\*32"),
    "row offset of one step": (lambda lm, ids, c: one_step_logprob(lm, ids, c, seed=0, row_offset=None), TypeError, "row_offset must be an int"),
    "mask not a tensor": (lambda lm, ids, c: masked_logprob(lm, ids, c.tolist()), TypeError, "mask must be a torch.Tensor"),
    "int mask": (lambda lm, ids, c: masked_logprob(lm, ids, c.long()), TypeError, "mask must have dtype"),
    "1-D mask": (lambda lm, ids, c: masked_logprob(lm, ids, c[0]), ValueError, "mask must be 2-D"),
    "mask shape": (lambda lm, ids, c: masked_logprob(lm, ids, c[:, 1:]), ValueError, r"mask must have shape \[B, L\]"),
    "int loss mask": (lambda lm, ids, c: masked_logprob(lm, ids, c, loss_mask=c.int()), TypeError, "loss_mask must have dtype"),
    "loss mask shape": (lambda lm, ids, c: masked_logprob(lm, ids, c, loss_mask=c[:1]), ValueError, r"loss_mask must have shape \[B, L\]"),
    "loss mask device": (lambda lm, ids, c: masked_logprob(lm, ids, c, loss_mask=c.to("meta")), ValueError, "loss_mask is on meta but input_ids is on cpu"),
    "loss mask outside mask": (
        lambda lm, ids, c: masked_logprob(lm, ids, c & (torch.arange(13) > 6), loss_mask=c),
        ValueError, r"loss_mask must be a subset of mask: loss_mask\[0, 5\] is True but mask\[0, 5\] is False",
    ),
    "loss mask outside the generated region": (
        lambda lm, ids, c: one_step_logprob(lm, ids, c & (torch.arange(13) > 6), seed=0, loss_mask=c),
        ValueError, r"loss_mask must be a subset of completion_mask: loss_mask\[0, 5\] is True but completion_mask\[0, 5\] is False",
    ),
    "loss mask of the coupled estimator": (
        lambda lm, ids, c: coupled_logprob(lm, ids, c, seed=0, loss_mask=c.long()), TypeError, "loss_mask must have dtype",
    ),
    "loss mask of an elbo sample": (
        lambda lm, ids, c: elbo_sample(lm, ids, c & (torch.arange(13) > 6), seed=0, loss_mask=c),
        ValueError, "loss_mask must be a subset of completion_mask",
    ),
    "block scoring": (
        lambda lm, ids, c: elbo_samples(lm, ids, c, num_samples=2, seed=0, block_length=3, block_scoring="blocks"),
        ValueError, "block_scoring must be 'spg' or 'block'",
    ),
    "elbo prompt inside the completion": (
        lambda lm, ids, c: elbo_sample(lm, ids, c, seed=0, prompt_mask_prob=0.5, prompt=torch.ones_like(c)),
        ValueError, "prompt must not overlap completion_mask",
    ),
    "elbo prompt probability": (
        lambda lm, ids, c: elbo_sample(lm, ids, c, seed=0, prompt_mask_prob=1.5), ValueError, r"prompt_mask_prob must be a finite number in \[0, 1\]",
    ),
    "mask ids": (lambda lm, ids, c: masked_logprob(lm, ids.float(), c), TypeError, "input_ids must have dtype"),
    "mask model": (lambda lm, ids, c: masked_logprob(lm.module, ids, c), TypeError, "lm must be a MaskedLM"),
    "zero block length": (lambda lm, ids, c: elbo_sample(lm, ids, c, seed=0, block_length=0), ValueError, "block_length must be >= 1"),
    "float block length": (lambda lm, ids, c: elbo_samples(lm, ids, c, num_samples=2, seed=0, block_length=4.0), TypeError, "block_length must be an int, got float"),
    "bool block length": (lambda lm, ids, c: elbo_sample(lm, ids, c, seed=0, block_length=True), TypeError, "block_length must be an int, got bool"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_refused_by_name(case, tiny_lm):
    call, error, message = BAD_CASES[case]
    ids, completion = _inputs()
    before = snapshot(ids, completion)
    with pytest.raises(error, match=message):
        call(tiny_lm, ids, completion)
    assert_unchanged(before, ids, completion)


def test_shift_refuses_a_completion_at_position_zero():
    lm = MaskedLM.from_hf(bidirectional(), mask_id=MASK_ID, shift=True)
    ids, completion = _inputs()
    completion[0, 0] = True
    with pytest.raises(ValueError, match=r"completion_mask\[:, 0\] must be False when lm.shift"):
        stratified_logprob(lm, ids, completion, num_strata=2, seed=0)


def test_an_input_past_the_models_position_limit_is_refused_by_name(backend):
    # BERT's 16 learned positions: 20 would fail inside transformers' embeddings.
    lm = MaskedLM.from_hf(bert(max_positions=16), mask_id=MASK_ID, verify=False)
    ids, completion, attention_mask = make_batch(length=20)
    answer = answer_of(completion)
    before = snapshot(ids, completion, attention_mask)
    calls = {
        "one_step": lambda: one_step_logprob(lm, ids, completion, seed=0, attention_mask=attention_mask),
        "stratified": lambda: stratified_logprob(lm, ids, completion, num_strata=2, seed=0),
        "coupled": lambda: coupled_logprob(lm, ids, completion, seed=0),
        "elbo_sample": lambda: elbo_sample(lm, ids, completion, seed=0),
        "elbo_samples": lambda: elbo_samples(lm, ids, completion, num_samples=2, seed=0),
        "masked_logprob": lambda: masked_logprob(lm, ids, completion),
        **{f"estimate_logprob {name}": (lambda name=name: estimate_logprob(
            lm, ids, completion, answer, attention_mask, estimator=name, seed=0))
           for name in ("one_step", "stratified", "coupled", "elbo")},
    }
    message = (r"^input_ids: the length L of input_ids \[B, L\] = 20 positions, more than the model accepts "
               r"\(lm.max_length = 16, its position limit\)$")
    for name, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call()
    state = ids.masked_fill(completion, MASK_ID)
    with pytest.raises(ValueError, match=r"^state: the length L of state \[B, L\] = 20 positions"):
        branch_logprob(lm, state, ids, completion)
    assert_unchanged(before, ids, completion, attention_mask)
    fits = one_step_logprob(lm, ids[:, :16], completion[:, :16], seed=0)
    assert fits.isfinite().all() and (fits[completion[:, :16]] < 0).all()


def test_a_prompt_that_overlaps_the_completion_is_refused_by_every_mask_function(backend, tiny_lm):
    # One rule: a prompt (eligible for prompt masking) lies outside the region the function masks itself.
    ids, completion, _ = make_batch()
    prompt = ~completion
    prompt[0, 6] = True
    before = snapshot(ids, completion, prompt)
    where = r"prompt\[0, 6\] and completion_mask\[0, 6\] are both True"
    calls = {
        "stratified_mask": (lambda: stratified_mask(ids, completion, 3, 0, MASK_ID, prompt=prompt, prompt_mask_prob=0.5),
                            where.replace("completion_mask", "maskable")),
        "one_step": (lambda: one_step_logprob(tiny_lm, ids, completion, seed=0, prompt=prompt, prompt_mask_prob=1.0),
                     where),
        "stratified": (lambda: stratified_logprob(tiny_lm, ids, completion, num_strata=2, seed=0, prompt=prompt,
                                                  prompt_mask_prob=0.3), where),
        "stratified, no prompt masking": (lambda: stratified_logprob(tiny_lm, ids, completion, num_strata=2, seed=0,
                                                                     prompt=prompt), where),
        "elbo_sample": (lambda: elbo_sample(tiny_lm, ids, completion, seed=0, prompt=prompt, prompt_mask_prob=0.5),
                        where),
        "elbo_sample_mask": (lambda: elbo_sample_mask(completion, seed=0, prompt=prompt), where),
    }
    for name, (call, message) in calls.items():
        with pytest.raises(ValueError, match="^prompt must not overlap .*" + message):
            call()
    assert_unchanged(before, ids, completion, prompt)
    with pytest.raises(ValueError, match=r"^prompt must not overlap maskable: prompt\[0, 6\]"):
        stratified_mask(ids, completion, 3, 0, MASK_ID, prompt=prompt, prompt_mask_prob=0.5, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "estimator",
    ["stratified_k3_answer", "coupled_answer", "one_step_prompt_masking", "masked_logprob_subset", "elbo_sample_spg_blocks_of_3"],
)
def test_cuda_estimators_match_cpu(estimator):
    model = bidirectional(tied=False, seed=2)
    ids, completion, am = make_batch(seed=13, batch=4, length=40)
    fused_fn, _ = ESTIMATORS[estimator]
    cpu = fused_fn(MaskedLM.from_hf(model, mask_id=MASK_ID), ids, completion, am)
    gpu_model = copy.deepcopy(model).to(DEVICE)
    gpu = fused_fn(MaskedLM.from_hf(gpu_model, mask_id=MASK_ID), ids.to(DEVICE), completion.to(DEVICE), am.to(DEVICE))
    torch.testing.assert_close(gpu.cpu(), cpu.detach(), rtol=1e-4, atol=1e-4)
    gpu.sum().backward()
    assert all(p.grad is not None for p in gpu_model.parameters())


def test_masked_logprob_runs_one_pass_and_sends_only_the_scored_rows_to_the_head(monkeypatch, tiny_lm):
    ids, completion, am = make_batch(seed=16)
    mask, scored = input_and_scored(completion)
    before = snapshot(ids, mask, scored, am)
    head_rows, model_inputs = [], []
    real_linear = masked_passes.linear_logprob_unchecked
    monkeypatch.setattr(masked_passes, "linear_logprob_unchecked", lambda h, *a, **k: head_rows.append(h.shape[0]) or real_linear(h, *a, **k))
    real_hidden = tiny_lm._hidden_fn
    monkeypatch.setattr(tiny_lm, "_hidden_fn", lambda ids, am: model_inputs.append(ids.clone()) or real_hidden(ids, am))

    out = masked_logprob(tiny_lm, ids, mask, loss_mask=scored, attention_mask=am)
    assert_unchanged(before, ids, mask, scored, am)
    assert len(model_inputs) == 1 and torch.equal(model_inputs[0], ids.masked_fill(mask, MASK_ID))
    assert head_rows == [int(scored.sum())], "only the scored rows may reach the head"
    assert out.dtype == torch.float32 and ((out != 0) == scored).all()

    everything = masked_logprob(tiny_lm, ids, mask, attention_mask=am)  # loss_mask defaults to mask
    assert head_rows[-1] == int(mask.sum()) and ((everything != 0) == mask).all()
    torch.testing.assert_close(everything[scored], out[scored], rtol=1e-6, atol=1e-6)

    calls = len(model_inputs)
    nothing = masked_logprob(tiny_lm, ids, mask, loss_mask=torch.zeros_like(mask), attention_mask=am)
    assert len(model_inputs) == calls and (nothing == 0).all(), "nothing scored: no forward pass"


def test_masked_logprob_of_a_float64_model_and_with_checkpointing(tiny_lm):
    ids, completion, am = make_batch(seed=17)
    mask, scored = input_and_scored(completion)
    lm64 = MaskedLM.from_hf(copy.deepcopy(tiny_lm.module).double(), mask_id=MASK_ID)
    out64 = masked_logprob(lm64, ids, mask, loss_mask=scored, attention_mask=am)
    assert out64.dtype == torch.float64
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    def run(checkpoint):
        return lambda m: masked_logprob(tiny_lm, ids, mask, loss_mask=scored, attention_mask=am, checkpoint=checkpoint)

    plain = values_and_grads(run(False), tiny_lm.module, upstream)
    checkpointed = values_and_grads(run(True), tiny_lm.module, upstream)
    tiny_lm.module.zero_grad(set_to_none=True)
    torch.testing.assert_close(plain[0], out64.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
    assert plain[1]
    assert_model_gradients_close(checkpointed[1], plain[1])


def test_shift_refuses_to_score_position_zero_but_may_mask_it():
    lm = MaskedLM.from_hf(bidirectional(), mask_id=MASK_ID, shift=True)
    ids, completion = _inputs()
    mask = completion.clone()
    mask[:, 0] = True
    out = masked_logprob(lm, ids, mask, loss_mask=completion)
    assert ((out != 0) == completion).all()
    with pytest.raises(ValueError, match=r"mask\[:, 0\] must be False when lm.shift"):
        masked_logprob(lm, ids, mask)
    with pytest.raises(ValueError, match=r"loss_mask\[:, 0\] must be False when lm.shift"):
        masked_logprob(lm, ids, mask, loss_mask=mask)


def test_block_elbo_samples_are_masked_passes_on_the_block_masks(tiny_lm):
    ids, completion, am = make_batch(seed=18, length=14)
    completion[:, 4:] = True
    completion[1, 11:] = False  # n = 10 (blocks 4, 4, 2) and 7 (4, 3)
    n = completion.sum(1).double()
    for block_scoring in ("spg", "block"):
        samples = elbo_samples(tiny_lm, ids, completion, num_samples=3, seed=5, attention_mask=am, block_length=4,
                               block_scoring=block_scoring)
        assert samples.logprob.shape == samples.mask.shape == (3, 3, 14) and samples.t.shape == (3, 3)
        assert ((samples.logprob != 0) == samples.mask).all()
        for j in range(3):
            block = block_elbo_mask(completion, 5, j, 3, 4)
            if block_scoring == "block":  # the selected block's masked positions, t = m / (K s)
                scored, t = block.scored, block.t
            else:  # SPG: every masked completion position, t = (number scored) / n
                scored, t = block.masked, block.masked.sum(1) / n
            assert torch.equal(samples.mask[j], scored) and torch.equal(samples.t[j], t.float())
            direct = masked_logprob(tiny_lm, ids, block.masked, loss_mask=scored, attention_mask=am)
            assert torch.equal(samples.logprob[j], direct)
        single = elbo_sample(tiny_lm, ids, completion, seed=5, index=2, num_samples=3, attention_mask=am, block_length=4,
                             block_scoring=block_scoring)
        assert torch.equal(single.logprob, samples.logprob[2]) and torch.equal(single.elbo(), samples.elbo()[2])
    assert any(not torch.equal(block_elbo_mask(completion, 5, j, 3, 4).masked, block_elbo_mask(completion, 5, j, 3, 4).scored)
               for j in range(3)), "some sample masks a later block: the two scorings differ"
    one_block = elbo_samples(tiny_lm, ids, completion, num_samples=3, seed=5, attention_mask=am, block_length=10)
    plain = elbo_samples(tiny_lm, ids, completion, num_samples=3, seed=5, attention_mask=am)
    for field in ("logprob", "mask", "t"):
        assert torch.equal(getattr(one_block, field), getattr(plain, field)), f"one block is the plain sample ({field})"


def test_spg_block_masks_and_scoring_read_off_the_mask(monkeypatch):
    """SPG's block-wise sample, checked against its definition on the mask alone: the padding after
    the answer and the blocks after the selected one are masked, the selected block holds the
    block-ELBO draw, prompt masking reaches the prompt and the earlier blocks only, and the scored
    set is every masked answer position with t = (number scored) / (answer length)."""
    monkeypatch.setenv("DACA_BACKEND", "torch")  # masks only; the backends draw identical masks
    completion = torch.zeros(5, 17, dtype=torch.bool)
    completion[:, 4:] = True
    answer = completion.clone()
    for row, end in ((0, 15), (1, 17), (2, 8), (3, 12), (4, 5)):
        answer[row, end:] = False
    ordinal = torch.cumsum(answer.long(), 1) - 1
    block = torch.where(answer, ordinal // 3, -1)
    num_blocks = (answer.sum(1) + 2) // 3
    sizes = torch.stack([(block == k).sum(1) for k in range(5)], dim=1)
    prompt_hits = earlier_hits = 0
    for j in range(6):
        common = dict(seed=7, index=j, num_samples=6, loss_mask=answer, block_length=3)
        ours = elbo_sample_mask(completion, block_scoring="block", **common)
        spg = elbo_sample_mask(completion, prompt_mask_prob=0.5, **common)
        everything = elbo_sample_mask(completion, prompt_mask_prob=1.0, **common)
        selected = torch.where(ours.scored, block, -1).amax(1, keepdim=True)
        assert (selected >= 0).all() and ((block == selected) | ~ours.scored).all(), "one block per row"
        for sample in (ours, spg, everything):
            assert (sample.masked[completion & ~answer]).all(), "the padding after the answer is always masked"
            assert (sample.masked[answer & (block > selected)]).all(), "the later blocks are masked"
            assert torch.equal(sample.masked & (block == selected), ours.scored), "the selected block's draw"
        assert not (ours.masked & ~completion).any() and not (ours.masked & answer & (block < selected)).any()
        m = ours.scored.sum(1, keepdim=True).double()
        s = sizes.gather(1, selected).double()
        torch.testing.assert_close(ours.t, (m / (num_blocks[:, None] * s)).squeeze(1), rtol=0, atol=0)
        for sample in (spg, everything):
            assert torch.equal(sample.scored, sample.masked & answer)
            torch.testing.assert_close(sample.t, sample.scored.sum(1).double() / answer.sum(1).double(), rtol=0, atol=0)
        earlier = answer & (block < selected)
        assert torch.equal(everything.masked, ~completion | earlier | ours.masked), "p = 1 masks every eligible position"
        prompt_hits += int((spg.masked & ~completion).sum())
        earlier_hits += int((spg.masked & earlier).sum())
        assert not (spg.masked & answer & (block == selected) & ~ours.scored).any(), "the selected block is not prompt-masked"
    assert prompt_hits > 0 and earlier_hits > 0, "p = 0.5 masks some prompt and some earlier-block positions"


def test_d1_one_step_estimator_masks_the_generated_region_and_scores_the_answer():
    """d1's diffu-GRPO, built by hand: the prompt as given, every generated position masked (the
    tokens after the first EOS too), log_softmax of the model's logits read up to and including the
    first EOS; the one-step estimator gives exactly these values and their gradients."""
    model = bidirectional(tied=False, seed=3)
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID)
    ids, _, _ = make_batch(seed=19, length=14)
    eos, prompt_length = 2, 5
    generated = torch.zeros_like(ids, dtype=torch.bool)
    generated[:, prompt_length:] = True
    ids[:, prompt_length:] = torch.where(ids[:, prompt_length:] == eos, eos + 1, ids[:, prompt_length:])
    ids[0, 9] = ids[0, 12] = eos  # answer: columns 5..9 (the second EOS is padding)
    ids[2, 5] = eos  # the answer is the EOS alone; row 1 has none and scores all of its completion
    answer = generated.clone()
    answer[0, 10:] = False
    answer[2, 6:] = False
    d1_input = ids.masked_fill(generated, MASK_ID)
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4))

    def d1(m):
        logp = torch.log_softmax(m(input_ids=d1_input).logits, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
        return torch.where(answer, logp, 0.0)

    want, want_grads = values_and_grads(d1, model, upstream)
    got, got_grads = values_and_grads(lambda m: one_step_logprob(lm, ids, generated, seed=0, loss_mask=answer), model, upstream)
    assert ((got != 0) == answer).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        assert (got_grads[name] - g).norm() <= 1e-4 * g.norm() + 1e-7, name
    # Scoring the answer as the whole region would show the model where it ends: other values.
    old = one_step_logprob(lm, ids, answer, seed=0).detach()
    assert not torch.allclose(old[[0, 2]], want[[0, 2]], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(old[1], want[1], rtol=1e-5, atol=1e-5)


def test_estimate_logprob_by_name(tiny_lm):
    ids, completion, am = make_batch(seed=5)
    answer = answer_of(completion)
    prompt = ~completion & am.bool()
    common = dict(attention_mask=am, loss_mask=answer, row_offset=3)
    expected = {
        "one_step": one_step_logprob(tiny_lm, ids, completion, seed=2, prompt_mask_prob=0.3, prompt=prompt, **common),
        "stratified": stratified_logprob(tiny_lm, ids, completion, num_strata=3, seed=2, prompt_mask_prob=0.3,
                                         prompt=prompt, **common),
        "coupled": coupled_logprob(tiny_lm, ids, completion, seed=2, **common),
    }
    samples = elbo_samples(tiny_lm, ids, completion, num_samples=2, seed=2, prompt_mask_prob=0.3, prompt=prompt,
                           **common)
    expected["elbo"] = (samples.logprob / samples.t[..., None]).mean(0)
    for name, values in expected.items():
        got = estimate_logprob(tiny_lm, ids, completion, answer, am, estimator=name, seed=2, num_strata=3,
                               elbo_samples=2, prompt_mask_prob=0.3, row_offset=3)
        torch.testing.assert_close(got, values, rtol=1e-6, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="estimator"):
        estimate_logprob(tiny_lm, ids, completion, answer, am, estimator="exact", seed=2)
    with pytest.raises(ValueError, match="estimator"):
        monte_carlo_masks(ids, completion, answer, am, estimator="one_step", seed=2, mask_id=MASK_ID)
