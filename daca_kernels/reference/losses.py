"""Readable references of the objectives in ``daca_kernels.losses``, written as explicit loops.

Everything is float64 and follows the formulas term by term — one sequence, one token, one sample
at a time — so that agreement with the vectorised implementations means something. Tokens outside
the masks are never read. Slow: for tests on small inputs only.
"""
from __future__ import annotations

import math
import statistics

import torch


def _f64(t):
    return None if t is None else t.to(torch.float64)


def group_advantages(rewards, group_size, scale="group", leave_one_out=False, eps=1e-4):
    """Reward minus the group's (or the other members') mean, divided by ``stdev + eps`` of the
    group / batch (sample standard deviation, 0 for a single value). Plain Python statistics."""
    values = [float(r) for r in rewards]
    groups = [values[k : k + group_size] for k in range(0, len(values), group_size)]

    def stdev(xs):
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    out = []
    for group in groups:
        for index, reward in enumerate(group):
            others = group[:index] + group[index + 1 :]
            baseline = statistics.fmean(others) if leave_one_out else statistics.fmean(group)
            advantage = reward - baseline
            if scale == "group":
                advantage /= stdev(group) + eps
            elif scale == "batch":
                advantage /= stdev(values) + eps
            out.append(advantage)
    return torch.tensor(out, dtype=torch.float64)


def _vespo_phi(log_ratios, a, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's Gamma weight of one sequence as a Python float: ``phi(w) = e^lam w^k e^(-lam w)``
    of the product ``w`` of its token ratios (log ratios clamped per token to [-20, 20], their sum
    to [log 1e-8, 20]); ``(k, lam)`` by the sign of A, ``lam`` at least 1e-4."""
    log_w = sum(min(max(float(x.detach()), -20.0), 20.0) for x in log_ratios)
    log_w = min(max(log_w, math.log(1e-8)), 20.0)
    k, lam = (k_pos, lambda_pos) if a >= 0 else (k_neg, lambda_neg)
    lam = max(lam, 1e-4)
    try:
        phi = math.exp(lam) * math.exp(k * log_w) * math.exp(-lam * math.exp(log_w))
    except OverflowError:
        return 0.0  # TRL drops a weight that overflows
    return phi if math.isfinite(phi) else 0.0


def _token_terms(logp, old_logp, advantages, mask, ref_logp, token_weights, options):
    """Per row, a list with one dict per completion token: its loss term, ratio value, clip flags
    and KL. ``options`` holds the keyword arguments of [`grpo_loss`][daca_kernels.reference.losses.grpo_loss]."""
    o = options
    rows = []
    for b in range(logp.shape[0]):
        positions = [i for i in range(logp.shape[1]) if bool(mask[b, i])]
        a = float(advantages[b])
        if positions:
            mean_log_ratio = sum(logp[b, i] - old_logp[b, i] for i in positions) / len(positions)
            sequence_ratio = torch.exp(mean_log_ratio)  # differentiated through the mean
        terms = []
        for i in positions:
            if o["importance_sampling_level"] == "token":
                ratio = torch.exp(logp[b, i] - old_logp[b, i])
                kl_ratio = ratio
            else:
                # GSPO-token: value s_b, gradient s_b * grad logp: sg[s] * pi / sg[pi].
                prob = torch.exp(logp[b, i])
                ratio = sequence_ratio.detach() * prob / prob.detach()
                kl_ratio = sequence_ratio
            r = float(ratio.detach())
            flags = {"low": False, "high": False, "delta": False}
            if o["loss_type"] == "cispo":
                cap = o["epsilon_high"]
                surrogate = min(r, cap) * a * logp[b, i]
                flags["high"] = r > cap and a > 0
            elif o["loss_type"] == "sapo":
                tau = o["sapo_temperature_pos"] if a > 0 else o["sapo_temperature_neg"]
                surrogate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * a
            elif o["loss_type"] == "vespo":
                log_ratios = [logp[b, j] - old_logp[b, j] for j in positions]
                phi = _vespo_phi(log_ratios, a, o["vespo_k_pos"], o["vespo_lambda_pos"], o["vespo_k_neg"],
                                 o["vespo_lambda_neg"])
                surrogate = phi * a * logp[b, i]
            else:
                epsilon, epsilon_high, delta = o["epsilon"], o["epsilon_high"], o["delta"]
                if r < 1.0 - epsilon:
                    clipped_ratio = torch.tensor(1.0 - epsilon, dtype=torch.float64)
                elif r > 1.0 + epsilon_high:
                    clipped_ratio = torch.tensor(1.0 + epsilon_high, dtype=torch.float64)
                else:
                    clipped_ratio = ratio
                capped_ratio = torch.tensor(delta, dtype=torch.float64) if delta is not None and r > delta else ratio
                first, second = capped_ratio * a, clipped_ratio * a
                surrogate = first if float(first.detach()) <= float(second.detach()) else second
                flags = {"low": r < 1.0 - epsilon and a < 0, "high": r > 1.0 + epsilon_high and a > 0,
                         "delta": delta is not None and r > delta and a < 0}
            weight = 1.0 if token_weights is None else token_weights[b, i]
            term = -weight * surrogate
            kl = None
            if ref_logp is not None:
                log_ref_over_cur = ref_logp[b, i] - logp[b, i]
                kl = torch.exp(log_ref_over_cur) - log_ref_over_cur - 1.0
                term = term + o["beta"] * (kl * kl_ratio if o["use_bias_correction_kl"] else kl)
            terms.append({"term": term, "ratio": r, "kl": kl, **flags})
        rows.append(terms)
    return rows


def grpo_loss(
    logp, old_logp, advantages, mask, *, ref_logp=None, token_weights=None, beta=0.0, epsilon=0.2,
    epsilon_high=None, delta=None, loss_type="dapo", importance_sampling_level="token", max_completion_length=None,
    num_items_in_batch=None, use_bias_correction_kl=False, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
):
    """The policy loss of each ``loss_type`` and its metrics, token by token (see
    ``daca_kernels.losses.grpo``)."""
    options = dict(
        beta=beta, epsilon=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high, delta=delta, loss_type=loss_type,
        importance_sampling_level=importance_sampling_level, use_bias_correction_kl=use_bias_correction_kl,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
    )
    logp = _f64(logp)
    old_logp = logp.detach() if old_logp is None else _f64(old_logp)
    rows = _token_terms(logp, old_logp, _f64(advantages), mask, _f64(ref_logp), _f64(token_weights), options)
    batch, length = logp.shape
    zero = torch.zeros((), dtype=torch.float64)
    row_sums = [sum((t["term"] for t in terms), zero) for terms in rows]
    num_tokens = sum(len(terms) for terms in rows)
    if loss_type in ("grpo", "sapo"):
        loss = sum((s / max(len(terms), 1) for s, terms in zip(row_sums, rows)), zero) / batch
    elif loss_type == "luspo":
        loss = sum(row_sums, zero) / batch
    elif loss_type == "bnpo":
        loss = sum(row_sums, zero) / max(num_tokens, 1)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:  # the columns where some row has a completion token
            max_completion_length = max(sum(1 for i in range(length) if any(bool(mask[b, i]) for b in range(batch))), 1)
        loss = sum(row_sums, zero) / (batch * max_completion_length)
    else:  # "dapo", "cispo", "vespo"
        loss = sum(row_sums, zero) / (float(num_items_in_batch) if num_items_in_batch is not None else max(num_tokens, 1))
    flat = [t for terms in rows for t in terms]
    count = max(num_tokens, 1)
    metrics = {
        "clip_fraction_low": sum(t["low"] for t in flat) / count,
        "clip_fraction_high": sum(t["high"] for t in flat) / count,
        "ratio_mean": sum(t["ratio"] for t in flat) / count,
    }
    metrics["clip_fraction"] = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
    if delta is not None:
        metrics["clip_fraction_delta"] = sum(t["delta"] for t in flat) / count
        metrics["clip_fraction"] += metrics["clip_fraction_delta"]
    if ref_logp is not None:
        metrics["kl_mean"] = sum(float(t["kl"].detach()) for t in flat) / count
    return loss, metrics


def gspo_sequence_loss(logp, old_logp, advantages, mask, *, eps=0.2):
    """GSPO as its paper writes it: ``-(1/B) sum_b min(s_b A_b, clip(s_b, 1-eps, 1+eps) A_b)``
    with ``s_b = exp(mean over b's tokens of (logp - old_logp))`` differentiated as a whole."""
    logp, old_logp = _f64(logp), _f64(old_logp)
    total = torch.zeros((), dtype=torch.float64)
    for b in range(logp.shape[0]):
        positions = [i for i in range(logp.shape[1]) if bool(mask[b, i])]
        if not positions:
            continue
        s = torch.exp(sum(logp[b, i] - old_logp[b, i] for i in positions) / len(positions))
        a = float(advantages[b])
        total = total - torch.minimum(s * a, torch.clamp(s, 1 - eps, 1 + eps) * a)
    return total / logp.shape[0]


def elbo_sample_scores(sample_logp, sample_masks, mask_ratios, token_weights=None):
    """``[n, B]``: per sample j and sequence b, ``(1 / t_jb) * sum over masked i of w_bi * logp_jbi``."""
    n, batch, length = sample_logp.shape
    out = []
    for j in range(n):
        row = []
        for b in range(batch):
            total = torch.zeros((), dtype=torch.float64)
            for i in range(length):
                if bool(sample_masks[j, b, i]):
                    weight = 1.0 if token_weights is None else token_weights[b, i].double()
                    total = total + weight * sample_logp[j, b, i].double()
            t = float(mask_ratios[j, b])
            row.append(total / t if t > 0 else total)
        out.append(torch.stack(row))
    return torch.stack(out)


def elbo_ratio_objective(sample_logp, old_sample_logp, advantages):
    """The ELBO-based objective that BGPO bounds, as a loss: ``-(1/B) sum_b A_b exp(mean_j
    (l_jb - l_old_jb))`` (needs every sample's graph at once)."""
    n, batch = sample_logp.shape
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch):
        mean_log_ratio = sum(sample_logp[j, b].double() - old_sample_logp[j, b].double() for j in range(n)) / n
        total = total + float(advantages[b]) * torch.exp(mean_log_ratio)
    return -total / batch


def bgpo_loss(sample_logp, old_sample_logp, advantages):
    """BGPO's linear bound as a loss, sample by sample with an explicit branch on the sign of A."""
    n, batch = sample_logp.shape
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch):
        a = float(advantages[b])
        for j in range(n):
            d = sample_logp[j, b].double() - old_sample_logp[j, b].double()
            total = total + ((1.0 + d) * a if a >= 0 else torch.exp(d) * a) / n
    return -total / batch


def eubo_scores(sample_logp, sample_masks, mask_ratios, completion_mask, beta, token_weights=None, uncovered="spg"):
    """``[B]``: SPG's Renyi bound row by row and token by token, ``(1/beta) log((1/n) sum_j (1/t_j)
    p^beta)`` written directly with ``exp`` and ``log`` (fine for the moderate log-probabilities of
    the tests) over the completion tokens some sample masked; with ``uncovered="spg"`` their mean
    times the number of completion tokens, with ``"zero"`` their sum."""
    n, batch, length = sample_logp.shape
    out = []
    for b in range(batch):
        terms = []
        for i in range(length):
            draws = [j for j in range(n) if bool(sample_masks[j, b, i]) and bool(completion_mask[b, i])]
            if not draws:
                continue
            inner = sum(torch.exp(beta * sample_logp[j, b, i].double()) / float(mask_ratios[j, b]) for j in draws) / n
            weight = 1.0 if token_weights is None else token_weights[b, i].double()
            terms.append(weight * torch.log(inner) / beta)
        total = sum(terms, torch.zeros((), dtype=torch.float64))
        if uncovered == "spg" and terms:
            total = total / len(terms) * sum(1 for i in range(length) if bool(completion_mask[b, i]))
        out.append(total)
    return torch.stack(out)


def spg_loss(
    sample_logp, sample_masks, mask_ratios, completion_mask, advantages, *, negative_bound="eubo", beta=1.0,
    mix_weight=0.5, token_weights=None, num_items_in_batch=None, uncovered="spg",
):
    """SPG's loss sequence by sequence: the ELBO for A >= 0 (or ``negative_bound="elbo"``), else
    [`eubo_scores`][daca_kernels.reference.losses.eubo_scores] or its mixture with the ELBO."""
    masks = sample_masks & completion_mask
    elbo = elbo_sample_scores(sample_logp, masks, mask_ratios, token_weights).mean(dim=0)
    eubo = eubo_scores(sample_logp, masks, mask_ratios, completion_mask, beta, token_weights, uncovered)
    total = torch.zeros((), dtype=torch.float64)
    for b in range(sample_logp.shape[1]):
        a = float(advantages[b])
        if a >= 0 or negative_bound == "elbo":
            bound = elbo[b]
        else:
            bound = eubo[b] if negative_bound == "eubo" else mix_weight * eubo[b] + (1 - mix_weight) * elbo[b]
        total = total + a * bound
    tokens = int(completion_mask.sum())
    divisor = float(num_items_in_batch) if num_items_in_batch is not None else max(tokens, 1)
    return -total / divisor


def dispo_step_loss(logp, old_logp, filled_mask, rewards, num_fillings, *, token_weights=None, epsilon=0.2, epsilon_high=None):
    """DiSPO's step loss with the default DAPO normalisation, state by state and filling by filling:
    ``-(1 / #filled tokens) sum_states sum_fillings sum_filled w * min(r A, clip(r) A)``."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    logp = _f64(logp)
    old_logp = logp.detach() if old_logp is None else _f64(old_logp)
    advantages = group_advantages(rewards, num_fillings)
    total = torch.zeros((), dtype=torch.float64)
    filled = 0
    for state in range(logp.shape[0] // num_fillings):
        for z in range(num_fillings):
            row = state * num_fillings + z
            a = float(advantages[row])
            for i in range(logp.shape[1]):
                if not bool(filled_mask[row, i]):
                    continue
                filled += 1
                ratio = torch.exp(logp[row, i] - old_logp[row, i])
                clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
                weight = 1.0 if token_weights is None else token_weights[row, i].double()
                total = total - weight * torch.minimum(ratio * a, clipped * a)
    return total / max(filled, 1)
