"""daca-kernels: fused kernels and estimators for RL post-training of masked diffusion LMs."""
from daca_kernels.ops import gather_logprob, linear_logprob, stratified_gather_logprob

__version__ = "0.1.0"

__all__ = ["gather_logprob", "linear_logprob", "stratified_gather_logprob"]

from daca_kernels.ops import confidence_delta, linear_topk_logprob, sample_step, sample_step_linear  # noqa: E402

__all__ += ["confidence_delta", "linear_topk_logprob", "sample_step", "sample_step_linear"]
