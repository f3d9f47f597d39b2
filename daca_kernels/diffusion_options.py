"""The diffusion settings of an RL run, declared once: the objective, the likelihood estimator, the
DPS token weights and the options of each objective.

[`DiffusionOptions`][daca_kernels.diffusion_options.DiffusionOptions] is the dataclass that
``DiffusionGRPOConfig`` (TRL's ``GRPOConfig`` plus these) inherits and the reference loop's
``RunConfig`` holds as ``diffusion``; its checks run once, in
[`resolve_diffusion_options`][daca_kernels.diffusion_options.DiffusionOptions.resolve_diffusion_options].
The settings a preset fills ([`PRESET_DEFAULTS`][daca_kernels.diffusion_options.PRESET_DEFAULTS]) default to
None, "not given", so that an explicit value wins over a preset and a preset over the default.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from daca_kernels.credit import VARIANTS as DPS_VARIANTS
from daca_kernels.likelihood.estimator import ESTIMATORS, EstimatorSpec
from daca_kernels.losses.spg import NEGATIVE_BOUNDS
from daca_kernels.objectives import OBJECTIVES
from daca_kernels.rl_step import check_estimator_for, check_sampling_correction
from daca_kernels.validation import check_bool, check_choice, check_float, check_int

# The settings a preset may fill and their values when neither the preset nor the user sets them.
PRESET_DEFAULTS = dict(objective="grpo", estimator="one_step", num_strata=4, elbo_samples=2, prompt_mask_prob=0.0,
                       dps=False)


@dataclass
class DiffusionOptions:
    """The objective, the estimator, the DPS token weights and each objective's options.

    Defaults that differ from a peer's:

    - ``spg_bound``: ``"mix"`` (SPG's headline "SPG w/ Mixture" recipe, EUBO weight 0.5);
      ``spg_loss``'s own default is ``"eubo"``, and SPG's config has no default.
    - ``spg_beta``: 1.0; SPG's config 1.5 (its released scripts use 1.0 to 2.0 by task).
    """

    objective: str | None = field(default=None, metadata={"help": ", ".join(OBJECTIVES) + " (default grpo)"})
    estimator: str | None = field(default=None, metadata={"help": ", ".join(ESTIMATORS) + " (default one_step)"})
    num_strata: int | None = field(default=None, metadata={"help": "SML strata K (estimator='stratified'; default 4)"})
    elbo_samples: int | None = field(default=None, metadata={"help": "ELBO mask samples (estimator='elbo'; "
                                                                     "default 2)"})
    prompt_mask_prob: float | None = field(default=None, metadata={"help": "d1's prompt masking probability "
                                                                           "(default 0)"})
    mask_block_length: int | None = field(default=None, metadata={"help": "SPG's block-wise ELBO masks"})
    mask_block_choice: str = field(
        default="uniform",
        metadata={"help": "how a block-wise ELBO mask picks its block: uniform, or spg (SPG's randperm % blocks)"},
    )
    dps: bool | None = field(default=None, metadata={"help": "DPS token weights in the loss (default False)"})
    dps_variant: str = field(default="progress", metadata={"help": "progress, self or lookahead"})
    dps_scale: float = field(default=0.5, metadata={"help": "DPS spread (0: all weights 1)"})
    dps_clip: list[float] | None = field(default_factory=lambda: [0.2, 5.0],
                                         metadata={"help": "DPS weight clip [low, high], or None"})
    spg_bound: str = field(default="mix", metadata={"help": "SPG's bound for A < 0: eubo, mix or elbo. Default "
                                                            "'mix' (SPG's mixture recipe); spg_loss's own default "
                                                            "is 'eubo'"})
    spg_beta: float = field(default=1.0, metadata={"help": "SPG's Renyi order (>= 1); SPG's config uses 1.5"})
    spg_mix_weight: float = field(default=0.5, metadata={"help": "SPG's EUBO weight in 'mix', in [0, 1]"})
    dispo_fillings: int = field(default=4, metadata={"help": "DiSPO's fillings Z of each branch state (>= 2)"})
    dispo_alpha: float = field(default=1.0, metadata={"help": "DiSPO's weight of the step loss"})
    dispo_branch_fraction: float = field(default=0.5, metadata={"help": "DiSPO's branch step, as a fraction "
                                                                         "of the denoising steps, in [0, 1)"})
    sampling_importance_sampling_correction: bool = field(
        default=False,
        metadata={"help": "correct an approximate rollout (a KV cache, parallel decoding): multiply each answer "
                          "token's policy-gradient term by the truncated importance weight min(p_full / "
                          "p_sampling, cap) of its committed token, p_full from full forwards of the states it was "
                          "committed from (grpo and dispo only; costs those forwards). TRL's "
                          "vllm_importance_sampling_correction for a diffusion sampler"})
    sampling_importance_sampling_mode: str = field(
        default="token_truncate", metadata={"help": "token_truncate (one weight per token) or sequence_truncate "
                                                    "(one per completion: the product of its tokens' ratios)"})
    sampling_importance_sampling_cap: float = field(
        default=3.0, metadata={"help": "the truncation C of the weights (> 0; TRL's default for its engine "
                                       "correction)"})

    def __post_init__(self):
        self.resolve_diffusion_options()

    def resolve_diffusion_options(self, recipe: dict | None = None) -> None:
        """Fills each setting left None from ``recipe`` (a preset's settings), then from
        [`PRESET_DEFAULTS`][daca_kernels.diffusion_options.PRESET_DEFAULTS], and checks every option: a
        TypeError for a wrong type, a ValueError for a wrong value, the message starting with the
        option's name."""
        for name, default in PRESET_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, (recipe or {}).get(name, default))
        check_choice(self.objective, "objective", tuple(OBJECTIVES))
        self.estimator_spec()  # the estimator's settings, checked by the spec
        check_estimator_for(self.objective, self.estimator)
        for name, choices in (("dps_variant", DPS_VARIANTS), ("spg_bound", NEGATIVE_BOUNDS)):
            check_choice(getattr(self, name), name, choices)
        check_int(self.dispo_fillings, "dispo_fillings", low=2)
        check_bool(self.dps, "dps")
        check_float(self.dps_scale, "dps_scale", minimum=0.0)
        if self.dps_clip is not None:
            if not isinstance(self.dps_clip, (list, tuple)) or len(self.dps_clip) != 2:
                raise TypeError(f"dps_clip must be a [low, high] pair or None, got {self.dps_clip!r}")
            low, high = (check_float(v, f"dps_clip[{i}]", minimum=0.0, exclusive_minimum=True)
                         for i, v in enumerate(self.dps_clip))
            if low > high:
                raise ValueError(f"dps_clip must be [low, high] with low <= high, got {self.dps_clip!r}")
            self.dps_clip = [low, high]
        check_float(self.spg_beta, "spg_beta", minimum=1.0)
        check_float(self.spg_mix_weight, "spg_mix_weight", minimum=0.0, maximum=1.0)
        check_float(self.dispo_alpha, "dispo_alpha", minimum=0.0)
        check_float(self.dispo_branch_fraction, "dispo_branch_fraction", minimum=0.0, maximum=1.0,
                    exclusive_maximum=True)
        check_sampling_correction(self.sampling_importance_sampling_correction, self.sampling_importance_sampling_mode,
                                  self.sampling_importance_sampling_cap, self.objective)

    def estimator_spec(self) -> EstimatorSpec:
        """The estimator and its settings
        ([`EstimatorSpec`][daca_kernels.likelihood.estimator.EstimatorSpec], checked)."""
        return EstimatorSpec.from_config(self)

    def dps_options(self) -> dict:
        """The keyword arguments of [`daca_kernels.credit.dps_weights`][daca_kernels.credit.dps_weights]
        (``variant``, ``scale``, ``clip``)."""
        return dict(variant=self.dps_variant, scale=self.dps_scale,
                    clip=None if self.dps_clip is None else tuple(self.dps_clip))
