//! Hashes the kernel sources into `BURN_FLASH_KERNEL_HASH`, which names the directory of the
//! compilation cache (`src/cache.rs`): cubecl keys cached PTX by kernel name and comptime
//! arguments, not by code, so a changed kernel must not find the old entries.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn main() {
    let src = Path::new("src");
    println!("cargo:rerun-if-changed=src");
    let mut paths = Vec::new();
    files(src, &mut paths);
    paths.sort();
    // FNV-1a over (path, contents): stable across Rust versions, unlike `DefaultHasher`.
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    for path in &paths {
        path.to_string_lossy().hash(&mut h);
        std::fs::read(path).unwrap_or_default().hash(&mut h);
    }
    println!("cargo:rustc-env=BURN_FLASH_KERNEL_HASH={:016x}", h.finish());
}
