"""``likelihood.branch_logprob``: DiSPO's one-step likelihood of each filling given its branch
state, against log-softmax of the full float64 logits of the state; gradients through the model;
bad input refused by name."""
import copy

import pytest
import torch
from support import assert_model_gradients_close, assert_no_worse_than_torch, assert_unchanged, snapshot
from tiny_models import MASK_ID, MODELS, VOCAB, bidirectional

from daca_kernels import branch_logprob
from daca_kernels.models.masked_lm import MaskedLM

STATES, FILLINGS, LENGTH = 3, 3, 11


def branch_case(seed=0):
    """``(state [3, 11], fillings [9, 11], filled [9, 11], attention_mask [3, 11])``: random states
    masked at random positions of columns >= 4 (ragged: row 1 keeps one masked position), left
    padding on state 2, fillings drawn at the masked positions of their state."""
    g = torch.Generator().manual_seed(seed)
    state = torch.randint(3, VOCAB - 1, (STATES, LENGTH), generator=g)
    masked = (torch.rand(STATES, LENGTH, generator=g) < 0.5) & (torch.arange(LENGTH) >= 4)
    masked[:, 4] = True
    masked[1, 5:] = False
    state = state.masked_fill(masked, MASK_ID)
    attention_mask = torch.ones(STATES, LENGTH, dtype=torch.long)
    attention_mask[2, :2] = 0
    filled = masked.repeat_interleave(FILLINGS, dim=0)
    fillings = torch.where(filled, torch.randint(3, VOCAB - 1, filled.shape, generator=g),
                           state.repeat_interleave(FILLINGS, dim=0))
    return state, fillings, filled, attention_mask


def direct(model, state, fillings, filled, attention_mask, shift):
    """The same quantity from the full logits: log_softmax of state r // Z, gathered at filling r."""
    logits = model(input_ids=state, attention_mask=attention_mask).logits
    if shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    logp = torch.log_softmax(logits, dim=-1).repeat_interleave(fillings.shape[0] // state.shape[0], dim=0)
    return torch.where(filled, logp.gather(-1, fillings[..., None]).squeeze(-1), 0.0)


def values_and_grads(fn, model, upstream):
    model.zero_grad(set_to_none=True)
    out = fn(model)
    (out * upstream.to(out.dtype)).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [("torch", m) for m in MODELS] + [("triton", "bidirectional")]


@pytest.mark.parametrize("backend_name,model_name", CASES)
def test_matches_the_full_logits_of_the_state(monkeypatch, backend_name, model_name):
    monkeypatch.setenv("DACA_BACKEND", backend_name)
    build, shift = MODELS[model_name]
    model = build()
    model64 = copy.deepcopy(model).double()
    state, fillings, filled, attention_mask = branch_case(seed=len(model_name))
    upstream = torch.randn(filled.shape, generator=torch.Generator().manual_seed(5))
    before = snapshot(state, fillings, filled, attention_mask)

    fused = values_and_grads(lambda m: branch_logprob(MaskedLM.from_hf(m, mask_id=MASK_ID, shift=shift), state,
                                                      fillings, filled, attention_mask=attention_mask), model, upstream)
    assert_unchanged(before, state, fillings, filled, attention_mask)
    plain = values_and_grads(lambda m: direct(m, state, fillings, filled, attention_mask, shift), model, upstream)
    ref = values_and_grads(lambda m: direct(m, state, fillings, filled, attention_mask, shift), model64,
                           upstream.double())

    assert fused[0].dtype == torch.float32
    assert (fused[0][~filled] == 0).all() and (fused[0][filled] < 0).all()
    assert_no_worse_than_torch(fused[0], plain[0], ref[0], 1e-5 * (1 + ref[0].abs()), "branch logprob")
    assert_model_gradients_close(fused[1], ref[1], plain[1])


def test_fillings_of_one_state_share_its_forward_pass(monkeypatch):
    # Z fillings of a state cost one backbone pass: B passes in all, whatever Z.
    monkeypatch.setenv("DACA_BACKEND", "torch")
    lm = MaskedLM.from_hf(bidirectional(), mask_id=MASK_ID)
    calls = []
    hidden = lm.hidden
    monkeypatch.setattr(lm, "hidden", lambda ids, am=None: calls.append(ids.shape) or hidden(ids, am))
    state, fillings, filled, attention_mask = branch_case()
    branch_logprob(lm, state, fillings, filled, attention_mask=attention_mask)
    assert calls == [state.shape]


def test_nothing_filled_runs_no_forward_pass(monkeypatch):
    lm = MaskedLM.from_hf(bidirectional(), mask_id=MASK_ID)
    monkeypatch.setattr(lm, "hidden", lambda *a: pytest.fail("forward pass with nothing to score"))
    state, _, filled, _ = branch_case()
    out = branch_logprob(lm, state, state.repeat_interleave(FILLINGS, dim=0), torch.zeros_like(filled))
    assert out.shape == filled.shape and (out == 0).all()


@pytest.fixture(scope="module")
def tiny_lm():
    return MaskedLM.from_hf(bidirectional(seed=2), mask_id=MASK_ID)


BAD_CASES = {
    "not a MaskedLM": (lambda lm, s, f, d: branch_logprob(lm.module, s, f, d), TypeError, "lm must be a MaskedLM"),
    "float state": (lambda lm, s, f, d: branch_logprob(lm, s.float(), f, d), TypeError, "state must have dtype"),
    "float fillings": (lambda lm, s, f, d: branch_logprob(lm, s, f.float(), d), TypeError, "fillings must have dtype"),
    "fillings not a multiple": (lambda lm, s, f, d: branch_logprob(lm, s, f[1:], d[1:]), ValueError,
                                r"fillings must have shape \[B \* Z, L\]"),
    "fillings length": (lambda lm, s, f, d: branch_logprob(lm, s, f[:, 1:], d[:, 1:]), ValueError,
                        r"fillings must have shape \[B \* Z, L\]"),
    "filling id out of range": (lambda lm, s, f, d: branch_logprob(lm, s, f.masked_fill(d, VOCAB), d), ValueError,
                                r"fillings must lie in \[0, 53\)"),
    "int filled": (lambda lm, s, f, d: branch_logprob(lm, s, f, d.long()), TypeError, "filled must have dtype"),
    "filled shape": (lambda lm, s, f, d: branch_logprob(lm, s, f, d[:3]), ValueError, r"filled must have shape \[R, L\]"),
    "filled position not masked": (lambda lm, s, f, d: branch_logprob(lm, s, f, torch.ones_like(d)), ValueError,
                                   r"filled must be a subset of \(state == lm.mask_id\): filled\[0, 0\]"),
    "attention mask shape": (lambda lm, s, f, d: branch_logprob(lm, s, f, d, attention_mask=d), ValueError,
                             r"attention_mask must have shape \[B, L\] \(from state\)"),
    "state id out of range": (lambda lm, s, f, d: branch_logprob(lm, s.masked_fill(s == MASK_ID, -1), f, d),
                              ValueError, r"state must lie in \[0, 53\)"),
    "fillings device": (lambda lm, s, f, d: branch_logprob(lm, s, f.to("meta"), d), ValueError,
                        "fillings is on meta but state is on cpu"),
    # Branch.sequences [Z, B, L] flattened with reshape(-1, L): rows in z * B + b order.
    "fillings ordered by filling, then state": (
        lambda lm, s, f, d: branch_logprob(lm, s, f.view(STATES, FILLINGS, LENGTH).transpose(0, 1).reshape(-1, LENGTH), d),
        ValueError, r"fillings must equal their state outside filled.*: fillings\[1, 0\] = \d+ but state\[0, 0\] = \d+"),
    "filling differs from its state": (lambda lm, s, f, d: branch_logprob(lm, s, f.masked_fill(~d, 3), d), ValueError,
                                       "fillings must equal their state outside filled"),
    "mask id filled": (lambda lm, s, f, d: branch_logprob(lm, s, f.masked_fill(d, MASK_ID), d), ValueError,
                       r"fillings must hold a token other than lm.mask_id at filled positions: fillings\[0, 4\]"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_refused_by_name(case, tiny_lm):
    call, error, message = BAD_CASES[case]
    state, fillings, filled, _ = branch_case()
    before = snapshot(state, fillings, filled)
    with pytest.raises(error, match=message):
        call(tiny_lm, state, fillings, filled)
    assert_unchanged(before, state, fillings, filled)


def test_shift_refuses_a_filled_position_zero():
    lm = MaskedLM.from_hf(bidirectional(), mask_id=MASK_ID, shift=True)
    state, fillings, filled, _ = branch_case()
    state[:, 0] = MASK_ID
    filled[0, 0] = True
    with pytest.raises(ValueError, match=r"filled\[:, 0\] must be False when lm.shift"):
        branch_logprob(lm, state, fillings, filled)
