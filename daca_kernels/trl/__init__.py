"""A TRL trainer for masked diffusion LMs: ``DiffusionGRPOConfig`` and ``DiffusionGRPOTrainer``.

Needs the optional extra ``trl`` (TRL 1.16), installed from a clone of the repository:
``pip install -e '.[trl]'`` (the package is not on PyPI). The trainer is TRL's
``GRPOTrainer`` with its generation and likelihood replaced, so datasets, reward functions,
``num_generations``, ``num_iterations``, ``beta`` with a reference model, reward scaling, logging,
checkpointing and ``accelerate launch`` work as in TRL:

- completions come from [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] (``max_completion_length`` tokens
  in ``diffusion_steps`` steps at ``temperature``; ``sampling_rule="llada"``: LLaDA's block-wise
  remasking with ``block_length``, ``remasking``; ``"dream"``: Dream's and DiffuCoder's sampler
  with ``sampling_alg``, ``sampling_alg_temp``, ``sampling_eps``, ``top_p``, ``top_k``; a
  block-causal model, SDAR or LLaDA2, block by block with its KV cache:
  [`DiffusionGRPOConfig.sampler_options`][daca_kernels.trl.config.DiffusionGRPOConfig.sampler_options]), decoded up to the first EOS
  for the reward functions;
- per-token log-probabilities come from the chosen estimator
  ([`daca_kernels.likelihood.estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob]), which masks the whole generated
  region and
  scores the answer up to and including the first EOS (d1's convention); the old, reference and
  current passes of an update rebuild the same masks from one seed per inner iteration;
- the loss is the chosen objective: ``grpo`` ([`daca_kernels.grpo_loss`][daca_kernels.losses.grpo.grpo_loss] with every TRL loss
  type), ``bgpo`` or ``spg`` (on [`daca_kernels.likelihood.monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks]; BGPO
  back-propagated one mask sample at a time in training), or ``dispo``
  (the ``grpo`` loss plus ``dispo_alpha`` times [`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss]: the rollout
  keeps its state at step ``dispo_branch_fraction * diffusion_steps``, ``dispo_fillings`` fillings
  of that state's masked positions are resampled from the cached distribution
  ([`daca_kernels.rollout.branch`][daca_kernels.rollout.sampler.branch], no extra rollout), scored by the reward functions and
  trained through [`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob]), with DPS token weights when
  ``dps=True`` (for ``dispo``: in its terminal loss). The step (values, losses, normalisation,
  BGPO's backward) is [`daca_kernels.rl_step`][daca_kernels.rl_step], shared with the reference loop.

Prompts come in TRL's order (``RepeatSampler``), except that the permutation of epoch ``e`` is a
function of ``(args.seed, e)`` ([`EpochRepeatSampler`][daca_kernels.trl.trainer.EpochRepeatSampler]), so that a run resumed in any epoch
trains on the prompts of the uninterrupted run. Advantages are
[`daca_kernels.group_advantages`][daca_kernels.losses.advantages.group_advantages]
of the rewards with ``scale_rewards`` and ``leave_one_out`` (a preset fills both with its peer's).

Randomness: the rollout of generation batch ``g``, the masks of its inner iteration ``i`` and its
DiSPO fillings use seeds derived from ``(args.seed, g)``, and every process passes the global
index of its first row as ``row_offset``, so P processes sample the completions and masks of one
process holding the whole batch.

Models ([`daca_kernels.models.model_loading.prepare_model`][daca_kernels.models.model_loading.prepare_model], applied to the policy and
the reference model at construction):
released modeling code written for transformers 4 is made to work with TRL and transformers 5 --
a ``generation_config`` built from the model config where the class gives none (LLaDA-MoE), list
``_tied_weights_keys`` declared as transformers 5's mapping so that ``save_model`` works (LLaDA-MoE,
Dream), buffers a load left wrong recomputed
([`daca_kernels.models.model_loading.repair_buffers`][daca_kernels.models.model_loading.repair_buffers]),
and layer-wise activation checkpointing where the class has none (LLaDA-8B;
[`daca_kernels.models.activation_checkpointing`][daca_kernels.models.activation_checkpointing]), so TRL's default
``gradient_checkpointing=True`` works.

Reference model (``beta > 0``): a deep copy of the policy as the trainer receives it (loaded by TRL
from ``model`` when that is a path, with ``model_init_kwargs`` and ``trust_remote_code``), taken
before training; TRL would instead reload ``model.config._name_or_path`` through the Auto classes,
which fails for a policy built in memory or whose remote class the Auto classes cannot find, and
would repeat the load's problems. The copy has the policy's class, dtype, device and weights.

Sharded models: every model call (rollout and estimates) runs inside a forward call of the wrapped
model (its ``forward`` is swapped for the call), so DDP sees an ordinary forward and FSDP2
(``fully_shard``) gathers the LM head and the embeddings for the call. DeepSpeed ZeRO-2 and ZeRO-3 run
under ``accelerate launch``; under ZeRO-3 the LM head is registered with the root module's forward
(which gathers it for the fused op and reduces its gradient into the partitions), a rollout gathers
the parameters once, and the reference model is built partitioned ([`daca_kernels.trl.zero3`][daca_kernels.trl.zero3]).

The config lives in [`daca_kernels.trl.config`][daca_kernels.trl.config], the trainer in
[`daca_kernels.trl.trainer`][daca_kernels.trl.trainer].
"""
from daca_kernels._optional import require

require("trl", "trl", "daca_kernels.trl")

from daca_kernels.trl.config import DiffusionGRPOConfig  # noqa: E402
from daca_kernels.trl.trainer import (  # noqa: E402
    DiffusionGRPOTrainer,
    EpochRepeatSampler,
    default_config,
    reference_copy,
    rollout_advantages,
    run_as_forward,
)

__all__ = [
    "DiffusionGRPOConfig",
    "DiffusionGRPOTrainer",
    "EpochRepeatSampler",
    "default_config",
    "reference_copy",
    "rollout_advantages",
    "run_as_forward",
]
