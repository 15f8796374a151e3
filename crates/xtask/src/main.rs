//! Project tasks, Burn-style: `cargo xtask demo` runs the quick-start example, `cargo xtask test`
//! runs the whole test suite. Both first make sure a Vulkan driver is there for wgpu (on a
//! machine without a GPU that is Mesa's lavapipe): as root they install `mesa-vulkan-drivers`,
//! otherwise they say what to install.
//!
//! Extra arguments are passed to cargo (`cargo xtask test --features cuda`). `cargo xtask test`
//! runs one test at a time in each test binary unless `RUST_TEST_THREADS` says otherwise (see
//! [`TEST_THREADS`]).

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

/// Test threads per test binary for `cargo xtask test` where `RUST_TEST_THREADS` is unset. The
/// tests of a binary share one device per backend, whose Fusion and cubecl threads spin while
/// they wait for work; run in parallel on a small CPU, they take cores from lavapipe's workers.
/// On 2 cores (2026-11-25) `attention_backward` took 1174 s with 2 test threads and 361 s one
/// test at a time; on CUDA one process compiles one kernel at a time whatever the threads.
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

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let wgpu_needed = !rest.iter().any(|a| a == "--no-default-features");
    let plan: Vec<String> = match task.as_str() {
        "demo" => ["run", "--example", "quickstart"]
            .map(String::from)
            .to_vec(),
        "test" => ["test", "--workspace"].map(String::from).to_vec(),
        _ => {
            eprintln!("usage: cargo xtask demo|test [cargo args]");
            return ExitCode::FAILURE;
        }
    };
    if wgpu_needed && let Err(e) = ensure_vulkan() {
        eprintln!("xtask: {e}");
        return ExitCode::FAILURE;
    }
    let envs: &[(&str, &str)] = if task == "test" && std::env::var_os("RUST_TEST_THREADS").is_none()
    {
        &[("RUST_TEST_THREADS", TEST_THREADS)]
    } else {
        &[]
    };
    let mut cmd = plan;
    cmd.extend(rest);
    cargo(&cmd, envs)
}
