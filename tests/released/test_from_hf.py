"""``MaskedLM.from_hf`` on the full-attention families' released code: which form of attention mask it
finds by behaviour for each release, what ``verify=False`` and an explicit ``mask_form`` do, how it
recognises each release, the refusal that lists what was tried; and loading the checkpoints directly with
transformers' Auto classes (without the library's loader) where the installed transformers can."""
import json
import subprocess
import sys
import textwrap
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from daca_kernels.models import families, masked_lm
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.models.released_code import auto_registrations_undone
from released import hub

TF5 = int(transformers.__version__.split(".")[0]) >= 5
# The form that hides padding in each release (README of the released files: hub LLaDA-8B and LLaDA-MoE
# ignore every mask, dllm's LLaDA honours the 2-D one, both Dreams take a 4-D bool mask; a 2-D integer
# mask is an error in the hub Dream's SDPA and dllm's Dream turns it into a query-and-key mask whose
# padding queries see nothing).
FOUND = {"llada": "none", "llada_dllm": "2d", "lladamoe": "none", "dream": "4d-bool", "dream_dllm": "4d-bool"}
FAMILY = {"llada": "llada", "llada_dllm": "llada", "lladamoe": "llada_moe", "dream": "dream", "dream_dllm": "dream"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    return {name: hub.write_checkpoint(name, root / name, seed=2) for name in FOUND if hub.require(name)}


def load(checkpoints, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hub.load(checkpoints[name], name)


def padded_batch(seed=0):
    ids = torch.randint(0, 61, (3, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(FOUND))
def test_from_hf_finds_the_mask_form_that_hides_padding(name, checkpoints):
    model = load(checkpoints, name)
    assert families.recognise(model).name == FAMILY[name]
    lm = MaskedLM.from_hf(model)
    assert lm.mask_form == FOUND[name] and lm.attention == "full"
    # A later re-wrap without the check uses the form found for the class.
    assert MaskedLM.from_hf(model, verify=False).mask_form == FOUND[name]
    ids, mask = padded_batch()
    with torch.no_grad():
        states = lm.hidden(ids, mask)
        for row, pad in ((1, 4), (2, 1)):
            alone = lm.hidden(ids[row:row + 1, pad:])[0]
            torch.testing.assert_close(states[row, pad:], alone, rtol=0, atol=1e-5 * (1 + alone.abs().max().item()))


RECORDED = {"llada": "none", "llada_dllm": "none", "lladamoe": "none", "dream": "4d-bool", "dream_dllm": "4d-bool"}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_without_the_check_the_familys_recorded_form_serves_every_release(name, checkpoints, monkeypatch):
    # A model class never checked in this process: verify=False takes the family's recorded form, which
    # must hide the padding of every release of the family (dllm's LLaDA honours a mask, the hub's not).
    monkeypatch.setattr(masked_lm, "_FOUND_FORMS", weakref.WeakKeyDictionary())
    model = load(checkpoints, name)
    lm = MaskedLM.from_hf(model, verify=False)
    assert lm.mask_form == RECORDED[name]
    ids, mask = padded_batch(1)
    with torch.no_grad():
        states = lm.hidden(ids, mask)
        alone = lm.hidden(ids[1:, 4:])[0]
    torch.testing.assert_close(states[1, 4:], alone, rtol=0, atol=1e-5 * (1 + alone.abs().max().item()))


@pytest.mark.parametrize("name, wrong", [("llada", "2d"), ("lladamoe", "4d-additive"), ("dream", "2d")])
def test_an_explicit_mask_form_the_release_does_not_honour_is_refused_by_the_check(name, wrong, checkpoints):
    model = load(checkpoints, name)
    with pytest.raises(ValueError, match=r"^model: \w+(: a left-padded row's hidden states change| failed on a left-p)"):
        MaskedLM.from_hf(model, mask_form=wrong)
    # Without the check it is used as given (the caller's responsibility).
    assert MaskedLM.from_hf(model, mask_form=wrong, verify=False).mask_form == wrong


def test_mask_form_must_be_a_known_form_for_a_full_attention_model(checkpoints):
    model = load(checkpoints, "dream")
    with pytest.raises(ValueError, match="^mask_form: one of 2d, 4d-bool, 4d-additive, none .* got '3d'"):
        MaskedLM.from_hf(model, mask_form="3d")
    with pytest.raises(TypeError, match="^mask_form must be a str or None, got int"):
        MaskedLM.from_hf(model, mask_form=2)
    with pytest.raises(ValueError, match="^mask_form must be one of"):
        MaskedLM(lambda ids, mask: ids, torch.zeros(4, 2), None, 1, mask_form="full")


def test_llada_moe_is_recognised_by_any_of_its_signs(checkpoints):
    model = load(checkpoints, "lladamoe")
    config = model.config
    for change in ({"model_type": "llada"}, {"model_type": "lladamoe", "architectures": None},
                   {"model_type": "something_else"}):
        saved = {key: getattr(config, key, None) for key in change}
        try:
            for key, value in change.items():
                setattr(config, key, value)
            assert families.recognise(model) is families.LLADA_MOE, change
        finally:
            for key, value in saved.items():
                setattr(config, key, value)


def test_two_llada_releases_in_one_process_each_run_their_own_code(checkpoints):
    # transformers 5 builds a checkpoint with a class registered for its model_type before its own remote
    # code; the released files register themselves, so the loader undoes that after each load.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    before = dict(CONFIG_MAPPING._extra_content)
    hub_llada, dllm_llada = load(checkpoints, "llada"), load(checkpoints, "llada_dllm")
    assert type(hub_llada) is not type(dllm_llada)
    assert dict(CONFIG_MAPPING._extra_content) == before
    assert MaskedLM.from_hf(hub_llada).mask_form == "none" and MaskedLM.from_hf(dllm_llada).mask_form == "2d"


class _FixedLengthBackbone(nn.Module):
    """Attends to every token whatever the mask (a mean over the row) and runs only on rows of 8 tokens
    (learned positions of a fixed length)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.positions = nn.Parameter(torch.randn(8, 4))

    def forward(self, input_ids, attention_mask=None, **_):
        if input_ids.shape[1] != 8:
            raise ValueError(f"rows of 8 tokens only, got {input_ids.shape[1]}")
        x = self.embed(input_ids) + self.positions
        return SimpleNamespace(last_hidden_state=x + x.mean(1, keepdim=True))


class _FixedLength(nn.Module):
    """No mask form and no padding-free run serve this model: every form of the check fails."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(model_type="fixed_length", mask_token_id=5)
        self.model = _FixedLengthBackbone()
        self.head = nn.Linear(4, 8, bias=False)

    @property
    def base_model(self):
        return self.model

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, **_):
        return SimpleNamespace(logits=self.head(self.model(input_ids).last_hidden_state))


def test_a_model_no_form_serves_is_refused_with_what_was_tried():
    with pytest.raises(ValueError, match=r"^model: _FixedLength: no form of attention mask serves a left-padded "
                                         r"batch \(full attention\); tried 2d .*: the row's states change with its "
                                         r"padding tokens; 4d-bool .*; 4d-additive .*; none .*rows of 8 tokens only"):
        MaskedLM.from_hf(_FixedLength())


# The direct load runs in a child process: the library's run-time support (which stays partly in place
# once a checkpoint was loaded through it) must not help it.
_DIRECT = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, transformers
    sys.path.insert(0, "tests")
    from released import hub
    out = {}
    for name, directory in json.loads(sys.argv[1]).items():
        auto = getattr(transformers, hub.FAMILIES[name].auto_class)
        try:
            with hub.cuda_on_cpu():
                model = auto.from_pretrained(directory, trust_remote_code=True).eval()
            out[name] = {k: v.tolist() for k, v in model.state_dict().items() if "inv_freq" not in k}
        except Exception as error:
            out[name] = f"{type(error).__name__}: {error}"
    print(json.dumps(out))
""")
# What transformers 5 cannot load without the library's loader, and why (README of the released files):
# LLaDA's LLaDAModelLM.__init__ never calls post_init(); Dream and LLaDA-MoE build their rotary
# embedding with ROPE_INIT_FUNCTIONS["default"], which transformers 5 removed.
NEEDS_LOADER_ON_TF5 = {"llada": "all_tied_weights_keys", "llada_dllm": "all_tied_weights_keys",
                       "lladamoe": "default", "dream": "default", "dream_dllm": "default"}


def test_direct_auto_class_loads_give_the_saved_weights_where_transformers_can(checkpoints):
    names = {name: str(path) for name, path in checkpoints.items()}
    child = subprocess.run([sys.executable, "-c", _DIRECT, json.dumps(names)], capture_output=True, text=True,
                           cwd=hub.REPO, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for name in names:
        if TF5 and name in NEEDS_LOADER_ON_TF5:
            assert isinstance(results[name], str) and NEEDS_LOADER_ON_TF5[name] in results[name], (name, results[name])
            continue
        assert isinstance(results[name], dict), (name, results[name])
        with auto_registrations_undone():
            loaded = load(checkpoints, name).state_dict()
        for key, value in results[name].items():
            torch.testing.assert_close(torch.tensor(value, dtype=loaded[key].dtype), loaded[key], rtol=0, atol=0)
