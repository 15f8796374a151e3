//! Layer normalisation of rows in one kernel: `y = (x − mean) / √(var + ε) · γ + β` over the
//! last dimension, with the mean and the (biased) variance taken in f32 in two passes over the
//! row (the centred squares, not `E[x²] − E[x]²`), then one pass writing `y`.
//!
//! Burn 0.21 composes its layer norm from two mean reductions and four element-wise ops, which
//! Fusion runs as about five kernels; a host-bound decoding step pays for each launch, and a
//! transformer layer has two norms. Here a cube holds `rows_per_cube` rows of `units_per_row`
//! units each ([`GroupShape`]); the units of a row stride over its columns, and the row's sums
//! are [`group_reduce()`]s (plane shuffles where the device has a fixed plane, else shared
//! memory).

use cubecl::prelude::*;

use crate::reduce::{GroupShape, group_reduce, row_offset};
use crate::tensor::{TensorRef, UnsupportedDType, check_dtype};

/// Units per cube of [`layer_norm_rows()`].
pub const UNITS: u32 = 256;

/// Two f32 passes over each row: streams, four cubes per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(4);

/// Normalises each row of `x` (its last dimension, any strides) into `out` (module docs).
/// Grid: one cube per `rows_per_cube` rows, linear over `(x, y)`.
#[cube(launch_unchecked)]
pub fn layer_norm_rows<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    out: &mut Tensor<F>,
    epsilon: f32,
    #[comptime] shape: GroupShape,
    #[comptime] has_beta: bool,
    #[define(F)] _dtype: StorageType,
) {
    let rank = x.rank();
    let last = rank - 1;
    let width = x.shape(last);
    let rows = x.len() / width;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let row = cube * comptime!(shape.rows_per_cube as usize) + UNIT_POS_Y as usize;
    let per_row = comptime!(shape.units_per_row as usize);
    // One buffer per reduction: a unit that has read the first result may write its second
    // partial while another still reads the first.
    let mut smem_mean = SharedMemory::<f32>::new(comptime!(shape.shared_len()));
    let mut smem_var = SharedMemory::<f32>::new(comptime!(shape.shared_len()));
    // Rows past the end read row 0 and write nothing: every unit takes part in the reductions.
    let valid = row < rows;
    let r = select(valid, row, 0usize);
    let at = row_offset(x, r, last);
    let sx = x.stride(last);
    let mut sum = 0.0f32;
    let mut col = UNIT_POS_X as usize;
    while col < width {
        sum += f32::cast_from(x[at + col * sx]);
        col += per_row;
    }
    let mean = group_reduce(sum, &mut smem_mean, false, shape) / f32::cast_from(width);
    let mut squares = 0.0f32;
    col = UNIT_POS_X as usize;
    while col < width {
        let c = f32::cast_from(x[at + col * sx]) - mean;
        squares += c * c;
        col += per_row;
    }
    let mut n = width;
    if comptime!(crate::mutation::biased_norm()) {
        n = width - 1;
    }
    let var = group_reduce(squares, &mut smem_var, false, shape) / f32::cast_from(n);
    let inv = 1.0f32 / f32::sqrt(var + epsilon);
    if valid {
        let to = row_offset(out, r, last);
        let so = out.stride(last);
        col = UNIT_POS_X as usize;
        while col < width {
            let mut y = (f32::cast_from(x[at + col * sx]) - mean) * inv;
            y *= f32::cast_from(gamma[col * gamma.stride(0)]);
            if comptime!(has_beta) {
                y += f32::cast_from(beta[col * beta.stride(0)]);
            }
            out[to + col * so] = F::cast_from(y);
            col += per_row;
        }
    }
}

/// The tensors of [`launch_layer_norm`]: `x` `[…, d]` (any strides), `gamma` and `beta` `[d]`,
/// `out` shaped as `x`.
#[derive(Debug, Clone, Copy)]
pub struct LayerNormTensors<'a> {
    /// Rows to normalise.
    pub x: TensorRef<'a>,
    /// Scale.
    pub gamma: TensorRef<'a>,
    /// Shift, where the norm has one.
    pub beta: Option<TensorRef<'a>>,
    /// The output.
    pub out: TensorRef<'a>,
}

/// Why [`launch_layer_norm`] refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerNormError {
    /// `x` has no dimension, or `gamma`, `beta` or `out` does not match it.
    Shape(String),
    /// The dtype is not a float type the device runs.
    UnsupportedDType(UnsupportedDType),
}

impl core::fmt::Display for LayerNormError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            LayerNormError::Shape(why) => write!(f, "{why}"),
            LayerNormError::UnsupportedDType(e) => write!(f, "{e}"),
        }
    }
}

impl core::error::Error for LayerNormError {}

/// The row layout for rows of `width` elements: units per row a power of two from 8 (about one
/// per 8 elements, at most [`UNITS`]), the rest of the cube's units on more rows; plane
/// reductions where the device has one fixed plane size of at least the units per row.
pub fn layer_norm_shape<R: Runtime>(client: &ComputeClient<R>, width: usize) -> GroupShape {
    let per_row = width
        .div_ceil(8)
        .next_power_of_two()
        .clamp(8, UNITS as usize) as u32;
    let hw = &client.properties().hardware;
    let planes = client
        .properties()
        .features
        .plane
        .contains(cubecl::features::Plane::Ops)
        && hw.plane_size_min == hw.plane_size_max
        && hw.plane_size_max.is_power_of_two();
    GroupShape {
        units_per_row: per_row,
        rows_per_cube: UNITS / per_row,
        plane_size: if planes { hw.plane_size_max } else { 0 },
    }
}

/// Launches [`layer_norm_rows()`] over every row of `t.x` into `t.out`.
pub fn launch_layer_norm<R: Runtime>(
    client: &ComputeClient<R>,
    t: LayerNormTensors<'_>,
    epsilon: f64,
    dtype: StorageType,
) -> Result<(), LayerNormError> {
    crate::cache::ensure_linked();
    check_dtype(client, dtype).map_err(LayerNormError::UnsupportedDType)?;
    let Some(&width) = t.x.shape.last() else {
        return Err(LayerNormError::Shape("`x` has no dimension".into()));
    };
    for (name, p) in [("gamma", Some(&t.gamma)), ("beta", t.beta.as_ref())] {
        if let Some(p) = p
            && p.shape != [width]
        {
            return Err(LayerNormError::Shape(format!(
                "`{name}` has shape {:?}, expected [{width}]",
                p.shape
            )));
        }
    }
    if t.out.shape != t.x.shape {
        return Err(LayerNormError::Shape(format!(
            "`out` has shape {:?}, `x` {:?}",
            t.out.shape, t.x.shape
        )));
    }
    let rows: usize = t.x.shape.iter().product::<usize>() / width.max(1);
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let shape = layer_norm_shape(client, width);
    let cubes = rows.div_ceil(shape.rows_per_cube as usize);
    let max_x = client.properties().hardware.max_cube_count.0 as usize;
    let y = cubes.div_ceil(max_x);
    let arg = |t: &TensorRef<'_>| {
        // SAFETY: the shape and strides describe the caller's buffer.
        unsafe { TensorArg::from_raw_parts(t.handle.clone(), t.strides.into(), t.shape.into()) }
    };
    // SAFETY: the shapes were checked above; each unit reads columns below the row's width of
    // rows below the row count and writes only the rows it reads.
    unsafe {
        layer_norm_rows::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes.div_ceil(y) as u32, y as u32, 1),
            CubeDim::new_2d(shape.units_per_row, shape.rows_per_cube),
            arg(&t.x),
            arg(&t.gamma),
            arg(&t.beta.unwrap_or(t.gamma)),
            arg(&t.out),
            epsilon as f32,
            shape,
            t.beta.is_some(),
            dtype,
        );
    }
    Ok(())
}
