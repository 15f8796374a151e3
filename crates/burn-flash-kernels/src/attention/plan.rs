//! The forward's plan: which kernel runs a call, with which tile ([`plan_attention`], the
//! host heuristic; no autotuning), and the tiles of each kernel path.

use cubecl::prelude::*;

use super::options::{
    AttentionDims, AttentionError, AttentionFeatures, AttentionKernel, AttentionOptions,
    AttentionPlan, validate,
};
use crate::flash::forward::{cmma, hopper, mma, tiled, units};
use crate::flash::{FlashConfig, ScoreSource, Tile};
use crate::fragment::{self, MatrixUnitsUnavailable};

/// Why the Hopper forward cannot run this call on `client`'s device (`None`: it can).
fn hopper_unavailable<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> Option<String> {
    options
        .hopper
        .switched_off()
        .or_else(|| hopper::unavailable(sm90(client), dims, dtype, features))
}

/// Whether `client` is a CUDA client of a Hopper GPU (sm_90).
pub(crate) fn sm90<R: Runtime>(client: &ComputeClient<R>) -> bool {
    #[cfg(feature = "cuda")]
    return crate::hopper::with_cuda_client!(client, |cuda| crate::hopper::sm90(cuda))
        .unwrap_or(false);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = client;
        false
    }
}

/// The launch for `dims`, without launching.
///
/// Heuristic (no autotuning): the matrix units for f16/bf16 where the device has `mma`,
/// `ldmatrix` and `cp.async` and the rows are aligned ([`mma_tile`]); cooperative matrices
/// where it has no manual `mma` but offers a `cmma` fragment for the dtype ([`cmma_tile`]),
/// and for f32 with [`AttentionOptions::tf32`] where it offers TF32 fragments (CUDA sm_80+);
/// plain units otherwise:
/// the register-tiled kernel for outputs of at least 65 × 65 (`G·Sq` rows, `Dv` columns)
/// where it fits and no dropout is asked for, else [`units_tile`].
pub fn plan_attention<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> Result<AttentionPlan, AttentionError> {
    validate(client, dims, dtype, options)?;
    let (head_dim, value_dim) = (dims.head_dim, dims.value_dim);
    let matrix_units = fragment::unavailable(client, dtype, features.aligned);
    let decode = match options.kernel {
        Some(AttentionKernel::SplitDecode) => true,
        None => decode_preferred(dims, features, options),
        Some(_) => false,
    };
    if decode {
        let plan = crate::decode::plan_decode(client, dims, dtype, features, options)?;
        return Ok(AttentionPlan {
            kernel: AttentionKernel::SplitDecode,
            config: plan.config,
            units: crate::decode::kernel::UNITS,
            shared_bytes: crate::decode::shared_bytes(client, &plan),
            cubes: plan.cubes,
            matrix_units,
        });
    }
    let rules = options.rules(features);
    let unavailable = |kernel, reason: String| AttentionError::KernelUnavailable { kernel, reason };
    let tf32 = options.tf32_for(dtype);
    let coop = cmma::fragment(client, dtype, tf32);
    let tiled_config = FlashConfig::new(ScoreSource::QueryKey, rules, tiled::tile(head_dim));
    let hopper_reason = hopper_unavailable(client, dims, dtype, features, options);
    let kernel = match (options.kernel, matrix_units) {
        (Some(AttentionKernel::Hopper), _) if hopper_reason.is_some() => {
            return Err(unavailable(
                AttentionKernel::Hopper,
                hopper_reason.unwrap_or_default(),
            ));
        }
        (Some(AttentionKernel::Tiled), _) if options.dropout.is_some() => {
            return Err(unavailable(
                AttentionKernel::Tiled,
                "dropout runs on the matrix-unit and plain-unit kernels only".into(),
            ));
        }
        (Some(AttentionKernel::MatrixUnits), Some(why)) => {
            return Err(unavailable(AttentionKernel::MatrixUnits, why.to_string()));
        }
        (Some(AttentionKernel::CooperativeMatrix), _) if coop.is_none() => {
            return Err(unavailable(
                AttentionKernel::CooperativeMatrix,
                format!(
                    "this device offers no cooperative matrix for {dtype:?} with f32 accumulators"
                ),
            ));
        }
        (Some(kernel), _) => kernel,
        (None, None) if hopper_reason.is_none() && hopper::preferred(features, options.hopper) => {
            AttentionKernel::Hopper
        }
        (None, None) => AttentionKernel::MatrixUnits,
        (None, Some(MatrixUnitsUnavailable::NoMma { .. })) if coop.is_some() => {
            AttentionKernel::CooperativeMatrix
        }
        // f32 with TF32 allowed, where the device has the fragment.
        (None, Some(_)) if tf32 && coop.is_some() => AttentionKernel::CooperativeMatrix,
        (None, Some(_))
            if options.dropout.is_none()
                && dims.group() * dims.seq_q > 64
                && value_dim > 64
                && tiled::fits(client, tiled_config) =>
        {
            AttentionKernel::Tiled
        }
        (None, Some(_)) => AttentionKernel::Units,
    };
    let max_shared = client.properties().hardware.max_shared_memory_size;
    let config = match kernel {
        AttentionKernel::MatrixUnits => FlashConfig::new(
            ScoreSource::QueryKey,
            rules,
            mma_tile(head_dim, value_dim, options.block_k)?,
        ),
        AttentionKernel::Hopper => {
            let tile = hopper::tile(dims);
            fixed_block_k(options.block_k, tile.block_k, "the Hopper kernel")?;
            FlashConfig::new(ScoreSource::QueryKey, rules, tile)
        }
        AttentionKernel::CooperativeMatrix => {
            let f = coop.expect("checked above");
            let config = FlashConfig::new(
                ScoreSource::QueryKey,
                rules,
                cmma_tile(head_dim, value_dim, f, options.block_k)?,
            )
            .with_tf32(tf32);
            if !cmma::fits(config, f) {
                return Err(AttentionError::InvalidOption {
                    reason: format!(
                        "block_k {} on cooperative matrices of {f:?}: a multiple of {}",
                        config.block_k,
                        (4 * f.lanes_per_row()).max(f.n).max(f.k)
                    ),
                });
            }
            config
        }
        AttentionKernel::Tiled => {
            fixed_block_k(options.block_k, tiled::BLOCK_K, "the tiled kernel")?;
            tiled_config
        }
        AttentionKernel::SplitDecode => unreachable!("the decoding kernel is planned above"),
        AttentionKernel::Units => {
            fixed_block_k(options.block_k, units::BLOCK_K, "plain units")?;
            FlashConfig::new(
                ScoreSource::QueryKey,
                rules,
                units_tile(head_dim, value_dim),
            )
        }
    };
    // Keys per step on the matrix units fall to 16 where shared memory is short.
    let config = match kernel {
        AttentionKernel::MatrixUnits
            if options.block_k.is_none() && mma::shared_bytes(config) > max_shared =>
        {
            FlashConfig {
                block_k: 16,
                ..config
            }
        }
        // Rows per cube fall to 64, then keys per step to 16, where shared memory is short.
        AttentionKernel::CooperativeMatrix
            if coop.is_some_and(|f| cmma::shared_bytes(config, f) > max_shared) =>
        {
            let f = coop.expect("checked above");
            let narrow = FlashConfig {
                block_q: cmma::BLOCK_Q,
                ..config
            };
            match options.block_k {
                None if cmma::shared_bytes(narrow, f) > max_shared => FlashConfig {
                    block_k: 16,
                    ..narrow
                },
                _ => narrow,
            }
        }
        _ => config,
    };
    let (units, shared_bytes) = match kernel {
        AttentionKernel::MatrixUnits => (mma::units(config), mma::shared_bytes(config)),
        AttentionKernel::CooperativeMatrix => coop.map_or((0, 0), |f| {
            (f.units(config.block_q), cmma::shared_bytes(config, f))
        }),
        AttentionKernel::Tiled => (
            tiled::UNITS,
            tiled::shared_bytes(config, tiled::planes(client)),
        ),
        AttentionKernel::Units => (units::UNITS, units::shared_bytes(config)),
        AttentionKernel::Hopper => (
            hopper::units(config),
            hopper::shared_bytes(config, hopper::bias_tiles(config, features)),
        ),
        AttentionKernel::SplitDecode => unreachable!("the decoding kernel is planned above"),
    };
    let hw = &client.properties().hardware;
    if units > hw.max_units_per_cube || shared_bytes > max_shared {
        return Err(unavailable(
            kernel,
            format!(
                "needs {units} units and {shared_bytes} B of shared memory per cube; the device has {} and {max_shared}",
                hw.max_units_per_cube
            ),
        ));
    }
    let unfolded = (
        value_dim.div_ceil(config.value_dim as usize).max(1),
        (dims.group() * dims.seq_q)
            .div_ceil(config.block_q as usize)
            .max(1),
        (dims.batch * dims.heads_kv).max(1),
    );
    let cubes = if kernel == AttentionKernel::Hopper {
        // Blocks over the tiles of `block_q` query rows of each (query head, batch): one per
        // tile, or persistent ones taking them in rounds.
        let sms = hw.num_streaming_multiprocessors.unwrap_or(1) as usize;
        let tiles = hopper::tiles(dims, config);
        (hopper::blocks(tiles, sms, options.schedule), 1, 1)
    } else {
        crate::flash::block::fold_grid(unfolded.0, unfolded.1, unfolded.2, hw.max_cube_count)
            .ok_or(AttentionError::TooLarge { cubes: unfolded })?
    };
    Ok(AttentionPlan {
        kernel,
        config,
        units,
        shared_bytes,
        cubes,
        matrix_units,
    })
}

/// Whether the plan takes the decoding kernel unasked: few query rows per key/value head
/// (`G·Sq` ≤ [`crate::decode::DECODE_ROWS`]), which the other kernels' row blocks of 64–192
/// would mostly leave empty, against at least one split's worth of keys
/// ([`crate::decode::MIN_SPLIT_KEYS`]), and a call it takes.
fn decode_preferred(
    dims: AttentionDims,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> bool {
    dims.group() * dims.seq_q <= crate::decode::DECODE_ROWS
        && dims.seq_k >= crate::decode::MIN_SPLIT_KEYS
        && crate::decode::unavailable(features, options).is_none()
}

/// The matrix-unit forward's tile for head dims `D`, `Dv`: two row tiles per plane (128 rows
/// per cube) while the accumulators fit the registers (`Dv ≤ 128`); 64 keys per step up to
/// `D = 64`, 32 beyond, or the forced `block_k` (a multiple of 16 up to 128).
pub fn mma_tile(
    head_dim: usize,
    value_dim: usize,
    block_k: Option<usize>,
) -> Result<Tile, AttentionError> {
    let d = head_dim.next_multiple_of(16) as u32;
    let dv = value_dim.next_multiple_of(16) as u32;
    let row_tiles = if dv <= 128 { 2 } else { 1 };
    let block_k = match block_k {
        None => {
            if d.max(dv) <= 64 {
                64
            } else {
                32
            }
        }
        Some(bk) if bk > 0 && bk.is_multiple_of(16) && bk <= 128 => bk as u32,
        Some(bk) => {
            return Err(AttentionError::InvalidOption {
                reason: format!("block_k {bk} on the matrix units: a multiple of 16 up to 128"),
            });
        }
    };
    Ok(Tile {
        block_q: 64 * row_tiles,
        row_tiles,
        block_k,
        head_dim: d,
        value_dim: dv,
    })
}

/// The cooperative-matrix forward's tile on fragment `f`: [`cmma::WIDE_BLOCK_Q`] rows (eight
/// planes of 16-row fragments share each `K`/`V` block; the plan falls back to
/// [`cmma::BLOCK_Q`] where shared memory is short), [`cmma::BLOCK_K`] keys per step or the
/// forced `block_k` (a multiple of 16 up to 128), `D` and `Dv` rounded up to the fragment.
pub fn cmma_tile(
    head_dim: usize,
    value_dim: usize,
    f: cmma::Fragment,
    block_k: Option<usize>,
) -> Result<Tile, AttentionError> {
    let block_k = match block_k {
        None => cmma::BLOCK_K,
        Some(bk) if bk > 0 && bk.is_multiple_of(16) && bk <= 128 => bk as u32,
        Some(bk) => {
            return Err(AttentionError::InvalidOption {
                reason: format!("block_k {bk} on cooperative matrices: a multiple of 16 up to 128"),
            });
        }
    };
    Ok(Tile {
        block_q: cmma::WIDE_BLOCK_Q,
        row_tiles: 1,
        block_k,
        head_dim: head_dim.next_multiple_of(f.k as usize) as u32,
        value_dim: value_dim.next_multiple_of(f.n as usize) as u32,
    })
}

/// The plain-unit forward's tile: [`units::BLOCK_Q`] rows, [`units::BLOCK_K`] keys per step,
/// `D` and `Dv` rounded up to its chunks.
pub fn units_tile(head_dim: usize, value_dim: usize) -> Tile {
    Tile {
        block_q: units::BLOCK_Q,
        row_tiles: 1,
        block_k: units::BLOCK_K,
        head_dim: head_dim.next_multiple_of(units::D_CHUNK as usize) as u32,
        value_dim: value_dim.next_multiple_of(units::V_CHUNK as usize) as u32,
    }
}

/// A forced `block_k` on a kernel whose keys per step are fixed at `fixed`: only that.
fn fixed_block_k(block_k: Option<usize>, fixed: u32, kernel: &str) -> Result<(), AttentionError> {
    match block_k {
        Some(bk) if bk != fixed as usize => Err(AttentionError::InvalidOption {
            reason: format!("block_k {bk} on {kernel}: it takes {fixed} keys per step"),
        }),
        _ => Ok(()),
    }
}
