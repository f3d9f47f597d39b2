"""The model adapter ([`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM]), the released model families it recognises, loading their
code, and the library's own tiny bidirectional transformers model.

Users import from here: ``from daca_kernels.models import MaskedLM, BidirectionalConfig,
BidirectionalLM, from_pretrained``. ``BidirectionalConfig`` and ``BidirectionalLM`` are transformers
models, imported on first use so that [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] (and the whole core) imports without
transformers; without it, asking for them is an ImportError naming the ``hf`` extra.
"""
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.models.model_loading import default_generation_config, from_pretrained

_BIDIRECTIONAL = ("BidirectionalConfig", "BidirectionalLM")

__all__ = ["BidirectionalConfig", "BidirectionalLM", "MaskedLM", "default_generation_config", "from_pretrained"]


def __getattr__(name: str):
    if name in _BIDIRECTIONAL:
        from daca_kernels.models import bidirectional

        return getattr(bidirectional, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
