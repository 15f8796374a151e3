//! `y = x·W + b` for a few rows of `x` (a decoding step's projections): [`linear_rows()`].
//!
//! With one to a few rows, a matrix product is a pass over the weight: every element of `W`
//! `[K, N]` is read once and used for each of the few rows, so the kernel is about reading `W`
//! at the memory's rate. Burn 0.21's matmul tiles such a call as if it had many rows (a
//! `[1, 512]·[512, 2048]` bf16 product measured 183 µs on an H200 against ~1 µs for reading its
//! 2 MiB). Here a cube of [`UNITS`] units covers [`COLUMN_LANES`] vectors of output columns
//! side by side, so that one row of `W` is read as one contiguous run, and [`K_LANES`] lanes
//! of the reduction dimension, each unit taking every `K_LANES`-th row of `W` with
//! [`UNROLL`] loads in flight; the lanes' partial sums meet in shared memory, one output row
//! at a time. Rows of `x` are read as scalars (a few, broadcast through the cache); the
//! accumulators are f32.

use cubecl::prelude::*;

use crate::tensor::{TensorRef, UnsupportedDType, check_dtype};

/// Vectors of output columns per cube.
pub const COLUMN_LANES: u32 = 16;
/// Lanes of the reduction dimension per cube.
pub const K_LANES: u32 = 16;
/// Units per cube.
pub const UNITS: u32 = COLUMN_LANES * K_LANES;
/// Rows of `W` each unit loads before it uses them.
pub const UNROLL: usize = 4;
/// Most rows of `x` a cube takes (more rows: more cubes along `y`).
pub const ROWS_PER_CUBE: usize = 4;
/// Most rows of `x` the kernel is planned for: beyond, a tiled matmul reads `W` fewer times.
pub const MAX_ROWS: usize = 16;

/// A K-slice of the rows per lane (256 threads): two cubes per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(2);

/// `out[m, ·] = x[m, ·]·w + b` for the cube's rows and columns (module docs). Grid: one cube
/// per [`COLUMN_LANES`] column vectors (`x`) and `rows` rows (`y`); units `(COLUMN_LANES,
/// K_LANES)`.
#[cube(launch_unchecked)]
pub fn linear_rows<F: Float, NV: Size>(
    x: &Tensor<F>,
    w: &Tensor<Vector<F, NV>>,
    bias: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] rows: usize,
    #[comptime] has_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let nv = NV::value();
    let lane = UNIT_POS_X as usize;
    let kl = UNIT_POS_Y as usize;
    let lanes = comptime!(COLUMN_LANES as usize);
    let k_lanes = comptime!(K_LANES as usize);
    let (m, k_dim) = (x.shape(0), x.shape(1));
    let n = out.shape(1);
    let n_vecs = n / nv;
    let col = CUBE_POS_X as usize * lanes + lane;
    let c = usize::min(col, n_vecs - 1);
    let row0 = CUBE_POS_Y as usize * rows;

    let mut acc = Array::<f32>::new(comptime!(rows * nv));
    #[unroll]
    for i in 0..comptime!(rows * nv) {
        acc[i] = 0.0f32;
    }
    let mut lane_k = kl;
    if comptime!(crate::mutation::skip_k_lane()) && kl == k_lanes - 1 {
        lane_k = k_dim;
    }
    let step = comptime!(K_LANES as usize * UNROLL);
    let mut k0 = lane_k;
    while k0 < k_dim {
        // UNROLL rows of `W` in flight; rows past `K` read row `K − 1` and count 0.
        let mut wv = Array::<Vector<F, NV>>::new(UNROLL);
        let mut on = Array::<f32>::new(UNROLL);
        #[unroll]
        for u in 0..UNROLL {
            let k = k0 + u * k_lanes;
            on[u] = select(k < k_dim, 1.0f32, 0.0f32);
            let at = usize::min(k, k_dim - 1) * w.stride(0) + c * nv * w.stride(1);
            wv[u] = w[at / nv];
        }
        #[unroll]
        for r in 0..rows {
            let row = usize::min(row0 + r, m - 1);
            #[unroll]
            for u in 0..UNROLL {
                let k = usize::min(k0 + u * k_lanes, k_dim - 1);
                let xv = f32::cast_from(x[row * x.stride(0) + k * x.stride(1)]) * on[u];
                #[unroll]
                for e in 0..nv {
                    acc[r * nv + e] += xv * f32::cast_from(wv[u][e]);
                }
            }
        }
        k0 += step;
    }

    // The K lanes' sums, one output row at a time: `nv · COLUMN_LANES` values per lane.
    let per_row = comptime!(nv * COLUMN_LANES as usize);
    let mut sums =
        SharedMemory::<f32>::new(comptime!(K_LANES as usize * nv * COLUMN_LANES as usize));
    let unit = UNIT_POS as usize;
    #[unroll]
    for r in 0..rows {
        #[unroll]
        for e in 0..nv {
            sums[(kl * nv + e) * lanes + lane] = acc[r * nv + e];
        }
        sync_cube();
        if unit < per_row {
            // Unit `e · COLUMN_LANES + l` sums element `e` of lane `l`'s vector.
            let l = unit % lanes;
            let e = unit / lanes;
            let mut total = 0.0f32;
            for j in 0..k_lanes {
                total += sums[(j * nv + e) * lanes + l];
            }
            let out_col = (CUBE_POS_X as usize * lanes + l) * nv + e;
            let row = row0 + r;
            if out_col < n && row < m {
                if comptime!(has_bias) {
                    total += f32::cast_from(bias[out_col * bias.stride(0)]);
                }
                out[row * out.stride(0) + out_col * out.stride(1)] = F::cast_from(total);
            }
        }
        sync_cube();
    }
}

/// The tensors of [`launch_linear_rows`]: `x` `[M, K]` (any strides), `w` `[K, N]` (unit last
/// stride where it is to be read in vectors), `bias` `[N]`, `out` `[M, N]`.
#[derive(Debug, Clone, Copy)]
pub struct LinearTensors<'a> {
    /// The rows.
    pub x: TensorRef<'a>,
    /// The weight.
    pub w: TensorRef<'a>,
    /// The bias, where the layer has one.
    pub bias: Option<TensorRef<'a>>,
    /// The output.
    pub out: TensorRef<'a>,
}

/// Why [`launch_linear_rows`] refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinearError {
    /// Shapes that do not match, or more than [`MAX_ROWS`] rows.
    Shape(String),
    /// The dtype is not a float type the device runs.
    UnsupportedDType(UnsupportedDType),
}

impl core::fmt::Display for LinearError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            LinearError::Shape(why) => write!(f, "{why}"),
            LinearError::UnsupportedDType(e) => write!(f, "{e}"),
        }
    }
}

impl core::error::Error for LinearError {}

/// The widest vector (16 bytes at most, one the device loads) that divides `N` and `w`'s row
/// stride, with `w`'s last stride 1; else 1 (any strides).
fn vector_width<R: Runtime>(client: &ComputeClient<R>, w: &TensorRef<'_>, elem: usize) -> usize {
    let sizes: Vec<usize> = client.io_optimized_vector_sizes(elem).collect();
    [8usize, 4, 2]
        .into_iter()
        .filter(|&v| v * elem <= 16 && sizes.contains(&v))
        .find(|&v| {
            w.strides[1] == 1 && w.shape[1].is_multiple_of(v) && w.strides[0].is_multiple_of(v)
        })
        .unwrap_or(1)
}

/// Launches [`linear_rows()`]: `t.out = t.x · t.w (+ t.bias)`, for at most [`MAX_ROWS`] rows.
pub fn launch_linear_rows<R: Runtime>(
    client: &ComputeClient<R>,
    t: LinearTensors<'_>,
    dtype: StorageType,
) -> Result<(), LinearError> {
    crate::cache::ensure_linked();
    check_dtype(client, dtype).map_err(LinearError::UnsupportedDType)?;
    let shape_err = |why: String| Err(LinearError::Shape(why));
    let ([m, k], [kw, n]) = match (t.x.shape, t.w.shape) {
        (&[m, k], &[kw, n]) => ([m, k], [kw, n]),
        _ => {
            return shape_err(format!(
                "`x` {:?} and `w` {:?} must be [M, K] and [K, N]",
                t.x.shape, t.w.shape
            ));
        }
    };
    if kw != k || t.out.shape != [m, n] || t.bias.is_some_and(|b| b.shape != [n]) {
        return shape_err(format!(
            "`x` {:?}, `w` {:?}, `bias` {:?}, `out` {:?}: expected [M, K], [K, N], [N], [M, N]",
            t.x.shape,
            t.w.shape,
            t.bias.map(|b| b.shape),
            t.out.shape
        ));
    }
    if m > MAX_ROWS {
        return shape_err(format!(
            "{m} rows, more than the {MAX_ROWS} the kernel takes"
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return shape_err("`K` is 0 (the output would be the bias alone)".into());
    }
    let vector = vector_width(client, &t.w, dtype.size());
    let rows = m.min(ROWS_PER_CUBE);
    let cubes_x = (n / vector).div_ceil(COLUMN_LANES as usize);
    let cubes_y = m.div_ceil(rows);
    let arg = |t: &TensorRef<'_>| {
        // SAFETY: the shape and strides describe the caller's buffer.
        unsafe { TensorArg::from_raw_parts(t.handle.clone(), t.strides.into(), t.shape.into()) }
    };
    // SAFETY: the shapes were checked above; every read is clamped inside `x`, `w` and `bias`,
    // and every write is an element of `out` below `[M, N]`; `vector` divides `N` and `w`'s
    // row stride, and `w`'s last stride is 1 where it is above 1.
    unsafe {
        linear_rows::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes_x as u32, cubes_y as u32, 1),
            CubeDim::new_2d(COLUMN_LANES, K_LANES),
            vector,
            arg(&t.x),
            arg(&t.w),
            arg(&t.bias.unwrap_or(t.out)),
            arg(&t.out),
            rows,
            t.bias.is_some(),
            dtype,
        );
    }
    Ok(())
}
