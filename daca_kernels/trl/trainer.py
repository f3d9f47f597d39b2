"""``DiffusionGRPOTrainer``: TRL's ``GRPOTrainer`` with diffusion rollouts, estimates and
objectives (overview: [`daca_kernels.trl`][daca_kernels.trl])."""
from __future__ import annotations

import contextlib
import copy
from collections import defaultdict

import torch
import trl.trainer.grpo_trainer as trl_grpo_trainer
from accelerate.utils import gather_object
from torch import Tensor, nn
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler, get_config_model_id, nanstd

from daca_kernels.credit import dps_weights
from daca_kernels.hashing import derive_seed
from daca_kernels.losses.advantages import group_advantages
from daca_kernels.models.masked_lm import HIDDEN_SOURCES, MaskedLM
from daca_kernels.models.model_loading import complete_construction, prepare_model
from daca_kernels.models.released_code import released_code_support
from daca_kernels.objectives import OBJECTIVES
from daca_kernels.rl_step import (
    Fillings,
    Policy,
    StepBatch,
    StepOptions,
    bgpo_backward,
    chunk_normaliser,
    objective_loss,
    old_values,
    reference_values,
    sampling_importance_weights,
    step_logprob,
    token_logprob,
)
from daca_kernels.rollout import Rollout, answer_mask, branch, generate, rescore_commits
from daca_kernels.trl import zero3
from daca_kernels.trl.config import DiffusionGRPOConfig
from daca_kernels.validation import (
    check_int,
    check_sequence_length,
    check_tokenizer_fits,
)


def rollout_advantages(args: DiffusionGRPOConfig, rewards: Tensor, group_size: int) -> Tensor:
    """The advantages the trainer trains on: float32 ``[N]`` from the rewards ``[N]`` of
    ``N / group_size`` prompts' consecutive groups, as ``args.scale_rewards`` and
    ``args.leave_one_out`` say ([`daca_kernels.group_advantages`][daca_kernels.losses.advantages.group_advantages])."""
    return group_advantages(rewards, group_size, scale=args.scale_rewards, leave_one_out=args.leave_one_out)


class EpochRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` whose order in epoch ``e`` is a function of ``(seed, e)`` only.

    TRL's sampler seeds its generator once and draws a new permutation at each pass, so a run
    resumed in epoch ``e > 0`` (a fresh sampler) replays epoch 0's prompts. Here each pass restarts
    the generator from ``seed`` and draws the ``e + 1``-th permutation of that stream, the one
    TRL's sampler draws in epoch ``e`` of an uninterrupted run: ``e`` comes from
    [`set_epoch`][daca_kernels.trl.trainer.EpochRepeatSampler.set_epoch],
    which transformers' Trainer (through accelerate's data loader) calls before every epoch, a
    resumed epoch included. Without ``set_epoch`` every pass is epoch 0 (the evaluation sampler:
    each evaluation sees the prompts in one order).
    """

    def __init__(self, data_source, mini_repeat_count: int, batch_size: int = 1, repeat_count: int = 1,
                 shuffle: bool = True, seed: int | None = None):
        super().__init__(data_source, mini_repeat_count, batch_size=batch_size, repeat_count=repeat_count,
                         shuffle=shuffle, seed=seed)
        self.epoch = 0

    @classmethod
    def like(cls, sampler: RepeatSampler) -> "EpochRepeatSampler":
        """The sampler with ``sampler``'s data, repeats, batch size, shuffle and seed."""
        return cls(sampler.data_source, sampler.mini_repeat_count, batch_size=sampler.batch_size,
                   repeat_count=sampler.repeat_count, shuffle=sampler.shuffle, seed=sampler.seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_int(epoch, "epoch", low=0)

    def __iter__(self):
        if self.shuffle:
            self.generator = torch.Generator()
            if self.seed is not None:
                self.generator.manual_seed(self.seed)
            for _ in range(self.epoch):
                torch.randperm(self.num_samples, generator=self.generator)
        return super().__iter__()


def run_as_forward(wrapped: nn.Module, module: nn.Module, fn):
    """``fn()`` run as the forward call of ``wrapped``, the wrapper (DDP, FSDP2, or ``module``
    itself) of ``module``: ``module.forward`` is swapped for ``fn`` during ``wrapped()``, so the
    wrapper's hooks run around it (FSDP2 gathers the parameters of ``module``'s own group, e.g. the
    LM head and embeddings, before ``fn`` and registers its backward on the output). The instance
    attribute ``forward`` (e.g. accelerate's autocast wrapper) is restored exactly afterwards."""
    saved = module.__dict__.get("forward")
    module.forward = lambda *args, **kwargs: fn()
    try:
        return wrapped()
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


def _auto_class_of(model_id, trust_remote_code: bool):
    """The Auto class TRL's loader should use for ``model_id``, or None to let it choose: ``AutoModel``
    for a remote-code checkpoint whose ``auto_map`` names ``AutoModel`` but no class TRL looks for
    (Dream and DiffuCoder map ``AutoModel`` only; TRL falls back to ``AutoModelForCausalLM``, which
    cannot load them)."""
    from transformers import AutoConfig, AutoModel  # here: importing transformers costs seconds

    try:
        config = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None  # not a checkpoint this can read: TRL's own loader says why
    auto_map = getattr(config, "auto_map", None) or {}
    if any(name in auto_map for name in ("AutoModelForCausalLM", "AutoModelForImageTextToText")):
        return None
    return AutoModel if "AutoModel" in auto_map else None


@contextlib.contextmanager
def _models_built_here(trainer: "DiffusionGRPOTrainer"):
    """During ``GRPOTrainer.__init__``: a policy TRL loads from a path is loaded as
    [`daca_kernels.models.model_loading.from_pretrained`][daca_kernels.models.model_loading.from_pretrained] loads it (the released
    code's help under the
    installed transformers, the completed construction, [`prepare_model`][daca_kernels.models.model_loading.prepare_model];
    ``AutoModel`` where the
    checkpoint's ``auto_map`` has no causal-LM class, `_auto_class_of`), and the reference model
    is a copy of the policy (module docstring) instead of TRL's reload of
    ``model.config._name_or_path``. TRL loads both through ``create_model_from_path``, the policy
    first; the reference after ``Trainer.__init__`` has set ``trainer.model``."""
    load = trl_grpo_trainer.create_model_from_path

    def build(model_id, **kwargs):
        policy = trainer.__dict__.get("model")
        if policy is None:
            with released_code_support(), complete_construction():
                if kwargs.get("architecture") is None:
                    auto = _auto_class_of(model_id, bool(kwargs.get("trust_remote_code", False)))
                    if auto is not None:
                        kwargs["architecture"] = auto
                return prepare_model(load(model_id, **kwargs))
        return reference_copy(policy)

    trl_grpo_trainer.create_model_from_path = build
    try:
        yield
    finally:
        trl_grpo_trainer.create_model_from_path = load


def reference_copy(policy: nn.Module) -> nn.Module:
    """The reference model: a deep copy of ``policy`` in evaluation mode without gradients (of a
    policy partitioned by DeepSpeed ZeRO-3, a copy built partitioned:
    [`daca_kernels.trl.zero3.partitioned_copy`][daca_kernels.trl.zero3.partitioned_copy])."""
    if zero3.is_partitioned(policy):
        reference = zero3.partitioned_copy(policy)
    else:
        reference = copy.deepcopy(policy)
        prepare_model(reference)
    return reference.eval().requires_grad_(False)


def default_config(model) -> DiffusionGRPOConfig:
    """The config of ``DiffusionGRPOTrainer(args=None)``: TRL's (output directory
    ``"<model name>-DiffusionGRPO"``, every option at its default), on the CPU without bf16 where
    CUDA is not available (TRL's default would stop there: bf16 needs a GPU)."""
    name = model if isinstance(model, str) else (get_config_model_id(model.config) or type(model).__name__)
    cpu = {} if torch.cuda.is_available() else {"use_cpu": True, "bf16": False}
    return DiffusionGRPOConfig(f"{name.split('/')[-1]}-DiffusionGRPO", **cpu)


class DiffusionGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` for a masked diffusion LM (module docstring).

    Takes the arguments of ``GRPOTrainer`` with ``args`` a [`DiffusionGRPOConfig`][daca_kernels.trl.config.DiffusionGRPOConfig]. The model
    must be a transformers model whose logits are ``hidden @ head.T (+ bias)``
    ([`daca_kernels.MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf]), bidirectional (e.g. LLaDA, LLaDA-MoE, Dream,
    DiffuCoder) or block-causal (SDAR / TraDo, LLaDA2), given as an
    object or as a path TRL loads; it is prepared in place
    ([`daca_kernels.models.model_loading.prepare_model`][daca_kernels.models.model_loading.prepare_model]), and with ``beta > 0`` the
    reference model is its copy
    ([`reference_copy`][daca_kernels.trl.trainer.reference_copy]). Prompts are text or conversations, as in TRL (vision inputs and tools
    are not supported).

    The tokenizer (``processing_class``) must fit the model, checked at construction: at most as
    many ids (``len(processing_class)``) as the model's head scores (a ValueError naming
    ``processing_class``; a smaller tokenizer is fine, checkpoints pad their vocabulary), the mask id
    inside both vocabularies (a ValueError naming ``mask_token_id``), and an EOS token (completions
    end at it). A tokenizer without a pad token is accepted as TRL accepts it: TRL's constructor
    sets ``pad_token`` to the EOS token on the tokenizer passed (and ``pad_token_id`` in the model's
    configs), so prompts are left padded with the EOS id; the padding is hidden by the attention
    mask, never masked or scored, and the completion's first EOS still ends the answer. A model
    with a position limit (``MaskedLM.max_length``: learned absolute position embeddings, e.g. BERT)
    refuses a ``max_completion_length`` beyond it at construction and, at each generation, a batch
    whose tokenized prompt width plus ``max_completion_length`` exceeds it, each a ValueError naming
    ``max_completion_length``.
    """

    def __init__(self, model, reward_funcs, args: DiffusionGRPOConfig | None = None, **kwargs):
        if args is None:
            args = default_config(model)
        if not isinstance(args, DiffusionGRPOConfig):
            raise TypeError(f"args must be a DiffusionGRPOConfig, got {type(args).__name__}")
        if getattr(args, "deepspeed_plugin", None) is not None:  # before any model is built or wrapped
            zero3.check_config(args.deepspeed_plugin.deepspeed_config, args)
        if isinstance(model, nn.Module):
            prepare_model(model)
        with _models_built_here(self):
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        with zero3.gathered(self.accelerator.unwrap_model(self.model)):  # the logits check reads whole weights
            self._check_model()
        self.step_options = StepOptions.from_config(args, beta=self.beta)
        eos = getattr(self._tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer (processing_class) must define eos_token_id: completions end at it")
        self.eos_id = int(eos)
        if self._tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer (processing_class) must define pad_token_id: prompts are left padded with it")

    # Samplers: TRL's order, reproducible per epoch (EpochRepeatSampler), so that a resumed run sees
    # the prompts of the uninterrupted one.
    def _get_train_sampler(self, dataset=None):
        return EpochRepeatSampler.like(super()._get_train_sampler(dataset))

    def _get_eval_sampler(self, eval_dataset):
        return EpochRepeatSampler.like(super()._get_eval_sampler(eval_dataset))

    def _check_model(self) -> None:
        """Wrap the policy once, with the logits check ([`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf]), and keep
        what the
        estimates need: ``mask_id`` (``mask_token_id``, else the tokenizer's, else the model's: its
        config, generation config or family), ``shift`` (``shift_logits``, else the family's) and
        ``hidden_from`` (the family's, else the first of ``HIDDEN_SOURCES`` that works). A model whose
        logits are not ``hidden @ head.T (+ bias)`` is refused clearly."""
        model = self.accelerator.unwrap_model(self.model)
        mask_id = next((c for c in (self.args.mask_token_id, getattr(self._tokenizer, "mask_token_id", None))
                        if c is not None), None)
        # The check is of the architecture, so it runs the class's forward: an instance forward, such
        # as the autocast wrapper accelerate leaves on a model an earlier bf16/fp16 trainer prepared,
        # computes the logits in half precision and would fail the float32 comparison.
        instance_forward = model.__dict__.pop("forward", None)
        try:
            failures = []
            for source in (None, *HIDDEN_SOURCES):
                try:
                    lm = MaskedLM.from_hf(model, mask_id=mask_id, shift=self.args.shift_logits, hidden_from=source)
                except (AttributeError, TypeError, IndexError) as error:
                    failures.append(f"{source or 'the family default'}: {type(error).__name__}: {error}")
                    continue
                except ValueError as error:
                    if str(error).startswith("mask_id"):
                        raise ValueError(f"mask_token_id: the tokenizer has none and {error}; set "
                                         f"DiffusionGRPOConfig(mask_token_id=...)") from error
                    raise
                check_tokenizer_fits(len(self._tokenizer), lm.vocab_size, lm.mask_id)
                check_sequence_length(self.args.max_completion_length, lm.max_length, "max_completion_length",
                                      "the completion length G")
                self.sampler_options = self.args.sampler_options(lm.attention)
                if self.args.sampling_importance_sampling_correction and lm.attention != "full":
                    raise ValueError("sampling_importance_sampling_correction: a block-causal model's rollouts are "
                                     "decoded with its exact KV cache and record no sampling log-probabilities; "
                                     "leave it False")
                self.mask_id, self.shift, self.hidden_from, self.attention = lm.mask_id, lm.shift, source, lm.attention
                self.max_length = lm.max_length
                return
        finally:
            if instance_forward is not None:
                model.forward = instance_forward
        raise ValueError(f"model: {type(model).__name__}'s base_model returns neither last_hidden_state nor "
                         f"hidden_states (the states its LM head reads): {'; '.join(failures)}")

    # Every model call goes through the wrapped module's forward (module docstring).
    def _in_forward(self, model: nn.Module, fn):
        """``fn(lm)`` with ``lm`` a [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] of ``model``, run as the forward call of
        ``model`` (DDP, FSDP2 or a plain module): parameters are read while the wrapper has
        gathered them, and the output's backward is the wrapper's."""
        inner = self.accelerator.unwrap_model(model)
        zero3.register_head(inner)  # ZeRO-3: the forward call gathers the head the estimators read

        def call():
            lm = MaskedLM.from_hf(inner, mask_id=self.mask_id, shift=self.shift, verify=False,
                                  hidden_from=self.hidden_from)
            with self.accelerator.autocast():
                return fn(lm)

        return run_as_forward(model, inner, call)

    def _policy(self, model: nn.Module) -> Policy:
        """``model`` (the wrapped policy or the reference model) as the step functions call it: every
        estimate is one forward call of the wrapper (`_in_forward`)."""
        return Policy(lambda fn: self._in_forward(model, fn), self.mask_id, self.attention)

    def _step_batch(self, batch: dict) -> StepBatch:
        """The [`StepBatch`][daca_kernels.rl_step.StepBatch] of a chunk of the generation batch (DiSPO's ``branch_*`` entries,
        ``[B, Z, ...]`` here so that a chunk is a slice of rows, in the ``R = B * Z`` row layout)."""
        fillings = None
        if "branch_fillings" in batch:
            z = batch["branch_fillings"].shape[1]
            fillings = Fillings(state=batch["branch_state"], fillings=batch["branch_fillings"].flatten(0, 1),
                                filled=batch["branch_filled"].repeat_interleave(z, dim=0),
                                rewards=batch["branch_rewards"].flatten(), num_fillings=z)
        return StepBatch(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         completion_mask=batch["completion_mask"], loss_mask=batch["loss_mask"],
                         advantages=batch["advantages"], generation_length=self.args.max_completion_length,
                         row_offset=int(batch["row_index"][0]), token_weights=batch.get("token_weights"),
                         fillings=fillings)

    def per_token_logps(self, model: nn.Module, batch: dict, seed: int) -> Tensor:
        """float32 ``[B, L]``: the configured estimator on ``batch`` (``input_ids``, ``attention_mask``,
        ``completion_mask``, ``loss_mask``, ``row_index``) with mask seed ``seed``."""
        return token_logprob(self._policy(model), self.step_options, self._step_batch(batch), seed)

    # Generation: rollouts, rewards, advantages, and the old and reference values of every iteration.
    def _prepare_inputs(self, generation_batch):
        # TRL's schedule (one generation per steps_per_generation * num_iterations steps), without its
        # shuffle: rows stay in global order so that a chunk's masks follow from its first row index.
        if not self.model.training:
            return {**self._generate_and_score_completions(generation_batch), "iteration": 0}
        if self._step == 0 and self.state.global_step > 0:
            # Resumed from a checkpoint: TRL's micro-step counter restarts at 0; continue it, so that
            # the generation count (and with it every seed) continues too.
            self._step = self.state.global_step * self.args.gradient_accumulation_steps
        chunks = self.args.steps_per_generation
        if self._step % (chunks * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            size = batch["input_ids"].shape[0] // chunks
            self._buffered_inputs = [{k: v[i * size:(i + 1) * size] if isinstance(v, Tensor) and v.dim() else v
                                      for k, v in batch.items()} for i in range(chunks)]
        inputs = self._buffered_inputs[self._step % chunks]
        return {**inputs, "iteration": (self._step // chunks) % self.num_iterations}

    def _generation_seeds(self, mode: str) -> tuple[int, list[int], int]:
        """The seeds of a generation: its rollout, the masks of each inner iteration, its DiSPO fillings."""
        generation = self._step // (self.args.steps_per_generation * self.num_iterations) if mode == "train" else \
            -1 - self.state.global_step
        base = (self.args.seed, generation)
        masks = [derive_seed(*base, 1 + i) for i in range(self.num_iterations if mode == "train" else 1)]
        return derive_seed(*base, 0), masks, derive_seed(*base, -1)

    def _left_padded_prompts(self, prompts: list) -> tuple[Tensor, Tensor]:
        ids, _, _ = self._tokenize_prompts(prompts)
        device = self.accelerator.device
        # One prompt width for all processes, so that a row's positions (and its noise) do not
        # depend on how the batch is split.
        width = int(self.accelerator.gather(torch.tensor([max(map(len, ids))], device=device)).max())
        pad = self._tokenizer.pad_token_id
        prompt_ids = torch.tensor([[pad] * (width - len(row)) + list(row) for row in ids], device=device)
        prompt_mask = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in ids], device=device)
        return prompt_ids, prompt_mask

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        mode = "train" if self.model.training else "eval"
        args = self.args
        prompts = [x["prompt"] for x in inputs]
        prompt_ids, prompt_mask = self._left_padded_prompts(prompts)
        width, length = prompt_ids.shape[1], args.max_completion_length
        check_sequence_length(width + length, self.max_length, "max_completion_length",
                              f"P + G with the batch's tokenized prompt width P = {width} and max_completion_length "
                              f"G = {length}")
        rows = prompt_ids.shape[0]
        first_row = self.accelerator.process_index * rows
        rollout_seed, mask_seeds, branch_seed = self._generation_seeds(mode)
        branch_steps = args.branch_steps(self.attention)
        was_training = self.model.training
        self.model.eval()
        # ZeRO-3: the parameters are gathered once for the whole rollout, not at each of its forwards.
        engine = self.model_wrapped if self.is_deepspeed_enabled else None
        gathered = zero3.gathered_for_rollout(engine, self.accelerator.unwrap_model(self.model)) \
            if args.ds3_gather_for_generation else contextlib.nullcontext()
        try:
            with torch.no_grad(), gathered:
                rollout = self._in_forward(self.model, lambda lm: generate(
                    lm, prompt_ids, gen_length=args.max_completion_length, temperature=args.temperature,
                    **self.sampler_options, seed=rollout_seed, prompt_mask=prompt_mask, row_offset=first_row, branch_steps=branch_steps))
                # The committed tokens under full forwards of the sampling policy (the correction's target).
                scored = self._in_forward(self.model, lambda lm: rescore_commits(lm, rollout)) \
                    if args.sampling_importance_sampling_correction else None
        finally:
            self.model.train(was_training)
        batch = self._rollout_batch(rollout, first_row)
        completions, completion_ids_list = self._completions(prompts, rollout.sequences[:, rollout.prompt_length:],
                                                             batch["loss_mask"][:, rollout.prompt_length:])
        rewards_per_func, rewards = self._rewards(inputs, prompts, completions, completion_ids_list)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        advantages = rollout_advantages(args, rewards, num_generations)
        batch["advantages"] = advantages[first_row:first_row + rows]
        batch["num_items_in_batch"] = self.accelerator.gather(batch["loss_mask"].sum()).sum()
        batch["mask_seeds"] = mask_seeds
        if args.dps:
            batch["token_weights"] = dps_weights(rollout, batch["loss_mask"], **args.dps_options())
        if scored is not None:
            weights, metrics = sampling_importance_weights(scored, rollout.commit_logprob, rollout.commit_step,
                                                           batch["loss_mask"], self.step_options)
            batch["token_weights"] = weights * batch["token_weights"] if "token_weights" in batch else weights
            for name, value in metrics.items():
                self._metrics[mode][name].append(self.accelerator.gather(value).mean().item())
        if OBJECTIVES[args.objective].fillings:
            self._add_fillings(batch, rollout, inputs, prompts, first_row, branch_seed, mode)
        with torch.no_grad():
            self._old_and_reference(batch, mode)
        self._log_generation(mode, prompts, completions, rewards_per_func, rewards, advantages,
                             batch["loss_mask"].sum(1))
        return batch

    def _completions(self, prompts: list, completion_ids: Tensor, answer: Tensor) -> tuple[list, list[list[int]]]:
        """What the reward functions get for completions ``[N, G]`` whose answers are ``answer``
        (bool ``[N, G]``): the texts (messages for conversational prompts) without EOS, and the ids."""
        completion_ids_list = [row[keep].tolist() for row, keep in zip(completion_ids, answer)]
        texts = self.processing_class.batch_decode(
            [[t for t in row if t != self.eos_id] for row in completion_ids_list], skip_special_tokens=True)
        if isinstance(prompts[0], list):  # conversational, as TRL passes completions to reward functions
            return [[{"role": "assistant", "content": text}] for text in texts], completion_ids_list
        return texts, completion_ids_list

    def _rewards(self, inputs: list[dict], prompts: list, completions: list, completion_ids_list: list) -> tuple:
        """``(rewards_per_func [N, F], rewards [N])`` of the whole batch (every process's rows): each
        reward function's values, and their ``reward_weights``-weighted sum (NaN counted as 0)."""
        per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return per_func, (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)

    def _add_fillings(self, batch: dict, rollout: Rollout, inputs: list[dict], prompts: list, first_row: int,
                      seed: int, mode: str) -> None:
        """DiSPO: add the Z fillings of each row's cached state and their rewards: ``branch_state``
        ``[B, L]``, ``branch_filled`` ``[B, L]`` (the state's masked positions), ``branch_fillings``
        ``[B, Z, L]``, ``branch_rewards`` ``[B, Z]``, ``branch_filled_count`` (filled tokens of all
        fillings of every process)."""
        z = self.args.dispo_fillings
        fills = branch(rollout, 0, z, seed=seed, temperature=self.args.temperature, row_offset=first_row)
        fillings = fills.sequences.transpose(0, 1)
        rows, length = fills.state.shape
        flat = fillings.reshape(rows * z, length)
        answer = answer_mask(flat, rollout.completion_mask.repeat_interleave(z, dim=0), self.eos_id)
        prompts_z = [p for p in prompts for _ in range(z)]
        completions, completion_ids_list = self._completions(prompts_z, flat[:, rollout.prompt_length:],
                                                             answer[:, rollout.prompt_length:])
        # Columns and metrics a reward function logs describe the rollouts' completions, not the fillings.
        extra, metrics = self._pending_extra_logs, self._pending_metrics
        self._pending_extra_logs, self._pending_metrics = defaultdict(list), defaultdict(list)
        try:
            _, rewards = self._rewards([x for x in inputs for _ in range(z)], prompts_z, completions, completion_ids_list)
        finally:
            self._pending_extra_logs, self._pending_metrics = extra, metrics
        batch.update(branch_state=fills.state, branch_filled=fills.filled, branch_fillings=fillings,
                     branch_rewards=rewards[first_row * z:(first_row + rows) * z].view(rows, z),
                     branch_filled_count=self.accelerator.gather(fills.filled.sum() * z).sum())
        self._metrics[mode]["dispo/filling_reward"].append(rewards.mean().item())

    def _rollout_batch(self, rollout: Rollout, first_row: int) -> dict:
        rows = rollout.sequences.shape[0]
        return {"input_ids": rollout.sequences, "attention_mask": rollout.attention_mask,
                "completion_mask": rollout.completion_mask, "loss_mask": rollout.answer_mask(self.eos_id),
                "row_index": torch.arange(first_row, first_row + rows, device=rollout.sequences.device)}

    def _old_and_reference(self, batch: dict, mode: str) -> None:
        """Add ``old`` (``[B, I, L]`` per-token values, or ``[B, I, n]`` BGPO sample scores) for the
        inner iterations that need them (``old_iterations``), and ``ref`` ``[B, I, L]`` with ``beta > 0``.
        Computed per chunk of ``per_device_train_batch_size`` rows (one forward's worth)."""
        args = self.args
        seeds = batch["mask_seeds"]
        # The policy moves between the generation and iteration i > 0; iteration 0 is on-policy unless
        # generation falls inside an accumulation window (TRL's rule).
        misaligned = args.gradient_accumulation_steps % (args.steps_per_generation * self.num_iterations) != 0
        batch["old_iterations"] = [i for i in range(len(seeds)) if (i > 0 or misaligned) and mode == "train"
                                   and OBJECTIVES[args.objective].ratio]
        need_ref = self.step_options.needs_reference
        if not batch["old_iterations"] and not need_ref:
            return
        size = args.per_device_train_batch_size if mode == "train" else batch["input_ids"].shape[0]
        total = batch["input_ids"].shape[0]
        chunks = [{k: v[s:s + size] if isinstance(v, Tensor) and v.dim() else v for k, v in batch.items()}
                  for s in range(0, total, size)]

        def stack(fn, iterations):
            # [B, I, ...]: the values of each iteration in ``iterations``, zeros for the others.
            per_chunk = []
            for chunk in chunks:
                values = {i: fn(chunk, seeds[i]) for i in iterations}
                like = next(iter(values.values()))
                per_chunk.append(torch.stack([values.get(i, torch.zeros_like(like)) for i in range(len(seeds))], 1))
            return torch.cat(per_chunk)

        options, policy = self.step_options, self._policy(self.model)
        if batch["old_iterations"]:
            def old(chunk: dict, seed: int) -> Tensor:
                values = old_values(policy, options, self._step_batch(chunk), seed)
                # rows first: per-sample scores [n, B] as [B, n]
                return values.T if OBJECTIVES[args.objective].old_values == "samples" else values

            batch["old"] = stack(old, batch["old_iterations"])
            if OBJECTIVES[args.objective].fillings:  # the step likelihood has no masks: one value for every iteration
                batch["branch_old"] = torch.cat([step_logprob(policy, self._step_batch(chunk)).view(
                    chunk["branch_fillings"].shape) for chunk in chunks])
        if need_ref:
            if self.ref_model is None:
                raise ValueError("beta > 0 needs a reference model; TRL builds none for a PEFT model, which this "
                                 "trainer does not support")
            reference = self._policy(self.ref_model)
            batch["ref"] = stack(lambda c, s: reference_values(reference, options, self._step_batch(c), s),
                                 range(len(seeds)))

    def _log_generation(self, mode, prompts, completions, rewards_per_func, rewards, advantages, lengths) -> None:
        """TRL's generation metrics and completion logs (``rewards_per_func``, ``rewards`` and
        ``advantages`` are the whole batch's; the rest this process's), and what the reward
        functions logged through ``log_extra`` and ``log_metric``."""
        metrics = self._metrics[mode]
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        metrics["reward"].append(rewards.mean().item())
        metrics["reward_std"].append(rewards.std().item() if rewards.numel() > 1 else 0.0)
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        metrics["frac_reward_zero_std"].append((rewards.view(-1, group_size).std(1) == 0).float().mean().item()
                                               if group_size > 1 else 1.0)
        metrics["completions/mean_length"].append(self.accelerator.gather(lengths.float()).mean().item())
        self._logs["prompt"].extend(gather_object(prompts))
        self._logs["completion"].extend(gather_object(completions))
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        self._logs["advantages"].extend(advantages.tolist())
        # Every process takes part in each gather, in one (sorted) order of the names.
        for column in sorted(set(gather_object(list(self._pending_extra_logs)))):
            values = self._pending_extra_logs.get(column, [None] * len(prompts))
            self._logs["extra"][column].extend(gather_object(values))
        self._pending_extra_logs.clear()
        for name in sorted(set(gather_object(list(self._pending_metrics)))):
            values = self._pending_metrics.get(name, [])
            total, count = self.accelerator.gather(torch.tensor([sum(values), len(values)], dtype=torch.float32,
                                                                device=self.accelerator.device)).view(-1, 2).sum(0)
            metrics[name].append((total / count).item())
        self._pending_metrics.clear()

    # The loss.
    def _compute_loss(self, model, inputs):
        args = self.args
        mode = "train" if self.model.training else "eval"
        iteration = inputs["iteration"]
        seed = inputs["mask_seeds"][iteration]
        off_policy = iteration in inputs.get("old_iterations", ())
        old = inputs["old"][:, iteration] if off_policy else None
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        normaliser = chunk_normaliser(inputs["num_items_in_batch"], inputs.get("branch_filled_count"),
                                      processes=self.accelerator.num_processes, accumulation=accumulation,
                                      chunks=args.steps_per_generation if mode == "train" else 1)
        policy, batch = self._policy(model), self._step_batch(inputs)
        if old is not None and OBJECTIVES[args.objective].old_values == "samples":
            old = old.T  # stored rows first, [B, n]
        by_sample = OBJECTIVES[args.objective].sample_by_sample_backward
        if by_sample and mode == "train" and torch.is_grad_enabled() and not self.is_deepspeed_enabled:
            # Every sample but the last goes through accelerator.backward here; the last sample's share
            # is returned with its graph, for the backward of the trainer's training step.
            loss, metrics = bgpo_backward(policy, self.step_options, batch, seed, normaliser, old=old,
                                          backward=self.accelerator.backward, keep_last=True)
        else:  # BGPO here (all samples at once): evaluation, or DeepSpeed (whose backward in accelerate also steps)
            loss, metrics = objective_loss(policy, self.step_options, batch, seed, normaliser, old=old,
                                           ref=inputs["ref"][:, iteration] if "ref" in inputs else None,
                                           old_step=inputs["branch_old"].flatten(0, 1) if off_policy and
                                           "branch_old" in inputs else None)
        for name, value in metrics.items():
            self._metrics[mode][name].append(self.accelerator.gather(value.detach().float()).mean().item())
        return loss
