//! Fused row softmax, log-softmax and quiet softmax, forward and backward.
//!
//! Host entry points: [`launch_softmax`] and [`launch_softmax_backward`]. Each validates its
//! arguments, plans the launch as [`plan_softmax`] would (reusing the permuted layouts for the
//! launch itself), and runs one kernel (two for rows too long for one cube). Outputs are
//! allocated by the caller with any strides.

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod kernel;
mod plan;

use core::fmt;

use cubecl::{
    prelude::*,
    server::Handle,
    zspace::{Shape, Strides},
};

pub use crate::tensor::{TensorRef, check_dtype};

pub use kernel::SoftmaxVariant;
pub use plan::{STRIDED_MAX_LEN, SoftmaxPlan};

use plan::{DeviceFacts, Layout};

/// Row scheme of a launch. [`SoftmaxOptions::tier`] forces one (tests do, to cover each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SoftmaxTier {
    /// Short rows: one plane (or part of one) per row, several rows per cube, row in registers.
    Plane,
    /// Medium rows: one cube per row, row in registers.
    Cube,
    /// Long rows: chunks of a row on several cubes; per-chunk `(m, l)` merged by a second kernel.
    Split,
    /// Long rows on CUDA: the chunks of [`Split`](Self::Split) in one kernel, each held in
    /// registers while the cubes of a row exchange their `(m, l)` (backward: partial sums)
    /// through global atomics, so every element is read once. Needs a runtime whose cubes make
    /// progress while others wait (CUDA) and at most one chunk per streaming multiprocessor.
    Exchange,
    /// Softmax dimension not contiguous: one unit per row, neighbouring units on neighbouring
    /// rows.
    Strided,
}

/// Overrides of the host heuristic. The default (`None` everywhere) is what users want.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SoftmaxOptions {
    /// Force a row scheme; an impossible choice is an error, not a fallback.
    pub tier: Option<SoftmaxTier>,
    /// Force plane (warp) operations on or off. On needs a runtime with a fixed plane width
    /// (lavapipe has one, though cubecl does not advertise plane operations there).
    pub plane_ops: Option<bool>,
    /// Vectors of a row each unit of the cube tier holds (the default: as many as 128 B of row
    /// allows, on the fewest units). Fewer vectors spread a row over more units, up to the
    /// cube's limit; from 1 to the 128 B limit, anything else is an error.
    pub unit_vectors: Option<usize>,
}

/// Why a softmax launch was refused. Nothing is launched when one is returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SoftmaxError {
    /// `dim` is not a dimension of the tensor.
    InvalidDim {
        /// The dimension asked for.
        dim: usize,
        /// The tensor's rank.
        rank: usize,
    },
    /// A tensor does not have the shape of the input.
    ShapeMismatch {
        /// Which argument.
        arg: &'static str,
        /// The input's shape.
        expected: Vec<usize>,
        /// The argument's shape.
        got: Vec<usize>,
    },
    /// The element type is not f32, f16 or bf16, or the device cannot run it.
    UnsupportedDType {
        /// The element type, as cubecl names it.
        dtype: String,
    },
    /// A forced [`SoftmaxTier`] cannot run this shape.
    TierUnavailable {
        /// The forced tier.
        tier: SoftmaxTier,
        /// Length of the softmax dimension.
        row_len: usize,
        /// Why not.
        reason: &'static str,
    },
    /// Plane operations were forced on, but this runtime's plane width is not fixed.
    PlaneOpsUnavailable {
        /// Smallest plane width the runtime reports.
        min: u32,
        /// Largest plane width the runtime reports.
        max: u32,
    },
    /// More cubes than the device can launch.
    TooLarge {
        /// Cubes the launch would need.
        cubes: usize,
    },
}

impl fmt::Display for SoftmaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidDim { dim, rank } => {
                write!(f, "dim {dim} is out of range for a tensor of rank {rank}")
            }
            Self::ShapeMismatch { arg, expected, got } => {
                crate::tensor::write_shape_mismatch(f, arg, expected, got)
            }
            Self::UnsupportedDType { dtype } => crate::tensor::write_unsupported_dtype(f, dtype),
            Self::TierUnavailable {
                tier,
                row_len,
                reason,
            } => write!(
                f,
                "tier {tier:?} cannot run rows of length {row_len}: {reason}"
            ),
            Self::PlaneOpsUnavailable { min, max } => write!(
                f,
                "plane operations were forced on, but the plane width varies from {min} to {max}"
            ),
            Self::TooLarge { cubes } => {
                write!(
                    f,
                    "the launch needs {cubes} cubes, more than the device allows"
                )
            }
        }
    }
}

impl core::error::Error for SoftmaxError {}

impl From<crate::tensor::UnsupportedDType> for SoftmaxError {
    fn from(e: crate::tensor::UnsupportedDType) -> Self {
        Self::UnsupportedDType { dtype: e.dtype }
    }
}

/// Permutation that moves `dim` last and orders the other dimensions by decreasing stride of
/// `reference`, so that consecutive rows are as close in memory as the layout allows.
fn row_major_permutation(strides: &[usize], dim: usize) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..strides.len()).filter(|&d| d != dim).collect();
    perm.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    perm.push(dim);
    perm
}

/// One tensor's metadata with its dimensions reordered as the kernels index them (inline for
/// ranks up to 5: no allocation).
struct Permuted {
    shape: Shape,
    strides: Strides,
}

impl Permuted {
    fn new(shape: &[usize], strides: &[usize], perm: &[usize]) -> Self {
        Self {
            shape: perm.iter().map(|&d| shape[d]).collect(),
            strides: perm.iter().map(|&d| strides[d]).collect(),
        }
    }

    fn layout(&self) -> Layout<'_> {
        Layout {
            shape: &self.shape,
            strides: &self.strides,
        }
    }

    fn arg<R: Runtime>(&self, handle: &Handle) -> TensorArg<R> {
        // SAFETY: shape and strides describe the buffer as the caller's TensorRef did, only
        // with the dimensions reordered.
        unsafe {
            TensorArg::from_raw_parts(handle.clone(), self.strides.clone(), self.shape.clone())
        }
    }
}

/// The tensors of one launch (same shape, any strides), permuted by
/// [`row_major_permutation`] of the first one's strides.
fn permute_all<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    dim: usize,
) -> [Permuted; N] {
    let perm = row_major_permutation(strides[0], dim);
    strides.map(|s| Permuted::new(shape, s, &perm))
}

fn check_dim(dim: usize, rank: usize) -> Result<(), SoftmaxError> {
    if dim >= rank {
        return Err(SoftmaxError::InvalidDim { dim, rank });
    }
    Ok(())
}

/// The plan for tensors already permuted (softmax dimension last).
fn plan_layouts<R: Runtime>(
    client: &ComputeClient<R>,
    layouts: &[Layout<'_>],
    dtype: StorageType,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> Result<SoftmaxPlan, SoftmaxError> {
    check_dtype(client, dtype)?;
    let facts = DeviceFacts::new(client, dtype, &options)?;
    plan::plan(&facts, layouts, dtype.size(), variant, &options)
}

fn check_same_shape(
    arg: &'static str,
    reference: &[usize],
    t: &TensorRef<'_>,
) -> Result<(), SoftmaxError> {
    if t.shape != reference || t.strides.len() != reference.len() {
        return Err(SoftmaxError::ShapeMismatch {
            arg,
            expected: reference.to_vec(),
            got: t.shape.to_vec(),
        });
    }
    Ok(())
}

/// The plan a launch over tensors of `shape` with the given `strides` (one entry per tensor the
/// kernel touches: input and output, or `y`, `dy` and `dx`) would use, without launching.
pub fn plan_softmax<R: Runtime>(
    client: &ComputeClient<R>,
    shape: &[usize],
    strides: &[&[usize]],
    dim: usize,
    dtype: StorageType,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> Result<SoftmaxPlan, SoftmaxError> {
    check_dim(dim, shape.len())?;
    let perm = row_major_permutation(strides[0], dim);
    let permuted: Vec<Permuted> = strides
        .iter()
        .map(|s| Permuted::new(shape, s, &perm))
        .collect();
    let layouts: Vec<Layout<'_>> = permuted.iter().map(Permuted::layout).collect();
    plan_layouts(client, &layouts, dtype, variant, options)
}

/// Longest rows each register tier takes on this device for this element type (the same for
/// every vector size): forward rows up to `plane` elements go to [`SoftmaxTier::Plane`], up to
/// `cube` to [`SoftmaxTier::Cube`], longer ones to [`SoftmaxTier::Exchange`] on CUDA (up to one
/// chunk per streaming multiprocessor) or [`SoftmaxTier::Split`]. The backward holds
/// two tensors of the row, so its limits are half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLimits {
    /// Longest forward row of the plane tier.
    pub plane: usize,
    /// Longest forward row of the cube tier.
    pub cube: usize,
    /// Longest backward row of the plane tier.
    pub backward_plane: usize,
    /// Longest backward row of the cube tier.
    pub backward_cube: usize,
}

/// The [`RowLimits`] of this device for `dtype`.
pub fn row_limits<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    options: SoftmaxOptions,
) -> Result<RowLimits, SoftmaxError> {
    check_dtype(client, dtype)?;
    Ok(DeviceFacts::new(client, dtype, &options)?.row_limits(dtype.size()))
}

/// `output = softmax(input)` along `dim` (or its log / quiet variant).
///
/// `output` must have the input's shape; its strides are free. Returns the plan that ran (or
/// `None` for an empty tensor, where nothing runs).
pub fn launch_softmax<R: Runtime>(
    client: &ComputeClient<R>,
    input: TensorRef<'_>,
    output: TensorRef<'_>,
    dim: usize,
    dtype: StorageType,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> Result<Option<SoftmaxPlan>, SoftmaxError> {
    crate::cache::ensure_linked();
    check_same_shape("output", input.shape, &output)?;
    check_dim(dim, input.shape.len())?;
    let [x, y] = permute_all(input.shape, [input.strides, output.strides], dim);
    let plan = plan_layouts(client, &[x.layout(), y.layout()], dtype, variant, options)?;
    if input.shape.contains(&0) {
        return Ok(None);
    }
    let neg_inf = f32::NEG_INFINITY;
    let (count, cube_dim, v) = (plan.cube_count.clone(), plan.cube_dim, plan.vector_size);
    let (rows, chunks, cfg) = (plan.num_rows, plan.num_chunks, plan.config);
    // SAFETY (all launches): every index is bounds-checked in the kernels against the shapes
    // passed here, which describe the caller's buffers.
    unsafe {
        match plan.tier {
            SoftmaxTier::Plane | SoftmaxTier::Cube => kernel::softmax_rows::launch_unchecked::<R>(
                client,
                count,
                cube_dim,
                v,
                x.arg(input.handle),
                y.arg(output.handle),
                row_starts(&plan),
                rows,
                neg_inf,
                cfg,
                dtype,
            ),
            SoftmaxTier::Split => {
                let partial_max = client.empty(rows * chunks * 4);
                let partial_sum = client.empty(rows * chunks * 4);
                kernel::softmax_split_partials::launch_unchecked::<R>(
                    client,
                    count.clone(),
                    cube_dim,
                    v,
                    x.arg(input.handle),
                    ArrayArg::from_raw_parts(partial_max.clone(), rows * chunks),
                    ArrayArg::from_raw_parts(partial_sum.clone(), rows * chunks),
                    row_starts(&plan),
                    rows,
                    chunks,
                    neg_inf,
                    cfg,
                    dtype,
                );
                kernel::softmax_split_finish::launch_unchecked::<R>(
                    client,
                    count,
                    cube_dim,
                    v,
                    x.arg(input.handle),
                    y.arg(output.handle),
                    ArrayArg::from_raw_parts(partial_max, rows * chunks),
                    ArrayArg::from_raw_parts(partial_sum, rows * chunks),
                    row_starts(&plan),
                    rows,
                    chunks,
                    neg_inf,
                    cfg,
                    dtype,
                );
            }
            SoftmaxTier::Exchange => {
                let words = 1 + 2 * rows * chunks;
                let exchange = crate::copy::zeroed_u32::<R>(client, words);
                kernel::softmax_split_exchange::launch_unchecked::<R>(
                    client,
                    count,
                    cube_dim,
                    v,
                    x.arg(input.handle),
                    y.arg(output.handle),
                    ArrayArg::from_raw_parts(exchange, words),
                    row_starts(&plan),
                    rows,
                    chunks,
                    neg_inf,
                    cfg,
                    dtype,
                );
            }
            SoftmaxTier::Strided => kernel::softmax_strided::launch_unchecked::<R>(
                client,
                count,
                cube_dim,
                x.arg(input.handle),
                y.arg(output.handle),
                rows,
                neg_inf,
                cfg.variant,
                dtype,
            ),
        }
    }
    Ok(Some(plan))
}

/// `dx` from the forward output `y` and the output gradient `dy`, along `dim`:
/// softmax and quiet softmax `dx = y ⊙ (dy − Σ dy ⊙ y)`; log-softmax `dx = dy − e^y ⊙ Σ dy`.
pub fn launch_softmax_backward<R: Runtime>(
    client: &ComputeClient<R>,
    y: TensorRef<'_>,
    dy: TensorRef<'_>,
    dx: TensorRef<'_>,
    dim: usize,
    dtype: StorageType,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> Result<Option<SoftmaxPlan>, SoftmaxError> {
    crate::cache::ensure_linked();
    check_same_shape("grad", y.shape, &dy)?;
    check_same_shape("output", y.shape, &dx)?;
    check_dim(dim, y.shape.len())?;
    let [py, pdy, pdx] = permute_all(y.shape, [y.strides, dy.strides, dx.strides], dim);
    let layouts = [py.layout(), pdy.layout(), pdx.layout()];
    let plan = plan_layouts(client, &layouts, dtype, variant, options)?;
    if y.shape.contains(&0) {
        return Ok(None);
    }
    let (count, cube_dim, v) = (plan.cube_count.clone(), plan.cube_dim, plan.vector_size);
    let (rows, chunks, cfg) = (plan.num_rows, plan.num_chunks, plan.config);
    // SAFETY: as in `launch_softmax`.
    unsafe {
        match plan.tier {
            SoftmaxTier::Plane | SoftmaxTier::Cube => {
                kernel::softmax_backward_rows::launch_unchecked::<R>(
                    client,
                    count,
                    cube_dim,
                    v,
                    py.arg(y.handle),
                    pdy.arg(dy.handle),
                    pdx.arg(dx.handle),
                    row_starts(&plan),
                    rows,
                    cfg,
                    dtype,
                )
            }
            SoftmaxTier::Exchange => {
                let words = 1 + rows * chunks;
                let exchange = crate::copy::zeroed_u32::<R>(client, words);
                kernel::softmax_backward_split_exchange::launch_unchecked::<R>(
                    client,
                    count,
                    cube_dim,
                    v,
                    py.arg(y.handle),
                    pdy.arg(dy.handle),
                    pdx.arg(dx.handle),
                    ArrayArg::from_raw_parts(exchange, words),
                    row_starts(&plan),
                    rows,
                    chunks,
                    cfg,
                    dtype,
                );
            }
            SoftmaxTier::Split => {
                let partial_sum = client.empty(rows * chunks * 4);
                kernel::softmax_backward_split_partials::launch_unchecked::<R>(
                    client,
                    count.clone(),
                    cube_dim,
                    v,
                    py.arg(y.handle),
                    pdy.arg(dy.handle),
                    ArrayArg::from_raw_parts(partial_sum.clone(), rows * chunks),
                    row_starts(&plan),
                    rows,
                    chunks,
                    cfg,
                    dtype,
                );
                kernel::softmax_backward_split_finish::launch_unchecked::<R>(
                    client,
                    count,
                    cube_dim,
                    v,
                    py.arg(y.handle),
                    pdy.arg(dy.handle),
                    pdx.arg(dx.handle),
                    ArrayArg::from_raw_parts(partial_sum, rows * chunks),
                    row_starts(&plan),
                    rows,
                    chunks,
                    cfg,
                    dtype,
                );
            }
            SoftmaxTier::Strided => kernel::softmax_backward_strided::launch_unchecked::<R>(
                client,
                count,
                cube_dim,
                py.arg(y.handle),
                pdy.arg(dy.handle),
                pdx.arg(dx.handle),
                rows,
                cfg.variant,
                dtype,
            ),
        }
    }
    Ok(Some(plan))
}

/// The [`kernel::RowStarts`] of a launch of `plan`: the row length in vectors and, with flat
/// rows, the row strides of the plan's tensors (0 past the plan's last), all in elements.
fn row_starts<R: Runtime>(plan: &SoftmaxPlan) -> kernel::RowStartsLaunch<R> {
    let v = plan.vector_size.max(1);
    let mut strides = plan.row_strides.iter().copied();
    let mut next = || strides.next().unwrap_or(0);
    kernel::RowStartsLaunch::new(plan.row_len / v, next(), next(), next())
}
