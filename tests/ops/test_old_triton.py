"""On a triton older than the CUDA floor (3.2 and 3.3, pinned by torch 2.6 and 2.7), CUDA tensors take
the chunked PyTorch path, said once in a warning; asking for the Triton backend says why it cannot."""
import warnings

import pytest
import torch

from daca_kernels.ops import dispatch


@pytest.fixture
def old_triton(monkeypatch):
    monkeypatch.setattr(dispatch, "TRITON_INSTALLED", True)
    monkeypatch.setattr(dispatch, "TRITON_VERSION", (3, 2))
    monkeypatch.setattr(dispatch, "_warned_old_triton", False)
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)


def test_cuda_falls_back_to_the_chunked_path_with_one_warning(old_triton):
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match=r"need triton >= 3\.4 on CUDA \(installed: 3\.2\).*chunked PyTorch path"):
        assert dispatch.resolve_backend(cuda) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.resolve_backend(cuda) == "torch"
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run on cuda tensors here: .*triton >= 3\.4"):
        dispatch.resolve_backend(cuda, "triton")


def test_the_floor_and_newer_releases_compile_for_cuda(monkeypatch):
    monkeypatch.setattr(dispatch, "TRITON_INSTALLED", True)
    for version, expected in (((3, 3), False), ((3, 4), True), ((3, 7), True), (None, True)):
        monkeypatch.setattr(dispatch, "TRITON_VERSION", version)
        assert dispatch.triton_compiles_for_cuda() is expected
