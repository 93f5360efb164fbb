"""torch.distributed over ringzero against gloo, and against ringzero-perf on the same transport.

    build/torch-venv/bin/python bench/torch/bench.py                       # 2 and 4 ranks
    build/torch-venv/bin/python bench/torch/bench.py --ranks 2 --max 16M \\
        --perf build/bench/tools/perf/ringzero-perf --run build/bench/tools/run/ringzero-run
    build/torch-venv/bin/python bench/torch/bench.py --ddp                 # the DDP example too
    build/torch-venv/bin/python bench/torch/bench.py --binding             # per-call cost, 1 rank

For each world size it starts the ranks once, with a process group of every backend, and times
each row over the backends in turn, in interleaved rounds (the median kept), so whatever else
loads the machine falls on all of them alike: float32 all_reduce,
all_gather_into_tensor and reduce_scatter_tensor from --min to --max bytes, as nccl-tests sizes
them (the whole buffer: all_reduce's, all_gather's output, reduce_scatter's input). A round's time
is the slowest rank's mean per call over a loop filling --seconds / --rounds, after warm-up
calls; bus bandwidth is nccl-tests' (docs/performance.md). With --perf and --run, ringzero-perf measures the
same collectives on the transport the backend picked (shm on one host), the first backend is also
timed through its backend object (`backend.allreduce([t]).wait()`, torch's Python layer left out),
and the table shows what the binding adds per call (the backend call less ringzero-perf's time)
and what torch.distributed's own layer adds on top (the dist call less the backend call).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
PERF_NAMES = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter"}


def size_arg(v: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", v)
    if not m:
        raise argparse.ArgumentTypeError(f"'{v}' is not a size (8, 64K, 256M)")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def human(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def busbw_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def elements(op: str, size: int, n: int) -> int:
    # float32 elements of the whole buffer, a multiple of n so that every rank's block is whole.
    count = max(size // 4, 1)
    return max(n, count - count % n) if op != "all_reduce" else count


def time_op(op: str, size: int, n: int, group, seconds: float, warmup: int,
            direct: bool = False) -> float:
    """Mean seconds per call over a loop filling `seconds`: the slowest rank's. `direct` calls the
    backend object and waits on its work, leaving torch.distributed's Python layer out."""
    count = elements(op, size, n)
    full = torch.ones(count)
    part = torch.ones(count // n) if op != "all_reduce" else None
    be = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
    # Blocking calls, as dist's are with async_op=False (the options' default is asynchronous).
    ar, ag, rs = (dist.AllreduceOptions(), torch._C._distributed_c10d.AllgatherOptions(),
                  dist.ReduceScatterOptions())
    for o in (ar, ag, rs):
        o.asyncOp = False

    def call():
        if direct:
            if op == "all_reduce":
                be.allreduce([full], ar).wait()
            elif op == "all_gather_into_tensor":
                be._allgather_base(full, part, ag).wait()
            else:
                be._reduce_scatter_base(part, full, rs).wait()
        elif op == "all_reduce":
            dist.all_reduce(full, group=group)
        elif op == "all_gather_into_tensor":
            dist.all_gather_into_tensor(full, part, group=group)
        else:
            dist.reduce_scatter_tensor(part, full, group=group)

    for _ in range(warmup):
        call()
    # Calibrate on rank 0, then every rank runs the same number of calls.
    dist.barrier(group=group)
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    iters = torch.tensor([max(3, min(100000, int(seconds / max(once, 1e-7))))], dtype=torch.int64)
    dist.broadcast(iters, 0, group=group)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(int(iters.item())):
        call()
    mean = torch.tensor([(time.perf_counter() - start) / int(iters.item())], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
    return mean.item()


def worker(rank: int, n: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # Every backend's group at once, and the rows interleaved: for each size, a round of each
    # backend in turn, --rounds times, the median round kept. Whatever else loads the machine
    # then falls on every backend alike.
    dist.init_process_group(args.backends[0], rank=rank, world_size=n)
    groups = {args.backends[0]: None}
    for b in args.backends[1:]:
        groups[b] = dist.new_group(backend=b)
    results = []
    size = args.min
    while size <= args.max:
        for op in args.ops:
            # With --perf, the first backend is also timed through its backend object: what the
            # binding costs, torch's own Python layer apart.
            paths = [(b, False) for b in args.backends] + ([(args.backends[0], True)]
                                                           if args.perf else [])
            times = {p: [] for p in paths}
            for _ in range(args.rounds):
                for b, direct in paths:
                    times[(b, direct)].append(time_op(op, size, n, groups[b],
                                                      args.seconds / args.rounds, args.warmup,
                                                      direct))
            for b, direct in paths:
                results.append({"backend": b + (" direct" if direct else ""), "ranks": n,
                                "op": op, "bytes": size,
                                "us": statistics.median(times[(b, direct)]) * 1e6})
        size *= args.factor
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perf_rows(args: argparse.Namespace, n: int, op: str) -> dict[int, float]:
    """ringzero-perf's time (us) per size, on the shm transport: in place for all_reduce, out of
    place for the others, as torch calls them."""
    cmd = [args.run, "-n", str(n), "--", args.perf, PERF_NAMES[op], "-T", "shm", "-d", "float",
           "-b", str(args.min), "-e", str(args.max), "-f", str(args.factor), "-n", "50", "-w", "5",
           "-c", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    rows = {}
    for line in out.stdout.splitlines():
        cols = line.split()
        if len(cols) > 6 and cols[0].isdigit():
            rows[int(cols[0])] = float(cols[9] if op == "all_reduce" else cols[5])
    return rows


def binding(args: argparse.Namespace) -> None:
    """Per-call cost on one rank, where a collective waits for nobody: float32 all_reduce of 8
    bytes through dist.all_reduce and through the backend object (torch's Python layer left
    out), the median of 5 loops of 20,000 calls."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group(args.backends[0], rank=0, world_size=1)
    groups = {args.backends[0]: dist.group.WORLD}
    for b in args.backends[1:]:
        groups[b] = dist.new_group(backend=b)
    t = torch.ones(2)

    def per_call(f, n=20000):
        for _ in range(1000):
            f()
        loops = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                f()
            loops.append((time.perf_counter() - start) / n * 1e6)
        return statistics.median(loops)

    print("\n## per-call cost on one rank (us): dist.all_reduce, backend.allreduce().wait()\n")
    for b, g in groups.items():
        be = g._get_backend(torch.device("cpu"))
        opts = dist.AllreduceOptions()
        opts.asyncOp = False  # as dist.all_reduce's blocking call
        print(f"| {b} | {per_call(lambda: dist.all_reduce(t, group=g)):.2f} | "
              f"{per_call(lambda: be.allreduce([t], opts).wait()):.2f} |")
    dist.destroy_process_group()


def ddp_step_times(args: argparse.Namespace, n: int) -> dict[str, float]:
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch", "ddp.py")
    times = {}
    for backend in args.backends:
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), script,
             "--backend", backend, "--steps", str(args.ddp_steps)],
            capture_output=True, text=True, timeout=1800,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
        m = re.search(r"step ([\d.]+) ms tokens/s (\d+)", out.stdout)
        if not m:
            raise RuntimeError(f"ddp.py over {backend} failed:\n{out.stdout}\n{out.stderr}")
        times[backend] = float(m.group(1))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--backends", nargs="+", default=["ringzero", "gloo"])
    p.add_argument("--min", type=size_arg, default=8)
    p.add_argument("--max", type=size_arg, default=256 << 20)
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--seconds", type=float, default=0.3, help="time to fill per row and backend")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row; the median")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--perf", help="ringzero-perf, to compare the binding with")
    p.add_argument("--run", help="ringzero-run, to start ringzero-perf's ranks")
    p.add_argument("--ddp", action="store_true", help="also time the DDP example's steps")
    p.add_argument("--ddp-steps", type=int, default=30)
    p.add_argument("--json", help="write every row here too")
    p.add_argument("--binding", action="store_true",
                   help="only the per-call cost on one rank, in this process")
    args = p.parse_args()
    if bool(args.perf) != bool(args.run):
        p.error("--perf and --run go together")

    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, torch {torch.__version__}")
    if args.binding:
        binding(args)
        return
    rows = []
    for n in args.ranks:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = mp.start_processes(worker, args=(n, free_port(), args, queue), nprocs=n, join=False,
                                   start_method="spawn")
        got = queue.get()
        procs.join()
        perf = {op: perf_rows(args, n, op) for op in args.ops} if args.perf else {}
        by = {(r["backend"], r["op"], r["bytes"]): r["us"] for r in got}
        for op in args.ops:
            print(f"\n## {op}, {n} ranks (float32; time in us, busbw in GB/s)\n")
            head = ["bytes"]
            for b in args.backends:
                head += [f"{b} us", f"{b} busbw"]
            if len(args.backends) > 1:
                head += [f"{args.backends[0]}/{args.backends[1]} busbw"]
            if perf:
                head += ["ringzero-perf us", f"{args.backends[0]} backend call us", "binding us",
                         "torch.distributed layer us"]
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            size = args.min
            while size <= args.max:
                line = [human(size)]
                bw = []
                for b in args.backends:
                    us = by[(b, op, size)]
                    busbw = size / (us * 1e-6) / 1e9 * busbw_factor(op, n)
                    bw.append(busbw)
                    line += [f"{us:.1f}", f"{busbw:.3f}"]
                if len(args.backends) > 1:
                    # The bandwidth ratio is the inverse time ratio (same bytes), which also
                    # holds on one rank, where bus bandwidth is 0.
                    line.append(f"{by[(args.backends[1], op, size)] / by[(args.backends[0], op, size)]:.2f}x")
                row = {"ranks": n, "op": op, "bytes": size,
                       **{f"{b}_us": by[(b, op, size)] for b in args.backends}}
                if perf:
                    # binding: the backend call less ringzero-perf's; the layer: dist's call less
                    # the backend call (torch's Python, paid alike by every backend).
                    pus = perf[op].get(size)
                    dus = by[(args.backends[0] + " direct", op, size)]
                    line += [f"{pus:.1f}" if pus is not None else "-", f"{dus:.1f}",
                             f"{dus - pus:.1f}" if pus is not None else "-",
                             f"{by[(args.backends[0], op, size)] - dus:.1f}"]
                    row["perf_us"] = pus
                    row["direct_us"] = dus
                print("| " + " | ".join(line) + " |")
                rows.append(row)
                size *= args.factor
        if args.ddp:
            t = ddp_step_times(args, n)
            print(f"\nDDP example ({n} ranks, {args.ddp_steps} steps): step time "
                  + ", ".join(f"{b} {ms:.1f} ms" for b, ms in t.items()))
            rows.append({"ranks": n, "ddp_step_ms": t})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
