"""stratified_mask: the reference, the chunked torch path and the Triton kernel agree bit for bit,
and the masks have the properties SML needs."""
import contextlib
import importlib
import os

import pytest
import torch
from gpu_device import DEVICE
from properties import given, settings, st

from daca_kernels import reference, stratified_mask

mask_op = importlib.import_module("daca_kernels.ops.stratified_mask")
from support import assert_unchanged, snapshot

MASK_ID = 1000


@contextlib.contextmanager
def forced_backend(name):
    old = os.environ.get("DACA_BACKEND")
    os.environ["DACA_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DACA_BACKEND")
        else:
            os.environ["DACA_BACKEND"] = old


def make_batch(batch, length, density, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID, (batch, length), generator=g).to(dtype)
    maskable = torch.rand(batch, length, generator=g) < density
    return ids, maskable


def assert_same(a, b, what):
    assert a.strata.dtype == b.strata.dtype == torch.int64
    assert torch.equal(a.strata, b.strata), f"{what}: strata differ"
    assert a.input_ids.dtype == b.input_ids.dtype
    assert torch.equal(a.input_ids, b.input_ids), f"{what}: masked copies differ"


def all_paths(ids, maskable, num_strata, seed, **kw):
    results = {}
    for name in ("reference", "torch", "triton"):
        with forced_backend(name):
            results[name] = stratified_mask(ids, maskable, num_strata, seed, MASK_ID, **kw)
    return results


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 40),
    num_strata=st.integers(1, 6),
    density=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    seed=st.integers(0, 2**64 - 1),
    scheme=st.sampled_from(["random", "interleave"]),
    prompt_mask_prob=st.sampled_from([0.0, 0.15, 0.5, 1.0]),
    data_seed=st.integers(0, 1000),
)
def test_three_paths_are_bit_identical(batch, length, num_strata, density, seed, scheme, prompt_mask_prob, data_seed):
    ids, maskable = make_batch(batch, length, density, data_seed)
    results = all_paths(ids, maskable, num_strata, seed, scheme=scheme, prompt_mask_prob=prompt_mask_prob)
    assert_same(results["torch"], results["reference"], "torch vs reference")
    assert_same(results["triton"], results["reference"], "triton vs reference")


def check_strata_properties(result, ids, maskable, num_strata):
    strata, copies = result.strata, result.input_ids
    assert strata.shape == ids.shape and copies.shape == (num_strata, *ids.shape)
    assert ((strata >= 0) == maskable).all(), "maskable positions get a stratum, the others -1"
    assert (strata < num_strata).all()
    sizes = torch.stack([(strata == k).sum(1) for k in range(num_strata)], dim=1)
    assert (sizes.sum(1) == maskable.sum(1)).all()
    assert (sizes.max(1).values - sizes.min(1).values <= 1).all(), "stratum sizes differ by more than one"
    for k in range(num_strata):
        expected = torch.where(strata == k, torch.full_like(ids, MASK_ID), ids)
        assert torch.equal(copies[k], expected), f"copy {k} is not the input masked exactly on stratum {k}"


@pytest.mark.parametrize("scheme", ["random", "interleave"])
@pytest.mark.parametrize("batch,length,num_strata", [(3, 50, 4), (1, 1, 1), (5, 17, 3), (2, 64, 7)])
def test_strata_partition_the_maskable_positions(backend, poison_allocations, scheme, batch, length, num_strata):
    ids, maskable = make_batch(batch, length, 0.6, seed=length)
    before = snapshot(ids, maskable)
    result = stratified_mask(ids, maskable, num_strata, 11, MASK_ID, scheme=scheme)
    assert_unchanged(before, ids, maskable)
    check_strata_properties(result, ids, maskable, num_strata)


def test_more_strata_than_maskable_positions_leaves_strata_empty(backend):
    ids, _ = make_batch(3, 12, 1.0, seed=0)
    maskable = torch.zeros(3, 12, dtype=torch.bool)
    maskable[0, [2, 5]] = True
    maskable[1, 7] = True  # row 2 has no maskable position at all
    for scheme in ("random", "interleave"):
        result = stratified_mask(ids, maskable, 5, 3, MASK_ID, scheme=scheme)
        check_strata_properties(result, ids, maskable, 5)
        assert (result.strata[2] == -1).all()
        assert torch.equal(result.input_ids[:, 2], ids[2].expand(5, -1))


def test_int32_ids_and_non_contiguous_inputs(backend):
    ids, maskable = make_batch(6, 30, 0.5, seed=4, dtype=torch.int32)
    ids_t, maskable_t = ids.T.contiguous().T, maskable[:, ::1].T.contiguous().T
    result = stratified_mask(ids_t[::2], maskable_t[::2], 3, 9, MASK_ID, prompt_mask_prob=0.25)
    expected = reference.stratified_mask(ids[::2], maskable[::2], 3, 9, MASK_ID, "random", ~maskable[::2], 0.25)
    assert result.input_ids.dtype == torch.int32
    assert torch.equal(result.strata, expected[0]) and torch.equal(result.input_ids, expected[1])


def prompt_and_completion(batch, length):
    completion = torch.zeros(batch, length, dtype=torch.bool)
    completion[:, 20:40] = True
    prompt = torch.zeros_like(completion)
    prompt[:, 2:20] = True  # positions 0-1 and 40+ are neither (e.g. padding): never masked
    return prompt, completion


def test_prompt_masking(backend):
    batch, length, num_strata = 4, 44, 3
    ids, _ = make_batch(batch, length, 1.0, seed=1)
    prompt, completion = prompt_and_completion(batch, length)

    untouched = stratified_mask(ids, completion, num_strata, 5, MASK_ID, prompt=prompt, prompt_mask_prob=0.0)
    assert torch.equal(untouched.input_ids[:, ~completion], ids[~completion].expand(num_strata, -1))

    full = stratified_mask(ids, completion, num_strata, 5, MASK_ID, prompt=prompt, prompt_mask_prob=1.0)
    assert (full.input_ids[:, prompt] == MASK_ID).all()
    assert torch.equal(full.strata, untouched.strata)

    drawn = stratified_mask(ids, completion, num_strata, 5, MASK_ID, prompt=prompt, prompt_mask_prob=0.3)
    assert torch.equal(drawn.strata, untouched.strata)
    neither = ~prompt & ~completion
    assert torch.equal(drawn.input_ids[:, neither], ids[neither].expand(num_strata, -1))
    on_completion = drawn.input_ids[:, completion] == MASK_ID
    assert torch.equal(on_completion, (drawn.strata[completion] == torch.arange(num_strata)[:, None]))
    prompt_masked = drawn.input_ids[:, prompt] == MASK_ID
    assert prompt_masked.any() and not prompt_masked.all()
    assert not torch.equal(prompt_masked[0], prompt_masked[1]), "each copy must draw its prompt mask afresh"

    default_prompt = stratified_mask(ids, completion, num_strata, 5, MASK_ID, prompt_mask_prob=0.3)
    expected = stratified_mask(ids, completion, num_strata, 5, MASK_ID, prompt=~completion, prompt_mask_prob=0.3)
    assert_same(default_prompt, expected, "prompt=None means every non-maskable position")


@pytest.mark.parametrize("prob", [0.15, 0.5, 0.9])
def test_prompt_masking_rate(prob):
    # Statistics on a large batch through the torch path (all paths agree bit for bit).
    ids, _ = make_batch(256, 44, 1.0, seed=1)
    prompt, completion = prompt_and_completion(256, 44)
    with forced_backend("torch"):
        drawn = stratified_mask(ids, completion, 2, 17, MASK_ID, prompt=prompt, prompt_mask_prob=prob)
    rate = (drawn.input_ids[:, prompt] == MASK_ID).float().mean().item()
    assert abs(rate - prob) < 0.02, f"prompt masking rate {rate:.3f} far from {prob}"


def test_one_stratum_with_prompt_masking_is_d1_masking(backend):
    ids, _ = make_batch(4, 30, 1.0, seed=2)
    completion = torch.zeros(4, 30, dtype=torch.bool)
    completion[:, 12:] = True
    result = stratified_mask(ids, completion, 1, 8, MASK_ID, prompt_mask_prob=0.15)
    assert (result.input_ids[0][completion] == MASK_ID).all(), "K = 1 masks the whole completion"
    assert (result.strata[completion] == 0).all()
    assert (result.input_ids[0][~completion] == MASK_ID).any()


def test_masks_are_a_function_of_seed_row_and_position(backend):
    ids, maskable = make_batch(3, 30, 0.7, seed=3)
    a = stratified_mask(ids, maskable, 4, 123, MASK_ID, prompt_mask_prob=0.2)
    again = stratified_mask(ids.clone(), maskable.clone(), 4, 123, MASK_ID, prompt_mask_prob=0.2)
    assert_same(a, again, "same seed")
    other = stratified_mask(ids, maskable, 4, 124, MASK_ID, prompt_mask_prob=0.2)
    assert not torch.equal(a.strata, other.strata), "another seed should give other strata"
    head = stratified_mask(ids[:2], maskable[:2], 4, 123, MASK_ID, prompt_mask_prob=0.2)
    assert torch.equal(head.strata, a.strata[:2]) and torch.equal(head.input_ids, a.input_ids[:, :2])
    wide_seed = stratified_mask(ids, maskable, 4, 123 + (5 << 32), MASK_ID)
    assert not torch.equal(wide_seed.strata, a.strata), "the high 32 bits of the seed must matter"


# (seed, shard): several seeds, shards at the start, the middle and the end of a batch of 7.
SHARDS = [(5, (0, 3)), (2**40 + 3, (3, 7)), (91, (2, 5))]


def assert_shard_of(whole, shard, lo, hi, what):
    assert torch.equal(shard.strata, whole.strata[lo:hi]), f"{what}: strata differ from the whole batch's rows"
    assert torch.equal(shard.input_ids, whole.input_ids[:, lo:hi]), f"{what}: copies differ from the whole batch's rows"


@pytest.mark.parametrize("scheme", ["random", "interleave"])
def test_a_shard_with_its_row_offset_gets_the_masks_of_its_rows_in_the_whole_batch(backend, scheme):
    ids, maskable = make_batch(7, 23, 0.6, seed=13)
    before = snapshot(ids, maskable)
    for seed, (lo, hi) in SHARDS:
        kw = dict(scheme=scheme, prompt_mask_prob=0.4)
        whole = stratified_mask(ids, maskable, 3, seed, MASK_ID, **kw)
        shard = stratified_mask(ids[lo:hi], maskable[lo:hi], 3, seed, MASK_ID, row_offset=lo, **kw)
        expected = reference.stratified_mask(
            ids[lo:hi], maskable[lo:hi], 3, seed, MASK_ID, scheme, ~maskable[lo:hi], 0.4, row_offset=lo
        )
        assert_shard_of(whole, shard, lo, hi, f"seed {seed}, rows {lo}:{hi}")
        assert torch.equal(shard.strata, expected[0]) and torch.equal(shard.input_ids, expected[1]), "vs reference"
    unshifted = stratified_mask(ids[3:], maskable[3:], 3, 5, MASK_ID, scheme=scheme, prompt_mask_prob=0.4)
    whole = stratified_mask(ids, maskable, 3, 5, MASK_ID, scheme=scheme, prompt_mask_prob=0.4)
    assert not torch.equal(unshifted.input_ids, whole.input_ids[:, 3:]), "without the offset a shard gets other masks"
    assert_unchanged(before, ids, maskable)


def test_row_offset_near_the_32_bit_limit(backend):
    ids, maskable = make_batch(3, 11, 0.7, seed=14)
    offset = 2**32 - 3  # the last row hashes as row 2**32 - 1
    result = stratified_mask(ids, maskable, 2, 8, MASK_ID, prompt_mask_prob=0.5, row_offset=offset)
    expected = reference.stratified_mask(ids, maskable, 2, 8, MASK_ID, "random", ~maskable, 0.5, row_offset=offset)
    assert torch.equal(result.strata, expected[0]) and torch.equal(result.input_ids, expected[1])


def test_row_offset_on_long_rows_and_across_torch_chunks(monkeypatch):
    # Rows longer than the kernel's block take the chunked PyTorch path, here in chunks of 2 rows.
    kernels = pytest.importorskip("daca_kernels.kernels.stratified_mask")
    monkeypatch.setattr(kernels, "MAX_ROW_LENGTH", 16)
    monkeypatch.setattr(mask_op, "CHUNK_POSITIONS", 40)
    monkeypatch.setenv("DACA_BACKEND", "triton")
    ids, maskable = make_batch(7, 19, 0.5, seed=15)
    for scheme in ("random", "interleave"):
        for seed, (lo, hi) in SHARDS:
            whole = stratified_mask(ids, maskable, 3, seed, MASK_ID, scheme=scheme, prompt_mask_prob=0.5)
            shard = stratified_mask(
                ids[lo:hi], maskable[lo:hi], 3, seed, MASK_ID, scheme=scheme, prompt_mask_prob=0.5, row_offset=lo
            )
            assert_shard_of(whole, shard, lo, hi, f"{scheme}, seed {seed}, rows {lo}:{hi}")


def test_random_scheme_spreads_positions_evenly_and_interleave_cycles():
    # The torch path is enough here (the three paths agree bit for bit, see above).
    ids = torch.arange(10)[None].expand(200, -1).contiguous()
    maskable = torch.zeros(200, 10, dtype=torch.bool)
    maskable[:, 1:9] = True
    with forced_backend("torch"):
        counts = sum(
            (stratified_mask(ids[:1], maskable[:1], 2, seed, MASK_ID).strata[0, 1:9] == 0).long() for seed in range(200)
        )
        assert ((counts > 70) & (counts < 130)).all(), f"position-in-stratum-0 counts {counts.tolist()} far from 100"
        interleaved = stratified_mask(ids, maskable, 3, 7, MASK_ID, scheme="interleave").strata[:, 1:9]
    steps = (interleaved[:, 1:] - interleaved[:, :-1]) % 3
    assert (steps == 1).all(), "interleave: consecutive maskable positions take consecutive strata"
    assert len(set(interleaved[:, 0].tolist())) == 3, "the per-row offset should vary across rows"


def test_rows_longer_than_the_kernel_block_take_the_torch_path(monkeypatch):
    kernels = pytest.importorskip("daca_kernels.kernels.stratified_mask")
    launched = []
    real_launch = kernels.stratified_mask
    monkeypatch.setattr(kernels, "stratified_mask", lambda *a: launched.append(a[0].shape) or real_launch(*a))
    monkeypatch.setattr(kernels, "MAX_ROW_LENGTH", 16)
    monkeypatch.setenv("DACA_BACKEND", "triton")
    for length in (16, 17, 40):
        ids, maskable = make_batch(3, length, 0.6, seed=length)
        result = stratified_mask(ids, maskable, 3, 21, MASK_ID, prompt_mask_prob=0.4)
        expected = reference.stratified_mask(ids, maskable, 3, 21, MASK_ID, "random", ~maskable, 0.4)
        assert torch.equal(result.strata, expected[0]) and torch.equal(result.input_ids, expected[1])
    assert launched == [(3, 16)], "only the row that fits the block may reach the kernel"


@pytest.mark.parametrize("layout", [(1, 8), (2, 4)])
def test_rows_spanning_several_tiles(monkeypatch, layout):
    # On a GPU one program takes one row in tiles of GPU_TILE positions; a narrow tile here makes
    # every row span several tiles (ranks counted across tiles, interleave ordinals carried).
    kernels = pytest.importorskip("daca_kernels.kernels.stratified_mask")
    monkeypatch.setattr(kernels, "launch_layout", lambda batch, length: layout)
    monkeypatch.setenv("DACA_BACKEND", "triton")
    ids, maskable = make_batch(3, 21, 0.5, seed=6)
    for scheme in ("random", "interleave"):
        result = stratified_mask(ids, maskable, 4, 77, MASK_ID, scheme=scheme, prompt_mask_prob=0.5)
        expected = reference.stratified_mask(ids, maskable, 4, 77, MASK_ID, scheme, ~maskable, 0.5)
        assert torch.equal(result.strata, expected[0]) and torch.equal(result.input_ids, expected[1])


def test_chunked_torch_path_across_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(mask_op, "CHUNK_POSITIONS", 40)
    monkeypatch.setenv("DACA_BACKEND", "torch")
    ids, maskable = make_batch(7, 19, 0.5, seed=8)
    for scheme in ("random", "interleave"):
        result = stratified_mask(ids, maskable, 3, 5, MASK_ID, scheme=scheme, prompt_mask_prob=0.5)
        expected = reference.stratified_mask(ids, maskable, 3, 5, MASK_ID, scheme, ~maskable, 0.5)
        assert torch.equal(result.strata, expected[0]) and torch.equal(result.input_ids, expected[1])


@pytest.mark.parametrize("shape", [(0, 10), (3, 0)])
def test_empty_inputs_give_empty_results(backend, shape):
    ids = torch.zeros(shape, dtype=torch.int64)
    result = stratified_mask(ids, torch.zeros(shape, dtype=torch.bool), 2, 0, MASK_ID)
    assert result.strata.shape == shape and result.input_ids.shape == (2, *shape)


def test_opcheck_stratified_mask(backend):
    ids, maskable = make_batch(3, 13, 0.5, seed=0)
    op = torch.ops.daca.stratified_mask.default
    torch.library.opcheck(op, (ids, maskable, ~maskable, 3, 12345, MASK_ID, False, 2**31, 0, backend))
    torch.library.opcheck(op, (ids, maskable, None, 2, 7, MASK_ID, True, 0, 0, backend))
    torch.library.opcheck(op, (ids, maskable, ~maskable, 3, 12345, MASK_ID, True, 2**30, 2**32 - 3, backend))


@pytest.mark.parametrize("seed,t_range", [(3, (0.3, 0.7)), (2**40 + 5, (0.2, 0.8)), (11, (0.5, 0.5))])
def test_ratio_masks_match_the_row_by_row_reference(backend, seed, t_range):
    from daca_kernels.likelihood.ratio_masks import coupled_split, elbo_mask
    from daca_kernels.reference import masking

    _, maskable = make_batch(7, 23, 0.6, seed=12)
    maskable[3] = False  # no completion
    maskable[4] = False
    maskable[4, 9] = True  # a one-token completion
    maskable[5, 2:4] = True  # a two-token completion
    maskable[5, 4:] = False
    split = coupled_split(maskable, seed, t_range)
    expected = masking.coupled_split(maskable, seed, t_range)
    for got, want in zip((split.strata, split.t, split.weights), expected):
        assert torch.equal(got, want)
    for index in range(3):
        mask, t = elbo_mask(maskable, seed, index, 3)
        want_mask, want_t = masking.elbo_mask(maskable, seed, index, 3)
        assert torch.equal(mask, want_mask) and torch.equal(t, want_t)


def test_ratio_masks_of_a_shard_with_its_row_offset_are_those_of_its_rows():
    from daca_kernels.likelihood.ratio_masks import coupled_split, elbo_mask
    from daca_kernels.reference import masking

    _, maskable = make_batch(7, 21, 0.6, seed=16)
    maskable[4] = False  # a row without completion
    for seed, (lo, hi) in SHARDS:
        part = maskable[lo:hi]
        whole = coupled_split(maskable, seed, (0.3, 0.7))
        shard = coupled_split(part, seed, (0.3, 0.7), row_offset=lo)
        expected = masking.coupled_split(part, seed, (0.3, 0.7), row_offset=lo)
        for got, full, want in zip((shard.strata, shard.t, shard.weights), (whole.strata, whole.t, whole.weights), expected):
            assert torch.equal(got, full[lo:hi]) and torch.equal(got, want)
        for index in range(3):
            mask, t = elbo_mask(part, seed, index, 3, row_offset=lo)
            full_mask, full_t = elbo_mask(maskable, seed, index, 3)
            want_mask, want_t = masking.elbo_mask(part, seed, index, 3, row_offset=lo)
            assert torch.equal(mask, full_mask[lo:hi]) and torch.equal(t, full_t[lo:hi])
            assert torch.equal(mask, want_mask) and torch.equal(t, want_t)
    assert not torch.equal(coupled_split(maskable[3:], 5).strata, coupled_split(maskable, 5).strata[3:])


@pytest.mark.parametrize(
    "row_offset,error,message",
    [
        (-1, ValueError, "row_offset must be >= 0, got -1"),
        (1.0, TypeError, "row_offset must be an int, got float"),
        (2**32 - 1, ValueError, r"row_offset must keep row_offset \+ B <= 2\*\*32 .*got row_offset = 4294967295 with B = 2"),
    ],
)
def test_ratio_masks_refuse_a_bad_row_offset(row_offset, error, message):
    from daca_kernels.likelihood.ratio_masks import coupled_split, elbo_mask

    _, maskable = make_batch(2, 9, 0.5, seed=0)
    with pytest.raises(error, match=message):
        coupled_split(maskable, 0, row_offset=row_offset)
    with pytest.raises(error, match=message):
        elbo_mask(maskable, 0, 0, 2, row_offset=row_offset)


BAD_CASES = {
    "zero strata": (dict(num_strata=0), ValueError, "num_strata must be >= 1"),
    "float strata": (dict(num_strata=2.0), TypeError, "num_strata must be an int"),
    "bool strata": (dict(num_strata=True), TypeError, "num_strata must be an int"),
    "float ids": (dict(input_ids=lambda ids, m: ids.float()), TypeError, "input_ids must have dtype"),
    "1-D ids": (dict(input_ids=lambda ids, m: ids[0]), ValueError, "input_ids must be 2-D"),
    "int maskable": (dict(maskable=lambda ids, m: m.long()), TypeError, "maskable must have dtype"),
    "maskable shape": (dict(maskable=lambda ids, m: m[:, :-1]), ValueError, r"maskable must have shape \[B, L\]"),
    "prompt shape": (dict(prompt=lambda ids, m: m[:1]), ValueError, r"prompt must have shape \[B, L\]"),
    "prompt dtype": (dict(prompt=lambda ids, m: m.int()), TypeError, "prompt must have dtype"),
    "prompt overlapping maskable": (dict(prompt=lambda ids, m: torch.ones_like(m), prompt_mask_prob=0.5), ValueError,
                                    r"prompt must not overlap maskable: prompt\[0, \d+\] and maskable\[0, \d+\] are both True"),
    "prompt overlapping maskable, unused": (dict(prompt=lambda ids, m: m.clone()), ValueError, "prompt must not overlap maskable"),
    "device mismatch": (dict(maskable=lambda ids, m: m.to("meta")), ValueError, "maskable is on meta but input_ids is on cpu"),
    "negative seed": (dict(seed=-1), ValueError, "seed must lie in"),
    "float seed": (dict(seed=1.5), TypeError, "seed must be an int"),
    "negative mask id": (dict(mask_id=-1), ValueError, "mask_id must be in"),
    "mask id too big for int32": (dict(input_ids=lambda ids, m: ids.int(), mask_id=2**31), ValueError, r"mask_id must be in \[0, 2147483648\), got 2147483648"),
    "scheme": (dict(scheme="blocks"), ValueError, "scheme must be one of 'random', 'interleave', got 'blocks'"),
    "probability above one": (dict(prompt_mask_prob=1.5), ValueError, r"prompt_mask_prob must be a finite number in \[0, 1\]"),
    "probability tensor": (dict(prompt_mask_prob=torch.tensor(0.1)), TypeError, "prompt_mask_prob must be a Python float"),
    "negative row offset": (dict(row_offset=-2), ValueError, "row_offset must be >= 0, got -2"),
    "float row offset": (dict(row_offset=2.0), TypeError, "row_offset must be an int, got float"),
    "bool row offset": (dict(row_offset=True), TypeError, "row_offset must be an int, got bool"),
    "tensor row offset": (dict(row_offset=torch.tensor(3)), TypeError, "row_offset must be an int, got Tensor"),
    "row offset past 32 bits": (dict(row_offset=2**32 - 1), ValueError, r"row_offset must keep row_offset \+ B <= 2\*\*32"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_refused_by_name(backend, case):
    overrides, error, message = BAD_CASES[case]
    ids, maskable = make_batch(2, 9, 0.5, seed=0)
    before = snapshot(ids, maskable)
    args = dict(input_ids=ids, maskable=maskable, num_strata=2, seed=0, mask_id=MASK_ID)
    for name, value in overrides.items():
        args[name] = value(ids, maskable) if callable(value) else value
    with pytest.raises(error, match=message):
        stratified_mask(
            args.pop("input_ids"), args.pop("maskable"), args.pop("num_strata"), args.pop("seed"), args.pop("mask_id"), **args
        )
    assert_unchanged(before, ids, maskable)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["random", "interleave"])
def test_cuda_kernel_matches_the_cpu_reference(scheme):
    ids, maskable = make_batch(16, 700, 0.6, seed=5)
    result = stratified_mask(ids.to(DEVICE), maskable.to(DEVICE), 4, 99, MASK_ID, scheme=scheme, prompt_mask_prob=0.15)
    expected = reference.stratified_mask(ids, maskable, 4, 99, MASK_ID, scheme, ~maskable, 0.15)
    assert torch.equal(result.strata.cpu(), expected[0]) and torch.equal(result.input_ids.cpu(), expected[1])
    shard = stratified_mask(
        ids[5:9].to(DEVICE), maskable[5:9].to(DEVICE), 4, 99, MASK_ID, scheme=scheme, prompt_mask_prob=0.15, row_offset=5
    )
    assert torch.equal(shard.strata.cpu(), expected[0][5:9]) and torch.equal(shard.input_ids.cpu(), expected[1][:, 5:9])
    long_ids, long_maskable = make_batch(2, 5000, 0.5, seed=6)  # longer than the kernel's block
    result = stratified_mask(long_ids.to(DEVICE), long_maskable.to(DEVICE), 3, 1, MASK_ID, scheme=scheme)
    with forced_backend("torch"):
        expected = stratified_mask(long_ids, long_maskable, 3, 1, MASK_ID, scheme=scheme)
    assert_same(type(expected)(result.strata.cpu(), result.input_ids.cpu()), expected, "long rows on CUDA")


# --- Block-wise ELBO masks (SPG) ---------------------------------------------------------------


def block_layout(completion, block_length):
    """Per row, the completion positions of each block, computed directly (list of lists)."""
    layout = []
    for row in completion:
        positions = row.nonzero().flatten().tolist()
        layout.append([positions[k:k + block_length] for k in range(0, len(positions), block_length)])
    return layout


def check_block_sample(result, completion, index, num_samples, block_length):
    """The structure every block-wise sample must have; returns the selected block of each row."""
    from daca_kernels.likelihood.ratio_masks import BlockElboMask

    assert isinstance(result, BlockElboMask)
    scored, masked, t = result.scored, result.masked, result.t
    assert scored.dtype == masked.dtype == torch.bool and scored.shape == masked.shape == completion.shape
    assert t.dtype == torch.float64 and t.shape == completion.shape[:1]
    assert not (masked & ~completion).any(), "a position outside the completion was masked"
    assert not (scored & ~masked).any(), "a scored position must be masked in the model input"
    selected = []
    for b, blocks in enumerate(block_layout(completion, block_length)):
        if not blocks:
            assert not masked[b].any() and t[b] == 1.0
            selected.append(None)
            continue
        with_scored = [k for k, block in enumerate(blocks) if scored[b, block].any()]
        assert len(with_scored) == 1, f"row {b}: blocks {with_scored} have scored positions, expected exactly one"
        c = with_scored[0]
        for k, block in enumerate(blocks):
            if k < c:
                assert not masked[b, block].any(), f"row {b}: block {k} before the selected {c} was masked"
            elif k > c:
                assert masked[b, block].all(), f"row {b}: block {k} after the selected {c} is not fully masked"
        block = blocks[c]
        assert torch.equal(masked[b, block], scored[b, block]), "inside the selected block masked = scored"
        m, s = int(scored[b].sum()), len(block)
        # u lies in (j / N, (j + 1) / N), so m = ceil(u s) does too (scaled by s), and m >= 1.
        assert 1 <= m <= s and index * s / num_samples < m <= -(-(index + 1) * s // num_samples)
        assert t[b].item() == m / (len(blocks) * s)
        if all(len(other) == block_length for other in blocks):
            assert t[b].item() == m / int(completion[b].sum()), "full blocks: t is the scored fraction"
        selected.append(c)
    return selected


def ragged_completion(batch, length, seed):
    """Completions of varied lengths and starts (some rows empty, one not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        start = int(torch.randint(0, length, (1,), generator=g))
        stop = int(torch.randint(start, length + 1, (1,), generator=g))
        completion[b, start:stop] = True
    if batch > 1 and length > 6:
        completion[1, 2:length:3] = True
    return completion


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 40),
    density=st.sampled_from([0.0, 0.4, 0.9, 1.0]),
    seed=st.integers(0, 2**64 - 1),
    num_samples=st.integers(1, 5),
    block_length=st.integers(1, 12),
    row_offset=st.sampled_from([0, 1, 77, 2**32 - 8]),
    data=st.data(),
)
def test_block_elbo_mask_matches_the_reference(batch, length, density, seed, num_samples, block_length, row_offset, data):
    from daca_kernels.likelihood.ratio_masks import block_elbo_mask
    from daca_kernels.reference import masking

    index = data.draw(st.integers(0, num_samples - 1), label="index")
    _, maskable = make_batch(batch, length, density, seed=length + batch)
    before = snapshot(maskable)
    result = block_elbo_mask(maskable, seed, index, num_samples, block_length, row_offset=row_offset)
    assert_unchanged(before, maskable)
    scored, masked, t = masking.block_elbo_mask(maskable, seed, index, num_samples, block_length, row_offset=row_offset)
    assert torch.equal(result.scored, scored) and torch.equal(result.masked, masked) and torch.equal(result.t, t)
    check_block_sample(result, maskable, index, num_samples, block_length)


@pytest.mark.parametrize("block_length", [1, 3, 4, 32])
def test_block_elbo_samples_have_the_block_structure(block_length):
    from daca_kernels.likelihood.ratio_masks import block_elbo_mask

    completion = ragged_completion(6, 26, seed=block_length)
    completion[3] = False
    selections = []  # per seed: the selected block of each row, per sample
    for seed in range(12):
        per_sample = []
        for index in range(3):
            result = block_elbo_mask(completion, seed, index, 3, block_length)
            per_sample.append(check_block_sample(result, completion, index, 3, block_length))
        selections.append(per_sample)
    if block_length < int(completion.sum(1).max()):
        assert any(len({s[b] for s in per_sample}) > 1 for per_sample in selections for b in range(6)), (
            "the samples of a row must draw their blocks independently"
        )


def test_one_block_is_the_plain_elbo_mask():
    from daca_kernels.likelihood.ratio_masks import block_elbo_mask, elbo_mask

    completion = ragged_completion(5, 30, seed=1)
    longest = int(completion.sum(1).max())
    for seed in (0, 9, 2**50 + 1):
        for index in range(4):
            mask, t = elbo_mask(completion, seed, index, 4, row_offset=3)
            for block_length in (longest, longest + 5):
                result = block_elbo_mask(completion, seed, index, 4, block_length, row_offset=3)
                assert torch.equal(result.scored, mask) and torch.equal(result.masked, mask) and torch.equal(result.t, t)


def test_block_selection_is_uniform_and_the_weighted_sum_is_unbiased():
    # A per-token value table that does not depend on the mask: 1/t times the scored sum must
    # average to the sum over the row. The layout has a one-token last block carrying a large
    # value, where weighting by the scored fraction |scored| / n instead would be far off.
    from daca_kernels.likelihood.ratio_masks import block_elbo_mask

    block_length, rows, num_samples = 4, 64, 2
    completion = torch.zeros(rows, 14, dtype=torch.bool)
    completion[:, 3:12] = True  # n = 9: blocks of 4, 4 and 1
    values = torch.rand(14, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1
    values[11] = 10.0
    truth = values[completion[0]].sum().item()
    estimates, naive, selected = [], [], torch.zeros(3)
    for seed in range(40):
        for index in range(num_samples):
            result = block_elbo_mask(completion, seed, index, num_samples, block_length)
            total = (result.scored * values).sum(1)
            estimates.append(total / result.t)
            naive.append(total * 9 / result.scored.sum(1))
            first_scored = result.scored.long().argmax(1)
            selected += torch.bincount((first_scored - 3) // block_length, minlength=3)
    estimates, naive = torch.cat(estimates), torch.cat(naive)
    assert (selected > 0).all(), f"some block was never selected: {selected.tolist()}"
    share = selected / selected.sum()
    assert ((share - 1 / 3).abs() < 0.04).all(), f"block selection far from uniform: {share.tolist()}"
    error = estimates.std().item() / len(estimates) ** 0.5
    assert abs(estimates.mean().item() - truth) < 5 * error, (estimates.mean().item(), truth, error)
    assert abs(naive.mean().item() - truth) > 20 * error, "the test cannot tell the weights apart"


def test_block_elbo_mask_of_a_shard_with_its_row_offset_is_that_of_its_rows(monkeypatch):
    from daca_kernels.likelihood.ratio_masks import block_elbo_mask
    from daca_kernels.reference import masking

    completion = ragged_completion(7, 23, seed=2)
    completion[4] = False
    monkeypatch.setattr(mask_op, "CHUNK_POSITIONS", 40)  # the ranks of the whole batch span chunks
    for seed, (lo, hi) in SHARDS:
        part = completion[lo:hi]
        for index in range(3):
            whole = block_elbo_mask(completion, seed, index, 3, 4)
            shard = block_elbo_mask(part, seed, index, 3, 4, row_offset=lo)
            expected = masking.block_elbo_mask(part, seed, index, 3, 4, row_offset=lo)
            for got, full, want in zip((shard.scored, shard.masked, shard.t), (whole.scored, whole.masked, whole.t), expected):
                assert torch.equal(got, full[lo:hi]) and torch.equal(got, want)
    whole = block_elbo_mask(completion, 5, 0, 3, 4)
    assert not torch.equal(block_elbo_mask(completion[3:], 5, 0, 3, 4).masked, whole.masked[3:])
    assert not torch.equal(block_elbo_mask(completion, 6, 0, 3, 4).masked, whole.masked), "the seed must matter"
    assert not torch.equal(block_elbo_mask(completion, 5, 1, 3, 4).masked, whole.masked), "the sample must matter"


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(block_length=0), ValueError, "block_length must be >= 1, got 0"),
        (dict(block_length=-3), ValueError, "block_length must be >= 1, got -3"),
        (dict(block_length=2.0), TypeError, "block_length must be an int, got float"),
        (dict(block_length=True), TypeError, "block_length must be an int, got bool"),
        (dict(block_length=None), TypeError, "block_length must be an int, got NoneType"),
        (dict(index=2), ValueError, r"index must lie in \[0, num_samples\)"),
        (dict(num_samples=0, index=0), ValueError, "num_samples must be >= 1"),
        (dict(completion_mask=lambda c: c.long()), TypeError, "completion_mask must have dtype"),
        (dict(completion_mask=lambda c: c[0]), ValueError, "completion_mask must be 2-D"),
        (dict(seed=-1), ValueError, "seed must lie in"),
        (dict(row_offset=-1), ValueError, "row_offset must be >= 0"),
    ],
)
def test_block_elbo_mask_refuses_bad_input_by_name(kwargs, error, message):
    from daca_kernels.likelihood.ratio_masks import block_elbo_mask

    _, completion = make_batch(2, 9, 0.5, seed=0)
    before = snapshot(completion)
    args = dict(completion_mask=completion, seed=0, index=1, num_samples=2, block_length=3)
    args.update({k: v(completion) if callable(v) else v for k, v in kwargs.items()})
    with pytest.raises(error, match=message):
        block_elbo_mask(
            args.pop("completion_mask"), args.pop("seed"), args.pop("index"), args.pop("num_samples"),
            args.pop("block_length"), **args,
        )
    assert_unchanged(before, completion)
