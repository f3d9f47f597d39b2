"""Checks once per public call, and no check that reads a tensor on the hot path.

One RL step of :mod:`daca_kernels.rl_step` (the TRL trainer's and the loop's) runs on the CPU with
index ranges guarded on the device as on CUDA, every tensor-to-host read recorded: no read comes
from a check, and the reads left are those the computation needs (a data-dependent shape per
masked pass, whether a batch is padded per forward call), held to their count. An estimator call
enters each check of each of its arguments once, however deep the call goes; so does a ``generate``
call, whose only value-reading checks are its prompt's, once per call, outside the decode.
"""
import sys
from collections import Counter

import pytest
import torch
from families import sdar
from tiny_models import tiny_masked_lm

from daca_kernels import validation
from daca_kernels.likelihood import ESTIMATORS, estimate_logprob, monte_carlo_masks
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rl_step import (
    Fillings,
    StepBatch,
    StepOptions,
    chunk_normaliser,
    objective_loss,
    old_values,
    reference_values,
    step_logprob,
)
from daca_kernels.rollout import generate

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")

ROWS, PROMPT, GEN, Z, SEED = 3, 3, 6, 2, 11


@pytest.fixture(scope="module")
def lm():
    return tiny_masked_lm(vocab=37, hidden=16, seed=3)


def make_batch(lm) -> StepBatch:
    """Left-padded prompts (row 0 has one pad), an answer ending early in row 1, advantages of both
    signs, and Z = 2 fillings of a state with a third of the completion masked (DiSPO)."""
    g = torch.Generator().manual_seed(0)
    length = PROMPT + GEN
    ids = torch.randint(0, lm.mask_id, (ROWS, length), generator=g)
    attention = torch.ones(ROWS, length, dtype=torch.long)
    attention[0, 0] = 0
    completion = torch.zeros(ROWS, length, dtype=torch.bool)
    completion[:, PROMPT:] = True
    loss_mask = completion.clone()
    loss_mask[1, PROMPT + 3:] = False
    filled = completion & (torch.arange(length) % 3 == 0)
    state = ids.masked_fill(filled, lm.mask_id)
    fillings = state.repeat_interleave(Z, dim=0)
    filled_rows = filled.repeat_interleave(Z, dim=0)
    fillings = torch.where(filled_rows, torch.randint(0, lm.mask_id, fillings.shape, generator=g), fillings)
    rewards = torch.rand(ROWS * Z, generator=g)
    return StepBatch(ids, attention, completion, loss_mask, torch.tensor([0.9, -1.1, 0.4]), generation_length=GEN,
                     fillings=Fillings(state, fillings, filled_rows, rewards, Z))


def training_step(lm, options: StepOptions, batch: StepBatch) -> None:
    """One step as the trainers take it: the old and reference values, then the loss back-propagated."""
    filled = batch.fillings.filled.sum().float() if options.objective == "dispo" else None
    normaliser = chunk_normaliser(batch.loss_mask.sum().float(), filled)
    old = old_values(lm, options, batch, SEED)
    ref = reference_values(lm, options, batch, SEED) if options.needs_reference else None
    old_step = None
    if options.objective == "dispo":
        with torch.no_grad():
            old_step = step_logprob(lm, batch)
    objective_loss(lm, options, batch, SEED, normaliser, old=old, ref=ref, old_step=old_step,
                   backward=torch.Tensor.backward)


# The reads of one step, by the function that makes them: none is a check. A masked pass gathers
# its scored positions (a data-dependent shape: one read per pass), and a forward call asks
# whether the batch is padded (one read per call); DiSPO gathers the filled positions once per call.
NEEDED_READS = {"logprob_by_stratum", "_padded", "branch_logprob"}
STEPS = {  # (objective, estimator): reads of one step (old values, reference values, loss and backward)
    ("grpo", "one_step"): 6,
    ("grpo", "stratified"): 24,
    ("bgpo", "stratified"): 16,
    ("spg", "elbo"): 4,
    ("dispo", "one_step"): 10,
}


@pytest.mark.parametrize("objective,estimator", list(STEPS))
def test_one_training_step_reads_the_device_only_where_the_computation_needs_it(count_host_reads, lm, objective,
                                                                              estimator):
    options = StepOptions(objective=objective, estimator=estimator, beta=0.04 if objective in ("grpo", "dispo") else 0.0)
    batch = make_batch(lm)
    lm.module.zero_grad()
    with count_host_reads() as reads:
        training_step(lm, options, batch)
    assert all(p.grad is not None for p in lm.module.parameters() if p.requires_grad), "the step must train"
    checks = [stack for stack in reads
              if any(file == "validation.py" or function.startswith(("check", "_check")) for file, function in stack)]
    assert not checks, f"checks read the device: {checks}"
    by_reader = Counter(stack[0][1] for stack in reads)
    assert set(by_reader) <= NEEDED_READS, f"reads outside the computation's own: {by_reader}"
    assert len(reads) == STEPS[objective, estimator], f"{len(reads)} reads: {by_reader}"


def entered_checks(call) -> Counter:
    """How often ``call()`` enters each function of :mod:`daca_kernels.validation` from outside it,
    keyed by ``(function, the names it is given)``."""
    entries = Counter()
    module = validation.__file__

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == module and frame.f_back.f_code.co_filename != module:
            arguments = frame.f_locals
            names = [v for v in arguments.values() if isinstance(v, str)] + sorted(arguments.get("others", {}))
            entries[frame.f_code.co_name, tuple(names)] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries


# The device guards (not checks) run once per launch or per result.
GUARDS = {"guard_index", "nan_where_invalid", "reads_values"}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_an_estimator_call_checks_each_argument_once(lm, estimator):
    batch = make_batch(lm)
    entries = entered_checks(lambda: estimate_logprob(
        lm, batch.input_ids, batch.completion_mask, batch.loss_mask, batch.attention_mask, estimator=estimator,
        seed=SEED, elbo_samples=3, num_strata=3))
    checks = {key: n for key, n in entries.items() if key[0] not in GUARDS}
    assert {"check_tensor", "check_index_range", "check_row_offset"} <= {function for function, _ in checks}
    repeated = {key: n for key, n in checks.items() if n > 1}
    assert not repeated, f"checks entered more than once in one call: {repeated}"


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_without_value_checks_the_estimators_give_nan_where_the_checks_raise(no_host_reads, lm, estimator):
    # Checks guarded on the device as on CUDA: a scored prompt position (loss_mask outside
    # completion_mask; the ValueError of tests/likelihood on the CPU) is NaN, read nowhere, and
    # every other position keeps its value.
    batch = make_batch(lm)
    settings = dict(estimator=estimator, seed=SEED, num_strata=3, elbo_samples=3)
    loss_mask = batch.loss_mask.clone()
    loss_mask[0, 1] = True
    with no_host_reads():
        good = estimate_logprob(lm, batch.input_ids, batch.completion_mask, batch.loss_mask, None, **settings)
        out = estimate_logprob(lm, batch.input_ids, batch.completion_mask, loss_mask, None, **settings)
    bad = torch.zeros_like(loss_mask)
    bad[0, 1] = True
    assert torch.isnan(out[bad]).all() and not torch.isnan(out[~bad]).any()
    rows = slice(1, None) if estimator == "elbo" else slice(None)  # ELBO draws row 0's masks over its loss_mask
    torch.testing.assert_close(out[rows][~bad[rows]], good[rows][~bad[rows]], rtol=1e-6, atol=1e-6)
    with no_host_reads():
        samples = monte_carlo_masks(batch.input_ids, batch.completion_mask, loss_mask, None, estimator="stratified",
                                    seed=SEED, mask_id=lm.mask_id)
    assert all(torch.isnan(s.t[0]) and not torch.isnan(s.t[1:]).any() for s in samples)


def test_without_value_checks_an_id_out_of_range_is_nan_where_scored(no_host_reads, lm):
    # One-step masks the whole completion, so a scored id reaches only the head (linear_logprob's
    # guard); elsewhere its row keeps its values.
    batch = make_batch(lm)
    ids = batch.input_ids.clone()
    ids[2, PROMPT + 1] = lm.vocab_size + 3
    with no_host_reads():
        good = estimate_logprob(lm, batch.input_ids, batch.completion_mask, batch.loss_mask, None, estimator="one_step",
                                seed=SEED)
        out = estimate_logprob(lm, ids, batch.completion_mask, batch.loss_mask, None, estimator="one_step", seed=SEED)
    bad = torch.zeros_like(batch.loss_mask)
    bad[2, PROMPT + 1] = True
    assert torch.isnan(out[bad]).all() and not torch.isnan(out[~bad]).any()
    torch.testing.assert_close(out[~bad], good[~bad], rtol=1e-6, atol=1e-6)


# A generate call per rule: LLaDA's (with a branch state), Dream's, LLaDA's with a prefix KV cache, and
# block-wise decoding of a block-causal model (the SDAR double, blocks of 4; with a branch state too):
# row 0's padding spreads its completion over three blocks.
GENERATE_CASES = {  # case: (block-causal model, generate's options, denoising steps taken)
    "llada": (False, dict(steps=8, block_length=4), 8),
    "llada-branch": (False, dict(steps=8, block_length=4, branch_steps=[3]), 8),
    "dream": (False, dict(steps=8, rule="dream"), 8),
    "llada-prefix-cache": (False, dict(steps=8, block_length=4, kv_cache="prefix"), 8),
    "blockwise": (True, dict(steps=4), 12),
    "blockwise-branch": (True, dict(steps=4, branch_steps=[5]), 12),
}
# Per step, a result guard: on the CPU a NaN confidence raises (names the step), on CUDA it stays NaN.
RESULT_GUARDS = GUARDS | {"check_not_nan"}


@pytest.fixture(scope="module")
def block_lm():
    return MaskedLM.from_hf(sdar.tiny(seed=1).eval())


def generate_call(lm, block_lm, case: str):
    block, options, _ = GENERATE_CASES[case]
    model = block_lm if block else lm
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.mask_id, (ROWS, 4), generator=g)
    prompt_mask = torch.ones(ROWS, 4, dtype=torch.long)
    prompt_mask[0, 0] = 0
    return lambda: generate(model, prompt, gen_length=8, seed=SEED, temperature=0.7, prompt_mask=prompt_mask, **options)


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_a_generate_call_checks_each_argument_once(lm, block_lm, case):
    entries = entered_checks(generate_call(lm, block_lm, case))
    checks = {key: n for key, n in entries.items() if key[0] not in RESULT_GUARDS}
    assert {("check_tensor", ("prompt_ids",)), ("check_int", ("gen_length",))} <= set(checks)
    repeated = {key: n for key, n in checks.items() if n > 1}
    assert not repeated, f"checks entered more than once in one call: {repeated}"
    steps = GENERATE_CASES[case][2]
    assert sum(n for key, n in entries.items() if key[0] == "check_not_nan") == steps  # once per step


# A generate call checks its prompt once, reading it (ids in range and not the mask id; the padding
# mask of 0/1 describing left padding): before a decode of many forward passes, and a clear error
# rather than a NaN rollout. No check reads the device inside the decode.
ENTRY_CHECKS = {"_check_prompt_ids", "_check_prompt_mask"}
# All reads of a call: the checks' 4, then per step the decode's own (the still-masked positions,
# whether a commit changed the input, the commit rule's per-row choice), a padded forward's question, a
# branch state's gather and forward; block-wise, once per call, the block layout's first block and length.
GENERATE_READS = {"llada": 92, "llada-branch": 94, "dream": 68, "llada-prefix-cache": 93, "blockwise": 106,
                  "blockwise-branch": 111}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_a_generate_call_reads_the_device_only_where_decoding_needs_it(count_host_reads, lm, block_lm, case):
    call = generate_call(lm, block_lm, case)
    with count_host_reads() as reads:
        call()
    checks = [stack for stack in reads
              if any(file == "validation.py" or function.startswith(("check", "_check")) for file, function in stack)]
    in_decode = [stack for stack in checks if not ENTRY_CHECKS & {function for _, function in stack}]
    assert not in_decode, f"checks read the device inside the decode: {in_decode}"
    assert len(checks) == 4, f"the prompt's checks read {len(checks)} times"
    assert len(reads) == GENERATE_READS[case], f"{len(reads)} reads: {Counter(stack[0][1] for stack in reads)}"
