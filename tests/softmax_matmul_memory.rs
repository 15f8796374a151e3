//! Peak device memory of `softmax(X)·V`'s forward, in its own test binary (its own process):
//! the measurement ([`common::peak_memory`]) puts the process's memory pools in cubecl's
//! persistent mode before any device starts, which no other test binary should share.

mod common;

use burn::tensor::{DType, Distribution, FloatDType, Tensor, activation};
use burn_flash::{FlashBackend, softmax_matmul};
use common::memory_check::{check_backend, check_peak};
use common::peak_memory::use_exact_pool;

/// Memory allowed beyond inputs + outputs: room for small buffers (launch metadata) and
/// alignment padding, far below one `d1 × d2` matrix of the sizes below.
const SLACK: u64 = 64 << 10;

/// `(batch, d1, d2, d3)` of one check.
type Dims = (usize, usize, usize, usize);

/// Checks the peak device memory of the forward: inputs + output + log-sum-exp + [`SLACK`],
/// and that the inputs were all that was in use before the call. `composed = true` runs
/// Burn's `softmax(x).matmul(v)` instead, which holds the `d1 × d2` scores and must fail the
/// same check: the proof that the check can fail.
fn forward_peak<B: FlashBackend, R: cubecl::Runtime>(
    device: &B::Device,
    dtype: FloatDType,
    composed: bool,
    (b, d1, d2, d3): Dims,
) where
    R::Device: From<B::Device>,
{
    // Drawn on the device: the CUDA shape has 2^28 elements, too many to draw on the host.
    let x =
        Tensor::<B, 3>::random([b, d1, d2], Distribution::Uniform(-4.0, 4.0), device).cast(dtype);
    let v =
        Tensor::<B, 3>::random([b, d2, d3], Distribution::Uniform(-1.0, 1.0), device).cast(dtype);
    let elem = DType::from(dtype).size() as u64;
    let inputs = ((b * d1 * d2 + b * d2 * d3) as u64) * elem;
    let outputs = (b * d1 * d3) as u64 * elem + (b * d1) as u64 * 4;
    let name = if composed { "composed" } else { "fused" };
    let what = format!(
        "{name} {dtype:?} {b}x{d1}x{d2}x{d3} (inputs {} KiB + outputs {} KiB + {SLACK} B)",
        inputs >> 10,
        outputs >> 10,
    );
    let (out, mem) =
        check_peak::<B, R, _>(device, &what, composed, inputs + outputs + SLACK, || {
            if composed {
                activation::softmax(x.clone(), 2).matmul(v.clone())
            } else {
                softmax_matmul(x.clone(), v.clone())
            }
        });
    assert!(
        mem.before >= inputs && mem.before <= inputs + SLACK,
        "{name}: {} B in use before the call, inputs are {inputs} B",
        mem.before
    );
    drop((x, v, out));
}

/// Every check of one backend at `dims`, the composed self-check first; `dtypes` are the fused
/// op's.
fn check_dims<B: FlashBackend, R: cubecl::Runtime>(dims: Dims, dtypes: &[FloatDType])
where
    R::Device: From<B::Device>,
{
    let fused: Vec<_> = dtypes.iter().map(|&dtype| (dims, dtype)).collect();
    check_backend::<B, _>(dims, &fused, forward_peak::<B, R>);
}

/// Small enough for a CPU (lavapipe): the composed op's f32 scores (2 MiB) are 32 × the slack.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_forward_within_inputs_plus_output() {
    use_exact_pool();
    check_dims::<burn::backend::Wgpu, cubecl::wgpu::WgpuRuntime>(
        (2, 256, 1024, 64),
        &[FloatDType::F32, FloatDType::F16],
    );
}

/// The benchmark's largest shape: the composed op's f32 scores are 1 GiB on top of 1344 MiB of
/// inputs and output.
#[cfg(feature = "cuda")]
#[test]
fn cuda_forward_within_inputs_plus_output() {
    use_exact_pool();
    check_dims::<burn::backend::Cuda, cubecl::cuda::CudaRuntime>(
        (16, 2048, 8192, 512),
        &[FloatDType::F32, FloatDType::F16, FloatDType::BF16],
    );
}
