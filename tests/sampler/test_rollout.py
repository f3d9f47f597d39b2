"""rollout.generate against the plain reference sampler, its invariants, caching and bad input."""
import dataclasses

import pytest
import torch
from gpu_device import DEVICE
from support import assert_close_reduced, assert_unchanged, snapshot
from tiny_models import bert, tiny_masked_lm

from daca_kernels import reference
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.reference import sampling as reference_sampling
from daca_kernels.reference.sampling import transfer_counts
from daca_kernels.rollout import Rollout, answer_mask, generate, remasking

VOCAB, MASK_ID = 61, 60
REDUCTION = 64  # the tiny models' MLP width: their longest reduction (support.reduction_tolerance)


@pytest.fixture(scope="module")
def lm():
    return tiny_masked_lm(seed=1)


@pytest.fixture(scope="module")
def shift_lm():
    return tiny_masked_lm(seed=2, shift=True, head_bias=True)


def padded_prompts(batch=3, length=6, seed=0):
    """Left-padded prompts of lengths ``length``, ``length - 2``, ``length - 5``, ... (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, MASK_ID, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b, pad in enumerate([0, 2, 5][:batch]):
        mask[b, :pad] = False
        ids[b, :pad] = 0
    return ids, mask


class RecordingLM(MaskedLM):
    """The model with every backbone input recorded."""

    def __init__(self, lm):
        super().__init__(self._record, lm.head_weight, lm.head_bias, lm.mask_id, shift=lm.shift)
        self.inner, self.inputs = lm, []

    def _record(self, input_ids, attention_mask):
        self.inputs.append(input_ids.clone())
        return self.inner.hidden(input_ids, attention_mask)


def assert_rollouts_equal(rollout, ref, what):
    assert torch.equal(rollout.sequences, ref.sequences), f"{what}: sequences differ"
    assert torch.equal(rollout.commit_step, ref.commit_step), f"{what}: commit steps differ"
    assert_close_reduced(rollout.commit_confidence, ref.commit_confidence, n=REDUCTION, dtype=torch.float32)
    assert_close_reduced(rollout.step_gain, ref.step_gain, n=REDUCTION, dtype=torch.float32)


def assert_invariants(rollout, recorded_inputs, prompt_length, gen_length, block_length, steps):
    batch, length = rollout.sequences.shape
    completion = torch.zeros(batch, length, dtype=torch.bool)
    completion[:, prompt_length:] = True
    assert (rollout.commit_step[:, :prompt_length] == -1).all()
    assert (rollout.commit_step[completion] >= 0).all() and (rollout.commit_step < steps).all()
    assert torch.equal(rollout.completion_mask, completion)
    assert (rollout.sequences != MASK_ID).all()
    assert (rollout.commit_confidence[:, :prompt_length] == 0).all()
    assert ((rollout.commit_confidence[completion] > 0) & (rollout.commit_confidence[completion] <= 1)).all()
    # Each step commits its scheduled number of tokens, all inside its own block.
    steps_per_block = steps // (gen_length // block_length)
    schedule = transfer_counts(block_length, steps_per_block)
    for s in range(steps):
        committed = rollout.commit_step == s
        assert (committed.sum(1) == schedule[s % steps_per_block]).all()
        block_start = prompt_length + (s // steps_per_block) * block_length
        positions = committed.nonzero()[:, 1]
        assert ((positions >= block_start) & (positions < block_start + block_length)).all()
    # A token, once committed, is in every later model input with its final value.
    unmasked_before = torch.zeros(batch, length, dtype=torch.bool)
    for x in recorded_inputs:
        unmasked = x != MASK_ID
        assert (unmasked | ~unmasked_before).all(), "a committed token was remasked"
        assert torch.equal(x[unmasked], rollout.sequences[unmasked]), "a committed token changed"
        unmasked_before = unmasked


def test_schedule_and_random_scores_match_the_reference():
    for num_masked in range(0, 40):
        for steps in range(1, 12):
            counts = remasking.transfer_counts(num_masked, steps)
            assert counts == transfer_counts(num_masked, steps) and sum(counts) == num_masked
    row_ids = torch.tensor([0, 1, 5, 1000, 2**32 - 1, 2**31 + 17])
    for seed, step in ((0, 0), (7, 3), (2**63 + 9, 2**20)):
        got = remasking.remasking_uniforms(seed, step, row_ids)
        assert got.dtype == torch.float32 and torch.equal(got, reference_sampling.remasking_uniforms(seed, step, row_ids))
    assert not torch.equal(remasking.remasking_uniforms(0, 1, row_ids), remasking.remasking_uniforms(0, 2, row_ids))


# (gen_length, block_length, steps, temperature, remasking)
CASES = [
    (8, 8, 8, 0.0, "low_confidence"),  # one block, one token a step
    (12, 4, 6, 0.0, "low_confidence"),  # three blocks, two tokens a step
    (10, 5, 4, 1.0, "random"),  # two blocks of 5 over 2 steps: 3 then 2
    (12, 6, 4, 0.9, "low_confidence"),
    (8, 4, 12, 0.7, "low_confidence"),  # 6 steps for 4 tokens a block: two steps commit nothing
    (9, 3, 9, 0.0, "random"),
]


@pytest.mark.parametrize("gen_length,block_length,steps,temperature,remasking", CASES)
def test_generate_equals_reference_sampler(lm, monkeypatch, gen_length, block_length, steps, temperature, remasking):
    prompt, prompt_mask = padded_prompts()
    before = snapshot(prompt, prompt_mask)
    kwargs = dict(gen_length=gen_length, steps=steps, block_length=block_length, temperature=temperature,
                  remasking=remasking, seed=7, prompt_mask=prompt_mask)
    ref = reference.reference_generate(lm, prompt, **kwargs)
    recorder = RecordingLM(lm)
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout = generate(recorder, prompt, **kwargs)
    assert_unchanged(before, prompt, prompt_mask)
    assert_rollouts_equal(rollout, ref, "torch path")
    assert_invariants(rollout, recorder.inputs, prompt.shape[1], gen_length, block_length, steps)
    assert rollout.nfe == len(recorder.inputs)
    assert rollout.step_gain.shape == (3, steps) and (rollout.step_gain[:, -1] == 0).all()
    assert torch.equal(rollout.attention_mask[:, :6], prompt_mask.long())


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]])
def test_generate_on_triton_kernels_equals_reference(lm, monkeypatch, case):
    gen_length, block_length, steps, temperature, remasking = case
    prompt, prompt_mask = padded_prompts(batch=2)
    kwargs = dict(gen_length=gen_length, steps=steps, block_length=block_length, temperature=temperature,
                  remasking=remasking, seed=3, prompt_mask=prompt_mask)
    monkeypatch.setenv("DACA_BACKEND", "triton")
    assert_rollouts_equal(generate(lm, prompt, **kwargs), reference.reference_generate(lm, prompt, **kwargs), "triton")


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_shift_model_with_head_bias(shift_lm, monkeypatch, backend_name):
    prompt, prompt_mask = padded_prompts(batch=2, seed=4)
    kwargs = dict(gen_length=6, steps=4, block_length=3, temperature=0.8, seed=9, prompt_mask=prompt_mask)
    monkeypatch.setenv("DACA_BACKEND", backend_name)
    assert_rollouts_equal(generate(shift_lm, prompt, **kwargs), reference.reference_generate(shift_lm, prompt, **kwargs), "shift")


def test_step_gain_is_the_online_form_of_the_confidence_history(lm, monkeypatch):
    """step_gain[s] sums c_{s+1} - c_s over the positions still masked after step s: check it
    against the stored history position by position, including the future blocks."""
    prompt, _ = padded_prompts(batch=2)
    kwargs = dict(gen_length=8, steps=8, block_length=4, temperature=0.5, seed=1)
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout = generate(lm, prompt, **kwargs)
    ref = reference.reference_generate(lm, prompt, **kwargs)
    c = ref.confidences
    for b in range(2):
        for s in range(7):
            still = (ref.commit_step[b] > s).nonzero().flatten()
            assert not torch.isnan(c[b, s + 1, still]).any() and not torch.isnan(c[b, s, still]).any()
            expected = (c[b, s + 1, still] - c[b, s, still]).sum()
            assert abs(rollout.step_gain[b, s].item() - expected.item()) < 1e-5
    at_commit = c.gather(1, ref.commit_step.clamp(min=0)[:, None]).squeeze(1)
    completion = ref.commit_step >= 0
    torch.testing.assert_close(rollout.commit_confidence[completion].double(), at_commit[completion], rtol=0, atol=2e-6)
    assert rollout.step_gain[:, :-1].abs().min() > 0, "every gain but the last is a real sum here"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_steps_that_commit_nothing_reuse_the_model_output(lm, monkeypatch, temperature):
    prompt, _ = padded_prompts(batch=2)
    recorder = RecordingLM(lm)
    monkeypatch.setenv("DACA_BACKEND", "torch")
    # Two blocks of 3 tokens over 5 steps each: steps 3 and 4 of a block commit nothing; step 3
    # still needs a forward (step 2 committed), step 4 and the next block's first step reuse it.
    rollout = generate(recorder, prompt, gen_length=6, steps=10, block_length=3, temperature=temperature, seed=2)
    assert rollout.nfe == len(recorder.inputs) == 10 - 3
    ref = reference.reference_generate(lm, prompt, gen_length=6, steps=10, block_length=3, temperature=temperature, seed=2)
    assert ref.nfe == 10
    assert_rollouts_equal(rollout, ref, "cached steps")


def test_padded_row_decodes_like_its_prompt_alone(lm, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    prompt, prompt_mask = padded_prompts()
    kwargs = dict(gen_length=6, steps=6, block_length=3, temperature=0.0, seed=0)
    batched = generate(lm, prompt, prompt_mask=prompt_mask, **kwargs)
    for b, pad in enumerate([0, 2, 5]):
        alone = generate(lm, prompt[b : b + 1, pad:], **kwargs)
        assert torch.equal(batched.sequences[b, 6:], alone.sequences[0, 6 - pad :])
        assert torch.equal(batched.commit_step[b, 6:], alone.commit_step[0, 6 - pad :])


@pytest.mark.parametrize("temperature,remasking", [(0.9, "random"), (1.0, "low_confidence")])
def test_a_shard_with_its_row_offset_samples_the_rows_of_the_whole_batch(lm, monkeypatch, temperature, remasking):
    # A data-parallel process generating rows lo:hi of the global batch passes row_offset=lo. The
    # row ids are formed before any kernel sees them (the torch path is enough; the Triton sampler's
    # use of arbitrary row ids is checked in test_sample_step).
    monkeypatch.setenv("DACA_BACKEND", "torch")
    prompt, prompt_mask = padded_prompts(batch=4, seed=5)
    before = snapshot(prompt, prompt_mask)
    kwargs = dict(gen_length=8, steps=4, block_length=4, temperature=temperature, remasking=remasking)
    for seed, (lo, hi) in [(7, (1, 4)), (2**40 + 5, (0, 2)), (11, (3, 4))]:
        whole = generate(lm, prompt, seed=seed, prompt_mask=prompt_mask, **kwargs)
        shard = generate(lm, prompt[lo:hi], seed=seed, prompt_mask=prompt_mask[lo:hi], row_offset=lo, **kwargs)
        what = f"seed {seed}, rows {lo}:{hi}"
        assert torch.equal(shard.sequences, whole.sequences[lo:hi]), f"{what}: sequences differ"
        assert torch.equal(shard.commit_step, whole.commit_step[lo:hi]), f"{what}: commit steps differ"
        assert_close_reduced(shard.commit_confidence, whole.commit_confidence[lo:hi], n=REDUCTION, what=what)
        assert_close_reduced(shard.step_gain, whole.step_gain[lo:hi], n=REDUCTION, what=what)
        oracle = reference.reference_generate(
            lm, prompt[lo:hi], seed=seed, prompt_mask=prompt_mask[lo:hi], row_offset=lo, **kwargs
        )
        assert_rollouts_equal(shard, oracle, f"{what} vs reference")
    unshifted = generate(lm, prompt[1:], seed=7, prompt_mask=prompt_mask[1:], **kwargs)
    whole = generate(lm, prompt, seed=7, prompt_mask=prompt_mask, **kwargs)
    assert not torch.equal(unshifted.sequences, whole.sequences[1:]), "without the offset a shard samples other noise"
    assert_unchanged(before, prompt, prompt_mask)


def test_row_offset_at_the_32_bit_limit(lm, monkeypatch):
    # The last row id, (row_offset + B) * L - 1, is the largest 32-bit word that fits.
    monkeypatch.setenv("DACA_BACKEND", "torch")
    prompt = torch.tensor([[3, 1, 4, 1]])
    kwargs = dict(gen_length=4, steps=2, block_length=4, temperature=1.0, remasking="random", seed=3)
    offset = 2**32 // 8 - 1
    rollout = generate(lm, prompt, row_offset=offset, **kwargs)
    assert_rollouts_equal(rollout, reference.reference_generate(lm, prompt, row_offset=offset, **kwargs), "last row ids")


def test_seeds(lm, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    prompt, _ = padded_prompts(batch=2)
    kwargs = dict(gen_length=8, steps=4, block_length=4, temperature=1.5)
    first = generate(lm, prompt, seed=5, **kwargs)
    assert torch.equal(first.sequences, generate(lm, prompt, seed=5, **kwargs).sequences)
    assert not torch.equal(first.sequences, generate(lm, prompt, seed=6, **kwargs).sequences)


def test_nan_logits_are_an_error(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    embedding = torch.randn(VOCAB, 8)
    weight = torch.randn(VOCAB, 8)
    weight[5] = float("nan")
    lm = MaskedLM(lambda ids, mask: embedding[ids], weight, None, MASK_ID)
    with pytest.raises(ValueError, match="lm produced NaN logits at step 0"):
        generate(lm, torch.ones(1, 3, dtype=torch.long), gen_length=4, steps=4, block_length=4, seed=0)


def test_nan_logits_are_nan_confidences_where_checks_do_not_read_the_device(monkeypatch):
    # As on CUDA (no synchronisation per step): the rollout carries the NaN where the CPU raises.
    from daca_kernels import validation

    monkeypatch.setenv("DACA_BACKEND", "torch")
    monkeypatch.setattr(validation, "GUARDED_ON_DEVICE", ("cuda", "cpu"))
    embedding = torch.randn(VOCAB, 8)
    weight = torch.randn(VOCAB, 8)
    weight[5] = float("nan")
    lm = MaskedLM(lambda ids, mask: embedding[ids], weight, None, MASK_ID)
    rollout = generate(lm, torch.ones(1, 3, dtype=torch.long), gen_length=4, steps=4, block_length=4, seed=0)
    committed = rollout.commit_step >= 0
    assert torch.isnan(rollout.commit_confidence[committed]).all() and committed.any()


@pytest.mark.gpu
def test_generate_on_cuda_equals_reference():
    lm = tiny_masked_lm(seed=1)
    lm.module.to(DEVICE)
    lm = MaskedLM.from_hf(lm.module, mask_id=MASK_ID)
    prompt, prompt_mask = (t.to(DEVICE) for t in padded_prompts())
    kwargs = dict(gen_length=12, steps=6, block_length=4, temperature=0.8, seed=7, prompt_mask=prompt_mask)
    rollout = generate(lm, prompt, **kwargs)
    ref = reference.reference_generate(lm, prompt, **kwargs)
    assert (rollout.sequences != ref.sequences).sum() <= 1  # GPU noise may flip a near-tie
    assert rollout.sequences.device.type == rollout.step_gain.device.type == DEVICE.type


def _simple_lm():
    embedding = torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(0))
    return MaskedLM(lambda ids, mask: embedding[ids], torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(1)), None, MASK_ID)


# Dream's rule decodes the completion as one block.
DREAM = {"rule": "dream", "block_length": None}

BAD_INPUT = {
    "gen_length vs block_length": ({"gen_length": 10, "block_length": 4}, ValueError, r"gen_length \(10\) must be divisible by block_length \(4\)"),
    "steps vs blocks": ({"gen_length": 12, "block_length": 4, "steps": 4}, ValueError, r"steps \(4\) must be divisible by the number of blocks gen_length / block_length = 3"),
    "negative temperature": ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
    "mask id in prompt": ({"prompt_ids": torch.tensor([[3, MASK_ID, 4]])}, ValueError, rf"prompt_ids must not contain mask_id = {MASK_ID} \(found at \(0, 1\)\)"),
    "prompt id out of range": ({"prompt_ids": torch.tensor([[3, VOCAB, 4]])}, ValueError, rf"prompt_ids must lie in \[0, {VOCAB}\)"),
    "float prompt": ({"prompt_ids": torch.ones(1, 3)}, TypeError, "prompt_ids must have dtype"),
    "1-D prompt": ({"prompt_ids": torch.ones(3, dtype=torch.long)}, ValueError, "prompt_ids must be 2-D"),
    "empty batch": ({"prompt_ids": torch.ones(0, 3, dtype=torch.long)}, ValueError, "prompt_ids must have at least one row"),
    "zero gen_length": ({"gen_length": 0}, ValueError, "gen_length must be >= 1"),
    "float steps": ({"steps": 4.0}, TypeError, "steps must be an int"),
    "remasking": ({"remasking": "entropy"}, ValueError, "remasking must be one of low_confidence, random"),
    "seed": ({"seed": -3}, ValueError, "seed must lie in"),
    "right padding": ({"prompt_mask": torch.tensor([[True, True, False]])}, ValueError, "prompt_mask must describe left padding"),
    "prompt_mask values": ({"prompt_mask": torch.tensor([[0, 2, 1]])}, ValueError, "prompt_mask must hold only 0 and 1"),
    "prompt_mask shape": ({"prompt_mask": torch.ones(1, 2, dtype=torch.bool)}, ValueError, r"prompt_mask must have shape \[B, P\]"),
    "branch step": ({"branch_steps": [0, 4]}, ValueError, r"branch_steps must be in \[0, 4\)"),
    "branch steps type": ({"branch_steps": 2}, TypeError, "branch_steps must be an iterable"),
    "branch_topk": ({"branch_topk": 0}, ValueError, "branch_topk must be >= 1"),
    "not a model": ({"lm": "llada"}, TypeError, "lm must be a daca_kernels.MaskedLM"),
    "mask_candidate": ({"mask_candidate": "LLaDA"}, ValueError, "mask_candidate must be one of exclude, llada, dream, got 'LLaDA'"),
    "rule": ({"rule": "Dream"}, ValueError, "rule must be one of 'llada', 'dream', got 'Dream'"),
    "Dream's mask_candidate under LLaDA's rule": ({"mask_candidate": "dream"}, ValueError,
                                                  "mask_candidate='dream' is the rule of the dream sampler; with rule='llada' use 'exclude' or 'llada'"),
    "LLaDA's mask_candidate under Dream's rule": ({**DREAM, "mask_candidate": "llada"}, ValueError,
                                                  "mask_candidate='llada' is the rule of the llada sampler; with rule='dream' use 'exclude' or 'dream'"),
    "alg under LLaDA's rule": ({"alg": "entropy"}, ValueError, "alg is an option of rule='dream'"),
    "alg_temp under LLaDA's rule": ({"alg_temp": 0.5}, ValueError, "alg_temp is an option of rule='dream'"),
    "eps under LLaDA's rule": ({"eps": 1e-3}, ValueError, "eps is an option of rule='dream'"),
    "top_p under LLaDA's rule": ({"top_p": 0.9}, ValueError, "top_p is an option of rule='dream'"),
    "top_k under LLaDA's rule": ({"top_k": 5}, ValueError, "top_k is an option of rule='dream'"),
    "blocks under Dream's rule": ({"rule": "dream"}, ValueError, r"block_length must be None or gen_length \(8\) with rule='dream'"),
    "remasking under Dream's rule": ({**DREAM, "remasking": "random"}, ValueError, "remasking is an option of rule='llada'"),
    "cfg_scale under Dream's rule": ({**DREAM, "cfg_scale": 1.0}, ValueError, "cfg_scale is an option of rule='llada'"),
    "logits_eos_inf under Dream's rule": ({**DREAM, "logits_eos_inf": True, "eos_id": 2}, ValueError,
                                          "logits_eos_inf is an option of rule='llada'"),
    "confidence_eos_eot_inf under Dream's rule": ({**DREAM, "confidence_eos_eot_inf": True}, ValueError,
                                                  "confidence_eos_eot_inf is an option of rule='llada'"),
    "alg": ({**DREAM, "alg": "greedy"}, ValueError, "alg must be one of 'origin', 'maskgit_plus', 'topk_margin', 'entropy', got 'greedy'"),
    "negative alg_temp": ({**DREAM, "alg_temp": -0.5}, ValueError, "alg_temp must be a finite number >= 0"),
    "tensor alg_temp": ({**DREAM, "alg_temp": torch.tensor(0.5)}, TypeError, "alg_temp must be a Python float"),
    "eps of 1": ({**DREAM, "eps": 1.0}, ValueError, r"eps must lie in \[0, 1\)"),
    "string eps": ({**DREAM, "eps": "1e-3"}, TypeError, "eps must be a float, got str"),
    "top_p of 0": ({**DREAM, "top_p": 0.0}, ValueError, "top_p must be a finite number > 0"),
    "top_p above 1": ({**DREAM, "top_p": 1.5}, ValueError, r"top_p must be <= 1 \(1: no filter\), got 1.5"),
    "top_k of 0": ({**DREAM, "top_k": 0}, ValueError, "top_k must be >= 1, got 0"),
    "float top_k": ({**DREAM, "top_k": 5.0}, TypeError, "top_k must be an int, got float"),
    "negative cfg_scale": ({"cfg_scale": -1.0}, ValueError, "cfg_scale must be a finite number >= 0"),
    "tensor cfg_scale": ({"cfg_scale": torch.tensor(1.0)}, TypeError, "cfg_scale must be a Python float"),
    "logits_eos_inf type": ({"logits_eos_inf": 1, "eos_id": 2}, TypeError, "logits_eos_inf must be a bool, got int"),
    "confidence_eos_eot_inf type": ({"confidence_eos_eot_inf": "yes"}, TypeError, "confidence_eos_eot_inf must be a bool"),
    "logits_eos_inf without eos_id": ({"logits_eos_inf": True}, ValueError, r"eos_id must be given with logits_eos_inf=True"),
    "confidence option without eos_id": ({"confidence_eos_eot_inf": True, "eot_id": 3}, ValueError,
                                          r"eos_id must be given with confidence_eos_eot_inf=True"),
    "confidence option without eot_id": ({"confidence_eos_eot_inf": True, "eos_id": 2}, ValueError,
                                         r"eot_id must be given with confidence_eos_eot_inf=True"),
    "eos_id out of range": ({"eos_id": VOCAB}, ValueError, rf"eos_id must be in \[0, {VOCAB}\), got {VOCAB}"),
    "float eot_id": ({"eot_id": 2.0}, TypeError, "eot_id must be an int, got float"),
    "negative row_offset": ({"row_offset": -1}, ValueError, "row_offset must be >= 0, got -1"),
    "float row_offset": ({"row_offset": 1.0}, TypeError, "row_offset must be an int, got float"),
    # L = 3 + 8 = 11: the last row id (row_offset + 1) * 11 - 1 would not fit in 32 bits.
    "row_offset past 32 bits": (
        {"row_offset": 2**32 // 11}, ValueError,
        r"row_offset must keep \(row_offset \+ B\) \* L <= 2\*\*32 .*got row_offset = 390451572 with B = 1, L = 11",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_generate_rejects(case):
    overrides, error, message = BAD_INPUT[case]
    kwargs = {"lm": _simple_lm(), "prompt_ids": torch.tensor([[3, 1, 4]]), "gen_length": 8, "steps": 4, "block_length": 4, "seed": 0}
    kwargs.update(overrides)
    before = snapshot(kwargs["prompt_ids"])
    with pytest.raises(error, match=message):
        generate(kwargs.pop("lm"), kwargs.pop("prompt_ids"), **kwargs)
    assert_unchanged(before, overrides.get("prompt_ids", torch.tensor([[3, 1, 4]])))


def test_a_sequence_past_the_models_position_limit_is_refused_by_name(backend):
    # BERT's 16 learned positions: a prompt of 12 and 8 generated tokens would fail inside transformers.
    lm = MaskedLM.from_hf(bert(max_positions=16, vocab=VOCAB), mask_id=MASK_ID, verify=False)
    prompt = torch.randint(1, MASK_ID, (2, 12), generator=torch.Generator().manual_seed(0))
    before = snapshot(prompt)
    message = (r"gen_length: P \+ G with prompt_ids' P = 12 and gen_length G = 8 = 20 positions, more than the model "
               r"accepts \(lm.max_length = 16")
    with pytest.raises(ValueError, match=message):
        generate(lm, prompt, gen_length=8, steps=4, block_length=4, seed=0)
    assert_unchanged(before, prompt)
    rollout = generate(lm, prompt, gen_length=4, steps=2, block_length=4, seed=0)  # P + G = 16 fits
    assert rollout.sequences.shape == (2, 16) and not (rollout.sequences == MASK_ID).any()
    # A block-causal model is checked before its block-wise decoding.
    block = MaskedLM(lm.hidden, lm.head_weight, lm.head_bias, MASK_ID, attention=("block", 4), max_length=16)
    with pytest.raises(ValueError, match="gen_length: P"):
        generate(block, prompt, gen_length=8, steps=4, seed=0)


def test_shift_model_needs_a_prompt_token_per_row():
    lm = _simple_lm()
    lm.shift = True
    with pytest.raises(ValueError, match="prompt_mask must leave at least one prompt token per row"):
        generate(lm, torch.tensor([[3, 1], [2, 2]]), prompt_mask=torch.tensor([[True, True], [False, False]]),
                 gen_length=4, steps=4, block_length=4, seed=0)
    with pytest.raises(ValueError, match="prompt_ids must have at least one column"):
        generate(lm, torch.ones(1, 0, dtype=torch.long), gen_length=4, steps=4, block_length=4, seed=0)


def test_rollout_fields(lm, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout = generate(lm, torch.tensor([[3, 1, 4]]), gen_length=4, steps=2, block_length=4, seed=0)
    assert isinstance(rollout, Rollout)
    assert rollout.sequences.dtype == torch.long and rollout.commit_step.dtype == torch.long
    assert rollout.commit_confidence.dtype == torch.float32 and rollout.step_gain.shape == (1, 2)
    assert rollout.attention_mask is None and rollout.prompt_length == 3 and rollout.num_steps == 2
    assert rollout.branches == () and rollout.mask_id == MASK_ID and rollout.nfe == 2


def test_answer_mask_ends_at_the_first_eos(lm, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    prompts = torch.tensor([[3, 9, 4], [9, 7, 1], [2, 2, 5]])  # the EOS id 9 in a prompt does not count
    rollout = generate(lm, prompts, gen_length=6, steps=6, block_length=6, seed=0)
    sequences = rollout.sequences.clone()
    sequences[:, 3:] = 5
    sequences[0, [5, 7]] = 9  # answer: columns 3..5
    sequences[2, 3] = 9  # answer: the EOS alone; row 1 has none and its answer is all it generated
    rollout = dataclasses.replace(rollout, sequences=sequences)
    want = torch.zeros(3, 9, dtype=torch.bool)
    want[0, 3:6] = want[1, 3:] = want[2, 3] = True
    assert torch.equal(rollout.answer_mask(9), want)
    assert not (rollout.answer_mask(9) & ~rollout.completion_mask).any()
    with pytest.raises(TypeError, match="eos_id must be an int"):
        rollout.answer_mask(torch.tensor(9))
    # The same rule over a leading dimension (the Z fillings of a branch): each filling on its own.
    fillings = torch.stack([sequences, sequences.roll(1, dims=0)])
    stacked = answer_mask(fillings, rollout.completion_mask, 9)
    assert torch.equal(stacked[0], want) and torch.equal(stacked[1], want.roll(1, dims=0))
    with pytest.raises(TypeError, match="completion_mask must have dtype"):
        answer_mask(fillings, rollout.completion_mask.long(), 9)
    with pytest.raises(ValueError, match="completion_mask must have the shape of sequences"):
        answer_mask(fillings, rollout.completion_mask[:, 1:], 9)


def _answer_case():
    sequences = torch.tensor([[3, 4, 9, 5], [3, 9, 9, 5]])
    return sequences, torch.tensor([[False, True, True, True]] * 2)


ANSWER_MASK_BAD_INPUT = {
    "sequences not a tensor": (lambda s, c: ([[3, 4]], c, 9), TypeError, "sequences must be a torch.Tensor, got list"),
    "float sequences": (lambda s, c: (s.float(), c, 9), TypeError, "sequences must have dtype"),
    "0-d sequences": (lambda s, c: (s[0, 0], c, 9), ValueError, "sequences must have at least 1 dims"),
    "int completion_mask": (lambda s, c: (s, c.long(), 9), TypeError, "completion_mask must have dtype"),
    "completion_mask rows": (lambda s, c: (s, c[:1].expand(3, 4), 9), ValueError,
                             r"completion_mask must have the shape of sequences \(2, 4\) or of its last dimensions, got \(3, 4\)"),
    "completion_mask longer than sequences": (lambda s, c: (s, c.expand(2, 2, 4), 9), ValueError,
                                              r"completion_mask must have the shape of sequences .* got \(2, 2, 4\)"),
    "completion_mask length": (lambda s, c: (s, c[:, 1:], 9), ValueError, "completion_mask must have the shape of sequences"),
    "completion_mask device": (lambda s, c: (s, c.to("meta"), 9), ValueError, "completion_mask is on meta but sequences is on cpu"),
    "negative eos_id": (lambda s, c: (s, c, -1), ValueError, "eos_id must be in"),
    "eos_id past int64": (lambda s, c: (s, c, 2**70), ValueError, "eos_id must be in"),
    "tensor eos_id": (lambda s, c: (s, c, torch.tensor(9)), TypeError, "eos_id must be an int, got Tensor"),
    "bool eos_id": (lambda s, c: (s, c, True), TypeError, "eos_id must be an int, got bool"),
}


@pytest.mark.parametrize("case", list(ANSWER_MASK_BAD_INPUT))
def test_answer_mask_refuses_bad_input_by_name(case):
    build, error, message = ANSWER_MASK_BAD_INPUT[case]
    sequences, completion = _answer_case()
    before = snapshot(sequences, completion)
    with pytest.raises(error, match=message):
        answer_mask(*build(sequences, completion))
    assert_unchanged(before, sequences, completion)
    want = torch.tensor([[False, True, True, False], [False, True, False, False]])
    assert torch.equal(answer_mask(sequences, completion, 9), want)
    assert torch.equal(answer_mask(sequences.int()[None].expand(2, 2, 4), completion, 9), want.expand(2, 2, 4))


def test_confidence_ties_commit_the_lowest_positions_first(monkeypatch):
    # Every masked position reads the same hidden state (the mask embedding): equal confidences. Small
    # integer weights make every logit exact, so no BLAS blocking can break the tie by a rounding.
    monkeypatch.setenv("DACA_BACKEND", "torch")
    g = torch.Generator().manual_seed(0)
    embedding = torch.randint(-2, 3, (VOCAB, 8), generator=g).float()
    lm = MaskedLM(lambda ids, mask: embedding[ids], torch.randint(-2, 3, (VOCAB, 8), generator=g).float(), None, MASK_ID)
    rollout = generate(lm, torch.tensor([[3, 1, 4], [2, 7, 1]]), gen_length=8, steps=8, block_length=4, seed=0)
    expected = torch.tensor([-1, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(rollout.commit_step, expected.expand(2, -1))
    ref = reference.reference_generate(lm, torch.tensor([[3, 1, 4], [2, 7, 1]]), gen_length=8, steps=8, block_length=4, seed=0)
    assert torch.equal(ref.commit_step, rollout.commit_step)
