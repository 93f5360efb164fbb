"""FSDP2 (fully_shard) over ringzero: a small transformer sharded across CPU ranks.

    torchrun --nproc-per-node 2 examples/torch/fsdp2.py                 # over ringzero
    torchrun --nproc-per-node 4 examples/torch/fsdp2.py --backend gloo  # the same over gloo

Each block and the whole model are sharded with fully_shard: parameters are gathered
(all_gather_into_tensor) before each block runs and gradients reduce-scattered
(reduce_scatter_tensor) after. Rank 0 prints the loss every step (the curve to compare between
backends), a checksum of the full parameters at the end, the step time and tokens/s.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from model import arguments, batches, checksum, loss_of, make_model, setup, timer


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, world = setup(args)
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(args)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(args, rank)
    clock = timer(args.warmup)
    for step in range(args.steps):
        clock.step(step)
        inputs, targets = next(data)
        loss = loss_of(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # The mean loss over ranks: the curve that must match between backends.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:3d} loss {mean.item() / world:.6f}", flush=True)
    step_ms, tokens_s = clock.report(args, world)
    full = [p.full_tensor() for p in model.parameters()]
    digest = checksum(full)
    if rank == 0 and args.save:
        torch.save([t.detach() for t in full], args.save)
    if rank == 0:
        print(f"backend {args.backend} ranks {world} checksum {digest}")
        print(f"step {step_ms:.2f} ms tokens/s {tokens_s:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
