"""The prefix-cache drivers of LLaDA and LLaDA-MoE (:mod:`daca_kernels.rollout.prefix_cache`) against the
released files they drive, on tiny hub-style float64 checkpoints.

Their top-level forwards refuse a cache, so the library drives the released blocks (LLaDA: each
``LLaDABlock`` with ``layer_past``; LLaDA-MoE: each decoder layer with ``past_key_value``) in the order
those forwards run them. Without a cache the driver is the released forward's computation: its hidden
states equal ``model.model(...)``'s. With a cache that stored a full forward of the same sequence, a
call on the columns after the kept ones gives the full forward's states at those columns (to float
rounding: the kept keys are exact when nothing changed), which checks that each query and key sits at
its position (LLaDA: the queries at the last positions of the keys; LLaDA-MoE: the given position ids,
the block alone included under ``"dual"``).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from support import assert_close_reduced

from daca_kernels import MaskedLM
from daca_kernels.rollout.prefix_cache import full_backbone, llada_moe_states, llada_states
from released import hub

FOLDERS = ("llada", "llada_dllm", "lladamoe")
LENGTH, Q0, END = 12, 5, 8

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    loaded = {}

    def get(name):
        if name not in loaded:
            directory = hub.write_checkpoint(name, tmp_path_factory.mktemp(name), seed=4)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded[name] = hub.load(directory, name, dtype=torch.float64)
        return loaded[name]

    return get


def inputs(padded: bool):
    ids = torch.randint(0, hub.VOCAB - 4, (3, LENGTH), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, LENGTH, dtype=torch.bool)
    if padded:
        mask[1, :2] = False
        mask[2, :3] = False
    return ids.masked_fill(~mask, hub.FAMILIES["llada"].pad_id), mask


def released_states(model, ids, mask):
    kwargs = {} if mask is None else {"attention_mask": mask.long()}
    if "moe" in type(model).__name__.lower():
        return model.model(input_ids=ids, **kwargs).last_hidden_state
    return model.model(input_ids=ids, output_hidden_states=True, use_cache=False, **kwargs).hidden_states[-1]


def driven_states(model, ids, mask):
    if "moe" in type(model).__name__.lower():
        return llada_moe_states(model.model, ids, torch.arange(ids.shape[1]).expand_as(ids))
    return llada_states(model.model, ids, mask)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", FOLDERS)
def test_without_a_cache_the_driver_is_the_released_forward(models, name, padded):
    """The same computation: equal states (dllm's LLaDA given the padding as the released forward's
    additive bias; the others ignore every mask, so the released forward is run with the mask too)."""
    model = models(name)
    ids, mask = inputs(padded)
    want = released_states(model, ids, mask if padded else None)
    got = driven_states(model, ids, mask if padded and name == "llada_dllm" else None)
    assert_close_reduced(got, want, n=want.shape[-1], what=f"{name} hidden states")
    if padded and name == "llada_dllm":  # the mask reaches the blocks: without it the states differ
        assert not torch.allclose(driven_states(model, ids, None), want)


MODES = [("llada", "prefix"), ("llada_dllm", "prefix"), ("lladamoe", "prefix"), ("lladamoe", "dual")]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name, mode", MODES)
def test_reading_the_stored_keys_of_an_unchanged_sequence_gives_the_full_forward(models, name, mode, padded):
    model = models(name)
    lm = MaskedLM.from_hf(model)
    protocol = full_backbone(lm, mode)
    ids, mask = inputs(padded)
    valid = mask if padded else None
    columns = torch.arange(LENGTH)
    kept = columns[:Q0] if mode == "prefix" else torch.cat([columns[:Q0], columns[END:]])
    q1 = LENGTH if mode == "prefix" else END
    positions = protocol.positions(valid, 3, LENGTH)
    caches = {}
    full = protocol(ids, positions, valid, caches, kept)
    exact = lm.hidden(ids, mask.long() if padded else None)
    assert_close_reduced(full[mask], exact[mask], n=exact.shape[-1], what="the storing forward")
    read_valid = None if valid is None else torch.cat([valid[:, kept], valid[:, Q0:q1]], 1)
    read = protocol(ids[:, Q0:q1], positions[:, Q0:q1], read_valid, caches, None)
    assert_close_reduced(read, exact[:, Q0:q1], n=exact.shape[-1], what=f"{name}, {mode}: the cached call")
    # The kept keys matter: a cache stored from another sequence gives other states.
    other = ids.clone()
    other[:, :Q0] = (other[:, :Q0] + 1) % (hub.VOCAB - 4)
    protocol(other, positions, valid, caches, kept)
    assert not torch.allclose(protocol(ids[:, Q0:q1], positions[:, Q0:q1], read_valid, caches, None), read)


def test_llada_configs_the_driver_does_not_reproduce_are_refused(tmp_path):
    directory = hub.write_checkpoint("llada", tmp_path / "llada", seed=4, block_group_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = MaskedLM.from_hf(hub.load(directory, "llada"))
    with pytest.raises(ValueError, match="kv_cache='prefix'.*block_group_size"):
        full_backbone(lm, "prefix")
