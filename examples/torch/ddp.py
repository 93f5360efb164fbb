"""DistributedDataParallel over ringzero: a small transformer trained on CPU.

    torchrun --nproc-per-node 2 examples/torch/ddp.py                 # over ringzero
    torchrun --nproc-per-node 2 examples/torch/ddp.py --backend gloo  # the same over gloo

The only ringzero-specific line is the backend's name: torch finds "ringzero" through the
installed ringzero-torch package's entry point. Rank 0 prints the loss, a checksum of the
final parameters (equal to gloo's, bit for bit, on 2 ranks: each gradient element is one
addition of two terms, the same in any order), the step time and tokens/s.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import arguments, batches, checksum, loss_of, make_model, setup, timer


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, world = setup(args)
    model = DDP(make_model(args))
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
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d} loss {loss.item():.6f}", flush=True)
    step_ms, tokens_s = clock.report(args, world)
    params = [p.detach() for p in model.module.parameters()]
    digest = checksum(params)
    if rank == 0 and args.save:
        torch.save(params, args.save)
    if rank == 0:
        print(f"backend {args.backend} ranks {world} checksum {digest}")
        print(f"step {step_ms:.2f} ms tokens/s {tokens_s:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
