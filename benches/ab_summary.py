#!/usr/bin/env python3
"""Summary of a `benches/ab.sh` run: for every burn-flash row of the attention, softmax and
softmax(X)·V CSVs, the device figure of each round of build A and of build B, their medians,
and B / A. A difference smaller than the spread between one build's rounds is noise.

Usage: python3 benches/ab_summary.py AB_DIR   (AB_DIR holds a-r1/, b-r1/, a-r2/, ...)
"""

import csv
import os
import statistics
import sys

# (file, key columns, figure column, which rows): burn-flash's own rows only.
TABLES = [
    (
        "attention.csv",
        ["dtype", "head_dim", "seq", "causal", "pass"],
        "device_TFLOP_per_s",
        lambda r: r["impl"] == "burn-flash",
    ),
    (
        "softmax.csv",
        ["dtype", "N", "direction", "impl"],
        "device_GB_per_s",
        lambda r: r["impl"].startswith("burn-flash"),
    ),
    (
        "softmax_matmul.csv",
        ["d2", "impl", "BLOCK"],
        "device_TFLOP_per_s",
        lambda r: r["impl"].startswith("burn_flash"),
    ),
    (
        "softmax_matmul_lowp.csv",
        ["dtype", "d2", "impl"],
        "device_TFLOP_per_s",
        lambda r: r["impl"].startswith("burn_flash"),
    ),
    (
        "softmax_matmul_backward.csv",
        ["dtype", "d2", "impl"],
        "device_TFLOP_per_s",
        lambda r: r["impl"].startswith("burn_flash"),
    ),
]


def rounds(root, side):
    found = sorted(d for d in os.listdir(root) if d.startswith(side + "-r"))
    return [os.path.join(root, d) for d in found]


def read(path, keys, figure, keep):
    out = {}
    if not os.path.exists(path):
        return out
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not keep(row) or not row.get(figure):
                continue
            out[tuple(row.get(k, "") for k in keys)] = float(row[figure])
    return out


def main(root):
    for name, keys, figure, keep in TABLES:
        per_side = {}
        for side in "ab":
            per_side[side] = [
                read(os.path.join(d, name), keys, figure, keep) for d in rounds(root, side)
            ]
        every = sorted(
            {k for side in per_side.values() for r in side for k in r},
            key=lambda k: tuple((0, int(x)) if x.isdigit() else (1, x) for x in k),
        )
        if not every:
            continue
        print(f"\n{name}: {figure} (A rounds | B rounds | B/A of the medians)")
        print("  " + ", ".join(keys))
        ratios = []
        for k in every:
            a = [r[k] for r in per_side["a"] if k in r]
            b = [r[k] for r in per_side["b"] if k in r]
            if not a or not b:
                print(f"  {k}: A {a} B {b} (missing)")
                continue
            ratio = statistics.median(b) / statistics.median(a)
            ratios.append(ratio)
            fmt = lambda xs: " ".join(f"{x:.1f}" for x in xs)
            print(f"  {', '.join(k)}: {fmt(a)} | {fmt(b)} | {ratio:.3f}")
        if ratios:
            print(
                f"  B/A over {len(ratios)} rows: median {statistics.median(ratios):.3f}, "
                f"min {min(ratios):.3f}, max {max(ratios):.3f}"
            )


if __name__ == "__main__":
    main(sys.argv[1])
