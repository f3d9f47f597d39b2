"""The public ops: input validation, backend dispatch, autograd and ``torch.library`` registration."""
from daca_kernels.ops.gather_logprob import gather_logprob, stratified_gather_logprob
from daca_kernels.ops.linear_logprob import linear_logprob

__all__ = ["gather_logprob", "linear_logprob", "stratified_gather_logprob"]

from daca_kernels.ops.confidence_delta import confidence_delta
from daca_kernels.ops.sample_step import sample_step, sample_step_linear
from daca_kernels.ops.topk_logprob import linear_topk_logprob

__all__ += ["confidence_delta", "sample_step", "sample_step_linear", "linear_topk_logprob"]
