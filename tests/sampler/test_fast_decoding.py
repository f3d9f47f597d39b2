"""Cached and parallel decoding of the full-attention families on their released code
(``generate(kv_cache="prefix" | "dual", threshold=..., tokens_per_step=...)``), padded batches included.

Dream (both released copies) serves the prefix and the dual cache through its own ``past_key_values``, and
so does transformers' bidirectional Llama (the reference loop's model); LLaDA-8B (hub and dllm's copy)
serves the prefix cache through its blocks' ``layer_past`` and refuses the dual one (its rotary embedding
places the queries at the last positions of the keys), LLaDA-MoE both through its decoder layers'
``past_key_value`` (tests/released/test_prefix_cache_drivers.py checks those drivers against the released
forwards). Hub LLaDA-8B and LLaDA-MoE ignore every mask: their padded rows run without their padding, on
the exact path and the cached one alike. Parallel decoding needs no cache and runs on every family.
"""
import warnings

import pytest
import torch
from released import hub
from tiny_models import VOCAB, modernbert, tiny_masked_lm

from daca_kernels import MaskedLM
from daca_kernels.rollout import Decoding, generate, rescore_commits
from daca_kernels.rollout.branch_states import topk_cache

DUAL = ("dream", "dream_dllm", "llama", "lladamoe")
PREFIX_ONLY = ("llada", "llada_dllm")
FULL = DUAL + PREFIX_ONLY  # "llama": transformers' bidirectional Llama, the reference loop's model
CACHES = [(name, "prefix") for name in FULL] + [(name, "dual") for name in DUAL]
PROMPT, GEN, BLOCK = 6, 12, 4
# The decoding logic is under test, not the kernels (tested against their references elsewhere): the ops run
# their PyTorch path, on one thread.
pytestmark = pytest.mark.usefixtures("torch_path_one_thread")
# Values through a float32 model: a few hundred ulps of 1 (the exact paths are bit-identical in practice).
TOL = 256 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(name):
        if name == "llama" and name not in built:
            built[name] = tiny_masked_lm(vocab=hub.VOCAB, seed=5)
        if name not in built:
            directory = hub.write_checkpoint(name, tmp_path_factory.mktemp(name), seed=5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built[name] = MaskedLM.from_hf(hub.load(directory, name))
        return built[name]

    return get


def prompts(padded: bool):
    ids = torch.randint(0, hub.VOCAB - 4, (3, PROMPT), generator=torch.Generator().manual_seed(11))
    if not padded:
        return ids, None
    mask = torch.ones(3, PROMPT, dtype=torch.bool)
    mask[1, :2] = False
    mask[2, :3] = False
    return ids.masked_fill(~mask, hub.FAMILIES["dream"].pad_id), mask


def run(lm, padded, **options):
    ids, mask = prompts(padded)
    options.setdefault("steps", GEN)
    return generate(lm, ids, gen_length=GEN, block_length=BLOCK, seed=3, prompt_mask=mask, **options)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name, mode", CACHES)
def test_the_first_step_of_every_block_commits_what_the_exact_sampler_commits_from_that_state(models, name, mode,
                                                                                               padded):
    lm = models(name)
    cached = run(lm, padded, kv_cache=mode)
    assert cached.decoding == Decoding(kv_cache=mode)
    ids, mask = prompts(padded)
    steps_per_block = GEN // (GEN // BLOCK)
    approximated = False
    for block in range(GEN // BLOCK):
        start = PROMPT + block * BLOCK
        first = block * steps_per_block
        state = cached.sequences[:, :start]
        state_mask = None if mask is None else torch.cat([mask, torch.ones(3, start - PROMPT, dtype=torch.bool)], 1)
        exact = generate(lm, state, gen_length=GEN - block * BLOCK, block_length=BLOCK,
                         steps=(GEN // BLOCK - block) * steps_per_block, seed=3, prompt_mask=state_mask)
        here = cached.commit_step[:, start:] == first
        assert torch.equal(here, exact.commit_step[:, start:] == 0)
        assert torch.equal(cached.sequences[:, start:][here], exact.sequences[:, start:][here])
        torch.testing.assert_close(cached.commit_confidence[:, start:][here], exact.commit_confidence[:, start:][here],
                                   rtol=TOL, atol=TOL)
        torch.testing.assert_close(cached.commit_logprob[:, start:][here], exact.commit_logprob[:, start:][here],
                                   rtol=TOL, atol=TOL)
        later = (cached.commit_step[:, start:start + BLOCK] > first)
        approximated |= bool(later.any())
    assert approximated  # the later steps read the cache: the comparison above is not the whole rollout


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name, mode", CACHES)
def test_one_step_per_block_is_the_exact_sampler(models, name, mode, padded, temperature):
    lm = models(name)
    exact = run(lm, padded, steps=GEN // BLOCK, temperature=temperature)
    cached = run(lm, padded, steps=GEN // BLOCK, temperature=temperature, kv_cache=mode)
    assert torch.equal(cached.sequences, exact.sequences)
    assert torch.equal(cached.commit_step, exact.commit_step)
    torch.testing.assert_close(cached.commit_confidence, exact.commit_confidence, rtol=TOL, atol=TOL)
    assert (cached.nfe, cached.forward_tokens) == (exact.nfe, exact.forward_tokens)


@pytest.mark.parametrize("name, mode", CACHES)
def test_forward_tokens_count_the_columns_each_call_ran(models, name, mode):
    lm = models(name)
    rollout = run(lm, True, kv_cache=mode)
    batch, length, blocks, per_block = 3, PROMPT + GEN, GEN // BLOCK, BLOCK
    shift = int(lm.shift)
    later = 0
    for block in range(blocks):
        q0 = PROMPT + block * BLOCK - shift
        later += (per_block - 1) * ((length - q0) if mode == "prefix" else (BLOCK + shift))
    assert rollout.nfe == GEN  # one call per step: every greedy step commits
    assert rollout.forward_tokens == batch * (blocks * length + later)
    assert rollout.forward_tokens < run(lm, True).forward_tokens


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", FULL)
def test_threshold_zero_commits_each_block_at_once_and_one_keeps_the_schedule(models, name, padded):
    lm = models(name)
    everything = run(lm, padded, threshold=0.0)
    assert everything.nfe == GEN // BLOCK and everything.step_gain.shape[1] == GEN // BLOCK
    assert torch.equal(everything.sequences, run(lm, padded, steps=GEN // BLOCK).sequences)
    nothing = run(lm, padded, threshold=1.0)
    exact = run(lm, padded)
    assert torch.equal(nothing.sequences, exact.sequences) and torch.equal(nothing.commit_step, exact.commit_step)
    assert nothing.decoding == Decoding(threshold=1.0) and not nothing.decoding.exact


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", FULL)
def test_threshold_combines_with_the_cache(models, name, padded):
    lm = models(name)
    everything = run(lm, padded, threshold=0.0, kv_cache="prefix")  # each block at its exact first step
    assert everything.nfe == GEN // BLOCK
    assert torch.equal(everything.sequences, run(lm, padded, steps=GEN // BLOCK).sequences)
    exact = run(lm, padded)
    threshold = float(exact.commit_confidence[exact.commit_step >= 0].quantile(0.25))
    both = run(lm, padded, threshold=threshold, kv_cache="prefix")
    assert both.decoding == Decoding(kv_cache="prefix", threshold=threshold)
    assert both.nfe <= exact.nfe and both.forward_tokens < exact.forward_tokens
    assert bool((both.commit_step[:, PROMPT:] >= 0).all())
    steps = both.step_gain.shape[1]
    assert int(both.commit_step.max()) == steps - 1
    # The rule: a step commits its schedule's one position, or only positions above the threshold.
    for step in range(steps):
        for row in range(3):
            here = both.commit_step[row] == step
            if int(here.sum()) > 1:
                assert bool((both.commit_confidence[row][here] > threshold).all())


@pytest.mark.parametrize("name", FULL)
def test_tokens_per_step_is_llada_schedule_with_that_many_steps(models, name):
    lm = models(name)
    fixed = generate(lm, prompts(True)[0], gen_length=GEN, block_length=BLOCK, tokens_per_step=2, seed=3,
                     prompt_mask=prompts(True)[1])
    exact = run(lm, True, steps=GEN // 2)
    assert torch.equal(fixed.sequences, exact.sequences) and fixed.nfe == GEN // 2
    assert fixed.decoding.tokens_per_step == 2 and fixed.decoding.exact
    counts = torch.stack([(fixed.commit_step == s).sum(1) for s in range(GEN // 2)], 1)
    assert bool((counts == 2).all())


@pytest.mark.parametrize("options", [dict(), dict(threshold=0.5), dict(steps=None, tokens_per_step=2)])
@pytest.mark.parametrize("name, mode", CACHES)
def test_padding_does_not_change_a_greedy_rows_cached_rollout(models, name, mode, options):
    """A left-padded row decodes as it does alone (greedy: no draw depends on the row's place). With a
    threshold a batch's block lasts until its last row's positions run out, so only the tokens are compared
    there (the step numbers of a row's later blocks depend on the other rows)."""
    lm = models(name)
    ids, mask = prompts(True)
    batch = run(lm, True, kv_cache=mode, **options)
    for row in range(3):
        pad = int((~mask[row]).sum())
        alone = generate(lm, ids[row:row + 1, pad:], gen_length=GEN, block_length=BLOCK, seed=3, kv_cache=mode,
                         **{"steps": GEN, **options})
        assert torch.equal(batch.sequences[row, pad:], alone.sequences[0]), f"{name}, {mode}: row {row}"
        if "threshold" not in options:
            assert torch.equal(batch.commit_step[row, pad:], alone.commit_step[0])


@pytest.mark.parametrize("name", PREFIX_ONLY)
def test_llada_refuses_the_dual_cache_and_says_why(models, name):
    with pytest.raises(ValueError, match="kv_cache='dual': LLaDA's released attention .* positions.*kv_cache='prefix'"):
        run(models(name), True, kv_cache="dual")


@pytest.mark.parametrize("model", ["hand-built", "modernbert"])
def test_a_model_without_a_protocol_is_refused_naming_kv_cache(model):
    if model == "hand-built":
        wrapped = tiny_masked_lm()
        lm = MaskedLM(wrapped.hidden, wrapped.head_weight, None, wrapped.mask_id)
    else:
        lm = MaskedLM.from_hf(modernbert(), mask_id=VOCAB - 1)
    ids = torch.randint(0, 50, (2, 4))
    with pytest.raises(ValueError, match="kv_cache='prefix'.*no KV-cache protocol"):
        generate(lm, ids, gen_length=4, steps=4, seed=0, kv_cache="prefix")


@pytest.mark.parametrize("name", FULL)
def test_rollouts_without_a_cache_rescore_to_their_own_log_probabilities_and_cached_ones_do_not(models, name):
    lm = models(name)
    for options in (dict(), dict(threshold=0.0), dict(steps=None, tokens_per_step=2)):
        exact = run(lm, True, **options)
        committed = exact.commit_step >= 0
        torch.testing.assert_close(rescore_commits(lm, exact)[committed], exact.commit_logprob[committed],
                                   rtol=TOL, atol=TOL)
        assert bool((exact.commit_logprob[committed] < 0).all())
    cached = run(lm, True, kv_cache="dual" if name in DUAL else "prefix")
    gap = (rescore_commits(lm, cached) - cached.commit_logprob)[cached.commit_step >= 0].abs()
    assert float(gap.max()) > 100 * TOL


@pytest.mark.parametrize("name, mode", CACHES)
def test_branch_states_hold_the_exact_distribution_and_their_forward_is_counted(models, name, mode):
    lm = models(name)
    plain = run(lm, True, kv_cache=mode)
    rollout = run(lm, True, kv_cache=mode, branch_steps=[0, 1])  # step 1 reads the cache
    assert rollout.nfe == plain.nfe + 1 and torch.equal(rollout.sequences, plain.sequences)
    for state in rollout.branches:
        b_idx, pos = state.masked.nonzero(as_tuple=True)
        rows = lm.hidden(state.sequences, rollout.attention_mask)[b_idx, pos - int(lm.shift)]
        ids, logprobs = topk_cache(lm, rows, state.token_ids.shape[1], None)
        assert torch.equal(ids, state.token_ids)
        torch.testing.assert_close(logprobs, state.logprobs, rtol=TOL, atol=TOL)


def test_bad_options_are_refused_by_name(models):
    lm = models("dream")
    ids, mask = prompts(False)
    cases = [
        (dict(kv_cache=True), "kv_cache must be None, 'prefix' or 'dual'"),
        (dict(kv_cache="suffix"), "kv_cache must be None"),
        (dict(threshold=1.5), "threshold must lie in"),
        (dict(kv_cache="prefix", rule="dream", block_length=None), "rule: kv_cache"),
        (dict(threshold=0.5, mask_candidate="llada"), "mask_candidate"),
        (dict(kv_cache="prefix", cfg_scale=1.0), "cfg_scale"),
        (dict(threshold=0.5, remasking="random"), "remasking"),
        (dict(tokens_per_step=3, steps=None), "tokens_per_step .3. must divide block_length"),
        (dict(tokens_per_step=2, steps=5), "tokens_per_step=2 means steps"),
        (dict(kv_cache="prefix", threshold=0.5, steps=None), "steps must be given"),
        (dict(stop_at_eos=True), "stop_at_eos"),
    ]
    for options, message in cases:
        options = {"steps": GEN, "block_length": BLOCK, **options}
        with pytest.raises(ValueError, match=message):
            generate(lm, ids, gen_length=GEN, seed=0, **options)
