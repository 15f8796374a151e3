//! The flash backward (FlashAttention-2's schedule, nothing of size `Sq × Sk` kept): the `δ`
//! prepass, the choice among the schedules, and their launch.
//!
//! With the forward's row log-sum-exp `lse` and `δ = rowsum(dO ⊙ O)` ([`flash_delta()`]), a
//! block of scores is rebuilt exactly as the forward made it ([`crate::flash::scores`]: scale,
//! softcap, mask, causal, bias) and
//!
//! ```text
//! P  = e^(S − lse)            (0 where the key is invisible or the row has none)
//! Z  = keep / (1 − p)         (dropout, the forward's mask drawn again; 1 without)
//! dV += (P ⊙ Z)ᵀ·dO
//! dP = dO·Vᵀ
//! dS = P ⊙ (dP ⊙ Z − δ)       (the gradient of the final score: dBias)
//! dR = dS ⊙ (1 − (s_c / c)²)  (through the softcap, s_c the capped score)
//! dQ += scale·dR·K,  dK += scale·dRᵀ·Q
//! ```
//!
//! Given scores (`softmax(X)·V`): `dX` is the core's `dS` and `dV` its `dV`; no `dQ`, `dK`.
//! Two kernels per `#[cube]` schedule, each owning its output, so that nothing is accumulated
//! across cubes (`dQ` by atomics from the dK/dV kernel, FlashAttention-2's one-kernel schedule,
//! measured slower there: RESULTS.md): a dK/dV kernel (one cube per block of keys, looping over the query rows of the
//! group) and a dQ kernel (one cube per block of query rows, looping over the keys they see).
//! - [`units`]: plain units, every runtime and float type, f32 arithmetic;
//! - [`units_given`]: plain units, the given-score products register-tiled;
//! - [`mma`] ([`mma_dq`], [`mma_dkv`]): the matrix units (f16/bf16, CUDA sm_80+);
//! - [`cmma`]: cooperative matrices (f16/bf16 wherever cubecl's `cmma` runs: Vulkan, Metal,
//!   CUDA's `wmma`);
//! - [`hopper`]: Hopper's `wgmma` and TMA (f16/bf16, sm_90), hand-written CUDA launched
//!   through cubecl's client; one kernel per key block with `dQ` accumulated by reductions.
//! - [`sm80`]: FlashAttention-2's data flow on `mma.sync` (f16/bf16, CUDA sm_80+), hand-written
//!   CUDA through the same door; one kernel per key block, `dQ` by reductions.

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod cmma;
pub mod hopper;
pub mod hopper_given;
pub mod mma;
pub mod mma_dkv;
pub mod mma_dq;
pub mod sm80;
pub mod sm80_given;
pub mod units;
pub mod units_given;

use cubecl::prelude::*;

use crate::flash::args::{BackwardLaunch, BackwardOperands, Operand, Scalars};
use crate::flash::block::{GROUP_ROWS, cube_count, row_groups_grid, row_of_group};
use crate::flash::config::{BackwardKernel, FlashConfig};
use crate::fragment::{MMA_M, PLANE};

/// The row prepass `δ = rowsum(dO ⊙ O)` streams: four cubes per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const DELTA_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(4);

/// `δ[b, h, i] = Σ_c dO[b, h, i, c] · O[b, h, i, c]` (f32) for every query row: 32 units per
/// row, [`GROUP_ROWS`] rows per cube; `delta` is contiguous `[B, Hq, Sq]`. Grid: row groups
/// along x then y.
#[cube(launch_unchecked)]
pub fn flash_delta<F: Float>(
    d_out: &Tensor<F>,
    out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let heads = out.shape(1);
    let seq_q = out.shape(2);
    let dv = out.shape(3);
    let rows = out.shape(0) * heads * seq_q;
    let lane = (UNIT_POS % 32) as usize;
    let group = UNIT_POS / 32;
    let r = row_of_group();
    let mut partial = 0.0f32;
    if r < rows {
        let (b, h, p) = (r / (heads * seq_q), (r / seq_q) % heads, r % seq_q);
        let g_base = b * d_out.stride(0) + h * d_out.stride(1) + p * d_out.stride(2);
        let o_base = b * out.stride(0) + h * out.stride(1) + p * out.stride(2);
        for s in 0..dv.div_ceil(32) {
            let col = s * 32 + lane;
            if col < dv {
                partial += f32::cast_from(d_out[g_base + col * d_out.stride(3)])
                    * f32::cast_from(out[o_base + col * out.stride(3)]);
            }
        }
    }
    let mut part_s = SharedMemory::<f32>::new(comptime!((32 * GROUP_ROWS) as usize));
    part_s[UNIT_POS as usize] = partial;
    sync_cube();
    if lane == 0 && r < rows {
        let mut sum = 0.0f32;
        for q in 0..32u32 {
            sum += part_s[(group * 32 + q) as usize];
        }
        if comptime!(crate::mutation::drop_delta()) {
            sum = 0.0f32;
        }
        delta[r] = sum;
    }
}

/// `δ = rowsum(dO ⊙ O)` of the `rows` query rows of `out` and `d_out` (4-D, `[B, H, Sq, Dv]`)
/// into a new contiguous f32 buffer of `rows` elements (row `(b·H + h)·Sq + i`), returned.
///
/// # Safety
/// The operands' shapes and strides describe their buffers.
pub unsafe fn launch_delta<R: Runtime>(
    client: &ComputeClient<R>,
    out: &Operand,
    d_out: &Operand,
    rows: usize,
    dtype: StorageType,
) -> Operand {
    let delta = Operand {
        handle: client.empty(rows.max(1) * 4),
        shape: vec![rows.max(1)],
        strides: vec![1],
    };
    let (x, y, _) = row_groups_grid(rows);
    if rows > 0 {
        // SAFETY: the caller's; every index is bounds-checked against `out`'s shape.
        unsafe {
            flash_delta::launch_unchecked::<R>(
                client,
                cubecl::CubeCount::Static(x as u32, y as u32, 1),
                cubecl::CubeDim::new_1d(32 * GROUP_ROWS),
                d_out.arg(),
                out.arg(),
                delta.arg(),
                dtype,
            );
        }
    }
    delta
}

/// What a backward launch runs beyond its kernels' configuration: the schedule a plan
/// picked, with what that schedule alone takes.
#[derive(Debug, Clone, Copy)]
pub enum Schedule<'a> {
    /// [`units::launch()`]; `write_ds`: `dS` (or `dX`) is written.
    Units {
        /// `dS` (given scores: `dX`) is written.
        write_ds: bool,
    },
    /// [`units_given::launch()`] (given scores only).
    UnitsGiven {
        /// The vector width (1, 2 or 4) dividing every row and stride.
        vector: usize,
    },
    /// [`cmma::launch()`].
    CooperativeMatrix {
        /// `dS` (given scores: `dX`) is written.
        write_ds: bool,
        /// The vector width dividing every row and stride of `q`, `k`, `v` and `dO`
        /// ([`crate::flash::forward::cmma::vector`]).
        vector: usize,
    },
    /// `launch_mma()`.
    MatrixUnits {
        /// `dS` (given scores: `dX`) is written.
        write_ds: bool,
        /// Where the dX kernel stores `P` for the dK/dV kernel (given scores, small `d2`).
        p_buffer: Option<&'a Operand>,
    },
}

impl Schedule<'_> {
    /// The kernels of the schedule.
    pub fn kernel(&self) -> BackwardKernel {
        match self {
            Self::Units { .. } => BackwardKernel::Units,
            Self::UnitsGiven { .. } => BackwardKernel::UnitsGiven,
            Self::MatrixUnits { .. } => BackwardKernel::MatrixUnits,
            Self::CooperativeMatrix { .. } => BackwardKernel::CooperativeMatrix,
        }
    }
}

/// Runs the backward from `δ` ([`launch_delta`] of `t`: one f32 per query row, `B·Hq·Sq`):
/// the schedule's dK/dV kernel on `dkv_cubes` and its dQ kernel on `dq_cubes` (none: not
/// launched), both with configuration `c` (the dQ kernel's; the tiled given-score products
/// take none).
///
/// # Safety
/// As the schedule's launcher: [`units::launch()`], [`units_given::launch()`],
/// [`cmma::launch()`], `launch_mma()`; `delta` is [`launch_delta`] of `t`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_backward<R: Runtime>(
    client: &ComputeClient<R>,
    schedule: Schedule<'_>,
    t: &BackwardOperands,
    delta: &Operand,
    dkv_cubes: Option<(usize, usize, usize)>,
    dq_cubes: Option<(usize, usize, usize)>,
    scalars: Scalars,
    c: FlashConfig,
    dtype: StorageType,
) {
    // SAFETY (every launch): the caller's.
    unsafe {
        let l = BackwardLaunch {
            client,
            t,
            delta,
            dkv_cubes,
            dq_cubes,
            dtype,
        };
        match schedule {
            Schedule::Units { write_ds } => units::launch(&l, scalars, c, write_ds),
            Schedule::UnitsGiven { vector } => units_given::launch(&l, vector),
            Schedule::CooperativeMatrix { write_ds, vector } => {
                cmma::launch(&l, scalars, c, write_ds, vector)
            }
            Schedule::MatrixUnits { write_ds, p_buffer } => {
                launch_mma(&l, scalars, c, write_ds, p_buffer)
            }
        }
    }
}

/// Runs [`flash_backward_dkv_mma()`] and [`flash_backward_dq_mma()`] on the launch's grids.
/// `c` is the dQ kernel's configuration: `c.block_q` rows per cube ([`mma::DQ_ROWS`], or
/// [`mma::WIDE_DX_ROWS`] for given scores where [`mma::dq_shared_bytes()`] fits); the dK/dV
/// kernel's is [`mma::dkv_config()`].
/// Given scores (`softmax_matmul`): `t.q` is `X`, `t.ds` its gradient, `write_ds` true. With
/// `p_buffer`, the dX kernel stores `P` there (laid out as `dX`) and the dK/dV kernel stages it
/// instead of rebuilding it from `X`.
///
/// [`flash_backward_dkv_mma()`]: mma_dkv::flash_backward_dkv_mma
/// [`flash_backward_dq_mma()`]: mma_dq::flash_backward_dq_mma
///
/// # Safety
/// The operands' shapes and strides describe their buffers; the rows of `q`, `k`, `v` and
/// `d_out` are 16-byte aligned (the kernels' vector); the grids are the kernels' (key blocks,
/// times `Dv`'s column tiles of `c.value_dim` for given scores; row blocks of `c.block_q`;
/// pairs folded by [`crate::flash::block::fold_pairs`]).
unsafe fn launch_mma<R: Runtime>(
    l: &BackwardLaunch<'_, R>,
    scalars: Scalars,
    c: FlashConfig,
    write_ds: bool,
    p_buffer: Option<&Operand>,
) {
    let (client, t, delta, dtype) = (l.client, l.t, l.delta, l.dtype);
    use crate::flash::forward::mma::NV8;
    use mma::{PLANES, dkv_config};
    use mma_dkv::flash_backward_dkv_mma;
    use mma_dq::flash_backward_dq_mma;
    // Given scores store `dX` as 16-byte vectors where its rows allow (`dS` of attention, for
    // a tracked bias, an element at a time).
    let ds_vector = if c.given() && write_ds && t.ds.rows_of_vectors(NV8) {
        NV8
    } else {
        1
    };
    let launch_dkv = || {
        let Some(cubes) = l.dkv_cubes else { return };
        // SAFETY: the caller's.
        unsafe {
            flash_backward_dkv_mma::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                cubecl::CubeDim::new_1d(PLANES * PLANE),
                NV8,
                t.score_inputs(p_buffer.unwrap_or(&t.q)),
                t.grad_inputs(delta),
                t.dk.arg(),
                t.dv.arg(),
                scalars.arg(),
                dkv_config(c),
                p_buffer.is_some(),
                dtype,
            );
        }
    };
    let launch_dq = || {
        let Some(cubes) = l.dq_cubes else { return };
        // SAFETY: the caller's.
        unsafe {
            flash_backward_dq_mma::launch_unchecked::<R>(
                client,
                cube_count(cubes),
                cubecl::CubeDim::new_1d(c.block_q / MMA_M * PLANE),
                NV8,
                ds_vector,
                t.score_inputs(&t.q),
                t.grad_inputs(delta),
                t.dq.arg(),
                t.ds.arg(),
                p_buffer.map_or(t.ds.arg(), |p| p.arg()),
                scalars.arg(),
                c,
                write_ds,
                ds_vector == NV8,
                p_buffer.is_some(),
                dtype,
            );
        }
    };
    // The P-buffer plan: the dX kernel writes `P`, which the dK/dV kernel then reads.
    if p_buffer.is_some() {
        launch_dq();
        launch_dkv();
    } else {
        launch_dkv();
        launch_dq();
    }
}
