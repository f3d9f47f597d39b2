"""Named training recipes: each a set of estimator, objective and token-weight settings.

A recipe is a plain dict of keyword settings (``objective``, ``estimator``, ``num_strata``,
``elbo_samples``, ``prompt_mask_prob``, ``dps``, ...) shared by the reference loop in
``integration/`` and [`daca_kernels.trl`][daca_kernels.trl], so that a name means the same thing in both.

``diffu-grpo`` is d1's recipe: the one-step estimator with the prompt masked at p = 0.15 and no
token weights. ``daca-grpo`` is the DACA recipe: Stratified Masking Likelihood (SML) with K = 4
strata and Denoising Progress Score (DPS) token weights.

[`ADVANTAGES`][daca_kernels.presets.ADVANTAGES] gives each recipe's advantages, as keyword arguments of
[`daca_kernels.group_advantages`][daca_kernels.losses.advantages.group_advantages] (``scale``, ``leave_one_out``): a recipe named after
a peer
uses that peer's released trainer's, and its ``+DACA`` variant and the ablations keep their
base's, so that a comparison changes only the likelihood and the token weights.
"""
from __future__ import annotations

# Each base objective and the same objective with DACA: SML (the stratified estimator, or its K
# strata as the Monte-Carlo mask samples of the ELBO-based objectives) and DPS token weights.
# Coupled-GRPO's estimator is already a complementary two-stratum design; DACA keeps its masks and
# adds DPS.
OBJECTIVE_VARIANTS = {
    "grpo": (dict(objective="grpo", estimator="one_step", prompt_mask_prob=0.15),
             dict(objective="grpo", estimator="stratified", num_strata=4, dps=True)),
    "coupled": (dict(objective="grpo", estimator="coupled"),
                dict(objective="grpo", estimator="coupled", dps=True)),
    "bgpo": (dict(objective="bgpo", estimator="elbo", elbo_samples=4),
             dict(objective="bgpo", estimator="stratified", num_strata=4, dps=True)),
    "spg": (dict(objective="spg", estimator="elbo", elbo_samples=4),
            dict(objective="spg", estimator="stratified", num_strata=4, dps=True)),
    "dispo": (dict(objective="dispo", estimator="one_step", prompt_mask_prob=0.15),
              dict(objective="dispo", estimator="stratified", num_strata=4, dps=True)),
}

METHODS = {"diffu-grpo": OBJECTIVE_VARIANTS["grpo"][0], "daca-grpo": OBJECTIVE_VARIANTS["grpo"][1]}

# DACA's two parts one at a time, and i.i.d. Monte-Carlo masks with the forward passes of SML K = 4.
ABLATIONS = {
    "sml-only": dict(objective="grpo", estimator="stratified", num_strata=4),
    "dps-only": dict(objective="grpo", estimator="one_step", prompt_mask_prob=0.15, dps=True),
    "elbo-mc": dict(objective="grpo", estimator="elbo", elbo_samples=4),
}

# Every named recipe: the two methods, each base objective with and without DACA, the ablations.
PRESETS = {**METHODS,
           **{name: settings for base, pair in OBJECTIVE_VARIANTS.items()
              for name, settings in zip((base, f"{base}+DACA"), pair)},
           **ABLATIONS}

# Advantages of the peers' released trainers (A = advantage, r = reward, over the G completions of a prompt):
# - d1 (diffu-grpo/diffu_grpo_trainer.py, _generate_and_score_completions): A = r - mean(r), no division by the std;
# - SPG (spg/spg_trainer.py, _generate_and_score_completions): A = r - mean(r), no division by the std;
# - DiffuCoder (src/open_r1/coupled_grpo.py with recipes/config_coupled_code.yaml, scale_rewards: false):
#   A = r - mean of the other G - 1 rewards (leave-one-out), no division by the std.
# BGPO's and DiSPO's trainers were not available to read: their recipes keep TRL's GRPO advantages.
D1_ADVANTAGES = dict(scale="none", leave_one_out=False)
SPG_ADVANTAGES = dict(scale="none", leave_one_out=False)
DIFFUCODER_ADVANTAGES = dict(scale="none", leave_one_out=True)
GRPO_ADVANTAGES = dict(scale="group", leave_one_out=False)

BASE_ADVANTAGES = {"grpo": D1_ADVANTAGES, "coupled": DIFFUCODER_ADVANTAGES, "bgpo": GRPO_ADVANTAGES,
                   "spg": SPG_ADVANTAGES, "dispo": GRPO_ADVANTAGES}

# Every preset's advantages: the methods and the ablations are d1's GRPO with one change, and each base
# objective's DACA variant keeps the base's.
ADVANTAGES = {"diffu-grpo": D1_ADVANTAGES, "daca-grpo": D1_ADVANTAGES,
              **{name: BASE_ADVANTAGES[base] for base in OBJECTIVE_VARIANTS for name in (base, f"{base}+DACA")},
              **{name: D1_ADVANTAGES for name in ABLATIONS}}
