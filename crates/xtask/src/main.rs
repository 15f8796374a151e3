//! Project tasks, Burn-style: `cargo xtask demo` runs the quick-start example, `cargo xtask test`
//! runs the whole test suite. Both first make sure a Vulkan driver is there for wgpu (on a
//! machine without a GPU that is Mesa's lavapipe): as root they install `mesa-vulkan-drivers`,
//! otherwise they say what to install. Where `XDG_RUNTIME_DIR` is unset (a headless login),
//! they give the child a private one ([`runtime_dir`]): the Vulkan loader's Wayland probe
//! otherwise prints `error: XDG_RUNTIME_DIR is invalid or not set in the environment.` on
//! every device it opens, which reads as a failure though nothing failed.
//!
//! Extra arguments are passed to cargo (`cargo xtask test --features cuda`), those after `--` to
//! every test binary (`cargo xtask test -- causal`). `cargo xtask test` builds every test target,
//! then runs the tests in several processes at a time, one per group of a binary's tests
//! ([`lanes`]: `XTASK_TEST_JOBS` processes, the cores by default), each one test at a time unless
//! `RUST_TEST_THREADS` says otherwise (see [`TEST_THREADS`]).
//!
//! `cargo xtask cuda-check [ARGS]` compiles every planned CUDA kernel variant on the CPU with
//! NVRTC and holds it to its budgets (`crates/cuda-check`; ARGS are its own, `--all` for the
//! full grid). It first installs NVRTC and the CUDA headers from NVIDIA's wheels
//! (`nvidia-cuda-nvrtc`, `nvidia-cuda-runtime`, [`CUDA_WHEELS`]) into a cache folder
//! ([`cuda_home`]) with pip, once. With `BURN_FLASH_MUTATION` set it builds the check with the
//! kernels' deliberate bugs (`--features mutants`); `cargo xtask cuda-check --mutations` runs
//! each of the check's own mutations and fails unless every one is caught. `--atomic-dq` builds
//! it with the kernels' `hopper-atomic-dq` feature (the Hopper backward's former per-thread `dQ`
//! reductions: `cargo xtask cuda-check --atomic-dq --arch sm_90a --filter Hopper`).

mod lanes;

use std::{
    path::Path,
    process::{Command, ExitCode},
};

const ICD_DIRS: [&str; 3] = [
    "/usr/share/vulkan/icd.d",
    "/etc/vulkan/icd.d",
    "/usr/local/share/vulkan/icd.d",
];

fn has_vulkan_loader() -> bool {
    Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libvulkan.so.1"))
        .unwrap_or(false)
}

fn has_vulkan_driver() -> bool {
    if std::env::var_os("VK_ICD_FILENAMES").is_some()
        || std::env::var_os("VK_DRIVER_FILES").is_some()
    {
        return true;
    }
    ICD_DIRS.iter().any(|dir| {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .any(|e| e.path().extension().is_some_and(|x| x == "json"))
            })
            .unwrap_or(false)
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A private `XDG_RUNTIME_DIR` for the child (`<temp>/burn-flash-xdg-<uid>`, mode 0700) where
/// the variable is unset or names no directory; `None` where it is usable (or the folder cannot
/// be made: the child then prints the Wayland probe's line, harmless).
fn runtime_dir() -> Option<String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| Path::new(&d).is_dir()) {
        return None;
    }
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("burn-flash-xdg-{uid}"));
    let made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    let usable = made.is_ok()
        || std::fs::metadata(&dir)
            .is_ok_and(|m| m.is_dir() && m.permissions().mode() & 0o777 == 0o700);
    usable.then(|| dir.to_string_lossy().into_owned())
}

/// Test threads per test process for `cargo xtask test` where `RUST_TEST_THREADS` is unset. The
/// tests of a process share one device per backend, and its kernels compile on one device
/// thread whatever the test threads: on 2 cores (2026-11-25) `attention_backward` took 1174 s
/// with 2 test threads and 361 s one test at a time. Parallelism comes from processes instead
/// ([`lanes`]).
const TEST_THREADS: &str = "1";

fn run(program: &str, args: &[&str]) -> bool {
    run_with(program, args, &[])
}

fn run_with(program: &str, args: &[&str], envs: &[(&str, &str)]) -> bool {
    let shown: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    eprintln!("xtask: {}{program} {}", shown.concat(), args.join(" "));
    Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Makes sure wgpu can find a Vulkan driver; installs Mesa's when root.
fn ensure_vulkan() -> Result<(), String> {
    if has_vulkan_loader() && has_vulkan_driver() {
        return Ok(());
    }
    const HINT: &str = "install a Vulkan driver: `apt-get install -y mesa-vulkan-drivers` \
                        (Debian/Ubuntu; lavapipe runs Vulkan on the CPU), or your GPU vendor's";
    if !Path::new("/usr/bin/apt-get").exists() {
        return Err(format!("no Vulkan driver found; {HINT}"));
    }
    if !is_root() {
        return Err(format!("no Vulkan driver found; as root, {HINT}"));
    }
    eprintln!("xtask: no Vulkan driver found; installing Mesa's (lavapipe)");
    let ok = run("apt-get", &["update", "-qq"])
        && run("apt-get", &["install", "-y", "-qq", "mesa-vulkan-drivers"]);
    if ok && has_vulkan_loader() && has_vulkan_driver() {
        Ok(())
    } else {
        Err(format!("installing mesa-vulkan-drivers failed; {HINT}"))
    }
}

fn cargo(args: &[String], envs: &[(&str, &str)]) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    if run_with(&cargo, &args, envs) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The CUDA version of the NVRTC the check installs: the CUDA 13 of the GPU machines, and the
/// first NVRTC that bundles its headers (`nvrtcInstallBundledHeaders`).
const CUDA_WHEELS: [&str; 2] = ["nvidia-cuda-nvrtc==13.5.*", "nvidia-cuda-runtime==13.5.*"];

/// Where the check's CUDA lives: `$XDG_CACHE_HOME/burn-flash/cuda-13.5` (else under
/// `~/.cache`); its `nvidia/cu13` is a `CUDA_PATH` (`include/`, and `lib/` with NVRTC).
fn cuda_home() -> std::path::PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(|| "target".into());
    cache.join("burn-flash").join("cuda-13.5")
}

/// Installs NVRTC and the CUDA headers from NVIDIA's wheels unless they are there; returns
/// the `CUDA_PATH`.
fn ensure_nvrtc() -> Result<std::path::PathBuf, String> {
    let home = cuda_home();
    let cuda = home.join("nvidia").join("cu13");
    let ready = |c: &Path| {
        c.join("lib").join("libnvrtc.so.13").exists()
            && c.join("include").join("cuda_runtime.h").exists()
    };
    if ready(&cuda) {
        return Ok(cuda);
    }
    eprintln!(
        "xtask: installing NVRTC and the CUDA headers into {}",
        home.display()
    );
    let target = home.to_string_lossy().into_owned();
    let mut args = vec![
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--target",
        &target,
    ];
    args.extend(CUDA_WHEELS);
    if !run("python3", &args) || !ready(&cuda) {
        return Err(format!(
            "could not install NVRTC: `python3 -m pip install --target {target} {}` failed \
             (it needs Python 3 with pip and PyPI)",
            CUDA_WHEELS.join(" ")
        ));
    }
    Ok(cuda)
}

/// The check's own mutations: each must make `cuda-check` fail on the calls given, with the
/// message given in its output.
const CHECK_MUTATIONS: [(&str, &[&str], &str); 5] = [
    (
        "forced-spill",
        &[
            "--arch",
            "sm_90a",
            "--filter",
            "attention Hopper f16 D128/128 plain fwd",
        ],
        "in a matrix-unit kernel",
    ),
    (
        "register-budget",
        &[
            "--arch",
            "sm_80",
            "--filter",
            "attention MatrixUnits f16 D128/128 plain fwd",
        ],
        "over the budget of",
    ),
    (
        "hopper-syntax",
        &[
            "--arch",
            "sm_90a",
            "--filter",
            "attention Hopper f16 D128/128 plain fwd",
        ],
        "---- NVRTC log ----",
    ),
    (
        "uncounted-barriers",
        &[
            "--arch",
            "sm_86",
            "--filter",
            "attention MatrixUnits f16 D256/256 plain fwd",
        ],
        "of shared memory; the device has",
    ),
    (
        "dropped-parameter",
        &[
            "--arch",
            "sm_90a",
            "--filter",
            "attention Hopper f16 D128/128 plain fwd",
        ],
        "parameters; `burn_flash_hopper_forward` takes",
    ),
];

/// `cargo xtask cuda-check`: NVRTC installed, then the check run (module docs).
fn cuda_check(rest: &[String]) -> ExitCode {
    let cuda = match ensure_nvrtc() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("xtask: {e}");
            return ExitCode::FAILURE;
        }
    };
    let lib = cuda.join("lib").to_string_lossy().into_owned();
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{lib}:{old}"),
        _ => lib,
    };
    let cuda_path = cuda.to_string_lossy().into_owned();
    let envs = [
        ("LD_LIBRARY_PATH", ld.as_str()),
        ("CUDA_PATH", cuda_path.as_str()),
    ];
    let mutations = rest.iter().any(|a| a == "--mutations");
    let mutants = mutations || std::env::var_os("BURN_FLASH_MUTATION").is_some();
    let atomic_dq = rest.iter().any(|a| a == "--atomic-dq");
    let rest: Vec<String> = rest
        .iter()
        .filter(|a| *a != "--atomic-dq")
        .cloned()
        .collect();
    let features: Vec<&str> = [(mutants, "mutants"), (atomic_dq, "hopper-atomic-dq")]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
    // `cargo run` of the check, with the kernels' mutations compiled in where asked.
    let check = |args: &[&str]| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["run", "--quiet", "--package", "cuda-check"]);
        if !features.is_empty() {
            cmd.args(["--features", &features.join(",")]);
        }
        cmd.arg("--").args(args).envs(envs);
        cmd
    };
    if !mutations {
        let args: Vec<&str> = rest.iter().map(String::as_str).collect();
        eprintln!(
            "xtask: cuda-check {} (CUDA_PATH={cuda_path})",
            args.join(" ")
        );
        let ok = check(&args).status().is_ok_and(|s| s.success());
        return if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    // Each mutation must fail the check with its message; unmutated, the same calls pass.
    let mut all_caught = true;
    for (name, args, expect) in CHECK_MUTATIONS {
        let clean = check(args).status().is_ok_and(|s| s.success());
        let mutated = check(args).env("BURN_FLASH_MUTATION", name).output();
        let (failed, shown) = match &mutated {
            Ok(out) => (
                !out.status.success(),
                String::from_utf8_lossy(&out.stdout).contains(expect),
            ),
            Err(_) => (false, false),
        };
        let caught = clean && failed && shown;
        eprintln!(
            "xtask: mutation {name}: unmutated {}; mutated {}, `{expect}` {} → {}",
            if clean { "passes" } else { "FAILS" },
            if failed { "fails" } else { "PASSES" },
            if shown { "shown" } else { "NOT shown" },
            if caught { "caught" } else { "NOT CAUGHT" },
        );
        all_caught &= caught;
    }
    if all_caught {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let wgpu_needed = !rest.iter().any(|a| a == "--no-default-features");
    if task == "cuda-check" {
        return cuda_check(&rest);
    }
    let plan: Vec<String> = match task.as_str() {
        "demo" => ["run", "--example", "quickstart"]
            .map(String::from)
            .to_vec(),
        // `cuda-check` turns on the kernels' `cuda` feature: built with the suites, it would
        // unify `cuda` into them (`cargo xtask cuda-check` tests it).
        "test" => ["test", "--workspace", "--exclude", "cuda-check"]
            .map(String::from)
            .to_vec(),
        _ => {
            eprintln!("usage: cargo xtask demo|test [cargo args] | cuda-check [check args]");
            return ExitCode::FAILURE;
        }
    };
    if wgpu_needed && let Err(e) = ensure_vulkan() {
        eprintln!("xtask: {e}");
        return ExitCode::FAILURE;
    }
    let mut envs: Vec<(&str, &str)> = Vec::new();
    if task == "test" && std::env::var_os("RUST_TEST_THREADS").is_none() {
        envs.push(("RUST_TEST_THREADS", TEST_THREADS));
    }
    let runtime = runtime_dir();
    if let Some(dir) = &runtime {
        envs.push(("XDG_RUNTIME_DIR", dir));
    }
    if task == "test" {
        // Arguments before `--` go to cargo's build, those after it to every test binary.
        let split = rest.iter().position(|a| a == "--").unwrap_or(rest.len());
        let mut cargo_args: Vec<String> = plan[1..].to_vec();
        cargo_args.extend(rest[..split].iter().cloned());
        let test_args = rest.get(split + 1..).unwrap_or_default();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        return lanes::test(&cargo, &cargo_args, test_args, &envs);
    }
    let mut cmd = plan;
    cmd.extend(rest);
    cargo(&cmd, &envs)
}
