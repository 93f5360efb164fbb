#!/usr/bin/env python3
"""Draws a merged ringzero trace (ringzero-trace merge) as a timeline picture.

Usage: plot.py MERGED.json OUT.png [--zoom START_MS LENGTH_MS] [--title TEXT]
(needs matplotlib: Debian python3-matplotlib)

Top: the whole run, one row per rank. Bottom: the zoom window (default: a tenth of the run
from its middle), where each collective is a bar labelled with its name and size, and the
wait at entry (how long the rank waited for its first message) is hatched.
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def load(path):
    with open(path) as f:
        events = json.load(f)
    slices = [e for e in events if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in slices})
    return slices, ranks


def human_bytes(b):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{int(b)} B"


def draw(ax, slices, ranks, colors, lo, hi, labels):
    rows = {}
    for r in ranks:
        rows[(r, "phase")] = len(rows)
        rows[(r, "collective")] = len(rows)
    for e in slices:
        kind = "phase" if e.get("cat") == "phase" else "collective"
        start, dur = e["ts"] / 1e3, max(e["dur"] / 1e3, (hi - lo) / 4000)
        if start + dur < lo or start > hi:
            continue
        y = rows[(e["pid"], kind)]
        ax.broken_barh([(start, dur)], (y - 0.4, 0.8), facecolors=colors[e["name"]],
                       edgecolor="black" if labels else "none", linewidth=0.3)
        wait = e.get("args", {}).get("wait_us")
        if labels and wait:
            ax.broken_barh([(start, min(wait / 1e3, dur))], (y - 0.4, 0.8), facecolors="none",
                           hatch="////", edgecolor="white", linewidth=0)
        if labels and dur > (hi - lo) / 25:
            text = e["name"]
            b = e.get("args", {}).get("bytes")
            if b:
                text += f"\n{human_bytes(b)}"
            ax.text(start + dur / 2, y, text, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {k}s" for (r, k) in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time (ms, rank 0's clock)")
    ax.grid(axis="x", linewidth=0.3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("merged")
    p.add_argument("out")
    p.add_argument("--zoom", nargs=2, type=float, metavar=("START_MS", "LENGTH_MS"))
    p.add_argument("--title", default="ringzero trace")
    a = p.parse_args()
    slices, ranks = load(a.merged)
    if not slices:
        raise SystemExit(f"{a.merged}: no events")
    names = sorted({e["name"] for e in slices})
    colors = {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    end = max(e["ts"] + e["dur"] for e in slices) / 1e3
    zlo, zlen = a.zoom if a.zoom else (end * 0.5, end * 0.1)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 3.2 + 0.9 * len(ranks)),
                                      gridspec_kw={"height_ratios": [1, 1.6]})
    draw(top, slices, ranks, colors, 0, end, labels=False)
    top.axvspan(zlo, zlo + zlen, color="gold", alpha=0.3)
    top.set_title(f"{a.title}: whole run ({len(ranks)} ranks, {len(slices)} events); "
                  "shaded: the window below")
    draw(bottom, slices, ranks, colors, zlo, zlo + zlen, labels=True)
    bottom.set_title(f"{zlen:.1f} ms from {zlo:.1f} ms (hatched: wait at entry for the first "
                     "message)")
    fig.legend(handles=[Patch(color=colors[n], label=n) for n in names], loc="upper right",
               ncol=min(len(names), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
