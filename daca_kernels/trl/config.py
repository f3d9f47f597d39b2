"""``DiffusionGRPOConfig``: TRL's ``GRPOConfig`` plus the diffusion settings, every option checked
at construction (the trainer and its overview: [`daca_kernels.trl`][daca_kernels.trl])."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import TrainingArguments
from trl import GRPOConfig

from daca_kernels.diffusion_options import DiffusionOptions
from daca_kernels.losses.advantages import ADVANTAGE_SCALES
from daca_kernels.losses.grpo import (
    CLIPPED_LOSS_TYPES,
    IMPORTANCE_LEVELS,
    LOSS_TYPES,
)
from daca_kernels.objectives import OBJECTIVES
from daca_kernels.presets import ADVANTAGES, PRESETS
from daca_kernels.rollout import REMASKING
from daca_kernels.rollout import RULES as ROLLOUT_RULES
from daca_kernels.rollout.prefix_cache import CACHE_MODES
from daca_kernels.rollout.remasking import DREAM_ALGS
from daca_kernels.validation import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_nonnegative_float,
)

# The advantages when the preset names none (TRL's GRPO): group_advantages keyword arguments.
DEFAULT_ADVANTAGES = dict(scale="group", leave_one_out=False)

# transformers 5 names the setting activation_checkpointing (gradient_checkpointing its deprecated alias);
# transformers 4's TrainingArguments has gradient_checkpointing only.
_TRAINER_KNOWS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}

# LLaDA's semi-autoregressive block length when ``block_length`` is unset (d1's setting).
LLADA_BLOCK_LENGTH = 32

# TRL options this trainer does not implement, with the value they must keep (TRL's default).

UNSUPPORTED_TRL_OPTIONS = dict(use_vllm=False, use_transformers_paged=False, use_transformers_continuous_batching=False,
                               multi_objective_aggregation="sum_then_normalize", top_entropy_quantile=1.0,
                               off_policy_mask_threshold=None, mask_truncated_completions=False, entropy_coef=0.0,
                               use_adaptive_entropy=False, min_p=None, repetition_penalty=1.0,
                               generation_kwargs=None)


@dataclass
class DiffusionGRPOConfig(DiffusionOptions, GRPOConfig):
    """``GRPOConfig`` plus the diffusion settings (docs/trl.md has the table).

    ``preset`` (a key of [`daca_kernels.presets.PRESETS`][daca_kernels.presets.PRESETS]) fills ``objective``, ``estimator``,
    ``num_strata``, ``elbo_samples``, ``prompt_mask_prob`` and ``dps``, and from
    [`daca_kernels.presets.ADVANTAGES`][daca_kernels.presets.ADVANTAGES] ``scale_rewards`` and ``leave_one_out`` (the advantages
    of the peer the recipe is named after); an option given explicitly (not None) wins over the
    preset; what neither sets takes [`PRESET_DEFAULTS`][daca_kernels.diffusion_options.PRESET_DEFAULTS] (advantages: TRL's,
    group-scaled).

    The objective, estimator, DPS and per-objective options are those of
    [`DiffusionOptions`][daca_kernels.diffusion_options.DiffusionOptions], inherited with their checks; the
    sampler's options and TRL's are this config's own.

    Every option is checked here (TypeError for a wrong type, ValueError for a wrong value, the
    message starting with the option's name), the inherited TRL options this trainer reads too.

    Defaults that differ from a peer's:

    - ``temperature``: TRL's 1.0 (DiffuCoder's too); ``rollout.generate``'s own default is 0
      (greedy), d1's and SPG's configs 0.9.
    - ``spg_bound``, ``spg_beta``: DiffusionOptions' (SPG's mixture recipe, order 1.0).
    - ``use_bias_correction_kl``: False (d1's plain k3 penalty; TRL's default is True).
    """

    preset: str | None = field(default=None, metadata={"help": "A named recipe: " + ", ".join(PRESETS)})
    diffusion_steps: int = field(default=128, metadata={"help": "denoising steps per completion"})
    sampling_rule: str = field(default="llada", metadata={"help": "the rollouts' sampler: llada (LLaDA's block-wise "
                                                                  "remasking) or dream (Dream's and DiffuCoder's "
                                                                  "diffusion_generate)"})
    block_length: int | None = field(default=None, metadata={"help": "semi-autoregressive block length (llada; "
                                                                     "default 32, a block-causal model's own "
                                                                     "block size); dream decodes one block"})
    remasking: str | None = field(default=None, metadata={"help": "llada's commit order: low_confidence (default) "
                                                                  "or random"})
    sampling_alg: str | None = field(default=None, metadata={"help": "dream's commit order (its alg): origin "
                                                                     "(default), maskgit_plus, topk_margin or "
                                                                     "entropy"})
    sampling_alg_temp: float | None = field(default=None, metadata={"help": "dream's alg_temp (default 0)"})
    sampling_eps: float | None = field(default=None, metadata={"help": "dream's eps, the schedule's last time "
                                                                       "(default 1e-3)"})
    sampling_threshold: float | None = field(default=None, metadata={"help": "commit every position of the block "
                                                                             "whose confidence exceeds it (at least "
                                                                             "the step's top-k): block-diffusion "
                                                                             "models' released rule, parallel "
                                                                             "decoding for llada's rule on "
                                                                             "full-attention models; None: top-k "
                                                                             "only"})
    sampling_kv_cache: str | None = field(default=None, metadata={"help": "full-attention models under llada's rule: "
                                                                          "prefix or dual, Fast-dLLM's approximate "
                                                                          "KV cache (fewer forward tokens; the "
                                                                          "rollout is no longer the exact sampler's); "
                                                                          "None: exact"})
    mask_candidate: str = field(default="exclude", metadata={"help": "exclude (the mask id is never sampled), or "
                                                                     "the released sampler's rule: llada or dream "
                                                                     "(the one of sampling_rule)"})
    mask_token_id: int | None = field(default=None, metadata={"help": "the [MASK] id (default: the tokenizer's, "
                                                                      "then the model's)"})
    shift_logits: bool | None = field(default=None, metadata={"help": "hidden state i - 1 predicts token i; default: "
                                                                      "the model family's (Dream, DiffuCoder: "
                                                                      "True; others False)"})
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "k3 KL times the importance ratio; "
                                                                          "False (d1's plain k3), TRL's default "
                                                                          "is True"})
    # TRL's options whose defaults differ here or that a preset fills.
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the rollouts (>= 0, 0: "
                                                              "greedy). TRL's default 1.0 (DiffuCoder's too); "
                                                              "rollout.generate's own default is 0, d1's and "
                                                              "SPG's configs 0.9"})
    scale_rewards: str | None = field(default=None, metadata={"help": "group, batch or none (TRL's); default: "
                                                                      "the preset's (d1, SPG, DiffuCoder: none), "
                                                                      "else TRL's group"})
    leave_one_out: bool | None = field(default=None, metadata={"help": "baseline each reward with the mean of the "
                                                                       "other completions of its prompt (RLOO, "
                                                                       "DiffuCoder's); default: the preset's, "
                                                                       "else False"})
    # TRL's default (checkpointing on) under transformers 5's name, set in __post_init__ when neither
    # name is given: TRL's config sets the deprecated ``gradient_checkpointing``, so every config built
    # from it warned that the name is deprecated.
    activation_checkpointing: bool | None = field(default=None, metadata={"help": "recompute activations in "
                                                                                   "the backward (default True, "
                                                                                   "TRL's)"})
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "transformers' deprecated alias "
                                                                                "of activation_checkpointing"})

    def __post_init__(self):
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True
        if not _TRAINER_KNOWS_ACTIVATION_CHECKPOINTING:
            # transformers 4's Trainer reads gradient_checkpointing only: the two names are one setting.
            if self.gradient_checkpointing is None:
                self.gradient_checkpointing = self.activation_checkpointing
            self.activation_checkpointing = self.gradient_checkpointing
        if self.preset is not None:
            check_choice(self.preset, "preset", tuple(PRESETS))
        self.resolve_diffusion_options(PRESETS.get(self.preset, {}))
        # TRL's post-init by name: DiffusionOptions' (first in the bases, so that TRL's fields keep their
        # positions, output_dir first) resolves without the preset, which the line above has done.
        GRPOConfig.__post_init__(self)
        for name, default in UNSUPPORTED_TRL_OPTIONS.items():
            if getattr(self, name) != default:
                raise ValueError(f"{name} is not supported by DiffusionGRPOTrainer; leave it at {default!r}")
        advantages = ADVANTAGES.get(self.preset, DEFAULT_ADVANTAGES)
        if self.scale_rewards is None:
            self.scale_rewards = advantages["scale"]
        if self.leave_one_out is None:
            self.leave_one_out = advantages["leave_one_out"]
        self._check_options()
        self._check_trl_options()

    def _check_options(self) -> None:
        """The options this config adds besides DiffusionOptions' (and ``max_completion_length``, the
        generation length)."""
        self._check_sampling_rule()
        if self.mask_token_id is not None:
            check_int(self.mask_token_id, "mask_token_id", low=0)
        for name in ("use_bias_correction_kl", "leave_one_out"):
            check_bool(getattr(self, name), name)
        if self.shift_logits is not None:
            check_bool(self.shift_logits, "shift_logits")

    def _check_sampling_rule(self) -> None:
        """``sampling_rule`` and the options of each rule (an option of the other rule must be left
        unset); fills ``remasking`` for ``llada``. ``block_length`` stays as given: None is 32 for a
        bidirectional model under ``llada`` and the model's block size for a block-causal one
        ([`sampler_options`][daca_kernels.trl.config.DiffusionGRPOConfig.sampler_options]). ``top_p``, ``top_k``: TRL's, Dream's filters."""
        check_choice(self.sampling_rule, "sampling_rule", ROLLOUT_RULES)
        check_choice(self.mask_candidate, "mask_candidate", ("exclude", self.sampling_rule))
        check_int(self.max_completion_length, "max_completion_length", low=1)
        check_int(self.diffusion_steps, "diffusion_steps", low=1)
        if self.block_length is not None:
            check_int(self.block_length, "block_length", low=1)
        if self.sampling_rule == "llada":
            for name, unset in (("sampling_alg", None), ("sampling_alg_temp", None), ("sampling_eps", None),
                                ("top_p", 1.0), ("top_k", 0)):
                if getattr(self, name) != unset:
                    raise ValueError(f"{name} is an option of sampling_rule='dream'; leave it at {unset!r} with "
                                     f"sampling_rule='llada', got {getattr(self, name)!r}")
            self.remasking = "low_confidence" if self.remasking is None else self.remasking
            check_choice(self.remasking, "remasking", REMASKING)
            if self.block_length is not None:
                self._check_blocks(self.block_length)
            if self.sampling_threshold is not None:
                check_float(self.sampling_threshold, "sampling_threshold", minimum=0.0, maximum=1.0)
            if self.sampling_kv_cache is not None:
                check_choice(self.sampling_kv_cache, "sampling_kv_cache", CACHE_MODES)
            return
        for name in ("remasking", "sampling_threshold", "sampling_kv_cache"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is an option of sampling_rule='llada'; with 'dream' choose the commit "
                                 f"order with sampling_alg, got {getattr(self, name)!r}")
        if self.block_length not in (None, self.max_completion_length):
            raise ValueError(f"block_length must be unset or max_completion_length ({self.max_completion_length}) "
                             f"with sampling_rule='dream' (one block), got {self.block_length!r}")
        if self.sampling_alg is not None:
            check_choice(self.sampling_alg, "sampling_alg", DREAM_ALGS)
        if self.sampling_alg_temp is not None:
            check_nonnegative_float(self.sampling_alg_temp, "sampling_alg_temp")
        if self.sampling_eps is not None:
            check_float(self.sampling_eps, "sampling_eps", minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_float(self.top_p, "top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)
        check_int(self.top_k, "top_k", low=0)

    def _check_blocks(self, block_length: int) -> None:
        """LLaDA's semi-autoregressive blocks: ``block_length`` divides the completion and the
        number of blocks divides ``diffusion_steps``."""
        if self.max_completion_length % block_length:
            raise ValueError(f"max_completion_length ({self.max_completion_length}) must be divisible by "
                             f"block_length ({block_length})")
        if self.diffusion_steps % (self.max_completion_length // block_length):
            raise ValueError(f"diffusion_steps ({self.diffusion_steps}) must be divisible by the number of blocks "
                             f"max_completion_length / block_length = {self.max_completion_length // block_length}")

    def sampler_options(self, attention: str | tuple[str, int] = "full") -> dict:
        """The keyword arguments of [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] (``steps`` included) that say
        how rollouts of a model with ``attention`` (``MaskedLM.attention``) are sampled.

        A block-causal model (``("block", S)``: SDAR, LLaDA2) is decoded block by block with its KV
        cache, ``max(1, min(S, diffusion_steps * S // max_completion_length))`` steps per block (so
        ``diffusion_steps`` keeps counting the steps of a whole completion), under ``llada``'s top-k
        schedule or ``sampling_threshold``; ``block_length`` must be unset or ``S``. A ValueError
        names an option the model's decoding cannot honour."""
        options = dict(rule=self.sampling_rule, mask_candidate=self.mask_candidate)
        if attention != "full":
            size = attention[1]
            for name, value, allowed in (("sampling_rule", self.sampling_rule, "llada"),
                                         ("remasking", self.remasking, "low_confidence"),
                                         ("mask_candidate", self.mask_candidate, "exclude")):
                if value != allowed:
                    raise ValueError(f"{name}: a block-causal model is decoded block by block with the top-k or "
                                     f"confidence-threshold rule; {name} must be {allowed!r}, got {value!r}")
            if self.sampling_kv_cache is not None:
                raise ValueError(f"sampling_kv_cache: a block-causal model is decoded with its own exact KV cache of "
                                 f"committed blocks; leave sampling_kv_cache unset, got {self.sampling_kv_cache!r}")
            if self.block_length not in (None, size):
                raise ValueError(f"block_length: the model is block-causal with blocks of {size} tokens; leave "
                                 f"block_length unset or set it to {size}, got {self.block_length}")
            if OBJECTIVES[self.objective].fillings and self.sampling_threshold is not None:
                raise ValueError(f"sampling_threshold: objective={self.objective!r} keeps the state of a fixed step, which "
                                 "needs a fixed number of steps per block; leave sampling_threshold unset")
            steps = max(1, min(size, self.diffusion_steps * size // self.max_completion_length))
            return {**options, "block_length": None, "steps": steps, "threshold": self.sampling_threshold}
        options["steps"] = self.diffusion_steps
        if self.sampling_rule == "llada":
            block_length = LLADA_BLOCK_LENGTH if self.block_length is None else self.block_length
            self._check_blocks(block_length)
            if OBJECTIVES[self.objective].fillings and self.sampling_threshold is not None:
                raise ValueError(f"sampling_threshold: objective={self.objective!r} keeps the state of a fixed step, which a "
                                 "threshold may skip; leave sampling_threshold unset")
            return {**options, "block_length": block_length, "remasking": self.remasking,
                    "threshold": self.sampling_threshold, "kv_cache": self.sampling_kv_cache}
        return {**options, "block_length": None, "alg": self.sampling_alg, "alg_temp": self.sampling_alg_temp,
                "eps": self.sampling_eps, "top_p": self.top_p if self.top_p < 1 else None,
                "top_k": self.top_k or None}

    def branch_steps(self, attention: str | tuple[str, int] = "full") -> list[int] | None:
        """DiSPO's branch step (``[s]``, for [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate]'s ``branch_steps``)
        of a model with ``attention``, or None when the objective is not ``dispo``.

        ``s = int(dispo_branch_fraction * diffusion_steps)``. A block-causal model's decode counts its
        steps over the blocks, and a block that is partly prompt may end before its ``steps``: ``s``
        is capped below the steps every decode takes (``steps`` per block in each block that the
        completion fills whole, at least ``max_completion_length // S - 1`` of them, and at least one
        more), so the state always exists."""
        if not OBJECTIVES[self.objective].fillings:
            return None
        step = int(self.dispo_branch_fraction * self.diffusion_steps)
        if attention != "full":
            size = attention[1]
            per_block = self.sampler_options(attention)["steps"]
            step = min(step, per_block * max(self.max_completion_length // size - 1, 0))
        return [step]

    def _check_trl_options(self) -> None:
        """The inherited TRL options this trainer reads and TRL leaves unchecked, with the ranges the
        sampler and the losses need."""
        check_nonnegative_float(self.temperature, "temperature")
        check_int(self.seed, "seed", low=0, high=1 << 64)
        check_int(self.num_iterations, "num_iterations", low=1)
        check_int(self.steps_per_generation, "steps_per_generation", low=1)
        if self.shuffle_dataset is not None:  # TRL reads None as False
            check_bool(self.shuffle_dataset, "shuffle_dataset")
        check_choice(self.scale_rewards, "scale_rewards", ADVANTAGE_SCALES)
        if self.num_generations_eval is not None:
            check_int(self.num_generations_eval, "num_generations_eval", low=2 if self.leave_one_out else 1)
        if self.reward_weights is not None:
            if not isinstance(self.reward_weights, (list, tuple)):
                raise TypeError(f"reward_weights must be a list of floats or None, got {self.reward_weights!r}")
            for i, weight in enumerate(self.reward_weights):
                check_float(weight, f"reward_weights[{i}]")
        beta = check_float(self.beta, "beta", minimum=0.0)
        if beta > 0 and not OBJECTIVES[self.objective].kl_term:
            raise ValueError(f"beta must be 0 with objective={self.objective!r} (its loss has no KL term), got {beta}")
        check_choice(self.loss_type, "loss_type", LOSS_TYPES)
        check_choice(self.importance_sampling_level, "importance_sampling_level", IMPORTANCE_LEVELS)
        check_float(self.epsilon, "epsilon", minimum=0.0, maximum=1.0, exclusive_maximum=True)
        if self.epsilon_high is not None:
            check_float(self.epsilon_high, "epsilon_high", minimum=0.0)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            check_float(getattr(self, name), name, minimum=0.0, exclusive_minimum=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_float(getattr(self, name), name, minimum=0.0)
        if OBJECTIVES[self.objective].token_loss:
            if self.loss_type == "cispo" and self.epsilon_high is None:
                raise ValueError("epsilon_high is required with loss_type='cispo': it is the cap on the ratio (e.g. "
                                 "5.0); TRL would cap at epsilon")
            if self.delta is not None:
                if self.loss_type not in CLIPPED_LOSS_TYPES:
                    raise ValueError(f"delta is only used by the clipped loss types {', '.join(CLIPPED_LOSS_TYPES)}, "
                                     f"got loss_type={self.loss_type!r}")
                epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
                check_float(self.delta, "delta", minimum=1.0 + epsilon_high)
        elif self.delta is not None:
            users = " or ".join(repr(name) for name, o in OBJECTIVES.items() if o.token_loss)
            raise ValueError(f"delta is only used by objective {users}, got objective={self.objective!r}")
