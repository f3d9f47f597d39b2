"""The Llama-style building blocks the family doubles share (written for these tests): RMS norm, rotary
embedding, the gated MLP. Each double subclasses them under its family's class names, so module names,
``state_dict`` keys and the classes its ``_init_weights`` tests for are those of the released code."""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """``inv_freq`` registered non-persistent, computed in ``__init__`` from ``config`` (the rotated width
    from :meth:`rotary_dim`), as the released classes do; ``forward`` gives ``(cos, sin)`` in ``x``'s dtype."""

    def __init__(self, config, device=None):
        super().__init__()
        self.config, self.rope_type, self.attention_scaling = config, "default", 1.0
        dim = self.rotary_dim(config)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = self.inv_freq

    @staticmethod
    def rotary_dim(config):
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
