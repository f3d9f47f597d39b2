"""Hub-style checkpoints of the released families on the task vocabulary of tests/trl_setup.py, for the
trainer and recipe conformance tests: the character tokenizer of ``sort_tokenizer`` drives them."""
from __future__ import annotations

from pathlib import Path

from integration.tasks import vocab
from released import hub

TASK_VOCAB = dict(vocab_size=vocab.size, mask_token_id=vocab.mask_id, eos_token_id=vocab.eos_id,
                  pad_token_id=vocab.pad_id)
# Settings that name the vocabulary in some families' configs only.
EXTRA_VOCAB = {"llada": dict(embedding_size=vocab.size), "llada_dllm": dict(embedding_size=vocab.size),
               "dream": dict(bos_token_id=vocab.bos_id), "dream_dllm": dict(bos_token_id=vocab.bos_id)}


def task_checkpoint(name: str, directory: Path | str, *, seed: int = 1, tokenizer: bool = False) -> Path:
    """:func:`hub.write_checkpoint` of ``name`` over the task vocabulary; with ``tokenizer``, the task's
    character tokenizer saved beside the weights (as a hub checkpoint holds its tokenizer)."""
    path = hub.write_checkpoint(name, directory, seed=seed, **TASK_VOCAB, **EXTRA_VOCAB.get(name, {}))
    if tokenizer:
        from tests.trl_setup import sort_tokenizer

        sort_tokenizer().save_pretrained(path)
    return path
