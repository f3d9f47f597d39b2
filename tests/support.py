"""Shared helpers for the correctness tests."""
import torch


def assert_no_worse_than_torch(fused, plain, ref, tol, what="value"):
    """DESIGN 6's rule: ``|fused - ref| <= |plain - ref| + tol`` elementwise.

    ``ref`` is the float64 reference, ``plain`` the same computation in plain PyTorch at the
    input dtype, ``fused`` the op under test.
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


def snapshot(*tensors):
    return [None if t is None else t.detach().clone() for t in tensors]


def assert_unchanged(before, *tensors):
    for b, t in zip(before, tensors):
        if t is not None:
            torch.testing.assert_close(t.detach(), b, rtol=0, atol=0, equal_nan=True, msg="an input was modified")


def bf16_ulp(ref):
    """One bfloat16 unit in the last place of ``ref`` (the interpreter truncates bf16 stores)."""
    return ref.double().abs() * 2.0**-7
