#!/usr/bin/env python3
"""Plots ringzero-model's CSV (--csv): all_reduce bus bandwidth at 8 GiB against node count,
one panel per fabric, one line per algorithm, and the published points.

Usage: plot.py MODEL.csv OUT.png   (needs matplotlib: Debian python3-matplotlib)
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "ring": "ring (one channel)",
    "tree": "double binary tree",
    "rd": "recursive doubling",
    "rhd": "Rabenseifner",
    "hier": "hierarchical",
    "striped": "ring striped over all NICs (NCCL-style)",
    "published": "published (nccl-tests)",
}


def main(source, target):
    data = {}
    with open(source) as f:
        for row in csv.DictReader(f):
            series = data.setdefault(row["fabric"], {}).setdefault(row["algorithm"], [])
            series.append((int(row["nodes"]), float(row["busbw_GBps"])))
    fig, axes = plt.subplots(1, len(data), figsize=(7 * len(data), 5), squeeze=False)
    for ax, (fabric, by_algo) in zip(axes[0], sorted(data.items())):
        for algo, points in by_algo.items():
            points.sort()
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            if algo == "published":
                ax.plot(xs, ys, "ko", label=LABELS[algo])
            else:
                ax.plot(xs, ys, "-", marker=".", linewidth=2.2 if algo in ("hier", "striped") else 1.2,
                        label=LABELS.get(algo, algo))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{fabric}: all_reduce 8 GiB, predicted bus bandwidth")
        ax.set_xlabel("nodes (8 GPUs each)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=100)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
