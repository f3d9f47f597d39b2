"""Supervised warm-up of the tiny policy with the masked-diffusion loss, cached on disk.

Each step draws a batch of task examples, masks every completion token of row b independently with
probability ``t_b ~ U(0.05, 1)`` (at least one per row) and minimises LLaDA's SFT loss
``-sum_b sum_{i masked} log p(y_i | x_masked) / t_b / (B * C)``, C the completion length. Only the
masked rows go through the head ([`daca_kernels.linear_logprob`][daca_kernels.ops.linear_logprob]).

The result is cached under ``cache_dir`` keyed by everything that determines it (task, model and
SFT configuration, seed), so the runs of a comparison start from one identical checkpoint.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from daca_kernels import linear_logprob
from integration.checkpoint import load_checkpoint, save_checkpoint
from integration.model import ModelConfig, as_masked_lm, build_model
from integration.tasks import vocab
from integration.tasks.base import Task

MIN_MASK_RATIO = 0.05


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 150
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0


def masked_diffusion_loss(lm, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """LLaDA's SFT loss on one batch: prompt ids ``[B, P]``, target completion ids ``[B, C]``."""
    batch, length = completion_ids.shape
    ratio = MIN_MASK_RATIO + (1 - MIN_MASK_RATIO) * torch.rand(batch, 1, generator=generator)
    masked = torch.rand(batch, length, generator=generator) < ratio
    masked[torch.arange(batch), torch.randint(0, length, (batch,), generator=generator)] = True
    noisy = torch.where(masked, vocab.mask_id, completion_ids)
    attention = torch.cat([prompt_ids != vocab.pad_id, torch.ones_like(masked)], dim=1).long()
    hidden = lm.hidden(torch.cat([prompt_ids, noisy], dim=1), attention)[:, prompt_ids.shape[1]:]
    b, i = masked.nonzero(as_tuple=True)
    logp = linear_logprob(hidden[b, i], lm.head_weight, completion_ids[b, i], bias=lm.head_bias)
    return -(logp / ratio[b, 0]).sum() / (batch * length)


def cache_path(cache_dir: Path, task: Task, model_config: ModelConfig, sft_config: SFTConfig, seed: int) -> Path:
    key = json.dumps(
        {"task": task.name, "model": model_config.to_dict(), "sft": asdict(sft_config), "seed": seed, "vocab": vocab.size},
        sort_keys=True,
    )
    return Path(cache_dir) / f"sft-{task.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def warm_start(
    task: Task,
    model_config: ModelConfig,
    sft_config: SFTConfig,
    *,
    seed: int,
    cache_dir: str | Path,
    progress: bool = True,
):
    """The SFT-initialised policy (a transformers model), trained now or read from the cache."""
    model = build_model(model_config, seed)
    path = cache_path(Path(cache_dir), task, model_config, sft_config, seed)
    if path.exists():
        model.load_state_dict(load_checkpoint(path, required=("model",))["model"])
        return model
    lm = as_masked_lm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft_config.lr, weight_decay=sft_config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * (1 - s / sft_config.steps))
    model.train()
    bar = tqdm(range(sft_config.steps), desc=f"SFT {task.name}", disable=None if progress else True, leave=False)
    for step in bar:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        prompts, examples = task.batch(sft_config.batch_size, seed=seed * 1_000_003 + step)
        loss = masked_diffusion_loss(lm, prompts, task.reference_ids(examples), generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    save_checkpoint(path, {"model": model.state_dict()})
    return model
