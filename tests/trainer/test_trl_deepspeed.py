"""``DiffusionGRPOTrainer`` under DeepSpeed ZeRO-2 and ZeRO-3 (``accelerate launch`` with the configs of
examples/, two gloo CPU processes, ``--mixed_precision no``), on the released Dream (full attention) and
SDAR (block diffusion) files: one step equals one process on the same global batch, for grpo (SML, DPS,
``beta > 0``, the reference model partitioned like the policy) and BGPO; under ZeRO-3 the LM head is
partitioned during training and its update equals one process's, a rollout gathers the parameters once,
a resumed run and its reloaded checkpoint equal the uninterrupted run, and a configuration the trainer
cannot run is refused at construction. Each process count is one run of tests/trl_deepspeed.py.

The updates are SGD steps (learning rate 1), so an update is the gradient: compared norm-wise per
parameter tensor, relative to float32's machine epsilon (the two runs sum the rows' contributions in
another order: measured at most about 25 eps).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

from released import hub  # noqa: E402

from daca_kernels.trl import zero3  # noqa: E402
from tests.trl_setup import tiny_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD = str(ROOT / "tests" / "trl_deepspeed.py")
# Norm-wise, relative to each tensor's update: 256 float32 epsilons (about 3e-5).
TOLERANCE = 256 * torch.finfo(torch.float32).eps

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_path_one_thread")]


def _run(command: list, env: dict) -> None:
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def _environment() -> dict:
    # DS_ACCELERATOR=cpu: DeepSpeed on the CPU (gloo), whatever devices the machine has.
    return {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu",
            "DACA_BACKEND": "torch", "OMP_NUM_THREADS": "1"}


def _once(tmp_path_factory, name: str, make) -> Path:
    """The folder ``name``, filled by ``make(folder)`` once for the whole session: under pytest-xdist
    every worker shares the folder above its own temporary root, and a worker that needs a run another
    is making waits for it (the runs are the expensive part; each is made once)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / f"deepspeed-{name}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "done").exists():
            folder.mkdir(exist_ok=True)
            make(folder)
            (folder / "done").touch()
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    hub.require("dream"), hub.require("sdar"), hub.require("llada")
    return _once(tmp_path_factory, "checkpoints",
                 lambda folder: _run([sys.executable, CHILD, "--write-checkpoints", str(folder)], _environment()))


@pytest.fixture(scope="module")
def one_process(checkpoints, tmp_path_factory):
    folder = _once(tmp_path_factory, "one", lambda folder: _run([sys.executable, CHILD, str(folder), str(checkpoints)],
                                                                 _environment()))
    return torch.load(folder / "results.pt")


def _launch(config: str, checkpoints: Path, *flags: str):
    # The examples' configs as written, on two processes; --mixed_precision no: the CPU runs in float32
    # (the trainer's bf16=False).
    def make(folder: Path) -> None:
        _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "examples" / config),
              "--num_processes", "2", "--mixed_precision", "no", CHILD, str(folder), str(checkpoints), *flags],
             _environment())
    return make


def _results(folder: Path) -> dict:
    results = torch.load(folder / "results.pt")
    assert results["world_size"] == 2
    return results


@pytest.fixture(scope="module")
def zero2_run(checkpoints, tmp_path_factory):
    return _results(_once(tmp_path_factory, "zero2", _launch("zero2.yaml", checkpoints, "--resume")))


@pytest.fixture(scope="module")
def zero3_run(checkpoints, tmp_path_factory):
    return _results(_once(tmp_path_factory, "zero3", _launch("zero3.yaml", checkpoints, "--resume", "--refuse")))


def _assert_same_step(two: dict, one: dict, label: str) -> None:
    """``two``'s parameters after one step moved from ``one``'s initial ones as ``one``'s did."""
    initial = one["initial"]
    for name, want in one["params"].items():
        update = want - initial[name]
        assert update.norm() > 0, f"{label}: {name} did not move"
        got = two["params"][name] - initial[name]
        assert (got - update).norm() <= TOLERANCE * update.norm(), f"{label}: {name}"


def _assert_same_steps(two: dict, one: dict) -> None:
    for (family, objective), params in one["params"].items():
        _assert_same_step({"params": two["params"][(family, objective)]},
                          {"params": params, "initial": one["initial"][family]}, f"{family} {objective}")


def _assert_same_two_steps(two: dict, one: dict) -> None:
    # The second step's KL to the reference model is not zero: the reference (partitioned under
    # ZeRO-3) pulls the update, and the update still equals one process's.
    assert one["straight_kl"][0] == 0 and one["straight_kl"][1] > 0, one["straight_kl"]
    _assert_same_step({"params": two["straight"]}, {"params": one["straight"], "initial": one["initial"]["sdar"]},
                      "sdar, two steps")


def _assert_resumed_and_reloaded(run: dict, one: dict) -> None:
    # Two steps straight through, or one, a checkpoint and a new trainer resuming from it; the model
    # saved at step 2 reloaded from its files. The straight run moved from the checkpoint it started at.
    assert run["resumed_step"] == 2
    for name, want in run["straight"].items():
        assert torch.equal(run["resumed"][name], want), name
        assert torch.equal(run["reloaded"][name], want), name
    assert any(not torch.equal(run["straight"][n], p) for n, p in one["initial"]["sdar"].items())


def test_zero2_steps_resume_and_reload(zero2_run, one_process):
    assert not any(zero2_run["built_partitioned"].values())
    _assert_same_steps(zero2_run, one_process)
    _assert_same_two_steps(zero2_run, one_process)
    _assert_resumed_and_reloaded(zero2_run, one_process)


def test_zero3_one_step_rollouts_head_and_resume(zero3_run, one_process):
    three = zero3_run
    # The LM head (and every parameter) partitioned: the fused op read it gathered inside the
    # forward call, and its gradient reached the partitions (its update equals one process's).
    assert three["head_partitioned"] == {"dream": True, "sdar": True}
    # The reference copy of a policy built whole (Dream's grpo run: loaded before the config; the
    # engine partitions both) and of one built partitioned (the others: loaded under zero.Init).
    built = three["built_partitioned"]
    assert not built[("dream", "grpo")] and built[("dream", "bgpo")] and built[("sdar", "grpo")], built
    _assert_same_steps(three, one_process)
    _assert_same_two_steps(three, one_process)
    # One gather (one collective over every parameter) per rollout, whatever its forwards; the same
    # rollout through DeepSpeed's hooks (ds3_gather_for_generation=False) gathers at its forwards.
    for family, rollouts in three["rollouts"].items():
        assert rollouts and all(gathers == 1 and forwards >= 2 for gathers, forwards in rollouts), (family, rollouts)
    assert all(gathers > 1 for gathers, _ in three["per_forward_rollout"]), three["per_forward_rollout"]
    _assert_resumed_and_reloaded(three, one_process)
    assert "nvme" in three["refused"] and "beta" in three["refused"], three["refused"]


def test_examples_configs_train_released_llada(zero2_run, zero3_run, one_process):
    # The released LLaDA (hub code, from its path): one grpo step under each example config equals
    # one process's (SDAR is in the tests above).
    for name, run in (("one process", one_process), ("zero2", zero2_run), ("zero3", zero3_run)):
        assert "error" not in run["llada"], f"{name}: {run['llada']['error']}"
    for name, run in (("zero2", zero2_run), ("zero3", zero3_run)):
        _assert_same_step(run["llada"], one_process["llada"], f"llada {name}")


def test_zero3_configurations_refused(tmp_path):
    args = tiny_config(str(tmp_path), beta=0.04)
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    with pytest.raises(ValueError, match="nvme"):
        zero3.check_config(nvme, args)
    zero3.check_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, args)
    zero3.check_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}, args)
    zero3.check_config(nvme, tiny_config(str(tmp_path), beta=0.0))
