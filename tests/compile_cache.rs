//! The compilation cache is on by default (`burn_flash::kernels::cache`): cubecl's configuration
//! names burn-flash's directory, keyed by the kernel sources; `BURN_FLASH_CACHE=off` and
//! `BURN_FLASH_CACHE_DIR` are obeyed (checked in child processes, which read the variables
//! before `main`); on CUDA a first launch writes PTX there.

use std::path::PathBuf;
use std::process::Command;

use burn_flash::kernels::cache::{KERNEL_SOURCE_HASH, active_cache_dir, cache_dir};

/// Runs the `probe` test of this binary in a child with `envs`, returns the directory it saw.
fn probe_in_child(envs: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = Command::new(exe);
    cmd.args(["probe", "--exact", "--nocapture", "--test-threads", "1"]);
    cmd.env_remove("BURN_FLASH_CACHE")
        .env_remove("BURN_FLASH_CACHE_DIR");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the probe");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "probe failed: {stdout}");
    stdout
        .lines()
        .find_map(|l| l.split_once("ACTIVE=").map(|(_, dir)| dir))
        .unwrap_or_else(|| panic!("no ACTIVE= line in {stdout}"))
        .to_string()
}

/// Prints the cache directory cubecl's configuration names (read by the parent test).
#[test]
fn probe() {
    println!("ACTIVE={:?}", active_cache_dir());
}

#[test]
fn on_by_default_keyed_by_the_sources() {
    // The process's own configuration: no cubecl.toml in this repository sets a cache, so
    // unless the environment turns it off, burn-flash's directory is the one in use.
    let ours = cache_dir();
    if std::env::var_os("BURN_FLASH_CACHE").is_none() {
        let dir = ours
            .clone()
            .expect("a user cache directory on this platform");
        let leaf = dir.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(
            leaf,
            format!("{}-{KERNEL_SOURCE_HASH}", env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(KERNEL_SOURCE_HASH.len(), 16);
        assert_eq!(active_cache_dir(), Some(dir));
    }
    // A fresh process with a clean environment turns it on …
    let default = probe_in_child(&[]);
    assert!(
        default.ends_with(&format!("0.1.0-{KERNEL_SOURCE_HASH}\")"))
            && default.contains("burn-flash"),
        "default: {default}"
    );
    // … the variable turns it off …
    assert_eq!(probe_in_child(&[("BURN_FLASH_CACHE", "off")]), "None");
    // … and the directory variable moves it.
    let moved = probe_in_child(&[("BURN_FLASH_CACHE_DIR", "/tmp/burn-flash-cache-test")]);
    let want =
        PathBuf::from("/tmp/burn-flash-cache-test").join(format!("0.1.0-{KERNEL_SOURCE_HASH}"));
    assert_eq!(moved, format!("{:?}", Some(want)));
}

/// A first CUDA launch writes its PTX into the cache directory.
#[cfg(feature = "cuda")]
#[test]
fn cuda_launch_fills_the_cache() {
    use burn::tensor::{Distribution, Tensor};
    type B = burn::backend::Cuda;
    let Some(dir) = active_cache_dir() else {
        panic!("the cache is off in this process (BURN_FLASH_CACHE?): nothing to check");
    };
    let device = Default::default();
    // A shape no other test of this binary uses, so its kernel variant is compiled or loaded here.
    let x = Tensor::<B, 2>::random([3, 777], Distribution::Normal(0.0, 1.0), &device);
    let y = burn_flash::softmax(x.clone(), 1);
    let want = burn::tensor::activation::softmax(x, 1);
    let err = (y - want).abs().max().into_scalar();
    assert!(err < 1e-6, "softmax error {err}");
    let files: Vec<_> = walk(&dir);
    assert!(
        files.iter().any(|f| f.to_string_lossy().contains("ptx")),
        "no PTX under {dir:?}: {files:?}"
    );
}

#[cfg(feature = "cuda")]
fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            }
            out.push(p);
        }
    }
    out
}
