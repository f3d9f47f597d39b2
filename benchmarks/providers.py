"""The implementations each benchmark compares, under one name per provider.

- ``daca``: this library's op on the default dispatch (Triton on a GPU, the chunked PyTorch path on
  a CPU); ``daca_torch``: the same op forced onto the chunked PyTorch path (``DACA_BACKEND=torch``;
  GPU runs only, since on a CPU it is ``daca``).
- ``eager``: what a trainer writes today, full logits then ``log_softmax`` and a gather;
  ``compile``: the same function under ``torch.compile``.
- ``liger``: Liger-Kernel's fused linear cross-entropy (and, on logits, its selective
  log-softmax forward and cross-entropy forward+backward); ``cce``: Cut Cross-Entropy's
  ``linear_cross_entropy``. Both only on CUDA and only when importable. They return the summed
  loss, whose forward and gradient cost what the log-probabilities' sum costs.
- ``trl``: TRL's own (1.16): ``trl.kernels.ChunkedLogProbFunction`` for the head (vocabulary tiles
  of the width TRL's trainer uses, a Triton fold on CUDA and torch ops elsewhere, so it runs on
  CPU too) and ``trl.trainer.utils.selective_log_softmax`` on logits. Wherever trl is importable.
- ``llada``: LLaDA's released sampler, written out here: full logits, Gumbel noise drawn in float64
  and applied as ``exp(logits) / (-log u)^temperature``, argmax, and the confidence from a float32
  softmax; and its block-wise low-confidence ``generate`` loop.

Every function returns what its op returns (or a sum standing for it); the benchmark adds the
backward.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from daca_kernels import gather_logprob, linear_logprob, sample_step, sample_step_linear
from daca_kernels.rollout.remasking import transfer_counts

TEMPERATURE = 0.7


@contextlib.contextmanager
def forced_backend(name: str | None):
    """Run with ``DACA_BACKEND=name`` (None: the default dispatch)."""
    old = os.environ.get("DACA_BACKEND")
    if name is not None:
        os.environ["DACA_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DACA_BACKEND", None)
        else:
            os.environ["DACA_BACKEND"] = old


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available(provider: str, device: torch.device, *, smoke: bool = False) -> bool:
    """Whether ``provider`` runs here (``compile`` is left out of smoke runs: compiling is slow)."""
    if provider == "daca_torch":
        return device.type == "cuda"
    if provider == "compile":
        return not smoke
    if provider == "liger":
        return device.type == "cuda" and importable("liger_kernel")
    if provider == "cce":
        return device.type == "cuda" and importable("cut_cross_entropy")
    if provider == "trl":
        return importable("trl")
    return True


_compiled: dict = {}


def compiled(fn):
    """``torch.compile(fn)``, built once per function (shapes are specialised, then made dynamic)."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


def on_torch_path(fn):
    def run(*args):
        with forced_backend("torch"):
            return fn(*args)

    return run


# gather_logprob(logits [N, V], targets [N]) -> float32 [N]

def eager_gather(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def liger_gather_fwd(logits, targets):
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

    # It scores the first L rows of [B, L + 1, V] logits; the benchmark allocates one spare row
    # after the N scored ones, so this view costs no copy.
    padded = logits.as_strided((1, logits.shape[0] + 1, logits.shape[1]), (0, logits.shape[1], 1))
    return fused_selective_log_softmax(padded, targets[None], temperature=1.0)[0]


def liger_gather_loss(logits, targets):
    from liger_kernel.transformers.functional import liger_cross_entropy

    return -liger_cross_entropy(logits, targets, reduction="sum")


def trl_gather(logits, targets):
    from trl.trainer.utils import selective_log_softmax

    return selective_log_softmax(logits, targets)


def gather_providers(mode: str) -> dict:
    return {
        "daca": gather_logprob,
        "daca_torch": on_torch_path(gather_logprob),
        "eager": eager_gather,
        "compile": compiled(eager_gather),
        "liger": liger_gather_fwd if mode == "fwd" else liger_gather_loss,
        "trl": trl_gather,
    }


# linear_logprob(hidden [N, H], weight [V, H], targets [N]) -> float32 [N] (or a sum)

def eager_linear(hidden, weight, targets):
    return eager_gather(hidden @ weight.T, targets)


def liger_linear(hidden, weight, targets):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return -LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, targets)


def cce_linear(hidden, weight, targets):
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(hidden, weight, targets, reduction="sum")


# The vocabulary tile width TRL 1.16's trainer passes (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE);
# its token tiles are fixed at trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE = 4096 rows.
TRL_VOCAB_CHUNK = 32768


def trl_linear(hidden, weight, targets):
    from trl.kernels import ChunkedLogProbFunction

    # Arguments: bias, temperature, vocabulary chunk, softcapping, logit scale, optional outputs
    # (none: the log-probabilities only, as every other provider computes).
    return ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ())[0]


LINEAR = {
    "daca": linear_logprob,
    "daca_torch": on_torch_path(linear_logprob),
    "eager": eager_linear,
    "compile": compiled(eager_linear),
    "liger": liger_linear,
    "cce": cce_linear,
    "trl": trl_linear,
}


# sample_step(logits [N, V]) -> (candidate int64 [N], confidence float32 [N]); mask id V - 1

def daca_step(logits, mask_id):
    return sample_step(logits, temperature=TEMPERATURE, seed=0, step=3, mask_id=mask_id)


def daca_step_linear(hidden, weight, mask_id):
    return sample_step_linear(hidden, weight, temperature=TEMPERATURE, seed=0, step=3, mask_id=mask_id)


def eager_step(logits, mask_id):
    """float32 softmax, Gumbel noise from ``torch.rand``, argmax, gather; the mask id excluded."""
    x = logits.float().index_fill(1, torch.tensor([mask_id], device=logits.device), float("-inf"))
    gumbel = -torch.log(-torch.log(torch.rand_like(x)))
    candidate = (x / TEMPERATURE + gumbel).argmax(dim=-1)
    return candidate, torch.softmax(x, dim=-1).gather(-1, candidate[:, None]).squeeze(-1)


def llada_step(logits, mask_id=None):
    """LLaDA's sampler step (its ``add_gumbel_noise`` in float64, then a float32 softmax)."""
    noisy = logits.double().exp() / (-torch.log(torch.rand_like(logits, dtype=torch.float64))) ** TEMPERATURE
    candidate = noisy.argmax(dim=-1)
    return candidate, torch.softmax(logits.float(), dim=-1).gather(-1, candidate[..., None]).squeeze(-1)


def eager_step_linear(hidden, weight, mask_id):
    return eager_step(hidden @ weight.T, mask_id)


def llada_step_linear(hidden, weight, mask_id):
    return llada_step(hidden @ weight.T, mask_id)


STEP = {"daca": daca_step, "eager": eager_step, "compile": compiled(eager_step), "llada": llada_step}
STEP_LINEAR = {"daca": daca_step_linear, "eager": eager_step_linear, "compile": compiled(eager_step_linear),
               "llada": llada_step_linear}


@torch.no_grad()
def llada_generate(lm, prompt, *, gen_length, steps, block_length, mask_id):
    """LLaDA's block-wise low-confidence remasking: every step forms the full ``[B, L, V]`` logits,
    samples every position with :func:`llada_step` and commits the block's most confident masked
    positions (``transfer_counts`` of the block per step)."""
    batch, prompt_length = prompt.shape
    x = torch.cat([prompt, prompt.new_full((batch, gen_length), mask_id)], dim=1)
    blocks = gen_length // block_length
    steps_per_block = steps // blocks
    for block in range(blocks):
        start = prompt_length + block * block_length
        in_block = torch.zeros_like(x, dtype=torch.bool)
        in_block[:, start:start + block_length] = True
        for count in transfer_counts(block_length, steps_per_block):
            masked = x == mask_id
            candidate, confidence = llada_step(lm.logits(x))
            confidence = torch.where(masked & in_block, confidence, float("-inf"))
            chosen = confidence.topk(count, dim=1).indices
            x.scatter_(1, chosen, candidate.gather(1, chosen))
    return x
