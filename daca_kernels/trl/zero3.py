"""DeepSpeed ZeRO-3 support of [`daca_kernels.trl.DiffusionGRPOTrainer`][daca_kernels.trl.trainer.DiffusionGRPOTrainer].

Under ZeRO-3 each process holds a partition of every parameter; DeepSpeed's module hooks gather a
module's own parameters around its forward (and again for its backward) and release them after. The
trainer reads three things outside those hooks, handled here:

- the LM head weight, which the estimators pass to a fused op (``linear_logprob``) instead of calling
  the head module: it is registered as an external parameter of the model's root module
  ([`register_head`][daca_kernels.trl.zero3.register_head]), so that the root's forward, inside which every estimate runs
  ([`daca_kernels.trl.run_as_forward`][daca_kernels.trl.trainer.run_as_forward]), gathers it and its backward gathers it again and
  reduces its gradient into the partitions;
- a rollout, a hundred forwards or more: the parameters are gathered once for the whole sampling loop
  and DeepSpeed's hooks are taken off meanwhile ([`gathered_for_rollout`][daca_kernels.trl.zero3.gathered_for_rollout]), instead of a gather
  per module per forward;
- the reference model, a copy of the policy: built partitioned, each process copying its own
  partitions ([`partitioned_copy`][daca_kernels.trl.zero3.partitioned_copy]), never the whole model on one process;
- the logits check at construction ([`daca_kernels.MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf]), which runs the
  policy
  outside DeepSpeed's hooks: the policy is gathered whole for it, once ([`gathered`][daca_kernels.trl.zero3.gathered]).

The rollout's hook removal and re-registration use DeepSpeed's ZeRO-3 internals (the hook lists and
``_register_deepspeed_module`` of its parameter-offload object, as TRL's generation does); tested with
DeepSpeed 0.19.8.

Everything here is a no-op on a model whose parameters are not partitioned, and imports DeepSpeed
only for one that is.
"""
from __future__ import annotations

import contextlib
import copy

from torch import nn

from daca_kernels.models.model_loading import finish_construction, prepare_model
from daca_kernels.models.released_code import released_code_support


def is_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitions (built under ``deepspeed.zero.Init`` or
    wrapped by a ZeRO-3 engine)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered(module: nn.Module):
    """A context in which every parameter of ``module`` is whole (read-only: the gathered values are
    dropped on exit); a no-op for a module that is not partitioned."""
    if not is_partitioned(module):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


def head_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The LM head's parameters (``get_output_embeddings()``: weight and bias)."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    return [] if head is None else list(head.parameters(recurse=False))


def register_head(module: nn.Module) -> None:
    """Register the LM head's parameters as external parameters of ``module`` (the model's root),
    once: ZeRO-3 then gathers them around every forward call of ``module`` and its backward. A no-op
    for a model that is not partitioned."""
    if not is_partitioned(module) or getattr(module, "_daca_head_registered", False):
        return
    import deepspeed

    for parameter in head_parameters(module):
        deepspeed.zero.register_external_parameter(module, parameter)
    module._daca_head_registered = True


def _hook_owner(engine):
    """The object that holds the ZeRO-3 module hooks of ``engine`` (a DeepSpeed engine), or None
    before it has one."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return None
    owner = getattr(optimizer, "parameter_offload", optimizer)
    return owner if hasattr(owner, "forward_hooks") and hasattr(owner, "_register_deepspeed_module") else None


@contextlib.contextmanager
def gathered_for_rollout(engine, module: nn.Module):
    """Around a rollout of ``module`` (the model ``engine``, a DeepSpeed ZeRO-3 engine or None,
    wraps): every parameter gathered once, and the engine's module hooks (which would gather and
    release each module's parameters at every forward) removed until the end, then registered again.
    A no-op for a model that is not partitioned."""
    if not is_partitioned(module):
        yield
        return
    owner = _hook_owner(engine)
    with gathered(module):
        if owner is None:  # no hooks yet (no engine): the gathered parameters serve the forwards as they are
            yield
            return
        for parameter in module.parameters():
            parameter.ds_active_sub_modules.clear()
        for hook in owner.forward_hooks + owner.backward_hooks:
            hook.remove()
        owner.forward_hooks, owner.backward_hooks = [], []
        try:
            yield
        finally:
            # The modules numbered as at the engine's registration: from the root's number, in the same order.
            owner._register_deepspeed_module(owner.module, count=[owner.module.ds_id])


def partitioned_copy(policy: nn.Module) -> nn.Module:
    """A copy of the partitioned ``policy``: the same class built from its config under
    ``deepspeed.zero.Init`` (so it is partitioned as it is built, as the policy was), then each
    process copies its own partition of every parameter and every buffer; no process ever holds a
    whole parameter. Prepared ([`daca_kernels.models.model_loading.prepare_model`][daca_kernels.models.model_loading.prepare_model]),
    not yet in
    evaluation mode."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        raise ValueError(f"{type(policy).__name__} is partitioned (DeepSpeed ZeRO-3) but the trainer's config does not "
                         "enable ZeRO-3: give it the DeepSpeed configuration the model was partitioned under")
    dtype = next(policy.parameters()).dtype
    with released_code_support():  # transformers builds it under deepspeed.zero.Init (ZeRO-3 is enabled)
        reference = type(policy)._from_config(copy.deepcopy(policy.config), dtype=dtype)
    finish_construction(reference)  # a released __init__ that skips post_init() (LLaDA-8B)
    source, target = dict(policy.named_parameters()), dict(reference.named_parameters())
    if list(source) != list(target):
        raise ValueError(f"the reference copy of {type(policy).__name__} has other parameters than the policy")
    for name, parameter in source.items():
        copy_to = target[name]
        if tuple(copy_to.ds_shape) != tuple(parameter.ds_shape) or copy_to.ds_tensor.shape != parameter.ds_tensor.shape:
            raise ValueError(f"the reference copy's partition of {name} differs from the policy's")
        copy_to.ds_tensor.data.copy_(parameter.ds_tensor.data)
    buffers = dict(reference.named_buffers())
    for name, buffer in policy.named_buffers():
        buffers[name].data.copy_(buffer.data)
    return prepare_model(reference)


def check_config(deepspeed_config: dict, args) -> None:
    """Refuse, at construction, a DeepSpeed configuration the trainer cannot run: under ZeRO-3 with
    ``beta > 0``, parameters offloaded to NVMe (``offload_param.device: nvme``), whose partitions the
    reference copy ([`partitioned_copy`][daca_kernels.trl.zero3.partitioned_copy]) would read from memory where they are not. ``args``
    is the trainer's config (``beta``)."""
    zero = deepspeed_config.get("zero_optimization") or {}
    if zero.get("stage") != 3:
        return
    device = (zero.get("offload_param") or {}).get("device", "none")
    if device == "nvme" and args.beta != 0.0:
        raise ValueError("DeepSpeed ZeRO-3 with offload_param.device 'nvme' and beta > 0 is not supported: the "
                         "reference model is copied from the policy's partitions in memory; offload the parameters "
                         "to 'cpu' (or 'none'), or set beta=0")
