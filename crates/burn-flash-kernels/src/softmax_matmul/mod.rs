//! `softmax(X)·V` without ever writing the softmax matrix: forward (online softmax, plus the
//! row log-sum-exp the backward needs) and backward (`dX`, `dV` from the saved log-sum-exp).
//!
//! Tensors are 3-D, `[batch, rows, cols]`: `x` is `[batch, d1, d2]`, `v` is `[batch, d2, d3]`
//! or `[1, d2, d3]` (one `V` shared by every batch), the output `[batch, d1, d3]` and the
//! log-sum-exp `[batch, d1]` in f32. Any strides.
//!
//! [`plan_softmax_matmul`] picks one forward kernel ([`SmmForwardKernel`]) once; the launch
//! matches on it once. The forward is the flash loop of [`crate::flash`] with **given scores**
//! ([`ScoreSource::Given`]) — the loop attention runs with scores computed as `Q·Kᵀ` — on two
//! inner-product paths ([`SmmPath`]):
//! - matrix units (`mma` m16n8k16, f32 accumulators), f16/bf16 on CUDA with 16-byte aligned
//!   rows: [`flash::mma`];
//! - plain units, every runtime and float type, f32 arithmetic: [`flash::tiled`]
//!   (register-tiled, 128 × 128 outputs per cube) where 256 units and its shared memory fit
//!   and the output is at least 65 × 65, else [`flash::units`].
//!
//! The backward is the flash backward core with given scores — the kernels attention's
//! backward runs with scores computed as `Q·Kᵀ` — on the same two paths
//! ([`SmmBackwardPath`]): `dX` is the core's `dS`, `dV` its `dV`.
//!
//! f32 never runs on the matrix units: their f32 mode rounds the operands to TF32 (10-bit
//! mantissa), and a TF32 kernel measured slower than the register-tiled f32 one at every `d2`
//! on an H200 (10.43 against 8.12 ms at `d2 = 8192`), so it was removed.

use core::fmt;

use cubecl::{CubeCount, CubeDim, prelude::*};

use crate::flash::{self, FlashConfig, ScoreSource};
use crate::fragment;
use crate::softmax::TensorRef;

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod wide;

/// Block sizes a caller may force, for `block_1` (rows of `X` per cube) and `block_2` (columns
/// of `X` per online-softmax step).
pub const BLOCK_SIZES: [usize; 3] = [16, 32, 64];

/// Which inner-product path runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmmPath {
    /// Plain units, f32 arithmetic: every runtime, every float type.
    Units,
    /// Matrix units (`mma`, f32 accumulation): f16/bf16 where the device has them (CUDA).
    MatrixUnits,
}

/// The forward kernel of a launch, chosen once by [`plan_softmax_matmul`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmmForwardKernel {
    /// [`flash::units::flash_forward_units()`] with given scores: plain units, `block_1 ×
    /// block_2` steps, 64 or 128 output columns per cube. Forced block sizes, outputs with at
    /// most 64 rows or columns, runtimes without the tiled kernel's 256 units or shared memory,
    /// and 16-bit rows the matrix units cannot take.
    Units,
    /// [`flash::tiled::flash_forward_tiled()`] with given scores: plain units, register-tiled
    /// 128 × 128 outputs, 16 columns of `X` per step.
    Tiled,
    /// [`flash::mma::flash_forward_mma()`] with given scores: f16/bf16 on the matrix units, `X`
    /// straight to registers, `V` by `cp.async` into two buffers (CUDA sm_80+, 16-byte aligned
    /// rows, `block_2` a multiple of 32).
    MatrixUnits,
    /// [`wide::softmax_matmul_wide()`]: f16/bf16 on the matrix units with one cube per 64 rows
    /// and all of `d3` (up to [`wide::MAX_COLUMNS`]), each `P` block computed once and shared
    /// through shared memory, where [`SmmForwardKernel::MatrixUnits`] recomputes `P` for each
    /// column tile of 128. Only when asked for ([`SoftmaxMatmulOptions::wide`]).
    Wide,
    /// The P-buffer plan on the matrix units: a softmax kernel on a register tier writes
    /// `P = softmax(X)` (the dtype, a `d1 × d2` buffer per batch) and the row log-sum-exp, then
    /// [`flash::mma::flash_forward_mma()`] with [`ScoreSource::Probabilities`] computes `P·V`
    /// with no `exp`: each element's exponential is taken once instead of once per output
    /// column tile, for one more write and read of `P`. Only when asked for
    /// ([`SoftmaxMatmulOptions::p_buffer`]): on an H200 it measured 10–25 % slower than the
    /// fused loop at every `d2` from 64 to 2048 (`NOTES.md`, session 19), because `P·V` in
    /// that loop's tiles is bound by L1 traffic, not by the `exp`s.
    PBuffer,
}

impl SmmForwardKernel {
    /// The inner-product path the kernel runs on.
    pub fn path(self) -> SmmPath {
        match self {
            Self::Units | Self::Tiled => SmmPath::Units,
            Self::MatrixUnits | Self::Wide | Self::PBuffer => SmmPath::MatrixUnits,
        }
    }

    /// The flash kernel that runs this one (`None`: [`SmmForwardKernel::Wide`], which is not a
    /// flash kernel shared with attention).
    fn flash(self) -> Option<flash::FlashKernel> {
        match self {
            Self::Units => Some(flash::FlashKernel::Units),
            Self::Tiled => Some(flash::FlashKernel::Tiled),
            Self::MatrixUnits | Self::PBuffer => Some(flash::FlashKernel::MatrixUnits),
            Self::Wide => None,
        }
    }
}

/// Overrides of the host heuristic. The default is what users want.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SoftmaxMatmulOptions {
    /// Force `(block_1, block_2)`, each one of [`BLOCK_SIZES`]; an impossible choice is an
    /// error, never a silent fallback.
    pub blocks: Option<(usize, usize)>,
    /// Force an inner-product path (the default picks matrix units where they exist).
    pub path: Option<SmmPath>,
    /// Run [`SmmForwardKernel::Wide`] (`Some(true)`: an error where it cannot run). The default
    /// (`None`, like `Some(false)`) does not: on an H100 it measured 3–8 % slower than the
    /// column-tiled matrix-unit loop at every point of the seed protocol (NOTES.md, session 16).
    pub wide: Option<bool>,
    /// Run [`SmmForwardKernel::PBuffer`] (`Some(true)`: an error where it cannot run). The
    /// default (`None`, like `Some(false)`) does not: it measured slower than the fused loop at
    /// every `d2` of the seed protocol (`NOTES.md`, session 19).
    pub p_buffer: Option<bool>,
}

/// Why a `softmax(X)·V` launch was refused. Nothing is launched when one is returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SoftmaxMatmulError {
    /// A tensor's shape does not fit the others.
    ShapeMismatch {
        /// Which argument.
        arg: &'static str,
        /// The shape it should have.
        expected: Vec<usize>,
        /// Its shape.
        got: Vec<usize>,
    },
    /// The element type is not f32, f16 or bf16, or the device cannot run it.
    UnsupportedDType {
        /// The element type, as cubecl names it.
        dtype: String,
    },
    /// A forced block size cannot run.
    InvalidBlocks {
        /// `(block_1, block_2)` as asked.
        blocks: (usize, usize),
        /// Why not.
        reason: String,
    },
    /// The forced path is not available for this dtype on this device.
    PathUnavailable {
        /// The forced path.
        path: SmmPath,
        /// Why not.
        reason: String,
    },
    /// [`SmmForwardKernel::Wide`] was forced and cannot run.
    WideUnavailable {
        /// Why not.
        reason: String,
    },
    /// [`SmmForwardKernel::PBuffer`] was forced and cannot run.
    PBufferUnavailable {
        /// Why not.
        reason: String,
    },
    /// More cubes along one grid axis than the device can launch.
    TooLarge {
        /// Cubes along each axis the launch would need.
        cubes: (usize, usize, usize),
    },
}

impl fmt::Display for SoftmaxMatmulError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ShapeMismatch { arg, expected, got } => {
                write!(f, "`{arg}` has shape {got:?}, expected {expected:?}")
            }
            Self::UnsupportedDType { dtype } => write!(
                f,
                "dtype {dtype} is not supported (f32, f16 and bf16 are, where the device has them)"
            ),
            Self::InvalidBlocks { blocks, reason } => {
                write!(f, "block sizes {blocks:?} cannot run: {reason}")
            }
            Self::PathUnavailable { path, reason } => {
                write!(f, "path {path:?} is not available: {reason}")
            }
            Self::WideUnavailable { reason } => {
                write!(f, "the wide matrix-unit kernel cannot run: {reason}")
            }
            Self::PBufferUnavailable { reason } => {
                write!(f, "the P-buffer plan cannot run: {reason}")
            }
            Self::TooLarge { cubes } => write!(
                f,
                "the launch needs {cubes:?} cubes along (x, y, z), more than the device allows"
            ),
        }
    }
}

impl core::error::Error for SoftmaxMatmulError {}

/// Problem sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmmDims {
    /// Batch (product of the leading dimensions).
    pub batch: usize,
    /// Rows of `X`.
    pub d1: usize,
    /// Columns of `X`, rows of `V` (the softmax dimension).
    pub d2: usize,
    /// Columns of `V`.
    pub d3: usize,
}

/// The forward launch [`plan_softmax_matmul`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoftmaxMatmulPlan {
    /// The kernel that runs.
    pub kernel: SmmForwardKernel,
    /// Rows of `X` per cube.
    pub block_1: usize,
    /// Columns of `X` per online-softmax step.
    pub block_2: usize,
    /// Output columns per cube.
    pub tile_3: usize,
    /// Vector width of the kernel's row loads, in elements (1: scalar loads through any
    /// strides).
    pub vector: usize,
    /// Units per cube.
    pub units: u32,
    /// Cubes: (output column tiles, row blocks, batch), the grid of the launch.
    pub cubes: (usize, usize, usize),
}

impl SoftmaxMatmulPlan {
    /// The inner-product path of the plan's kernel.
    pub fn path(&self) -> SmmPath {
        self.kernel.path()
    }
}

/// Checks that `dtype` is a float type the kernels are written for and the device supports.
pub fn check_dtype<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
) -> Result<(), SoftmaxMatmulError> {
    crate::softmax::check_dtype(client, dtype).map_err(|_| SoftmaxMatmulError::UnsupportedDType {
        dtype: format!("{dtype:?}"),
    })
}

fn check_cubes<R: Runtime>(
    client: &ComputeClient<R>,
    cubes: (usize, usize, usize),
) -> Result<CubeCount, SoftmaxMatmulError> {
    let (mx, my, mz) = client.properties().hardware.max_cube_count;
    if cubes.0 > mx as usize || cubes.1 > my as usize || cubes.2 > mz as usize {
        return Err(SoftmaxMatmulError::TooLarge { cubes });
    }
    Ok(CubeCount::Static(
        cubes.0 as u32,
        cubes.1 as u32,
        cubes.2 as u32,
    ))
}

/// The forward grid: column tiles, row blocks, batches folded over y and z
/// ([`flash::fold_grid`]).
fn fold_cubes<R: Runtime>(
    client: &ComputeClient<R>,
    tiles: usize,
    row_blocks: usize,
    batch: usize,
) -> Result<(usize, usize, usize), SoftmaxMatmulError> {
    let max = client.properties().hardware.max_cube_count;
    flash::fold_grid(tiles, row_blocks, batch, max).ok_or(SoftmaxMatmulError::TooLarge {
        cubes: (tiles.max(1), row_blocks.max(1), batch.max(1)),
    })
}

/// The widest vector, in elements (up to 16 bytes), that divides the row length and the row and
/// batch strides of every tensor, each with a unit stride along its rows; 1 otherwise.
pub fn row_vector(tensors: &[(&[usize], &[usize])], dtype: StorageType) -> usize {
    let widest = (16 / dtype.size()).max(1);
    [8, 4, 2]
        .into_iter()
        .filter(|&n| n <= widest)
        .find(|&n| {
            tensors.iter().all(|(shape, strides)| {
                strides[2] == 1
                    && shape[2].is_multiple_of(n)
                    && strides[1].is_multiple_of(n)
                    && strides[0].is_multiple_of(n)
            })
        })
        .unwrap_or(1)
}

/// [`row_vector`] of row-major contiguous `x`, `v` and output of `dims` (Burn's layout of new
/// tensors; CUDA's pitched rows are 512-byte multiples and give the same vector).
pub fn contiguous_row_vector(dims: SmmDims, dtype: StorageType) -> usize {
    let SmmDims { batch, d1, d2, d3 } = dims;
    row_vector(
        &[
            (&[batch, d1, d2], &[d1 * d2, d2, 1]),
            (&[batch, d2, d3], &[d2 * d3, d3, 1]),
            (&[batch, d1, d3], &[d1 * d3, d3, 1]),
        ],
        dtype,
    )
}

/// The forward launch for `dims`, without launching. `row_vector` is [`row_vector`] of `x`, `v`
/// and the output ([`contiguous_row_vector`] for contiguous tensors).
///
/// Heuristic (no autotuning), one kernel per call:
/// - f16/bf16 where the device has manual `mma`, `ldmatrix` and `cp.async` for the type (CUDA)
///   and the rows are 16-byte aligned: [`SmmForwardKernel::MatrixUnits`];
/// - everything else on plain units: [`SmmForwardKernel::Tiled`] where it fits (see
///   `tiled_fits`), [`SmmForwardKernel::Units`] otherwise and for forced blocks.
///
/// Blocks outside the tiled kernel: `block_1 = 64` (fewer when `d1` is short; 32 on wgpu's plain
/// units; 128 on the matrix units when the grid still has at least 4 cubes per multiprocessor),
/// `block_2 = 32`; the output tile as wide as shared memory and `d3` allow (up to 128 columns),
/// since each column tile re-reads `X`.
pub fn plan_softmax_matmul<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    row_vector: usize,
    options: SoftmaxMatmulOptions,
) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
    check_dtype(client, dtype)?;
    let props = client.properties();
    let hw = &props.hardware;
    let max_shared = hw.max_shared_memory_size;
    // The flash loop on the matrix units reads 16-byte vectors of `X` and copies `V`
    // asynchronously.
    let mma_why_not = if !fragment::supported(client, dtype) {
        Some(if dtype.size() == 4 {
            "f32 never runs on the matrix units (their f32 mode rounds to TF32)".to_string()
        } else {
            format!("this device has no manual mma and ldmatrix for {dtype:?}")
        })
    } else if !props.features.copy_async {
        Some("this device has no asynchronous copies".into())
    } else if row_vector * dtype.size() != 16 {
        Some("rows are not 16-byte aligned (d2, d3 and every stride multiples of 8)".into())
    } else if options
        .blocks
        .is_some_and(|(_, b2)| !(b2 as u32).is_multiple_of(flash::mma::CHUNK))
    {
        Some(format!(
            "block_2 must be a multiple of {} on the matrix units",
            flash::mma::CHUNK
        ))
    } else {
        None
    };
    let path = match (options.path, mma_why_not.clone()) {
        (Some(SmmPath::MatrixUnits), Some(reason)) => {
            return Err(SoftmaxMatmulError::PathUnavailable {
                path: SmmPath::MatrixUnits,
                reason,
            });
        }
        (Some(path), _) => path,
        (None, None) => SmmPath::MatrixUnits,
        (None, Some(_)) => SmmPath::Units,
    };
    if options.p_buffer == Some(true) {
        let refuse = |reason: String| Err(SoftmaxMatmulError::PBufferUnavailable { reason });
        if path != SmmPath::MatrixUnits {
            return refuse(
                mma_why_not.unwrap_or_else(|| "it runs on the matrix units only".into()),
            );
        }
        if options.wide == Some(true) {
            return refuse("the wide kernel was forced too".into());
        }
    }
    let (b1, b2) = match options.blocks {
        Some((b1, b2)) => {
            if !BLOCK_SIZES.contains(&b1) || !BLOCK_SIZES.contains(&b2) {
                return Err(SoftmaxMatmulError::InvalidBlocks {
                    blocks: (b1, b2),
                    reason: format!("each block size must be one of {BLOCK_SIZES:?}"),
                });
            }
            (b1, b2)
        }
        None => {
            // Matrix units: 128 rows per cube (4 planes of 2 row tiles share each V block)
            // where that still gives every multiprocessor a few cubes.
            let sms = hw.num_streaming_multiprocessors.unwrap_or(1) as usize;
            let wide = dims.d3.div_ceil(128) * dims.d1.div_ceil(128) * dims.batch >= 4 * sms;
            // On wgpu the plain-unit kernel runs faster with 32 rows per cube (measured on an
            // H200 through Vulkan: (32, 32) beat (64, 32) by 19–22 % at every d2 of the bench,
            // `benches/results/h200-2026-11-22-softmax_matmul-wgpu.csv`); on CUDA 64 wins.
            let wgpu = R::name(client).starts_with("wgpu");
            let b1 = if dims.d1 <= 16 {
                16
            } else if dims.d1 <= 32 || (path == SmmPath::Units && wgpu) {
                32
            } else if path == SmmPath::MatrixUnits && wide {
                128
            } else {
                64
            };
            // 32 columns per step: the matrix-unit loop keeps two steps of scores in
            // registers, and 64 would spill.
            (b1, 32)
        }
    };
    let wide = wide_config(client, dims, path, mma_why_not.as_deref(), options);
    match (options.wide, wide) {
        (Some(true), Err(reason)) => return Err(SoftmaxMatmulError::WideUnavailable { reason }),
        (Some(true), Ok(c)) => return wide_plan(client, dims, c),
        _ => {}
    }
    if path == SmmPath::Units && options.blocks.is_none() && tiled_fits(client, dims) {
        let cubes = fold_cubes(
            client,
            dims.d3.div_ceil(flash::tiled::TILE_N as usize),
            dims.d1.div_ceil(flash::tiled::BLOCK_Q as usize),
            dims.batch,
        )?;
        return Ok(SoftmaxMatmulPlan {
            kernel: SmmForwardKernel::Tiled,
            block_1: flash::tiled::BLOCK_Q as usize,
            block_2: flash::tiled::BLOCK_K as usize,
            tile_3: flash::tiled::TILE_N as usize,
            // The tiled kernel loads 4-vectors at most.
            vector: row_vector.min(4),
            units: flash::tiled::UNITS,
            cubes,
        });
    }
    let no_room = || SoftmaxMatmulError::InvalidBlocks {
        blocks: (b1, b2),
        reason: format!("needs more than the device's {max_shared} B of shared memory"),
    };
    // The output tile as wide as shared memory and d3 allow (up to 128 columns): each column
    // tile re-reads X.
    let (kernel, tiles, vector) = match path {
        SmmPath::Units => (
            SmmForwardKernel::Units,
            &[128, 64][..],
            // Scalar loads: the plain-unit loop reads through any strides.
            1,
        ),
        SmmPath::MatrixUnits => (SmmForwardKernel::MatrixUnits, &[128, 64, 32, 16][..], 8),
    };
    let d3_cap = dims
        .d3
        .next_power_of_two()
        .clamp(*tiles.last().unwrap_or(&16), 128);
    let (t3, units) = tiles
        .iter()
        .copied()
        .filter(|&t3| t3 <= d3_cap)
        .map(|t3| match kernel {
            SmmForwardKernel::MatrixUnits => {
                let c = flash_config(kernel, b1, b2, t3);
                (t3, flash::mma::units(c), flash::mma::shared_bytes(c))
            }
            _ => {
                let c = flash_config(kernel, b1, b2, t3);
                (t3, flash::units::UNITS, flash::units::shared_bytes(c))
            }
        })
        .find(|&(_, units, bytes)| bytes <= max_shared && units <= hw.max_units_per_cube)
        .map(|(t3, units, _)| (t3, units))
        .ok_or_else(no_room)?;
    let cubes = fold_cubes(
        client,
        dims.d3.div_ceil(t3),
        dims.d1.div_ceil(b1),
        dims.batch,
    )?;
    // Forced on (the path was checked above: here `kernel` is the matrix-unit loop), the
    // softmax must hold a row in registers.
    let kernel = match (kernel, options.p_buffer) {
        (SmmForwardKernel::MatrixUnits, Some(true)) => {
            let longest = crate::softmax::row_limits(client, dtype, Default::default())
                .map(|limits| limits.cube)
                .unwrap_or(0);
            if dims.d2 == 0 || dims.d2 > longest {
                return Err(SoftmaxMatmulError::PBufferUnavailable {
                    reason: format!(
                        "rows of {} are outside the softmax's register tiers (1..={longest})",
                        dims.d2
                    ),
                });
            }
            SmmForwardKernel::PBuffer
        }
        _ => kernel,
    };
    Ok(SoftmaxMatmulPlan {
        kernel,
        block_1: b1,
        block_2: b2,
        tile_3: t3,
        vector,
        units,
        cubes,
    })
}

/// The configuration of [`SmmForwardKernel::Wide`] for `dims`, or why it cannot run: the matrix
/// units, `d3` within [`wide::MIN_COLUMNS`]`..=`[`wide::MAX_COLUMNS`], forced blocks (if any)
/// of 64 rows and one of [`wide::STEPS`] columns, and the device's shared memory and units per
/// cube. Unforced, the longest step whose shared memory fits.
fn wide_config<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    path: SmmPath,
    mma_why_not: Option<&str>,
    options: SoftmaxMatmulOptions,
) -> Result<FlashConfig, String> {
    if let Some(reason) = mma_why_not {
        return Err(reason.into());
    }
    if path != SmmPath::MatrixUnits {
        return Err("it runs on the matrix units only".into());
    }
    if let Some(reason) = wide::refuses(dims.d3) {
        return Err(reason);
    }
    let steps: Vec<u32> = match options.blocks {
        None => wide::STEPS.to_vec(),
        Some((b1, b2)) if b1 == wide::BLOCK_ROWS as usize && wide::STEPS.contains(&(b2 as u32)) => {
            vec![b2 as u32]
        }
        Some(blocks) => {
            return Err(format!(
                "its blocks are {} rows and one of {:?} columns of x per step, not {blocks:?}",
                wide::BLOCK_ROWS,
                wide::STEPS
            ));
        }
    };
    let base = flash_config(SmmForwardKernel::MatrixUnits, 64, 32, 64);
    let hw = &client.properties().hardware;
    let mut why = String::new();
    for step in steps {
        let c = wide::config(base, dims.d3, step);
        let (bytes, units) = (wide::shared_bytes(c, 2), wide::planes(c) * fragment::PLANE);
        if wide::stages(c, hw.max_shared_memory_size).is_some() && units <= hw.max_units_per_cube {
            return Ok(c);
        }
        why = format!(
            "it needs {bytes} B of shared memory and {units} units per cube (the device has {} \
             B and {})",
            hw.max_shared_memory_size, hw.max_units_per_cube
        );
    }
    Err(why)
}

/// The plan of [`SmmForwardKernel::Wide`] with configuration `c`.
fn wide_plan<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    c: FlashConfig,
) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
    let cubes = fold_cubes(client, 1, dims.d1.div_ceil(c.block_q as usize), dims.batch)?;
    Ok(SoftmaxMatmulPlan {
        kernel: SmmForwardKernel::Wide,
        block_1: c.block_q as usize,
        block_2: c.block_k as usize,
        tile_3: c.value_dim as usize,
        vector: flash::mma::NV8,
        units: wide::planes(c) * fragment::PLANE,
        cubes,
    })
}

/// The configuration of a flash kernel (given scores) with `block_1 × block_2` steps and
/// `tile_3` output columns per cube. On the matrix units, two row tiles per plane share each
/// `V` fragment for 32 and 64 rows; 128 rows take 8 planes of one tile (more warps to hide
/// latency: the layout of the 16-bit `softmax_matmul` forward before the loops merged).
fn flash_config(kernel: SmmForwardKernel, b1: usize, b2: usize, t3: usize) -> FlashConfig {
    let mma = matches!(
        kernel,
        SmmForwardKernel::MatrixUnits | SmmForwardKernel::PBuffer
    );
    let config = FlashConfig {
        source: if kernel == SmmForwardKernel::PBuffer {
            ScoreSource::Probabilities
        } else {
            ScoreSource::Given
        },
        block_q: b1 as u32,
        row_tiles: if mma && (32..=64).contains(&b1) { 2 } else { 1 },
        block_k: b2 as u32,
        head_dim: 0,
        value_dim: t3 as u32,
        causal: false,
        mask: false,
        bias: false,
        softcap: false,
        dropout: false,
        masked_score: None,
        quiet: false,
    };
    if kernel == SmmForwardKernel::Tiled {
        flash::tiled::config(config, 0)
    } else {
        config
    }
}

/// Whether the register-tiled flash loop ([`flash::tiled`]) runs for `dims`: the runtime has
/// its units and shared memory, and the output fills most of a 128 × 128 tile (smaller outputs
/// waste its work).
fn tiled_fits<R: Runtime>(client: &ComputeClient<R>, dims: SmmDims) -> bool {
    flash::tiled::fits(client, flash_config(SmmForwardKernel::Tiled, 0, 0, 0))
        && dims.d1 > 64
        && dims.d3 > 64
        && dims.d2 > 0
}

/// Which kernels compute the gradients of `softmax(X)·V`: the flash backward core with given
/// scores (`dX` is its `dS`, `dV` its `dV`, summed over the batches of a shared `V` in the
/// kernel, as grouped-query attention sums a group's heads), on one of its inner-product paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmmBackwardPath {
    /// The matrix units ([`flash::mma_backward`]; f16/bf16 on CUDA, 16-byte aligned rows, `dO`
    /// and two steps of `V` in shared memory).
    MatrixUnits,
    /// Plain units, register-tiled ([`flash::given_tiled`]: the core's given-score products,
    /// 128 × 128 outputs per cube; gradients of at least 65 × 65).
    Tiled,
    /// Plain units, the flash schedule ([`flash::backward`]; every runtime and float type, f32
    /// arithmetic).
    Units,
}

/// The backward path [`launch_softmax_matmul_backward`] takes for tensors of these shapes and
/// strides (`v`'s batch stride 0 when it is shared): the matrix units where
/// [`flash::mma_backward`] fits, else plain units, register-tiled for gradients of at least
/// 65 × 65.
pub fn plan_softmax_matmul_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    x: (&[usize], &[usize]),
    v: (&[usize], &[usize]),
    d_out: (&[usize], &[usize]),
) -> SmmBackwardPath {
    if mma_backward_fits(client, dims, dtype, x, v, d_out) {
        SmmBackwardPath::MatrixUnits
    } else if tiled_backward_fits(client, dims) {
        SmmBackwardPath::Tiled
    } else {
        SmmBackwardPath::Units
    }
}

/// Whether the register-tiled given-score products ([`flash::given_tiled`]) run: 256 units
/// and their shared memory, and both gradients at least 65 × 65 (smaller ones waste most of a
/// 128 × 128 tile).
fn tiled_backward_fits<R: Runtime>(client: &ComputeClient<R>, dims: SmmDims) -> bool {
    let hw = &client.properties().hardware;
    hw.max_units_per_cube >= crate::tiling::UNITS
        && hw.max_shared_memory_size >= flash::given_tiled::SHARED_BYTES
        && dims.d1 > 64
        && dims.d2 > 64
        && dims.d3 > 64
}

/// The matrix-unit backward's configuration (its dQ kernel's, see
/// [`flash::mma_backward::launch_backward_mma`]) for `d3` columns: steps of
/// [`flash::mma::CHUNK`] columns of `X`, all of `d3` (rounded up to 16) in the `dX` kernel.
fn mma_backward_config(d3: usize) -> FlashConfig {
    FlashConfig {
        block_q: flash::mma_backward::DQ_ROWS,
        row_tiles: 1,
        block_k: flash::mma::CHUNK,
        head_dim: 0,
        value_dim: d3.next_multiple_of(16) as u32,
        ..flash_config(SmmForwardKernel::MatrixUnits, 64, 64, 64)
    }
}

/// Rows per cube of the matrix-unit `dX` kernel for `dims` (with `shared_v`, `v` has one batch
/// and the batches are rows of one grid row; else each batch is one):
/// [`flash::mma_backward::WIDE_DX_ROWS`] where its shared memory (the `dO` tile of all of `d3`
/// and two `V` blocks) fits and its row blocks still give every multiprocessor one, else
/// [`flash::mma_backward::DQ_ROWS`]. The `dX` kernel runs one cube per multiprocessor at
/// `d3` 512 either way (shared memory), so the wide cube doubles the warps that hide its
/// latency (ncu, H100, d2 1024: 4 warps, an instruction every 5.2 cycles per scheduler;
/// `NOTES.md`, session 17); on a grid smaller than the device, halving the cubes would cost
/// more than that.
pub fn mma_dx_rows<R: Runtime>(client: &ComputeClient<R>, dims: SmmDims, shared_v: bool) -> u32 {
    use flash::mma_backward::{DQ_ROWS, WIDE_DX_ROWS, dq_shared_bytes};
    let hw = &client.properties().hardware;
    let sms = hw.num_streaming_multiprocessors.unwrap_or(1) as usize;
    let c = FlashConfig {
        block_q: WIDE_DX_ROWS,
        ..mma_backward_config(dims.d3)
    };
    let (rows, pairs) = if shared_v {
        (dims.batch * dims.d1, 1)
    } else {
        (dims.d1, dims.batch)
    };
    let fits = dq_shared_bytes(c) <= hw.max_shared_memory_size
        && WIDE_DX_ROWS / fragment::MMA_M * fragment::PLANE <= hw.max_units_per_cube;
    if fits && rows.div_ceil(WIDE_DX_ROWS as usize) * pairs >= sms {
        WIDE_DX_ROWS
    } else {
        DQ_ROWS
    }
}

/// The largest `d2` at which the matrix-unit backward writes `P` for its dK/dV kernel
/// ([`mma_p_buffer()`]): fwd+bwd measured 3–4 % faster with it at d2 1024–2048 and 1–2 % at
/// 256 on an H100 (`NOTES.md`, session 18); above, the buffer's size grows with `d2`.
pub const P_BUFFER_MAX_D2: usize = 2048;

/// Whether the matrix-unit backward takes the P-buffer plan for `dims`: `d2` at most
/// [`P_BUFFER_MAX_D2`] (one more `d1 × d2` buffer in the dtype, the size of `dX`, so only where
/// it is small) and `dX` stored as 16-byte vectors (the `P` stores are `dX`'s).
pub fn mma_p_buffer(dims: SmmDims, dx_shape: &[usize], dx_strides: &[usize]) -> bool {
    let rank = dx_shape.len();
    let vectors = rank > 0
        && dx_shape[rank - 1].is_multiple_of(8)
        && dx_strides[rank - 1] == 1
        && dx_strides[..rank - 1].iter().all(|s| s.is_multiple_of(8));
    dims.d2 <= P_BUFFER_MAX_D2 && vectors
}

/// Whether the matrix-unit backward runs: f16/bf16 with manual `mma`, `ldmatrix` and
/// `cp.async`, 16-byte vectors dividing every row and stride of `x`, `v` and `d_out`, and both
/// kernels' shared memory (the `dX` kernel's grows with `d3`).
fn mma_backward_fits<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    x: (&[usize], &[usize]),
    v: (&[usize], &[usize]),
    d_out: (&[usize], &[usize]),
) -> bool {
    use flash::mma_backward::{PLANES, dkv_config, dkv_shared_bytes, dq_shared_bytes};
    let props = client.properties();
    let hw = &props.hardware;
    let c = mma_backward_config(dims.d3);
    fragment::supported(client, dtype)
        && props.features.copy_async
        && hw.max_units_per_cube >= PLANES * fragment::PLANE
        && hw.max_shared_memory_size
            >= dq_shared_bytes(c).max(dkv_shared_bytes(dkv_config(c), false))
        && row_vector(&[x, v, d_out], dtype) == 8
}

/// Reads the sizes of a call from `x` and `v` and checks every tensor's shape.
fn dims_of(
    x: &TensorRef<'_>,
    v: &TensorRef<'_>,
    others: &[(&'static str, &TensorRef<'_>, [usize; 3])],
) -> Result<SmmDims, SoftmaxMatmulError> {
    if x.shape.len() != 3 || x.strides.len() != 3 {
        return Err(SoftmaxMatmulError::ShapeMismatch {
            arg: "x",
            expected: vec![0, 0, 0],
            got: x.shape.to_vec(),
        });
    }
    let dims = SmmDims {
        batch: x.shape[0],
        d1: x.shape[1],
        d2: x.shape[2],
        d3: v.shape.get(2).copied().unwrap_or(0),
    };
    let v_ok = v.shape.len() == 3
        && v.strides.len() == 3
        && (v.shape[0] == dims.batch || v.shape[0] == 1)
        && v.shape[1] == dims.d2;
    if !v_ok {
        return Err(SoftmaxMatmulError::ShapeMismatch {
            arg: "v",
            expected: vec![dims.batch, dims.d2, dims.d3],
            got: v.shape.to_vec(),
        });
    }
    for (arg, t, expected) in others {
        let expected = expected.map(|e| match e {
            BATCH => dims.batch,
            D1 => dims.d1,
            D2 => dims.d2,
            D3 => dims.d3,
            other => other,
        });
        let expected: Vec<usize> = expected.into_iter().filter(|&e| e != NONE).collect();
        if t.shape != expected || t.strides.len() != expected.len() {
            return Err(SoftmaxMatmulError::ShapeMismatch {
                arg,
                expected,
                got: t.shape.to_vec(),
            });
        }
    }
    Ok(dims)
}

// Placeholders of `dims_of`'s expected shapes.
const BATCH: usize = usize::MAX;
const D1: usize = usize::MAX - 1;
const D2: usize = usize::MAX - 2;
const D3: usize = usize::MAX - 3;
const NONE: usize = usize::MAX - 4;

/// `out = softmax(x)·v` along the last dimension of `x`, and `lse` = the row log-sum-exp of
/// `x` (f32; −inf for a row without a finite score, whose output row is 0).
///
/// Returns the plan that ran. Nothing is launched when an error is returned; with an empty
/// tensor, nothing is launched either and the plan is returned.
#[allow(clippy::too_many_arguments)]
pub fn launch_softmax_matmul<R: Runtime>(
    client: &ComputeClient<R>,
    x: TensorRef<'_>,
    v: TensorRef<'_>,
    out: TensorRef<'_>,
    lse: TensorRef<'_>,
    dtype: StorageType,
    options: SoftmaxMatmulOptions,
) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
    crate::cache::ensure_linked();
    let dims = dims_of(
        &x,
        &v,
        &[
            ("out", &out, [BATCH, D1, D3]),
            ("lse", &lse, [BATCH, D1, NONE]),
        ],
    )?;
    let mut v_strides = v.strides.to_vec();
    if v.shape[0] == 1 {
        // A shared `v` is read at batch stride 0.
        v_strides[0] = 0;
    }
    let vector = row_vector(
        &[
            (x.shape, x.strides),
            (v.shape, &v_strides),
            (out.shape, out.strides),
        ],
        dtype,
    );
    let plan = plan_softmax_matmul(client, dims, dtype, vector, options)?;
    if dims.batch * dims.d1 * dims.d3 == 0 {
        return Ok(plan);
    }
    let shared_v = v.shape[0] == 1 && dims.batch > 1;
    let units = CubeDim::new_1d(plan.units);
    // The flash kernels see 4-D tensors with one head: X `[batch, 1, d1, d2]` as the given
    // scores, V `[batch or 1, 1, d2, d3]`, out `[batch, 1, d1, d3]`, lse `[batch, 1, d1]`.
    let count = check_cubes(client, plan.cubes)?;
    let mut config = flash_config(plan.kernel, plan.block_1, plan.block_2, plan.tile_3);
    // The P-buffer plan: `P = softmax(X)` and `lse` first, then `P·V` reads `P` where the
    // fused loop reads `X`.
    let p_handle;
    let (p_shape, p_strides) = (
        [dims.batch, dims.d1, dims.d2],
        [dims.d1 * dims.d2, dims.d2, 1],
    );
    let x = if plan.kernel == SmmForwardKernel::PBuffer {
        p_handle = client.empty(dims.batch * dims.d1 * dims.d2 * dtype.size());
        let p = TensorRef {
            handle: &p_handle,
            shape: &p_shape,
            strides: &p_strides,
        };
        crate::softmax::launch_softmax_lse(client, x, p, lse, dtype).map_err(|e| {
            SoftmaxMatmulError::PBufferUnavailable {
                reason: e.to_string(),
            }
        })?;
        p
    } else {
        x
    };
    let heads = |t: &TensorRef<'_>, batch_stride: usize| {
        let mut shape = t.shape.to_vec();
        let mut strides = t.strides.to_vec();
        shape.insert(1, 1);
        strides[0] = batch_stride;
        strides.insert(1, 0);
        // SAFETY: shape and strides describe the caller's buffer with a head axis of size 1;
        // zero strides only make every index along them read the same element.
        unsafe { TensorArg::<R>::from_raw_parts(t.handle.clone(), strides.into(), shape.into()) }
    };
    let v_batch_stride = if shared_v { 0 } else { v.strides[0] };
    let tensors = flash::FlashTensors {
        q: heads(&x, x.strides[0]),
        k: heads(&x, x.strides[0]),
        v: heads(&v, v_batch_stride),
        mask: heads(&x, x.strides[0]),
        bias: heads(&x, x.strides[0]),
        out: heads(&out, out.strides[0]),
        lse: heads(&lse, lse.strides[0]),
    };
    let Some(kernel) = plan.kernel.flash() else {
        config = wide::config(config, dims.d3, plan.block_2 as u32);
        let max_shared = client.properties().hardware.max_shared_memory_size;
        let stages = wide::stages(config, max_shared).expect("the plan checked shared memory");
        // SAFETY: as above; the plan chose this kernel only for 16-byte aligned rows (its
        // vector of 8) and `d3` within the configuration's width.
        unsafe {
            wide::softmax_matmul_wide::launch_unchecked::<R>(
                client,
                count,
                units,
                flash::mma::NV8,
                tensors.q,
                tensors.v,
                tensors.out,
                tensors.lse,
                config,
                stages,
                dtype,
            );
        }
        return Ok(plan);
    };
    // SAFETY: as above; the matrix-unit kernel runs only on 16-byte aligned rows (the plan's
    // vector of 8), the tiled kernel's vector (the plan's) divides every row and stride, and
    // `k`, `mask` and `bias` (stand-ins: `x`) are never read with given scores.
    unsafe {
        flash::launch_forward(
            client,
            kernel,
            count,
            units,
            plan.vector,
            tensors,
            1.0,
            1.0,
            crate::dropout::DropoutParams::new(0.0, 0),
            config,
            dtype,
        );
    }
    Ok(plan)
}

/// Gradients of [`launch_softmax_matmul`]: `dx` (`[batch, d1, d2]`) and `dv` (`v`'s shape; a
/// shared `v` gets the sum over batches) from the forward's `out` and `lse` and the output
/// gradient `d_out`. Needs one f32 per row of scratch, nothing of size `d1 × d2` but `dx`.
#[allow(clippy::too_many_arguments)]
pub fn launch_softmax_matmul_backward<R: Runtime>(
    client: &ComputeClient<R>,
    x: TensorRef<'_>,
    v: TensorRef<'_>,
    out: TensorRef<'_>,
    lse: TensorRef<'_>,
    d_out: TensorRef<'_>,
    dx: TensorRef<'_>,
    dv: TensorRef<'_>,
    dtype: StorageType,
) -> Result<(), SoftmaxMatmulError> {
    crate::cache::ensure_linked();
    let v_batch = v.shape.first().copied().unwrap_or(0);
    let dims = dims_of(
        &x,
        &v,
        &[
            ("out", &out, [BATCH, D1, D3]),
            ("lse", &lse, [BATCH, D1, NONE]),
            ("d_out", &d_out, [BATCH, D1, D3]),
            ("dx", &dx, [BATCH, D1, D2]),
            ("dv", &dv, [v_batch, D2, D3]),
        ],
    )?;
    check_dtype(client, dtype)?;
    let SmmDims { batch, d1, d2, d3 } = dims;
    let shared_v = v_batch == 1 && batch > 1;
    let mut v_strides = v.strides.to_vec();
    if shared_v {
        v_strides[0] = 0;
    }
    let rows = batch * d1;
    // Without rows, dV is zero: the flash backward core writes it.
    let path = if rows == 0 {
        SmmBackwardPath::Units
    } else {
        plan_softmax_matmul_backward(
            client,
            dims,
            dtype,
            (x.shape, x.strides),
            (v.shape, &v_strides),
            (d_out.shape, d_out.strides),
        )
    };
    // The flash kernels' 4-D view of a 3-D tensor `[batch or 1, n1, n2]`: one head per batch,
    // or, with a shared `V`, every batch a query head of the one key/value head (so that `dV`
    // sums over the batches in the kernel, as grouped-query attention sums a group).
    let view = |t: &TensorRef<'_>, shared: bool| {
        let (mut shape, mut strides) = (t.shape.to_vec(), t.strides.to_vec());
        if shared {
            shape.insert(0, 1);
            strides.insert(0, 0);
            if shape[1] == 1 {
                strides[1] = 0;
            }
        } else {
            shape.insert(1, 1);
            strides.insert(1, 0);
        }
        flash::backward::Operand {
            handle: t.handle.clone(),
            shape,
            strides,
        }
    };
    let dv_nonempty = dv.shape.iter().product::<usize>() > 0;
    let group = if shared_v { batch } else { 1 };
    let pairs = if shared_v { 1 } else { batch };
    let (y, z) = flash::backward::fold_pairs(pairs, client.properties().hardware.max_cube_count.1);
    let shared = |t: &TensorRef<'_>| view(t, shared_v);
    let operands = flash::backward::BackwardOperands {
        q: shared(&x),
        k: shared(&x),
        v: shared(&v),
        mask: shared(&x),
        bias: shared(&x),
        out: shared(&out),
        d_out: shared(&d_out),
        lse: shared(&lse),
        dq: shared(&dx),
        dk: shared(&x),
        dv: shared(&dv),
        ds: shared(&dx),
    };
    match path {
        SmmBackwardPath::MatrixUnits => {
            use flash::mma_backward::{dkv_blocks, launch_backward_mma};
            let dx_rows = mma_dx_rows(client, dims, shared_v);
            // The P-buffer plan (small d2): the dX kernel stores `P` in a buffer laid out as
            // `dX`, which the dK/dV kernel then stages instead of recomputing it from `X`.
            let p_buffer = mma_p_buffer(dims, dx.shape, dx.strides).then(|| {
                let elems = 1 + dx
                    .shape
                    .iter()
                    .zip(dx.strides)
                    .map(|(&n, &s)| n.saturating_sub(1) * s)
                    .sum::<usize>();
                let mut p = shared(&dx);
                p.handle = client.empty(elems * dtype.size());
                p
            });
            let dkv = (dkv_blocks(d2, d3, true), y, z);
            let dq = ((group * d1).div_ceil(dx_rows as usize), y, z);
            for cubes in [dkv, dq] {
                check_cubes(client, cubes)?;
            }
            // SAFETY: every index is bounds-checked against the shapes passed here, which
            // describe the caller's buffers (`dims_of` checked that they agree); the plan
            // checked the 16-byte rows of `x`, `v` and `d_out`; the grids are the kernels'.
            unsafe {
                launch_backward_mma(
                    client,
                    &operands,
                    rows,
                    (dv_nonempty && d2 > 0).then_some(dkv),
                    (rows > 0 && d2 > 0).then_some(dq),
                    1.0,
                    1.0,
                    crate::dropout::DropoutParams::new(0.0, 0),
                    mma_backward_config(d3),
                    dx_rows,
                    true,
                    false,
                    p_buffer.as_ref(),
                    dtype,
                );
            }
        }
        SmmBackwardPath::Tiled => {
            use flash::given_tiled::{launch_given_tiled, tiles};
            let dv_cubes = (tiles(d2, d3), y, z);
            let dx_cubes = (tiles(group * d1, d2), y, z);
            for cubes in [dv_cubes, dx_cubes] {
                check_cubes(client, cubes)?;
            }
            let vector = row_vector(
                &[
                    (x.shape, x.strides),
                    (v.shape, &v_strides),
                    (d_out.shape, d_out.strides),
                    (dx.shape, dx.strides),
                    (dv.shape, dv.strides),
                ],
                dtype,
            )
            .min(4);
            // SAFETY: as below; `vector` divides every row and stride.
            unsafe {
                launch_given_tiled(
                    client,
                    &operands,
                    rows,
                    dv_nonempty.then_some(dv_cubes),
                    Some(dx_cubes),
                    vector,
                    dtype,
                );
            }
        }
        SmmBackwardPath::Units => {
            use flash::backward::{BLOCK_ROWS, dkv_blocks};
            let dkv = (dkv_blocks(d2, 0, d3, true), y, z);
            let dq = ((group * d1).div_ceil(BLOCK_ROWS as usize), y, z);
            for cubes in [dkv, dq] {
                check_cubes(client, cubes)?;
            }
            let config = FlashConfig {
                block_q: flash::backward::BLOCK_ROWS,
                block_k: flash::backward::STEP_KEYS,
                head_dim: 0,
                value_dim: d3.next_multiple_of(flash::backward::CHUNK as usize) as u32,
                ..flash_config(SmmForwardKernel::Units, 16, 16, 64)
            };
            // SAFETY: as above; the plain-unit kernels read scalars.
            unsafe {
                flash::backward::launch_backward(
                    client,
                    &operands,
                    rows,
                    (dv_nonempty && d2 > 0).then_some(dkv),
                    (rows > 0 && d2 > 0).then_some(dq),
                    1.0,
                    1.0,
                    crate::dropout::DropoutParams::new(0.0, 0),
                    config,
                    true,
                    dtype,
                );
            }
        }
    }
    Ok(())
}
