"""Branching for DiSPO: the top-k cache of a denoising state and the Z fillings drawn from it."""
import pytest
import torch
from support import assert_unchanged, snapshot
from tiny_models import tiny_masked_lm

from daca_kernels import branch_logprob, dispo_step_loss, linear_topk_logprob, reference
from daca_kernels.rollout import branch, generate


def head_case(n, hidden_size, vocab, dtype, seed, with_bias):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 2 / hidden_size**0.5).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype) if with_bias else None
    return hidden, weight, bias


@pytest.mark.parametrize("n,vocab,k,chunk_size", [(1, 50, 49, None), (9, 301, 5, 4), (4, 64, 1, 1)])
@pytest.mark.parametrize("dtype,with_bias", [(torch.float32, True), (torch.bfloat16, False)])
def test_topk_cache_matches_reference(poison_allocations, n, vocab, k, chunk_size, dtype, with_bias):
    hidden, weight, bias = head_case(n, 8, vocab, dtype, seed=n + k, with_bias=with_bias)
    before = snapshot(hidden, weight, bias)
    ids, logprobs = linear_topk_logprob(hidden, weight, k=k, bias=bias, mask_id=vocab - 1, chunk_size=chunk_size)
    assert_unchanged(before, hidden, weight, bias)
    assert ids.shape == (n, k) and ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert (ids != vocab - 1).all()
    logits = reference.linear_logits(hidden.double(), weight.double(), None if bias is None else bias.double())
    ref_ids, ref_logprobs = reference.topk_logprob(logits, k, vocab - 1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, rtol=0, atol=2e-5)
    full_ids, _ = linear_topk_logprob(hidden, weight, k=vocab - 1, bias=bias, mask_id=vocab - 1)
    assert torch.equal(full_ids.sort(1).values, torch.arange(vocab - 1).expand(n, -1)), "k = V - 1 keeps every candidate"


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"k": 50}, ValueError, r"k must be in \[1, 50\)"),
        ({"k": 0}, ValueError, "k must be in"),
        ({"k": 3, "mask_id": 50}, ValueError, r"mask_id must be in \[0, 50\)"),
        ({"k": 3, "chunk_size": -1}, ValueError, "chunk_size must be >= 1"),
        ({"k": 2.0}, TypeError, "k must be an int"),
    ],
)
def test_topk_cache_rejects(kwargs, error, message):
    hidden, weight, _ = head_case(3, 8, 50, torch.float32, seed=0, with_bias=False)
    kwargs = {"mask_id": 49, **kwargs}
    with pytest.raises(error, match=message):
        linear_topk_logprob(hidden, weight, **kwargs)


MASK_ID = 60


@pytest.fixture(scope="module")
def branched():
    """A rollout with three cached states and the reference sampler's full logits for the same run."""
    lm = tiny_masked_lm(seed=4)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(1, MASK_ID, (2, 5), generator=g)
    prompt_mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    kwargs = dict(gen_length=8, steps=4, block_length=4, temperature=0.7, seed=13, prompt_mask=prompt_mask)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DACA_BACKEND", "torch")
        rollout = generate(lm, prompt, branch_steps=[3, 0, 2], branch_topk=6, **kwargs)
    return rollout, reference.reference_generate(lm, prompt, **kwargs)


def test_cached_states_match_reference(branched):
    rollout, ref = branched
    assert [state.step for state in rollout.branches] == [0, 2, 3]
    for state in rollout.branches:
        masked = ref.commit_step >= state.step  # not yet committed when the step starts
        assert torch.equal(state.masked, masked)
        assert torch.equal(state.sequences, torch.where(masked, MASK_ID, ref.sequences))
        b_idx, pos = masked.nonzero(as_tuple=True)
        logits = ref.step_logits[state.step][b_idx, pos].double()
        # The 6 most probable tokens other than the mask id, with their log-probabilities under the
        # full softmax (mask id included): branch_logprob's values.
        ref_ids, _ = reference.topk_logprob(logits, 6, MASK_ID)
        ref_logprobs = torch.log_softmax(logits, dim=1).gather(1, ref_ids)
        assert state.token_ids.shape == (len(pos), 6)
        assert torch.equal(state.token_ids, ref_ids)
        torch.testing.assert_close(state.logprobs.double(), ref_logprobs, rtol=0, atol=2e-5)


def test_fillings(branched, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, _ = branched
    state = rollout.branches[1]
    before = snapshot(state.sequences, state.masked, state.token_ids, state.logprobs)
    result = branch(rollout, 1, 5, seed=99, temperature=1.0)
    assert_unchanged(before, state.sequences, state.masked, state.token_ids, state.logprobs)
    assert result.step == 2 and torch.equal(result.filled, state.masked) and torch.equal(result.state, state.sequences)
    assert result.sequences.shape == (5, 2, 13) and result.old_logprob.shape == (5, 2, 13)
    assert torch.equal(result.attention_mask, rollout.attention_mask)
    filled = result.filled
    b_idx, pos = filled.nonzero(as_tuple=True)
    for z in range(5):
        sequence = result.sequences[z]
        assert torch.equal(sequence[~filled], state.sequences[~filled])
        # The Gumbel-max draw over the cached log-probabilities, noise of (seed, z, b * L + j).
        column, _ = reference.sample_step(state.logprobs, 1.0, 99, z, b_idx * 13 + pos)
        assert torch.equal(sequence[b_idx, pos], state.token_ids.gather(1, column[:, None]).squeeze(1))
        assert torch.equal(result.old_logprob[z, b_idx, pos], state.logprobs.gather(1, column[:, None]).squeeze(1))
        assert (result.old_logprob[z][~filled] == 0).all()
    assert len({tuple(s[filled].tolist()) for s in result.sequences}) > 1, "fillings must differ"
    assert torch.equal(branch(rollout, 1, 5, seed=99).sequences, result.sequences)
    assert not torch.equal(branch(rollout, 1, 5, seed=100).sequences, result.sequences)


def test_fillings_on_triton_kernels_equal_torch_path(branched, monkeypatch):
    rollout, _ = branched
    results = {}
    for name in ("triton", "torch"):
        monkeypatch.setenv("DACA_BACKEND", name)
        results[name] = branch(rollout, 0, 2, seed=4, temperature=0.6).sequences
    assert torch.equal(results["triton"], results["torch"])


def test_temperature_zero_takes_the_most_probable_token(branched, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, _ = branched
    state = rollout.branches[2]
    result = branch(rollout, 2, 3, seed=0, temperature=0.0)
    for z in range(3):
        assert torch.equal(result.sequences[z][state.masked], state.token_ids[:, 0])


def test_exact_cache_keeps_every_candidate(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    lm = tiny_masked_lm(seed=5)
    prompt = torch.tensor([[5, 6, 7]])
    for topk in (None, 10**6):
        rollout = generate(lm, prompt, gen_length=4, steps=2, block_length=4, seed=0, branch_steps=[1], branch_topk=topk)
        state = rollout.branches[0]
        assert state.token_ids.shape == (2, MASK_ID)  # V - 1: every token but the mask
        assert (state.token_ids != MASK_ID).all()
        mask_prob = torch.softmax(lm.logits(state.sequences)[state.masked], dim=1)[:, MASK_ID]
        torch.testing.assert_close(state.logprobs.exp().sum(1) + mask_prob, torch.ones(2))


def test_a_shard_with_its_row_offset_branches_like_its_rows_of_the_whole_batch(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    lm = tiny_masked_lm(seed=4)
    prompt = torch.randint(1, MASK_ID, (3, 5), generator=torch.Generator().manual_seed(9))
    kwargs = dict(gen_length=8, steps=4, block_length=4, temperature=0.7, seed=13, branch_steps=[1], branch_topk=6)
    whole = generate(lm, prompt, **kwargs)
    for seed, (lo, hi) in [(99, (1, 3)), (2**50 + 1, (0, 2)), (4, (2, 3))]:
        shard = generate(lm, prompt[lo:hi], row_offset=lo, **kwargs)
        got = branch(shard, 0, 4, seed=seed, row_offset=lo)
        want = branch(whole, 0, 4, seed=seed)
        assert torch.equal(got.filled, want.filled[lo:hi])
        assert torch.equal(got.sequences, want.sequences[:, lo:hi]), f"seed {seed}, rows {lo}:{hi}: fillings differ"
        torch.testing.assert_close(got.old_logprob, want.old_logprob[:, lo:hi])
    shard = generate(lm, prompt[1:], row_offset=1, **kwargs)
    unshifted = branch(shard, 0, 4, seed=99)
    assert not torch.equal(unshifted.sequences, branch(whole, 0, 4, seed=99).sequences[:, 1:]), (
        "without the offset a shard's fillings get other noise"
    )


def test_branch_rejects(branched, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, _ = branched
    with pytest.raises(ValueError, match=r"index must be in \[0, 3\)"):
        branch(rollout, 3, 2, seed=0)
    with pytest.raises(ValueError, match="num_fillings must be >= 1"):
        branch(rollout, 0, 0, seed=0)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        branch(rollout, 0, 2, seed=0, temperature=-1.0)
    with pytest.raises(ValueError, match="seed must lie in"):
        branch(rollout, 0, 2, seed=-1)
    with pytest.raises(ValueError, match="row_offset must be >= 0"):
        branch(rollout, 0, 2, seed=0, row_offset=-1)
    with pytest.raises(TypeError, match="row_offset must be an int"):
        branch(rollout, 0, 2, seed=0, row_offset="1")
    with pytest.raises(ValueError, match=r"row_offset must keep \(row_offset \+ B\) \* L <= 2\*\*32 .*B = 2, L = 13"):
        branch(rollout, 0, 2, seed=0, row_offset=2**32 // 13 - 1)
    with pytest.raises(TypeError, match="rollout must be a Rollout"):
        branch(rollout.branches[0], 0, 2, seed=0)
    plain = generate(tiny_masked_lm(seed=5), torch.tensor([[5, 6]]), gen_length=4, steps=2, block_length=4, seed=0)
    with pytest.raises(ValueError, match="rollout has no cached states"):
        branch(plain, 0, 2, seed=0)


def test_the_layout_the_consumers_take(branched):
    rollout, _ = branched
    fills = branch(rollout, 1, 3, seed=5)
    batch, length = fills.state.shape
    assert fills.num_fillings == 3
    assert fills.fillings.shape == fills.fillings_filled.shape == fills.fillings_old_logprob.shape == (batch * 3, length)
    for b in range(batch):
        for z in range(3):
            assert torch.equal(fills.fillings[b * 3 + z], fills.sequences[z, b])
            assert torch.equal(fills.fillings_filled[b * 3 + z], fills.filled[b])
            assert torch.equal(fills.fillings_old_logprob[b * 3 + z], fills.old_logprob[z, b])


ON_POLICY = {
    # name: (model dtype, backend, generate options)
    "float64, default rule": (torch.float64, "torch", {}),
    "float32, triton": (torch.float32, "triton", {}),
    "LLaDA's rule with guidance and EOS options": (
        torch.float64, "torch",
        dict(mask_candidate="llada", cfg_scale=1.0, logits_eos_inf=True, confidence_eos_eot_inf=True, eos_id=3, eot_id=4),
    ),
}


@pytest.mark.parametrize("case", list(ON_POLICY))
def test_cached_log_probabilities_are_the_policy_s_on_policy(monkeypatch, case):
    """The old log-probabilities a branch caches are what branch_logprob computes for the current
    policy: the ratio is 1 on-policy (float rounding aside), whatever the sampler's rule and options
    (the cache is the model's own distribution, the conditional pass under guidance)."""
    dtype, backend_name, options = ON_POLICY[case]
    monkeypatch.setenv("DACA_BACKEND", backend_name)
    lm = tiny_masked_lm(seed=4, head_bias=True, dtype=dtype)
    prompt = torch.randint(1, MASK_ID, (2, 5), generator=torch.Generator().manual_seed(8))
    prompt_mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    rollout = generate(lm, prompt, gen_length=8, steps=4, block_length=4, temperature=0.7, seed=13,
                       prompt_mask=prompt_mask, branch_steps=[1], branch_topk=6, **options)
    fills = branch(rollout, 0, 3, seed=2)
    filled = fills.fillings_filled
    assert (fills.fillings[filled] != MASK_ID).all()
    with torch.no_grad():
        logp = branch_logprob(lm, fills.state, fills.fillings, filled, attention_mask=fills.attention_mask)
    assert logp.dtype == fills.fillings_old_logprob.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    ratio = torch.exp(logp - fills.fillings_old_logprob)[filled]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=tolerance)
    rewards = torch.rand(filled.shape[0], generator=torch.Generator().manual_seed(0), dtype=dtype)
    _, metrics = dispo_step_loss(logp, fills.fillings_old_logprob, filled, rewards, fills.num_fillings)
    assert abs(metrics["ratio_mean"].item() - 1) <= tolerance


def test_the_fillings_flattened_in_the_wrong_order_are_refused(branched, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, _ = branched
    lm = tiny_masked_lm(seed=4)
    fills = branch(rollout, 1, 3, seed=5)
    length = fills.state.shape[1]
    with pytest.raises(ValueError, match=r"fillings must equal their state outside filled.*z \* B \+ b order"):
        branch_logprob(lm, fills.state, fills.sequences.reshape(-1, length), fills.fillings_filled,
                       attention_mask=fills.attention_mask)
