"""The SDAR and LLaDA2 doubles of tests/families against their released files, so that the two cannot drift apart.

The doubles stay for what the released files cannot give quickly (float64 models with a biased head for the
token-for-token sampler tests, the transformers-5 failure modes their docstrings list); here each is built with
the tiny config of the released checkpoint, given the released model's weights, and compared: parameter and
buffer names and shapes, tied-weight declarations, rotary buffers, the classes of their outputs, and the logits
of the same inputs under every mask form the families' code takes (and the errors of the forms it refuses).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from families import llada2, sdar

from released import hub

DOUBLES = {"sdar": sdar, "llada2": llada2}
S = 4
EPS32 = torch.finfo(torch.float32).eps

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


def pair(name, tmp_path):
    """``(released, double)``: the checkpoint's model and the double built from the same config holding its weights."""
    directory = hub.write_checkpoint(name, tmp_path, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        released = hub.load(directory, name)
    double = DOUBLES[name].tiny(**hub.FAMILIES[name].config)
    double.load_state_dict(released.state_dict(), strict=True)
    return released, double.eval()


def assert_same_logits(released, double, what, **inputs):
    with torch.no_grad():
        want, got = released(**inputs), double(**inputs)
    assert type(got).__name__ == type(want).__name__, what
    assert got.logits.dtype == want.logits.dtype and got.logits.shape == want.logits.shape, what
    # Norm-wise: the same weights through two implementations of the same float32 computation.
    err = (got.logits.double() - want.logits.double()).norm()
    assert err <= 1e2 * EPS32 * (1 + want.logits.double().norm()), f"{what}: |double - released| = {err:.3e}"


def block_keep(batch, length, pads=None):
    """bool ``[B, 1, L, L]``: the block-causal rule (blocks from column 0), padding keys hidden, every query
    keeping itself."""
    block = torch.arange(length) // S
    keep = (block[None, :] <= block[:, None]).expand(batch, 1, length, length).clone()
    for b, pad in enumerate(pads or []):
        keep[b, :, :, :pad] = False
    return keep | torch.eye(length, dtype=torch.bool)


def additive(keep, dtype=torch.float32):
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_a_double_declares_what_its_released_file_declares(name, tmp_path):
    released, double = pair(name, tmp_path)
    assert type(double).__name__ == type(released).__name__
    assert double.config.model_type == released.config.model_type
    want, got = released.state_dict(), double.state_dict()
    assert list(got) == list(want)  # parameters and persistent buffers (LLaDA2's gate expert_bias), in order
    assert all(got[key].shape == want[key].shape and got[key].dtype == want[key].dtype for key in want)
    assert type(double)._tied_weights_keys == type(released)._tied_weights_keys
    assert double.get_output_embeddings().weight is not double.get_input_embeddings().weight
    assert released.get_output_embeddings().weight is not released.get_input_embeddings().weight
    assert double.base_model_prefix == released.base_model_prefix
    assert type(double.get_decoder()).__name__ == type(released.get_decoder()).__name__
    assert double.supports_gradient_checkpointing == released.supports_gradient_checkpointing
    rotary = {n: m.inv_freq for n, m in released.named_modules() if hasattr(m, "inv_freq")}
    assert rotary and rotary.keys() == {n for n, m in double.named_modules() if hasattr(m, "inv_freq")}
    fresh = DOUBLES[name].tiny(**hub.FAMILIES[name].config)
    for module_name, inv_freq in rotary.items():
        ours = dict(fresh.named_modules())[module_name].inv_freq
        torch.testing.assert_close(ours, inv_freq, rtol=0, atol=0, msg=module_name)


def test_sdar_double_gives_the_released_logits_under_each_mask_form(tmp_path):
    released, double = pair("sdar", tmp_path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (3, 11), generator=g)
    positions = torch.arange(11).expand(3, 11)
    assert_same_logits(released, double, "block-causal bool mask", input_ids=ids,
                       attention_mask=block_keep(3, 11), position_ids=positions, use_cache=False)
    assert_same_logits(released, double, "block-causal bool mask with padding", input_ids=ids,
                       attention_mask=block_keep(3, 11, [0, 2, 5]), position_ids=positions, use_cache=False)
    assert_same_logits(released, double, "all-ones 2-D mask (full attention)", input_ids=ids,
                       attention_mask=torch.ones_like(ids), use_cache=False)
    assert_same_logits(released, double, "no mask (full attention)", input_ids=ids, use_cache=False)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0
    assert_same_logits(released, double, "2-D key-padding mask", input_ids=ids, attention_mask=padding,
                       use_cache=False)
    # The KV-cache protocol of the released decoder: a stored prefix, then a block read against it.
    keep = block_keep(1, 12)
    logits = []
    for model in (released, double):
        cache = sdar.SubscriptableCache()
        with torch.no_grad():
            model(input_ids=ids[:1, :8], attention_mask=keep[:, :, :8, :8], position_ids=positions[:1, :8],
                  past_key_values=cache, use_cache=True, store_kv=True)
            block = torch.randint(0, 60, (1, 4), generator=torch.Generator().manual_seed(1))
            logits.append(model(input_ids=block, attention_mask=keep[:, :, 8:12, :12],
                                position_ids=torch.arange(8, 12)[None], past_key_values=cache, use_cache=True,
                                store_kv=False).logits)
    assert (logits[1] - logits[0]).norm() <= 1e2 * EPS32 * (1 + logits[0].norm())


def test_llada2_double_gives_the_released_logits_under_each_mask_form(tmp_path):
    released, double = pair("llada2", tmp_path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (3, 11), generator=g)
    positions = torch.arange(11).expand(3, 11)
    assert_same_logits(released, double, "block-causal additive mask", input_ids=ids,
                       attention_mask=additive(block_keep(3, 11)), position_ids=positions, use_cache=False)
    assert_same_logits(released, double, "block-causal additive mask with padding", input_ids=ids,
                       attention_mask=additive(block_keep(3, 11, [0, 2, 5])), position_ids=positions, use_cache=False)
    assert_same_logits(released, double, "no mask (full attention)", input_ids=ids, use_cache=False)
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    assert_same_logits(released, double, "2-D mask with a 0 (causal for the batch)", input_ids=ids,
                       attention_mask=padded, use_cache=False)
    assert_same_logits(released, double, "one 4-D mask for the batch", input_ids=ids,
                       attention_mask=additive(block_keep(1, 11)), position_ids=positions, use_cache=False)
    for model in (released, double):  # the released generate's bfloat16 mask on a float32 model
        with pytest.raises(RuntimeError):
            model(input_ids=ids, attention_mask=additive(block_keep(3, 11), torch.bfloat16), use_cache=False)
