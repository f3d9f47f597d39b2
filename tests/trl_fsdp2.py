"""Child of tests/trainer/test_trl_trainer.py, run with ``torch.distributed.run --nproc_per_node 2`` (gloo,
CPU): the tiny policy sharded with FSDP2 (``fully_shard`` on each decoder layer and on the root,
which then owns the embeddings and the LM head), the SML estimate of each process's rows computed
through :func:`daca_kernels.trl.run_as_forward` and back-propagated. Process 0 saves to ``argv[1]``
the estimates of both processes' rows and the full gradients (``DTensor.full_tensor``), and whether
the same estimate outside a forward call fails on the sharded head."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from daca_kernels.likelihood import estimate_logprob
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.trl import run_as_forward
from integration.model import build_model
from integration.tasks import vocab
from tests.trl_setup import ROWS, TINY, estimator_batch


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(TINY, 0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids, completion, answer = estimator_batch()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)

    def estimate():
        lm = MaskedLM.from_hf(model, mask_id=vocab.mask_id, verify=False)
        return estimate_logprob(lm, ids[rows], completion[rows], answer[rows], None, estimator="stratified", num_strata=2,
                                seed=7, row_offset=rows.start)

    try:
        estimate()
        outside = "ran"
    except Exception as error:  # the sharded head is a DTensor shard of [V / P, H] outside a forward
        outside = type(error).__name__
    logp = run_as_forward(model, model, estimate)
    # Each process's share of the loss on the whole batch (FSDP2 averages the gradients).
    (logp.sum() * world / ROWS).backward()
    gathered = [None] * world
    dist.all_gather_object(gathered, logp.detach())
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save({"world_size": world, "logp": torch.cat(gathered), "grads": grads, "outside": outside}, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DACA_BACKEND", "torch")
    main()
    # Leave without running C++ static destructors: at interpreter exit a worker thread of this
    # torch's CPU distributed stack is sometimes still joinable, and its destructor calls
    # std::terminate ("terminate called without an active exception", SIGABRT) after the results
    # were saved and the process group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
