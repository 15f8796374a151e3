//! Peak device memory of `softmax(X)·V`'s forward, in its own test binary (its own process):
//! the measurement reads the device's memory pool, which concurrent tests would disturb, so
//! each backend runs its checks one after the other inside one test.

mod common;

use burn::tensor::{DType, FloatDType, Tensor, activation};
use burn_flash::{FlashBackend, softmax_matmul};
use common::*;

/// Peak device memory of the forward: inputs + output + 5%.
///
/// The pool keeps freed pages reserved until a cleanup. After a cleanup, buffers of the
/// outputs' sizes are allocated and freed (room for the outputs), then the growth of reserved
/// memory across the call is what the call needed beyond its outputs; it must stay within 5%
/// of inputs + output. The problem is sized per backend so that a `d1 × d2` buffer cannot
/// hide in the pool's free reserve: `composed = true` checks that Burn's `softmax(x).matmul(v)`
/// fails this check, so the check can fail.
fn peak_memory<B: FlashBackend, R: burn_cubecl::cubecl::Runtime>(
    device: &B::Device,
    dtype: FloatDType,
    composed: bool,
    (b, d1, d2): (usize, usize, usize),
) where
    R::Device: From<B::Device>,
{
    // An 8 MiB output in every dtype: the pool's pages are 8 MiB here, and a smaller output
    // would be rounded up to one by more than 5%.
    let elem = DType::from(dtype).size();
    let d3 = 1024 / elem;
    let client = R::client(&R::Device::from(device.clone()));
    let x = rand3::<B>([b, d1, d2], 4.0, dtype, device);
    let v = rand3::<B>([b, d2, d3], 1.0, dtype, device);
    sync::<B>(device);
    client.memory_cleanup();
    // Room for the outputs in the pool (freed buffers of their sizes): the op's own outputs then
    // need no new page, and any growth is memory the op needed beyond them.
    let room_out = Tensor::<B, 3>::zeros([b, d1, d3], device).cast(dtype);
    let room_lse = Tensor::<B, 2>::zeros([b, d1], device);
    sync::<B>(device);
    drop((room_out, room_lse));
    sync::<B>(device);
    let before = client.memory_usage().expect("memory usage");
    let out = if composed {
        activation::softmax(x.clone(), 2).matmul(v.clone())
    } else {
        softmax_matmul(x.clone(), v.clone())
    };
    sync::<B>(device);
    let after = client.memory_usage().expect("memory usage");
    let elem = elem as u64;
    let inputs = ((b * d1 * d2 + b * d2 * d3) as u64) * elem;
    let output = (b * d1 * d3) as u64 * elem + (b * d1 * 4) as u64;
    let grown = after.bytes_reserved.saturating_sub(before.bytes_reserved);
    let allowed = (inputs + output) / 20;
    let ok = grown <= allowed;
    assert_eq!(
        ok, !composed,
        "composed {composed}: the call grew reserved memory by {grown} B beyond room for \
         its outputs; 5% of inputs + output = {allowed} B (before {before:?}, after {after:?})"
    );
    drop((x, v, out));
}

/// `(batch, d1, d2)` on lavapipe: a 128 MiB f32 score matrix, more than the pool's free reserve.
#[cfg(feature = "wgpu")]
const WGPU_SIZE: (usize, usize, usize) = (8, 1024, 4096);
/// On CUDA the pool starts with ~1.6 GB reserved (H100): a 2 GiB f32 score matrix.
#[cfg(feature = "cuda")]
const CUDA_SIZE: (usize, usize, usize) = (8, 4096, 16384);

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_forward_within_inputs_plus_output() {
    type W = burn::backend::Wgpu;
    type R = burn::backend::wgpu::WgpuRuntime;
    let device = Default::default();
    // First show that the check catches a d1 × d2 buffer, then check the fused op.
    peak_memory::<W, R>(&device, FloatDType::F32, true, WGPU_SIZE);
    peak_memory::<W, R>(&device, FloatDType::F32, false, WGPU_SIZE);
    peak_memory::<W, R>(&device, FloatDType::F16, false, WGPU_SIZE);
}

/// Not a check on CUDA yet: cubecl's CUDA pool had 7 GB reserved before the call on an H100
/// (1.6 GB in an earlier process), so even a 2 GiB score matrix caused no growth and the
/// self-check (the composed op must fail) did not trip. Run with `--ignored` to see that; the
/// CUDA memory claim is unverified until the measurement reads the driver's free memory.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "reserved-memory growth cannot see the op's allocations in cubecl's CUDA pool"]
fn cuda_forward_within_inputs_plus_output() {
    type C = burn::backend::Cuda;
    type R = burn_cubecl::cubecl::cuda::CudaRuntime;
    let device = Default::default();
    peak_memory::<C, R>(&device, FloatDType::F32, true, CUDA_SIZE);
    peak_memory::<C, R>(&device, FloatDType::F32, false, CUDA_SIZE);
    peak_memory::<C, R>(&device, FloatDType::F16, false, CUDA_SIZE);
    peak_memory::<C, R>(&device, FloatDType::BF16, false, CUDA_SIZE);
}
