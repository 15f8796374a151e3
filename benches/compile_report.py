#!/usr/bin/env python3
"""Where a kernel's cold compile goes, and what the compiled kernel costs in registers.

cubecl's CUDA runtime compiles a kernel in three steps on its first launch: its own expansion
and optimisation passes (CPU, in the Rust process), NVRTC (CUDA C++ to PTX), and the driver's
JIT (PTX to machine code, in `cuModuleLoadData`). This script reruns the last two on the
sources cubecl logged, each timed, and reads `ptxas -v`'s resource report: registers, spills,
stack, shared memory. Subtracting both from a cold first call gives the expansion's share.

- `--via nvrtc` (default where `libnvrtc` loads): NVRTC itself, with cubecl's options
  (`--gpu-architecture=sm_90a --include-path=$CUDA/include [--include-path=$CUDA/include/cccl]
  -lineinfo`), then `cuModuleLoadData` of its PTX with the driver's JIT cache off
  (`CUDA_CACHE_DISABLE=1`): cubecl's own path, step for step. A failed compile keeps
  NVRTC's log (first lines) in the row's note.
- `--via nvcc`: the toolkit's `nvcc --ptx` (the same front end, compiling as a whole
  translation unit with host code), then `ptxas` (the assembler the JIT embeds).

Either way `ptxas -v` on the PTX gives the resources. `--headers` times NVRTC alone on an empty
kernel under each set of the includes cubecl's CUDA compiler emits (its `compile_includes`: the
matrix-unit kernels here get `<mma.h>`, and with cubecl's `Barrier` for `cp.async`
`<cooperative_groups.h>`, `<cooperative_groups/memcpy_async.h>` and `<cuda/barrier>`), the
fixed part of every such kernel's compile. Usage, on the GPU machine:

    CUBECL_DEBUG_LOG=/tmp/kernels.log BURN_FLASH_CACHE=off <a program that launches kernels>
    python3 benches/compile_report.py /tmp/kernels.log --out $OUT/compile.csv [--arch sm_90a]

The log holds one `[START_KERNEL_COMPILATION] … [END_KERNEL_COMPILATION]` block per compiled
kernel (cubecl's full compilation log level, which `CUBECL_DEBUG_LOG` turns on). Output: one CSV
row and one printed line per kernel (name, source lines, nvcc and ptxas seconds, registers,
spill bytes, stack bytes, shared memory).
"""

import argparse
import ctypes
import csv
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

BLOCK = re.compile(
    r"\[START_KERNEL_COMPILATION\](.*?)source:\s*```[a-z]*\n(.*?)```\s*\[END_KERNEL_COMPILATION\]",
    re.S,
)
NAME = re.compile(r"name:\s*(.+)")


def kernels(log):
    """(name, source) for each kernel block of a cubecl compilation log, in order."""
    text = open(log, encoding="utf-8", errors="replace").read()
    for head, source in BLOCK.findall(text):
        m = NAME.search(head)
        name = m.group(1).strip() if m else "?"
        yield name, source


CUDA = os.environ.get("CUDA_PATH", "/usr/local/cuda")


class Nvrtc:
    """NVRTC and the driver through ctypes: compile as cubecl does, load as cubecl does."""

    def __init__(self, arch):
        names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
        names += sorted(glob.glob(f"{CUDA}/lib64/libnvrtc.so*"))
        names += sorted(glob.glob("/usr/local/lib/python3*/dist-packages/nvidia/cu*/lib/libnvrtc.so*"))
        self.lib = None
        for name in names:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if self.lib is None:
            raise OSError("libnvrtc not found")
        # The driver's JIT cache off, before the driver starts: every load JIT-compiles.
        os.environ["CUDA_CACHE_DISABLE"] = "1"
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0), "cuInit")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        opts = [f"--gpu-architecture={arch}", f"--include-path={CUDA}/include", "-lineinfo"]
        if os.path.isdir(f"{CUDA}/include/cccl"):
            opts.insert(2, f"--include-path={CUDA}/include/cccl")
        self.options = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        self.n_options = len(opts)

    @staticmethod
    def check(result, what):
        if result != 0:
            raise RuntimeError(f"{what} returned {result}")

    def compile(self, source):
        """(seconds, PTX bytes or None, log) of one NVRTC compile."""
        lib, prog = self.lib, ctypes.c_void_p()
        self.check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None),
                   "nvrtcCreateProgram")
        start = time.perf_counter()
        result = lib.nvrtcCompileProgram(prog, self.n_options, self.options)
        seconds = time.perf_counter() - start
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = None
        if result == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx = buf.raw.rstrip(b"\0")
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return seconds, ptx, log.value.decode(errors="replace")

    def load(self, ptx):
        """Seconds of `cuModuleLoadData` (the driver's JIT, its cache off)."""
        module = ctypes.c_void_p()
        start = time.perf_counter()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(ptx + b"\0")),
                   "cuModuleLoadData")
        seconds = time.perf_counter() - start
        self.cu.cuModuleUnload(module)
        return seconds


def timed(cmd):
    """(seconds, completed run) of `cmd`; exits with a message where the tool is missing."""
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit(f"{cmd[0]} not found (on the GPU machine: PATH=$PATH:{CUDA}/bin)")
    return time.perf_counter() - start, run


def resources(report):
    """Registers, spill stores + loads, stack frame and shared memory from `ptxas -v`."""
    def grab(pattern):
        m = re.search(pattern, report)
        return int(m.group(1)) if m else None

    spill = [grab(r"(\d+) bytes spill stores"), grab(r"(\d+) bytes spill loads")]
    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_bytes": sum(s for s in spill if s is not None) if any(s is not None for s in spill) else None,
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
        "smem_bytes": grab(r"(\d+) bytes smem"),
    }


HEADER_SETS = [
    ("runtime+fp16", ["cuda_runtime.h", "cuda_fp16.h"]),
    ("+mma.h", ["cuda_runtime.h", "cuda_fp16.h", "mma.h"]),
    ("+cooperative_groups", ["cuda_runtime.h", "cuda_fp16.h", "cooperative_groups.h"]),
    ("+cg/memcpy_async", ["cuda_runtime.h", "cuda_fp16.h", "cooperative_groups.h",
                          "cooperative_groups/memcpy_async.h"]),
    ("+cuda/barrier", ["cuda_runtime.h", "cuda_fp16.h", "cuda/barrier"]),
    ("all (matrix-unit kernels)", ["cuda_runtime.h", "cuda_fp16.h", "mma.h", "cooperative_groups.h",
                                   "cooperative_groups/memcpy_async.h", "cuda/barrier"]),
]


def headers(nvrtc, out, reps=3):
    """NVRTC seconds (median of `reps`) of an empty kernel under each include set."""
    body = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n'
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["includes", "nvrtc_s", "note"])
        for label, files in HEADER_SETS:
            source = "".join(f"#include <{h}>\n" for h in files) + body
            times, note = [], ""
            for _ in range(reps):
                seconds, ptx, log = nvrtc.compile(source)
                if ptx is None:
                    note = "NVRTC failed: " + " | ".join(log.splitlines()[:2])[:300]
                    break
                times.append(seconds)
            med = sorted(times)[len(times) // 2] if times else None
            writer.writerow([label, round(med, 3) if med is not None else "", note])
            print(f"{label:<28} {med if med is None else round(med, 3)} s {note}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", nargs="?", help="cubecl's compilation log (not with --headers)")
    ap.add_argument("--headers", action="store_true",
                    help="time NVRTC on an empty kernel under each include set cubecl emits")
    ap.add_argument("--out", default="compile.csv")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--keep", help="directory to keep the .cu and .ptx files in")
    ap.add_argument("--via", choices=["nvrtc", "nvcc"], default=None,
                    help="NVRTC + the driver's JIT (default where libnvrtc loads), or nvcc + ptxas")
    ap.add_argument("--seconds", type=float, default=None,
                    help="start no kernel after this many seconds (rows so far are kept)")
    args = ap.parse_args()
    start = time.perf_counter()
    nvrtc = None
    if args.via != "nvcc":
        try:
            nvrtc = Nvrtc(args.arch)
        except (OSError, RuntimeError) as err:
            if args.via == "nvrtc":
                sys.exit(f"NVRTC unavailable: {err}")
            print(f"NVRTC unavailable ({err}): nvcc + ptxas instead", flush=True)
    if args.headers:
        if not nvrtc:
            sys.exit("--headers needs NVRTC")
        headers(nvrtc, args.out)
        return
    if not args.log:
        ap.error("a compilation log is needed (or --headers)")
    via = "nvrtc" if nvrtc else "nvcc"
    # `to_ptx_s`: NVRTC's or nvcc's seconds; `to_sass_s`: the driver's JIT (cuModuleLoadData)
    # or ptxas.
    fields = ["kernel", "via", "source_lines", "ptx_lines", "to_ptx_s", "to_sass_s", "registers",
              "spill_bytes", "stack_bytes", "smem_bytes", "note"]
    out = open(args.out, "w", newline="")
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    rows = []

    def emit(row):
        rows.append(row)
        writer.writerow({k: row.get(k, "") for k in fields})
        out.flush()
        if row.get("note"):
            print(f"{row['kernel'][:60]}: {row['note']}", flush=True)
        else:
            print(
                f"{row['kernel'][:60]:<60} src {row['source_lines']:>6} ptx {row['ptx_lines']:>6} "
                f"{via} {row['to_ptx_s']:6.2f}s + {row['to_sass_s']:6.2f}s regs {row['registers']} "
                f"spill {row['spill_bytes']} stack {row['stack_bytes']}",
                flush=True,
            )

    work = args.keep or tempfile.mkdtemp()
    os.makedirs(work, exist_ok=True)
    seen = set()
    for i, (name, source) in enumerate(kernels(args.log)):
        if args.seconds is not None and time.perf_counter() - start > args.seconds:
            print(f"stopped after {args.seconds} s", flush=True)
            break
        key = hash(source)
        if key in seen:
            continue
        seen.add(key)
        cu = os.path.join(work, f"k{i:03}.cu")
        ptx = os.path.join(work, f"k{i:03}.ptx")
        with open(cu, "w") as f:
            f.write(source)
        row = {"kernel": name, "via": via, "source_lines": source.count("\n")}
        if nvrtc:
            seconds, code, log = nvrtc.compile(source)
            row["to_ptx_s"] = round(seconds, 3)
            if code is None:
                first = [l for l in log.splitlines() if l.strip()][:3] or ["?"]
                row["note"] = "NVRTC failed: " + " | ".join(first)[:400]
                emit(row)
                continue
            with open(ptx, "wb") as f:
                f.write(code)
            try:
                row["to_sass_s"] = round(nvrtc.load(code), 3)
            except RuntimeError as err:
                row["note"] = str(err)
        else:
            # NVRTC's options: the architecture, -lineinfo, PTX out.
            seconds, run = timed(["nvcc", f"-arch={args.arch}", "-lineinfo", "--ptx", cu, "-o", ptx])
            row["to_ptx_s"] = round(seconds, 3)
            if run.returncode != 0:
                # The first error, not nvcc's closing count ("1 error detected …").
                errors = [l for l in run.stderr.splitlines() if "error" in l] or ["?"]
                row["note"] = "nvcc failed: " + errors[0][:300]
                emit(row)
                continue
        row["ptx_lines"] = sum(1 for _ in open(ptx, "rb"))
        seconds, run = timed(["ptxas", f"-arch={args.arch}", "-v", ptx, "-o", os.devnull])
        if not nvrtc:
            row["to_sass_s"] = round(seconds, 3)
        row.update(resources(run.stderr + run.stdout))
        if run.returncode != 0 and not row.get("note"):
            row["note"] = "ptxas failed"
        emit(row)
    out.close()
    print(f"{len(rows)} kernels; wrote {args.out}")
    if not rows:
        sys.exit(1)


if __name__ == "__main__":
    main()
