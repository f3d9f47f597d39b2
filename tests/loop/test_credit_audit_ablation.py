"""The credit audit and the ablation at toy size (so their code paths cannot rot), and their statistics."""
import itertools
import json
import math

import numpy as np
import pytest
import torch
from distributed_gradients import tiny_config

# integration.compare draws its charts with matplotlib (the integration extra), imported at module level.
pytest.importorskip("matplotlib", reason="matplotlib is not installed (the integration extra)")

from integration import ablation, credit_audit
from integration.statistics import auc, average_ranks, bootstrap_ci, spearman
from integration.trainer import Trainer


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")


# ---------------------------------------------------------------- statistics on hand-checked cases
def test_average_ranks_share_ties():
    assert average_ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_spearman():
    # One swapped pair of four: 1 - 6 * sum d^2 / (n (n^2 - 1)) = 1 - 6 * 2 / 60.
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # Ties: ranks (1.5, 1.5, 3) against (1, 2, 3): covariance 1.5 / sqrt(1.5 * 2).
    assert spearman([5, 5, 7], [1, 2, 3]) == pytest.approx(1.5 / math.sqrt(3.0))
    x = np.random.default_rng(0).normal(size=50)
    y = x + np.random.default_rng(1).normal(size=50)
    assert spearman(np.exp(x), y) == pytest.approx(spearman(x, y))  # a rank statistic
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_auc_against_all_pairs():
    # Positives 0.35 and 0.8 against negatives 0.1 and 0.4: 3 of 4 pairs ordered.
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([1.0, 1.0, 1.0], [0, 1, 1]) == 0.5
    rng = np.random.default_rng(2)
    scores, labels = rng.integers(0, 4, size=30).astype(float), rng.integers(0, 2, size=30)
    pairs = [(s, t) for s, t in itertools.product(scores[labels == 1], scores[labels == 0])]
    expected = sum(1.0 if s > t else 0.5 if s == t else 0.0 for s, t in pairs) / len(pairs)
    assert auc(scores, labels) == pytest.approx(expected)
    assert math.isnan(auc([1.0, 2.0], [1, 1]))


def test_bootstrap_ci():
    assert bootstrap_ci([0.2] * 5) == pytest.approx((0.2, 0.2))
    # Two values: resampled means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4.
    assert bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
    assert bootstrap_ci([0.0, 1.0], confidence=0.4) == (0.5, 0.5)
    values = np.random.default_rng(3).normal(0.1, 0.05, size=8)
    low, high = bootstrap_ci(values, seed=7)
    assert low < values.mean() < high and (low, high) == bootstrap_ci(values, seed=7)


def test_statistics_bad_input():
    with pytest.raises(ValueError, match="same length"):
        spearman([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="labels"):
        auc([1.0, 2.0], [0, 2])
    with pytest.raises(ValueError, match="finite"):
        spearman([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="differences"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1.0], confidence=1.0)


# ---------------------------------------------------------------- the audit
def test_score_measures_on_a_hand_made_batch():
    nan = float("nan")
    credit = torch.tensor([[1.0, 0.0, 1.0, nan], [0.0, 1.0, nan, nan], [1.0, 1.0, nan, nan]])
    score = torch.tensor([[3.0, 1.0, 2.0, 9.0], [2.0, 1.0, 0.0, 0.0], [1.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    measures = credit_audit.score_measures(score, credit, torch.tensor([0.5, -0.5, 0.0]))
    # Row 0 ranks both right tokens first (AUC 1), row 1 the wrong one (AUC 0); row 2 has no wrong token.
    assert measures["within_auc"] == pytest.approx(0.5) and measures["mixed_completions"] == 2
    assert measures["within_auc_positive"] == 1.0 and measures["within_auc_negative"] == 0.0
    assert (measures["positive_completions"], measures["negative_completions"]) == (1, 1)
    assert measures["auc"] == pytest.approx(auc([3, 1, 2, 2, 1, 1, 2], [1, 0, 1, 0, 1, 1, 1]))


def test_commit_statistics_reproduce_the_recorded_confidence(torch_backend, tmp_path):
    trainer = Trainer(tiny_config(), tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    result = credit_audit.audit_policy(trainer, prompts=3)
    assert result["replay_gap"] < 1e-5 and result["completions"] == 3 * trainer.config.group_size
    assert set(result["scores"]) == set(credit_audit.SCORES)
    uniform = result["scores"]["uniform"]
    assert uniform["auc"] == 0.5 and math.isnan(uniform["spearman"])


def test_audit_runs_end_to_end(torch_backend, tmp_path):
    audit = credit_audit.audit_task(tiny_config(steps=1), 2, tmp_path / "runs", tmp_path / "cache", progress=False)
    assert list(audit["policies"]) == ["SFT", "diffu-GRPO 1 steps"]
    table = credit_audit.audit_table({"sort": audit})
    assert table.count("\n") == 1 + 2 * len(credit_audit.SCORES)
    assert credit_audit.rollouts_table({"sort": audit}).count("| sort |") == 2
    again = credit_audit.audit_task(tiny_config(steps=1), 2, tmp_path / "runs", tmp_path / "cache", progress=False)
    # The trained run is read back from its checkpoint and the audit is deterministic (NaN != NaN: compare text).
    assert json.dumps(again) == json.dumps(audit)


# ---------------------------------------------------------------- the ablation
def test_ablation_end_to_end(torch_backend, tmp_path):
    base = tiny_config(steps=1, eval_every=1)
    variants = ablation.ablation_variants(base.steps)
    assert list(variants) == ["diffu-grpo", "sml-only", "dps-only", "daca-grpo", "elbo-mc", "diffu-grpo-2x"]
    results = ablation.run_comparison(base, variants, [0, 1], tmp_path / "runs", tmp_path / "cache", progress=False,
                                      resume=True)
    # Pairing: per seed, every variant starts from the same checkpoint and sees the same prompts.
    for seed in (0, 1):
        assert len({runs[seed][0]["eval_reward"] for runs in results.values()}) == 1
        prompts = {Trainer(base.replace(**settings, seed=seed), tmp_path / "x", cache_dir=tmp_path / "cache",
                           progress=False).local_batch(0)[0].sum().item() for settings in variants.values()}
        assert len(prompts) == 1
    step_seconds = ablation.interleaved_step_seconds(base, variants, tmp_path / "cache", rounds=1)
    assert set(step_seconds) == set(variants) and all(t > 0 for t in step_seconds.values())
    path = ablation.write_report(results, variants, base, tmp_path / "out", "ablation-sort", "cmd", 1.0, step_seconds, 1)
    rows = ablation.ablation_rows(results, step_seconds)
    assert [r["variant"] for r in rows] == list(variants)
    assert rows[-1]["steps"] == 2 and rows[0]["steps"] == 1 and rows[0]["time_ratio"] == 1.0
    for row in rows[1:]:
        differences = [f - b for f, b in zip(row["final"], rows[0]["final"])]
        assert row["difference"] == pytest.approx(np.mean(differences))
        assert row["ci"][0] <= row["difference"] <= row["ci"][1] and 0 <= row["wins"] <= 2
    assert "advantages A = r - mean;" in path.read_text()  # every variant has d1's, so no settings cell repeats them
    assert path.read_text().count("| diffu-grpo") == 2 and (tmp_path / "out" / "ablation-sort.png").stat().st_size > 0
    assert (tmp_path / "out" / "ablation-sort.json").exists()
    again = ablation.run_comparison(base, variants, [0, 1], tmp_path / "runs", tmp_path / "cache", progress=False,
                                    resume=True)
    assert again == results  # finished runs are read back
    with pytest.raises(ValueError, match="paired"):
        ablation.ablation_rows({**results, "dps-only": {0: results["dps-only"][0]}})
