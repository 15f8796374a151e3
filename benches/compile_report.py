#!/usr/bin/env python3
"""Where a kernel's cold compile goes, and what the compiled kernel costs in registers.

cubecl's CUDA runtime compiles a kernel in three steps on its first launch: its own expansion
and optimisation passes (CPU, in the Rust process), NVRTC (CUDA C++ to PTX), and the driver's
JIT (PTX to machine code, in `cuModuleLoadData`). This script reruns the last two on the
sources cubecl logged, with the toolkit's own `nvcc` (the same front end as NVRTC) and `ptxas`
(the assembler the driver's JIT embeds), each timed, and reads `ptxas -v`'s resource report:
registers, spills, stack, shared memory. Subtracting both from a cold first call gives the
expansion's share.

Usage, on the GPU machine (it needs `nvcc` and `ptxas`):

    CUBECL_DEBUG_LOG=/tmp/kernels.log BURN_FLASH_CACHE=off <a program that launches kernels>
    python3 benches/compile_report.py /tmp/kernels.log --out $OUT/compile.csv [--arch sm_90a]

The log holds one `[START_KERNEL_COMPILATION] … [END_KERNEL_COMPILATION]` block per compiled
kernel (cubecl's full compilation log level, which `CUBECL_DEBUG_LOG` turns on). Output: one CSV
row and one printed line per kernel (name, source lines, nvcc and ptxas seconds, registers,
spill bytes, stack bytes, shared memory).
"""

import argparse
import csv
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


def timed(cmd):
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--out", default="compile.csv")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--keep", help="directory to keep the .cu and .ptx files in")
    ap.add_argument("--seconds", type=float, default=None,
                    help="start no kernel after this many seconds (rows so far are kept)")
    args = ap.parse_args()
    start = time.perf_counter()
    fields = ["kernel", "source_lines", "ptx_lines", "nvcc_s", "ptxas_s", "registers",
              "spill_bytes", "stack_bytes", "smem_bytes", "note"]
    out = open(args.out, "w", newline="")
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()

    def emit(row):
        rows.append(row)
        writer.writerow({k: row.get(k, "") for k in fields})
        out.flush()

    work = args.keep or tempfile.mkdtemp()
    os.makedirs(work, exist_ok=True)
    rows = []
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
        # NVRTC as cubecl calls it: the architecture, -lineinfo, PTX out.
        t_nvcc, run = timed(["nvcc", f"-arch={args.arch}", "-lineinfo", "--ptx", cu, "-o", ptx])
        row = {"kernel": name, "source_lines": source.count("\n"), "nvcc_s": round(t_nvcc, 3)}
        if run.returncode != 0:
            # The first error, not nvcc's closing count ("1 error detected …").
            errors = [l for l in run.stderr.splitlines() if "error" in l] or ["?"]
            row["note"] = "nvcc failed: " + errors[0][:300]
            emit(row)
            print(f"{name}: {row['note']}", flush=True)
            continue
        row["ptx_lines"] = sum(1 for _ in open(ptx))
        t_ptxas, run = timed(["ptxas", f"-arch={args.arch}", "-v", ptx, "-o", os.devnull])
        row["ptxas_s"] = round(t_ptxas, 3)
        row.update(resources(run.stderr + run.stdout))
        if run.returncode != 0:
            row["note"] = "ptxas failed"
        emit(row)
        print(
            f"{name[:60]:<60} src {row['source_lines']:>6} ptx {row['ptx_lines']:>6} "
            f"nvcc {t_nvcc:6.2f}s ptxas {t_ptxas:6.2f}s regs {row['registers']} "
            f"spill {row['spill_bytes']} stack {row['stack_bytes']}",
            flush=True,
        )
    out.close()
    print(f"{len(rows)} kernels; wrote {args.out}")
    if not rows:
        sys.exit(1)


if __name__ == "__main__":
    main()
