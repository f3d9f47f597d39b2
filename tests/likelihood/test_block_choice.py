"""SPG's block choice for the block-wise ELBO masks (``block_choice="spg"``): the production masks
against the row-by-row reference, SPG's ``randperm(N) % K`` draw as a defining property (every
permutation's N samples select block c exactly ``#{v < N : v mod K = c}`` times), its
distribution over rows, the weight ``t`` that keeps the block ELBO unbiased, the plumbing through
``elbo_sample_mask`` / ``elbo_samples``, and bad input."""
import pytest
import torch
from properties import given, settings, st
from support import assert_unchanged, snapshot
from tiny_models import tiny_masked_lm

from daca_kernels.likelihood.elbo import elbo_sample_mask, elbo_samples
from daca_kernels.likelihood.estimator import estimate_logprob, monte_carlo_masks
from daca_kernels.likelihood.ratio_masks import block_elbo_mask
from daca_kernels.reference import masking


def regions(batch, length, seed, answer_density=0.7):
    """``(answer, generated)`` bool ``[B, L]``: a generated region of random length at the end of
    each row and an answer that is a prefix of it (as a rollout's answer is)."""
    g = torch.Generator().manual_seed(seed)
    columns = torch.arange(length)
    start = torch.randint(0, length // 2 + 1, (batch, 1), generator=g)
    generated = columns >= start
    gen_length = generated.sum(1, keepdim=True)
    answer_length = (gen_length * answer_density).long() + torch.randint(0, 2, (batch, 1), generator=g)
    answer = generated & (columns < start + answer_length.minimum(gen_length))
    return answer, generated


def selected_blocks(result, answer, block_length):
    """long ``[B]``: the block (of ``block_length`` answer positions) holding each row's scored positions."""
    ordinal = torch.cumsum(answer.long(), dim=1) - 1
    block = torch.where(result.scored, ordinal // block_length, -1)
    return block.amax(dim=1)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 40),
    seed=st.sampled_from([0, 3, 2**40 + 7]),
    num_samples=st.integers(1, 9),
    block_length=st.integers(1, 8),
    row_offset=st.sampled_from([0, 5, 2**32 - 8]),
    with_generated=st.booleans(),
    data=st.data(),
)
def test_spg_choice_matches_the_reference(batch, length, seed, num_samples, block_length, row_offset, with_generated,
                                          data):
    index = data.draw(st.integers(0, num_samples - 1), label="index")
    answer, generated = regions(batch, length, seed=length + batch)
    generated = generated if with_generated else None
    before = snapshot(answer, generated)
    result = block_elbo_mask(answer, seed, index, num_samples, block_length, row_offset=row_offset,
                             block_choice="spg", generated=generated)
    assert_unchanged(before, answer, generated)
    scored, masked, t = masking.block_elbo_mask(answer, seed, index, num_samples, block_length, row_offset=row_offset,
                                                block_choice="spg", generated=generated)
    assert torch.equal(result.scored, scored) and torch.equal(result.masked, masked) and torch.equal(result.t, t)


@pytest.mark.parametrize("decoding_blocks,answer_blocks", [(5, 3), (4, 4), (7, 2), (3, 1), (6, 4)])
def test_each_permutation_selects_every_block_as_often_as_spg_modulo(decoding_blocks, answer_blocks):
    """SPG's ``randperm(N) % K``: the N samples of one permutation (samples 0..N-1, and N..2N-1 the
    next one) select block c exactly ``#{v < N : v mod K = c}`` times in every row, whatever the seed."""
    block_length, batch = 3, 16
    length = decoding_blocks * block_length
    generated = torch.ones(batch, length, dtype=torch.bool)
    answer = torch.arange(length) < answer_blocks * block_length - 1  # last answer block one short
    answer = answer.expand(batch, length).clone()
    want = torch.bincount(torch.arange(decoding_blocks) % answer_blocks, minlength=answer_blocks)
    num_samples = 2 * decoding_blocks
    picks = torch.stack([
        selected_blocks(block_elbo_mask(answer, 11, j, num_samples, block_length, block_choice="spg",
                                        generated=generated), answer, block_length)
        for j in range(num_samples)
    ])  # [2N, B]
    for first in (0, decoding_blocks):
        counts = torch.stack([torch.bincount(picks[first:first + decoding_blocks, b], minlength=answer_blocks)
                              for b in range(batch)])
        assert torch.equal(counts, want.expand(batch, -1)), f"samples {first}..{first + decoding_blocks - 1}"
    if answer_blocks > 1:
        orders = {tuple(picks[:, b].tolist()) for b in range(batch)}
        assert len(orders) > 1, "rows must draw different permutations"
        assert not torch.equal(picks[:decoding_blocks], picks[decoding_blocks:]), "the second permutation is a new draw"


def test_spg_choice_favours_the_early_blocks_like_randperm_modulo():
    """Over many rows, sample 0's block follows ``q_c = #{v < N : v mod K = c} / N`` (N = 5,
    K = 3: 2/5, 2/5, 1/5), which a plain ``torch.randperm(5) % 3`` also gives; the uniform choice
    gives 1/3 each."""
    batch, block_length = 6000, 2
    generated = torch.ones(batch, 10, dtype=torch.bool)
    answer = (torch.arange(10) < 6).expand(batch, 10).clone()
    spg = selected_blocks(block_elbo_mask(answer, 4, 0, 1, block_length, block_choice="spg", generated=generated),
                          answer, block_length)
    uniform = selected_blocks(block_elbo_mask(answer, 4, 0, 1, block_length), answer, block_length)
    g = torch.Generator().manual_seed(0)
    plain = torch.stack([torch.randperm(5, generator=g)[0] % 3 for _ in range(batch)])
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    for picks, want in ((spg, q), (plain, q), (uniform, torch.full((3,), 1 / 3, dtype=torch.float64))):
        freq = torch.bincount(picks, minlength=3).double() / batch
        assert (freq - want).abs().max() < 0.02, f"frequencies {freq.tolist()}, expected {want.tolist()}"


@pytest.mark.parametrize("answer_length,gen_length,block_length", [(12, 20, 4), (11, 20, 4), (7, 9, 3), (5, 5, 2)])
def test_block_weight_makes_each_permutation_average_the_answer_length(answer_length, gen_length, block_length):
    """``t = m q / s``: with the scored count m, ``m / t = s / q``; over the N samples of a
    permutation block c appears ``N q_c`` times, so the mean of ``m / t`` is exactly ``n`` (the
    block ELBO's unbiasedness with f = 1, realised exactly by one permutation)."""
    batch = 6
    generated = torch.zeros(batch, gen_length + 3, dtype=torch.bool)
    generated[:, 3:] = True
    answer = generated & (torch.arange(gen_length + 3) < 3 + answer_length)
    decoding_blocks = -(-gen_length // block_length)
    total = torch.zeros(batch, dtype=torch.float64)
    for j in range(decoding_blocks):
        result = block_elbo_mask(answer, 2, j, decoding_blocks, block_length, block_choice="spg", generated=generated)
        total += result.scored.sum(1).double() / result.t
    torch.testing.assert_close(total / decoding_blocks, torch.full((batch,), float(answer_length), dtype=torch.float64),
                               rtol=1e-12, atol=0)


def test_the_uniform_choice_is_unchanged_and_spg_without_generated_permutes_the_answer_blocks():
    answer, generated = regions(4, 30, seed=1)
    for j in range(3):
        default = block_elbo_mask(answer, 9, j, 3, 4)
        explicit = block_elbo_mask(answer, 9, j, 3, 4, block_choice="uniform", generated=generated)
        scored, masked, t = masking.block_elbo_mask(answer, 9, j, 3, 4)
        for result in (default, explicit):
            assert torch.equal(result.scored, scored) and torch.equal(result.masked, masked) and torch.equal(result.t, t)
    # N = K: one permutation of the answer's blocks, every block once (without replacement).
    answer = torch.ones(3, 12, dtype=torch.bool)
    picks = torch.stack([selected_blocks(block_elbo_mask(answer, 5, j, 4, 3, block_choice="spg"), answer, 3)
                         for j in range(4)])
    assert (picks.sort(0).values == torch.arange(4)[:, None]).all()


def test_elbo_samples_pass_the_choice_with_the_generated_region_as_spg_does(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    answer, generated = regions(3, 24, seed=2)
    for scoring in ("spg", "block"):
        for j in range(4):
            sample = elbo_sample_mask(generated, seed=6, index=j, num_samples=4, loss_mask=answer, block_length=3,
                                      block_scoring=scoring, block_choice="spg")
            block = block_elbo_mask(answer, 6, j, 4, 3, block_choice="spg", generated=generated)
            assert torch.equal(sample.scored & ~sample.masked, torch.zeros_like(answer))
            if scoring == "block":
                assert torch.equal(sample.scored, block.scored) and torch.equal(sample.t, block.t)
            else:
                assert torch.equal(sample.masked, block.masked | (generated & ~answer))
    lm = tiny_masked_lm(seed=3, vocab=29)
    ids = torch.randint(0, 28, answer.shape, generator=torch.Generator().manual_seed(1))
    out = elbo_samples(lm, ids, generated, num_samples=2, seed=6, loss_mask=answer, block_length=3, block_choice="spg")
    for j in range(2):
        want = elbo_sample_mask(generated, seed=6, index=j, num_samples=2, loss_mask=answer, block_length=3,
                                block_choice="spg")
        assert torch.equal(out.mask[j], want.scored)
    uniform = elbo_samples(lm, ids, generated, num_samples=2, seed=6, loss_mask=answer, block_length=3)
    assert not torch.equal(out.mask, uniform.mask), "the choice must reach the estimator"


def test_the_estimator_settings_carry_the_choice(monkeypatch):
    """``mask_block_choice`` of ``estimate_logprob`` / ``monte_carlo_masks`` (the trainer's and
    the loop's setting) reaches the masks."""
    monkeypatch.setenv("DACA_BACKEND", "torch")
    answer, generated = regions(3, 24, seed=4)
    lm = tiny_masked_lm(seed=3, vocab=29)
    ids = torch.randint(0, 28, answer.shape, generator=torch.Generator().manual_seed(2))
    settings = dict(seed=9, elbo_samples=3, mask_block_length=3, mask_block_choice="spg")
    samples = monte_carlo_masks(ids, generated, answer, None, estimator="elbo", mask_id=28, **settings)
    direct = elbo_samples(lm, ids, generated, num_samples=3, seed=9, loss_mask=answer, block_length=3, block_choice="spg")
    for j, sample in enumerate(samples):
        want = elbo_sample_mask(generated, seed=9, index=j, num_samples=3, loss_mask=answer, block_length=3,
                                block_choice="spg")
        assert torch.equal(sample.scored, want.scored) and torch.equal(sample.masked, want.masked)
    estimate = estimate_logprob(lm, ids, generated, answer, None, estimator="elbo", **settings)
    expected = (direct.logprob / (3 * direct.t[:, :, None])).sum(0)
    torch.testing.assert_close(estimate, expected.to(estimate.dtype))
    uniform = estimate_logprob(lm, ids, generated, answer, None, estimator="elbo", **{**settings, "mask_block_choice": "uniform"})
    assert not torch.equal(estimate, uniform)


BAD_CASES = {
    "block_choice value": (dict(block_choice="SPG"), ValueError, "block_choice must be one of 'uniform', 'spg', got 'SPG'"),
    "block_choice type": (dict(block_choice=None), ValueError, "block_choice must be one of 'uniform', 'spg', got None"),
    "generated dtype": (dict(generated=torch.ones(2, 8, dtype=torch.long)), TypeError, "generated must have dtype"),
    "generated shape": (dict(generated=torch.ones(2, 7, dtype=torch.bool)), ValueError,
                        r"generated must have shape \[B, L\] \(from completion_mask\) = \(2, 8\)"),
    "generated device": (dict(generated=torch.ones(2, 8, dtype=torch.bool, device="meta")), ValueError,
                         "generated is on meta but completion_mask is on cpu"),
    "generated misses the answer": (dict(generated=torch.zeros(2, 8, dtype=torch.bool)), ValueError,
                                    "generated must contain completion_mask"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_refused_by_name(case):
    kwargs, error, message = BAD_CASES[case]
    answer = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(error, match=message):
        block_elbo_mask(answer, 0, 0, 2, 4, **kwargs)
    with pytest.raises(ValueError, match="block_choice must be one of .uniform., .spg."):
        elbo_sample_mask(answer, seed=0, block_choice="random")
