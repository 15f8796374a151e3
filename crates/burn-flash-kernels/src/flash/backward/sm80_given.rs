//! The backward of `softmax(X)·V` on Ampere and later (sm_80 … sm_90), two hand-written
//! `mma.sync` GEMMs (`sm80_given.cu` next to this file, on `crate::hopper`'s `sm80.cuh`
//! wrappers), the Hopper pair's ([`super::hopper_given`]) data flow on warp-level products:
//! - `dX = P ⊙ (dO·Vᵀ − δ)`: 128 rows × 128 keys a block, `dP` over `d3` in chunks of 64
//!   columns (double-buffered `cp.async`), the softmax's gradient as its epilogue from an `X`
//!   tile copied with the last chunk ([`launch`]; `δ` from [`super::launch_delta`]);
//! - `dV = Pᵀ·dO`: 128 keys × 128 columns a block over the rows of every batch that feeds it,
//!   `Pᵀ = e^(Xᵀ − lse)` built in registers from `ldmatrix.trans` fragments ([`launch_dv`]).
//!
//! Any `d3` (the `#[cube]` `mma` backward keeps its `dV` columns in registers; these kernels
//! tile them), f16 and bf16, every tensor through its strides. [`unavailable`] names what
//! they do not take. Planned ([`SmmBackwardPath::Ampere`](crate::softmax_matmul::SmmBackwardPath))
//! under [`AmpereUse::Always`] only, until a GPU run verifies them.

use crate::attention::AmpereUse;
#[cfg(feature = "cuda")]
use crate::hopper::CudaCompiled;
#[cfg(feature = "cuda")]
use crate::hopper::task::HandWritten;
#[cfg(feature = "cuda")]
use crate::hopper::{Defines, words};
#[cfg(feature = "cuda")]
use crate::tensor::TensorRef;
#[cfg(feature = "cuda")]
use cubecl::prelude::*;

/// Rows and keys of `dX` a block of the `dX` kernel; keys and columns of `dV` a block of the
/// `dV` kernel.
pub const BLOCK: usize = 128;
/// Threads per block (8 warps).
pub const UNITS: u32 = 256;

/// 256 threads at up to 255 registers, one block per SM (NVRTC 13.5: `dX` 204 registers,
/// `dV` 178 on sm_80, no spill; at two blocks a SM both spill). Held by `cargo xtask
/// cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(1);

/// Dynamic shared memory of the `dX` kernel (`DX_SMEM`): two slots of a 64-column chunk of `dO`
/// and of `V` (128 rows each), the `X` tile (128 × 128) and the rows' `lse₂` and `δ`.
pub const DX_SHARED: usize = 2 * 2 * 128 * 128 + 128 * 256 + 2 * 128 * 4;
/// Dynamic shared memory of the `dV` kernel (`DV_SMEM`): two slots of an `X` tile (64 rows ×
/// 128 keys), a `dO` tile (64 rows × 128 columns) and the rows' `lse₂`.
pub const DV_SHARED: usize = 2 * (2 * 64 * 256 + 64 * 4);

/// Words of the kernels' parameter struct (`SmgParams`, which the source asserts).
#[cfg(feature = "cuda")]
const PARAM_WORDS: usize = 12;

#[cfg(feature = "cuda")]
const DX_ENTRY: &str = "burn_flash_sm80_smm_dx";
#[cfg(feature = "cuda")]
const DV_ENTRY: &str = "burn_flash_sm80_smm_dv";

/// The CUDA source of both kernels: the instruction wrappers, the score helpers, the kernels.
#[cfg(feature = "cuda")]
pub const SOURCE: &str = concat!(
    include_str!("../../hopper/sm80.cuh"),
    include_str!("../scores.cuh"),
    include_str!("sm80_given.cu")
);

#[cfg(feature = "cuda")]
const SOURCE_HASH: u64 = crate::hopper::source_hash(SOURCE);

/// Why the Ampere kernels do not run a backward of `dims` in `dtype` under `ampere`, with
/// `matrix_units` what the `mma` check found, `cuda` whether the client is CUDA, `rows16`
/// whether every tensor has 16-byte rows and starts with unit strides along its rows
/// (`row_vector` 8 elements), and `max_shared` the device's shared memory a block (`None`:
/// they run it). Only [`AmpereUse::Always`] takes them until a GPU run verifies them.
#[allow(clippy::too_many_arguments)]
pub fn unavailable(
    ampere: AmpereUse,
    cuda: bool,
    matrix_units: bool,
    sixteen_bit: bool,
    rows16: bool,
    dims: crate::softmax_matmul::SmmDims,
    max_shared: usize,
) -> Option<&'static str> {
    let crate::softmax_matmul::SmmDims { batch, d1, d2, d3 } = dims;
    if ampere != AmpereUse::Always {
        Some(
            "the Ampere softmax·V backward is opt-in (AmpereUse::Always) until a GPU run verifies it",
        )
    } else if !cuda {
        Some("the Ampere softmax·V backward is hand-written CUDA")
    } else if !matrix_units {
        Some("the Ampere softmax·V backward runs on the matrix units (mma.sync, sm_80 and later)")
    } else if !sixteen_bit {
        Some("the Ampere softmax·V backward takes f16 and bf16")
    } else if !rows16 {
        Some(
            "the Ampere softmax·V backward copies rows by 16 bytes: unit stride along the rows, row lengths and strides multiples of 16 bytes, buffers starting on 16 bytes",
        )
    } else if batch == 0 || d1 == 0 || d2 == 0 || d3 == 0 {
        Some("the Ampere softmax·V backward takes non-empty tensors")
    } else if batch > 65_535 || d1.div_ceil(BLOCK) > 65_535 || d2.div_ceil(BLOCK) > 65_535 {
        Some("the Ampere softmax·V backward launches at most 65535 blocks along y and z")
    } else if d1 > i32::MAX as usize / 2 || d2 > i32::MAX as usize / 2 || d3 > i32::MAX as usize / 2
    {
        Some("the Ampere softmax·V backward indexes positions with 32-bit integers")
    } else if DX_SHARED.max(DV_SHARED) > max_shared {
        Some("the Ampere softmax·V backward needs 97 KiB of shared memory a block")
    } else {
        None
    }
}

/// The `dX` grid for `d1` rows and `d2` keys of `batch` batches: key blocks, row blocks,
/// batches.
pub fn dx_cubes(batch: usize, d1: usize, d2: usize) -> (usize, usize, usize) {
    (d2.div_ceil(BLOCK), d1.div_ceil(BLOCK), batch)
}

/// The `dV` grid for `dv_batch` batches of `dV` (1 for a shared `V`), `d2` keys and `d3`
/// columns: column tiles, key blocks, batches.
pub fn dv_cubes(dv_batch: usize, d2: usize, d3: usize) -> (usize, usize, usize) {
    (d3.div_ceil(BLOCK), d2.div_ceil(BLOCK), dv_batch)
}

/// The parameter words (`SmgParams`): batch and row strides of `x`, `v`, `d_out`, the gradient
/// written and `lse` (a tensor with one batch for all gets batch stride 0), then the sizes.
#[cfg(feature = "cuda")]
fn params(
    [x, v, d_out, grad, lse]: [&TensorRef<'_>; 5],
    (d1, d2, d3): (usize, usize, usize),
    batches: usize,
) -> Vec<u64> {
    let strides = |t: &TensorRef<'_>| {
        let batch_stride = if t.shape[0] == 1 { 0 } else { t.strides[0] };
        [batch_stride as u64, t.strides[1] as u64]
    };
    let mut out = Vec::with_capacity(PARAM_WORDS);
    for t in [x, v, d_out, grad, lse] {
        out.extend(strides(t));
    }
    out.push(words(d1 as u32, d2 as u32));
    out.push(words(d3 as u32, batches as u32));
    debug_assert_eq!(out.len(), PARAM_WORDS);
    out
}

/// The kernel `entry` for `dtype`, with the mutation switch's edits.
#[cfg(feature = "cuda")]
fn kernel<R: CudaCompiled>(
    client: &ComputeClient<R>,
    entry: &'static str,
    shared: usize,
    dtype: StorageType,
) -> HandWritten<R> {
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let (source, hash) = crate::hopper::mutated(
        SOURCE,
        SOURCE_HASH,
        &[
            (
                crate::mutation::zero_dx(),
                "const float g0 = p0 * (acc[mt][nt][2 * h] - dl);",
                "const float g0 = 0.0f * (acc[mt][nt][2 * h] - dl);",
            ),
            (
                crate::mutation::drop_delta(),
                "s_delta[tid - 128u] = row < d1 ? delta[(u64)batch * d1 + (u64)row] : 0.0f;",
                "s_delta[tid - 128u] = 0.0f;",
            ),
            (
                crate::mutation::warp_cols(),
                "const u32 key0 = 32u * wk, col0 = 64u * wc;",
                "const u32 key0 = 32u * wk, col0 = 0u * wc;",
            ),
        ],
    );
    HandWritten::new_hashed(
        client,
        source,
        hash,
        entry,
        CubeDim::new_1d(UNITS),
        shared,
        u64::from(bf16),
    )
    .with_defines(&Defines::empty().word("ELEM_BF16", bf16))
}

/// Launches `dx` (`[batch, d1, d2]`) of `softmax(x)·v` on `client` from `x` (`[batch or 1, d1,
/// d2]`), `v` (`[batch or 1, d2, d3]`), the output gradient `d_out` (`[batch, d1, d3]`), the
/// forward's `lse` (`[batch, d1]`, f32) and `delta` (one f32 per row, `batch · d1 + row`). The
/// caller checked [`unavailable`] against the call.
///
/// # Safety
/// The shapes and strides describe the buffers; `delta` holds `batch · d1` floats.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch<R: CudaCompiled>(
    client: &ComputeClient<R>,
    x: &TensorRef<'_>,
    v: &TensorRef<'_>,
    d_out: &TensorRef<'_>,
    lse: &TensorRef<'_>,
    delta: &cubecl::server::Handle,
    dx: &TensorRef<'_>,
    dtype: StorageType,
) {
    let (batch, d1, d2, d3) = (dx.shape[0], dx.shape[1], dx.shape[2], v.shape[2]);
    let (cx, cy, cz) = dx_cubes(batch, d1, d2);
    let kernel = kernel(client, DX_ENTRY, DX_SHARED, dtype);
    let params = params([x, v, d_out, dx, lse], (d1, d2, d3), 1);
    // SAFETY: block (n, m, b) copies rows 128m .. 128m + 127 below `d1` of `d_out[b]` and
    // `x[b]` (columns below `d3` and `d2`) and keys 128n .. 128n + 127 below `d2` of `v[b]`,
    // reads `lse` and `delta` of its rows below `d1`, and writes the pairs of `dx[b]` of those
    // rows and keys (`d2` even: 16-byte rows), all through the strides given.
    unsafe {
        kernel.launch(
            CubeCount::Static(cx as u32, cy as u32, cz as u32),
            vec![
                x.handle.clone().binding(),
                v.handle.clone().binding(),
                d_out.handle.clone().binding(),
                lse.handle.clone().binding(),
                delta.clone().binding(),
                dx.handle.clone().binding(),
            ],
            params,
        );
    }
}

/// Launches `dv` (`[batch or 1, d2, d3]`; one batch sums every batch's) of `softmax(x)·v` on
/// `client` from `x` (`[batch or 1, d1, d2]`), the output gradient `d_out` (`[batch, d1, d3]`)
/// and the forward's `lse` (`[batch, d1]`, f32). The caller checked [`unavailable`] against the
/// call.
///
/// # Safety
/// The shapes and strides describe the buffers.
#[cfg(feature = "cuda")]
pub unsafe fn launch_dv<R: CudaCompiled>(
    client: &ComputeClient<R>,
    x: &TensorRef<'_>,
    d_out: &TensorRef<'_>,
    lse: &TensorRef<'_>,
    dv: &TensorRef<'_>,
    dtype: StorageType,
) {
    let (batch, d1, d3) = (d_out.shape[0], d_out.shape[1], d_out.shape[2]);
    let (dv_batch, d2) = (dv.shape[0], dv.shape[1]);
    let batches = if dv_batch == 1 { batch } else { 1 };
    let (cx, cy, cz) = dv_cubes(dv_batch, d2, d3);
    let kernel = kernel(client, DV_ENTRY, DV_SHARED, dtype);
    // `v` is not read: `dv` stands in for its strides' slot.
    let params = params([x, dv, d_out, dv, lse], (d1, d2, d3), batches);
    // SAFETY: block (t, n, b) copies rows below `d1` of `x` and `d_out` of the batches it sums
    // (keys below `d2`, columns below `d3`), reads `lse` of those rows, and writes the pairs of
    // `dv[b]` of keys 128n .. 128n + 127 below `d2` and columns 128t .. 128t + 127 below `d3`
    // (an even count), through the strides given.
    unsafe {
        kernel.launch(
            CubeCount::Static(cx as u32, cy as u32, cz as u32),
            vec![
                x.handle.clone().binding(),
                d_out.handle.clone().binding(),
                lse.handle.clone().binding(),
                dv.handle.clone().binding(),
            ],
            params,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::softmax_matmul::SmmDims;

    /// Each limit is named, in order; a call inside every limit runs only under `Always`.
    #[test]
    fn unavailable_names_each_limit() {
        let dims = SmmDims {
            batch: 2,
            d1: 300,
            d2: 264,
            d3: 520,
        };
        let shared = 227 * 1024;
        let check = unavailable;
        assert_eq!(
            check(AmpereUse::Always, true, true, true, true, dims, shared),
            None
        );
        let cases = [
            (
                check(AmpereUse::Faster, true, true, true, true, dims, shared),
                "opt-in",
            ),
            (
                check(AmpereUse::Off, true, true, true, true, dims, shared),
                "opt-in",
            ),
            (
                check(AmpereUse::Always, false, true, true, true, dims, shared),
                "hand-written CUDA",
            ),
            (
                check(AmpereUse::Always, true, false, true, true, dims, shared),
                "matrix units",
            ),
            (
                check(AmpereUse::Always, true, true, false, true, dims, shared),
                "f16 and bf16",
            ),
            (
                check(AmpereUse::Always, true, true, true, false, dims, shared),
                "16 bytes",
            ),
            (
                check(
                    AmpereUse::Always,
                    true,
                    true,
                    true,
                    true,
                    SmmDims { d2: 0, ..dims },
                    shared,
                ),
                "non-empty",
            ),
            (
                check(
                    AmpereUse::Always,
                    true,
                    true,
                    true,
                    true,
                    SmmDims {
                        batch: 65_536,
                        ..dims
                    },
                    shared,
                ),
                "65535",
            ),
            (
                check(AmpereUse::Always, true, true, true, true, dims, 64 * 1024),
                "shared memory",
            ),
        ];
        for (reason, part) in cases {
            let reason = reason.expect("refused");
            assert!(reason.contains(part), "{reason:?} should name {part:?}");
        }
        // The grids cover every row, key and column.
        assert_eq!(dx_cubes(2, 300, 264), (3, 3, 2));
        assert_eq!(dv_cubes(1, 264, 520), (5, 3, 1));
        assert_eq!(DX_SHARED, 99_328);
        assert_eq!(DV_SHARED, 66_048);
    }
}
