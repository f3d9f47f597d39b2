"""Every released family loads from a hub-style checkpoint with the library's loader, and the loaded model
is the one that was saved (same logits), on the installed transformers."""
import warnings

import pytest
import torch
import transformers

from released import hub


def call_kwargs(name):
    # The released LLaDA code reads config.use_cache, which transformers 5 drops from the config; dllm's
    # Dream refuses attention_mask=None and takes "full" for no mask.
    if name.startswith("llada"):
        return {"use_cache": False}
    return {"attention_mask": "full"} if name == "dream_dllm" else {}


@pytest.mark.parametrize("name", sorted(hub.FAMILIES))
def test_a_checkpoint_loads_and_gives_the_saved_models_logits(name, tmp_path):
    directory = hub.write_checkpoint(name, tmp_path / "first", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = hub.load(directory, name)
        second = hub.load(directory, name)
    ids = torch.randint(0, hub.VOCAB - 3, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = first(ids, **call_kwargs(name)).logits
        again = second(ids, **call_kwargs(name)).logits
    assert logits.shape == (2, 8, hub.VOCAB) and bool(torch.isfinite(logits).all())
    assert torch.equal(logits, again)  # the same weights and code in the same order: exact by construction
    assert type(first).__name__ == hub.FAMILIES[name].architectures[0]


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="transformers 5's post_init() contract (all_tied_weights_keys, tie_weights arguments)")
def test_finish_construction_completes_a_released_llada_built_directly(tmp_path):
    # LLaDA-8B's __init__ skips post_init() and its tie_weights() takes no arguments; a model built
    # from its class directly (as a partitioned reference copy is) is completed without editing it.
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from daca_kernels.models.model_loading import finish_construction

    directory = hub.write_checkpoint("llada", tmp_path / "llada")
    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    model = get_class_from_dynamic_module(hub.FAMILIES["llada"].auto_map["AutoModel"], str(directory))(config)
    assert getattr(model, "all_tied_weights_keys", None) is None
    with pytest.raises(TypeError):
        model.tie_weights(recompute_mapping=True)  # what transformers 5's post_init() calls
    assert finish_construction(model) is model
    assert getattr(model, "all_tied_weights_keys", None) is not None
    assert "tie_weights" not in model.__dict__  # the tolerant stand-in was removed again
