//! `cuda-check`: every CUDA kernel variant burn-flash's plans produce on a grid of calls,
//! compiled on the CPU by NVRTC for sm_80, sm_86, sm_89 and sm_90a, its resources read from
//! ptxas and held to budgets. Run through `cargo xtask cuda-check` (which installs NVRTC and
//! sets `LD_LIBRARY_PATH`); docs/testing.md's "CUDA without a GPU" says what it does not cover.
//!
//! For each architecture a [`TargetRuntime`] client takes every call of [`grid::calls`]; the
//! kernels those calls launch are compiled to CUDA C++ as cubecl-cuda compiles them, deduplicated
//! by source, and handed to NVRTC with the runtime's options plus `--ptxas-options=-v`, two
//! at a time (or `--jobs`). Results are cached by a hash of NVRTC's version, the architecture
//! and the source, under `target/cuda-check/cache`.
//!
//! Budgets ([`budget`]): no spill store or load in a kernel that issues matrix instructions;
//! registers at or under what the occupancy stated next to the kernel's launch allows
//! (`burn_flash_kernels::occupancy`); shared memory (dynamic + static) within the
//! architecture's opt-in limit. A broken budget, a kernel without a stated occupancy, a call
//! the plans refuse and an NVRTC error all fail the check with their table row (or log).

mod budget;
mod grid;
mod nvrtc;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use burn_flash_kernels::cuda_target::{ARCHS, Arch, TargetLaunch, TargetRuntime, take_launches};

use budget::Verdict;
use nvrtc::{Compiled, Resources};

/// The command line.
struct Args {
    /// Cross every grid axis instead of the representative grid.
    all: bool,
    /// Architectures to compile for.
    archs: Vec<Arch>,
    /// Concurrent NVRTC compiles.
    jobs: usize,
    /// Only calls whose name contains this.
    filter: Option<String>,
    /// Where the report and the cache go.
    out: PathBuf,
    /// A CUDA installation's root (`CUDA_PATH`): its `include/` is what NVRTC includes from.
    cuda: Option<PathBuf>,
    /// Compile again what the cache holds.
    no_cache: bool,
    /// List the variants without compiling.
    list: bool,
    /// Write each variant's CUDA source under this folder.
    sources: Option<PathBuf>,
    /// A previous `resources.csv` to compare registers and spills with.
    baseline: Option<PathBuf>,
}

const USAGE: &str = "usage: cuda-check [--all] [--arch sm_80,sm_86,sm_89,sm_90a] [--jobs N] \
                     [--filter TEXT] [--out DIR] [--cuda CUDA_PATH] [--no-cache] [--list] \
                     [--sources DIR] [--baseline OLD_resources.csv]";

fn args() -> Result<Args, String> {
    let mut a = Args {
        all: false,
        archs: ARCHS.to_vec(),
        jobs: std::thread::available_parallelism().map_or(2, |n| n.get()),
        filter: None,
        out: PathBuf::from("target/cuda-check"),
        cuda: std::env::var_os("CUDA_PATH").map(PathBuf::from),
        no_cache: false,
        list: false,
        sources: None,
        baseline: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} takes a value; {USAGE}"));
        match arg.as_str() {
            "--all" => a.all = true,
            "--no-cache" => a.no_cache = true,
            "--list" => a.list = true,
            "--arch" => {
                a.archs = value()?
                    .split(',')
                    .map(|name| {
                        ARCHS
                            .into_iter()
                            .find(|arch| arch.nvrtc == name || arch.nvrtc == format!("{name}a"))
                            .ok_or(format!("unknown architecture {name}; {USAGE}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--jobs" => a.jobs = value()?.parse().map_err(|e| format!("--jobs: {e}"))?,
            "--filter" => a.filter = Some(value()?),
            "--out" => a.out = PathBuf::from(value()?),
            "--cuda" => a.cuda = Some(PathBuf::from(value()?)),
            "--sources" => a.sources = Some(PathBuf::from(value()?)),
            "--baseline" => a.baseline = Some(PathBuf::from(value()?)),
            _ => return Err(USAGE.into()),
        }
    }
    Ok(a)
}

/// One kernel variant: a distinct source on one architecture, and the calls that launch it.
struct Variant {
    launch: TargetLaunch,
    /// The first call that launched it.
    call: String,
    /// How many calls launched it.
    calls: usize,
}

/// FNV-1a of `parts` (the hand-written kernels' source hash), each part ended by a NUL.
fn fnv(parts: &[&str]) -> u64 {
    let joined: String = parts.iter().flat_map(|p| [*p, "\0"]).collect();
    burn_flash_kernels::hopper::source_hash(&joined)
}

/// Makes every call on every architecture; returns the distinct variants in launch order and
/// the calls that failed (a plan refusing a call the grid expects to run).
fn collect(args: &Args) -> (Vec<Variant>, Vec<String>) {
    let mut variants: Vec<Variant> = Vec::new();
    let mut index: HashMap<(u32, u64), usize> = HashMap::new();
    let mut failed = Vec::new();
    for &arch in &args.archs {
        let client = TargetRuntime::client_of(arch);
        for call in grid::calls(&[arch], args.all) {
            if args
                .filter
                .as_ref()
                .is_some_and(|f| !call.name.contains(f.as_str()))
            {
                continue;
            }
            if let Err(e) = call.run(&client) {
                failed.push(format!("{arch} {}: {e}", call.name));
            }
            // The client hands launches to the server's thread: wait for them.
            if let Err(e) = cubecl::future::block_on(client.sync()) {
                failed.push(format!("{arch} {}: {e:?}", call.name));
            }
            for launch in take_launches() {
                let key = (arch.cc, fnv(&[&launch.source, &launch.entry]));
                match index.get(&key) {
                    Some(&i) => variants[i].calls += 1,
                    None => {
                        index.insert(key, variants.len());
                        variants.push(Variant {
                            launch,
                            call: call.name.clone(),
                            calls: 1,
                        });
                    }
                }
            }
        }
    }
    (variants, failed)
}

/// The NVRTC options of a launch: cubecl-cuda's (`--gpu-architecture`, the CUDA include path
/// and its CCCL folder, `-lineinfo`), then the resource report.
fn options(arch: Arch, headers: &Path) -> Vec<String> {
    let include = headers.display();
    vec![
        format!("--gpu-architecture={}", arch.nvrtc),
        format!("--include-path={include}"),
        "-lineinfo".into(),
        format!("--include-path={include}/cccl"),
        "--ptxas-options=-v".into(),
    ]
}

/// A cached result: `registers spill_stores spill_loads stack static_smem barriers ms`.
fn read_cache(path: &Path) -> Option<(Resources, f64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let n: Vec<f64> = text
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let [
        registers,
        spill_stores,
        spill_loads,
        stack,
        static_smem,
        barriers,
        ms,
    ] = n[..]
    else {
        return None;
    };
    let u = |x: f64| x as u32;
    Some((
        Resources {
            registers: u(registers),
            spill_stores: u(spill_stores),
            spill_loads: u(spill_loads),
            stack: u(stack),
            static_smem: u(static_smem),
            barriers: u(barriers),
        },
        ms,
    ))
}

fn write_cache(path: &Path, (r, ms): &(Resources, f64)) {
    let text = format!(
        "{} {} {} {} {} {} {ms:.1}\n",
        r.registers, r.spill_stores, r.spill_loads, r.stack, r.static_smem, r.barriers
    );
    let _ = std::fs::write(path, text);
}

/// Compiles every variant not refused before NVRTC, `jobs` at a time; returns each one's
/// outcome and whether it came from the cache.
fn compile_all(
    args: &Args,
    variants: &[Variant],
    headers: &Path,
    nvrtc: (i32, i32),
) -> Vec<(Compiled, bool)> {
    let cache = args.out.join("cache");
    let _ = std::fs::create_dir_all(&cache);
    let results: Vec<Mutex<Option<(Compiled, bool)>>> =
        variants.iter().map(|_| Mutex::new(None)).collect();
    let next = Mutex::new(0usize);
    let done = Mutex::new(0usize);
    let todo = variants
        .iter()
        .filter(|v| v.launch.refused.is_none())
        .count();
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..args.jobs.max(1) {
            s.spawn(|| {
                loop {
                    let i = {
                        let mut n = next.lock().unwrap();
                        *n += 1;
                        *n - 1
                    };
                    let Some(v) = variants.get(i) else { break };
                    if v.launch.refused.is_some() {
                        continue;
                    }
                    let opts = options(v.launch.arch, headers);
                    let version = format!("{}.{}", nvrtc.0, nvrtc.1);
                    // The headers come with NVRTC's version: their path is not part of the key.
                    let key = fnv(&[
                        &version,
                        v.launch.arch.nvrtc,
                        &v.launch.source,
                        &v.launch.entry,
                    ]);
                    let path = cache.join(format!("{key:016x}"));
                    let cached = (!args.no_cache).then(|| read_cache(&path)).flatten();
                    let outcome = match cached {
                        Some(hit) => (Ok(hit), true),
                        None => {
                            let compiled = nvrtc::compile(&v.launch.source, &v.launch.entry, &opts);
                            if let Ok(ok) = &compiled {
                                write_cache(&path, ok);
                            }
                            (compiled, false)
                        }
                    };
                    *results[i].lock().unwrap() = Some(outcome);
                    let mut d = done.lock().unwrap();
                    *d += 1;
                    if (*d).is_multiple_of(25) || *d == todo {
                        eprintln!(
                            "cuda-check: {}/{todo} compiled ({:.0} s)",
                            *d,
                            start.elapsed().as_secs_f64()
                        );
                    }
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| {
            r.into_inner()
                .unwrap()
                .unwrap_or((Err("refused before NVRTC".into()), false))
        })
        .collect()
}

/// Writes each variant's source as `dir/<arch>/<entry>-<source hash>.cu`, its first call and
/// NVRTC's options in a comment at the top.
fn write_sources(dir: &Path, variants: &[Variant]) -> std::io::Result<()> {
    for v in variants {
        let l = &v.launch;
        let folder = dir.join(l.arch.nvrtc);
        std::fs::create_dir_all(&folder)?;
        let hash = fnv(&[&l.source]);
        let header = format!(
            "// {} ({} threads, {} B of dynamic shared memory), first launched by: {}\n",
            l.entry,
            l.cube_dim.num_elems(),
            l.shared_bytes,
            v.call
        );
        std::fs::write(
            folder.join(format!("{}-{hash:016x}.cu", l.entry)),
            header + &l.source,
        )?;
    }
    Ok(())
}

/// The CSV of the run: one row per variant.
fn write_csv(path: &Path, rows: &[(&Variant, &(Compiled, bool), &Verdict)]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    writeln!(
        f,
        "kernel,variant,arch,threads,registers,register_budget,spill_stores,spill_loads,stack,static_smem,dynamic_smem,smem_limit,barriers,matrix_units,nvrtc_ms,cached,calls,status"
    )?;
    for (v, (compiled, cached), verdict) in rows {
        let l = &v.launch;
        let r = compiled.as_ref().map(|(r, _)| *r).unwrap_or_default();
        let ms = compiled.as_ref().map_or(0.0, |(_, ms)| *ms);
        writeln!(
            f,
            "{},\"{}\",{},{},{},{},{},{},{},{},{},{},{},{},{ms:.0},{},{},\"{}\"",
            l.entry,
            v.call,
            l.arch,
            l.cube_dim.num_elems(),
            r.registers,
            verdict
                .register_budget
                .map_or(String::new(), |b| b.to_string()),
            r.spill_stores,
            r.spill_loads,
            r.stack,
            r.static_smem,
            l.shared_bytes,
            l.arch.max_shared,
            r.barriers,
            verdict.matrix_units,
            cached,
            v.calls,
            verdict.status().replace('"', "'"),
        )?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cuda-check: {e}");
            return ExitCode::from(2);
        }
    };
    let start = Instant::now();
    let (variants, failed) = collect(&args);
    eprintln!(
        "cuda-check: {} variants from the {} grid on {} ({:.1} s to plan and generate)",
        variants.len(),
        if args.all { "full" } else { "representative" },
        args.archs
            .iter()
            .map(|a| a.nvrtc)
            .collect::<Vec<_>>()
            .join(", "),
        start.elapsed().as_secs_f64()
    );
    if let Some(dir) = &args.sources {
        if let Err(e) = write_sources(dir, &variants) {
            eprintln!("cuda-check: writing sources under {}: {e}", dir.display());
            return ExitCode::from(2);
        }
        eprintln!("cuda-check: sources under {}", dir.display());
    }
    if args.list {
        for v in &variants {
            println!(
                "{} {} ({} calls, first: {})",
                v.launch.arch, v.launch.entry, v.calls, v.call
            );
        }
        return ExitCode::SUCCESS;
    }
    let nvrtc_version = match nvrtc::version() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("cuda-check: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(cuda) = &args.cuda else {
        eprintln!("cuda-check: no CUDA headers: pass --cuda (a CUDA_PATH) or set CUDA_PATH");
        return ExitCode::from(2);
    };
    let headers = cuda.join("include");
    // A toolkit has every header; the `nvidia-cuda-runtime` wheel lacks `crt/` and CCCL,
    // which NVRTC bundles.
    if !headers.join("crt").join("host_config.h").exists()
        && let Err(e) = nvrtc::install_headers(&headers)
    {
        eprintln!("cuda-check: {e}");
        return ExitCode::from(2);
    }
    if !headers.join("cuda_runtime.h").exists() {
        eprintln!(
            "cuda-check: {} has no cuda_runtime.h (cubecl's kernels include it)",
            headers.display()
        );
        return ExitCode::from(2);
    }
    let compiled = compile_all(&args, &variants, &headers, nvrtc_version);
    let verdicts: Vec<Verdict> = variants
        .iter()
        .zip(&compiled)
        .map(|(v, (c, _))| budget::judge(&v.launch, c))
        .collect();
    let rows: Vec<_> = variants
        .iter()
        .zip(&compiled)
        .zip(&verdicts)
        .map(|((v, c), j)| (v, c, j))
        .collect();
    let _ = std::fs::create_dir_all(&args.out);
    let csv = args.out.join("resources.csv");
    if let Err(e) = write_csv(&csv, &rows) {
        eprintln!("cuda-check: writing {}: {e}", csv.display());
    }
    let summary = budget::summary(&rows);
    println!("{summary}");
    if let Some(base) = &args.baseline {
        match std::fs::read_to_string(base) {
            Ok(old) => print!("{}", budget::compare(&old, &rows)),
            Err(e) => eprintln!("cuda-check: reading {}: {e}", base.display()),
        }
    }
    let mut broken = 0;
    for (v, (c, _), verdict) in &rows {
        if verdict.ok() {
            continue;
        }
        broken += 1;
        println!(
            "FAIL {} {} [{}]: {}",
            v.launch.arch,
            v.launch.entry,
            v.call,
            verdict.status()
        );
        if let Err(log) = c
            && v.launch.refused.is_none()
        {
            println!(
                "---- NVRTC log ----\n{log}\n---- source: {} lines ----",
                v.launch.source.lines().count()
            );
        }
    }
    for f in &failed {
        println!("FAIL call refused: {f}");
    }
    let fresh = compiled
        .iter()
        .filter(|(c, cached)| c.is_ok() && !cached)
        .count();
    let nvrtc_ms: f64 = compiled
        .iter()
        .filter(|(_, cached)| !cached)
        .filter_map(|(c, _)| c.as_ref().ok().map(|(_, ms)| ms))
        .sum();
    println!(
        "cuda-check: {} variants, {fresh} compiled now ({:.0} s of NVRTC), {} from the cache; {} failures; report {} ({:.0} s in all, NVRTC {}.{})",
        variants.len(),
        nvrtc_ms / 1e3,
        compiled.iter().filter(|(_, cached)| *cached).count(),
        broken + failed.len(),
        csv.display(),
        start.elapsed().as_secs_f64(),
        nvrtc_version.0,
        nvrtc_version.1
    );
    if broken + failed.len() > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every call of the representative grid plans on every architecture, and every kernel it
    /// launches compiles to CUDA C++ within the device's limits (no NVRTC needed).
    #[test]
    fn every_call_plans_and_generates_within_limits() {
        let args = Args {
            all: false,
            archs: ARCHS.to_vec(),
            jobs: 1,
            filter: None,
            out: PathBuf::new(),
            cuda: None,
            no_cache: true,
            list: true,
            sources: None,
            baseline: None,
        };
        let (variants, failed) = collect(&args);
        assert!(failed.is_empty(), "calls refused: {failed:#?}");
        let refused: Vec<_> = variants
            .iter()
            .filter_map(|v| {
                v.launch
                    .refused
                    .as_ref()
                    .map(|r| (&v.call, v.launch.arch, r))
            })
            .collect();
        assert!(refused.is_empty(), "launches refused: {refused:#?}");
        for arch in ARCHS {
            let n = variants.iter().filter(|v| v.launch.arch == arch).count();
            assert!(n > 100, "{arch}: only {n} variants");
        }
        // The Hopper kernels on sm_90a only, but for the backward's per-row passes, which the
        // Ampere backward runs on every architecture.
        let rows = [
            "burn_flash_hopper_backward_rows",
            "burn_flash_hopper_backward_dq",
        ];
        let mut hopper = variants.iter().filter(|v| {
            v.launch.entry.starts_with("burn_flash_hopper")
                && !rows.contains(&v.launch.entry.as_str())
        });
        assert!(hopper.clone().count() >= 20);
        assert!(
            hopper.all(|v| v.launch.arch.cc == 90),
            "Hopper kernels on sm_90a only"
        );
        for arch in ARCHS {
            for entry in [
                "burn_flash_sm80_backward",
                "burn_flash_sm80_backward_paired",
            ] {
                assert!(
                    variants
                        .iter()
                        .any(|v| v.launch.arch == arch && v.launch.entry == entry),
                    "{arch}: no {entry}"
                );
            }
        }
    }
}
