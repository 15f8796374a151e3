#!/usr/bin/env python3
"""PyTorch and Triton peers of benches/softmax.rs and benches/softmax_matmul.rs, on the same
shapes and dtypes, written with the same CSV columns so that the Rust benches' `--plot` puts
every implementation on one plot per sweep (they read these files from the same directory).

    python3 benches/softmax_peers.py [--out DIR] [--quick] [--sweeps softmax,smm]
        [--dtypes f32,f16,bf16] [--m 4096] [--ns 256,...] [--d2s 64,...] [--passes N (softmax)]

Files under DIR (default $CARGO_TARGET_DIR/bench, else target/bench), flushed row by row:
- `torch_softmax.csv`, the columns of `softmax.csv` (backend `cuda`): M = 4096 rows,
  N in {256, ..., 262144}, per dtype:
  - `copy` / `torch copy`: `dst.copy_(src)` of the M x N tensor, the same run's ceiling;
  - `forward` / `torch.softmax`: `torch.softmax(x, -1)`;
  - `forward` / `triton softmax`: a fused Triton kernel, one program per row. Rows of up to
    16384 elements (8192 f32) are loaded once into registers (the Triton tutorial's kernel);
    longer rows take two passes over the row in chunks (online max and sum, then normalise),
    which is what a single program per row can do;
  - `backward` / `torch softmax backward`: `torch._softmax_backward_data(dy, y, -1, dtype)`.
  GB/s count each element read once and written once (forward 2.M.N.size, backward 3.M.N.size,
  copy 2.M.N.size); `pct_of_copy` against the same run's `torch copy`.
- `torch_softmax_matmul_forward.csv` and `torch_softmax_matmul_backward.csv`, the columns of
  `softmax_matmul_lowp.csv` / `_backward.csv`: batch 16, d1 2048, d3 512, d2 in {64, ..., 8192};
  `torch softmax(x)@v` is `torch.softmax(x, -1) @ v` (TF32 off: full f32 matmuls), forward, and
  forward + backward through autograd (`out.backward(w)`, `w` random; FLOP 3.5x the forward's).
  TFLOP/s = 2.batch.d1.d2.d3 / time. `peak_MiB`: inputs plus the most allocated during one call
  beyond what was allocated before it (`torch.cuda.max_memory_allocated`).

Protocol, as the Rust benches': softmax: 3 warm-up calls, then --passes (10; 3 with --quick)
passes, each as many calls as make it last >= 10 ms (at most 2000); softmax(x)@v: the seed
protocol of benches/softmax_matmul.rs, 10 warm-up calls, then 100 passes of one call each. A pass
is between two `torch.cuda.synchronize()`:
`wall_*` is the median pass per call; then as many passes timed with CUDA events around the
calls (`device_*`, timing_method `cuda-events`). Inputs are Normal(0, 1) (x scaled by 4 for the
softmax sweep: rows with a spread of exponents), never zeros. A failed configuration (out of
memory, a Triton refusal) is a row with a `failed: ...` note, and the sweep goes on.
"""

import argparse
import csv
import gc
import math
import os
import statistics
import sys
import time

import torch

# The helpers sdpa.py (the attention peer, same directory) already has.
from sdpa import one_line, peak_mib, sig

try:
    import triton
    import triton.language as tl
except ImportError:  # the rows say so
    triton = None

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
M = 4096
NS = [256, 1024, 4096, 16384, 65536, 262144]
BATCH, D1, D3 = 16, 2048, 512
D2S = [64, 128, 256, 512, 1024, 2048, 4096, 8192]

SOFTMAX_COLUMNS = [
    "backend", "dtype", "M", "N", "direction", "impl", "calls_per_pass", "wall_us_median",
    "device_us_median", "timing_method", "wall_GB_per_s", "device_GB_per_s", "pct_of_copy",
    "device_pct_of_copy", "note",
]
SMM_COLUMNS = [
    "dtype", "batch_size", "d1", "d2", "d3", "impl", "wall_ms_mean", "wall_ms_std",
    "wall_ms_median", "TFLOP_per_s", "device_ms_median", "device_TFLOP_per_s", "timing_method",
    "peak_MiB", "note",
]


class Csv:
    def __init__(self, path, columns):
        self.file = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=columns)
        self.writer.writeheader()
        self.path = path

    def push(self, row):
        self.writer.writerow(row)
        self.file.flush()


def measure(call, passes, quick, fixed_calls=None, warmup=3):
    """(wall stats, device median, calls per pass); wall stats = (mean, std, median).
    `fixed_calls`: that many calls per pass instead of >= 10 ms."""
    for _ in range(1 if quick else warmup):
        out = call()
        torch.cuda.synchronize()
        del out
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    one = time.perf_counter() - start
    del out
    calls = 1 if quick else max(1, min(2000, math.ceil(0.01 / max(one, 1e-9))))
    if fixed_calls:
        calls = fixed_calls
    wall = []
    for _ in range(passes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) / calls)
        del out
    device = []
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
    std = statistics.stdev(wall) if len(wall) > 1 else 0.0
    return (statistics.mean(wall), std, statistics.median(wall)), statistics.median(device), calls


# -- Triton softmax --

if triton is not None:

    @triton.jit
    def _softmax_one_block(x_ptr, y_ptr, x_stride, y_stride, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        y = e / tl.sum(e, axis=0)
        tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _softmax_chunked(x_ptr, y_ptr, x_stride, y_stride, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        y_row = y_ptr + row * y_stride
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        row_max = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - row_max), axis=0)
        inv = 1.0 / total
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n, other=-float("inf")).to(tl.float32)
            y = tl.exp(x - row_max) * inv
            tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n)


def triton_softmax(x):
    rows, n = x.shape
    y = torch.empty_like(x)
    one_block_max = 8192 if x.element_size() == 4 else 16384
    if n <= one_block_max:
        block = triton.next_power_of_2(n)
        warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _softmax_one_block[(rows,)](x, y, x.stride(0), y.stride(0), n, BLOCK=block,
                                    num_warps=warps)
    else:
        _softmax_chunked[(rows,)](x, y, x.stride(0), y.stride(0), n, BLOCK=4096, num_warps=8)
    return y


def softmax_sweep(args, device, out_dir):
    out = Csv(os.path.join(out_dir, "torch_softmax.csv"), SOFTMAX_COLUMNS)
    m = args.m or (64 if args.quick else M)
    ns = args.ns or (NS[:4] if args.quick else NS)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for n in ns:
            size = torch.tensor([], dtype=dtype).element_size()
            gen = torch.Generator(device=device).manual_seed(1000 + n)
            try:
                x = (torch.randn(m, n, device=device, generator=gen) * 4).to(dtype)
                dy = torch.randn(m, n, device=device, generator=gen).to(dtype)
                y = torch.softmax(x, -1)
                dst = torch.empty_like(x)
            except Exception as err:  # out of memory
                for d, impl in [("forward", "torch.softmax")]:
                    out.push(dict(backend="cuda", dtype=dname, M=m, N=n, direction=d, impl=impl,
                                  note=f"failed: {one_line(err)}"))
                continue
            cases = [
                ("copy", "torch copy", lambda: dst.copy_(x), 2),
                ("forward", "torch.softmax", lambda: torch.softmax(x, -1), 2),
                ("forward", "triton softmax", (lambda: triton_softmax(x)) if triton else None, 2),
                ("backward", "torch softmax backward",
                 lambda: torch._softmax_backward_data(dy, y, -1, dtype), 3),
            ]
            copy_rate = None
            for direction, impl, call, factor in cases:
                row = dict(backend="cuda", dtype=dname, M=m, N=n, direction=direction, impl=impl)
                if call is None:
                    row["note"] = "failed: triton is not installed"
                    out.push(row)
                    continue
                try:
                    if impl == "triton softmax":  # checked before it is timed
                        err = (call().float() - torch.softmax(x.float(), -1)).abs().max().item()
                        tol = 1e-5 if dtype == torch.float32 else 1e-2
                        if not err <= tol:
                            raise RuntimeError(f"triton softmax is off by {err}")
                    (_, _, wall), dev, calls = measure(call, args.passes, args.quick)
                except Exception as err:
                    row["note"] = f"failed: {one_line(err)}"
                    out.push(row)
                    torch.cuda.empty_cache()
                    continue
                nbytes = factor * m * n * size
                wall_rate, dev_rate = nbytes / wall / 1e9, nbytes / dev / 1e9
                if direction == "copy":
                    copy_rate = (wall_rate, dev_rate)
                row.update(
                    calls_per_pass=calls, wall_us_median=sig(wall * 1e6),
                    device_us_median=sig(dev * 1e6), timing_method="cuda-events",
                    wall_GB_per_s=sig(wall_rate), device_GB_per_s=sig(dev_rate),
                    pct_of_copy=sig(100 * wall_rate / copy_rate[0], 3) if copy_rate else None,
                    device_pct_of_copy=sig(100 * dev_rate / copy_rate[1], 3) if copy_rate else None,
                    note="")
                out.push(row)
                print(f"{dname:5} N={n:<7} {direction:8} {impl:24} {row['wall_us_median']:>9} us "
                      f"{row['wall_GB_per_s']:>8} GB/s ({row['device_GB_per_s']} device) "
                      f"{row['pct_of_copy']} % of copy", flush=True)
            del x, dy, y, dst
            gc.collect()
            torch.cuda.empty_cache()
    print(f"wrote {out.path}")


def smm_sweep(args, device, out_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fwd = Csv(os.path.join(out_dir, "torch_softmax_matmul_forward.csv"), SMM_COLUMNS)
    bwd = Csv(os.path.join(out_dir, "torch_softmax_matmul_backward.csv"), SMM_COLUMNS)
    batch, d1, d3 = (2, 256, 64) if args.quick else (BATCH, D1, D3)
    d2s = args.d2s or (D2S[:4] if args.quick else D2S)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for d2 in d2s:
            flop = 2 * batch * d1 * d2 * d3
            for train, file in [(False, fwd), (True, bwd)]:
                row = dict(dtype=dname, batch_size=batch, d1=d1, d2=d2, d3=d3,
                           impl="torch softmax(x)@v")
                try:
                    gen = torch.Generator(device=device).manual_seed(2000 + d2)
                    x = torch.randn(batch, d1, d2, device=device, generator=gen).to(dtype)
                    v = torch.randn(batch, d2, d3, device=device, generator=gen).to(dtype)
                    inputs = x.numel() * x.element_size() + v.numel() * v.element_size()
                    if train:
                        x.requires_grad_(True)
                        v.requires_grad_(True)
                        w = torch.randn(batch, d1, d3, device=device, generator=gen).to(dtype)

                        def call():
                            out = torch.softmax(x, -1) @ v
                            out.backward(w)
                            return out
                    else:
                        def call():
                            return torch.softmax(x, -1) @ v
                    (mean, std, wall), dev, _ = measure(
                        call, args.smm_passes, args.quick, fixed_calls=1, warmup=10)
                    factor = 3.5 if train else 1.0
                    row.update(
                        wall_ms_mean=sig(mean * 1e3), wall_ms_std=sig(std * 1e3),
                        wall_ms_median=sig(wall * 1e3),
                        TFLOP_per_s=sig(factor * flop / wall / 1e12),
                        device_ms_median=sig(dev * 1e3),
                        device_TFLOP_per_s=sig(factor * flop / dev / 1e12),
                        timing_method="cuda-events", peak_MiB=sig(peak_mib(call, inputs)),
                        note="")
                except Exception as err:
                    row["note"] = f"failed: {one_line(err)}"
                file.push(row)
                print(f"{dname:5} d2={d2:<5} {'fwd+bwd' if train else 'fwd':7} "
                      f"{row.get('wall_ms_median')} ms ({row.get('device_ms_median')} device) "
                      f"{row.get('TFLOP_per_s')} TFLOP/s peak {row.get('peak_MiB')} MiB "
                      f"{row.get('note', '')}", flush=True)
                x = v = w = None
                gc.collect()
                torch.cuda.empty_cache()
    print(f"wrote {fwd.path}\nwrote {bwd.path}")


def main():
    def csv_list(kind):
        return lambda text: [kind(v) for v in text.split(",") if v]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sweeps", type=csv_list(str), default=["softmax", "smm"])
    p.add_argument("--dtypes", type=csv_list(str), default=["f32", "f16", "bf16"])
    p.add_argument("--m", type=int, default=None)
    p.add_argument("--ns", type=csv_list(int), default=None)
    p.add_argument("--d2s", type=csv_list(int), default=None)
    p.add_argument("--passes", type=int, default=None)
    args = p.parse_args()
    args.passes = args.passes or (3 if args.quick else 10)
    args.smm_passes = args.passes if args.quick else 100
    out_dir = args.out or os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "bench")
    os.makedirs(out_dir, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("softmax_peers.py: no CUDA device")
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, triton {getattr(triton, '__version__', None)}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    torch.zeros(1, device=device).sum().item()  # the context, outside every row
    if "softmax" in args.sweeps:
        softmax_sweep(args, device, out_dir)
    if "smm" in args.sweeps:
        smm_sweep(args, device, out_dir)


if __name__ == "__main__":
    main()
