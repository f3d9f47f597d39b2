"""Configuration of a reference-loop run, and the per-task settings of the comparisons.

The named recipes (``diffu-grpo``, ``daca-grpo``, each base objective with and without DACA, the
ablations) live in [`daca_kernels.presets`][daca_kernels.presets], with their advantages in ``presets.ADVANTAGES``;
[`preset_settings`][integration.config.preset_settings] turns one into [`RunConfig`][integration.config.RunConfig] settings. A run is a
recipe plus everything
it shares with the others (rollouts, optimiser, budget).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from daca_kernels.diffusion_options import PRESET_DEFAULTS, DiffusionOptions
from daca_kernels.losses.advantages import ADVANTAGE_SCALES
from daca_kernels.presets import ADVANTAGES, PRESETS
from integration.model import ModelConfig
from integration.sft import SFTConfig

BACKENDS = ("fused", "reference")
# The RunConfig field holding each keyword of daca_kernels.group_advantages (the keys of presets.ADVANTAGES).
ADVANTAGE_FIELDS = {"scale": "advantage_scale", "leave_one_out": "leave_one_out"}


# The diffusion options (RunConfig.diffusion), which from_flat, replace, from_dict and task_config
# also take as top-level names.
DIFFUSION_FIELDS = tuple(f.name for f in dataclasses.fields(DiffusionOptions))


@dataclass(frozen=True)
class RunConfig:
    """One GRPO run. ``steps`` optimiser rounds, each on ``prompts_per_step * group_size`` rollouts.

    ``diffusion`` holds the objective, the estimator, the DPS token weights and each objective's
    options ([`daca_kernels.diffusion_options.DiffusionOptions`][daca_kernels.diffusion_options.DiffusionOptions],
    the options ``DiffusionGRPOConfig`` inherits, with the same names, defaults and checks);
    [`from_flat`][integration.config.RunConfig.from_flat], [`replace`][integration.config.RunConfig.replace] and
    [`task_config`][integration.config.task_config] take them by name beside the run's own settings.

    ``sft_seed`` picks the SFT warm start (runs that share it start from one checkpoint); ``seed``
    drives everything random in the RL phase (prompts, rollouts, masks). ``advantage_scale`` and
    ``leave_one_out`` are [`daca_kernels.group_advantages`][daca_kernels.losses.advantages.group_advantages]' ``scale`` and
    ``leave_one_out``
    (default: TRL's GRPO advantages; a preset sets its peer's, [`preset_settings`][integration.config.preset_settings]).
    ``kv_cache`` (None, ``"prefix"``, ``"dual"``) and ``threshold`` are the rollouts' options of
    [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] (the evaluation always decodes exactly). With such
    rollouts ``diffusion.sampling_importance_sampling_correction`` (``_mode``, ``_cap``) multiplies the
    token weights by the truncated importance weights of the committed tokens
    ([`daca_kernels.rl_step.sampling_importance_weights`][daca_kernels.rl_step.sampling_importance_weights]; grpo and dispo only).
    """

    task: str = "sort"
    diffusion: DiffusionOptions = field(default_factory=DiffusionOptions)
    backend: str = "fused"
    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    advantage_scale: str = "group"
    leave_one_out: bool = False
    inner_iterations: int = 2
    lr: float = 1e-4
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    temperature: float = 1.0
    gen_steps: int | None = None
    block_length: int | None = None
    kv_cache: str | None = None
    threshold: float | None = None
    eval_every: int = 10
    eval_prompts: int = 128
    checkpoint_every: int = 10
    seed: int = 0
    sft_seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self):
        if not isinstance(self.diffusion, DiffusionOptions):
            raise TypeError(f"diffusion must be a DiffusionOptions, got {type(self.diffusion).__name__}")
        if self.advantage_scale not in ADVANTAGE_SCALES:
            raise ValueError(f"advantage_scale must be one of {', '.join(ADVANTAGE_SCALES)}, got {self.advantage_scale!r}")
        if not isinstance(self.leave_one_out, bool):
            raise ValueError(f"leave_one_out must be a bool, got {self.leave_one_out!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("steps", "prompts_per_step", "group_size", "inner_iterations", "eval_every", "eval_prompts",
                     "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.kv_cache not in (None, "prefix", "dual"):
            raise ValueError(f"kv_cache must be None, 'prefix' or 'dual' (the rollouts' approximate KV cache), "
                             f"got {self.kv_cache!r}")
        if self.threshold is not None and (isinstance(self.threshold, bool) or not isinstance(self.threshold, float)
                                           or not 0.0 <= self.threshold <= 1.0):
            raise ValueError(f"threshold must be None or a float in [0, 1] (parallel decoding), got {self.threshold!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")

    @classmethod
    def from_flat(cls, **settings) -> "RunConfig":
        """The config of ``settings``: RunConfig's fields and
        [`DiffusionOptions`][daca_kernels.diffusion_options.DiffusionOptions]' by name (``objective="bgpo"``)."""
        diffusion = {name: settings.pop(name) for name in DIFFUSION_FIELDS if name in settings}
        return cls(diffusion=DiffusionOptions(**diffusion), **settings)

    def advantage_options(self) -> dict:
        """The keyword arguments of [`daca_kernels.group_advantages`][daca_kernels.losses.advantages.group_advantages] (``scale``,
        ``leave_one_out``)."""
        return {keyword: getattr(self, name) for keyword, name in ADVANTAGE_FIELDS.items()}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        """The config of ``to_dict``'s output (or of a flat one, as checkpoints of older code hold)."""
        values = dict(values)
        values["model"] = ModelConfig(**values["model"])
        values["sft"] = SFTConfig(**values["sft"])
        return cls.from_flat(**values.pop("diffusion", {}), **values)

    def replace(self, **changes) -> "RunConfig":
        """A copy with ``changes``, RunConfig's fields and DiffusionOptions' by name."""
        diffusion = {name: changes.pop(name) for name in DIFFUSION_FIELDS if name in changes}
        if diffusion:
            changes["diffusion"] = dataclasses.replace(self.diffusion, **diffusion)
        return dataclasses.replace(self, **changes)


def preset_settings(method: str) -> dict:
    """The [`RunConfig`][integration.config.RunConfig] settings of the named recipe ``method`` (a key of
    [`PRESETS`][daca_kernels.presets.PRESETS]):
    its objective, estimator and token-weight settings and its advantages (``presets.ADVANTAGES``)."""
    if method not in PRESETS:
        raise ValueError(f"method must be one of {', '.join(PRESETS)}, got {method!r}")
    return {**PRESETS[method], **{ADVANTAGE_FIELDS[keyword]: value for keyword, value in ADVANTAGES[method].items()}}


def describe_advantages(settings: dict) -> str:
    """The advantages of a variant's settings in a few symbols: ``A = r - mean``, ``A = r - others' mean``
    (leave-one-out), ``A = (r - mean) / std`` (group std) or ``... / batch std``; RunConfig's defaults
    for settings it lacks."""
    baseline = "others' mean" if settings.get("leave_one_out", RunConfig.leave_one_out) else "mean"
    scale = settings.get("advantage_scale", RunConfig.advantage_scale)
    if scale == "none":
        return f"A = r - {baseline}"
    return f"A = (r - {baseline}) / {'std' if scale == 'group' else 'batch std'}"


def shared_advantages(variants: dict[str, dict]) -> str | None:
    """[`describe_advantages`][integration.config.describe_advantages] of ``variants`` (name -> settings) when all have the same
    advantages, else None."""
    found = {describe_advantages(settings) for settings in variants.values()}
    return found.pop() if len(found) == 1 else None


def describe_variants(variants: dict[str, dict]) -> dict[str, str]:
    """[`describe_settings`][integration.config.describe_settings] of every variant (name -> settings), with its advantages
    ([`describe_advantages`][integration.config.describe_advantages]) when they differ between the variants."""
    show = shared_advantages(variants) is None
    return {name: describe_settings(settings) + (f", {describe_advantages(settings)}" if show else "")
            for name, settings in variants.items()}


def describe_settings(settings: dict) -> str:
    """A short human description of a variant's settings (objective, estimator, DPS)."""
    objective = settings.get("objective", PRESET_DEFAULTS["objective"])
    estimator = settings.get("estimator", PRESET_DEFAULTS["estimator"])
    parts = [objective, estimator]
    if estimator == "stratified":
        parts[-1] += f" K={settings.get('num_strata', PRESET_DEFAULTS['num_strata'])}"
    elif estimator == "elbo":
        parts[-1] += f" n={settings.get('elbo_samples', PRESET_DEFAULTS['elbo_samples'])}"
    if settings.get("prompt_mask_prob"):
        parts.append(f"prompt p={settings['prompt_mask_prob']}")
    if settings.get("mask_block_length"):
        parts.append(f"block masks {settings['mask_block_length']}")
    if settings.get("dps"):
        parts.append("DPS")
    return ", ".join(parts)


# Per-task settings of the comparisons: an SFT warm start that earns a reward above zero (the
# JSON task needs a larger policy and a longer warm-up to emit valid JSON at all).
TASK_DEFAULTS = {
    "sort": {},
    "sudoku4": dict(sft=SFTConfig(steps=300)),
    "constraints": dict(sft=SFTConfig(steps=600)),
    "json_schema": dict(model=ModelConfig(hidden_size=128, num_layers=3, intermediate_size=384),
                        sft=SFTConfig(steps=2400, lr=1e-3)),
}


def task_config(task: str, **overrides) -> RunConfig:
    """The configuration of ``task`` ([`TASK_DEFAULTS`][integration.config.TASK_DEFAULTS]) with ``overrides``."""
    if task not in TASK_DEFAULTS:
        raise ValueError(f"task must be one of {', '.join(TASK_DEFAULTS)}, got {task!r}")
    return RunConfig.from_flat(task=task, **{**TASK_DEFAULTS[task], **overrides})
