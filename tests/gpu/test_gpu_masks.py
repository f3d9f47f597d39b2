"""stratified_mask on CUDA: bit-identical to the CPU path and to the reference.

Both schemes, prompt masking, a row offset (sharded batches), int32 and int64 ids, ragged rows
(one with fewer maskable positions than strata, one with none) and rows longer than the kernel's
(which take the PyTorch path on CUDA too). gpu-marked; ``DACA_GPU_TESTS_ON_CPU=1`` runs the same
bodies on CPU (see ``gpu_device.py``).
"""
import pytest
import torch
from gpu_device import CPU, DEVICE, LLADA_MASK_ID, generator, sized

from daca_kernels import reference, stratified_mask

pytestmark = pytest.mark.gpu

NUM_STRATA, SEED, PROMPT_MASK_PROB = 4, 2**63 + 5, 0.3


def make_batch(batch, length, dtype, seed):
    """CPU ``(ids, maskable, prompt)``: row b has left padding, a prompt, then a completion of
    random length; row 1 has two maskable positions (fewer than the strata), row 2 none."""
    g = generator(seed, CPU)
    ids = torch.randint(0, LLADA_MASK_ID, (batch, length), generator=g).to(dtype)
    padding = torch.randint(0, length // 8, (batch,), generator=g)
    starts = padding + torch.randint(1, length // 4, (batch,), generator=g)
    ends = torch.minimum(starts + torch.randint(length // 4, length, (batch,), generator=g), torch.tensor(length))
    ends[1], ends[2] = starts[1] + 2, starts[2]
    positions = torch.arange(length)
    maskable = (positions >= starts[:, None]) & (positions < ends[:, None])
    prompt = (positions >= padding[:, None]) & (positions < starts[:, None])
    return ids, maskable, prompt


def assert_identical(result, strata, copies, what):
    assert result.strata.dtype == torch.int64 and result.input_ids.dtype == copies.dtype, what
    assert torch.equal(result.strata.to(CPU), strata), f"{what}: strata differ"
    assert torch.equal(result.input_ids.to(CPU), copies), f"{what}: masked copies differ"


@pytest.mark.parametrize("dtype,row_offset", [(torch.int64, 0), (torch.int32, 3_000_000)])
@pytest.mark.parametrize("scheme", ["random", "interleave"])
def test_stratified_mask_is_bit_identical_to_cpu_and_reference(scheme, dtype, row_offset):
    ids, maskable, prompt = make_batch(6, sized(333, 45), dtype, seed=1)  # the interpreter sorts slowly
    args = (NUM_STRATA, SEED, LLADA_MASK_ID)
    kwargs = dict(scheme=scheme, prompt_mask_prob=PROMPT_MASK_PROB, row_offset=row_offset)
    on_device = stratified_mask(ids.to(DEVICE), maskable.to(DEVICE), *args, prompt=prompt.to(DEVICE), **kwargs)
    assert on_device.strata.device == ids.to(DEVICE).device

    strata, copies = reference.stratified_mask(ids, maskable, *args, scheme, prompt, PROMPT_MASK_PROB, row_offset)
    assert_identical(on_device, strata, copies, "device vs reference")
    on_cpu = stratified_mask(ids, maskable, *args, prompt=prompt, **kwargs)
    assert_identical(on_device, on_cpu.strata, on_cpu.input_ids, "device vs CPU path")
    assert (strata[1] >= 0).sum() == 2 and not (strata[2] >= 0).any()

    shard = stratified_mask(
        ids[2:5].to(DEVICE), maskable[2:5].to(DEVICE), *args, prompt=prompt[2:5].to(DEVICE),
        **{**kwargs, "row_offset": row_offset + 2},
    )
    assert_identical(shard, strata[2:5], copies[:, 2:5], "a shard with its row offset")


@pytest.mark.parametrize("scheme", ["random", "interleave"])
def test_rows_longer_than_the_kernel_match_cpu(scheme):
    ids, maskable, prompt = make_batch(3, 4099, torch.int64, seed=2)

    def masks(device):
        return stratified_mask(
            ids.to(device), maskable.to(device), NUM_STRATA, SEED, LLADA_MASK_ID,
            scheme=scheme, prompt=prompt.to(device), prompt_mask_prob=PROMPT_MASK_PROB, row_offset=7,
        )

    on_device, on_cpu = masks(DEVICE), masks(CPU)
    assert_identical(on_device, on_cpu.strata, on_cpu.input_ids, "long rows, device vs CPU path")
