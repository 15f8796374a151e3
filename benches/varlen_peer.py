#!/usr/bin/env python3
"""PyTorch's peers of benches/varlen.rs: the same drawn lengths, shapes and columns.

Rows (`impl`): `torch-varlen` (`torch.nn.attention.varlen.varlen_attn` where this PyTorch has
it: packed `[T, H, D]` with cumulative lengths), `sdpa-dense` (`scaled_dot_product_attention`
on `[T / 4096, H, 4096, D]`, flash backend), `sdpa-padded` (the padded batch `[n, H, max, D]`
with a bool key padding mask, the backends that take a mask: cuDNN, then memory-efficient).
FLOP as varlen.rs: the useful `Σ 4·H·l²·D` (halved when causal) except `sdpa-dense`; ×3.5 for a
training step. Timing as benches/sdpa.py: 3 warm-up calls, passes of calls lasting ≥ 10 ms,
the median per call, wall (host clock between syncs) and device (CUDA events).

    python3 benches/varlen_peer.py --out DIR [--tokens 65536] [--lengths 64,4096] [--seed 7]
"""

import argparse
import csv
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def draw_lengths(tokens, lo, hi, seed):
    """benches/varlen.rs's draw: SplitMix64 from `seed`, uniform in lo..=hi, the last cut."""
    mask = (1 << 64) - 1
    state = seed

    def nxt():
        nonlocal state
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    lengths, left = [], tokens
    while left >= lo:
        length = min(lo + nxt() % (hi - lo + 1), left)
        lengths.append(length)
        left -= length
    return lengths


def measure(call, passes=10, max_calls=50):
    """3 warm-up calls, `passes` passes of calls lasting ≥ 10 ms (at most `max_calls`): the
    median per call, wall (host clock between syncs) and device (CUDA events)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    one = time.perf_counter() - start
    calls = max(1, min(max_calls, math.ceil(0.01 / max(one, 1e-9))))
    wall, device = [], []
    for _ in range(passes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) / calls)
        del out
    for _ in range(passes):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(calls):
            out = call()
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end) / 1e3 / calls)
        del out
    return statistics.median(wall), statistics.median(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="target/bench")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--lengths", default="64,4096")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", default="false,true")
    p.add_argument("--modes", default="fwd,train")
    a = p.parse_args()
    lo, hi = map(int, a.lengths.split(","))
    lengths = draw_lengths(a.tokens, lo, hi, a.seed)
    tokens, mx, n = sum(lengths), max(lengths), len(lengths)
    print(f"{n} sequences, {tokens} tokens (seed {a.seed}): {lengths}")
    h, d, dt, dev = a.heads, a.dim, torch.bfloat16, "cuda"
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lengths)), dtype=torch.int32, device=dev)
    dense_len = min(hi, tokens)
    dense_b = tokens // dense_len
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        varlen_attn = None
        why_varlen = f"{type(e).__name__}: {e}"
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "varlen_peer.csv")
    rows = []
    for causal in [c == "true" for c in a.causal.split(",")]:
        useful = sum(4.0 * h * d * l * l for l in lengths) * (0.5 if causal else 1.0)
        dense = 4.0 * dense_b * h * d * dense_len * dense_len * (0.5 if causal else 1.0)
        for mode in a.modes.split(","):
            train = mode == "train"
            for impl in ["torch-varlen", "sdpa-dense", "sdpa-padded"]:
                row = dict(runtime="cuda", dtype="bf16", tokens=tokens, sequences=n, max_len=mx,
                           heads=h, head_dim=d, causal=str(causal).lower(),
                           pass_="fwd+bwd" if train else "fwd", impl=impl, kernel="",
                           wall_ms_median="", TFLOP_per_s="", device_ms_median="",
                           device_TFLOP_per_s="", note="")
                flop = (dense if impl == "sdpa-dense" else useful) * (3.5 if train else 1.0)
                try:
                    if impl == "torch-varlen":
                        if varlen_attn is None:
                            raise RuntimeError(f"not in this PyTorch ({why_varlen})")
                        q, k, v = (torch.randn(tokens, h, d, device=dev, dtype=dt, requires_grad=train) for _ in range(3))

                        import inspect
                        params = inspect.signature(varlen_attn).parameters
                        flag = next((n for n in ("is_causal", "causal") if n in params), None)
                        if flag:
                            kw = {flag: causal}
                        elif causal and "window_size" in params:
                            # torch 2.11: causal is the window (−1, 0) (all keys before, none after).
                            kw = {"window_size": (-1, 0)}
                            row["note"] = "causal as window_size (-1, 0)"
                        elif causal:
                            raise RuntimeError(f"varlen_attn{inspect.signature(varlen_attn)} takes no causal flag")
                        else:
                            kw = {}

                        def fwd():
                            return varlen_attn(q, k, v, cu, cu, mx, mx, **kw)
                        row["kernel"] = "varlen_attn"
                    elif impl == "sdpa-dense":
                        q, k, v = (torch.randn(dense_b, h, dense_len, d, device=dev, dtype=dt, requires_grad=train) for _ in range(3))

                        def fwd():
                            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        row["kernel"] = "flash"
                    else:
                        q, k, v = (torch.randn(n, h, mx, d, device=dev, dtype=dt, requires_grad=train) for _ in range(3))
                        keep = torch.arange(mx, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
                        m = keep[:, None, None, :]
                        if causal:
                            # Bottom-right aligned within each sequence = top-left with the
                            # sequence at the start (Sq = Sk per sequence).
                            m = m & torch.ones(mx, mx, dtype=torch.bool, device=dev).tril()[None, None]

                        def fwd():
                            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                        row["kernel"] = "cudnn|efficient"
                    call = fwd
                    if train:
                        g = None

                        def call():
                            nonlocal g
                            out = fwd()
                            if g is None:
                                g = torch.randn_like(out)
                            (gq,) = torch.autograd.grad(out, [q], g)
                            return gq
                    wall, device = measure(call)
                    row.update(wall_ms_median=f"{wall * 1e3:.4g}", TFLOP_per_s=f"{flop / wall / 1e12:.4g}",
                               device_ms_median=f"{device * 1e3:.4g}",
                               device_TFLOP_per_s=f"{flop / device / 1e12:.4g}")
                except Exception as e:  # noqa: BLE001
                    row["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(row)
                rows.append(row)
                torch.cuda.empty_cache()
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
