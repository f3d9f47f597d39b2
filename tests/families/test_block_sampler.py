"""Block-wise decoding of block-causal models (``daca_kernels.rollout.blockwise``) on the SDAR and LLaDA2 doubles.

The oracles: ``sdar_generate`` below, a plain re-implementation of SDAR's released
``block_diffusion_generate`` as the double's docstring describes it (prefill, ``store_kv`` reads and
stores on a ``SubscriptableCache``, top-k/top-p ``multinomial`` sampling, the static and dynamic
confidence rules), and the LLaDA2 double's own ``generate`` (no cache, the prefix recomputed each
step). Both draw with ``torch.multinomial``; :class:`HashedDraws` replaces it, while they run, by the
Gumbel-max draw of the library's counter-hash uniforms of the same ``(step in block, row id, token)``,
an exact sampler of the same distribution, so the two sides meet token for token. "Greedy" runs the
oracles with ``multinomial`` replaced by the argmax at temperature 1 (SDAR's script has no greedy
branch; LLaDA2's temperature 0 is its own).

The models are the float64 doubles with a biased head whose mask-id entry is ``-1e4``: the released
rules let the mask id compete; its probability is then exactly 0, so they propose what the library
(which never proposes it) does.
"""
import functools

import pytest
import torch
from support import assert_close_reduced, assert_model_gradients_close, assert_unchanged, snapshot
from torch import nn

from daca_kernels.credit import dps_weights
from daca_kernels.hashing import gumbel_hash, seed32, uniform_from_hash
from daca_kernels.likelihood import branch_logprob
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rollout import branch, generate
from families import llada2, sdar

SIZE, MASK_ID = 4, 60
pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


def biased(model):
    """The float64 double with a random head bias, the mask id's entry -1e4."""
    model = model.double()
    weight = model.lm_head.weight.detach()
    model.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model.lm_head.weight.copy_(weight)
        model.lm_head.bias.copy_(torch.randn(weight.shape[0], generator=g, dtype=torch.float64))
        model.lm_head.bias[MASK_ID] = -1e4
    return model.eval()


# The doubles' longest reduction (their MLP's width, 64) and the narrowest dtype their log-probabilities
# pass through: both run in float64, but LLaDA2's released forward casts its logits to float32, so a
# value it computes along two paths may differ by float32 rounding.
REDUCTION = 64
THROUGH = {"sdar": torch.float64, "llada2": torch.float32}


@functools.cache
def _model(family):
    if family == "sdar":
        return biased(sdar.tiny(seed=1))
    return biased(llada2.tiny(seed=1, use_cache=False))


@functools.cache
def lm_of(family) -> MaskedLM:
    model = _model(family)
    return MaskedLM.from_hf(model, **({} if family == "sdar" else dict(mask_id=MASK_ID, block_size=SIZE)))


def prompts(batch, length, pads, seed=0):
    ids = torch.randint(0, 58, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b, pad in enumerate(pads):
        mask[b, :pad] = False
        ids[b, :pad] = 59
    return ids, (mask if any(pads) else None)


def gumbel(u):
    return -torch.log(-torch.log(u))


class HashedDraws:
    """``torch.multinomial(probs, 1)`` over the rows of one block of a batch-1 decode, replaced by the
    Gumbel-max of the counter-hash uniforms of ``(step in block, row id = position - prompt length,
    token)`` (greedy: the argmax). ``start`` and ``step`` say where the decode is."""

    def __init__(self, seed, prompt_length, greedy):
        self.seed, self.prompt_length, self.greedy = seed32(seed), prompt_length, greedy
        self.start, self.step = None, -1

    def at(self, start):
        self.step = self.step + 1 if start == self.start else 0
        self.start = start

    def multinomial(self, probs, num_samples=1, replacement=False):
        assert num_samples == 1 and probs.dim() == 2
        if self.greedy:
            return probs.argmax(dim=-1, keepdim=True)
        row_ids = (self.start + torch.arange(probs.shape[0]) - self.prompt_length).clamp(min=0)
        tokens = torch.arange(probs.shape[1])
        u = uniform_from_hash(gumbel_hash(self.seed, self.step, row_ids[:, None], tokens))
        return (probs.log() + gumbel(u).to(probs.dtype)).argmax(dim=-1, keepdim=True)


def sdar_sample(logits, temperature, top_k, top_p):
    """SDAR's ``sample_with_temperature_topk_topp``: always a ``multinomial`` draw."""
    logits = logits.reshape(-1, logits.shape[-1])
    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1:], float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        drop = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    token = torch.multinomial(probs, num_samples=1)
    return token.squeeze(-1), probs.gather(-1, token).squeeze(-1)


def sdar_generate(model, prompt, draws, *, gen_length, block_length, denoising_steps, temperature, top_k, top_p,
                  remasking_strategy, confidence_threshold, stop_id=None):
    """SDAR's released ``block_diffusion_generate`` (batch 1, see the double's docstring; ``stop_id``:
    its ``stopping_criteria_idx`` of one id). Returns ``(x, history)``, ``history[s] = (block start,
    masked [L] before step s, confidence [L] there (NaN elsewhere), x after step s)``."""
    prompt_length = prompt.shape[1]
    num_blocks = -(-(prompt_length + gen_length) // block_length)
    total = num_blocks * block_length
    mask = sdar.block_diffusion_attention_mask(total, block_length)
    positions = torch.arange(total)[None]
    x = torch.full((1, total), MASK_ID, dtype=torch.long)
    x[:, :prompt_length] = prompt
    cache = sdar.SubscriptableCache()
    first = prompt_length // block_length
    if first > 0:
        n = first * block_length
        model(x[:, :n], attention_mask=mask[:, :n, :n], position_ids=positions[:, :n], past_key_values=cache,
              use_cache=True, store_kv=True)
    counts = sdar.get_num_transfer_tokens(block_length, denoising_steps)
    history = []
    for block in range(first, num_blocks):
        start, end = block * block_length, (block + 1) * block_length
        kwargs = dict(attention_mask=mask[:, start:end, :end], position_ids=positions[:, start:end],
                      past_key_values=cache, use_cache=True)
        for step in range(denoising_steps + 1):
            masked = x[0, start:end] == MASK_ID
            if not masked.any():
                model(x[:, start:end], store_kv=True, **kwargs)
                break
            logits = model(x[:, start:end], store_kv=False, **kwargs).logits
            draws.at(start)
            x0, x0_p = sdar_sample(logits, temperature, top_k, top_p)
            count = min(int(counts[step]), int(masked.sum()))
            confidence = torch.where(masked, x0_p, -torch.inf)
            transfer = torch.zeros_like(masked)
            high = confidence > confidence_threshold
            if remasking_strategy == "low_confidence_dynamic" and int(high.sum()) >= count:
                transfer = high
            else:
                transfer[torch.topk(confidence, count).indices] = True
            before = torch.zeros(total, dtype=torch.bool)
            before[start:end] = masked
            seen = torch.full((total,), float("nan"), dtype=torch.float64)
            seen[start:end][masked] = x0_p[masked]
            x[0, start:end][transfer] = x0[transfer]
            history.append((start, before, seen, x[0].clone()))
        if stop_id is not None and bool((x[:, prompt_length:] == stop_id).any()):
            break
    return x, history


def released_sdar(monkeypatch, prompt, seed, *, gen_length, steps, temperature, top_k=None, top_p=None,
                  strategy="low_confidence_static", threshold=None, stop_id=None):
    """``sdar_generate`` on the double with the hashed draws (greedy at temperature 0)."""
    greedy = temperature == 0
    draws = HashedDraws(seed, prompt.shape[1], greedy)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "multinomial", draws.multinomial)
        return sdar_generate(_model("sdar"), prompt, draws, gen_length=gen_length, block_length=SIZE,
                             denoising_steps=steps, temperature=1.0 if greedy else temperature, top_k=top_k,
                             top_p=top_p, remasking_strategy=strategy,
                             confidence_threshold=0.0 if threshold is None else threshold, stop_id=stop_id)


def expected_dps(history, length):
    """``(commit_step, commit_confidence, step_gain)`` ``[L]``/``[L]``/``[S]`` of a batch-1 history: the
    gain of step s sums ``c_{s+1} - c_s`` over the positions of its block still masked after it."""
    commit_step = torch.full((length,), -1, dtype=torch.long)
    commit_confidence = torch.zeros(length, dtype=torch.float64)
    gain = torch.zeros(len(history), dtype=torch.float64)
    for s, (start, masked, confidence, after) in enumerate(history):
        committed = masked & (after != MASK_ID)
        commit_step[committed[:length]] = s
        commit_confidence[committed[:length]] = confidence[:length][committed[:length]]
        if s + 1 < len(history) and history[s + 1][0] == start:
            still, following = history[s + 1][1], history[s + 1][2]
            gain[s] = (following - confidence)[still].sum()
    return commit_step, commit_confidence, gain


SDAR_CASES = {  # name -> (prompt length, steps, temperature, top_k, top_p, strategy, threshold)
    "greedy, static, prompt tail": (6, 2, 0.0, None, None, "low_confidence_static", None),
    "greedy, dynamic, whole prompt blocks": (8, 4, 0.0, None, None, "low_confidence_dynamic", 0.1),
    "sampled, dynamic, top-k and top-p": (5, 3, 0.8, 7, 0.9, "low_confidence_dynamic", 0.15),
    "sampled, static": (3, 4, 1.3, None, None, "low_confidence_static", None),
}


@pytest.mark.parametrize("case", list(SDAR_CASES))
def test_sdar_equals_the_released_block_diffusion_generate(monkeypatch, case):
    prompt_length, steps, temperature, top_k, top_p, strategy, threshold = SDAR_CASES[case]
    gen_length, seed = 9, 7
    prompt, _ = prompts(1, prompt_length, [0])
    x, history = released_sdar(monkeypatch, prompt, seed, gen_length=gen_length, steps=steps, temperature=temperature,
                               top_k=top_k, top_p=top_p, strategy=strategy, threshold=threshold)
    before = snapshot(prompt)
    rollout = generate(lm_of("sdar"), prompt, gen_length=gen_length, steps=steps, seed=seed, temperature=temperature,
                       top_k=top_k, top_p=top_p, threshold=threshold)
    assert_unchanged(before, prompt)
    length = prompt_length + gen_length
    assert torch.equal(rollout.sequences[0], x[0, :length]), case
    commit_step, commit_confidence, gain = expected_dps(history, length)
    assert torch.equal(rollout.commit_step[0], commit_step)
    assert_close_reduced(rollout.commit_confidence[0], commit_confidence, n=REDUCTION, dtype=THROUGH["sdar"])
    assert_close_reduced(rollout.step_gain[0], gain, n=REDUCTION, dtype=THROUGH["sdar"])


def released_llada2(monkeypatch, prompt, seed, **options):
    """The LLaDA2 double's ``generate`` (block size ``SIZE``, the float64 mask) with the hashed draws."""
    model = _model("llada2")
    draws = HashedDraws(seed, prompt.shape[1], greedy=False)
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: draws.at(kwargs["input_ids"].shape[1] - SIZE), with_kwargs=True)
    float64_mask = functools.partial(llada2.block_diffusion_attention_mask, dtype=torch.float64)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(torch, "multinomial", draws.multinomial)
            patch.setattr(llada2, "block_diffusion_attention_mask", float64_mask)
            return model.generate(prompt, block_length=SIZE, mask_id=MASK_ID, **options)
    finally:
        hook.remove()


# name -> (prompt length, prompt seed, steps, temperature, top_k, top_p, threshold); prompt seeds
# whose decode runs long before the first EOS (one stops at 7 of 10 tokens)
LLADA2_CASES = {
    "greedy, released threshold": (6, 2, 4, 0.0, None, None, 0.95),
    "greedy, low threshold, whole prompt blocks": (8, 5, 2, 0.0, None, None, 0.2),
    "sampled with top-k and top-p, EOS": (5, 5, 3, 0.9, 9, 0.8, 0.5),
}


@pytest.mark.parametrize("case", list(LLADA2_CASES))
def test_llada2_equals_the_released_generate(monkeypatch, case):
    prompt_length, prompt_seed, steps, temperature, top_k, top_p, threshold = LLADA2_CASES[case]
    gen_length, seed = 10, 3
    prompt, _ = prompts(1, prompt_length, [0], seed=prompt_seed)
    released = released_llada2(monkeypatch, prompt, seed, temperature=temperature, steps=steps, gen_length=gen_length,
                               top_p=top_p, top_k=top_k, threshold=threshold, eos_id=llada2.EOS_ID)
    rollout = generate(lm_of("llada2"), prompt, gen_length=gen_length, steps=steps, seed=seed, temperature=temperature,
                       top_k=top_k, top_p=top_p, threshold=threshold)
    # The released generate stops after the block holding the first EOS and cuts after it: the
    # blocks before it do not see the later ones.
    assert released.shape[1] >= prompt_length + 7, "the case must decode more than a block"
    assert torch.equal(rollout.sequences[:, :released.shape[1]], released), case


def backbone_calls(lm):
    """Records ``(cached columns, query columns, rows, store)`` of every backbone call."""
    calls = []

    def record(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        cached = 0 if cache is None else cache.get_seq_length()
        # SDAR says it in the call, LLaDA2's cache in its mode.
        store = bool(kwargs.get("store_kv", getattr(cache, "storing", False)))
        calls.append((cached, kwargs["input_ids"].shape[1], kwargs["input_ids"].shape[0], store))

    return calls, lm.module.base_model.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_committed_blocks_are_never_recomputed(family):
    lm = lm_of(family)
    prompt, prompt_mask = prompts(3, 9, [0, 3, 6])
    options = dict(gen_length=11, steps=3, seed=2, temperature=0.7, threshold=0.4, prompt_mask=prompt_mask)
    runs = {}
    for kv_cache in (True, False):
        calls, hook = backbone_calls(lm)
        try:
            runs[kv_cache] = generate(lm, prompt, kv_cache=kv_cache, **options), calls
        finally:
            hook.remove()
    (cached, calls), (plain, plain_calls) = runs[True], runs[False]
    # Internal layout: prompts of 9, 6 and 3 tokens give 2 whole prompt blocks for the first row.
    prefill = calls[0]
    assert prefill == (0, 2 * SIZE, 3, True)
    stored = [prefill[1]]
    for before, columns, rows, store in calls[1:]:
        assert columns == SIZE and rows == 3, "after the prefill every call runs one block"
        assert before == sum(stored), "each call reads exactly the blocks stored so far"
        if store:
            stored.append(columns)
    last_block_start = sum(stored)
    # Every block but the last is stored exactly once, after its steps.
    assert [c[3] for c in calls].count(True) == len(stored)
    steps = len(calls) - len(stored)
    assert steps == cached.num_steps
    assert cached.nfe == len(calls) and cached.forward_tokens == sum(c[1] * c[2] for c in calls)
    # Without a cache each step runs the whole prefix up to the end of its block.
    assert all(before == 0 and not store for before, _, _, store in plain_calls)
    assert plain.nfe == plain.num_steps == steps and len(plain_calls) == steps
    assert plain_calls[-1][1] == last_block_start + SIZE
    assert plain.forward_tokens == sum(c[1] * c[2] for c in plain_calls) > cached.forward_tokens
    assert torch.equal(cached.sequences, plain.sequences)


CACHE_CASES = {  # name -> (temperature, top_k, top_p, threshold, pads)
    "greedy, top-k rule": (0.0, None, None, None, [0, 0]),
    "greedy, threshold, padded": (0.0, None, None, 0.3, [0, 5]),
    "sampled, threshold, padded": (1.1, 8, 0.9, 0.25, [2, 0, 7]),
}


@pytest.mark.parametrize("case", list(CACHE_CASES))
@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_cache_and_no_cache_give_the_same_rollout(family, case):
    temperature, top_k, top_p, threshold, pads = CACHE_CASES[case]
    prompt, prompt_mask = prompts(len(pads), 7, pads)
    options = dict(gen_length=9, steps=2, seed=11, temperature=temperature, top_k=top_k, top_p=top_p,
                   threshold=threshold, prompt_mask=prompt_mask)
    lm = lm_of(family)
    cached = generate(lm, prompt, kv_cache=True, **options)
    plain = generate(lm, prompt, kv_cache=False, **options)
    assert torch.equal(cached.sequences, plain.sequences)
    assert torch.equal(cached.commit_step, plain.commit_step)
    assert_close_reduced(cached.commit_confidence, plain.commit_confidence, n=REDUCTION, dtype=THROUGH[family])
    assert_close_reduced(cached.step_gain, plain.step_gain, n=REDUCTION, dtype=THROUGH[family])
    assert cached.forward_tokens < plain.forward_tokens


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_a_left_padded_row_is_decoded_as_alone(family):
    lm = lm_of(family)
    prompt, prompt_mask = prompts(3, 10, [0, 3, 8])
    options = dict(gen_length=7, steps=3, seed=5, temperature=0.9, top_k=12, threshold=0.3)
    before = snapshot(prompt, prompt_mask)
    batch = generate(lm, prompt, prompt_mask=prompt_mask, **options)
    assert_unchanged(before, prompt, prompt_mask)
    assert torch.equal(batch.sequences[:, :10], prompt), "the prompt and its padding are returned as given"
    assert torch.equal(batch.attention_mask[:, :10], prompt_mask.long()) and bool(batch.attention_mask[:, 10:].all())
    for b, pad in enumerate([0, 3, 8]):
        alone = generate(lm, prompt[b:b + 1, pad:], row_offset=b, **options)
        assert torch.equal(batch.sequences[b, pad:], alone.sequences[0]), f"row {b}"
        assert torch.equal(batch.commit_confidence[b, pad:] > 0, alone.commit_confidence[0] > 0)
        assert_close_reduced(batch.commit_confidence[b, pad:], alone.commit_confidence[0], n=REDUCTION,
                             dtype=THROUGH[family])


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_dps_fields_are_consistent(family):
    prompt, prompt_mask = prompts(2, 6, [0, 1])
    rollout = generate(lm_of(family), prompt, gen_length=10, steps=3, seed=1, temperature=0.8, threshold=0.5,
                       prompt_mask=prompt_mask)
    completion = rollout.completion_mask
    assert (rollout.commit_step[~completion] == -1).all() and (rollout.commit_confidence[~completion] == 0).all()
    steps = rollout.commit_step[completion]
    # The last steps may commit only positions past G in the last block (decoded, then dropped).
    assert steps.min() == 0 and steps.max() <= rollout.num_steps - 1
    assert ((rollout.commit_confidence[completion] > 0) & (rollout.commit_confidence[completion] <= 1)).all()
    assert (rollout.sequences[completion] != MASK_ID).all()
    # Within a row, a later block's tokens are committed at later steps.
    for b in range(2):
        first = 6 - (rollout.attention_mask[b, :6] == 1).sum()
        blocks = (torch.arange(16) - first) // SIZE
        for j in range(int(blocks[completion[b]].min()), int(blocks.max())):
            this, after = completion[b] & (blocks == j), completion[b] & (blocks == j + 1)
            if after.any():
                assert rollout.commit_step[b, this].max() < rollout.commit_step[b, after].min()
    weights = dps_weights(rollout, completion)
    assert torch.isfinite(weights).all() and weights.shape == (2, 16)


def test_a_block_model_without_a_cache_protocol_is_decoded_through_hidden():
    lm = lm_of("sdar")
    by_hand = MaskedLM(lm.hidden, lm.head_weight, lm.head_bias, MASK_ID, attention=("block", SIZE))
    prompt, _ = prompts(2, 6, [0, 0])
    options = dict(gen_length=6, steps=2, seed=0, temperature=0.5, threshold=0.4)
    rollout = generate(by_hand, prompt, **options)
    assert torch.equal(rollout.sequences, generate(lm, prompt, **options).sequences)
    assert rollout.nfe == rollout.num_steps
    with pytest.raises(ValueError, match="kv_cache: this model has no KV-cache protocol"):
        generate(by_hand, prompt, kv_cache=True, **options)


def test_an_empty_prompt_decodes_from_the_first_block():
    lm = lm_of("sdar")
    rollout = generate(lm, torch.zeros(2, 0, dtype=torch.long), gen_length=6, steps=2, seed=0, temperature=0.5)
    assert rollout.sequences.shape == (2, 6) and (rollout.sequences != MASK_ID).all()
    assert (rollout.commit_step[:, :SIZE] < rollout.commit_step[:, SIZE:].min()).all()


def test_bad_options_are_refused_by_name():
    lm = lm_of("sdar")
    prompt, _ = prompts(1, 5, [0])
    cases = [
        (dict(steps=SIZE + 1), "steps"),
        (dict(threshold=1.5), "threshold"),
        (dict(top_p=0.0), "top_p"),
        (dict(block_length=2 * SIZE), "block_length"),
        (dict(branch_steps=[99]), "branch_steps"),
        (dict(remasking="random"), "remasking"),
        (dict(rule="dream"), "rule"),
        (dict(kv_cache="yes"), "kv_cache"),
    ]
    for extra, name in cases:
        with pytest.raises((ValueError, TypeError), match=name):
            generate(lm, prompt, **{"gen_length": 4, "steps": 2, "seed": 0, **extra})
    full = MaskedLM(lm.hidden, lm.head_weight, lm.head_bias, MASK_ID)
    # A full-attention lm takes a threshold (parallel decoding) but neither the stop at EOS nor a bool cache.
    with pytest.raises(ValueError, match="stop_at_eos is an option of block-wise decoding"):
        generate(full, prompt, gen_length=4, steps=2, seed=0, stop_at_eos=True, eos_id=1)
    with pytest.raises(ValueError, match="kv_cache must be None, 'prefix' or 'dual' for a full-attention lm"):
        generate(full, prompt, gen_length=4, steps=2, seed=0, kv_cache=True)
    with pytest.raises(ValueError, match="prompt_ids must not contain mask_id"):
        generate(lm, torch.full((1, 3), MASK_ID), gen_length=4, steps=2, seed=0)
    with pytest.raises(ValueError, match="prompt_mask must describe left padding"):
        generate(lm, prompt, prompt_mask=torch.tensor([[1, 0, 1, 1, 1]]), gen_length=4, steps=2, seed=0)


def new_in_second_block(sequences, prompt_length):
    """A token of the second completion block of row 0 that its first completion block lacks: as EOS,
    a decode stops after two blocks."""
    first_block_end = (prompt_length // SIZE + 1) * SIZE
    seen = set(sequences[0, prompt_length:first_block_end].tolist())
    fresh = [t for t in sequences[0, first_block_end:first_block_end + SIZE].tolist() if t not in seen]
    assert fresh, "the case must commit a new token in its second block"
    return fresh[0], first_block_end + SIZE


STOP_PROMPT_SEEDS = {"sdar": 0, "llada2": 5}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_stop_at_eos_equals_the_released_stop(monkeypatch, family, temperature):
    """The released decoders stop after the block holding EOS: SDAR's leaves the later blocks masked
    (its re-implementation above with ``stopping_criteria_idx``), LLaDA2's cuts after the first EOS."""
    prompt_length, gen_length, steps, seed = 5, 14, 2, 7
    prompt, _ = prompts(1, prompt_length, [0], seed=STOP_PROMPT_SEEDS[family])
    lm = lm_of(family)
    options = dict(gen_length=gen_length, steps=steps, seed=seed, temperature=temperature, threshold=0.6)
    full = generate(lm, prompt, **options)
    eos, stop_end = new_in_second_block(full.sequences, prompt_length)
    stopped = generate(lm, prompt, stop_at_eos=True, eos_id=eos, **options)
    length = prompt_length + gen_length
    if family == "sdar":
        x, history = released_sdar(monkeypatch, prompt, seed, gen_length=gen_length, steps=steps,
                                   temperature=temperature, strategy="low_confidence_dynamic", threshold=0.6,
                                   stop_id=eos)
        assert torch.equal(stopped.sequences[0], x[0, :length])
        commit_step, commit_confidence, gain = expected_dps(history, length)
        assert torch.equal(stopped.commit_step[0], commit_step)
        assert_close_reduced(stopped.commit_confidence[0], commit_confidence, n=REDUCTION, dtype=THROUGH["sdar"])
        assert_close_reduced(stopped.step_gain[0], gain, n=REDUCTION, dtype=THROUGH["sdar"])
    else:
        released = released_llada2(monkeypatch, prompt, seed, temperature=temperature, steps=steps,
                                   gen_length=gen_length, threshold=0.6, eos_id=eos)
        assert torch.equal(stopped.sequences[:, :released.shape[1]], released)
    assert torch.equal(stopped.sequences[:, :stop_end], full.sequences[:, :stop_end])
    assert (stopped.sequences[0, stop_end:] == MASK_ID).all() and (stopped.commit_step[0, stop_end:] == -1).all()
    assert (stopped.commit_confidence[0, stop_end:] == 0).all()
    assert torch.equal(stopped.answer_mask(eos), full.answer_mask(eos)), "the undecoded positions follow the EOS"
    assert stopped.nfe < full.nfe and stopped.num_steps < full.num_steps


def earliest_common_token(sequences, prompt_length):
    """The completion token whose latest first occurrence over the rows comes first."""
    completion = sequences[:, prompt_length:]

    def last_first_occurrence(token):
        hits = completion == token
        return max(int(row.nonzero()[0]) if row.any() else completion.shape[1] for row in hits)

    return min(completion.unique().tolist(), key=last_first_occurrence)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_stop_at_eos_stops_each_row_on_its_own(family):
    lm = lm_of(family)
    pads = [0, 2, 5]
    prompt, prompt_mask = prompts(3, 7, pads, seed=1)
    options = dict(gen_length=12, steps=2, seed=3, temperature=0.8, threshold=0.4)
    full = generate(lm, prompt, prompt_mask=prompt_mask, **options)
    eos = earliest_common_token(full.sequences, 7)
    stopped = generate(lm, prompt, prompt_mask=prompt_mask, stop_at_eos=True, eos_id=eos, **options)
    assert stopped.nfe < full.nfe, "every row ends early"
    assert torch.equal(stopped.answer_mask(eos), full.answer_mask(eos))
    answer = full.answer_mask(eos)
    assert torch.equal(stopped.sequences[answer], full.sequences[answer])
    assert (stopped.sequences[full.completion_mask & (stopped.commit_step == -1)] == MASK_ID).all()
    for b, pad in enumerate(pads):
        alone = generate(lm, prompt[b:b + 1, pad:], row_offset=b, stop_at_eos=True, eos_id=eos, **options)
        assert torch.equal(stopped.sequences[b, pad:], alone.sequences[0]), f"row {b}"
    # The last step's state: a stopped row's undecoded positions are masked there too, and filled.
    last = stopped.num_steps - 1
    branched = generate(lm, prompt, prompt_mask=prompt_mask, stop_at_eos=True, eos_id=eos, branch_steps=[last],
                        **options)
    state = branched.branches[0]
    undecoded = full.completion_mask & ((stopped.commit_step >= last) | (stopped.commit_step == -1))
    assert torch.equal(state.masked, undecoded) and bool((undecoded & (stopped.commit_step == -1)).any())
    fills = branch(branched, 0, 2, seed=1)
    filled = fills.fillings_filled
    logp = branch_logprob(lm, fills.state, fills.fillings, filled, attention_mask=fills.attention_mask)
    assert_close_reduced(logp[filled], fills.fillings_old_logprob[filled], n=REDUCTION, dtype=THROUGH[family])


def block_causal_logprobs(family, ids):
    """float64 ``[L, V]``: log-softmax of the double's head on its backbone's states for one unpadded row
    ``[1, L]``, the backbone called directly with an explicit block-causal mask (blocks from position 0)
    in its released form (LLaDA2's ``logits`` are cast to float32, hence the head applied here)."""
    model, length = _model(family), ids.shape[1]
    total = -(-length // SIZE) * SIZE
    if family == "sdar":
        mask = sdar.block_diffusion_attention_mask(total, SIZE)[:, :length, :length]
    else:
        mask = llada2.block_diffusion_attention_mask(total, SIZE, dtype=torch.float64)[:, :, :length, :length]
    states = model.model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(length)[None],
                         use_cache=False).last_hidden_state
    return torch.log_softmax(model.lm_head(states[0]), dim=-1)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_branch_states_of_a_left_padded_batch(family):
    """A branch state is the decoder's input at a global step; its cache is the top k of a full
    block-causal forward of it (each row's blocks from its first token); ``branch_logprob`` gives the
    cached values; the extra forward is counted."""
    lm, pads, k = lm_of(family), [0, 2, 5], 5
    prompt, prompt_mask = prompts(3, 6, pads)
    options = dict(gen_length=7, steps=2, seed=4, temperature=0.9, threshold=0.5, prompt_mask=prompt_mask)
    plain = generate(lm, prompt, **options)
    chosen = [0, 2, plain.num_steps - 1]
    rollout = generate(lm, prompt, branch_steps=[chosen[2], chosen[0], chosen[1], chosen[0]], branch_topk=k, **options)
    assert torch.equal(rollout.sequences, plain.sequences) and torch.equal(rollout.commit_step, plain.commit_step)
    assert [state.step for state in rollout.branches] == chosen
    # One extra call per state over the 13 columns of every row.
    assert rollout.nfe == plain.nfe + 3 and rollout.forward_tokens == plain.forward_tokens + 3 * 3 * 13
    for index, state in enumerate(rollout.branches):
        masked = rollout.completion_mask & (rollout.commit_step >= state.step)
        assert torch.equal(state.masked, masked)
        assert torch.equal(state.sequences, torch.where(masked, MASK_ID, rollout.sequences))
        first = 0
        for b, pad in enumerate(pads):
            logp = block_causal_logprobs(family, state.sequences[b:b + 1, pad:])[masked[b, pad:]]
            rows = slice(first, first + len(logp))
            first += len(logp)
            ids = logp.masked_fill(torch.arange(logp.shape[1]) == MASK_ID, float("-inf")).topk(k).indices
            assert torch.equal(state.token_ids[rows], ids), f"state {index}, row {b}"
            assert_close_reduced(state.logprobs[rows], logp.gather(1, ids), n=REDUCTION, dtype=THROUGH[family])
        assert first == state.token_ids.shape[0]
        fills = branch(rollout, index, 3, seed=index)
        filled = fills.fillings_filled
        with torch.no_grad():
            logp = branch_logprob(lm, fills.state, fills.fillings, filled, attention_mask=fills.attention_mask)
        assert_close_reduced(logp[filled], fills.fillings_old_logprob[filled], n=REDUCTION, dtype=THROUGH[family])
        assert (logp[~filled] == 0).all()


def test_branch_states_of_a_block_model_without_hidden_with_keep():
    """Through ``hidden_fn`` alone (blocks and positions from column 0) each padded row is moved right to
    start a block: the same cache but for the rounding of the positions (the double's rotary tables are
    float32)."""
    lm, pads = lm_of("sdar"), [0, 3, 1]
    by_hand = MaskedLM(lm.hidden_fn, lm.head_weight, lm.head_bias, MASK_ID, attention=("block", SIZE))
    prompt, prompt_mask = prompts(3, 5, pads, seed=3)
    options = dict(gen_length=6, steps=2, seed=2, temperature=0.7, prompt_mask=prompt_mask, branch_steps=[2],
                   branch_topk=4)
    rollout, exact = generate(by_hand, prompt, **options), generate(lm, prompt, **options)
    plain = generate(by_hand, prompt, **{**options, "branch_steps": None})
    # Rows moved right by (-pad) mod 4 = 0, 1 and 3 columns: 14 columns.
    assert rollout.nfe == plain.nfe + 1 and rollout.forward_tokens == plain.forward_tokens + 3 * 14
    state, want = rollout.branches[0], exact.branches[0]
    assert torch.equal(state.sequences, want.sequences) and torch.equal(state.token_ids, want.token_ids)
    # The positions pass through the double's float32 rotary tables.
    assert_close_reduced(state.logprobs, want.logprobs, n=REDUCTION, dtype=torch.float32)
    assert not torch.equal(state.logprobs, want.logprobs), "the positions differ in rounding only"
    fills = branch(rollout, 0, 2, seed=0)
    filled = fills.fillings_filled
    logp = branch_logprob(by_hand, fills.state, fills.fillings, filled, attention_mask=fills.attention_mask)
    assert_close_reduced(logp[filled], fills.fillings_old_logprob[filled], n=REDUCTION, dtype=THROUGH["sdar"])


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_branch_logprob_of_a_block_model_is_differentiable(family):
    lm, model = lm_of(family), _model(family)
    prompt, prompt_mask = prompts(2, 5, [0, 3], seed=2)
    rollout = generate(lm, prompt, gen_length=6, steps=2, seed=1, temperature=0.8, prompt_mask=prompt_mask,
                       branch_steps=[1], branch_topk=4)
    fills = branch(rollout, 0, 2, seed=3)
    filled = fills.fillings_filled
    upstream = torch.rand(filled.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def gradients(fn):
        model.zero_grad(set_to_none=True)
        (fn() * upstream).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return grads

    def direct():
        out = torch.zeros(filled.shape, dtype=torch.float64)
        for r in range(filled.shape[0]):
            pad = int((prompt_mask[r // 2] == 0).sum())
            logp = block_causal_logprobs(family, fills.state[r // 2:r // 2 + 1, pad:])
            taken = logp.gather(1, fills.fillings[r, pad:, None]).squeeze(1)
            out[r, pad:] = torch.where(filled[r, pad:], taken, 0.0)
        return out

    fused = gradients(lambda: branch_logprob(lm, fills.state, fills.fillings, filled,
                                             attention_mask=fills.attention_mask))
    want = gradients(direct)
    assert len(want) > 0
    assert_model_gradients_close(fused, want, what=family)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_bad_branch_and_stop_options_are_refused_by_name(family):
    lm = lm_of(family)
    prompt, _ = prompts(1, 5, [0])
    options = dict(gen_length=3, steps=4, seed=0)
    # One block of three masked positions: at most 4 steps, 3 taken.
    cases = [
        (dict(branch_steps=[4]), ValueError, r"branch_steps must be in \[0, 4\)"),
        (dict(branch_steps=[-1]), ValueError, "branch_steps"),
        (dict(branch_steps=3), TypeError, "branch_steps must be an iterable"),
        (dict(branch_steps=[3]), ValueError, "branch_steps: step 3 was not reached; this decode took 3 steps"),
        (dict(branch_steps=[0], branch_topk=0), ValueError, "branch_topk"),
        (dict(stop_at_eos=True), ValueError, "eos_id must be given with stop_at_eos=True"),
        (dict(eos_id=3), ValueError, "eos_id is read only with stop_at_eos=True"),
        (dict(stop_at_eos=1), TypeError, "stop_at_eos"),
        (dict(stop_at_eos=True, eos_id=MASK_ID), ValueError, "eos_id must not be the mask id"),
        (dict(stop_at_eos=True, eos_id=61), ValueError, "eos_id"),
    ]
    for extra, error, message in cases:
        with pytest.raises(error, match=message):
            generate(lm, prompt, **options, **extra)
    assert generate(lm, prompt, branch_steps=[2], **options).branches[0].step == 2
    full = MaskedLM(lm.hidden, lm.head_weight, lm.head_bias, MASK_ID)
    with pytest.raises(ValueError, match="stop_at_eos is an option of block-wise decoding"):
        generate(full, prompt, stop_at_eos=True, eos_id=3, **options)
    state = torch.cat([prompt, torch.full((1, 3), MASK_ID)], dim=1)
    filled = state == MASK_ID
    holes = torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask must describe left padding"):
        branch_logprob(lm, state, state.masked_fill(filled, 3), filled, attention_mask=holes)
