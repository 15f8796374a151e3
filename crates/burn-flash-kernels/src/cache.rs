//! The compilation cache, on by default: compiled kernels (CUDA PTX) are kept on disk, so a
//! kernel variant compiles once per machine, not once per process.
//!
//! cubecl 0.10 has the cache (`[compilation] cache` in `cubecl.toml`) but leaves it off, and
//! keys its entries by kernel name, comptime arguments and cube shape, not by the kernel's
//! code: a changed kernel would load the old PTX. burn-flash turns it on when the process
//! starts, in a directory named after this crate's version and a hash of its kernel sources
//! (computed by `build.rs`), so a changed kernel never finds an old entry:
//!
//! `<user cache dir>/burn-flash/<version>-<source hash>/` — on Linux
//! `$XDG_CACHE_HOME/burn-flash/…` or `~/.cache/burn-flash/…`, on macOS
//! `~/Library/Caches/burn-flash/…`, on Windows `%LOCALAPPDATA%\burn-flash\…`.
//!
//! - **Where**: [`cache_dir()`]. `BURN_FLASH_CACHE_DIR` replaces the `<user cache dir>/burn-flash`
//!   part. A build with the `mutants` feature running a mutation adds `-mutation-<name>` to the
//!   directory: a mutation changes the code, not cubecl's keys.
//! - **Clear**: delete that directory (`rm -rf ~/.cache/burn-flash`); old versions' directories
//!   are never read again and can go at any time.
//! - **Off**: `BURN_FLASH_CACHE=off`. A `cubecl.toml` (or `burn.toml` `[cubecl]` section) that
//!   sets `[compilation] cache` itself is obeyed as it is.
//!
//! What the cache holds is cubecl's, for every kernel of the process (Burn's own included,
//! whose code the pinned burn and cubecl versions fix). It covers the CUDA runtime; cubecl 0.10
//! has no cache for wgpu's shaders.
//!
//! How it is turned on: cubecl reads its configuration once, when the first device starts, so
//! this runs before `main` (an `.init_array`-style constructor on Linux, macOS and Windows)
//! and stores the configuration cubecl would have loaded, with the cache added. A program that
//! sets cubecl's configuration itself with `CubeClRuntimeConfig::set` must run with
//! `BURN_FLASH_CACHE=off` (`set` refuses a configuration already stored) or put its settings in
//! `cubecl.toml`.

use std::path::PathBuf;
use std::sync::Arc;

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};

/// Hash of the kernel sources this crate was built from (see the module docs).
pub const KERNEL_SOURCE_HASH: &str = env!("BURN_FLASH_KERNEL_HASH");

/// The directory burn-flash gives cubecl's compilation cache: `None` where it is off
/// (`BURN_FLASH_CACHE=off`) or the platform has no user cache directory.
pub fn cache_dir() -> Option<PathBuf> {
    if std::env::var("BURN_FLASH_CACHE").is_ok_and(|v| v == "off" || v == "0") {
        return None;
    }
    let base = match std::env::var_os("BURN_FLASH_CACHE_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => dirs::cache_dir()?.join("burn-flash"),
    };
    let mut dir = format!("{}-{}", env!("CARGO_PKG_VERSION"), KERNEL_SOURCE_HASH);
    // A mutation changes the kernels' code but not cubecl's keys: its kernels get their own
    // entries, or a mutated run would load the plain PTX (and a plain run the mutated one).
    if let Some(name) = crate::mutation::chosen_name() {
        dir.push_str("-mutation-");
        dir.push_str(name);
    }
    Some(base.join(dir))
}

/// The cache directory cubecl's configuration names, if it has one (burn-flash's or the
/// user's own).
pub fn active_cache_dir() -> Option<PathBuf> {
    CubeClRuntimeConfig::get()
        .compilation
        .cache
        .as_ref()
        .map(CacheConfig::root)
}

/// Stores cubecl's configuration with the cache on, unless it was stored already or the
/// user's configuration names a cache. Never panics (a panic before `main` aborts).
fn enable() {
    let _ = std::panic::catch_unwind(|| {
        let Some(dir) = cache_dir() else { return };
        let mut state = CubeClRuntimeConfig::storage().lock();
        if state.is_some() {
            return;
        }
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        if config.compilation.cache.is_none() {
            config.compilation.cache = Some(CacheConfig::File(dir));
        }
        *state = Some(Arc::new(config));
    });
}

extern "C" fn enable_at_start() {
    enable();
}

/// The constructor: the platform's loader calls it before `main`. Referenced from
/// [`ensure_linked()`] so that the linker keeps it.
#[used]
#[cfg_attr(
    any(target_os = "linux", target_os = "android", target_os = "freebsd"),
    unsafe(link_section = ".init_array")
)]
#[cfg_attr(
    target_vendor = "apple",
    unsafe(link_section = "__DATA,__mod_init_func")
)]
#[cfg_attr(windows, unsafe(link_section = ".CRT$XCU"))]
static ENABLE_AT_START: extern "C" fn() = enable_at_start;

/// Keeps the constructor's object in the link (an object file of a library is linked only
/// when something refers to it): every launcher calls it.
#[inline]
pub(crate) fn ensure_linked() {
    std::hint::black_box(&ENABLE_AT_START);
}
