"""Every released family loads from a hub-style checkpoint with the library's loader, and the loaded model
is the one that was saved (same logits), on the installed transformers."""
import warnings

import pytest
import torch

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
