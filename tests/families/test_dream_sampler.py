"""``generate(rule="dream")`` against the double's ``diffusion_generate`` (Dream's released sampler).

The double (``families/dream.py``) draws from the global torch RNG in three places: ``torch.rand``
(which positions ``alg="origin"`` reveals), ``torch.distributions.Categorical(probs).sample()``
(the token of a position at temperature > 0) and ``torch.multinomial(probs, k)`` without replacement
(which positions to commit under ``alg_temp > 0``). :class:`HashedDraws` replaces them, while the
double runs, by draws from the library's counter-hash uniforms of the same ``(step, row id[, token])``:
the reveal uniform itself, the Gumbel-max ``argmax(log p + g)`` for the token and the Gumbel-top-k
``topk(log p + g, k)`` for the positions, each an exact sampler of the distribution the released
call draws from. The two samplers then meet token for token on a float64 model. The double's own
confidences (``sample_tokens`` at every step, read from its logits hook) are the oracle of the DPS
quantities.

The model is the double with a biased head (the released head has none; the bias lets a test push
the mask id's logit): ``mask_logit=-1e4`` makes its probability exactly 0, so the library's default
``mask_candidate="exclude"`` and the released rule (the mask id competes) propose the same tokens.
"""
from types import SimpleNamespace

import pytest
import torch
from support import assert_unchanged, snapshot
from torch import nn

from daca_kernels.hashing import STREAM_RANDOM_REMASK, gumbel_hash, hash4, seed32, uniform_from_hash
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rollout import generate
from families import dream

PROMPT_LENGTH, GEN_LENGTH = 5, 6


def dream_model(mask_logit: float) -> dream.DreamModel:
    """The float64 double with a random head bias, the mask id's entry set to ``mask_logit``."""
    model = dream.tiny(seed=3).double()
    weight = model.lm_head.weight.detach()
    model.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model.lm_head.weight.copy_(weight)
        model.lm_head.bias.copy_(torch.randn(dream.VOCAB, generator=g, dtype=torch.float64))
        model.lm_head.bias[dream.MASK_ID] = mask_logit
    return model.eval()


def dream_lm(model: dream.DreamModel) -> MaskedLM:
    """The double as a ``MaskedLM`` (shift=True), its backbone called in the form the released sampler
    uses: ``"full"`` attention when no position is padding, else the 4-D bool mask and positions
    ``cumsum(mask) - 1`` (1 on padding)."""

    def hidden_fn(input_ids, attention_mask):
        if attention_mask is None or bool(attention_mask.all()):
            return model.model(input_ids=input_ids, attention_mask="full").last_hidden_state
        keep = attention_mask.bool()
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(~keep, 1)
        pairs = keep[:, None, None, :] & keep[:, None, :, None]
        return model.model(input_ids=input_ids, attention_mask=pairs, position_ids=positions).last_hidden_state

    return MaskedLM(hidden_fn, model.lm_head.weight, model.lm_head.bias, dream.MASK_ID, shift=True, module=model)


def prompts(batch: int, padded: bool):
    ids = torch.randint(0, dream.EOS_ID, (batch, PROMPT_LENGTH), generator=torch.Generator().manual_seed(0))
    if not padded:
        return ids, None
    mask = torch.ones(batch, PROMPT_LENGTH, dtype=torch.bool)
    for b, pad in enumerate([0, 2, 4][:batch]):
        mask[b, :pad] = False
        ids[b, :pad] = dream.PAD_ID
    return ids, mask


def gumbel(uniforms: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniforms))


class HashedDraws:
    """The double's torch draws, replaced by the library's counter-hash uniforms (see the module
    docstring). A forward pre-hook on the model tells the step (the double calls the model once per
    step) and the input, whose masked positions ``b * L + j`` (in ``x == mask_id`` order, the order
    of the double's ``logits[mask_index]``) are the row ids."""

    def __init__(self, model: dream.DreamModel, seed: int):
        self.seed, self.step, self.x, self.reveal = seed32(seed), -1, None, None
        self.hook = model.register_forward_pre_hook(self._saw_input)

    def _saw_input(self, module, args):
        self.step, self.x, self.reveal = self.step + 1, args[0].clone(), None

    def _uniforms(self, stream, row_ids, tokens=0):
        return uniform_from_hash(hash4(self.seed, stream, self.step, row_ids, tokens))

    def masked_row_ids(self) -> torch.Tensor:
        b, j = (self.x == dream.MASK_ID).nonzero(as_tuple=True)
        return b * self.x.shape[1] + j

    def rand(self, *shape, **kwargs):
        """``alg="origin"``: the reveal uniform of every masked position."""
        self.reveal = self._uniforms(STREAM_RANDOM_REMASK, self.masked_row_ids())
        assert tuple(self.reveal.shape) == tuple(shape)
        return self.reveal

    def categorical(self, probs: torch.Tensor):
        """A token per row of ``probs``: the masked positions in order, or under ``"origin"`` those whose
        reveal uniform fell below ``1 - s / t``, which (a threshold) are the ``n`` smallest."""
        row_ids = self.masked_row_ids()
        if probs.shape[0] != row_ids.numel():
            revealed = torch.sort(self.reveal, stable=True).indices[: probs.shape[0]]
            row_ids = row_ids[torch.sort(revealed).values]
        noise = gumbel(uniform_from_hash(gumbel_hash(self.seed, self.step, row_ids[:, None], torch.arange(probs.shape[1]))))
        return SimpleNamespace(sample=lambda: (probs.log() + noise.to(probs.dtype)).argmax(dim=-1))

    def multinomial(self, probs: torch.Tensor, num_samples: int, replacement: bool = False):
        """``k`` positions per row without replacement, by Gumbel-top-k."""
        assert not replacement and probs.dim() == 2
        row_ids = torch.arange(probs.numel()).view(probs.shape)
        noise = gumbel(self._uniforms(STREAM_RANDOM_REMASK, row_ids))
        return torch.topk(probs.log() + noise.to(probs.dtype), num_samples, dim=-1).indices


def released(model, prompt, prompt_mask, monkeypatch, *, seed, steps, **options):
    """The double's ``diffusion_generate`` with hashed draws. Returns ``(sequences [B, L], history)``,
    ``history[s] = (masked [B, L] before step s, confidence [B, L] of every masked position (NaN
    elsewhere), sequences after step s)``."""
    draws = HashedDraws(model, seed)
    history = []

    def read_logits(step, x, logits):
        masked = x == dream.MASK_ID
        confidence = torch.full(x.shape, float("nan"), dtype=logits.dtype)
        confidence[masked], _ = dream.sample_tokens(logits[masked], options["temperature"], options.get("top_p"),
                                                    options.get("top_k"))
        history.append([masked, confidence])
        return logits

    def read_tokens(step, x, logits):
        if step is not None:
            history[step].append(x.clone())
        return x

    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", draws.rand)
        patch.setattr(torch, "multinomial", draws.multinomial)
        patch.setattr(torch.distributions, "Categorical", lambda probs: draws.categorical(probs))
        try:
            x = model.diffusion_generate(
                prompt.clone(), attention_mask=None if prompt_mask is None else prompt_mask.long(),
                max_new_tokens=GEN_LENGTH, steps=steps, generation_logits_hook_func=read_logits,
                generation_tokens_hook_func=read_tokens, **options)
        finally:
            draws.hook.remove()
    return x, history


def overwrites(history) -> bool:
    """Whether the double wrote the mask id over an unmasked position: the released rule does so when
    a row has fewer masked positions than the batch's mean count (``generate`` does not)."""
    return any(bool(((after == dream.MASK_ID) & ~masked).any()) for masked, _, after in history)


def expected_dps(history):
    """``(commit_step, commit_confidence, step_gain)`` from the double's history: a position is
    committed by the step after which it holds a token other than the mask id."""
    shape = history[0][0].shape
    commit_step = torch.full(shape, -1, dtype=torch.long)
    commit_confidence = torch.zeros(shape, dtype=torch.float64)
    gain = torch.zeros(shape[0], len(history), dtype=torch.float64)
    for s, (masked, confidence, after) in enumerate(history):
        committed = masked & (after != dream.MASK_ID)
        commit_step[committed] = s
        commit_confidence[committed] = confidence[committed]
        if s + 1 < len(history):
            still, next_confidence, _ = history[s + 1]
            gain[:, s] = torch.where(still, next_confidence - confidence, 0.0).sum(1)
    return commit_step, commit_confidence, gain


def run_both(monkeypatch, *, alg, temperature, padded, mask_candidate="exclude", mask_logit=-1e4, batch=3, steps=4,
             seed=5, alg_temp=None, top_p=None, top_k=None, eps=1e-3):
    model = dream_model(mask_logit)
    prompt, prompt_mask = prompts(batch, padded)
    options = dict(alg=alg, temperature=temperature, alg_temp=alg_temp, top_p=top_p, top_k=top_k, eps=eps)
    before = snapshot(prompt, prompt_mask)
    rollout = generate(dream_lm(model), prompt, gen_length=GEN_LENGTH, steps=steps, seed=seed, prompt_mask=prompt_mask,
                       rule="dream", mask_candidate=mask_candidate, **options)
    assert_unchanged(before, prompt, prompt_mask)
    return rollout, released(model, prompt, prompt_mask, monkeypatch, seed=seed, steps=steps, **options)


def assert_matches_released(rollout, released_run, what):
    x, history = released_run
    assert torch.equal(rollout.sequences, x), f"{what}: sequences differ from the released sampler's"
    commit_step, commit_confidence, gain = expected_dps(history)
    assert torch.equal(rollout.commit_step, commit_step), f"{what}: commit steps differ"
    torch.testing.assert_close(rollout.commit_confidence, commit_confidence, rtol=0, atol=1e-12)
    torch.testing.assert_close(rollout.step_gain, gain, rtol=0, atol=1e-12)
    assert rollout.nfe <= len(history)


ALGS = ["origin", "maskgit_plus", "topk_margin", "entropy"]
# name -> (temperature, alg_temp, top_p, top_k, padded)
DRAWS = {
    "greedy": (0.0, None, None, None, False),
    "greedy, padded": (0.0, None, None, None, True),
    "sampled, padded": (0.9, 0.5, None, None, True),
    "sampled with top_p and top_k": (1.3, 0.3, 0.8, 7, False),
}


@pytest.mark.parametrize("draw", list(DRAWS))
@pytest.mark.parametrize("alg", ALGS)
def test_dream_rule_equals_the_released_sampler(monkeypatch, alg, draw):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    temperature, alg_temp, top_p, top_k, padded = DRAWS[draw]
    rollout, released_run = run_both(monkeypatch, alg=alg, temperature=temperature, padded=padded,
                                     alg_temp=alg_temp, top_p=top_p, top_k=top_k)
    assert_matches_released(rollout, released_run, f"{alg}, {draw}")
    assert (rollout.sequences != dream.MASK_ID).all()


# (alg, temperature, alg_temp, batch, padded): with the mask id's logit raised, it is proposed and
# committed (a hole, predicted again) and some holes stay; with one row, or with rows that keep equal
# masked counts, the released rule never writes over an unmasked position.
HOLES = {
    "origin, greedy": ("origin", 0.0, None, 1, False),
    "maskgit_plus, sampled": ("maskgit_plus", 0.9, 0.5, 1, False),
    "topk_margin, greedy": ("topk_margin", 0.0, None, 1, False),
    "entropy, sampled": ("entropy", 0.9, 0.5, 1, False),
    "origin, greedy, 3 padded rows": ("origin", 0.0, None, 3, True),
    "entropy, greedy, 3 padded rows": ("entropy", 0.0, None, 3, True),
}


@pytest.mark.parametrize("case", list(HOLES))
def test_dream_rule_with_the_mask_id_a_candidate_equals_the_released_sampler(monkeypatch, case):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    alg, temperature, alg_temp, batch, padded = HOLES[case]
    rollout, (x, history) = run_both(monkeypatch, alg=alg, temperature=temperature, alg_temp=alg_temp, batch=batch,
                                     padded=padded, mask_candidate="dream", mask_logit=4.0)
    assert not overwrites(history)
    assert_matches_released(rollout, (x, history), case)
    holes = rollout.completion_mask & (rollout.sequences == dream.MASK_ID)
    assert holes.any() and (rollout.commit_step[holes] == -1).all()


def test_dream_rule_never_writes_over_an_unmasked_position(monkeypatch):
    """Rows with different masked counts (holes) and k above a row's count: the released rule writes
    the mask id over some of that row's unmasked positions (which ones: the order of torch.topk among
    -inf scores); generate commits all of the row's masked positions and nothing else."""
    monkeypatch.setenv("DACA_BACKEND", "torch")
    rollout, (x, history) = run_both(monkeypatch, alg="maskgit_plus", temperature=0.0, padded=True,
                                     mask_candidate="dream", mask_logit=3.0)
    assert overwrites(history)
    prompt, _ = prompts(3, True)
    assert torch.equal(rollout.sequences[:, :PROMPT_LENGTH], prompt)
    committed = rollout.commit_step >= 0
    assert (rollout.sequences[committed] != dream.MASK_ID).all()
    assert torch.equal(committed | (rollout.sequences == dream.MASK_ID), rollout.completion_mask)


def test_dream_rule_on_triton_kernels_equals_the_released_sampler(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "triton")
    rollout, released_run = run_both(monkeypatch, alg="entropy", temperature=1.3, alg_temp=0.3, top_p=0.8, top_k=7,
                                     padded=True)
    assert_matches_released(rollout, released_run, "entropy on the Triton kernels")


def test_the_cases_are_not_vacuous(monkeypatch):
    """Each option changes the rollout, a step that commits nothing saves a model call, and the
    hashed draws are what make the double meet the library (its own RNG gives other tokens)."""
    monkeypatch.setenv("DACA_BACKEND", "torch")
    model = dream_model(-1e4)
    prompt, prompt_mask = prompts(3, True)

    def tokens(**options):
        base = dict(alg="entropy", temperature=0.9, alg_temp=0.5, steps=4, seed=5)
        rollout = generate(dream_lm(model), prompt, gen_length=GEN_LENGTH, prompt_mask=prompt_mask, rule="dream",
                           **{**base, **options})
        return rollout.sequences

    plain = tokens()
    for change in [dict(temperature=0.0), dict(alg_temp=None), dict(top_p=0.8), dict(top_k=5), dict(seed=6),
                   dict(alg="maskgit_plus"), dict(alg="origin"), dict(eps=0.5)]:
        assert not torch.equal(tokens(**change), plain), f"{change} must change this rollout"
    greedy = generate(dream_lm(model), prompt, gen_length=GEN_LENGTH, steps=GEN_LENGTH, seed=0, rule="dream",
                      alg="maskgit_plus", prompt_mask=prompt_mask)
    assert greedy.nfe < GEN_LENGTH and (greedy.commit_step[:, PROMPT_LENGTH:] >= 0).all()
    torch.manual_seed(0)
    own_rng = model.diffusion_generate(prompt, attention_mask=prompt_mask.long(), max_new_tokens=GEN_LENGTH, steps=4,
                                       alg="entropy", temperature=0.9, alg_temp=0.5)
    assert not torch.equal(own_rng, plain)


def test_a_shard_with_its_row_offset_samples_the_rows_of_the_whole_batch(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    lm = dream_lm(dream_model(-1e4))
    prompt, prompt_mask = prompts(3, True)
    options = dict(gen_length=GEN_LENGTH, steps=3, seed=9, rule="dream", alg="topk_margin", temperature=0.8,
                   alg_temp=0.4, top_k=9)
    whole = generate(lm, prompt, prompt_mask=prompt_mask, **options)
    shard = generate(lm, prompt[1:], prompt_mask=prompt_mask[1:], row_offset=1, **options)
    assert torch.equal(shard.sequences, whole.sequences[1:])
    assert torch.equal(shard.commit_step, whole.commit_step[1:])


def test_the_adapter_from_hf_samples_as_the_hand_built_one(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    model = dream_model(-1e4)
    prompt, prompt_mask = prompts(3, True)
    options = dict(gen_length=GEN_LENGTH, steps=4, seed=5, prompt_mask=prompt_mask, rule="dream", alg="entropy",
                   temperature=0.9, alg_temp=0.5, top_p=0.8)
    from_hf = generate(MaskedLM.from_hf(model), prompt, **options)
    by_hand = generate(dream_lm(model), prompt, **options)
    assert torch.equal(from_hf.sequences, by_hand.sequences)
    torch.testing.assert_close(from_hf.commit_confidence, by_hand.commit_confidence, rtol=0, atol=1e-12)
