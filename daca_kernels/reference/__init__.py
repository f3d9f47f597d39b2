"""Pure-PyTorch references: the executable specification of every op (float64-capable)."""
from daca_kernels.reference.logprob import gather_logprob, linear_logprob, stratified_gather_logprob

__all__ = ["gather_logprob", "linear_logprob", "stratified_gather_logprob"]
from daca_kernels.reference import losses  # noqa: E402  (references of daca_kernels.losses)

__all__ += ["losses"]
