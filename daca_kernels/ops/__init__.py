"""The public ops: input validation, backend dispatch, autograd and ``torch.library`` registration."""
from daca_kernels.ops.confidence_delta import confidence_delta
from daca_kernels.ops.gather_logprob import gather_logprob, stratified_gather_logprob
from daca_kernels.ops.linear_logprob import linear_logprob
from daca_kernels.ops.sample_step import sample_step, sample_step_linear
from daca_kernels.ops.stratified_mask import StratifiedMask, stratified_mask
from daca_kernels.ops.topk_logprob import linear_topk_logprob

__all__ = [
    "StratifiedMask",
    "confidence_delta",
    "gather_logprob",
    "linear_logprob",
    "linear_topk_logprob",
    "sample_step",
    "sample_step_linear",
    "stratified_gather_logprob",
    "stratified_mask",
]
