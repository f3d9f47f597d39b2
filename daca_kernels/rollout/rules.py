"""The sampler rules of [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate], one small options object each.

``generate(lm, prompt_ids, gen_length=..., steps=..., seed=..., temperature=..., sampler=...)`` takes
one of these; the same options as flat keywords (``generate(..., block_length=32, remasking="random")``,
``rule="dream"`` for Dream's) keep working and mean the same. Each field is the keyword of that name
of [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] (documented there), with the same default and the same checks,
run when ``generate`` is called.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class LLaDASampler:
    """LLaDA's block-wise remasking (its released ``generate.py``) on a full-attention model, with the
    options that trade exactness for speed (``threshold``, ``kv_cache``, ``tokens_per_step``)."""

    rule: ClassVar[str] = "llada"
    block_length: int | None = None
    remasking: str = "low_confidence"
    mask_candidate: str = "exclude"
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    eos_id: int | None = None
    eot_id: int | None = None
    threshold: float | None = None
    kv_cache: str | None = None
    tokens_per_step: int | None = None


@dataclass(frozen=True)
class DreamSampler:
    """Dream's ``diffusion_generate`` (Dream-7B, DiffuCoder) on a full-attention model: one block,
    the commit order of ``alg``; None takes the released default."""

    rule: ClassVar[str] = "dream"
    alg: str | None = None
    alg_temp: float | None = None
    eps: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    mask_candidate: str = "exclude"


@dataclass(frozen=True)
class BlockSampler:
    """Block-wise decoding of a block-causal model (SDAR / TraDo, LLaDA2) as their released decoders
    do it: ``steps`` per block, top-k then top-p, the confidence threshold, the family's KV cache
    (None: when it has one), a stop after the block holding ``eos_id`` with ``stop_at_eos``."""

    top_k: int | None = None
    top_p: float | None = None
    threshold: float | None = None
    kv_cache: bool | None = None
    stop_at_eos: bool = False
    eos_id: int | None = None


SAMPLERS = (LLaDASampler, DreamSampler, BlockSampler)
# Every flat keyword of generate that a sampler object holds.
RULE_OPTIONS = frozenset({"rule"} | {f.name for cls in SAMPLERS for f in dataclasses.fields(cls)})


def sampler_keywords(sampler: LLaDASampler | DreamSampler | BlockSampler, block_causal: bool) -> dict:
    """``sampler``'s options as [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate]'s flat keywords (with ``rule``
    for the full-attention rules); a TypeError or ValueError naming ``sampler`` when it is not one of
    [`SAMPLERS`][daca_kernels.rollout.rules.SAMPLERS] or not the kind of the model (``block_causal``)."""
    if not isinstance(sampler, SAMPLERS):
        raise TypeError(f"sampler must be a LLaDASampler, DreamSampler or BlockSampler, got {type(sampler).__name__}")
    if block_causal != isinstance(sampler, BlockSampler):
        raise ValueError(f"sampler: a {'block-causal' if block_causal else 'full-attention'} lm is decoded with "
                         f"{'BlockSampler' if block_causal else 'LLaDASampler or DreamSampler'}, got "
                         f"{type(sampler).__name__}")
    keywords = dataclasses.asdict(sampler)
    return keywords if block_causal else {**keywords, "rule": sampler.rule}
