//! Peak device memory of one call on a CubeCL runtime (CUDA, wgpu), measured so that no buffer
//! the call allocates can hide.
//!
//! # What is measured
//! [`peak_memory`] returns an upper bound on the bytes of the device memory pool that were *in
//! use* (held by a live buffer: inputs, outputs, intermediates) at any moment of the call,
//! including what was already in use when it started. Since the pool allocates each buffer
//! exactly (rounded up to the device's alignment: 512 B on CUDA), the bound is the true peak
//! whenever no buffer was freed and followed by a buffer of another size; otherwise it counts
//! both. For one custom kernel, or a short chain like `softmax(x).matmul(v)`, it is exact up to
//! the alignment.
//!
//! # Why it can be trusted
//! cubecl's pool reports `bytes_in_use` and `bytes_reserved`, both only as of now
//! (`cubecl-runtime-0.10.0/src/memory_management/memory_manage.rs`, `memory_usage`). Neither is
//! a peak: an intermediate that the call allocates and frees is gone from `bytes_in_use` by the
//! end, and the default pools reserve memory ahead of use (CUDA's sliced pools reserve pages of
//! up to a quarter of the device, `cubecl-cuda-0.10.0/src/runtime.rs`:
//! `max_page_size: max_memory / 4`), so `bytes_reserved` can absorb a gigabyte without growing.
//! [`use_exact_pool`] therefore puts the process's pools in cubecl's *persistent* mode (config
//! `memory.persistent_memory = "enforced"`; `MemoryManagement::from_configuration` then starts
//! in `MemoryAllocationMode::Persistent` and `MemoryManagement::mode` can no longer change it),
//! where every reservation goes to the `PersistentPool` (`memory_manage.rs`, `reserve`:
//! `if matches!(self.mode, MemoryAllocationMode::Persistent) ... self.persistent.alloc(..)`).
//! That pool (`memory_pool/persistent_pool.rs`):
//! - allocates a buffer of exactly the requested size plus alignment padding (`alloc`), and
//!   reuses a free buffer only for a request of the same padded size (`try_reserve`): nothing is
//!   reserved ahead of use;
//! - never releases a buffer except on an explicit cleanup (`cleanup`: `if explicit`), so its
//!   reserved bytes only grow during the call;
//! - on an explicit cleanup releases every free buffer, leaving reserved = in use + padding.
//!
//! So after a cleanup the pool holds exactly the live buffers; during the call every byte in
//! use sits in a reserved buffer and reserved bytes never shrink; hence the reserved bytes after
//! the call bound the bytes in use at every moment of it. [`peak_memory`] checks the first point
//! (reserved = in use + padding before the call), so a process that did not call
//! [`use_exact_pool`] in time fails loudly instead of measuring wrong.
//!
//! Allocations happen when an operation *executes* on the runtime's server (with Burn's Fusion,
//! when its queue is flushed, e.g. at a sync), and buffers are freed as their handles drop, so
//! the call is bracketed by syncs. The counters are per stream (on CUDA each stream has its own
//! pool, `cubecl-cuda-0.10.0/src/compute/command.rs`: `self.streams.current()`); Fusion runs
//! the operations of a thread on that thread's stream (`burn-fusion-0.21.0/src/op.rs`:
//! `self.stream_id.executes(..)`), so calling from the thread that issues the ops reads their
//! pool. Staging and pinned host memory are separate pools and not counted.
//!
//! # Cost
//! In persistent mode the pool keeps one buffer per distinct size until a cleanup, so a process
//! that runs many shapes holds more memory than with the default pools (each measurement starts
//! with a cleanup). Run the measurement in a process of its own (a test binary, or a bench run
//! dedicated to memory), not in one whose timings matter.
//!
//! This file depends only on cubecl, so that benches can include it with `#[path]`.

#![allow(dead_code)]

use std::sync::{Arc, Once};

use cubecl::{
    MemoryUsage, Runtime,
    client::ComputeClient,
    config::{CubeClRuntimeConfig, RuntimeConfig, memory::PersistentMemory},
};

/// Puts every device memory pool of this process in cubecl's persistent mode (see the module
/// docs). Call it before the first use of any device of the process (a device's pools read
/// the configuration when the device starts); later calls do nothing. The rest of cubecl's
/// configuration (`cubecl.toml`, `CUBECL_*` variables) is kept.
///
/// A call after a device started does not reach that device's pools (they read the
/// configuration once): the tests call it first thing.
pub fn use_exact_pool() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let mut state = CubeClRuntimeConfig::storage().lock();
        match state.as_ref() {
            None => {
                let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
                config.memory.persistent_memory = PersistentMemory::Enforced;
                *state = Some(Arc::new(config));
            }
            // burn-flash's constructor stores the configuration before `main` (its
            // compilation cache); no device has read it yet when this runs first thing.
            Some(config)
                if !matches!(config.memory.persistent_memory, PersistentMemory::Enforced) =>
            {
                let mut config = config.as_ref().clone();
                config.memory.persistent_memory = PersistentMemory::Enforced;
                *state = Some(Arc::new(config));
            }
            Some(_) => {}
        }
    });
}

/// Device memory around one call, in bytes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeakMemory {
    /// In use when the call started (its inputs and anything else alive).
    pub before: u64,
    /// Upper bound on the bytes in use at any moment of the call, `before` included (with the
    /// buffers' alignment padding: under 512 B each on CUDA).
    pub peak: u64,
    /// In use after the call (with its outputs still alive).
    pub after: u64,
}

impl PeakMemory {
    /// Memory the call needed beyond what it left allocated: its freed intermediates.
    pub fn transient(&self) -> u64 {
        self.peak.saturating_sub(self.after)
    }
}

/// Runs `call` and measures the device memory it used on `client`'s pool; `sync` must wait for
/// all work queued on the device (e.g. `B::sync(&device)` for a Burn backend, which also
/// flushes Fusion's queue). Needs [`use_exact_pool`] to have run before the device's first use.
///
/// Keep the call's outputs alive in the returned value: buffers dropped inside `call` count
/// towards `peak` but not `after`.
///
/// # Panics
/// If the pool is not in persistent mode (reserved ≠ in use + padding after a cleanup), or the
/// runtime cannot report its memory.
pub fn peak_memory<R: Runtime, T>(
    client: &ComputeClient<R>,
    sync: impl Fn(),
    call: impl FnOnce() -> T,
) -> (T, PeakMemory) {
    sync();
    // Releases every free buffer: the pool holds exactly the live ones.
    client.memory_cleanup();
    let before = usage(client);
    assert_eq!(
        before.bytes_reserved,
        before.bytes_in_use + before.bytes_padding,
        "peak_memory: the pool keeps free memory after a cleanup, so it could hide the call's \
         allocations: call peak_memory::use_exact_pool() before the device's first use ({before:?})"
    );
    let out = call();
    sync();
    let after = usage(client);
    let measured = PeakMemory {
        before: before.bytes_in_use,
        // Every byte in use during the call sat in a buffer still reserved now.
        peak: after.bytes_reserved,
        after: after.bytes_in_use,
    };
    (out, measured)
}

fn usage<R: Runtime>(client: &ComputeClient<R>) -> MemoryUsage {
    client
        .memory_usage()
        .expect("peak_memory: the runtime reports no memory usage")
}
