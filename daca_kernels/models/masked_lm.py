"""``MaskedLM``: how the estimators and the sampler see a masked diffusion language model.

A model is split into a backbone that maps token ids to the hidden states the LM head reads,
and the head itself (``weight [V, H]``, optional ``bias [V]``). Estimators gather only the hidden
rows they need and send those through [`daca_kernels.linear_logprob`][daca_kernels.ops.linear_logprob], so full
``[B, L, V]`` logits are never formed.

[`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] splits a transformers model, or the released remote code of a family
[`daca_kernels.models.families`][daca_kernels.models.families] recognises (LLaDA, LLaDA-MoE, Dream / DiffuCoder, SDAR / TraDo,
LLaDA2): the backbone is ``model.base_model``, called the way its family's code needs (hidden-state
source, attention-mask form, cache flags); the head is ``model.get_output_embeddings()`` (tied or
not, with or without bias). Masked-LM heads that transform the hidden states before the output
projection (ModernBERT's ``head``, BERT's ``cls.predictions.transform``) are applied as part of
``hidden``. The shift convention and the mask id come from the family and the config unless given.

Block-causal models (``attention=("block", size)``) may also carry ``hidden_with_keep(input_ids,
position_ids, keep)``: the backbone run with caller-given position ids and a caller-given bool
attention matrix, which the block estimators use to score every block in one forward pass of the
noisy/clean layout ([`daca_kernels.likelihood.masked_passes`][daca_kernels.likelihood.masked_passes]).
[`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] provides it
for SDAR / TraDo and LLaDA2; a model given as a plain ``hidden_fn`` has none, and the estimators
then run one forward pass per block.

One block partition per row. A block model's blocks are counted from each row's first attended
position (``attention_mask``'s first nonzero column: the row's first token after its left padding),
and so are its position ids: block ``c`` of row ``b`` holds the columns ``i`` with ``(i - first_b) //
size == c`` ([`block_index`][daca_kernels.models.masked_lm.block_index]).
[`MaskedLM.hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden],
[`MaskedLM.block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden], the
estimators, the sampler ([`daca_kernels.rollout.blockwise`][daca_kernels.rollout.blockwise]), the branch states and the trainer all use
this partition, which is the one the released decoders see (they decode one unpadded prompt), so a
left-padded row is scored under the partition it was sampled under and its values do not depend on
its padding. Only ``hidden_fn`` itself, the raw call a [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] is built from, counts blocks
from column 0 of its input.

``verify=True`` checks once, on short random inputs, that ``hidden @ W.T + b`` reproduces
``model(...).logits`` (architectures that post-process logits, soft-capping or scaling, are refused
instead of silently mis-estimated); for a full-attention model it finds the form of attention mask
that hides a left-padded row's padding ([`daca_kernels.models.families.MASK_FORMS`][daca_kernels.models.families.MASK_FORMS]: the 2-D
key-padding
mask, a 4-D bool or additive mask, or none: rows then run without their padding), and it checks that a
left-padded row's states do not depend on its padding,
and the attention structure: bidirectional, or block-causal by the block rule for block-diffusion
families (and that ``hidden_with_keep`` honours the positions and the matrix it is given); a causal
model is refused, since the estimators assume a bidirectional one.

Position limit (``max_length``): a backbone with a learned absolute position table (an ``nn.Embedding``
named ``position_embeddings``, as in BERT, RoBERTa, ELECTRA, DistilBERT, or ``wpe``, as in GPT-2) has
one row per position and cannot run a longer input, so [`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] sets
``max_length`` to
the table's rows (``config.max_position_embeddings``; for RoBERTa less ``padding_idx + 1``, where its
positions start), and the sampler, the estimators and the trainer refuse a longer input by name.
Rotary models (LLaDA, Dream / DiffuCoder, SDAR / TraDo, LLaDA2, Llama, Qwen, ModernBERT) state a
``max_position_embeddings`` or ``max_sequence_length`` too, but that is the context they were trained
on, not a limit their code enforces (the rotary angles of any position are computed): they get no
``max_length``, and a longer input runs, extrapolated as the model's own code would run it.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from daca_kernels.models import families
from daca_kernels.models.families import HIDDEN_SOURCES
from daca_kernels.models.model_loading import repair_buffers
from daca_kernels.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bool,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
)

HiddenFn = Callable[[Tensor, "Tensor | None"], Tensor]
KeepHiddenFn = Callable[[Tensor, Tensor, Tensor], Tensor]

# Attribute paths of prediction-head transforms applied between the backbone and the projection.
_HEAD_TRANSFORMS = ("head", "cls.predictions.transform")


def check_attention(attention) -> int | None:
    """``attention`` must be ``"full"`` (returns None) or ``("block", size)`` with an int ``size >= 1``
    (returns the size); a ValueError naming ``attention`` otherwise."""
    if attention == "full":
        return None
    if not (isinstance(attention, tuple) and len(attention) == 2 and attention[0] == "block"
            and isinstance(attention[1], int) and not isinstance(attention[1], bool) and attention[1] >= 1):
        raise ValueError(f"attention must be 'full' or ('block', size) with an int size >= 1, got {attention!r}")
    return attention[1]


def leading_columns(attention_mask: Tensor) -> Tensor:
    """int64 ``[B]``: the columns before each row's first attended position of a ``[B, L]`` mask (nonzero =
    attend): the row's left padding (``L`` for a row with no attended position)."""
    return ((attention_mask != 0).long().cumsum(1) == 0).sum(1)


def block_index(block_size: int, attention_mask: Tensor | None, batch: int, length: int,
                device: torch.device | None = None) -> Tensor:
    """int64 ``[B, L]``: the block of each column under the block rule of a padded row (module docstring).

    Column ``i`` of row ``b`` lies in block ``(i - first_b) // block_size`` (floor division), ``first_b``
    the row's first attended column of ``attention_mask`` (``[B, L]``, nonzero = attend; None: 0 for every
    row). Block 0 starts at the row's first token; left padding lies in negative blocks.
    """
    columns = torch.arange(length, device=device)
    if attention_mask is None:
        return (columns // block_size).expand(batch, length)
    first = leading_columns(attention_mask).to(columns.device)
    return torch.div(columns[None, :] - first[:, None], block_size, rounding_mode="floor")


def _aligning_columns(first: Tensor, size: int, length: int) -> tuple[Tensor, int] | None:
    """Where each row's columns go when it is moved right by ``(-first) mod size`` so that its first token
    starts a block of the widened input: ``(column long [B, L], width)``, or None when no row moves."""
    extra = -first % size
    if not bool(extra.any()):
        return None
    column = extra[:, None] + torch.arange(length, device=first.device)[None, :]
    return column, length + int(extra.max())


def _widen(values: Tensor, column: Tensor, width: int) -> Tensor:
    """``values [B, L]`` at ``column`` of a zero ``[B, width]`` tensor."""
    return values.new_zeros(values.shape[0], width).scatter(1, column, values)


def _narrow(states: Tensor, column: Tensor) -> Tensor:
    """The rows ``[B, L, H]`` of widened ``states [B, W, H]`` at ``column``."""
    return states.gather(1, column[:, :, None].expand(*column.shape, states.shape[-1]))


class MaskedLM:
    """A masked diffusion LM seen as ``hidden(input_ids, attention_mask) -> [B, L, H]`` plus a head
    (and, for block-causal models, [`block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden] and optionally
    [`hidden_with_keep`][daca_kernels.models.masked_lm.MaskedLM.hidden_with_keep]).

    Args:
        hidden_fn: a callable mapping long ``[B, L]`` ids (and an optional ``[B, L]`` attention
            mask, 1 = attend) to the ``[B, L, H]`` hidden states the head reads.
        head_weight: floating ``[V, H]`` LM-head weight with ``V >= 1`` (may be tied to the input
            embeddings).
        head_bias: ``[V]`` in the dtype and on the device of ``head_weight``, or None.
        mask_id: the ``[MASK]`` token id, an int in ``[0, V)``.
        shift: a bool; True for the Dream / DiffuCoder convention: the hidden state at ``i - 1``
            predicts token ``i``.
        module: the ``nn.Module`` owning the parameters (for ``parameters()``, ``train()``, ...),
            or None.
        attention: ``"full"`` (bidirectional) or ``("block", size)`` (block-causal: position ``q``
            sees key ``k`` iff ``k`` lies in ``q``'s block or an earlier one). ``hidden_fn`` counts
            blocks from column 0 of its input; [`hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden] and everything built on it
            count them
            from each row's first attended position (module docstring), moving a padded row right
            when it must. The estimators score a block model block by block
            ([`block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden]).
        hidden_with_keep_fn: block-causal models only, or None: a callable mapping long ``[B, N]``
            ids, long ``[B, N]`` position ids and a bool ``[B, N, N]`` attention matrix (``keep[b, q,
            k]``: query ``q`` attends to key ``k``) to the ``[B, N, H]`` hidden states, the backbone
            using exactly that matrix and those positions (see
            [`hidden_with_keep`][daca_kernels.models.masked_lm.MaskedLM.hidden_with_keep]).
        max_length: the longest input the model accepts, an int >= 1 (the ``L`` of ``[B, L]`` ids),
            or None (no limit). The sampler (``P + G``), the estimators (``L``) and the trainer
            refuse a longer input by name instead of failing inside the model.
            [`from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] sets it
            for a model with learned absolute position embeddings (module docstring).
        mask_form: how ``hidden_fn`` passes padding to the model (a key of
            [`daca_kernels.models.families.MASK_FORMS`][daca_kernels.models.families.MASK_FORMS];
            [`from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] sets it), or None when unknown.
        family: the [`Family`][daca_kernels.models.families.Family] record of ``module``'s family
            ([`from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] sets it; the block sampler reads its KV-cache protocol there),
            or None (a
            model built by hand: no family protocol is used).

    A wrong type or dtype is a TypeError, a wrong shape, value or device a ValueError, each naming
    the argument.
    """

    def __init__(
        self,
        hidden_fn: HiddenFn,
        head_weight: Tensor,
        head_bias: Tensor | None,
        mask_id: int,
        *,
        shift: bool = False,
        module: nn.Module | None = None,
        attention: str | tuple[str, int] = "full",
        hidden_with_keep_fn: KeepHiddenFn | None = None,
        max_length: int | None = None,
        mask_form: str | None = None,
        family: families.Family | None = None,
    ):
        if not callable(hidden_fn):
            raise TypeError(f"hidden_fn must be callable, got {type(hidden_fn).__name__}")
        check_tensor(head_weight, "head_weight", ndim=2, dtypes=FLOAT_DTYPES)
        vocab = head_weight.shape[0]
        if vocab == 0:
            raise ValueError(f"head_weight must have at least one row (V >= 1), got shape {tuple(head_weight.shape)}")
        if head_bias is not None:
            check_tensor(head_bias, "head_bias", dtypes=(head_weight.dtype,))
            check_shape(head_bias, "head_bias", (vocab,), "[V] (from head_weight)")
            check_same_device(head_weight, "head_weight", head_bias=head_bias)
        check_int(mask_id, "mask_id", low=0, high=vocab)
        check_bool(shift, "shift")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module or None, got {type(module).__name__}")
        check_attention(attention)
        if hidden_with_keep_fn is not None:
            if not callable(hidden_with_keep_fn):
                raise TypeError(f"hidden_with_keep_fn must be callable or None, got {type(hidden_with_keep_fn).__name__}")
            if attention == "full":
                raise ValueError("hidden_with_keep_fn is for block-causal models (attention=('block', size)); "
                                 "a bidirectional model is scored with hidden_fn alone")
        if max_length is not None:
            check_int(max_length, "max_length", low=1)
        if mask_form is not None and mask_form not in families.MASK_FORMS:
            raise ValueError(f"mask_form must be one of {', '.join(families.MASK_FORMS)} or None, got {mask_form!r}")
        if family is not None and not isinstance(family, families.Family):
            raise TypeError(f"family must be a Family record or None, got {type(family).__name__}")
        self._hidden_fn = hidden_fn
        self._hidden_with_keep_fn = hidden_with_keep_fn
        self.head_weight = head_weight
        self.head_bias = head_bias
        self.mask_id = mask_id
        self.shift = shift
        self.module = module
        self.attention = attention
        self.max_length = max_length
        self.mask_form = mask_form
        self.family = family

    @property
    def vocab_size(self) -> int:
        return self.head_weight.shape[0]

    @property
    def block_size(self) -> int | None:
        """The block size of a block-causal model, None for a bidirectional one."""
        return None if self.attention == "full" else self.attention[1]

    @property
    def hidden_fn(self) -> HiddenFn:
        """The callable this model was built from (a block model's ``hidden_fn`` counts blocks from column
        0 of its input; [`hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden] counts them from each row's first attended position)."""
        return self._hidden_fn

    @property
    def has_hidden_with_keep(self) -> bool:
        """Whether [`hidden_with_keep`][daca_kernels.models.masked_lm.MaskedLM.hidden_with_keep] is available (block models built with
        it)."""
        return self._hidden_with_keep_fn is not None

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    def hidden(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Hidden states ``[B, L, H]`` the head reads (no logits are computed).

        Args:
            input_ids: int64/int32 ``[B, L]``.
            attention_mask: ``[B, L]`` (nonzero = attend) or None.

        A bidirectional model: ``hidden_fn(input_ids, attention_mask)``. A block model: each row's blocks
        and position ids counted from its first attended position (module docstring), so a left-padded
        row gets the states of the row alone: with [`hidden_with_keep`][daca_kernels.models.masked_lm.MaskedLM.hidden_with_keep], one
        forward with position
        ids ``0, 1, ...`` from each row's first token and the block-causal matrix of those positions
        (padding keys hidden); without, one forward of ``hidden_fn`` with each row moved right by
        ``(-first) mod size`` columns, so that its first token starts a block (``hidden_fn``'s own
        position ids then count the padding). A batch without padding is ``hidden_fn``'s call as is.
        Differentiable through the model.
        """
        size = self.block_size
        if size is None or attention_mask is None:
            return self._hidden_fn(input_ids, attention_mask)
        check_tensor(attention_mask, "attention_mask", ndim=2)
        check_shape(attention_mask, "attention_mask", input_ids.shape, "[B, L] (from input_ids)")
        first = leading_columns(attention_mask)
        if not bool(first.any()):
            return self._hidden_fn(input_ids, attention_mask)
        batch, length = input_ids.shape
        device = input_ids.device
        if self.has_hidden_with_keep:
            positions = (torch.arange(length, device=device)[None, :] - first[:, None]).clamp(min=0)
            block = block_index(size, attention_mask, batch, length, device)
            keep = (block[:, None, :] <= block[:, :, None]) & (attention_mask != 0)[:, None, :]
            return self.hidden_with_keep(input_ids, positions, keep | torch.eye(length, dtype=torch.bool, device=device))
        aligning = _aligning_columns(first, size, length)
        if aligning is None:
            return self._hidden_fn(input_ids, attention_mask)
        column, width = aligning
        return _narrow(self._hidden_fn(_widen(input_ids, column, width), _widen(attention_mask, column, width)), column)

    def hidden_with_keep(self, input_ids: Tensor, position_ids: Tensor, keep: Tensor) -> Tensor:
        """Hidden states ``[B, N, H]`` of the backbone run on ``input_ids`` with ``position_ids`` and the
        attention matrix ``keep`` instead of the block rule and the padding mask.

        Args:
            input_ids: int64/int32 ``[B, N]`` ids in ``[0, V)``.
            position_ids: int64 ``[B, N]``, the rotary position of each input position (repeats allowed:
                the noisy/clean layout gives both halves ``0 .. L-1``).
            keep: bool ``[B, N, N]``: ``keep[b, q, k]`` True when query ``q`` attends to key ``k``; every
                query must keep at least one key (itself, say): an attention row without a key is NaN.

        A ValueError when the model has none (``has_hidden_with_keep`` False) or the shapes disagree, a
        TypeError for a wrong dtype, each naming the argument.
        """
        if self._hidden_with_keep_fn is None:
            raise ValueError("lm: this MaskedLM has no hidden_with_keep (a block-causal model from MaskedLM.from_hf "
                             "of SDAR / TraDo or LLaDA2 has one)")
        check_tensor(input_ids, "input_ids", ndim=2, dtypes=INDEX_DTYPES)
        check_tensor(position_ids, "position_ids", ndim=2, dtypes=(torch.int64,))
        check_shape(position_ids, "position_ids", input_ids.shape, "[B, N] (from input_ids)")
        check_tensor(keep, "keep", ndim=3, dtypes=(torch.bool,))
        batch, length = input_ids.shape
        check_shape(keep, "keep", (batch, length, length), "[B, N, N] (from input_ids)")
        check_same_device(input_ids, "input_ids", position_ids=position_ids, keep=keep)
        if length and not bool(keep.any(-1).all()):
            raise ValueError("keep must keep at least one key for every query (keep.any(-1) all True)")
        return self._hidden_with_keep_fn(input_ids, position_ids, keep)

    def aligned_hidden(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """[`hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden] (which counts a padded row's blocks from its first token): the
        name under which
        earlier releases offered that partition beside a ``hidden`` that counted from column 0."""
        return self.hidden(input_ids, attention_mask)

    def block_hidden(self, noisy_ids: Tensor, clean_ids: Tensor, attention_mask: Tensor | None = None, *,
                     needed: Tensor | None = None) -> Tensor:
        """Block-causal models: the states ``[B, L, H]`` of ``noisy_ids`` with every block conditioned on
        the *clean* blocks before it.

        Position ``i`` of block ``c`` gets the state it has on the input ``[clean_ids before block c,
        noisy_ids in block c]`` (blocks after ``c`` never matter under block-causal attention):
        ``log p(y_c | y_<c)`` of a block-diffusion model is a masked-diffusion problem on block ``c``
        whose context is the clean earlier blocks. Blocks and position ids are counted from each row's
        first attended position (module docstring, [`block_index`][daca_kernels.models.masked_lm.block_index]), as
        [`hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden] counts them.

        With [`hidden_with_keep`][daca_kernels.models.masked_lm.MaskedLM.hidden_with_keep] all blocks come from ONE forward pass of the
        noisy/clean layout
        of block-diffusion training: input ``[noisy_ids ; clean_ids]`` (``2L``), the row's position ids
        in both halves, noisy block ``c`` attending to itself and to the clean blocks before ``c``, the
        clean half block-causal within itself, padding keys (``attention_mask == 0``) hidden from every
        query but themselves ([`noisy_clean_layout`][daca_kernels.models.masked_lm.noisy_clean_layout]). Without it, one forward pass
        of ``hidden_fn``
        per block, each row moved right to start a block as [`hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden] moves it.

        Args:
            noisy_ids: int64/int32 ``[B, L]`` ids in ``[0, V)``: the noisy sequence.
            clean_ids: int64/int32 ``[B, L]`` ids in ``[0, V)``: the clean sequence.
            attention_mask: ``[B, L]`` (1 = attend) or None.
            needed: bool ``[B, L]`` or None (all): the positions whose states the caller reads; the
                per-block path runs only the blocks and rows holding one (other states are then 0).

        Returns ``[B, L, H]``, differentiable through the model. A ValueError for a bidirectional model
        or mismatched shapes (naming the argument).
        """
        if self.block_size is None:
            raise ValueError("lm: block_hidden is for block-causal models; this one has full attention")
        check_tensor(noisy_ids, "noisy_ids", ndim=2, dtypes=INDEX_DTYPES)
        check_tensor(clean_ids, "clean_ids", ndim=2, dtypes=INDEX_DTYPES)
        check_shape(clean_ids, "clean_ids", noisy_ids.shape, "[B, L] (from noisy_ids)")
        batch, length = noisy_ids.shape
        if attention_mask is not None:
            check_tensor(attention_mask, "attention_mask", ndim=2)
            check_shape(attention_mask, "attention_mask", noisy_ids.shape, "[B, L] (from noisy_ids)")
        if needed is not None:
            check_tensor(needed, "needed", ndim=2, dtypes=(torch.bool,))
            check_shape(needed, "needed", noisy_ids.shape, "[B, L] (from noisy_ids)")
        check_same_device(noisy_ids, "noisy_ids", clean_ids=clean_ids, attention_mask=attention_mask, needed=needed)
        size = self.block_size
        if self.has_hidden_with_keep:
            positions, keep = noisy_clean_layout(size, attention_mask, batch, length, noisy_ids.device)
            return self.hidden_with_keep(torch.cat([noisy_ids, clean_ids], dim=1), positions, keep)[:, :length]
        if needed is None:
            needed = torch.ones(noisy_ids.shape, dtype=torch.bool, device=noisy_ids.device)
        aligning = None
        if attention_mask is not None:
            aligning = _aligning_columns(leading_columns(attention_mask), size, length)
        if aligning is None:
            return self._block_hidden_per_block(noisy_ids, clean_ids, attention_mask, needed)
        column, width = aligning
        states = self._block_hidden_per_block(_widen(noisy_ids, column, width), _widen(clean_ids, column, width),
                                              _widen(attention_mask, column, width), _widen(needed, column, width))
        return _narrow(states, column)

    def _block_hidden_per_block(self, noisy_ids: Tensor, clean_ids: Tensor, attention_mask: Tensor | None,
                                needed: Tensor) -> Tensor:
        """[`block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden] by one ``hidden_fn`` call per block, on rows whose
        first tokens start a block
        (so that ``hidden_fn``'s blocks, counted from column 0, are the rows' own)."""
        batch, length = noisy_ids.shape
        size = self.block_size
        out = None
        for start in range(0, length, size):
            end = min(start + size, length)
            rows = needed[:, start:end].any(1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            ids = torch.cat([clean_ids[rows, :start], noisy_ids[rows, start:end]], dim=1)
            states = self._hidden_fn(ids, None if attention_mask is None else attention_mask[rows, :end])[:, start:]
            if out is None:
                out = states.new_zeros(batch, length, states.shape[-1])
            cols = torch.arange(start, end, device=rows.device)
            out = out.index_put((rows[:, None], cols[None, :]), states)
        return self.head_weight.new_zeros(batch, length, self.head_weight.shape[1]) if out is None else out

    def logits(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Full ``[B, L, V]`` logits, for references and tests (the estimators never call this)."""
        out = self.hidden(input_ids, attention_mask) @ self.head_weight.T
        return out if self.head_bias is None else out + self.head_bias

    def parameters(self):
        if self.module is None:
            raise ValueError("this MaskedLM was built without a module")
        return self.module.parameters()

    @classmethod
    def from_hf(cls, model: nn.Module, *, mask_id: int | None = None, shift: bool | None = None,
                verify: bool = True, hidden_from: str | None = None,
                block_size: int | None = None, mask_form: str | None = None) -> "MaskedLM":
        """Wrap a transformers model or a released model family's remote code (module docstring).

        Args:
            model: a transformers ``*ForCausalLM`` / ``*ForMaskedLM`` model or the released model of a
                family [`daca_kernels.models.families`][daca_kernels.models.families] recognises (LLaDA, LLaDA-MoE, Dream / DiffuCoder,
                SDAR / TraDo, LLaDA2). Decoder-style transformers models must be built bidirectional
                (``LlamaConfig(..., is_causal=False)``).
            mask_id: the ``[MASK]`` id; None reads ``config.mask_token_id`` (then the generation
                config's, then the family's released id); a ValueError naming ``mask_id`` when none is
                found or it lies outside the vocabulary.
            shift: None takes the family's convention (True for Dream / DiffuCoder, False otherwise);
                an explicit value that contradicts a known family's is a ValueError.
            verify: check at construction, once, on short random inputs: that ``hidden @ W.T + b``
                reproduces ``model(...).logits``; for full attention without ``mask_form``, which form
                of attention mask hides a left-padded row's padding (the family's recorded form first,
                then the others of [`MASK_FORMS`][daca_kernels.models.families.MASK_FORMS] in order, ``"none"``
                last, since it serves any model: the first under which the row's states equal those of the row alone, unchanged
                by its padding tokens and finite, is used, and remembered for the model's class); that
                a left-padded row's states do not depend on its padding (and, for full attention,
                equal the row alone); and the attention
                structure: bidirectional (a later token changes an earlier position's state; a causal
                model is refused) or block-causal by the block rule, and for block models that
                ``hidden_with_keep`` on the noisy/clean layout of a clean probe gives ``hidden`` in
                both halves (so the backbone honours the matrix and the position ids). Non-persistent buffers left
                uninitialised by ``from_pretrained`` are repaired first
                ([`daca_kernels.models.model_loading.repair_buffers`][daca_kernels.models.model_loading.repair_buffers]).
                ``verify=False`` does none of it
                (for re-wrapping an already checked model every step) and uses ``mask_form``, else the
                form last found for the model's class, else the family's recorded form (for LLaDA and
                LLaDA-MoE ``"none"``, right for every release; Dream ``"4d-bool"``; other models
                ``"2d"``).
            hidden_from: ``"last_hidden_state"`` or ``"hidden_states"`` (the last entry of the
                backbone's ``hidden_states``, asked for with ``output_hidden_states=True``, for
                backbones that return logits; for LLaDA-8B the call stops at the final norm that
                produces it, so its logits are never computed); None takes the family's
                (``"hidden_states"`` for LLaDA-8B, ``"last_hidden_state"`` otherwise).
            block_size: block-causal families only: the block size, None for ``config.block_size``
                (LLaDA2: 32, its ``generate``'s default, when the config has none).
            mask_form: full attention only: the form in which the padding mask reaches the model (a key
                of [`MASK_FORMS`][daca_kernels.models.families.MASK_FORMS]), None to find it (``verify``). A model
                for which no form serves is a ValueError that lists what each form did.

        The result's ``mask_form`` says which form it uses (None for a block-causal model); its
        ``attention`` is ``"full"`` or ``("block", block_size)``; block models of SDAR / TraDo and
        LLaDA2 carry ``hidden_with_keep``; ``max_length`` is the rows of a learned absolute position
        table, None for a rotary model (module docstring); ``family`` is the recognised family's record.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a transformers model (an nn.Module), got {type(model).__name__}")
        check_bool(verify, "verify")
        if shift is not None:
            check_bool(shift, "shift")
        if hidden_from is not None and hidden_from not in HIDDEN_SOURCES:
            raise ValueError(f"hidden_from must be one of {', '.join(HIDDEN_SOURCES)}, got {hidden_from!r}")
        family = families.recognise(model)
        backbone = getattr(model, "base_model", None)
        projection = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if backbone is None or backbone is model or projection is None:
            raise ValueError("model must be a transformers model with an LM head (get_output_embeddings() and base_model)")
        weight = getattr(projection, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"the output embeddings ({type(projection).__name__}) have no [V, H] weight")
        if family.shift is not None and shift is not None and shift != family.shift:
            raise ValueError(
                f"shift: {family.title} models predict token i from position {'i - 1' if family.shift else 'i'} "
                f"(shift={family.shift}); got shift={shift}"
            )
        shift = family.shift if shift is None else shift
        attention = _attention(model, family, block_size)
        if mask_form is not None and not isinstance(mask_form, str):
            raise TypeError(f"mask_form must be a str or None, got {type(mask_form).__name__}")
        if mask_form is not None and (attention != "full" or mask_form not in families.MASK_FORMS):
            raise ValueError(f"mask_form: one of {', '.join(families.MASK_FORMS)} for a full-attention model, "
                             f"got {mask_form!r}" + ("" if attention == "full" else
                                                     f" ({family.title} is block-causal: its mask form is fixed)"))
        transform = _head_transform(model, projection) if family is families.GENERIC else None
        source = hidden_from or family.hidden_from
        mask_id = _mask_id(model, family, mask_id, weight.shape[0])

        def build(form: str | None) -> MaskedLM:
            block = None if attention == "full" else attention[1]
            hidden_fn = families.backbone_fn(family, backbone, source, block, transform, form)
            keep_fn = None if block is None else families.keep_backbone_fn(family, backbone, source, transform)
            return cls(hidden_fn, weight, getattr(projection, "bias", None), mask_id, shift=bool(shift),
                       module=model, attention=attention, hidden_with_keep_fn=keep_fn, mask_form=form,
                       max_length=_position_limit(backbone), family=family)

        form = None if family.block else mask_form or _FOUND_FORMS.get(type(model), family.mask_form)
        lm = build(form)
        if verify:
            repair_buffers(model)
            search = attention == "full" and mask_form is None
            lm = _verify(model, lm, family, (lambda: _find_mask_form(model, build, family)) if search else None)
        return lm


def noisy_clean_layout(block_size: int, attention_mask: Tensor | None, batch: int, length: int,
                       device: torch.device) -> tuple[Tensor, Tensor]:
    """The noisy/clean layout of block-diffusion training for an input ``[noisy ; clean]`` of ``2L``.

    Returns ``(position_ids int64 [B, 2L], keep bool [B, 2L, 2L])``. Blocks and positions are each row's
    own, counted from its first attended column of ``attention_mask`` (``[B, L]`` or None;
    [`block_index`][daca_kernels.models.masked_lm.block_index]), the same in both halves; a noisy query of block ``c`` keeps the noisy
    keys of
    block ``c`` and the clean keys of the blocks before ``c``; a clean query keeps the clean keys of its
    block and the blocks before (never a noisy key); keys where ``attention_mask`` is 0 are dropped in
    both halves; every query keeps itself (a padding query whose keys are all dropped would be NaN, and
    NaN reaches real rows through the next layer's ``0 * NaN``). Without ``attention_mask`` ``keep`` is
    an expanded view of one ``[2L, 2L]`` matrix.
    """
    columns = torch.arange(length, device=device)
    if attention_mask is None:
        block = (columns // block_size)[None, :]
        positions = columns[None, :]
    else:
        block = block_index(block_size, attention_mask, batch, length, device)
        positions = (columns[None, :] - leading_columns(attention_mask)[:, None]).clamp(min=0)
    same = block[:, :, None] == block[:, None, :]
    before = block[:, None, :] < block[:, :, None]
    keep = torch.cat([torch.cat([same, before], dim=2),
                      torch.cat([torch.zeros_like(same), same | before], dim=2)], dim=1)
    keep = keep.expand(batch, 2 * length, 2 * length)  # a view when every row shares one partition
    if attention_mask is not None:
        keys = (attention_mask != 0).repeat(1, 2)
        keep = (keep & keys[:, None, :]) | torch.eye(2 * length, dtype=torch.bool, device=device)
    return positions.repeat(1, 2).expand(batch, 2 * length), keep


# The mask form found by the construction check for each model class (a property of the class's code),
# used by later ``from_hf(..., verify=False)`` calls on models of that class.
_FOUND_FORMS: "weakref.WeakKeyDictionary[type, str]" = weakref.WeakKeyDictionary()


def _find_mask_form(model: nn.Module, build: Callable[[str], MaskedLM], family: families.Family) -> MaskedLM:
    """The first form (``family.mask_form``, then [`families.MASK_FORMS`][daca_kernels.models.families.MASK_FORMS] in order, ``"none"``
    last: it serves any model, more slowly) under which a left-padded row's states are finite,
    unchanged by its padding tokens and equal to the row alone: the MaskedLM using it. The form is
    remembered for ``model``'s class."""
    masks = [f for f in (family.mask_form, *families.MASK_FORMS) if f != "none"]
    tried = []
    for form in dict.fromkeys((*masks, "none")):
        lm = build(form)
        failure = _padding_failure(lm)
        if failure is None:
            _FOUND_FORMS[type(model)] = form
            return lm
        tried.append(f"{form} ({families.MASK_FORMS[form]}): {failure}")
    raise ValueError(f"model: {type(model).__name__}: no form of attention mask serves a left-padded batch "
                     f"(full attention); tried {'; '.join(tried)}")


def _padding_failure(lm: MaskedLM) -> str | None:
    """What goes wrong with a left-padded probe row under ``lm`` (None if nothing): the call fails, its
    states are not finite, change with the padding tokens or differ from the row alone."""
    ids, mask, pad = _padded_probe(lm, 8)
    repadded = ids.clone()
    repadded[1, :pad] = (ids[1, :pad] + 1) % lm.vocab_size
    try:
        states = lm.hidden(ids, mask).float()
        again = lm.hidden(repadded, mask).float()[1, pad:]
    except Exception as error:  # any failure of the model's own code under this form rules the form out
        return f"{type(error).__name__}: {error}"
    if not bool(torch.isfinite(states[:, pad:]).all()):
        return "non-finite states"
    equal = _tolerances(lm)[0] * (1 + states[:, pad:].abs().max().item())
    if (again - states[1, pad:]).abs().max() > equal:
        return "the row's states change with its padding tokens"
    try:
        alone = lm.hidden(ids[1:, pad:]).float()[0]
    except Exception as error:
        return f"the row alone: {type(error).__name__}: {error}"
    if (alone - states[1, pad:]).abs().max() > equal:
        return "the row's states differ from those of the row alone"
    return None


def _padded_probe(lm: MaskedLM, length: int) -> tuple[Tensor, Tensor, int]:
    """Two random rows of ``length`` (``length != 2``: a 2-D mask must not broadcast against the
    ``[L, L]`` scores) and a mask left-padding row 1 by 3; returns ``(ids, mask, 3)``."""
    ids = _probe(lm, 2, length, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask, 3


def _attention(model: nn.Module, family: families.Family, block_size) -> str | tuple[str, int]:
    if not family.block:
        if block_size is not None:
            raise ValueError(f"block_size: {type(model).__name__} has full attention; block_size is for "
                             "block-causal models (SDAR, LLaDA2)")
        return "full"
    if block_size is None:
        block_size = getattr(model.config, "block_size", None) or family.default_block_size
    if block_size is None:
        raise ValueError(f"block_size: {family.title} is block-causal and its config has no block_size; "
                         "pass block_size")
    return ("block", check_int(block_size, "block_size", low=1))


def _mask_id(model: nn.Module, family: families.Family, mask_id, vocab: int) -> int:
    if mask_id is not None:
        return mask_id
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        found = getattr(config, "mask_token_id", None)
        if isinstance(found, int) and not isinstance(found, bool):
            return found
    if family.default_mask_id is not None:
        if family.default_mask_id < vocab:
            return family.default_mask_id
        raise ValueError(
            f"mask_id: {family.title}'s config has no mask_token_id and the released checkpoints' mask id "
            f"{family.default_mask_id} is outside this model's vocabulary of {vocab} ids; pass mask_id"
        )
    raise ValueError(f"mask_id: {type(model).__name__}'s config has no mask_token_id; pass mask_id")


# Attribute names of learned absolute position tables (BERT, RoBERTa, ELECTRA, DistilBERT: position_embeddings;
# GPT-2: wpe). Rotary backbones have none.
_POSITION_TABLES = ("position_embeddings", "wpe")


def _position_limit(backbone: nn.Module) -> int | None:
    """The longest input a backbone with a learned absolute position table accepts (the table's
    ``config.max_position_embeddings`` rows, less RoBERTa's offset: its positions start after the
    table's ``padding_idx``), None for a backbone without one."""
    limits = [module.num_embeddings - (0 if module.padding_idx is None else module.padding_idx + 1)
              for name, module in backbone.named_modules()
              if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES]
    return min(limits) if limits else None


def _head_transform(model: nn.Module, projection: nn.Module) -> nn.Module | None:
    """The module between the backbone output and the output projection, if the model has one."""
    for path in _HEAD_TRANSFORMS:
        module = families.find_submodule(model, path)
        if module is not None and module is not projection and module is not model.base_model:
            return module
    return None


# Relative tolerances of the construction checks (of the states' largest magnitude). Equality: the
# same computation in another batch layout rounds differently, by far less than 1e-3 in float32 and
# 5e-2 in half precision. Dependence: a masked-out key contributes exactly nothing, while a token a
# position attends to moves its state by orders of magnitude more than 1e-5 (1e-4 in half precision).
def _tolerances(lm: MaskedLM) -> tuple[float, float]:
    full = lm.head_weight.dtype in (torch.float32, torch.float64)
    return (1e-3, 1e-5) if full else (5e-2, 1e-4)


def _verify(model: nn.Module, lm: MaskedLM, family: families.Family,
            find_form: Callable[[], MaskedLM] | None) -> MaskedLM:
    """The construction checks, in eval mode without gradients; ``find_form`` (or None) replaces ``lm``
    by the one with the mask form found, between the logits check and the structure checks."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _verify_logits(model, lm, family)
            if find_form is not None:
                lm = find_form()
            _verify_structure(model, lm, family)
    finally:
        model.train(was_training)
    return lm


def _probe(lm: MaskedLM, batch: int, length: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, lm.vocab_size, (batch, length), generator=g).to(lm.device)


def _verify_logits(model: nn.Module, lm: MaskedLM, family: families.Family) -> None:
    block = None if lm.attention == "full" else lm.attention[1]
    probe = _probe(lm, 1, 8, 0)
    kwargs = family.call_kwargs(probe, None, block, families.param_dtype(model))
    try:
        expected = model(input_ids=probe, **kwargs).logits.float()
    except Exception as error:
        raise ValueError(f"model: {type(model).__name__}(input_ids, {', '.join(f'{k}=...' for k in kwargs)}) failed "
                         f"on an unpadded probe: {type(error).__name__}: {error}") from error
    got = lm.logits(probe).float()
    tol = _tolerances(lm)[0]
    atol = tol * (1 + expected.abs().max().item())
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=atol, rtol=0):
        raise ValueError(
            f"{type(model).__name__}: hidden @ head.T + bias does not reproduce model(...).logits; "
            "the architecture post-processes its logits and is not supported by MaskedLM.from_hf"
        )


def _verify_structure(model: nn.Module, lm: MaskedLM, family: families.Family) -> None:
    """Run with a left-padded batch: padding is hidden, and the attention is what ``lm.attention`` says."""
    name = type(model).__name__
    form = families.MASK_FORMS.get(lm.mask_form, family.mask_form)
    block = None if lm.attention == "full" else lm.attention[1]
    length, pad = (8, 3) if block is None else (2 * block + 2, min(3, block))
    ids = _probe(lm, 2, length, 1)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    try:
        states = lm.hidden_fn(ids, mask).float()
    except Exception as error:
        raise ValueError(f"model: {name} failed on a left-padded batch with its attention mask passed as {form}: "
                         f"{type(error).__name__}: {error}") from error
    equal, moved = (t * (1 + states[:, pad:].abs().max().item()) for t in _tolerances(lm))

    def differ(a: Tensor, b: Tensor) -> Tensor:
        return (a.float() - b.float()).abs().amax(dim=-1)

    repadded = ids.clone()
    repadded[1, :pad] = (ids[1, :pad] + 1) % lm.vocab_size
    if differ(lm.hidden_fn(repadded, mask)[1, pad:], states[1, pad:]).max() > equal:
        raise ValueError(f"model: {name}: a left-padded row's hidden states change with its padding tokens: the "
                         f"attention mask passed as {form} does not hide the padding")
    if block is None and differ(lm.hidden_fn(ids[1:, pad:], None)[0], states[1, pad:]).max() > equal:
        raise ValueError(f"model: {name}: a left-padded row's hidden states differ from those of the row alone "
                         f"(attention mask passed as {form})")
    if block is None:
        changed = ids.clone()
        changed[:, -1] = (ids[:, -1] + 1) % lm.vocab_size
        delta = differ(lm.hidden_fn(changed, mask), states)
        if delta[0, 0] <= moved or delta[1, pad] <= moved:
            raise ValueError(
                f"model: {name} is causal: the hidden state of a row's first position does not change when its "
                "last token does. The estimators assume a bidirectional model (build a transformers decoder "
                "with is_causal=False, which needs a transformers version that honours it)"
            )
        return
    later = block + 1
    changed = ids.clone()
    changed[0, later] = (ids[0, later] + 1) % lm.vocab_size
    delta = differ(lm.hidden_fn(changed, mask)[0], states[0])
    if delta[:block].max() > moved:
        raise ValueError(f"model: {name} is not block-causal with block size {block}: a position of an earlier block "
                         f"sees a later token (attention mask passed as {form})")
    if delta[block] <= moved or delta[-1] <= moved:
        raise ValueError(f"model: {name} does not attend within and after a block of size {block}: an earlier "
                         f"position of the token's block or a later block does not see it (attention mask passed "
                         f"as {form})")
    if lm.has_hidden_with_keep:
        # A clean probe in both halves of the noisy/clean layout must give hidden() in both: noisy queries
        # read clean keys of the other half, so wrong position ids or an ignored matrix show. hidden() itself
        # (each row's blocks from its first token) must give the family's own call on the unpadded row 0
        # and, on the padded row 1, that call on the row alone.
        positions, keep = noisy_clean_layout(block, mask, 2, length, ids.device)
        both = lm.hidden_with_keep(ids.repeat(1, 2), positions, keep).float()
        aligned = lm.hidden(ids, mask).float()
        real = mask.bool().repeat(1, 2)
        if (differ(both, aligned.repeat(1, 2, 1))[real].max() > equal or differ(aligned[0], states[0]).max() > equal
                or differ(aligned[1, pad:], lm.hidden_fn(ids[1:, pad:], None)[0]).max() > equal):
            raise ValueError(f"model: {name} does not honour the 4-D mask and position ids of the noisy/clean "
                             f"layout (hidden_with_keep): its states differ from the block-causal forward")
