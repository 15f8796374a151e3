#!/usr/bin/env python3
"""PyTorch's peers of benches/decode.rs: the same shapes and columns.

Rows (`impl`): `torch-copy` (a device copy of the KV cache's bytes, read and written),
`sdpa` (`scaled_dot_product_attention(q [B, Hq, 1, D], k [B, Hkv, S, D], v, enable_gqa=True)`,
the backend PyTorch picks), `sdpa-repeat` (keys and values repeated per query head outside the
timed region, then SDPA: the flash backend, which needs equal heads), and
`flash_attn_with_kvcache` where the `flash_attn` package is installed (contiguous caches).
`kv_GB_per_s` = the bytes of K and V read per second (copy: read + written), `pct_of_copy`
against `torch-copy` of the same run. Timing: benches/varlen_peer.py's `measure` (3 warm-up calls,
passes of calls lasting ≥ 10 ms, the median per call, wall (host clock between syncs) and device
(CUDA events), at most 200 calls a pass).

    python3 benches/decode_peer.py --out DIR [--batches 1,8,32,64] [--contexts 1024,...]
"""

import argparse
import csv
import os

import torch
import torch.nn.functional as F

from varlen_peer import measure


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="target/bench")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="1024,8192,32768,131072")
    p.add_argument("--heads", default="32x8")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--passes", type=int, default=10)
    a = p.parse_args()
    hq, hkv = (int(x) for x in a.heads.split("x"))
    d = a.dim
    dtype = torch.bfloat16
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: PLC0415
    except ImportError:
        flash_attn_with_kvcache = None
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "decode_peer.csv")
    cols = ["runtime", "dtype", "batch", "context", "heads_q", "heads_kv", "head_dim", "impl",
            "kernel", "wall_ms_median", "kv_GB_per_s", "pct_of_copy", "device_ms_median",
            "device_kv_GB_per_s", "device_pct_of_copy", "timing_method", "note"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for b in (int(x) for x in a.batches.split(",")):
            for s in (int(x) for x in a.contexts.split(",")):
                kv_bytes = 2 * b * hkv * s * d * 2
                base = dict(runtime="cuda", dtype="bf16", batch=b, context=s, heads_q=hq,
                            heads_kv=hkv, head_dim=d, timing_method="device",
                            kernel=f"torch {torch.__version__}")
                if kv_bytes > 12e9:
                    for imp in ["torch-copy", "sdpa", "sdpa-repeat"]:
                        w.writerow({**base, "impl": imp, "note": "skipped: the cache exceeds 12 GB"})
                    continue
                q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype)
                k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
                v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
                copy_rate = [None, None]
                rows = [
                    ("torch-copy", lambda: (k.clone(), v.clone()), 2.0),
                    ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 1.0),
                ]
                if kv_bytes * (hq // hkv) <= 24e9:
                    kr = k.repeat_interleave(hq // hkv, dim=1)
                    vr = v.repeat_interleave(hq // hkv, dim=1)
                    rows.append(("sdpa-repeat",
                                 lambda: F.scaled_dot_product_attention(q, kr, vr), 1.0))
                if flash_attn_with_kvcache is not None:
                    qf = q.transpose(1, 2).contiguous()
                    kc = k.transpose(1, 2).contiguous()
                    vc = v.transpose(1, 2).contiguous()
                    rows.append(("fa-kvcache", lambda: flash_attn_with_kvcache(qf, kc, vc), 1.0))
                for imp, call, factor in rows:
                    row = {**base, "impl": imp}
                    try:
                        wall, dev = measure(call, a.passes, max_calls=200)
                        rate = (kv_bytes * factor / wall / 1e9, kv_bytes * factor / dev / 1e9)
                        if imp == "torch-copy":
                            copy_rate = list(rate)
                        row.update(wall_ms_median=round(wall * 1e3, 5),
                                   kv_GB_per_s=round(rate[0], 2),
                                   device_ms_median=round(dev * 1e3, 5),
                                   device_kv_GB_per_s=round(rate[1], 2))
                        if copy_rate[0]:
                            row["pct_of_copy"] = round(100 * rate[0] / copy_rate[0], 1)
                            row["device_pct_of_copy"] = round(100 * rate[1] / copy_rate[1], 1)
                    except Exception as e:  # noqa: BLE001 — a failed row is recorded, the sweep goes on
                        row["note"] = f"failed: {e}"[:200]
                    print(row, flush=True)
                    w.writerow(row)
                del q, k, v
                torch.cuda.empty_cache()
    print("wrote", path)


if __name__ == "__main__":
    main()
