//! The check both memory suites make (`attention_memory`, `softmax_matmul_memory`): one
//! call's peak device memory ([`super::peak_memory`]) against what it may hold, with the
//! stock-ops composition as the proof that the check can fail.

use burn::tensor::{FloatDType, backend::Backend};

use super::peak_memory::{PeakMemory, peak_memory};
use super::sync;

/// Runs `call` on `device` (measured on runtime `R`'s pool) and checks its peak against
/// `allowed` bytes: the fused op must stay within it, and the composition of stock ops
/// (`composed`), which holds the scores, must not. `what` names the call in the messages.
/// Returns the call's output (to drop after the measurement) and the measurement.
pub fn check_peak<B: Backend, R: cubecl::Runtime, T>(
    device: &B::Device,
    what: &str,
    composed: bool,
    allowed: u64,
    call: impl FnOnce() -> T,
) -> (T, PeakMemory)
where
    R::Device: From<B::Device>,
{
    let client = R::client(&R::Device::from(device.clone()));
    let (out, mem) = peak_memory(&client, || sync::<B>(device), call);
    eprintln!(
        "{what}: peak {} KiB, allowed {} KiB (in use before {} KiB, after {} KiB)",
        mem.peak >> 10,
        allowed >> 10,
        mem.before >> 10,
        mem.after >> 10
    );
    assert_eq!(
        mem.peak <= allowed,
        !composed,
        "{what}: peak {} B, allowed {allowed} B ({mem:?})",
        mem.peak
    );
    (out, mem)
}

/// The checks of one backend on its default device: the composed self-check in f32 at
/// `composed`, then each fused case whose dtype the device supports.
pub fn check_backend<B: Backend, D: Copy>(
    composed: D,
    fused: &[(D, FloatDType)],
    check: impl Fn(&B::Device, FloatDType, bool, D),
) {
    let device = Default::default();
    check(&device, FloatDType::F32, true, composed);
    for &(dims, dtype) in fused {
        if B::supports_dtype(&device, dtype.into()) {
            check(&device, dtype, false, dims);
        }
    }
}
