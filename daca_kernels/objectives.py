"""The objectives the RL step trains with, and what each one needs: one table.

[`daca_kernels.rl_step`][daca_kernels.rl_step] (the step the TRL trainer and the reference loop call), the TRL config
and the loop's config all read [`OBJECTIVES`][daca_kernels.objectives.OBJECTIVES]; nothing else lists the objectives or tests an
objective's name to decide what it needs. A new objective is its loss (``losses/``), its reference
(``reference/losses.py``), a row here, its entry in ``rl_step.OBJECTIVE_LOSSES``, docs and tests
(CONTRIBUTING.md, "Adding an objective").

========  ===============  =====  =======  ========  ==========  =================
name      Monte-Carlo      ratio  KL term  fillings  old values  sample-by-sample
          masks                                                  backward
========  ===============  =====  =======  ========  ==========  =================
grpo      no               yes    yes      no        tokens      no
bgpo      yes              yes    no       no        samples     yes
spg       yes              no     no       no        none        no
dispo     no               yes    yes      yes       tokens      no
========  ===============  =====  =======  ========  ==========  =================
"""
from __future__ import annotations

from dataclasses import dataclass

from daca_kernels.validation import check_choice


@dataclass(frozen=True)
class Objective:
    """What one objective's loss needs from the step."""

    name: str
    monte_carlo_masks: bool
    """Its loss runs over Monte-Carlo mask samples (estimator ``elbo`` or ``stratified``)."""
    token_loss: bool
    """Its loss is (or contains) the per-token GRPO-family loss of [`daca_kernels.grpo_loss`][daca_kernels.losses.grpo.grpo_loss]: TRL's
    loss types, clipping, ``delta`` and the KL term apply."""
    kl_term: bool
    """It takes a KL penalty to a reference policy (``beta > 0``), so needs the reference's values."""
    fillings: bool
    """It trains on DiSPO's fillings of branch states (the rollout keeps branch states)."""
    old_values: str | None
    """What the sampling policy's values are, off-policy: ``"tokens"`` (per-token estimates
    ``[B, L]``), ``"samples"`` (per-sample scores ``[n, B]``), or None (no ratio: never needed)."""
    sample_by_sample_backward: bool
    """Its loss can be back-propagated one mask sample at a time (one sample's graph alive)."""

    @property
    def ratio(self) -> bool:
        """Whether its loss has an importance ratio to the sampling policy (it reads old values)."""
        return self.old_values is not None


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("grpo", monte_carlo_masks=False, token_loss=True, kl_term=True, fillings=False, old_values="tokens",
              sample_by_sample_backward=False),
    Objective("bgpo", monte_carlo_masks=True, token_loss=False, kl_term=False, fillings=False, old_values="samples",
              sample_by_sample_backward=True),
    Objective("spg", monte_carlo_masks=True, token_loss=False, kl_term=False, fillings=False, old_values=None,
              sample_by_sample_backward=False),
    Objective("dispo", monte_carlo_masks=False, token_loss=True, kl_term=True, fillings=True, old_values="tokens",
              sample_by_sample_backward=False),
)}


def objective(name: str, argument: str = "objective") -> Objective:
    """The row of ``name``; a ValueError naming ``argument`` when it is not an objective."""
    check_choice(name, argument, tuple(OBJECTIVES))
    return OBJECTIVES[name]
