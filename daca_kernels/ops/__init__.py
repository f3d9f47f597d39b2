"""The public ops: input validation, backend dispatch, autograd and ``torch.library`` registration."""
from daca_kernels.ops.gather_logprob import gather_logprob, stratified_gather_logprob
from daca_kernels.ops.linear_logprob import linear_logprob

__all__ = ["gather_logprob", "linear_logprob", "stratified_gather_logprob"]
from daca_kernels.ops.stratified_mask import StratifiedMask, stratified_mask

__all__ += ["StratifiedMask", "stratified_mask"]
