//! The backward of `softmax(X)·V` on Hopper (sm_90a), two `wgmma` GEMMs fed by TMA (sources next
//! to this file, on the wrappers of `crate::hopper` and the helpers of `flash/scores.cuh`):
//! - `dX = P ⊙ (dO·Vᵀ − δ)` over `d3`, with the softmax's gradient as its epilogue
//!   (`hopper_dx.cu`, `launch`; `δ` from [`super::launch_delta`]);
//! - `dV = Pᵀ·dO` over the rows, with `Pᵀ = e^(Xᵀ − lse)` built in registers as its A operand
//!   (`hopper_dv.cu`, `launch_dv`; a shared `V` sums every batch in the block).
//!
//! Variants: the element type (f16, bf16). What they need (16-byte rows and starts, sm_90) is
//! checked by `crate::softmax_matmul::plan_softmax_matmul_backward_for`.

#[cfg(feature = "cuda")]
use crate::hopper::CudaCompiled;
#[cfg(feature = "cuda")]
use cubecl::prelude::*;

#[cfg(feature = "cuda")]
use crate::hopper::task::{HandWritten, tensor_map};
#[cfg(feature = "cuda")]
use crate::hopper::{Defines, words};
#[cfg(feature = "cuda")]
use crate::tensor::TensorRef;

/// Rows of `X` per block (two consumer warpgroups of 64).
pub const BLOCK_ROWS: usize = 128;
/// Columns of `X` (keys) per block.
pub const BLOCK_KEYS: usize = 256;
/// Slots of the `dO`/`V` chunk ring.
pub const STAGES: usize = 3;
/// Threads per block: one producer and two consumer warpgroups.
pub const UNITS: u32 = 384;

/// Warp-specialised `dX` and `dV` kernels (384 threads, `setmaxnreg`): one block per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(1);

#[cfg(feature = "cuda")]
const ENTRY: &str = "burn_flash_hopper_smm_dx";

/// The CUDA source: the instruction wrappers, the score helpers, the kernel.
#[cfg(feature = "cuda")]
pub const SOURCE: &str = concat!(
    include_str!("../../hopper/sm90.cuh"),
    include_str!("../scores.cuh"),
    include_str!("hopper_dx.cu")
);

#[cfg(feature = "cuda")]
const SOURCE_HASH: u64 = crate::hopper::source_hash(SOURCE);

/// Dynamic shared memory of the `dX` kernel: the `X` tile, [`STAGES`] slots of a 64-column chunk of `dO`
/// ([`BLOCK_ROWS`] rows) and of `V` ([`BLOCK_KEYS`] rows), the barriers, and 1 KiB to align the
/// swizzle atoms.
pub fn shared_bytes() -> usize {
    let x = BLOCK_KEYS / 64 * BLOCK_ROWS * 128;
    let slot = (BLOCK_ROWS + BLOCK_KEYS) * 128;
    1024 + x + STAGES * slot + 8 * (1 + 2 * STAGES)
}

/// The grid for `d1` rows and `d2` columns of `batch` batches: key blocks, row blocks, batches.
pub fn cubes(batch: usize, d1: usize, d2: usize) -> (usize, usize, usize) {
    (d2.div_ceil(BLOCK_KEYS), d1.div_ceil(BLOCK_ROWS), batch)
}

/// Launches `dx` (`[batch, d1, d2]`) of `softmax(x)·v` on `client` from `x` (`[batch, d1,
/// d2]`), `v` (`[batch or 1, d2, d3]`), the output gradient `d_out` (`[batch, d1, d3]`), the
/// forward's `lse` (`[batch, d1]`, f32) and `delta` (one f32 per row, `batch · d1 + row`). The
/// caller checked the shapes, that no size is 0, and the layout the TMA maps and the pair
/// stores need: 16-byte rows, row strides and starts of `x`, `v`, `d_out` and `dx`, nonzero row
/// strides.
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
    use crate::flash::forward::hopper::{tma_view, view};
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let (source, hash) = crate::hopper::mutated(
        SOURCE,
        SOURCE_HASH,
        &[
            (
                crate::mutation::zero_dx(),
                "g[e] = pv * (dp[k] - delta[r]);",
                "g[e] = 0.0f;",
            ),
            (
                crate::mutation::drop_delta(),
                "dlt[r] = delta[(u64)batch * p.d1 + (u64)row[r]];",
                "dlt[r] = 0.0f;",
            ),
            (
                crate::mutation::hopper_no_wait(),
                "if (ch >= STAGES) mbar_wait(",
                "if (false) mbar_wait(",
            ),
        ],
    );
    let kernel = HandWritten::new_hashed(
        client,
        source,
        hash,
        ENTRY,
        CubeDim::new_1d(UNITS),
        shared_bytes(),
        u64::from(bf16),
    )
    .with_defines(&Defines::elem(bf16));
    let (batch, d1, d2, d3) = (x.shape[0], x.shape[1], x.shape[2], v.shape[2]);
    let (x_shape, x_strides, x_batched) = tma_view(x);
    let (v_shape, v_strides, v_batched) = tma_view(v);
    let (do_shape, do_strides, _) = tma_view(d_out);
    let x4 = view(x, &x_shape, &x_strides);
    let v4 = view(v, &v_shape, &v_strides);
    let do4 = view(d_out, &do_shape, &do_strides);
    let params = vec![
        dx.strides[0] as u64,
        dx.strides[1] as u64,
        lse.strides[0] as u64,
        lse.strides[1] as u64,
        words(d1 as u32, d2 as u32),
        words(d3.div_ceil(64) as u32, 0),
        words(u32::from(x_batched), u32::from(v_batched)),
    ];
    let (cx, cy, cz) = cubes(batch, d1, d2);
    let maps = vec![
        tensor_map(&x4, dtype, BLOCK_ROWS),
        tensor_map(&do4, dtype, BLOCK_ROWS),
        tensor_map(&v4, dtype, BLOCK_KEYS),
    ];
    // SAFETY: the loads stay inside `x`, `d_out` and `v` (TMA clips every box to the shapes
    // given; the views describe the caller's buffers); block (n, m, b) reads `lse` and `delta`
    // of rows 128m .. 128m + 127 below `d1` of batch b and writes the pairs of `dx[b]` of those
    // rows and of columns 256n .. 256n + 255 below `d2` (an even count), through the strides
    // given.
    unsafe {
        kernel.launch_with_maps(
            CubeCount::Static(cx as u32, cy as u32, cz as u32),
            maps,
            vec![
                lse.handle.clone().binding(),
                delta.clone().binding(),
                dx.handle.clone().binding(),
            ],
            params,
        );
    }
}

/// Keys of `dV` per block of the `dV` kernel (two consumer warpgroups of 64).
pub const DV_BLOCK_KEYS: usize = 128;
/// Columns of `dV` per block of the `dV` kernel.
pub const DV_BLOCK_COLS: usize = 256;
/// Rows per step of the `dV` kernel.
pub const DV_BLOCK_ROWS: usize = 64;

#[cfg(feature = "cuda")]
const DV_ENTRY: &str = "burn_flash_hopper_smm_dv";

/// The CUDA source of the `dV` kernel: the instruction wrappers, the score helpers, the kernel.
#[cfg(feature = "cuda")]
pub const DV_SOURCE: &str = concat!(
    include_str!("../../hopper/sm90.cuh"),
    include_str!("../scores.cuh"),
    include_str!("hopper_dv.cu")
);

#[cfg(feature = "cuda")]
const DV_SOURCE_HASH: u64 = crate::hopper::source_hash(DV_SOURCE);

/// Dynamic shared memory of the `dV` kernel: [`STAGES`] slots of an `X` tile
/// ([`DV_BLOCK_ROWS`] rows × [`DV_BLOCK_KEYS`]) and a `dO` tile (× [`DV_BLOCK_COLS`]), the
/// barriers, and 1 KiB to align the swizzle atoms.
pub fn dv_shared_bytes() -> usize {
    let slot = DV_BLOCK_ROWS * 2 * (DV_BLOCK_KEYS + DV_BLOCK_COLS);
    1024 + STAGES * slot + 8 * 2 * STAGES
}

/// The grid of the `dV` kernel for `dv_batch` batches of `dV` (1 for a shared `V`), `d2` keys
/// and `d3` columns: column tiles, key blocks, batches.
pub fn dv_cubes(dv_batch: usize, d2: usize, d3: usize) -> (usize, usize, usize) {
    (
        d3.div_ceil(DV_BLOCK_COLS),
        d2.div_ceil(DV_BLOCK_KEYS),
        dv_batch,
    )
}

/// Launches `dv` (`[batch or 1, d2, d3]`; one batch sums every batch's) of `softmax(x)·v` on
/// `client` from `x` (`[batch, d1, d2]`), the output gradient `d_out` (`[batch, d1, d3]`) and
/// the forward's `lse` (`[batch, d1]`, f32). The caller checked the shapes, that no size is 0,
/// and the layout the TMA maps and the pair stores need: 16-byte rows, row strides and starts
/// of `x`, `d_out` and `dv`, nonzero row strides.
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
    use crate::flash::forward::hopper::{tma_view, view};
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let (source, hash) = crate::hopper::mutated(
        DV_SOURCE,
        DV_SOURCE_HASH,
        &[(
            crate::mutation::hopper_no_wait(),
            "if (it >= STAGES) mbar_wait(",
            "if (false) mbar_wait(",
        )],
    );
    let kernel = HandWritten::new_hashed(
        client,
        source,
        hash,
        DV_ENTRY,
        CubeDim::new_1d(UNITS),
        dv_shared_bytes(),
        u64::from(bf16),
    )
    .with_defines(&Defines::elem(bf16));
    let (batch, d1, d2, d3) = (x.shape[0], x.shape[1], x.shape[2], d_out.shape[2]);
    let dv_batch = dv.shape[0];
    let (x_shape, x_strides, x_batched) = tma_view(x);
    let (do_shape, do_strides, _) = tma_view(d_out);
    let x4 = view(x, &x_shape, &x_strides);
    let do4 = view(d_out, &do_shape, &do_strides);
    let batches = if dv_batch == 1 { batch } else { 1 };
    let params = vec![
        dv.strides[0] as u64,
        dv.strides[1] as u64,
        lse.strides[0] as u64,
        lse.strides[1] as u64,
        words(d1 as u32, d2 as u32),
        words(d3 as u32, batches as u32),
        words(u32::from(x_batched), 0),
    ];
    let (cx, cy, cz) = dv_cubes(dv_batch, d2, d3);
    let maps = vec![
        tensor_map(&x4, dtype, DV_BLOCK_ROWS),
        tensor_map(&do4, dtype, DV_BLOCK_ROWS),
    ];
    // SAFETY: the loads stay inside `x` and `d_out` (TMA clips every box to the shapes given;
    // the views describe the caller's buffers); block (t, n, b) reads `lse` of rows below `d1`
    // of the batches it sums and writes the pairs of `dv[b]` of keys 128n .. 128n + 127 below
    // `d2` and columns 256t .. 256t + 255 below `d3` (an even count), through the strides given.
    unsafe {
        kernel.launch_with_maps(
            CubeCount::Static(cx as u32, cy as u32, cz as u32),
            maps,
            vec![lse.handle.clone().binding(), dv.handle.clone().binding()],
            params,
        );
    }
}
