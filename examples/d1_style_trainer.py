"""The library's ops dropped into someone else's trainer: a TRL ``GRPOTrainer`` subclass in the style of
d1's diffu-GRPO trainer.

d1 subclasses TRL's ``GRPOTrainer`` and overrides two things: generation (a masked diffusion
sampler instead of ``model.generate``) and the per-token log-probabilities (its one-step estimator:
every completion token masked, each prompt token masked with probability ``p_mask_prompt``, one
forward pass, then full ``[B, L, V]`` logits, ``log_softmax`` and a gather). ``D1StyleGRPOTrainer``
keeps that structure and replaces the pieces:

- generation: :func:`daca_kernels.rollout.generate` (LLaDA's low-confidence remasking, block by block);
- log-probabilities: the same one-step masking, but the backbone's hidden states of the completion
  rows go through :func:`daca_kernels.linear_logprob`, which never forms the ``[rows, V]`` logits at
  once (:func:`daca_kernels.one_step_logprob` is the same estimator as a library call, and
  :func:`daca_kernels.stratified_logprob` the stratified one).

Everything else (rewards, advantages, the clipped loss, logging) is TRL's. The masks of the
old-policy and current passes over the same batch are drawn from one seed that is a function of the
batch's tokens, so the importance ratio compares like with like (d1 draws a seed per inner
iteration). Runs on a CPU in seconds: ``python examples/d1_style_trainer.py``.
"""
from __future__ import annotations

import tempfile

import torch
from trl import GRPOConfig, GRPOTrainer

from daca_kernels import MaskedLM, linear_logprob
from daca_kernels.models import default_generation_config
from daca_kernels.rollout import generate


class D1StyleGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` for a masked diffusion LM, with d1's one-step log-probabilities computed
    through :func:`daca_kernels.linear_logprob`.

    Args:
        mask_id: the ``[MASK]`` id.
        diffusion_steps: denoising steps per completion (``args.max_completion_length`` tokens).
        block_length: LLaDA's semi-autoregressive block length (None: one block).
        p_mask_prompt: probability that a prompt token is masked in the likelihood pass (d1: 0.15).
    """

    def __init__(self, *args, mask_id: int, diffusion_steps: int, block_length: int | None = None,
                 p_mask_prompt: float = 0.15, **kwargs):
        self.mask_id, self.diffusion_steps, self.block_length = mask_id, diffusion_steps, block_length
        self.p_mask_prompt = p_mask_prompt
        model = kwargs.get("model")
        if isinstance(model, torch.nn.Module):
            default_generation_config(model)  # TRL reads one; a class that is not a GenerationMixin has none
        super().__init__(*args, **kwargs)

    def _lm(self, model) -> MaskedLM:
        # The backbone / head split of the (unwrapped) policy; checked once at the first call.
        checked = getattr(self, "_checked", False)
        self._checked = True
        return MaskedLM.from_hf(self.accelerator.unwrap_model(model), mask_id=self.mask_id, verify=not checked)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completions from the library's sampler: ``(completion ids per row up to the first EOS, None)``."""
        device = self.accelerator.device
        width = max(len(ids) for ids in prompt_ids)
        prompts = torch.zeros((len(prompt_ids), width), dtype=torch.long, device=device)  # prompt_mask hides the padding
        prompt_mask = torch.zeros(prompts.shape, dtype=torch.bool, device=device)
        for row, ids in enumerate(prompt_ids):  # left padding, as TRL pads prompts
            prompts[row, width - len(ids):] = torch.tensor(ids, device=device)
            prompt_mask[row, width - len(ids):] = True
        seed = self.args.seed * 1_000_003 + self.state.global_step
        with torch.no_grad():
            rollout = generate(self._lm(self.model), prompts, prompt_mask=prompt_mask,
                               gen_length=self.max_completion_length, steps=self.diffusion_steps,
                               block_length=self.block_length, temperature=self.temperature, seed=seed)
        completions = rollout.sequences[:, width:].tolist()
        eos = set(self.eos_token_ids)
        cut = [ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))] for ids in completions]
        return cut, None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """d1's one-step estimate of ``log pi(token)`` for the last ``logits_to_keep`` columns."""
        lm = self._lm(model)
        batch, length = input_ids.shape
        start = length - logits_to_keep
        seed = int((input_ids.long() * torch.arange(1, length + 1, device=input_ids.device)).sum().item()) % 2**31
        generator = torch.Generator().manual_seed(seed)
        noisy = input_ids.clone()
        noisy[:, start:] = self.mask_id  # every completion token masked
        prompt_masked = (torch.rand(batch, start, generator=generator) < self.p_mask_prompt).to(input_ids.device)
        noisy[:, :start] = noisy[:, :start].masked_fill(prompt_masked, self.mask_id)
        keys = attention_mask.clone()
        keys[:, start:] = 1  # the masked completion is visible to the model, the padding after EOS too
        with self.accelerator.autocast():
            hidden = lm.hidden(noisy, keys)
        # Dream-style models (shift=True) predict token i from position i - 1.
        rows = hidden[:, start - 1:-1] if lm.shift else hidden[:, start:]
        targets = input_ids[:, start:].reshape(-1)
        out = linear_logprob(rows.reshape(-1, rows.shape[-1]), lm.head_weight, targets, bias=lm.head_bias,
                             temperature=self.temperature, return_entropy=compute_entropy)
        logps, entropies = out if compute_entropy else (out, None)
        logps = logps.view(batch, logits_to_keep)
        return logps, None if entropies is None else entropies.view(batch, logits_to_keep), None


def main(output_dir: str | None = None, max_steps: int = 2) -> D1StyleGRPOTrainer:
    """Train ``max_steps`` steps on a tiny model (built in code) and a toy digit task; returns the trainer."""
    from datasets import Dataset
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from daca_kernels.models import BidirectionalConfig, BidirectionalLM

    symbols = ["[PAD]", "[MASK]", "[EOS]", "[BOS]", *"0123456789"]
    chars = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="[PAD]"))
    chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    chars.decoder = decoders.Fuse()
    chars.add_special_tokens(symbols[:4])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="[PAD]", mask_token="[MASK]",
                                        eos_token="[EOS]", bos_token="[BOS]")
    torch.manual_seed(0)
    model = BidirectionalLM(BidirectionalConfig(vocab_size=len(symbols), hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2, pad_token_id=0,
                                                eos_token_id=2, bos_token_id=3))
    dataset = Dataset.from_dict({"prompt": ["[BOS]3142", "[BOS]2713", "[BOS]905", "[BOS]6648"]})

    def even_digits(prompts, completions, **columns):  # TRL's reward signature
        return [sum(c in "02468" for c in text) / max(len(text), 1) for text in completions]

    with tempfile.TemporaryDirectory() as scratch:
        args = GRPOConfig(output_dir=output_dir or scratch, max_completion_length=4, num_generations=4,
                          per_device_train_batch_size=4, max_steps=max_steps, learning_rate=1e-2, temperature=1.0,
                          logging_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                          disable_tqdm=True)
        trainer = D1StyleGRPOTrainer(model=model, reward_funcs=[even_digits], args=args, train_dataset=dataset,
                                     processing_class=tokenizer, mask_id=tokenizer.mask_token_id, diffusion_steps=2,
                                     block_length=4)
        trainer.train()
    return trainer


if __name__ == "__main__":
    history = main().state.log_history
    print({k: v for k, v in history[-1].items() if k in ("loss", "reward", "train_loss")})
