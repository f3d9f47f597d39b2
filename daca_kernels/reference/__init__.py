"""Pure-PyTorch references: the executable specification of every op (float64-capable)."""
from daca_kernels.reference.logprob import gather_logprob, linear_logprob, stratified_gather_logprob

__all__ = ["gather_logprob", "linear_logprob", "stratified_gather_logprob"]
from daca_kernels.reference.likelihood import masked_copies_logprob
from daca_kernels.reference.masking import stratified_mask

__all__ += ["masked_copies_logprob", "stratified_mask"]
