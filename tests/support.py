"""Shared helpers for the correctness tests."""
import math

import torch

from daca_kernels import reference
from daca_kernels.reference.sampling import gumbel_noise


def assert_no_worse_than_torch(fused, plain, ref, tol, what="value"):
    """The project's accuracy rule for op outputs: ``|fused - ref| <= |plain - ref| + tol`` elementwise.

    ``ref`` is the float64 reference, ``plain`` the same computation in plain PyTorch at the
    input dtype, ``fused`` the op under test. For gradients accumulated through a whole model use
    :func:`assert_model_gradients_close`.
    """
    fused, plain, ref = fused.double(), plain.double(), ref.double()
    assert fused.shape == ref.shape, f"{what}: shape {tuple(fused.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(fused).all(), f"{what}: non-finite entries"
    err = (fused - ref).abs()
    tol = torch.as_tensor(tol, dtype=torch.float64, device=err.device).expand_as(err)  # a number or per element
    allowed = (plain - ref).abs() + tol
    worst = (err - allowed).argmax()
    assert (err <= allowed).all(), (
        f"{what}: error {err.flatten()[worst].item():.3e} exceeds plain-torch error "
        f"{(plain - ref).abs().flatten()[worst].item():.3e} + tol {tol.flatten()[worst].item():.1e} "
        f"at flat index {worst.item()}"
    )


# Norm-wise rule for parameter gradients accumulated through a whole model (see
# assert_model_gradients_close). Such a gradient sums thousands of products through several layers,
# and the order of those sums is the BLAS's (it differs between Intel and AMD x86 and aarch64
# builds, and between a chunked and an unchunked head). Each order rounds each element by a few
# float32 ulps of the accumulated magnitudes, which can be far larger than the element itself, so
# an elementwise "no worse than plain torch" test fails by chance wherever plain torch's order
# happened to be lucky for one element. Over a whole parameter these errors average out, and the
# rule compares norms, one parameter at a time (a bug in a small bias is not diluted by a large
# embedding):
#
#     ||fused - ref|| <= GRADIENT_ERROR_RATIO * ||plain - ref|| + GRADIENT_RTOL * ||ref||
#
# GRADIENT_ERROR_RATIO = 2: the fused path's rounding error is another draw of the same size as
# plain torch's (another summation order), not a bigger one. Measured per parameter over the 32
# torch-backend cases of test_likelihood.py::test_estimator_matches_full_logits on an x86 CPU, the
# ratio ||fused - ref|| / ||plain - ref|| reaches 1.6; 2 covers that spread and no more.
# GRADIENT_RTOL = 1e-5: float32 rounding (unit 6e-8) through the tiny test models gives
# ||plain - ref|| / ||ref|| between 4e-7 and 1.5e-6 in the same measurement; a different summation
# order moves each element by a few ulps and the norm by about that much again, an order of
# magnitude below 1e-5. A real bug (a wrong mask, a dropped or doubled term, a wrong weight) moves
# a gradient by 1e-3 relative or more, two orders above it (test_likelihood.py plants such errors
# in every parameter, in whole and in one element, and checks that the rule catches each).
# Without a float64 ``ref`` (two float32 computations that differ only in summation order:
# checkpointed or not, sample by sample or stacked, one process or several) the rule is
# ||fused - ref|| <= GRADIENT_RTOL * ||ref||.
GRADIENT_ERROR_RATIO = 2.0
GRADIENT_RTOL = 1e-5


def assert_model_gradients_close(fused, ref, plain=None, what="d"):
    """Per-parameter norm-wise comparison of whole-model gradients (the rule above).

    ``fused``, ``ref`` and ``plain`` map parameter names to gradients of the same shapes (lists
    are numbered). ``ref`` is the float64 reference, or the other float32 computation when
    ``plain`` is None; ``plain`` the same computation in plain PyTorch at the model's dtype.
    """
    fused, ref = _named(fused), _named(ref)
    plain = None if plain is None else _named(plain)
    assert fused.keys() == ref.keys(), f"{what}: parameters {sorted(fused.keys() ^ ref.keys())} differ"
    for name, r in ref.items():
        f = fused[name].double()
        r = r.double()
        assert f.shape == r.shape, f"{what} {name}: shape {tuple(f.shape)} != {tuple(r.shape)}"
        assert torch.isfinite(f).all(), f"{what} {name}: non-finite entries"
        error = (f - r).norm().item()
        allowed = GRADIENT_RTOL * r.norm().item()
        if plain is not None:
            plain_error = (plain[name].double() - r).norm().item()
            allowed += GRADIENT_ERROR_RATIO * plain_error
        assert error <= allowed, (
            f"{what} {name}: ||error|| {error:.3e} exceeds the allowed {allowed:.3e} (||ref|| {r.norm().item():.3e}"
            + ("" if plain is None else f", ||plain - ref|| {plain_error:.3e}") + ")"
        )


def _named(grads):
    return dict(grads) if isinstance(grads, dict) else {str(i): g for i, g in enumerate(grads)}


# Elementwise rule for values that two computation paths produce from the same inputs through a model
# (a KV cache or not, a row alone or in a padded batch, one process or two, a cast to float32 on one
# side): each path sums the same terms in its own order (the BLAS's blocking depends on the shapes and
# differs between Intel, AMD and aarch64 builds), or rounds an intermediate to a narrower dtype. A sum
# of n terms of size m at a dtype of unit roundoff u = eps / 2 carries a rounding error of about
# u * sqrt(n) * m (a random walk of n roundings); two orders differ by about sqrt(2) of that, and the
# few layers of a test model and the log-softmax after them multiply it by a small factor. The rule:
#
#     |got - want| <= REDUCTION_FACTOR * eps(dtype) * sqrt(n) * max(1, max |want|)
#
# with n the length of the longest reduction behind a value (the hidden size for a head's logits) and
# dtype the narrowest one the values pass through. REDUCTION_FACTOR = 8: about four standard
# deviations of such a sum, times two for the layers. At the test models' sizes (n of 16 to 128,
# values of a few nats) this is 1e-6 to 1e-5 in float32 and 1e-14 to 1e-13 in float64, while a bug
# (a wrong mask, a dropped or doubled term) moves a value by 1e-3 or more.
REDUCTION_FACTOR = 8.0


def reduction_tolerance(dtype, n, magnitude=1.0):
    """The absolute tolerance of the rule above for values of size ``magnitude`` (at least 1) that
    come out of reductions of ``n`` terms at ``dtype``."""
    return REDUCTION_FACTOR * torch.finfo(dtype).eps * math.sqrt(max(int(n), 1)) * max(float(magnitude), 1.0)


def assert_close_reduced(got, want, *, n, dtype=None, what="values"):
    """``got`` and ``want`` (same shape) agree within :func:`reduction_tolerance` of ``dtype`` (the
    narrower of the two tensors' dtypes by default) for reductions of ``n`` terms, elementwise."""
    dtype = dtype or min(got.dtype, want.dtype, key=lambda d: torch.finfo(d).bits)
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"{what}: non-finite entries differ"
    finite = torch.isfinite(want)
    if not finite.any():
        return
    assert torch.equal(got[~finite], want[~finite]), f"{what}: non-finite entries differ"
    tol = reduction_tolerance(dtype, n, want[finite].abs().max().item())
    err = (got - want)[finite].abs()
    assert err.max().item() <= tol, (
        f"{what}: |difference| {err.max().item():.3e} exceeds {tol:.3e} ({dtype}, reductions of {n} terms)"
    )


def snapshot(*tensors):
    return [None if t is None else t.detach().clone() for t in tensors]


def assert_unchanged(before, *tensors):
    for b, t in zip(before, tensors):
        if t is not None:
            torch.testing.assert_close(t.detach(), b, rtol=0, atol=0, equal_nan=True, msg="an input was modified")


def ulp(ref, dtype):
    """``finfo(dtype).eps * |ref|``: about one unit in the last place of ``ref`` at ``dtype``, the
    error of one store at that dtype (rounded on CUDA, truncated by the interpreter)."""
    return ref.double().abs() * torch.finfo(dtype).eps


def bf16_ulp(ref):
    """One bfloat16 unit in the last place of ``ref`` (the interpreter truncates bf16 stores)."""
    return ulp(ref, torch.bfloat16)


def run_with_grads(fn, tensors, upstreams):
    """``fn`` on fresh leaf copies of ``tensors`` (None stays None) and the gradients of
    ``sum_i (outputs[i] * upstreams[i]).sum()`` with respect to those leaves.

    ``fn`` returns a tuple of outputs, one per upstream. Returns ``(outputs, grads)``: the outputs
    detached, the gradients a list (None for a None tensor).
    """
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    outputs = fn(*leaves)
    loss = sum((out * up).sum() for out, up in zip(outputs, upstreams))
    used = [leaf for leaf in leaves if leaf is not None]
    grads = iter(torch.autograd.grad(loss, used))
    return [out.detach() for out in outputs], [None if leaf is None else next(grads) for leaf in leaves]


def plain_gather_logprob(logits, targets, rows=None, temperature=1.0):
    """``(log-prob, entropy)`` of chosen targets the obvious way, in plain PyTorch at the input dtype."""
    x = logits.reshape(-1, logits.shape[-1])
    if rows is not None:
        x = x[rows]
    logp = torch.log_softmax(x / temperature, dim=-1)
    p = logp.exp()
    return logp.gather(-1, targets.reshape(-1, 1)).squeeze(-1), -(p * logp).sum(-1)


def plain_linear_logprob(hidden, weight, bias, targets, temperature):
    """``plain_gather_logprob`` of ``hidden @ weight.T + bias`` (full logits, input dtype)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    return plain_gather_logprob(logits, targets, temperature=temperature)


# A sampled candidate may lose to the float64 maximum by this much (relative): the rounding of the
# float32 score (noise, logits from a matmul) may resolve a near-tie either way.
NEAR_TIE = 1e-5


def reference_scores(logits, temperature, seed, step, row_ids, mask_id):
    """float64 candidate scores ``x / T + g`` (``x`` at T = 0), mask id at -inf."""
    x = logits.double().clone()
    if mask_id is not None:
        x[:, mask_id] = float("-inf")
    if temperature == 0:
        return x
    return x / temperature + gumbel_noise(seed, step, row_ids, x.shape[1]).double()


def near_maxima(scores, tokens):
    """bool ``[N]``: ``scores[n, tokens[n]]`` is the row maximum up to ``NEAR_TIE``."""
    best = scores.max(dim=1).values
    chosen = scores.gather(1, tokens[:, None]).squeeze(1)
    return chosen >= best - NEAR_TIE * (1 + best.abs())


def assert_same_samples(tokens, expected, scores, what):
    """Identical candidates, except in rows where both are maxima of the float64 ``scores`` up to
    ``NEAR_TIE`` (a near-tie, which rounding that is not bit-identical may resolve either way)."""
    beyond_ties = (tokens != expected) & ~(near_maxima(scores, tokens) & near_maxima(scores, expected))
    assert not beyond_ties.any(), f"{what}: candidates differ beyond a near-tie at rows {beyond_ties.nonzero().flatten().tolist()}"


def plain_torch_confidence(logits, tokens, mask_id):
    """Confidence and entropy the obvious way: float32 softmax (float64 for float64 logits)."""
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    if mask_id is not None:
        x = x.index_fill(1, torch.tensor([mask_id], device=x.device), float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    return p.gather(1, tokens[:, None]).squeeze(1), -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


def assert_valid_step(tokens, confidence, entropy, ref_logits, plain_logits, temperature, seed, step, row_ids, mask_id):
    """Candidates are maxima of the float64 score (up to rounding of the score); confidence and
    entropy are no worse than plain torch on ``plain_logits`` (what a user would have at hand).
    All tensors on one device."""
    n = ref_logits.shape[0]
    if row_ids is None:
        row_ids = torch.arange(n, device=ref_logits.device)
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    assert ((tokens >= 0) & (tokens < ref_logits.shape[1])).all()
    if mask_id is not None:
        assert (tokens != mask_id).all()
    scores = reference_scores(ref_logits, temperature, seed, step, row_ids, mask_id)
    assert near_maxima(scores, tokens).all(), "a candidate is not the Gumbel-max"
    _, _, ref_entropy = reference.sample_step(ref_logits.double(), temperature, seed, step, row_ids, mask_id, return_entropy=True)
    x = ref_logits.double().clone()
    if mask_id is not None:
        x[:, mask_id] = float("-inf")
    ref_conf_at_tokens = torch.softmax(x, dim=1).gather(1, tokens[:, None]).squeeze(1)
    plain_conf, plain_entropy = plain_torch_confidence(plain_logits, tokens, mask_id)
    assert_no_worse_than_torch(confidence, plain_conf, ref_conf_at_tokens, 1e-6, "confidence")
    assert_no_worse_than_torch(entropy, plain_entropy, ref_entropy, 1e-6 * (1 + ref_entropy.abs()), "entropy")
