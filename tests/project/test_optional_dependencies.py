"""The core (ops, losses, estimators, sampler, DPS) imports and runs without transformers, TRL,
accelerate or datasets; the model adapters and the trainer name the extra to install."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A child interpreter in which the optional packages cannot be imported (as if not installed).
_WITHOUT_EXTRAS = textwrap.dedent('''
    import importlib.abc, sys
    ABSENT = ("transformers", "trl", "accelerate", "datasets")

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ABSENT:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Absent())

    import torch
    from torch import nn

    import daca_kernels
    from daca_kernels import MaskedLM, group_advantages, grpo_loss, linear_logprob, stratified_logprob
    from daca_kernels.credit import dps_weights
    from daca_kernels.rollout import generate

    torch.manual_seed(0)
    vocab, hidden = 11, 8
    embed, mix, head = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, vocab)

    def states(ids, attention_mask):  # every position sees the mean of the row: bidirectional
        x = embed(ids)
        return torch.tanh(x + mix(x.mean(1, keepdim=True)))

    lm = MaskedLM(states, head.weight, head.bias, vocab - 1)
    prompt = torch.randint(0, vocab - 1, (4, 3))
    rollout = generate(lm, prompt, gen_length=4, steps=2, seed=0, temperature=1.0)
    ids = rollout.sequences
    completion = torch.zeros(ids.shape, dtype=torch.bool)
    completion[:, 3:] = True
    logp = stratified_logprob(lm, ids, completion, num_strata=2, seed=0)
    weights = dps_weights(rollout)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
    loss = grpo_loss(logp, logp.detach(), advantages, completion)[0]
    loss.backward()
    assert head.weight.grad is not None and torch.isfinite(loss), loss
    assert linear_logprob(torch.randn(5, hidden), head.weight, torch.randint(0, vocab, (5,))).shape == (5,)
    assert weights.shape[0] == 4
    for module, extra in (("daca_kernels.models.bidirectional", "hf"), ("daca_kernels.trl", "trl")):
        try:
            __import__(module)
        except ModuleNotFoundError as error:
            assert f"pip install 'daca-kernels[{extra}]'" in str(error), error
        else:
            raise AssertionError(f"{module} imported without its extra")
    leaked = sorted({m.split(".")[0] for m in sys.modules} & set(ABSENT))
    assert not leaked, leaked
    print("core ok")
''')


def test_the_core_runs_without_transformers_and_the_adapters_name_their_extra():
    run = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "core ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
