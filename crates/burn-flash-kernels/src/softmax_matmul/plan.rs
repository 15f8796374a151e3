//! The host heuristics of `softmax(X)·V`: which kernel runs a call and with which tile. No
//! autotuning; each choice is a small function with its reason.

use cubecl::prelude::*;

use super::options::{
    BLOCK_SIZES, SmmBackwardPath, SmmBackwardPlan, SmmDims, SmmForwardKernel, SmmPath,
    SoftmaxMatmulError, SoftmaxMatmulOptions, SoftmaxMatmulPlan,
};
use crate::flash::backward::{
    cmma as backward_cmma, hopper_given, mma, sm80, sm80_given, units, units_given,
};
use crate::flash::block::{fold_grid, fold_pairs};
use crate::flash::forward::{self, hopper, tiled};
use crate::flash::{FlashConfig, ScoreRules, ScoreSource, Tile};
use crate::fragment::{self, MatrixUnitsUnavailable};

/// Checks that `dtype` is a float type the kernels are written for and the device supports.
pub fn check_dtype<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
) -> Result<(), SoftmaxMatmulError> {
    Ok(crate::tensor::check_dtype(client, dtype)?)
}

/// Checks a grid against the device's limits.
pub(crate) fn check_cubes<R: Runtime>(
    client: &ComputeClient<R>,
    cubes: (usize, usize, usize),
) -> Result<(usize, usize, usize), SoftmaxMatmulError> {
    let (mx, my, mz) = client.properties().hardware.max_cube_count;
    if cubes.0 > mx as usize || cubes.1 > my as usize || cubes.2 > mz as usize {
        return Err(SoftmaxMatmulError::TooLarge { cubes });
    }
    Ok(cubes)
}

/// The forward grid: column tiles, row blocks, batches folded over y and z ([`fold_grid`]).
fn fold_cubes<R: Runtime>(
    client: &ComputeClient<R>,
    tiles: usize,
    row_blocks: usize,
    batch: usize,
) -> Result<(usize, usize, usize), SoftmaxMatmulError> {
    let max = client.properties().hardware.max_cube_count;
    fold_grid(tiles, row_blocks, batch, max).ok_or(SoftmaxMatmulError::TooLarge {
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

/// The configuration of a forward flash kernel (given scores) on `tile`.
fn given(tile: Tile) -> FlashConfig {
    FlashConfig::new(ScoreSource::Given, ScoreRules::NONE, tile)
}

/// The tile of a plain-unit or matrix-unit forward with `block_1 × block_2` steps and `tile_3`
/// output columns per cube. On the matrix units, two row tiles per plane share each `V`
/// fragment for 32 and 64 rows; 128 rows take 8 planes of one tile (more warps to hide
/// latency).
pub fn forward_tile(kernel: SmmForwardKernel, b1: usize, b2: usize, t3: usize) -> Tile {
    let mma = kernel == SmmForwardKernel::MatrixUnits;
    Tile {
        block_q: b1 as u32,
        row_tiles: if mma && (32..=64).contains(&b1) { 2 } else { 1 },
        block_k: b2 as u32,
        head_dim: 0,
        value_dim: t3 as u32,
    }
}

/// The default `(block_1, block_2)` for `dims` on `path`: 64 rows per cube (fewer when `d1`
/// is short; 32 on wgpu's plain units, where they ran faster; 128 on the matrix units when the
/// grid still has at least 4 cubes per multiprocessor, so that 4 planes of 2 row tiles share
/// each `V` block) and 32 columns per step (the matrix-unit loop keeps two steps of scores in
/// registers, and 64 would spill).
pub fn default_blocks(dims: SmmDims, path: SmmPath, wgpu: bool, sms: usize) -> (usize, usize) {
    let wide = dims.d3.div_ceil(128) * dims.d1.div_ceil(128) * dims.batch >= 4 * sms;
    let b1 = if dims.d1 <= 16 {
        16
    } else if dims.d1 <= 32 || (path == SmmPath::Units && wgpu) {
        32
    } else if path == SmmPath::MatrixUnits && wide {
        128
    } else {
        64
    };
    (b1, 32)
}

/// Whether the register-tiled flash loop ([`tiled`]) runs for `dims`: the runtime has its
/// units and shared memory, and the output fills most of a 128 × 128 tile (smaller outputs
/// waste its work).
fn tiled_fits<R: Runtime>(client: &ComputeClient<R>, dims: SmmDims) -> bool {
    tiled::fits(client, given(tiled::tile(0))) && dims.d1 > 64 && dims.d3 > 64
}

/// Why the Hopper forward ([`SmmForwardKernel::Hopper`]) cannot run a call of `dims` on
/// `client`'s device (`None`: it can). `row_vector` is [`row_vector`] of `x`, `v` and the
/// output; `tma` says that every buffer starts on 16 bytes and no dimension of `x`, `v` or the
/// output but the batch is read at stride 0 (the TMA maps' needs).
pub fn hopper_unavailable<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    row_vector: usize,
    tma: bool,
) -> Option<String> {
    use cubecl::ir::{ElemType, FloatKind};
    let reason = if !crate::attention::sm90(client) {
        "the device is not a Hopper GPU (sm_90)"
    } else if !matches!(
        dtype,
        StorageType::Scalar(ElemType::Float(FloatKind::F16 | FloatKind::BF16))
    ) {
        "the Hopper forward takes f16 and bf16"
    } else if row_vector * dtype.size() != 16 || !tma {
        "the Hopper forward reads rows through TMA: unit stride along the rows, row lengths and strides multiples of 16 bytes, buffers starting on 16 bytes"
    } else if dims.batch * dims.d1 * dims.d2 * dims.d3 == 0 {
        "the Hopper forward takes non-empty tensors"
    } else if dims.batch > 65_535 || dims.d1.div_ceil(hopper::BLOCK_Q) > 65_535 {
        "the Hopper forward launches one block row per 128 rows and batch: at most 65535 each"
    } else if dims.d1 > i32::MAX as usize / 2 || dims.d2 > i32::MAX as usize / 2 {
        "the Hopper forward indexes positions with 32-bit integers"
    } else {
        return None;
    };
    Some(reason.into())
}

/// The forward launch for `dims`, without launching. `row_vector` is [`row_vector`] of `x`, `v`
/// and the output ([`contiguous_row_vector`] for contiguous tensors); the tensors are taken to
/// be TMA-ready (see [`plan_softmax_matmul_for`]), as Burn's new tensors are.
pub fn plan_softmax_matmul<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    row_vector: usize,
    options: SoftmaxMatmulOptions,
) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
    plan_softmax_matmul_for(client, dims, dtype, row_vector, true, options)
}

/// The forward launch for `dims`, without launching. `row_vector` is [`row_vector`] of `x`, `v`
/// and the output; `tma` is what [`hopper_unavailable`] takes.
///
/// Heuristic, one kernel per call:
/// - f16/bf16 on a Hopper GPU where [`hopper_unavailable`] finds nothing against the call, with
///   neither blocks nor plain units forced and `options.hopper` not `Some(false)`:
///   [`SmmForwardKernel::Hopper`] (`Some(true)` makes it an error not to);
/// - f16/bf16 where the matrix units run the dtype on 16-byte aligned rows
///   ([`fragment::unavailable`]): [`SmmForwardKernel::MatrixUnits`];
/// - f16/bf16 where the device has no manual `mma` but offers cooperative matrices
///   ([`forward::cmma::fragment`]; any rows): [`SmmForwardKernel::CooperativeMatrix`], at most
///   64 rows per cube;
/// - everything else on plain units: [`SmmForwardKernel::Tiled`] where it fits (see
///   `tiled_fits`), [`SmmForwardKernel::Units`] otherwise and for forced blocks.
///
/// Blocks outside the tiled kernel: [`default_blocks`]; the output tile as wide as shared
/// memory and `d3` allow (up to 128 columns), since each column tile re-reads `X`.
pub fn plan_softmax_matmul_for<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    row_vector: usize,
    tma: bool,
    options: SoftmaxMatmulOptions,
) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
    check_dtype(client, dtype)?;
    let hw = &client.properties().hardware;
    let hopper_reason = hopper_unavailable(client, dims, dtype, row_vector, tma);
    let hopper = match options.hopper {
        Some(true) => {
            let reason = if options.blocks.is_some() {
                Some("the Hopper kernel takes no forced blocks".to_string())
            } else if options.path == Some(SmmPath::Units) {
                Some("the Hopper kernel runs on the matrix units, not plain units".to_string())
            } else {
                hopper_reason
            };
            if let Some(reason) = reason {
                return Err(SoftmaxMatmulError::PathUnavailable {
                    path: SmmPath::MatrixUnits,
                    reason,
                });
            }
            true
        }
        Some(false) => false,
        None => {
            options.blocks.is_none()
                && options.path != Some(SmmPath::Units)
                && hopper_reason.is_none()
        }
    };
    if hopper {
        let config = given(hopper::given_tile(dims.d3));
        // Blocks over the tiles of output columns, rows and batches: one per tile, or
        // persistent ones taking them in rounds.
        let sms = hw.num_streaming_multiprocessors.unwrap_or(1) as usize;
        let tiles = hopper::given_tiles(dims.d1, dims.d3, dims.batch, config);
        let cubes = (hopper::blocks(tiles, sms, options.schedule), 1, 1);
        return Ok(SoftmaxMatmulPlan {
            kernel: SmmForwardKernel::Hopper,
            config,
            vector: row_vector,
            units: hopper::UNITS,
            cubes: check_cubes(client, cubes)?,
            matrix_units: None,
        });
    }
    let max_shared = hw.max_shared_memory_size;
    // The flash loop on the matrix units reads 16-byte vectors of `X` and copies `V`
    // asynchronously; forced steps must be whole chunks of its loads.
    let matrix_units = fragment::unavailable(client, dtype, row_vector * dtype.size() == 16);
    // Cooperative matrices take the matrix-unit path where the manual `mma` is missing.
    let coop = forward::cmma::fragment(client, dtype, false)
        .filter(|_| matches!(matrix_units, Some(MatrixUnitsUnavailable::NoMma { .. })));
    let mma_why_not = if coop.is_some() {
        None
    } else {
        matrix_units.map(|why| why.to_string())
    };
    let mma_why_not = mma_why_not.or_else(|| {
        options
            .blocks
            .is_some_and(|(_, b2)| {
                coop.is_none() && !(b2 as u32).is_multiple_of(forward::mma::CHUNK)
            })
            .then(|| {
                format!(
                    "block_2 must be a multiple of {} on the matrix units",
                    forward::mma::CHUNK
                )
            })
    });
    let path = match (options.path, mma_why_not) {
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
        None => default_blocks(
            dims,
            path,
            R::name(client).starts_with("wgpu"),
            hw.num_streaming_multiprocessors.unwrap_or(1) as usize,
        ),
    };
    if path == SmmPath::Units && options.blocks.is_none() && tiled_fits(client, dims) {
        let cubes = fold_cubes(
            client,
            dims.d3.div_ceil(tiled::TILE_N as usize),
            dims.d1.div_ceil(tiled::BLOCK_Q as usize),
            dims.batch,
        )?;
        return Ok(SoftmaxMatmulPlan {
            kernel: SmmForwardKernel::Tiled,
            config: given(tiled::tile(0)),
            // The tiled kernel loads 4-vectors at most.
            vector: row_vector.min(4),
            units: tiled::UNITS,
            cubes,
            matrix_units,
        });
    }
    let no_room = || SoftmaxMatmulError::InvalidBlocks {
        blocks: (b1, b2),
        reason: format!("needs more than the device's {max_shared} B of shared memory"),
    };
    // The output tile as wide as shared memory and d3 allow (up to 128 columns): each column
    // tile re-reads X.
    let (kernel, tiles, vector) = match (path, coop) {
        (SmmPath::Units, _) => (
            SmmForwardKernel::Units,
            &[128, 64][..],
            // Scalar loads: the plain-unit loop reads through any strides.
            1,
        ),
        (SmmPath::MatrixUnits, None) => (SmmForwardKernel::MatrixUnits, &[128, 64, 32, 16][..], 8),
        // Vectors of up to 16 bytes that divide a lane's columns of `X` per step (the
        // cooperative kernel reads through any strides).
        (SmmPath::MatrixUnits, Some(f)) => (
            SmmForwardKernel::CooperativeMatrix,
            &[128, 64, 32, 16][..],
            row_vector.min((b2 as u32 / f.lanes_per_row()) as usize),
        ),
    };
    // The cooperative kernel holds at most 64 rows (4 planes of 16-row fragments).
    let b1 = match kernel {
        SmmForwardKernel::CooperativeMatrix if options.blocks.is_none() => b1.min(64),
        _ => b1,
    };
    let d3_cap = dims
        .d3
        .next_power_of_two()
        .clamp(*tiles.last().unwrap_or(&16), 128);
    let (config, units) = tiles
        .iter()
        .copied()
        .filter(|&t3| t3 <= d3_cap)
        .map(|t3| {
            let c = given(forward_tile(kernel, b1, b2, t3));
            match kernel {
                SmmForwardKernel::MatrixUnits => {
                    (c, forward::mma::units(c), forward::mma::shared_bytes(c))
                }
                SmmForwardKernel::CooperativeMatrix => {
                    let f = coop.expect("the cooperative kernel has a fragment");
                    let fits = forward::cmma::fits(c, f);
                    let bytes = forward::cmma::shared_bytes(c, f);
                    (c, f.units(c.block_q), if fits { bytes } else { usize::MAX })
                }
                _ => (c, forward::units::UNITS, forward::units::shared_bytes(c)),
            }
        })
        .find(|&(_, units, bytes)| bytes <= max_shared && units <= hw.max_units_per_cube)
        .map(|(c, units, _)| (c, units))
        .ok_or_else(no_room)?;
    let cubes = fold_cubes(
        client,
        dims.d3.div_ceil(config.value_dim as usize),
        dims.d1.div_ceil(b1),
        dims.batch,
    )?;
    Ok(SoftmaxMatmulPlan {
        kernel,
        config,
        vector,
        units,
        cubes,
        matrix_units,
    })
}

/// The tensors' layouts (shape, strides) a backward plan reads: `x`, `v` (batch stride 0 when
/// it is shared), `d_out`, `dx`, `dv`.
pub type BackwardLayouts<'a> = [(&'a [usize], &'a [usize]); 5];

/// The backward launch for tensors of these shapes and strides, without launching, with the
/// tensors taken to be TMA-ready (see [`plan_softmax_matmul_backward_for`]).
pub fn plan_softmax_matmul_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    layouts: BackwardLayouts<'_>,
    options: SoftmaxMatmulOptions,
) -> Result<SmmBackwardPlan, SoftmaxMatmulError> {
    plan_softmax_matmul_backward_for(client, dims, dtype, layouts, true, options)
}

/// The backward launch for tensors of these shapes and strides, without launching: the matrix
/// units where [`mma_backward_unavailable`] says they can run — on a Hopper GPU with `dX` by the
/// `wgmma` kernel ([`SmmBackwardPath::Hopper`]) where [`hopper_unavailable`] finds nothing
/// against `x`, `v`, `d_out` and `dx` (`tma`: every buffer starts on 16 bytes and no row stride
/// is 0) and the forward's `options` do not say `hopper: Some(false)` — else plain units,
/// register-tiled ([`units_given`]) for gradients of at least 65 × 65 where the device has its
/// units and shared memory, else the flash schedule ([`units`]). Ahead of all of them, the
/// Ampere kernels ([`SmmBackwardPath::Ampere`]) wherever [`ampere_unavailable`] finds nothing
/// (only under `AmpereUse::Always`).
pub fn plan_softmax_matmul_backward_for<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    layouts: BackwardLayouts<'_>,
    tma: bool,
    options: SoftmaxMatmulOptions,
) -> Result<SmmBackwardPlan, SoftmaxMatmulError> {
    check_dtype(client, dtype)?;
    let SmmDims { batch, d1, d2, d3 } = dims;
    let [x, v, d_out, dx, dv] = layouts;
    let shared_v = v.0.first() == Some(&1) && batch > 1;
    // A shared `V`: every batch is a query head of the one key/value head (its dV sums them).
    let (group, pairs) = if shared_v { (batch, 1) } else { (1, batch) };
    let (y, z) = fold_pairs(pairs, client.properties().hardware.max_cube_count.1);
    let matrix_units = mma_backward_unavailable(client, dims, dtype, &[x, v, d_out]);
    let rows = batch * d1;
    // Cooperative matrices where the device has them and no `mma`, for `d3` up to their
    // accumulators' width.
    let cooperative = forward::cmma::fragment(client, dtype, false).and_then(|f| {
        let c = given(backward_cmma::tile(0, d3, f));
        let wanted = matches!(matrix_units, Some(MatrixUnitsUnavailable::NoMma { .. }));
        (wanted && backward_cmma::runs(client, c, f)).then_some((f, c))
    });
    // Without rows, dV is zero: the flash schedule writes it.
    let path = if rows > 0 && matrix_units.is_none() {
        SmmBackwardPath::MatrixUnits
    } else if rows > 0 && cooperative.is_some() {
        SmmBackwardPath::CooperativeMatrix
    } else if rows > 0 && tiled_backward_fits(client, dims) {
        SmmBackwardPath::Tiled
    } else {
        SmmBackwardPath::Units
    };
    let units_config = given(Tile {
        block_q: units::BLOCK_ROWS,
        row_tiles: 1,
        block_k: units::STEP_KEYS,
        head_dim: 0,
        value_dim: d3.next_multiple_of(units::CHUNK as usize) as u32,
    });
    // dX and dV on Hopper's `wgmma` kernels where they can run.
    let path = match path {
        SmmBackwardPath::MatrixUnits
            if options.hopper != Some(false)
                && hopper_unavailable(
                    client,
                    dims,
                    dtype,
                    row_vector(&[x, v, d_out, dx, dv], dtype),
                    tma,
                )
                .is_none()
                && dims.d2.div_ceil(hopper_given::BLOCK_KEYS) <= i32::MAX as usize =>
        {
            SmmBackwardPath::Hopper
        }
        other => other,
    };
    // dX and dV on the Ampere kernels where the use asks for them and they can run.
    let path = if ampere_unavailable(client, dims, dtype, &layouts, tma, options).is_none() {
        SmmBackwardPath::Ampere
    } else {
        path
    };
    let (config, dv_cubes, dx_cubes) = match path {
        SmmBackwardPath::Hopper | SmmBackwardPath::Ampere => {
            let c = mma_backward_config(d3, mma::DQ_ROWS);
            // The grids are the hand-written kernels' own (below).
            (c, 0, 0)
        }
        SmmBackwardPath::MatrixUnits => {
            let c = mma_backward_config(d3, mma_dx_rows(client, dims, shared_v));
            let dx = (group * d1).div_ceil(c.block_q as usize);
            (c, mma::dkv_blocks(d2, d3, true), dx)
        }
        SmmBackwardPath::CooperativeMatrix => {
            let (f, c) = cooperative.expect("the path was picked with them");
            (
                c,
                d2.div_ceil(backward_cmma::block_keys(f) as usize),
                (group * d1).div_ceil(c.block_q as usize),
            )
        }
        SmmBackwardPath::Tiled => (
            units_config,
            units_given::tiles(d2, d3),
            units_given::tiles(group * d1, d2),
        ),
        SmmBackwardPath::Units => (
            units_config,
            units::dkv_blocks(d2, 0, d3, true),
            (group * d1).div_ceil(units::BLOCK_ROWS as usize),
        ),
    };
    Ok(SmmBackwardPlan {
        path,
        config,
        p_buffer: path == SmmBackwardPath::MatrixUnits && mma_p_buffer(dims, dx.0, dx.1),
        vector: match cooperative {
            Some((f, c)) if path == SmmBackwardPath::CooperativeMatrix => {
                forward::cmma::vector(&[x, v, d_out], c, f)
            }
            _ => row_vector(&[x, v, d_out, dx, dv], dtype).min(4),
        },
        dv_cubes: match path {
            SmmBackwardPath::Hopper => check_cubes(client, hopper_given::dv_cubes(v.0[0], d2, d3))?,
            SmmBackwardPath::Ampere => check_cubes(client, sm80_given::dv_cubes(v.0[0], d2, d3))?,
            _ => check_cubes(client, (dv_cubes, y, z))?,
        },
        dx_cubes: match path {
            SmmBackwardPath::Hopper => check_cubes(client, hopper_given::cubes(batch, d1, d2))?,
            SmmBackwardPath::Ampere => check_cubes(client, sm80_given::dx_cubes(batch, d1, d2))?,
            _ => check_cubes(client, (dx_cubes, y, z))?,
        },
        matrix_units,
    })
}

/// Why the Ampere kernels ([`SmmBackwardPath::Ampere`]) do not run a backward
/// ([`sm80_given::unavailable`]; `None`: they do): `layouts` as the plan reads them, `tma`
/// whether every buffer starts on 16 bytes and no row stride is 0.
pub fn ampere_unavailable<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    layouts: &BackwardLayouts<'_>,
    tma: bool,
    options: SoftmaxMatmulOptions,
) -> Option<&'static str> {
    let [x, v, d_out, dx, dv] = *layouts;
    // Every buffer starts on 16 bytes, rows and strides are 16-byte multiples.
    let rows16 = tma && row_vector(&[x, v, d_out, dx, dv], dtype) * dtype.size() == 16;
    sm80_given::unavailable(
        options.ampere,
        sm80::cuda(client),
        fragment::unavailable(client, dtype, true).is_none(),
        dtype.size() == 2,
        rows16,
        dims,
        client.properties().hardware.max_shared_memory_size,
    )
}

/// Whether the register-tiled given-score products ([`units_given`]) run: 256 units and their
/// shared memory, and both gradients at least 65 × 65 (smaller ones waste most of a 128 × 128
/// tile).
fn tiled_backward_fits<R: Runtime>(client: &ComputeClient<R>, dims: SmmDims) -> bool {
    let hw = &client.properties().hardware;
    hw.max_units_per_cube >= crate::tiling::UNITS
        && hw.max_shared_memory_size >= units_given::SHARED_BYTES
        && dims.d1 > 64
        && dims.d2 > 64
        && dims.d3 > 64
}

/// The matrix-unit backward's configuration (its `dX` kernel's, see [`mma::launch`]) for `d3`
/// columns and `rows` rows per cube: steps of [`forward::mma::CHUNK`] columns of `X`, all of
/// `d3` (rounded up to 16) in the `dX` kernel.
fn mma_backward_config(d3: usize, rows: u32) -> FlashConfig {
    given(Tile {
        block_q: rows,
        row_tiles: 1,
        block_k: forward::mma::CHUNK,
        head_dim: 0,
        value_dim: d3.next_multiple_of(16) as u32,
    })
}

/// Rows per cube of the matrix-unit `dX` kernel for `dims` (with `shared_v`, `v` has one batch
/// and the batches are rows of one grid row; else each batch is one): [`mma::WIDE_DX_ROWS`]
/// where its shared memory (the `dO` tile of all of `d3` and two `V` blocks) fits and its row
/// blocks still give every multiprocessor one, else [`mma::DQ_ROWS`]. The `dX` kernel runs one
/// cube per multiprocessor at `d3` 512 either way (shared memory), so the wide cube doubles
/// the warps that hide its latency; on a grid smaller than the device, halving the cubes would
/// cost more than that.
pub fn mma_dx_rows<R: Runtime>(client: &ComputeClient<R>, dims: SmmDims, shared_v: bool) -> u32 {
    use mma::{DQ_ROWS, WIDE_DX_ROWS, dq_shared_bytes};
    let hw = &client.properties().hardware;
    let sms = hw.num_streaming_multiprocessors.unwrap_or(1) as usize;
    let c = mma_backward_config(dims.d3, WIDE_DX_ROWS);
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
/// ([`mma_p_buffer()`]): above it, the buffer's size grows with `d2` and its cost passes its
/// gain.
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

/// Why the matrix-unit backward cannot run (`None`: it can): the dtype on this device with
/// 16-byte vectors dividing every row and stride of `x`, `v` and `d_out`
/// ([`fragment::unavailable`]), and both kernels' units and shared memory (the `dX` kernel's
/// grows with `d3`).
pub fn mma_backward_unavailable<R: Runtime>(
    client: &ComputeClient<R>,
    dims: SmmDims,
    dtype: StorageType,
    tensors: &[(&[usize], &[usize])],
) -> Option<MatrixUnitsUnavailable> {
    let hw = &client.properties().hardware;
    let c = mma_backward_config(dims.d3, mma::DQ_ROWS);
    let aligned = row_vector(tensors, dtype) * dtype.size() == 16;
    fragment::unavailable(client, dtype, aligned).or((hw.max_units_per_cube
        < mma::PLANES * fragment::PLANE
        || hw.max_shared_memory_size
            < mma::dq_shared_bytes(c).max(mma::dkv_shared_bytes(mma::dkv_config(c))))
    .then_some(MatrixUnitsUnavailable::Resources))
}
