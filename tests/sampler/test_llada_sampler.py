"""``generate(mask_candidate="llada")`` and LLaDA's sampler options against LLaDA's released sampler.

``released_generate`` below is a plain re-implementation of ``generate`` in LLaDA's released
``generate.py`` (the version with ``attention_mask``, ``logits_eos_inf`` and
``confidence_eos_eot_inf``), written from reading it: full logits every step, the mask id a
candidate like any token, Gumbel-max as ``exp(logits) / (-log u) ** temperature`` in float64,
the confidence the softmax probability of the candidate, the classifier-free guidance pass on
the input with the prompt masked. Its two draws from ``torch.rand`` are replaced by the
library's counter-hash uniforms of the same ``(step, row id, token)``, so sampled rollouts can be
compared token for token. It also records every step's confidences, the oracle of the DPS
quantities.
"""
import pytest
import torch
from support import assert_unchanged, snapshot
from tiny_models import tiny_masked_lm

from daca_kernels.hashing import STREAM_RANDOM_REMASK, gumbel_hash, hash4, seed32, uniform_from_hash
from daca_kernels.rollout import generate

VOCAB, MASK_ID = 61, 60
EOS_ID, EOT_ID = 7, 11  # stand-ins for LLaDA-8B-Instruct's 126081 and 126348


def hashed_uniforms(seed: int, step: int, batch: int, length: int, vocab: int | None = None):
    """float64 ``[B, L]`` (``[B, L, V]`` with ``vocab``): the library's uniform of row id ``b * L + j``
    at ``step`` for random remasking (for the Gumbel noise of token ``v``), in place of ``torch.rand``."""
    row_ids = torch.arange(batch * length).view(batch, length)
    if vocab is None:
        words = hash4(seed32(seed), STREAM_RANDOM_REMASK, step, row_ids, 0)
    else:
        words = gumbel_hash(seed32(seed), step, row_ids[..., None], torch.arange(vocab))
    return uniform_from_hash(words).double()


def released_generate(lm, prompt, *, attention_mask, steps, gen_length, block_length, temperature, cfg_scale,
                      remasking, logits_eos_inf, confidence_eos_eot_inf, eos_id, eot_id, seed):
    """LLaDA's released sampler on ``lm.logits``; returns ``(x [B, L], history)`` where
    ``history[s] = (masked [B, L] at the start of step s, candidate [B, L], its confidence [B, L],
    positions written [B, L])``."""
    mask_id = lm.mask_id
    batch, prompt_length = prompt.shape
    length = prompt_length + gen_length
    x = torch.full((batch, length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones(batch, gen_length, dtype=attention_mask.dtype)], dim=1)
    is_prompt = x != mask_id
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    history, step = [], 0
    for block in range(num_blocks):
        block_end = prompt_length + (block + 1) * block_length
        in_block = (x[:, block_end - block_length:block_end] == mask_id).sum(1)
        # LLaDA's get_num_transfer_tokens: an even split, the remainder to the first steps.
        counts = [[int(n) // steps_per_block + (i < int(n) % steps_per_block) for i in range(steps_per_block)]
                  for n in in_block]
        for i in range(steps_per_block):
            masked = x == mask_id
            if cfg_scale > 0:
                unconditional = x.clone()
                unconditional[is_prompt] = mask_id
                both_masks = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
                conditional, un = lm.logits(torch.cat([x, unconditional]), both_masks).chunk(2)
                logits = un + (cfg_scale + 1) * (conditional - un)
            else:
                logits = lm.logits(x, attention_mask)
            if logits_eos_inf:
                logits[:, :, eos_id] = float("-inf")
            if temperature == 0:
                noisy = logits  # the released add_gumbel_noise returns its input at temperature 0
            else:
                u = hashed_uniforms(seed, step, batch, length, logits.shape[-1])
                noisy = logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature
            candidate = noisy.argmax(dim=-1)
            if confidence_eos_eot_inf:
                noisy[:, :, eos_id] = logits[:, :, eot_id] = float("-inf")
            confidence = torch.softmax(logits, dim=-1).gather(-1, candidate[..., None]).squeeze(-1)
            if remasking == "low_confidence":
                score = confidence.clone()
            else:
                score = hashed_uniforms(seed, step, batch, length)
            score[:, block_end:] = float("-inf")
            candidate = torch.where(masked, candidate, x)
            score = torch.where(masked, score, float("-inf"))
            written = torch.zeros_like(masked)
            for b in range(batch):
                # torch.topk in the released code leaves the order of equal scores unspecified; the
                # stable sort takes the lowest positions, one of the outcomes it allows.
                chosen = torch.sort(score[b], descending=True, stable=True).indices[: counts[b][i]]
                written[b, chosen] = True
            x[written] = candidate[written]
            history.append((masked, candidate, confidence, written))
            step += 1
    return x, history


def expected_dps(history):
    """``(commit_step, commit_confidence, step_gain)`` from the released sampler's history: a
    position is committed by the step that writes a token other than the mask id into it (a
    written mask id leaves it masked, to be written again)."""
    masked = history[0][0]
    commit_step = torch.full(masked.shape, -1, dtype=torch.long)
    commit_confidence = torch.zeros(masked.shape, dtype=torch.float64)
    gain = torch.zeros(masked.shape[0], len(history), dtype=torch.float64)
    for s, (masked, candidate, confidence, written) in enumerate(history):
        real = written & (candidate != MASK_ID)
        commit_step[real] = s
        commit_confidence[real] = confidence[real].double()
        if s + 1 < len(history):
            still, _, next_confidence, _ = history[s + 1]
            gain[:, s] = torch.where(still, next_confidence.double() - confidence.double(), 0.0).sum(1)
    return commit_step, commit_confidence, gain


def mask_prone_lm(*, exclude_mask_logit=False):
    """A float64 tiny model whose mask id, EOS and EOT logits are raised so that the mask id is
    proposed and committed now and then (holes) and the EOS / EOT options change the rollout; with
    ``exclude_mask_logit`` the mask logit is -1e4 instead (exp underflows to 0: no rule proposes it)."""
    lm = tiny_masked_lm(seed=1, head_bias=True, dtype=torch.float64)
    with torch.no_grad():
        lm.head_bias[MASK_ID] = -1e4 if exclude_mask_logit else lm.head_bias[MASK_ID] + 4.0
        lm.head_bias[EOS_ID] += 3.0
        lm.head_bias[EOT_ID] += 3.0
    return lm


def prompts(batch=3, length=6, padded=True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, MASK_ID, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.bool)
    if padded:
        for b, pad in enumerate([0, 2, 5][:batch]):
            mask[b, :pad] = False
            ids[b, :pad] = 0
    return ids, mask if padded else None


# (gen_length, block_length, steps, temperature, remasking, cfg_scale, logits_eos_inf, confidence_eos_eot_inf, padded)
CASES = {
    "greedy, 3 blocks": (12, 4, 12, 0.0, "low_confidence", 0.0, False, False, True),
    "sampled, 2 tokens a step": (12, 4, 6, 0.8, "low_confidence", 0.0, False, False, True),
    "random remasking": (8, 4, 4, 1.0, "random", 0.0, False, False, False),
    "guidance, sampled": (8, 8, 8, 0.7, "low_confidence", 1.5, False, False, True),
    "guidance and both EOS options, greedy": (8, 4, 8, 0.0, "low_confidence", 0.5, True, True, True),
    "both EOS options, sampled": (8, 4, 8, 0.9, "low_confidence", 0.0, True, True, False),
    "EOT option alone, greedy": (8, 4, 8, 0.0, "low_confidence", 0.0, False, True, True),
}


def run_both(lm, case, mask_candidate, seed=5):
    gen_length, block_length, steps, temperature, remasking, cfg_scale, eos_inf, conf_inf, padded = case
    prompt, prompt_mask = prompts(padded=padded)
    options = dict(gen_length=gen_length, steps=steps, block_length=block_length, temperature=temperature,
                   remasking=remasking, cfg_scale=cfg_scale, logits_eos_inf=eos_inf, confidence_eos_eot_inf=conf_inf,
                   eos_id=EOS_ID, eot_id=EOT_ID)
    before = snapshot(prompt, prompt_mask)
    rollout = generate(lm, prompt, seed=seed, prompt_mask=prompt_mask, mask_candidate=mask_candidate, **options)
    assert_unchanged(before, prompt, prompt_mask)
    released = released_generate(lm, prompt, attention_mask=None if prompt_mask is None else prompt_mask.long(),
                                 seed=seed, **options)
    return rollout, released


def assert_matches_released(rollout, released, what):
    x, history = released
    assert torch.equal(rollout.sequences, x), f"{what}: sequences differ from the released sampler's"
    commit_step, commit_confidence, gain = expected_dps(history)
    assert torch.equal(rollout.commit_step, commit_step), f"{what}: commit steps differ"
    torch.testing.assert_close(rollout.commit_confidence, commit_confidence, rtol=0, atol=1e-12)
    torch.testing.assert_close(rollout.step_gain, gain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_llada_rule_equals_the_released_sampler(monkeypatch, case):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, released = run_both(mask_prone_lm(), CASES[case], "llada")
    assert_matches_released(rollout, released, case)
    assert rollout.nfe == CASES[case][2] * (2 if CASES[case][5] > 0 else 1)


@pytest.mark.parametrize("case", ["guidance and both EOS options, greedy", "both EOS options, sampled"])
def test_default_rule_with_the_options_equals_the_released_sampler_on_a_model_that_never_proposes_mask(
        monkeypatch, case):
    # With the mask logit at -1e4 both rules give the same candidates and confidences, so the
    # options under the default rule (mask id left out by sample_step) meet the released code too.
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, released = run_both(mask_prone_lm(exclude_mask_logit=True), CASES[case], "exclude")
    assert_matches_released(rollout, released, case)


@pytest.mark.parametrize("case", ["guidance and both EOS options, greedy", "both EOS options, sampled"])
def test_llada_rule_on_triton_kernels_equals_the_released_sampler(monkeypatch, case):
    monkeypatch.setenv("DACA_BACKEND", "triton")
    rollout, released = run_both(mask_prone_lm(), CASES[case], "llada")
    assert_matches_released(rollout, released, case)


def test_the_cases_reach_holes_and_the_options_change_the_rollout(monkeypatch):
    """Guards against a vacuous comparison: the model commits the mask id, holes are predicted again
    and some stay, the default rule leaves none, and each option changes what is sampled."""
    monkeypatch.setenv("DACA_BACKEND", "torch")
    lm = mask_prone_lm()
    rollout, (x, history) = run_both(lm, CASES["sampled, 2 tokens a step"], "llada")
    holed = torch.zeros_like(x, dtype=torch.bool)
    refilled = 0
    for _, candidate, _, written in history:
        refilled += int((written & holed & (candidate != MASK_ID)).sum())
        holed |= written & (candidate == MASK_ID)
    holes = int((x[:, 6:] == MASK_ID).sum())
    assert holes > 0 and int((rollout.commit_step[:, 6:] == -1).sum()) == holes
    assert refilled > 0, "a committed mask id must be predicted again and replaced"
    default, _ = run_both(lm, CASES["sampled, 2 tokens a step"], "exclude")
    assert (default.sequences != MASK_ID).all() and (default.commit_step[:, 6:] >= 0).all()

    case = CASES["greedy, 3 blocks"]
    plain, _ = run_both(lm, case, "llada")
    assert (plain.sequences == EOS_ID).any() and (plain.sequences == EOT_ID).any()
    for name, index, value in [("cfg_scale", 5, 1.0), ("logits_eos_inf", 6, True), ("confidence_eos_eot_inf", 7, True)]:
        changed = list(case)
        changed[index] = value
        other, _ = run_both(lm, tuple(changed), "llada")
        assert not torch.equal(other.sequences, plain.sequences), f"{name} must change this rollout"
        if name == "logits_eos_inf":
            assert (other.sequences != EOS_ID).all()


def test_dps_weights_of_a_rollout_with_holes_cover_the_committed_tokens(monkeypatch):
    from daca_kernels.credit import dps_weights

    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, _ = run_both(mask_prone_lm(), CASES["sampled, 2 tokens a step"], "llada")
    holes = rollout.completion_mask & (rollout.commit_step < 0)
    assert holes.any() and (rollout.sequences[holes] == MASK_ID).all()
    with pytest.raises(ValueError, match="completion_mask must select only positions the sampler committed"):
        dps_weights(rollout)
    committed = rollout.completion_mask & (rollout.commit_step >= 0)
    weights = dps_weights(rollout, committed)
    assert (weights[holes] == 0).all() and (weights[committed] > 0).all()
