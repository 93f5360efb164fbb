"""The small transformer and data the torch examples train (ddp.py, fsdp2.py).

A decoder-only language model on synthetic token streams: every rank draws its own batches from
a generator seeded with its rank, so runs are repeatable and ranks see different data. The
checksum is a SHA-256 of every parameter's bytes, in order: equal checksums mean bitwise equal
parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer(
            "mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x, self.mask[: tokens.shape[1], : tokens.shape[1]])
        return self.head(self.ln(x))


def arguments(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", default="ringzero", help="torch.distributed backend (ringzero, gloo)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--save", help="rank 0 saves the final parameters here (torch.save)")
    return p.parse_args()


def setup(args: argparse.Namespace) -> tuple[int, int]:
    # Repeatable on CPU: one intra-op thread per rank (torchrun sets OMP_NUM_THREADS=1 too).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(args.backend)
    return dist.get_rank(), dist.get_world_size()


def make_model(args: argparse.Namespace) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(args.vocab, args.dim, args.heads, args.layers, args.seq)


def batches(args: argparse.Namespace, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        # A learnable stream: each token is the previous one plus a small step, mod vocab.
        start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
        steps = torch.randint(1, 4, (args.batch, args.seq + 1), generator=g)
        seq = (start + steps.cumsum(1)) % args.vocab
        yield seq[:, :-1], seq[:, 1:]


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def checksum(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class timer:
    """Wall time of the steps after the warm-up ones, for tokens/s and the step time."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.steps = 0
        self.start = 0.0

    def step(self, step: int) -> None:
        if step == self.warmup:
            self.start = time.perf_counter()
            self.steps = 0
        elif step > self.warmup:
            self.steps += 1

    def report(self, args: argparse.Namespace, world: int) -> tuple[float, float]:
        secs = time.perf_counter() - self.start
        step_ms = 1e3 * secs / max(self.steps, 1)
        tokens = self.steps * args.batch * args.seq * world
        return step_ms, tokens / secs if secs > 0 else 0.0
