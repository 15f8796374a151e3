//! The softmax family's backward kernels, one per forward row scheme (`*_rows`,
//! `*_split_partials` + `*_split_finish`, `*_split_exchange`, `*_strided`):
//! - softmax and quiet softmax: `dx = y ⊙ (dy − Σ dy ⊙ y)`;
//! - log-softmax: `dx = dy − e^y ⊙ Σ dy`.
//!
//! Quiet softmax has the same Jacobian form `diag(y) − y yᵀ` as softmax (its rows just do not sum
//! to 1), hence the same formula.

use super::*;

/// The per-element term whose row sum the backward needs.
#[cube]
pub(super) fn backward_term<F: Float, N: Size>(
    y: Vector<F, N>,
    dy: Vector<F, N>,
    #[comptime] variant: SoftmaxVariant,
) -> Vector<f32, N> {
    let dyf = Vector::<f32, N>::cast_from(dy);
    match variant {
        SoftmaxVariant::LogSoftmax => dyf,
        _ => dyf * Vector::<f32, N>::cast_from(y),
    }
}

#[cube]
pub(super) fn backward_apply<F: Float, N: Size>(
    y: Vector<F, N>,
    dy: Vector<F, N>,
    s: f32,
    #[comptime] variant: SoftmaxVariant,
) -> Vector<F, N> {
    let yf = Vector::<f32, N>::cast_from(y);
    let dyf = Vector::<f32, N>::cast_from(dy);
    let mut s = s;
    if comptime!(crate::mutation::drop_delta()) {
        s = 0.0f32;
    }
    let mut g = match variant {
        SoftmaxVariant::LogSoftmax => dyf - Vector::exp(yf) * Vector::new(s),
        _ => yf * (dyf - Vector::new(s)),
    };
    if comptime!(crate::mutation::zero_dx()) {
        g = Vector::new(0.0f32);
    }
    Vector::cast_from(g)
}

/// Backward, whole row in registers: two reads and one write per element.
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_backward_rows<F: Float, N: Size>(
    y: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    starts: RowStarts,
    num_rows: usize,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let (row, active) = cube_row(num_rows, cfg.group);
    let n_vec = starts.vectors;
    let y_base = row_start(y, row, starts.first, cfg.flat_rows);
    let dy_base = row_start(dy, row, starts.second, cfg.flat_rows);
    let dx_base = row_start(dx, row, starts.third, cfg.flat_rows);
    let mut smem = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));

    let mut regs_y = Array::<Vector<F, N>>::new(comptime!(k_count as usize));
    let mut regs_dy = Array::<Vector<F, N>>::new(comptime!(k_count as usize));
    let mut local = 0.0f32;
    #[unroll]
    for k in 0..k_count {
        let j = (UNIT_POS_X + k * x) as usize;
        let mut vy = Vector::<F, N>::new(F::new(0.0));
        let mut vdy = Vector::<F, N>::new(F::new(0.0));
        if active && j < n_vec {
            vy = y[y_base + j];
            vdy = dy[dy_base + j];
        }
        regs_y[k as usize] = vy;
        regs_dy[k as usize] = vdy;
        local = vector_sum(local, backward_term(vy, vdy, cfg.variant));
    }
    let s = group_reduce(local, &mut smem, false, cfg.group);
    #[unroll]
    for k in 0..k_count {
        let j = (UNIT_POS_X + k * x) as usize;
        if active && j < n_vec {
            dx[dx_base + j] =
                backward_apply(regs_y[k as usize], regs_dy[k as usize], s, cfg.variant);
        }
    }
}

/// Backward, split rows, first pass: each chunk's share of the row sum.
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_backward_split_partials<F: Float, N: Size>(
    y: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    partial_sum: &mut Array<f32>,
    starts: RowStarts,
    num_rows: usize,
    num_chunks: usize,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let (row, _, chunk_start) = split_chunk(CUBE_POS, num_rows, num_chunks, cfg);
    let n_vec = starts.vectors;
    let y_base = row_start(y, row, starts.first, cfg.flat_rows);
    let dy_base = row_start(dy, row, starts.second, cfg.flat_rows);
    let mut smem = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));

    let mut local = 0.0f32;
    #[unroll]
    for k in 0..k_count {
        let j = chunk_start + (UNIT_POS_X + k * x) as usize;
        if j < n_vec {
            local = vector_sum(
                local,
                backward_term(y[y_base + j], dy[dy_base + j], cfg.variant),
            );
        }
    }
    let s = group_reduce(local, &mut smem, false, cfg.group);
    if UNIT_POS == 0 {
        partial_sum[CUBE_POS] = s;
    }
}

/// Backward, split rows, second pass: add the row's partial sums and write this chunk of `dx`.
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_backward_split_finish<F: Float, N: Size>(
    y: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    partial_sum: &Array<f32>,
    starts: RowStarts,
    num_rows: usize,
    num_chunks: usize,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let (row, _, chunk_start) = split_chunk(CUBE_POS, num_rows, num_chunks, cfg);
    let n_vec = starts.vectors;
    let y_base = row_start(y, row, starts.first, cfg.flat_rows);
    let dy_base = row_start(dy, row, starts.second, cfg.flat_rows);
    let dx_base = row_start(dx, row, starts.third, cfg.flat_rows);
    let mut smem = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));

    let mut local = 0.0f32;
    let mut p = UNIT_POS_X as usize;
    while p < num_chunks {
        local += partial_sum[row * num_chunks + p];
        p += x as usize;
    }
    let s = group_reduce(local, &mut smem, false, cfg.group);
    #[unroll]
    for k in 0..k_count {
        let j = chunk_start + (UNIT_POS_X + k * x) as usize;
        if j < n_vec {
            dx[dx_base + j] = backward_apply(y[y_base + j], dy[dy_base + j], s, cfg.variant);
        }
    }
}

/// Backward, split rows in one pass (CUDA): each cube holds its chunk of `y` and `dy` in
/// registers, publishes the chunk's `Σ dy⊙y` (`Σ dy` for log-softmax), waits for the row's
/// other chunks and writes its chunk of `dx` from registers: `y` and `dy` read once, where the
/// two-kernel split reads them twice. `exchange` and the ticket protocol are those of
/// [`softmax_split_exchange()`]'s, with one word per (row, chunk).
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_backward_split_exchange<F: Float, N: Size>(
    y: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    exchange: &mut Array<Atomic<u32>>,
    starts: RowStarts,
    num_rows: usize,
    num_chunks: usize,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let (row, chunk, chunk_start) = split_chunk(draw_ticket(exchange), num_rows, num_chunks, cfg);
    let n_vec = starts.vectors;
    let y_base = row_start(y, row, starts.first, cfg.flat_rows);
    let dy_base = row_start(dy, row, starts.second, cfg.flat_rows);
    let dx_base = row_start(dx, row, starts.third, cfg.flat_rows);
    let mut smem_chunk = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));
    let mut smem_row = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));

    let mut y_regs = Array::<Vector<F, N>>::new(comptime!(k_count as usize));
    let mut dy_regs = Array::<Vector<F, N>>::new(comptime!(k_count as usize));
    let mut local = 0.0f32;
    #[unroll]
    for k in 0..k_count {
        let j = chunk_start + (UNIT_POS_X + k * x) as usize;
        let mut yv = Vector::<F, N>::new(F::from_int(0));
        let mut dyv = Vector::<F, N>::new(F::from_int(0));
        if j < n_vec {
            yv = y[y_base + j];
            dyv = dy[dy_base + j];
        }
        y_regs[k as usize] = yv;
        dy_regs[k as usize] = dyv;
        local = vector_sum(local, backward_term(yv, dyv, cfg.variant));
    }
    let chunk_sum = group_reduce(local, &mut smem_chunk, false, cfg.group);
    let words = 1 + row * num_chunks;
    if UNIT_POS == 0 {
        publish(exchange, words + chunk, chunk_sum);
    }

    let mut total = 0.0f32;
    let mut p = UNIT_POS_X as usize;
    while p < num_chunks {
        total += published(exchange, words + p);
        p += x as usize;
    }
    let s = group_reduce(total, &mut smem_row, false, cfg.group);
    #[unroll]
    for k in 0..k_count {
        let j = chunk_start + (UNIT_POS_X + k * x) as usize;
        if j < n_vec {
            dx[dx_base + j] =
                backward_apply(y_regs[k as usize], dy_regs[k as usize], s, cfg.variant);
        }
    }
}

/// Backward for a non-contiguous softmax dimension: one unit per row.
#[cube(launch_unchecked)]
pub fn softmax_backward_strided<F: Float>(
    y: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    num_rows: usize,
    #[comptime] variant: SoftmaxVariant,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS;
    if row >= num_rows {
        terminate!();
    }
    let dim = y.rank() - 1;
    let n = y.shape(dim);
    let (sy, sdy, sdx) = (y.stride(dim), dy.stride(dim), dx.stride(dim));
    let y_base = row_offset(y, row, dim);
    let dy_base = row_offset(dy, row, dim);
    let dx_base = row_offset(dx, row, dim);
    let mut s = 0.0f32;
    for j in 0..n {
        let vdy = f32::cast_from(dy[dy_base + j * sdy]);
        s += match variant {
            SoftmaxVariant::LogSoftmax => vdy,
            _ => vdy * f32::cast_from(y[y_base + j * sy]),
        };
    }
    if comptime!(crate::mutation::drop_delta()) {
        s = 0.0f32;
    }
    for j in 0..n {
        let vy = f32::cast_from(y[y_base + j * sy]);
        let vdy = f32::cast_from(dy[dy_base + j * sdy]);
        let mut g = match variant {
            SoftmaxVariant::LogSoftmax => vdy - f32::exp(vy) * s,
            _ => vy * (vdy - s),
        };
        if comptime!(crate::mutation::zero_dx()) {
            g = 0.0f32;
        }
        dx[dx_base + j * sdx] = F::cast_from(g);
    }
}
