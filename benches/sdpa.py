#!/usr/bin/env python3
"""PyTorch peer of benches/attention.rs: torch's scaled_dot_product_attention (SDPA) backends
on the same shapes, written with the same CSV columns.

    python3 benches/sdpa.py [--out DIR] [--quick] [--dtypes bf16,f16,f32] [--seqs 512,1024]
        [--dims 64,128] [--causal false,true] [--sweeps main,gqa,bias,mask,alibi,window]
        [--window W]
        [--backends flash,cudnn,efficient,math] [--math-max-s 4096] [--bias-full-max-s 4096]
        [--bias-tracked] [--passes N] [--modes fwd,train]

Writes DIR/sdpa.csv (DIR defaults to $CARGO_TARGET_DIR/bench, else target/bench), one row per
(configuration, backend), flushed after each row. `cargo bench --bench attention -- --plot
DIR/sdpa.csv` draws it like the Rust bench's CSV.

Configurations (those of benches/attention.rs; its module docs give the details):
- main: B 4, H 16, S in {512, ..., 16384}, D in {64, 128}, causal and not;
- gqa: Hq 32, Hkv 8 (`enable_gqa=True`; where the torch version or the backend refuses it, K/V
  are repeated with `repeat_interleave` before the timed calls, and the note says so);
- bias: ALiBi `-slope_h*|i - j|`, [1, H, S, S] up to S = --bias-full-max-s, above it the
  broadcast `-slope_h*(S - 1 - j)`, [1, H, 1, S]; passed as a float `attn_mask`;
- mask: padding mask [B, 1, 1, S], last ceil(S/10) keys masked; passed as a bool `attn_mask`
  (True = attend, torch's convention).
- alibi: the bias sweep's [1, H, S, S] ALiBi at every S (SDPA has no in-kernel ALiBi: the
  materialised bias is its only way);
- window: causal sliding window of --window keys (1024), causal rows only, as a bool band
  `attn_mask` [1, 1, S, S] (SDPA has no window); FLOP count the pairs inside the window.
gqa, bias and mask run at the largest of --dims. SDPA refuses `attn_mask` together with
`is_causal=True`, so causal bias/mask rows fold the causal mask into `attn_mask` (a full
[1, H, S, S] float bias, or a [B, 1, S, S] bool mask), made before the timed calls; the note says
so. --quick: B 1, H 2 (GQA Hq 4, Hkv 1), S in {128, 256}, D 64, 1 warm-up call, 3 passes.

Implementations (`impl`): torch-sdpa-flash, torch-sdpa-cudnn, torch-sdpa-efficient, and
torch-sdpa-math (off by default: --backends ...,math; rows above S = --math-max-s are skipped),
each with `torch.nn.attention.sdpa_kernel(SDPBackend.X)` around the row. Every dtype runs on
every backend: flash and cuDNN have no f32 kernel, and such rows (and any other refusal, out of
memory included) are recorded with a `failed: ...` note, then the sweep goes on. `kernel` is the
SDPBackend's name.

Protocol, as the Rust bench's: `first_call_ms` is the first call of the row (synchronize, call,
synchronize; host clock), before any warm-up (the process's CUDA context is created by a
throw-away call before the first row). Then 3 warm-up calls (1 with --quick), then --passes (10;
3 with --quick) passes, each as many calls as make it last >= 10 ms (at most 50; 1 with --quick)
between two `torch.cuda.synchronize()`: `wall_ms_median` is the median pass per call. Then as
many passes timed with CUDA events around the calls (`device_ms_median`, timing_method
`cuda-events`: the GPU's time from the first launch to the end of the last, launch gaps
included). TFLOP/s = 4*B*Hq*S*S*D / time, halved when causal (masked keys counted).

Training rows (`pass`, --modes), as the Rust bench's: `fwd` the forward; `fwd+bwd` q, k, v
with requires_grad, the forward, then `out.backward(g)` with a random `g` (Normal(0, 1)),
FLOP = 3.5 x the forward's; `bwd` derived: the fwd+bwd medians minus the fwd ones, FLOP = 2.5 x.

`peak_MiB`: the inputs (q, k, v and the attn_mask as stored; K/V as repeated where they are)
plus `torch.cuda.max_memory_allocated()` during one call beyond what was allocated before it
(after `reset_peak_memory_stats`), measured after the timings.
"""

import argparse
import csv
import gc
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # older torch: the flags API, no cuDNN backend
    SDPBackend = None
    sdpa_kernel = None

COLUMNS = [
    "runtime", "dtype", "batch", "heads_q", "heads_kv", "seq", "head_dim", "causal", "variant",
    "pass", "impl", "kernel", "first_call_ms", "wall_ms_median", "TFLOP_per_s", "device_ms_median",
    "device_TFLOP_per_s", "timing_method", "peak_MiB", "note",
]

BATCH, HEADS, GQA_HEADS = 4, 16, (32, 8)
SEQS = [512, 1024, 2048, 4096, 8192, 16384]
DIMS = [64, 128]
QUICK_BATCH, QUICK_HEADS, QUICK_GQA_HEADS = 1, 2, (4, 1)
QUICK_SEQS, QUICK_DIMS = [128, 256], [64]
MASKED_FRACTION = 0.1
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
# backend name -> (SDPBackend member name, flags for the pre-2.3 API)
BACKENDS = {
    "flash": ("FLASH_ATTENTION", dict(enable_flash=True, enable_mem_efficient=False, enable_math=False)),
    "cudnn": ("CUDNN_ATTENTION", None),
    "efficient": ("EFFICIENT_ATTENTION", dict(enable_flash=False, enable_mem_efficient=True, enable_math=False)),
    "math": ("MATH", dict(enable_flash=False, enable_mem_efficient=False, enable_math=True)),
}
SWEEPS = ["main", "gqa", "bias", "mask", "alibi", "window"]


def sig(x, digits=4):
    """`x` rounded to `digits` significant digits."""
    if x is None or x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def csv_list(kind):
    def parse(text):
        return [kind(v) for v in text.split(",") if v]
    return parse


def parse_bool(text):
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"`{text}`: expected true or false")


def one_line(err, limit=300):
    text = str(err).strip().splitlines()
    text = text[0] if text else type(err).__name__
    return text[:limit]


def torch_reasons(caught, limit=400):
    """The specific reasons in torch's warnings of a refused call (why each backend declined),
    without the generic headers and the source locations."""
    reasons = []
    for w in caught:
        text = str(w.message).split(" (Triggered internally")[0].strip()
        if not text or text.endswith("because:") or "runtime disabled" in text:
            continue
        if text not in reasons:
            reasons.append(text)
    return " | ".join(reasons)[:limit]


class Unsupported(Exception):
    """A backend this torch does not have."""


def backend_context(name):
    """The context that lets SDPA use only backend `name`."""
    member, flags = BACKENDS[name]
    if sdpa_kernel is not None:
        backend = getattr(SDPBackend, member, None)
        if backend is None:
            raise Unsupported(f"SDPBackend.{member} is not in torch {torch.__version__}")
        return sdpa_kernel(backend)
    if flags is None:
        raise Unsupported(f"no {name} backend selector in torch {torch.__version__}")
    return torch.backends.cuda.sdp_kernel(**flags)


def configs(args):
    quick = args.quick
    batch, heads, gqa = (QUICK_BATCH, QUICK_HEADS, QUICK_GQA_HEADS) if quick else (BATCH, HEADS, GQA_HEADS)
    seqs = args.seqs or (QUICK_SEQS if quick else SEQS)
    dims = args.dims or (QUICK_DIMS if quick else DIMS)
    variant_dim = max(dims)
    causals = args.causal or [False, True]
    for variant in [s for s in SWEEPS if s in args.sweeps]:
        heads_q, heads_kv = gqa if variant == "gqa" else (heads, heads)
        head_dims = dims if variant == "main" else [variant_dim]
        for dtype in args.dtypes:
            for head_dim in head_dims:
                for causal in causals:
                    if variant == "window" and not causal:
                        continue
                    for seq in seqs:
                        bias = None
                        if variant == "bias":
                            rows = seq if seq <= args.bias_full_max_s else 1
                            bias = [1, heads_q, rows, seq]
                        if variant == "alibi":
                            bias = [1, heads_q, seq, seq]
                        window = args.window if variant == "window" else None
                        masked = None
                        if variant == "mask":
                            masked = max(1, math.ceil(seq * MASKED_FRACTION))
                        yield dict(variant=variant, dtype=dtype, batch=batch, heads_q=heads_q,
                                   heads_kv=heads_kv, seq=seq, head_dim=head_dim, causal=causal,
                                   bias=bias, masked=masked, window=window)


def window_pairs(s, w):
    """(query, key) pairs inside a causal window of w keys: sum_i min(i + 1, w)."""
    w = min(w, s)
    return w * (w + 1) / 2 + (s - w) * w


def flop(c):
    if c.get("window"):
        return 4.0 * c["batch"] * c["heads_q"] * c["head_dim"] * window_pairs(c["seq"], c["window"])
    f = 4.0 * c["batch"] * c["heads_q"] * c["seq"] * c["seq"] * c["head_dim"]
    return f / 2 if c["causal"] else f


def alibi(shape, dtype, device):
    """ALiBi as benches/attention.rs makes it, in f32, then cast."""
    _, h, rows, s = shape
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=device)
    slopes = slopes.view(1, h, 1, 1)
    keys = torch.arange(s, device=device, dtype=torch.float32).view(1, 1, 1, s)
    if rows == 1:
        distance = (s - 1) - keys
    else:
        queries = torch.arange(s, device=device, dtype=torch.float32).view(1, 1, s, 1)
        distance = (queries - keys).abs()
    return (-(distance * slopes)).to(dtype)


def make_inputs(c, device):
    """q, k, v, attn_mask and the notes on how they were made; causal is folded into a mask."""
    dtype = DTYPES[c["dtype"]]
    b, s, d = c["batch"], c["seq"], c["head_dim"]
    q = torch.randn(b, c["heads_q"], s, d, device=device, dtype=dtype)
    k = torch.randn(b, c["heads_kv"], s, d, device=device, dtype=dtype)
    v = torch.randn(b, c["heads_kv"], s, d, device=device, dtype=dtype)
    notes, mask, is_causal = [], None, c["causal"]
    if c["bias"] is not None:
        notes.append(f"ALiBi bias {list(c['bias'])}")
        mask = alibi(c["bias"], dtype, device)
        if is_causal:
            future = torch.ones(s, s, device=device, dtype=torch.bool).triu(1)
            mask = mask.expand(1, c["heads_q"], s, s).masked_fill(future, float("-inf"))
            mask = mask.contiguous()
            is_causal = False
            notes.append(f"causal folded into attn_mask {list(mask.shape)}")
    if c.get("window"):
        w = c["window"]
        notes.append(f"window ({w - 1}, 0) as a bool attn_mask [1, 1, {s}, {s}]")
        i = torch.arange(s, device=device).view(s, 1)
        j = torch.arange(s, device=device).view(1, s)
        mask = ((j <= i) & (j > i - w)).view(1, 1, s, s)
        is_causal = False
    if c["masked"] is not None:
        n = c["masked"]
        notes.append(f"padding mask [{b}, 1, 1, {s}], last {n} keys masked")
        mask = torch.ones(b, 1, 1, s, device=device, dtype=torch.bool)
        mask[..., s - n:] = False
        if is_causal:
            past = torch.ones(s, s, device=device, dtype=torch.bool).tril()
            mask = (mask & past).contiguous()
            is_causal = False
            notes.append(f"causal folded into attn_mask {list(mask.shape)}")
    return q, k, v, mask, is_causal, notes


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def first_call_seconds(call):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del out
    return seconds


def measure(call, warmup, passes, quick):
    """Wall and CUDA-event medians per call (module docstring), calls per pass."""
    for _ in range(warmup):
        out = call()
        torch.cuda.synchronize()
        del out
    if quick:
        calls = 1
    else:
        one = first_call_seconds(call)
        calls = max(1, min(50, math.ceil(0.01 / max(one, 1e-9))))
    wall = []
    for _ in range(passes):
        outs = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            outs.append(call())
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) / calls)
        del outs
    device = []
    for _ in range(passes):
        outs = []
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(calls):
            outs.append(call())
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end) / 1e3 / calls)
        del outs
    return statistics.median(wall), statistics.median(device), calls


def peak_mib(call, inputs_bytes):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (inputs_bytes + max(0, peak - before)) / 2**20


MODE_NAMES = {"fwd": "fwd", "train": "fwd+bwd"}
MODE_FLOP = {"fwd": 1.0, "train": 3.5}


def backward_row(fwd, train, c):
    """The derived backward-only row of configuration c: fwd+bwd medians minus fwd ones (None
    unless both ran)."""
    try:
        wall = float(train["wall_ms_median"]) - float(fwd["wall_ms_median"])
        dev = float(train["device_ms_median"]) - float(fwd["device_ms_median"])
    except (KeyError, TypeError, ValueError):
        return None
    row = {k: v for k, v in train.items() if k not in ("first_call_ms", "peak_MiB", "note")}
    f = flop(c) * 2.5
    row.update(pass_="bwd", wall_ms_median=sig(wall), device_ms_median=sig(dev),
               TFLOP_per_s=sig(f / wall / 1e9) if wall > 0 else "",
               device_TFLOP_per_s=sig(f / dev / 1e9) if dev > 0 else "",
               note="derived: fwd+bwd minus fwd medians")
    row["pass"] = row.pop("pass_")
    return row


def run_row(c, backend, args, device, mode="fwd"):
    row = {
        "runtime": "cuda", "dtype": c["dtype"], "batch": c["batch"], "heads_q": c["heads_q"],
        "heads_kv": c["heads_kv"], "seq": c["seq"], "head_dim": c["head_dim"],
        "causal": "true" if c["causal"] else "false", "variant": c["variant"],
        "pass": MODE_NAMES[mode], "impl": f"torch-sdpa-{backend}", "kernel": BACKENDS[backend][0],
    }
    if backend == "math" and c["seq"] > args.math_max_s:
        row["note"] = "skipped (--math-max-s)"
        return row
    notes = []
    tensors = {}
    caught = []  # torch's warnings of the row (why a backend refused), once recorded
    try:
        context = backend_context(backend)
        q, k, v, mask, is_causal, made = make_inputs(c, device)
        tensors.update(q=q, k=k, v=v, mask=mask)
        notes += made
        group = c["heads_q"] // c["heads_kv"]
        kwargs = {}
        if group > 1:
            kwargs["enable_gqa"] = True

        def forward():
            return F.scaled_dot_product_attention(
                tensors["q"], tensors["k"], tensors["v"], attn_mask=tensors["mask"],
                is_causal=is_causal, **kwargs)

        tracked = ["q", "k", "v"]
        if mode == "train" and args.bias_tracked and c["bias"] is not None:
            # The float attn_mask (the bias, causal folded in) is a leaf with a gradient.
            tracked.append("mask")
            notes.append("bias tracked")
        if mode == "train":
            for name in tracked:
                tensors[name].requires_grad_(True)
            tensors["g"] = torch.randn(c["batch"], c["heads_q"], c["seq"], c["head_dim"],
                                       device=device, dtype=DTYPES[c["dtype"]])

            def call():
                for name in tracked:
                    tensors[name].grad = None
                forward().backward(tensors["g"])
                return tensors["q"].grad
        else:
            call = forward

        with context, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.synchronize()
            try:
                first = first_call_seconds(call)
            except torch.cuda.OutOfMemoryError:
                raise
            except (TypeError, RuntimeError) as err:
                if not kwargs:
                    raise
                # enable_gqa unknown to this torch, or refused by this backend: repeat K/V.
                # Noted only if the repeated K/V run: otherwise the refusal had another cause,
                # which the failure's note gives.
                why = torch_reasons(caught, 200) or one_line(err, 200)
                kwargs.clear()
                for name in ("k", "v"):
                    repeated = tensors[name].detach().repeat_interleave(group, dim=1)
                    tensors[name] = repeated.requires_grad_(mode == "train")
                caught.clear()
                first = first_call_seconds(call)
                notes.append(f"enable_gqa refused ({why}): K/V repeated (repeat_interleave, "
                             f"untimed)")
            warmup = 1 if args.quick else 3
            passes = args.passes or (3 if args.quick else 10)
            wall, dev, calls = measure(call, warmup, passes, args.quick)
            peak = peak_mib(call, nbytes(*tensors.values()))
        f = flop(c) * MODE_FLOP[mode]
        row.update(
            first_call_ms=sig(first * 1e3), wall_ms_median=sig(wall * 1e3),
            TFLOP_per_s=sig(f / wall / 1e12), device_ms_median=sig(dev * 1e3),
            device_TFLOP_per_s=sig(f / dev / 1e12), timing_method="cuda-events",
            peak_MiB=sig(peak),
        )
        if calls > 1:
            notes.append(f"{calls} calls per pass")
    except Unsupported as err:
        notes.append(f"failed: unsupported: {err}")
    except torch.cuda.OutOfMemoryError as err:
        notes.append(f"failed: out of memory: {one_line(err, 200)}")
    except (RuntimeError, TypeError, ValueError) as err:
        notes.append(f"failed: {one_line(err)}")
        reasons = torch_reasons(caught)
        if reasons:
            notes.append(f"torch: {reasons}")
    finally:
        tensors.clear()
        gc.collect()
        torch.cuda.empty_cache()
    row["note"] = "; ".join(notes)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="DIR",
                        default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "bench"))
    parser.add_argument("--quick", action="store_true", help="small shapes, few passes")
    parser.add_argument("--dtypes", type=csv_list(str), default=["bf16", "f16", "f32"])
    parser.add_argument("--seqs", type=csv_list(int), default=None)
    parser.add_argument("--dims", type=csv_list(int), default=None)
    parser.add_argument("--causal", type=csv_list(parse_bool), default=None)
    parser.add_argument("--sweeps", type=csv_list(str), default=SWEEPS)
    parser.add_argument("--backends", type=csv_list(str), default=["flash", "cudnn", "efficient"])
    parser.add_argument("--math-max-s", type=int, default=4096,
                        help="math-backend rows above this S are skipped")
    parser.add_argument("--bias-full-max-s", type=int, default=4096,
                        help="the bias is [1, H, S, S] up to this S, [1, H, 1, S] above")
    parser.add_argument("--window", type=int, default=1024,
                        help="keys of the window sweep's causal window")
    parser.add_argument("--bias-tracked", action="store_true",
                        help="training rows of the bias sweep also take the bias's gradient")
    parser.add_argument("--passes", type=int, default=None)
    parser.add_argument("--modes", type=csv_list(str), default=["fwd", "train"],
                        help="fwd (the forward), train (forward + backward)")
    args = parser.parse_args()
    for name, given, known in [("--dtypes", args.dtypes, DTYPES), ("--sweeps", args.sweeps, SWEEPS),
                               ("--backends", args.backends, BACKENDS),
                               ("--modes", args.modes, MODE_NAMES)]:
        bad = [g for g in given if g not in known]
        if bad:
            parser.error(f"{name}: unknown {bad}; known: {list(known)}")
    if not torch.cuda.is_available():
        sys.exit("sdpa.py: no CUDA device")

    device = torch.device("cuda")
    torch.manual_seed(0)
    # The CUDA context and cuBLAS start here, not in the first row's first call.
    torch.ones(64, 64, device=device) @ torch.ones(64, 64, device=device)
    torch.cuda.synchronize()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sdpa.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        for c in configs(args):
            for backend in args.backends:
                rows = [run_row(c, backend, args, device, mode) for mode in args.modes]
                if len(rows) == 2:
                    derived = backward_row(*rows, c)
                    if derived is not None:
                        rows.append(derived)
                for row in rows:
                    writer.writerow(row)
                    f.flush()
                    print(" ".join(f"{k}={row.get(k, '')}" for k in COLUMNS
                                   if row.get(k, "") != ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
