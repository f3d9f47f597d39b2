"""One RL step of a masked diffusion LM: the values and losses that the TRL trainer
([`daca_kernels.trl`][daca_kernels.trl]) and the reference loop (``integration/``) both train on.

Everything is a plain function of a policy (a [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM], or a
[`Policy`][daca_kernels.rl_step.Policy] whose
``forward`` runs each model call inside a wrapper's forward, as the TRL trainer's DDP/FSDP2 model
needs), the settings of a run ([`StepOptions`][daca_kernels.rl_step.StepOptions]), a batch
([`StepBatch`][daca_kernels.rl_step.StepBatch]) and a mask seed:

- [`mask_samples`][daca_kernels.rl_step.mask_samples]: the Monte-Carlo mask samples of BGPO and SPG for a seed;
- [`token_logprob`][daca_kernels.rl_step.token_logprob], [`sample_logprob`][daca_kernels.rl_step.sample_logprob],
  [`sample_scores`][daca_kernels.rl_step.sample_scores], [`step_logprob`][daca_kernels.rl_step.step_logprob]: the
  configured estimator's per-token values ``[B, L]``, the per-sample log-probabilities
  ``[n, B, L]``, BGPO's per-sample sequence scores ``[n, B]``, DiSPO's one-step likelihood
  ``[R, L]`` at the branch states;
- [`old_values`][daca_kernels.rl_step.old_values], [`reference_values`][daca_kernels.rl_step.reference_values]: the sampling policy's
  values of the objective (the
  ratio's denominator; none for SPG) and the frozen reference policy's per-token values (the KL
  term, ``beta > 0`` with ``grpo`` or ``dispo``), computed without gradients;
- [`objective_loss`][daca_kernels.rl_step.objective_loss]: the loss of ``grpo``
  ([`daca_kernels.grpo_loss`][daca_kernels.losses.grpo.grpo_loss]), ``bgpo``
  ([`daca_kernels.bgpo_loss`][daca_kernels.losses.bgpo.bgpo_loss]), ``spg``
  ([`daca_kernels.spg_loss`][daca_kernels.losses.spg.spg_loss]) or ``dispo`` (the
  ``grpo`` loss plus ``dispo_alpha`` times [`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss]), normalised by a
  [`Normaliser`][daca_kernels.rl_step.Normaliser] so that the chunks' losses combine to the global batch's; with ``backward=``
  (a callable such as ``Tensor.backward``; the TRL trainer's ``accelerator.backward``) it is
  back-propagated, BGPO one mask sample at a time ([`bgpo_backward`][daca_kernels.rl_step.bgpo_backward]: memory of one sample
  whatever n);
- [`sampling_importance_weights`][daca_kernels.rl_step.sampling_importance_weights]: the optional correction of an approximate rollout (a KV
  cache, parallel decoding): truncated importance weights of the committed tokens, multiplied into
  the batch's token weights (``sampling_importance_sampling_correction``).

Masks are functions of ``(seed, batch.row_offset + b, position)`` ([`daca_kernels.likelihood`][daca_kernels.likelihood]),
so the old, reference and current passes of one update see the same masks.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from daca_kernels.likelihood import branch_logprob, estimate_logprob, masked_logprob, monte_carlo_masks
from daca_kernels.likelihood.estimator import MONTE_CARLO_ESTIMATORS, EstimatorSpec, MaskSample
from daca_kernels.losses import bgpo_backward as bgpo_backward_by_sample
from daca_kernels.losses import bgpo_loss, dispo_step_loss, elbo_sample_scores, grpo_loss, mixed_objective, spg_loss
from daca_kernels.losses.grpo import TOKEN_COUNT_LOSS_TYPES
from daca_kernels.losses.importance import truncated_importance_weights
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.objectives import OBJECTIVES, objective
from daca_kernels.validation import check_bool, check_choice, check_float, check_int

GRADIENT_REDUCTIONS = ("averaged", "summed")
# The modes of the sampling correction, TRL's names for its engine correction's truncated modes.
SAMPLING_CORRECTION_MODES = ("token_truncate", "sequence_truncate")
# The StepOptions fields that grpo_loss takes as keywords of the same name.
_GRPO_OPTIONS = ("beta", "epsilon", "epsilon_high", "delta", "loss_type", "importance_sampling_level",
                 "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                 "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


@dataclass(frozen=True)
class StepOptions:
    """The objective, the estimator and the loss settings of a run (defaults: those of
    [`daca_kernels.grpo_loss`][daca_kernels.losses.grpo.grpo_loss] and of the trainers).
    [`from_config`][daca_kernels.rl_step.StepOptions.from_config] reads them from any
    config with attributes of these names (``DiffusionGRPOConfig``, the loop's ``RunConfig``)."""

    objective: str = "grpo"
    """``"grpo"``, ``"bgpo"``, ``"spg"`` or ``"dispo"`` (bgpo and spg need a Monte-Carlo estimator)."""
    estimator: EstimatorSpec = EstimatorSpec()
    """The estimator and its settings; a name alone (``estimator="stratified"``) is that estimator
    at its default settings."""
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    spg_bound: str = "mix"
    spg_beta: float = 1.0
    spg_mix_weight: float = 0.5
    dispo_alpha: float = 1.0
    sampling_importance_sampling_correction: bool = False
    """Multiply the token weights by [`sampling_importance_weights`][daca_kernels.rl_step.sampling_importance_weights] (grpo and dispo
    only)."""
    sampling_importance_sampling_mode: str = "token_truncate"
    sampling_importance_sampling_cap: float = 3.0

    def __post_init__(self):
        if isinstance(self.estimator, str):
            object.__setattr__(self, "estimator", EstimatorSpec(self.estimator))
        if not isinstance(self.estimator, EstimatorSpec):
            raise TypeError(f"estimator must be an EstimatorSpec or an estimator's name, got "
                            f"{type(self.estimator).__name__}")
        check_estimator_for(self.objective, self.estimator.name)
        check_sampling_correction(self.sampling_importance_sampling_correction, self.sampling_importance_sampling_mode,
                                  self.sampling_importance_sampling_cap, self.objective)

    @classmethod
    def from_config(cls, config: Any, **overrides) -> "StepOptions":
        """The options named like attributes of ``config`` (the others at their defaults), then
        ``overrides``; ``estimator`` is the [`EstimatorSpec`][daca_kernels.likelihood.estimator.EstimatorSpec] of the config's
        estimator settings (``estimator``, ``num_strata``, ...)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "estimator"]
        values = {name: getattr(config, name) for name in names if hasattr(config, name)}
        if hasattr(config, "estimator"):
            values["estimator"] = EstimatorSpec.from_config(config)
        return cls(**{**values, **overrides})

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference policy's values (a KL term: ``beta > 0``, grpo or dispo)."""
        return self.beta != 0.0 and OBJECTIVES[self.objective].kl_term


def check_estimator_for(objective_name: str, estimator: str) -> None:
    """A ValueError naming ``estimator`` unless it suits ``objective_name`` (which is checked first):
    bgpo's and spg's losses run over Monte-Carlo mask samples."""
    if objective(objective_name).monte_carlo_masks and estimator not in MONTE_CARLO_ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(MONTE_CARLO_ESTIMATORS)} (Monte-Carlo mask samples) "
                         f"for objective={objective_name!r}, got {estimator!r}")


def check_sampling_correction(correction: bool, mode: str, cap: float, objective: str) -> None:
    """The options of the sampling correction (``sampling_importance_sampling_correction``, ``_mode``,
    ``_cap``) for ``objective``: a TypeError or ValueError naming the option. The correction weights
    the per-token policy-gradient term, which only the GRPO-family loss has (``grpo``, and ``dispo``'s
    GRPO part): BGPO's and SPG's token weights weight the terms of a sequence's ELBO bound inside the
    ratio (BGPO) or the bound (SPG), where an importance weight of the sampling is not meaningful."""
    check_bool(correction, "sampling_importance_sampling_correction")
    check_choice(mode, "sampling_importance_sampling_mode", SAMPLING_CORRECTION_MODES)
    check_float(cap, "sampling_importance_sampling_cap", minimum=0.0, exclusive_minimum=True)
    if correction and not OBJECTIVES[objective].token_loss:
        users = " or ".join(repr(name) for name, row in OBJECTIVES.items() if row.token_loss)
        raise ValueError(f"sampling_importance_sampling_correction is only meaningful for objective {users} (a "
                         f"per-token policy-gradient term); objective={objective!r} weights its tokens inside a "
                         f"sequence's ELBO bound")


def sampling_importance_weights(target_logp: Tensor, commit_logprob: Tensor, commit_step: Tensor, loss_mask: Tensor,
                                options: StepOptions) -> tuple[Tensor, dict[str, Tensor]]:
    """The correction of a rollout whose tokens were drawn from another distribution than the
    one being scored: ``(weights, metrics)``.

    ``target_logp``: [`daca_kernels.rollout.rescore_commits`][daca_kernels.rollout.sampler.rescore_commits] of the rollout under the policy
    that sampled it, the log-probability of each committed token under a full forward of the state
    it was committed from; ``commit_logprob`` and ``commit_step``: the rollout's
    (``Rollout.commit_logprob``, the same tokens under the forward the sampler ran, a cached one
    under a KV cache); ``loss_mask``: bool ``[B, L]``, the answer tokens. All ``[B, L]``.

    ``weights``: ``[B, L]``, float32 (float64 for float64 inputs), detached,
    [`daca_kernels.losses.truncated_importance_weights`][daca_kernels.losses.importance.truncated_importance_weights]
    (``level`` from ``options.sampling_importance_sampling_mode``, ``cap``) over the committed answer
    tokens, 1 elsewhere (a token without a sampling probability, e.g. one left masked, is
    uncorrected). Multiply them into the batch's token weights (the DPS weights, or None). For an
    exact rollout the weights are 1 up to float rounding.

    ``metrics``: 0-d float32 tensors over the committed answer tokens: ``sampling/logp_gap_abs_mean``
    (mean ``|target_logp - commit_logprob|``), ``sampling/truncated_fraction`` (the share whose
    weight the cap truncated) and ``sampling/importance_weight_mean``.
    """
    counted = loss_mask & (commit_step >= 0)
    level = options.sampling_importance_sampling_mode.split("_")[0]
    cap = options.sampling_importance_sampling_cap
    weights = truncated_importance_weights(target_logp, commit_logprob, counted, cap=cap, level=level)
    gap = torch.where(counted, target_logp.double() - commit_logprob.double(), 0.0)
    raw = gap.sum(dim=1, keepdim=True).expand_as(gap) if level == "sequence" else gap
    tokens = counted.sum().clamp(min=1)
    metrics = {"sampling/logp_gap_abs_mean": gap.abs().sum() / tokens,
               "sampling/truncated_fraction": (counted & (raw > math.log(cap))).sum() / tokens,
               "sampling/importance_weight_mean": torch.where(counted, weights.double(), 0.0).sum() / tokens}
    return torch.where(counted, weights, 1.0), {k: v.float() for k, v in metrics.items()}


@dataclass(frozen=True)
class Fillings:
    """DiSPO's fillings of one branch state per row: ``R = B * Z`` rows, each state's Z fillings
    consecutive (row ``b * Z + z`` is filling z of state b)."""

    state: Tensor
    """long ``[B, L]``: the cached states (mask id at the positions to fill)."""
    fillings: Tensor
    """long ``[R, L]``: the completed sequences."""
    filled: Tensor
    """bool ``[R, L]``: the positions each filling filled (its state's masked positions)."""
    rewards: Tensor
    """float ``[R]``: each filling's reward."""
    num_fillings: int
    """Z >= 2."""


@dataclass(frozen=True)
class StepBatch:
    """The rows a step trains on (one process's chunk of the global batch)."""

    input_ids: Tensor
    """long ``[B, L]``: left-padded prompt, then the completion."""
    attention_mask: Tensor | None
    """``[B, L]`` (1 = real token), or None for a batch without padding."""
    completion_mask: Tensor
    """bool ``[B, L]``: the generated region, masked by the estimators."""
    loss_mask: Tensor
    """bool ``[B, L]`` inside ``completion_mask``: the answer tokens, scored and counted."""
    advantages: Tensor
    """float ``[B]``."""
    generation_length: int
    """G, the generated width (Dr. GRPO's constant ``max_completion_length``)."""
    row_offset: int = 0
    """The global index of row 0 (the masks follow it)."""
    token_weights: Tensor | None = None
    """float ``[B, L]`` (DPS) or None."""
    fillings: Fillings | None = None
    """DiSPO's fillings (``objective="dispo"``)."""


@dataclass(frozen=True)
class Normaliser:
    """How one chunk's loss makes the global batch's: the divisors of its losses."""

    token_count: Tensor | float
    """The divisor of the token-count losses (``dapo``, ``cispo``, ``vespo``; SPG)."""
    filled_count: Tensor | float | None = None
    """The divisor of DiSPO's step loss (filled tokens)."""
    divisor: float = 1.0
    """The divisor of the losses averaged over this chunk's rollouts (``grpo``, ``sapo``, ``luspo``,
    ``dr_grpo``, ``bnpo``; BGPO's advantages)."""
    bnpo_global: bool = False
    """``bnpo`` as the mean over the global batch's tokens (``token_count``) instead of this chunk's."""


def chunk_normaliser(tokens: Tensor, filled: Tensor | None = None, *, processes: int = 1, gradients: str = "averaged",
                     accumulation: int = 1, chunks: int = 1) -> Normaliser:
    """The [`Normaliser`][daca_kernels.rl_step.Normaliser] of a chunk from ``tokens`` (and DiSPO's ``filled``), the answer
    (filled) tokens of the global batch over every process (0-d tensors).

    ``gradients="averaged"`` (DDP, TRL's rule): the processes' gradients are averaged and the
    ``accumulation`` chunks of an optimiser step summed, the generation batch being cut into
    ``chunks``: counts are divided by ``processes`` and scaled by ``accumulation / chunks``, the
    other losses divided by ``accumulation``, ``bnpo`` is this chunk's mean. ``gradients="summed"``
    (the reference loop, one chunk per process): counts are the global ones, the other losses are
    divided by ``processes``, ``bnpo`` is the global token mean.
    """
    check_choice(gradients, "gradients", GRADIENT_REDUCTIONS)
    processes = check_int(processes, "processes", low=1)
    accumulation = check_int(accumulation, "accumulation", low=1)
    chunks = check_int(chunks, "chunks", low=1)
    if gradients == "summed":
        if accumulation != 1 or chunks != 1:
            raise ValueError("gradients='summed' takes one chunk per process (accumulation=1, chunks=1)")
        return Normaliser(tokens, filled, float(processes), bnpo_global=True)

    def count(total: Tensor) -> Tensor:
        return total.clamp(min=1.0) / processes * accumulation / chunks

    return Normaliser(count(tokens), None if filled is None else count(filled), float(accumulation))


@dataclass(frozen=True)
class Policy:
    """A model as the step functions call it: ``forward(fn)`` returns ``fn(lm)``, ``lm`` a
    [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] of the model, run as one forward call of the model (a wrapper's hooks around
    it); ``mask_id`` and ``attention`` are ``lm``'s, known without a call."""

    forward: Callable[[Callable[[MaskedLM], Any]], Any]
    mask_id: int
    attention: str | tuple[str, int] = "full"

    @classmethod
    def of(cls, model: "MaskedLM | Policy") -> "Policy":
        """``model`` itself, or the policy calling a [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] directly."""
        if isinstance(model, Policy):
            return model
        if not isinstance(model, MaskedLM):
            raise TypeError(f"model must be a MaskedLM or a Policy, got {type(model).__name__}")
        return cls(lambda fn: fn(model), model.mask_id, model.attention)


# Estimates: each function is one forward call of the model.
def _token_estimate(lm: MaskedLM, options: StepOptions, batch: StepBatch, seed: int) -> Tensor:
    return estimate_logprob(lm, batch.input_ids, batch.completion_mask, batch.loss_mask, batch.attention_mask, seed=seed,
                            row_offset=batch.row_offset, **options.estimator.keywords())


def _sample_estimate(lm: MaskedLM, batch: StepBatch, sample: MaskSample) -> Tensor:
    return masked_logprob(lm, batch.input_ids, sample.masked, loss_mask=sample.scored, attention_mask=batch.attention_mask)


def _step_estimate(lm: MaskedLM, batch: StepBatch) -> Tensor:
    f = _fillings(batch)
    return branch_logprob(lm, f.state, f.fillings, f.filled, attention_mask=batch.attention_mask)


def _fillings(batch: StepBatch) -> Fillings:
    if batch.fillings is None:
        raise ValueError("batch.fillings is required by objective='dispo' (the branch states and their fillings)")
    return batch.fillings


def mask_samples(model: MaskedLM | Policy, options: StepOptions, batch: StepBatch, seed: int) -> list[MaskSample]:
    """The Monte-Carlo mask samples of BGPO and SPG for mask seed ``seed``
    ([`daca_kernels.likelihood.monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks] of the options' estimator)."""
    policy = Policy.of(model)
    return monte_carlo_masks(batch.input_ids, batch.completion_mask, batch.loss_mask, batch.attention_mask, seed=seed,
                             mask_id=policy.mask_id, row_offset=batch.row_offset, attention=policy.attention,
                             **options.estimator.keywords())


def token_logprob(model: MaskedLM | Policy, options: StepOptions, batch: StepBatch, seed: int) -> Tensor:
    """float32 ``[B, L]``: the options' estimator on ``batch`` with mask seed ``seed``
    ([`daca_kernels.likelihood.estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob]), 0 outside ``loss_mask``."""
    return Policy.of(model).forward(lambda lm: _token_estimate(lm, options, batch, seed))


def sample_logprob(model: MaskedLM | Policy, batch: StepBatch, samples: list[MaskSample]) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp [n, B, L] float32, scored bool [n, B, L], t [n, B] in logp's dtype)`` of ``samples``,
    all in one forward call of the model."""
    logp = Policy.of(model).forward(lambda lm: torch.stack([_sample_estimate(lm, batch, s) for s in samples]))
    return logp, torch.stack([s.scored for s in samples]), torch.stack([s.t for s in samples]).to(logp.dtype)


def sample_scores(model: MaskedLM | Policy, options: StepOptions, batch: StepBatch, seed: int) -> Tensor:
    """BGPO's per-sample sequence scores ``[n, B]`` ([`daca_kernels.elbo_sample_scores`][daca_kernels.losses.elbo.elbo_sample_scores],
    DPS-weighted by ``batch.token_weights``) of the mask samples of ``seed``."""
    logp, scored, t = sample_logprob(model, batch, mask_samples(model, options, batch, seed))
    return elbo_sample_scores(logp, scored, t, token_weights=batch.token_weights)


def step_logprob(model: MaskedLM | Policy, batch: StepBatch) -> Tensor:
    """DiSPO: float32 ``[R, L]``, ``log p(filling token | branch state)`` at the filled positions of
    every filling ([`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob]), 0 elsewhere."""
    return Policy.of(model).forward(lambda lm: _step_estimate(lm, batch))


@torch.no_grad()
def old_values(model: MaskedLM | Policy, options: StepOptions, batch: StepBatch, seed: int) -> Tensor | None:
    """The sampling policy's values for mask seed ``seed``, without gradients: BGPO's sample scores
    ``[n, B]``, the per-token estimates ``[B, L]`` for grpo and dispo, None for SPG (no ratio).
    DiSPO's step values have no masks: [`step_logprob`][daca_kernels.rl_step.step_logprob] once, under ``torch.no_grad()``."""
    kind = OBJECTIVES[options.objective].old_values
    if kind == "samples":
        return sample_scores(model, options, batch, seed)
    return None if kind is None else token_logprob(model, options, batch, seed)


@torch.no_grad()
def reference_values(model: MaskedLM | Policy, options: StepOptions, batch: StepBatch, seed: int) -> Tensor:
    """The frozen reference policy's per-token estimates ``[B, L]`` for mask seed ``seed`` (the KL
    term's ``ref_logp``; see [`StepOptions.needs_reference`][daca_kernels.rl_step.StepOptions.needs_reference])."""
    return token_logprob(model, options, batch, seed)


def normalised_grpo_loss(options: StepOptions, batch: StepBatch, logp: Tensor, old: Tensor | None, ref: Tensor | None,
                         normaliser: Normaliser, *, loss_fn: Callable = grpo_loss) -> tuple[Tensor, dict]:
    """The options' GRPO-family loss of per-token values ``logp`` ``[B, L]`` (``old``, ``ref``: the
    same under the sampling and reference policies, or None), normalised by ``normaliser``:
    ``(loss, metrics)``. ``loss_fn``: a function with [`daca_kernels.grpo_loss`][daca_kernels.losses.grpo.grpo_loss]'s signature
    (the reference loop's reference backend passes ``daca_kernels.reference``'s)."""
    kwargs = {name: getattr(options, name) for name in _GRPO_OPTIONS}
    if options.loss_type in TOKEN_COUNT_LOSS_TYPES:
        kwargs["num_items_in_batch"] = normaliser.token_count
    elif options.loss_type == "dr_grpo":
        kwargs["max_completion_length"] = batch.generation_length
    loss, metrics = loss_fn(logp, old, batch.advantages, batch.loss_mask, ref_logp=ref,
                            token_weights=batch.token_weights, **kwargs)
    if options.loss_type == "bnpo" and normaliser.bnpo_global:
        loss = loss * (float(batch.loss_mask.sum()) / float(normaliser.token_count))
    elif options.loss_type not in TOKEN_COUNT_LOSS_TYPES:
        loss = loss / normaliser.divisor
    return loss, metrics


def _dispo_step_loss(options: StepOptions, batch: StepBatch, logp: Tensor, old: Tensor | None,
                     normaliser: Normaliser) -> tuple[Tensor, dict]:
    f = _fillings(batch)
    if normaliser.filled_count is None:
        raise ValueError("normaliser.filled_count is required by objective='dispo' (the step loss's divisor)")
    return dispo_step_loss(logp, old, f.filled, f.rewards, f.num_fillings, epsilon=options.epsilon,
                           epsilon_high=options.epsilon_high, num_items_in_batch=normaliser.filled_count)


# Each objective's loss: (model, options, batch, seed, normaliser, old, ref, old_step) -> (loss, metrics).
def _grpo_objective(model, options, batch, seed, normaliser, old, ref, old_step):
    return normalised_grpo_loss(options, batch, token_logprob(model, options, batch, seed), old, ref, normaliser)


def _bgpo_objective(model, options, batch, seed, normaliser, old, ref, old_step):
    scores = sample_scores(model, options, batch, seed)
    loss, metrics = bgpo_loss(scores, scores.detach() if old is None else old, batch.advantages)
    return loss / normaliser.divisor, metrics


def _spg_objective(model, options, batch, seed, normaliser, old, ref, old_step):
    logp, scored, t = sample_logprob(model, batch, mask_samples(model, options, batch, seed))
    return spg_loss(logp, scored, t, batch.loss_mask, batch.advantages, negative_bound=options.spg_bound,
                    beta=options.spg_beta, mix_weight=options.spg_mix_weight, token_weights=batch.token_weights,
                    num_items_in_batch=normaliser.token_count)


def _dispo_objective(model, options, batch, seed, normaliser, old, ref, old_step):
    # One forward call of the model for both estimates.
    logp, step_logp = Policy.of(model).forward(lambda lm: (_token_estimate(lm, options, batch, seed),
                                                           _step_estimate(lm, batch)))
    loss, metrics = normalised_grpo_loss(options, batch, logp, old, ref, normaliser)
    step, step_metrics = _dispo_step_loss(options, batch, step_logp, old_step, normaliser)
    metrics.update({f"dispo/{k}": v for k, v in {**step_metrics, "step_loss": step.detach()}.items()})
    return mixed_objective(loss, step, alpha_base=1.0, alpha_step=options.dispo_alpha), metrics


# The loss of every objective of daca_kernels.objectives.OBJECTIVES (a test holds the two to one set of names).
OBJECTIVE_LOSSES: dict[str, Callable] = {"grpo": _grpo_objective, "bgpo": _bgpo_objective, "spg": _spg_objective,
                                         "dispo": _dispo_objective}


def objective_loss(
    model: MaskedLM | Policy,
    options: StepOptions,
    batch: StepBatch,
    seed: int,
    normaliser: Normaliser,
    *,
    old: Tensor | None = None,
    ref: Tensor | None = None,
    old_step: Tensor | None = None,
    backward: Callable[[Tensor], object] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The options' objective on ``batch`` with mask seed ``seed``: ``(loss, metrics)``, the 0-d loss
    with its graph and the loss's detached metrics (DiSPO's step metrics prefixed ``dispo/``, with
    ``dispo/step_loss``).

    ``old``: [`old_values`][daca_kernels.rl_step.old_values] of the sampling policy for ``seed``, or None on-policy (the current
    values detached: ratio 1); ``ref``: [`reference_values`][daca_kernels.rl_step.reference_values] (required with ``beta > 0`` for
    grpo and dispo); ``old_step``: DiSPO's old [`step_logprob`][daca_kernels.rl_step.step_logprob], or None on-policy.

    ``backward``: None, or a callable (``Tensor.backward``, ``accelerator.backward``) through which
    the loss is back-propagated into the parameters' ``.grad`` and then returned detached; BGPO then
    goes one mask sample at a time ([`bgpo_backward`][daca_kernels.rl_step.bgpo_backward]: one sample's graph alive whatever n),
    where without ``backward`` its loss holds every sample's graph at once.
    """
    if backward is not None and OBJECTIVES[options.objective].sample_by_sample_backward:
        return bgpo_backward(model, options, batch, seed, normaliser, old=old, backward=backward)
    loss, metrics = OBJECTIVE_LOSSES[options.objective](model, options, batch, seed, normaliser, old, ref, old_step)
    if backward is None:
        return loss, metrics
    backward(loss)
    return loss.detach(), metrics


def bgpo_backward(
    model: MaskedLM | Policy,
    options: StepOptions,
    batch: StepBatch,
    seed: int,
    normaliser: Normaliser,
    *,
    old: Tensor | None = None,
    backward: Callable[[Tensor], object] = Tensor.backward,
    keep_last: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """BGPO's loss ([`objective_loss`][daca_kernels.rl_step.objective_loss] with ``objective="bgpo"``) back-propagated one mask sample
    at a time ([`daca_kernels.bgpo_backward`][daca_kernels.losses.bgpo.bgpo_backward]): each sample's forward call, then ``backward`` of
    its share, so that one sample's graph is alive at once whatever n. ``old``: ``[n, B]`` or None
    (on-policy). With ``keep_last`` the last share is returned with its graph instead (for a
    training step that runs the final backward itself). Returns ``(loss, metrics)``, detached but
    for that share."""
    if options.objective != "bgpo":
        raise ValueError(f"options.objective must be 'bgpo' for bgpo_backward, got {options.objective!r}")
    policy = Policy.of(model)
    samples = mask_samples(policy, options, batch, seed)

    def scores(j: int) -> Tensor:
        logp, scored, t = sample_logprob(policy, batch, samples[j:j + 1])
        return elbo_sample_scores(logp, scored, t, token_weights=batch.token_weights)[0]

    return bgpo_backward_by_sample(scores, len(samples), old, batch.advantages / normaliser.divisor, backward=backward,
                                   keep_last=keep_last)
