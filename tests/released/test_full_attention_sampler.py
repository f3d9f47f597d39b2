"""``rollout.generate`` on hub-style checkpoints of the full-attention families against each family's own
released sampler: LLaDA's ``generate.py`` (the LLaDA family and LLaDA-MoE, ``rule="llada"``) and Dream's
``diffusion_generate`` (Dream / DiffuCoder, ``rule="dream"``), greedy and seeded, on equal and left-padded
prompts.

The released samplers draw from torch's global generator. While one runs, its draws are replaced by the
library's counter-hash uniforms of the same ``(step, row id[, token])`` (as tests/sampler/test_llada_sampler.py
and tests/families/test_dream_sampler.py do for their doubles): LLaDA's ``torch.rand_like`` (the Gumbel noise of
``exp(logits) / (-log u) ** T``) and ``torch.rand`` (random remasking); Dream's ``torch.rand`` (``alg="origin"``),
``Categorical(probs).sample()`` (Gumbel-max) and ``torch.multinomial`` (Gumbel-top-k). Both samplers then draw
the same noise, and the rollouts meet token for token on a float64 model. The samplers run with the released
candidate rule (``mask_candidate`` "llada" or "dream": the mask id competes like any token).

Padding. Hub LLaDA-8B and LLaDA-MoE ignore every attention mask, so LLaDA's ``generate.py`` on a left-padded
batch lets each row attend its padding: a padded row's rollout depends on its padding. The library gives a
padded row the rollout of the row alone (the backbone runs it without its padding), so on those two the
padded batch is compared with the released sampler run on each row alone, its noise drawn for the row's
positions in the batch (row id ``b * L + pad_b + j``); that the released sampler's padded batch differs is
asserted too, as the documented difference. dllm's LLaDA honours the mask and Dream hides the padding itself
(a 4-D mask and position ids), so there the released sampler runs on the padded batch as well.
"""
from __future__ import annotations

import importlib.util
import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch

from daca_kernels.hashing import STREAM_RANDOM_REMASK, gumbel_hash, hash4, seed32, uniform_from_hash
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rollout import generate
from released import hub

LLADA_FOLDERS = ("llada", "llada_dllm", "lladamoe")
DREAM_FOLDERS = ("dream", "dream_dllm")
# The code of these ignores every attention mask: padding is attended by the released sampler.
IGNORE_MASKS = ("llada", "lladamoe")
MASK_ID, EOS_ID, PAD_ID = 63, 62, 61
PROMPT_LENGTH, GEN_LENGTH = 5, 8
PADS = (0, 2, 3)

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The float64 model of each folder, loaded once per module from its hub-style checkpoint."""
    loaded = {}

    def get(name):
        if name not in loaded:
            directory = hub.write_checkpoint(name, tmp_path_factory.mktemp(name), seed=3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the released files' own warnings, and the buffer repair
                model = hub.load(directory, name, dtype=torch.float64)
            assert_runs_its_own_code(model, name)
            loaded[name] = model
        return loaded[name]

    return get


def assert_runs_its_own_code(model, name):
    """The loaded class is defined by the folder's own modeling file (not by a family loaded earlier)."""
    source = inspect.getsource(inspect.getmodule(type(model)))
    modeling = next(f for f in hub.FAMILIES[name].files if f.startswith("modeling_"))
    assert source == (hub.require(hub.FAMILIES[name].folder) / modeling).read_text()


def prompts(padded: bool):
    ids = torch.randint(0, PAD_ID, (len(PADS), PROMPT_LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(ids.shape, dtype=torch.bool)
    if padded:
        for b, pad in enumerate(PADS):
            mask[b, :pad] = False
            ids[b, :pad] = PAD_ID
    return ids, mask


def row_ids_of(batch: int, length: int) -> torch.Tensor:
    """long ``[B, L]``: the library's row id ``b * L + j`` of each position of a batch of width ``L``."""
    return torch.arange(batch * length).view(batch, length)


# ------------------------------------------------------------------ LLaDA's generate.py

def released_llada_module():
    path = hub.require("llada") / "generate.py"
    spec = importlib.util.spec_from_file_location("released_llada_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LLaDADraws:
    """LLaDA's ``torch.rand_like`` (Gumbel noise, ``[B, L, V]``) and ``torch.rand`` (random remasking,
    ``[B, L]``) as the library's hashed uniforms of ``row_ids`` at the current step (a forward pre-hook on
    the model counts the steps: one model call per step without guidance)."""

    def __init__(self, model, seed: int, row_ids: torch.Tensor):
        self.seed, self.row_ids, self.step = seed32(seed), row_ids, -1
        self.hook = model.register_forward_pre_hook(lambda module, args: self._next())

    def _next(self):
        self.step += 1

    def rand_like(self, logits, dtype=None, **kwargs):
        assert logits.shape[:2] == self.row_ids.shape
        words = gumbel_hash(self.seed, self.step, self.row_ids[..., None], torch.arange(logits.shape[-1]))
        return uniform_from_hash(words).to(dtype or logits.dtype)

    def rand(self, shape, device=None, **kwargs):
        assert tuple(shape) == tuple(self.row_ids.shape)
        return uniform_from_hash(hash4(self.seed, STREAM_RANDOM_REMASK, self.step, self.row_ids, 0)).double()


def run_released_llada(model, prompt, attention_mask, monkeypatch, *, seed, row_ids, **options):
    released = released_llada_module()
    draws = LLaDADraws(model, seed, row_ids)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand_like", draws.rand_like)
        patch.setattr(torch, "rand", draws.rand)
        try:
            return released.generate(model, prompt.clone(), attention_mask, mask_id=MASK_ID, **options)
        finally:
            draws.hook.remove()


LLADA_CASES = {  # name -> (temperature, remasking, steps)
    "greedy": (0.0, "low_confidence", GEN_LENGTH),
    "seeded": (0.9, "low_confidence", GEN_LENGTH // 2),
    "seeded, random remasking": (1.0, "random", GEN_LENGTH // 2),
}


def llada_options(case):
    temperature, remasking, steps = LLADA_CASES[case]
    return dict(steps=steps, gen_length=GEN_LENGTH, block_length=GEN_LENGTH // 2, temperature=temperature,
                remasking=remasking)


def library_rollout(model, prompt, prompt_mask, *, seed, **options):
    before = (prompt.clone(), prompt_mask.clone())
    rollout = generate(MaskedLM.from_hf(model), prompt, prompt_mask=prompt_mask, seed=seed, **options)
    assert torch.equal(prompt, before[0]) and torch.equal(prompt_mask, before[1])
    return rollout


@pytest.mark.parametrize("case", list(LLADA_CASES))
@pytest.mark.parametrize("name", LLADA_FOLDERS)
def test_llada_rule_equals_llada_generate_on_equal_prompts(checkpoints, monkeypatch, name, case):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    model = checkpoints(name)
    prompt, mask = prompts(padded=False)
    options = llada_options(case)
    rollout = library_rollout(model, prompt, mask, seed=5, mask_candidate="llada", **options)
    expected = run_released_llada(model, prompt, None, monkeypatch, seed=5,
                                  row_ids=row_ids_of(len(PADS), PROMPT_LENGTH + GEN_LENGTH), **options)
    assert torch.equal(rollout.sequences, expected), f"{name}, {case}: the rollout differs from generate.py's"
    assert (rollout.commit_step[:, PROMPT_LENGTH:] >= 0).any()


@pytest.mark.parametrize("case", ["greedy", "seeded"])
@pytest.mark.parametrize("name", LLADA_FOLDERS)
def test_llada_rule_on_left_padded_prompts_gives_each_row_its_rollout_alone(checkpoints, monkeypatch, name, case):
    """A padded row's rollout is generate.py's on the row alone; where the model honours the mask
    (dllm's LLaDA), generate.py's padded batch gives it too; where it ignores masks (hub LLaDA-8B,
    LLaDA-MoE), generate.py's padded batch differs: its rows attend their padding."""
    monkeypatch.setenv("DACA_BACKEND", "torch")
    model = checkpoints(name)
    prompt, mask = prompts(padded=True)
    options = llada_options(case)
    rollout = library_rollout(model, prompt, mask, seed=5, mask_candidate="llada", **options)
    length = PROMPT_LENGTH + GEN_LENGTH
    for b, pad in enumerate(PADS):
        alone = run_released_llada(model, prompt[b:b + 1, pad:], None, monkeypatch, seed=5,
                                   row_ids=row_ids_of(len(PADS), length)[b:b + 1, pad:], **options)
        assert torch.equal(rollout.sequences[b, pad:], alone[0]), f"{name}, {case}: row {b} differs from the row alone"
    batch = run_released_llada(model, prompt, mask.long(), monkeypatch, seed=5,
                               row_ids=row_ids_of(len(PADS), length), **options)
    if name in IGNORE_MASKS:
        assert not torch.equal(batch[:, PROMPT_LENGTH:], rollout.sequences[:, PROMPT_LENGTH:]), (
            f"{name} ignores masks: generate.py's padded rows attend their padding and were expected to differ")
    else:
        assert torch.equal(batch, rollout.sequences), f"{name}, {case}: the padded batch differs from generate.py's"


def test_llada_draws_are_what_makes_the_samplers_meet(checkpoints, monkeypatch):
    """Guards against a vacuous comparison: under the released sampler's own random draws the seeded
    rollout is another one, and the seed changes the library's rollout."""
    monkeypatch.setenv("DACA_BACKEND", "torch")
    model = checkpoints("llada_dllm")
    prompt, mask = prompts(padded=False)
    options = llada_options("seeded")
    rollout = library_rollout(model, prompt, mask, seed=5, mask_candidate="llada", **options)
    other_seed = library_rollout(model, prompt, mask, seed=6, mask_candidate="llada", **options)
    assert not torch.equal(rollout.sequences, other_seed.sequences)
    torch.manual_seed(0)
    own_draws = released_llada_module().generate(model, prompt, None, mask_id=MASK_ID, **options)
    assert not torch.equal(own_draws, rollout.sequences)


# ------------------------------------------------------------------ Dream's diffusion_generate

class DreamDraws:
    """Dream's ``torch.rand`` (which positions ``alg="origin"`` reveals), ``Categorical(probs).sample()``
    (the token, at temperature > 0) and ``torch.multinomial`` without replacement (which positions, under
    ``alg_temp > 0``), replaced by the library's hashed draws of the masked positions' row ids
    ``b * L + j`` (in ``x == mask_id`` order, the order of ``logits[mask_index]``) at the current step."""

    def __init__(self, model, seed: int):
        self.seed, self.step, self.x, self.reveal = seed32(seed), -1, None, None
        self.hook = model.register_forward_pre_hook(self._saw_input)

    def _saw_input(self, module, args):
        self.step, self.x, self.reveal = self.step + 1, args[0].clone(), None

    def masked_row_ids(self):
        b, j = (self.x == MASK_ID).nonzero(as_tuple=True)
        return b * self.x.shape[1] + j

    def rand(self, *shape, **kwargs):
        self.reveal = uniform_from_hash(hash4(self.seed, STREAM_RANDOM_REMASK, self.step, self.masked_row_ids(), 0))
        assert tuple(self.reveal.shape) == tuple(shape)
        return self.reveal

    def categorical(self, probs):
        row_ids = self.masked_row_ids()
        if probs.shape[0] != row_ids.numel():  # "origin": the revealed positions, the n smallest uniforms
            revealed = torch.sort(self.reveal, stable=True).indices[: probs.shape[0]]
            row_ids = row_ids[torch.sort(revealed).values]
        words = gumbel_hash(self.seed, self.step, row_ids[:, None], torch.arange(probs.shape[1]))
        noise = -torch.log(-torch.log(uniform_from_hash(words)))
        return SimpleNamespace(sample=lambda: (probs.log() + noise.to(probs.dtype)).argmax(dim=-1))

    def multinomial(self, probs, num_samples, replacement=False):
        assert not replacement and probs.dim() == 2
        words = hash4(self.seed, STREAM_RANDOM_REMASK, self.step, torch.arange(probs.numel()).view(probs.shape), 0)
        noise = -torch.log(-torch.log(uniform_from_hash(words)))
        return torch.topk(probs.log() + noise.to(probs.dtype), num_samples, dim=-1).indices


def run_released_dream(model, prompt, prompt_mask, monkeypatch, *, seed, steps, **options):
    draws = DreamDraws(model, seed)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", draws.rand)
        patch.setattr(torch, "multinomial", draws.multinomial)
        patch.setattr(torch.distributions, "Categorical", lambda probs: draws.categorical(probs))
        try:
            return model.diffusion_generate(prompt.clone(), attention_mask=None if prompt_mask is None else
                                            prompt_mask.long(), max_new_tokens=GEN_LENGTH, steps=steps,
                                            mask_token_id=MASK_ID, **options)
        finally:
            draws.hook.remove()


DREAM_CASES = {  # name -> (padded, alg, temperature, alg_temp, top_p, top_k)
    "greedy": (False, "entropy", 0.0, None, None, None),
    "greedy, padded": (True, "maskgit_plus", 0.0, None, None, None),
    "seeded": (False, "topk_margin", 1.1, 0.5, 0.9, 20),
    "seeded, padded": (True, "origin", 0.9, None, None, None),
}


@pytest.mark.parametrize("case", list(DREAM_CASES))
@pytest.mark.parametrize("name", DREAM_FOLDERS)
def test_dream_rule_equals_diffusion_generate(checkpoints, monkeypatch, name, case):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    model = checkpoints(name)
    padded, alg, temperature, alg_temp, top_p, top_k = DREAM_CASES[case]
    prompt, mask = prompts(padded)
    options = dict(alg=alg, temperature=temperature, alg_temp=alg_temp, top_p=top_p, top_k=top_k)
    steps = GEN_LENGTH // 2
    rollout = library_rollout(model, prompt, mask, seed=5, gen_length=GEN_LENGTH, steps=steps, rule="dream",
                              mask_candidate="dream", **options)
    expected = run_released_dream(model, prompt, mask if padded else None, monkeypatch, seed=5, steps=steps,
                                  **options)
    assert torch.equal(rollout.sequences, expected), f"{name}, {case}: the rollout differs from diffusion_generate's"
    assert (rollout.sequences[:, PROMPT_LENGTH:] != MASK_ID).any()


def test_dream_draws_are_what_makes_the_samplers_meet(checkpoints, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    model = checkpoints("dream")
    prompt, mask = prompts(padded=True)
    options = dict(alg="origin", temperature=0.9)
    rollout = library_rollout(model, prompt, mask, seed=5, gen_length=GEN_LENGTH, steps=4, rule="dream",
                              mask_candidate="dream", **options)
    torch.manual_seed(0)
    own_draws = model.diffusion_generate(prompt, attention_mask=mask.long(), max_new_tokens=GEN_LENGTH, steps=4,
                                         mask_token_id=MASK_ID, **options)
    assert not torch.equal(own_draws, rollout.sequences)
