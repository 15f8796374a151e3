//! Host heuristic: which row scheme, vector size and cube shape a softmax launch uses.
//!
//! The plan depends only on the shape, the strides, the element size and a few device
//! properties, so it costs nothing at run time and there is no first-call pause: no autotuning.

use cubecl::{CubeCount, CubeDim, features::Plane, prelude::*};

use super::{SoftmaxError, SoftmaxOptions, SoftmaxTier};
use crate::reduce::GroupShape;
use crate::softmax::kernel::{RowConfig, SoftmaxVariant};

/// Bytes of one row that one unit keeps in registers in the register tiers. 128 B is 32 f32
/// registers: with 1024 units per cube that is half of an NVIDIA SM's 64 K registers, which
/// leaves room for the kernel's own and avoids spills. So one cube holds rows of up to 128 KiB
/// (32 768 f32, 65 536 f16); longer rows take the split scheme.
const ROW_BYTES_PER_UNIT: usize = 128;
/// Most units a cube uses in the register tiers (NVIDIA's and most Vulkan drivers' limit).
const MAX_UNITS_PER_CUBE: u32 = 1024;
/// Units per cube in the plane tier: 8 warps, several rows per cube, enough for the SM's
/// scheduler to hide load latency with short rows.
const PLANE_TIER_UNITS: u32 = 256;
/// 16-bit forward rows that fit [`KEPT_EXP_UNITS`] units of [`KEPT_EXP_VECTORS`] vectors each
/// take the cube tier that way rather than on the fewest units (8 vectors each), so that each
/// unit keeps its exponentials in registers ([`RowConfig::cache_exp`]). Longer rows keep the
/// fewest units: spread this way they were slower (RESULTS.md, softmax).
const KEPT_EXP_VECTORS: usize = 4;
/// See [`KEPT_EXP_VECTORS`].
const KEPT_EXP_UNITS: usize = 128;
/// Units per cube of the split scheme's chunk. 256 units × 128 B = 32 KiB of row per cube: a
/// 2^20 f32 row is 32 chunks, enough cubes to fill the GPU even for a single row.
const SPLIT_UNITS: u32 = 256;
/// Units per cube of the strided scheme (one unit per row).
const STRIDED_UNITS: u32 = 256;
/// Longest row the strided scheme takes. Its units loop over the row twice, and on lavapipe
/// (Mesa 22, wgpu 0.10's Vulkan path) a unit's loops stopped after ~65 536 iterations in all,
/// silently leaving the rest of the row unwritten (rows of 40 000 went wrong from element
/// 25 528); 16 384 keeps a 2× margin. Longer non-contiguous rows must be relaid out first.
pub const STRIDED_MAX_LEN: usize = 16384;
/// Group width used to lay out rows when the runtime has no plane operations (the reduction
/// then goes through shared memory, whatever this width).
const VIRTUAL_PLANE: u32 = 32;

/// The launch a softmax call will make (forward or backward), as chosen by
/// [`plan_softmax`](super::plan_softmax).
#[derive(Debug, Clone)]
pub struct SoftmaxPlan {
    /// Row scheme.
    pub tier: SoftmaxTier,
    /// Elements per vector load/store.
    pub vector_size: usize,
    /// Comptime configuration of the row kernels (unused by the strided tier but for `variant`).
    pub config: RowConfig,
    /// Rows (product of every dimension but the softmax one).
    pub num_rows: usize,
    /// Length of a row.
    pub row_len: usize,
    /// The row stride of each tensor of the launch, in elements, in the order of the planned
    /// layouts, where every tensor's leading dimensions collapse into one stride
    /// ([`RowConfig::flat_rows`]); empty otherwise.
    pub row_strides: Vec<usize>,
    /// Chunks per row (split tier only; 1 otherwise).
    pub num_chunks: usize,
    /// Units per cube.
    pub cube_dim: CubeDim,
    /// Cubes launched (one dimension's count spread over two when over the device limit).
    pub cube_count: CubeCount,
}

/// Bytes of a row one unit of the chunked tiers (split, exchange) holds for `dtype`: 64 for
/// 16-bit types. Their vectors widen to f32 for the arithmetic, so at 128 B a unit holds more
/// registers than f32's and fewer cubes fit a multiprocessor.
fn chunk_unit_bytes(dtype: StorageType) -> usize {
    if dtype.size() == 2 {
        ROW_BYTES_PER_UNIT / 2
    } else {
        ROW_BYTES_PER_UNIT
    }
}

/// Whether a 1024-unit cube holding [`ROW_BYTES_PER_UNIT`] each spills registers for `dtype`
/// (bf16 does; f16 does not). Such rows take the chunked tiers instead.
fn full_cube_spills(dtype: StorageType) -> bool {
    use cubecl::ir::{ElemType, FloatKind};
    matches!(dtype, StorageType::Scalar(ElemType::Float(FloatKind::BF16)))
}

/// Whether the exchange forward reads its chunk again for the write pass
/// ([`RowConfig::reread`]) for `dtype`: bf16, whose kernel holds more registers than f16's for
/// the same instructions, so fewer cubes fit a multiprocessor; the second read (an L2 hit)
/// frees them. f16 has the registers to spare and would only pay for the extra read.
fn exchange_rereads(dtype: StorageType) -> bool {
    full_cube_spills(dtype)
}

/// Device facts the heuristic needs (read from the client's properties, a field access: no
/// cache needed).
#[derive(Debug, Clone)]
pub(crate) struct DeviceFacts {
    plane_size: Option<u32>,
    max_units: u32,
    max_cube_count: (u32, u32, u32),
    /// Largest of `io_optimized_vector_sizes`, which are it and its halvings down to 1.
    max_vector_size: usize,
    /// Bytes of a row one unit of the chunked tiers holds ([`chunk_unit_bytes`]).
    chunk_unit_bytes: usize,
    /// Most units of a cube-tier cube ([`full_cube_spills`] halves it).
    cube_units: u32,
    /// The exchange forward re-reads its chunk ([`exchange_rereads`]).
    exchange_reread: bool,
    /// Most chunks per row the exchange tier may use: the streaming multiprocessors (each
    /// holds at least one cube of the tier at once), on CUDA only; `None` elsewhere.
    exchange_chunks: Option<usize>,
    /// The approximate exponential ([`RowConfig::fast_exp`]): 16-bit types on CUDA. Elsewhere
    /// the accurate one: f32 results keep their few-ulp accuracy, and other compilers may read
    /// the fast-math modes' "no inf" as leave to drop the −inf handling.
    fast_exp: bool,
}

impl DeviceFacts {
    pub(crate) fn new<R: Runtime>(
        client: &ComputeClient<R>,
        dtype: StorageType,
        options: &SoftmaxOptions,
    ) -> Result<Self, SoftmaxError> {
        let elem_size = dtype.size();
        let props = client.properties();
        let hw = &props.hardware;
        let has_planes = props.features.plane.contains(Plane::Ops);
        let fixed_plane =
            hw.plane_size_min == hw.plane_size_max && hw.plane_size_max.is_power_of_two();
        // Plane operations are used when the runtime advertises them and the plane width is fixed
        // (the butterfly's lane masks depend on it). `plane_ops` forces the choice either way;
        // forcing them on still needs a fixed width.
        if options.plane_ops == Some(true) && !fixed_plane {
            return Err(SoftmaxError::PlaneOpsUnavailable {
                min: hw.plane_size_min,
                max: hw.plane_size_max,
            });
        }
        let use_planes = options.plane_ops.unwrap_or(has_planes) && fixed_plane;
        Ok(Self {
            plane_size: use_planes.then_some(hw.plane_size_max),
            max_units: hw.max_units_per_cube.min(MAX_UNITS_PER_CUBE),
            chunk_unit_bytes: chunk_unit_bytes(dtype),
            cube_units: {
                let units = hw.max_units_per_cube.min(MAX_UNITS_PER_CUBE);
                if full_cube_spills(dtype) && units > 512 {
                    units / 2
                } else {
                    units
                }
            },
            max_cube_count: hw.max_cube_count,
            max_vector_size: client
                .io_optimized_vector_sizes(elem_size)
                .next()
                .unwrap_or(1),
            // The exchange needs cubes that make progress while others spin: CUDA's scheduler
            // gives that; Vulkan/Metal/WebGPU do not promise it (lavapipe runs workgroups on a
            // small thread pool).
            fast_exp: R::name(client) == "cuda" && elem_size == 2,
            exchange_reread: exchange_rereads(dtype),
            exchange_chunks: (R::name(client) == "cuda")
                .then_some(hw.num_streaming_multiprocessors)
                .flatten()
                .map(|sms| sms as usize),
        })
    }

    pub(crate) fn row_limits(&self, elem_size: usize) -> super::RowLimits {
        let per_unit = (ROW_BYTES_PER_UNIT / elem_size).max(1);
        let plane = self.plane_size.unwrap_or(VIRTUAL_PLANE) as usize * per_unit;
        let cube = self.cube_units as usize * per_unit;
        super::RowLimits {
            plane,
            cube,
            backward_plane: plane / 2,
            backward_cube: cube / 2,
        }
    }
}

/// Metadata of one tensor taking part in a launch, already permuted so that the softmax
/// dimension is last.
pub(crate) struct Layout<'a> {
    pub shape: &'a [usize],
    pub strides: &'a [usize],
}

/// Chooses the launch for rows of `layouts[0].shape` (softmax dim last) over all `layouts`
/// (every tensor the kernel touches: they share the shape, not necessarily the strides).
pub(crate) fn plan(
    facts: &DeviceFacts,
    layouts: &[Layout<'_>],
    elem_size: usize,
    variant: SoftmaxVariant,
    options: &SoftmaxOptions,
) -> Result<SoftmaxPlan, SoftmaxError> {
    let shape = layouts[0].shape;
    let rank = shape.len();
    let row_len = shape[rank - 1];
    let num_rows: usize = shape[..rank - 1].iter().product();
    let contiguous_rows = row_len == 1 || layouts.iter().all(|l| l.strides[rank - 1] == 1);

    // `io_optimized_vector_sizes`: the largest, then its halvings down to 1.
    let mut vector_sizes =
        core::iter::successors(Some(facts.max_vector_size), |&v| (v > 1).then_some(v / 2));
    let vector_size = if contiguous_rows {
        vector_sizes
            .find(|&v| {
                row_len.is_multiple_of(v)
                    && layouts.iter().all(|l| {
                        (0..rank - 1).all(|d| l.shape[d] == 1 || l.strides[d].is_multiple_of(v))
                    })
            })
            .unwrap_or(1)
    } else {
        1
    };
    let n_vec = row_len / vector_size;
    let plane = facts.plane_size.unwrap_or(VIRTUAL_PLANE);
    // The backward holds two tensors of the row (y and dy): half the vectors each.
    let held = if layouts.len() > 2 { 2 } else { 1 };
    let max_k = (ROW_BYTES_PER_UNIT / (held * vector_size * elem_size)).max(1);
    let chunk_k = (facts.chunk_unit_bytes / (held * vector_size * elem_size)).max(1);
    let cube_max_vec = facts.cube_units as usize * max_k;

    let split_units = SPLIT_UNITS.min(facts.max_units);
    let split_chunks = n_vec.div_ceil(split_units as usize * chunk_k);
    let exchange_ok = facts.exchange_chunks.is_some_and(|c| split_chunks <= c);
    let auto = if !contiguous_rows {
        SoftmaxTier::Strided
    } else if n_vec <= plane as usize * max_k {
        SoftmaxTier::Plane
    } else if n_vec <= cube_max_vec {
        SoftmaxTier::Cube
    } else if exchange_ok {
        SoftmaxTier::Exchange
    } else {
        SoftmaxTier::Split
    };
    let tier = options.tier.unwrap_or(auto);
    let unavailable = |reason: &'static str| SoftmaxError::TierUnavailable {
        tier,
        row_len,
        reason,
    };
    if tier != SoftmaxTier::Strided && !contiguous_rows {
        return Err(unavailable(
            "the softmax dimension is not contiguous in every tensor",
        ));
    }
    if tier == SoftmaxTier::Strided && row_len > STRIDED_MAX_LEN {
        return Err(unavailable(
            "the strided scheme takes rows of at most 16384 elements; make the softmax \
             dimension contiguous first",
        ));
    }

    if tier == SoftmaxTier::Exchange && !exchange_ok {
        return Err(unavailable(if facts.exchange_chunks.is_none() {
            "the exchange scheme runs on CUDA only (cubes must make progress while others wait)"
        } else {
            "the row has more chunks than the device has streaming multiprocessors"
        }));
    }
    let plane_size = facts.plane_size.unwrap_or(0);
    let (units_per_row, rows_per_cube, k) = match tier {
        SoftmaxTier::Plane => {
            if n_vec > plane as usize * max_k {
                return Err(unavailable("the row does not fit in one plane's registers"));
            }
            let x = (n_vec.next_power_of_two() as u32).min(plane);
            let y = (PLANE_TIER_UNITS / x).clamp(1, facts.max_units / x);
            (x, y, n_vec.div_ceil(x as usize).max(1))
        }
        SoftmaxTier::Cube => {
            if n_vec > cube_max_vec {
                return Err(unavailable("the row does not fit in one cube's registers"));
            }
            let kept = held == 1
                && elem_size == 2
                && KEPT_EXP_VECTORS <= max_k
                && n_vec.div_ceil(KEPT_EXP_VECTORS) <= KEPT_EXP_UNITS;
            let per_unit = match options.unit_vectors {
                None if kept => KEPT_EXP_VECTORS,
                None => max_k,
                Some(k) if (1..=max_k).contains(&k) => k,
                Some(_) => {
                    return Err(unavailable(
                        "unit_vectors must be from 1 to the vectors of 128 B of row",
                    ));
                }
            };
            let x = (n_vec.div_ceil(per_unit).next_power_of_two() as u32)
                .max(plane)
                .min(facts.cube_units);
            (x, 1, n_vec.div_ceil(x as usize).max(1))
        }
        SoftmaxTier::Split | SoftmaxTier::Exchange => (split_units, 1, chunk_k),
        SoftmaxTier::Strided => (STRIDED_UNITS.min(facts.max_units), 1, 1),
    };
    // Kept exponentials: 32 f32 registers at most, forward (two tensors) register tiers of
    // softmax and quiet softmax, cubes of at most 512 units (1024-unit cubes have 64 registers
    // a unit, which the row's own share already fills).
    let cache_exp = layouts.len() == 2
        && matches!(tier, SoftmaxTier::Plane | SoftmaxTier::Cube)
        && variant != SoftmaxVariant::LogSoftmax
        && k * vector_size <= 32
        && units_per_row * rows_per_cube <= 512;
    let row_strides: Option<Vec<usize>> = layouts
        .iter()
        .map(|l| rows_stride(&l.shape[..rank - 1], &l.strides[..rank - 1]))
        .collect();
    let config = RowConfig {
        variant,
        fast_exp: facts.fast_exp,
        cache_exp,
        reread: tier == SoftmaxTier::Exchange && layouts.len() == 2 && facts.exchange_reread,
        flat_rows: row_strides.is_some() && tier != SoftmaxTier::Strided,
        group: GroupShape {
            units_per_row,
            rows_per_cube,
            plane_size,
        },
        vectors_per_unit: k as u32,
    };
    let (num_chunks, cubes) = match tier {
        SoftmaxTier::Plane => (1, num_rows.div_ceil(rows_per_cube as usize)),
        SoftmaxTier::Cube => (1, num_rows),
        SoftmaxTier::Split | SoftmaxTier::Exchange => (split_chunks, num_rows * split_chunks),
        SoftmaxTier::Strided => (1, num_rows.div_ceil(units_per_row as usize)),
    };
    Ok(SoftmaxPlan {
        tier,
        vector_size: if tier == SoftmaxTier::Strided {
            1
        } else {
            vector_size
        },
        config,
        num_rows,
        row_len,
        row_strides: row_strides.unwrap_or_default(),
        num_chunks,
        cube_dim: CubeDim::new_2d(units_per_row, rows_per_cube),
        cube_count: spread_cube_count(cubes, facts.max_cube_count)?,
    })
}

/// The one stride between consecutive rows of a tensor whose rows enumerate the indices of
/// `shape` (last dimension fastest), or `None` where the dimensions do not collapse into one:
/// each dimension longer than 1 must step over the whole of the next longer-than-1 one inside
/// it. Dimensions of length 1 take no part; with none left (one row) the stride is 0.
pub(crate) fn rows_stride(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let mut inner: Option<(usize, usize)> = None; // (row stride, span of the dims so far)
    for (&size, &stride) in shape.iter().zip(strides).rev() {
        if size == 1 {
            continue;
        }
        inner = match inner {
            None => Some((stride, stride * size)),
            Some((row, span)) if stride == span => Some((row, span * size)),
            Some(_) => return None,
        };
    }
    Some(inner.map_or(0, |(row, _)| row))
}

/// A linear count of cubes as a 2-D grid within the device's per-dimension limits. Kernels read
/// the linear `CUBE_POS` and ignore cubes past the end.
fn spread_cube_count(cubes: usize, max: (u32, u32, u32)) -> Result<CubeCount, SoftmaxError> {
    let max_x = max.0 as usize;
    if cubes <= max_x {
        return Ok(CubeCount::Static(cubes.max(1) as u32, 1, 1));
    }
    let y = cubes.div_ceil(max_x);
    if y > max.1 as usize {
        return Err(SoftmaxError::TooLarge { cubes });
    }
    let x = cubes.div_ceil(y);
    Ok(CubeCount::Static(x as u32, y as u32, 1))
}
