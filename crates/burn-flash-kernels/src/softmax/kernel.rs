//! Device code of the softmax family.
//!
//! Every kernel sees its tensors with the softmax dimension moved last (the host permutes the
//! metadata), so a "row" is one fibre along the last dimension and rows enumerate the remaining
//! indices. Values are stored in `F` and all arithmetic is in f32.
//!
//! Three row schemes, picked on the host (see `plan.rs`):
//! - `*_rows`: the whole row is held in registers by `units_per_row` units (one plane or one
//!   cube), so every element is read once and written once;
//! - `*_split_partials` + `*_split_finish`: rows too long for one cube are cut in chunks; the
//!   first kernel writes each chunk's `(m, l)`, the second merges them and normalises its chunk;
//! - `softmax_split_exchange`, `softmax_backward_split_exchange` (CUDA): the same chunks in one
//!   kernel, each held in registers while the cubes of a row exchange their `(m, l)` (backward:
//!   their partial sums) through global atomics: one read per element;
//! - `*_strided`: the softmax dimension is not contiguous; one unit per row, neighbouring units
//!   take neighbouring rows so that loads coalesce.

use cubecl::prelude::*;

use crate::reduce::{GroupShape, group_reduce, rebase, reference, row_offset};

mod backward;

pub use backward::*;

/// Member of the softmax family computed by a kernel (a comptime flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SoftmaxVariant {
    /// `y = e^x / Σ e^x`.
    Softmax,
    /// `y = x − ln Σ e^x`.
    LogSoftmax,
    /// `y = e^x / (1 + Σ e^x)`, as Burn's `quiet_softmax`.
    QuietSoftmax,
}

/// Comptime configuration of the row kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowConfig {
    /// Which softmax.
    pub variant: SoftmaxVariant,
    /// The hardware's approximate exponential and logarithm ([`exp_modes`]): 16-bit types on
    /// CUDA, whose rounding (2^-11 or 2^-8) is far above theirs.
    pub fast_exp: bool,
    /// The forward register tiers keep `e^(x − shift)` in f32 registers from the sum pass to
    /// the write pass instead of computing it again (softmax and quiet softmax, where the
    /// unit's share of the row is at most 32 elements and the cube has room for the registers).
    pub cache_exp: bool,
    /// The exchange forward ([`softmax_split_exchange()`]) reads its chunk again for the write
    /// pass (an L2 hit: the row's cubes wait on each other only briefly) instead of holding it
    /// in registers through the wait: bf16, whose widened values hold more registers than
    /// f16's for the same code (`plan::exchange_rereads`).
    pub reread: bool,
    /// Every tensor of the launch has its rows at one stride ([`RowStarts`]): a row starts at
    /// `row · stride`, without [`row_offset()`]'s metadata loads and per-dimension divisions.
    pub flat_rows: bool,
    /// Layout of units over rows and how they reduce.
    pub group: GroupShape,
    /// Vectors each unit holds in registers (per row, or per chunk for the split scheme).
    pub vectors_per_unit: u32,
}

/// The fast-math modes of a row kernel: with `fast`, the ones under which cubecl's CUDA
/// compiler emits `__expf` and `__logf` (`MUFU.EX2` and `MUFU.LG2` with a multiply, against
/// the accurate `expf`'s range reduction and polynomial, ~8 instructions) — none otherwise.
/// The kernels keep their −inf semantics: the hardware gives `e^(−inf) = 0`, `ln 0 = −inf`, and
/// NaN through both; cubecl's CUDA compiler uses these modes only to pick those functions
/// (division keeps its accurate form: it asks for `AllowReciprocal` too).
pub fn exp_modes(fast: bool) -> enumset::EnumSet<cubecl::ir::FastMath> {
    use cubecl::ir::FastMath;
    if fast {
        FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
    } else {
        enumset::EnumSet::empty()
    }
}

/// The shift subtracted before exponentiating, from the row maximum `m`.
///
/// If `m` is −inf every element was −inf (a fully masked row): `x − m` would be
/// `−inf − (−inf) = NaN`, so shift by 0 instead and let every exponential be 0. Quiet softmax
/// also never shifts below 0, so that its implicit extra term `e^0 = 1` stays representable.
#[cube]
fn softmax_shift(m: f32, neg_inf: f32, #[comptime] variant: SoftmaxVariant) -> f32 {
    let shift = reference(m, neg_inf);
    match variant {
        SoftmaxVariant::QuietSoftmax => f32::max(shift, 0.0f32),
        _ => shift,
    }
}

/// Turns the shifted sum `s = Σ e^(x − shift)` into the factor (or log-sum-exp) the output needs.
///
/// Softmax: `1/s`, or 0 for a fully masked row (`s = 0`). Quiet: `1/(e^−shift + s)`.
/// Log-softmax: `shift + ln s`, or +inf for a fully masked row so that its output is −inf.
#[cube]
fn softmax_norm(s: f32, shift: f32, neg_inf: f32, #[comptime] variant: SoftmaxVariant) -> f32 {
    match variant {
        SoftmaxVariant::Softmax => select(s == 0.0f32, 0.0f32, 1.0f32 / s),
        SoftmaxVariant::QuietSoftmax => 1.0f32 / (f32::exp(-shift) + s),
        SoftmaxVariant::LogSoftmax => select(s == 0.0f32, -neg_inf, shift + f32::ln(s)),
    }
}

/// One output vector from an input vector, given the row's shift and norm.
#[cube]
fn softmax_apply<F: Float, N: Size>(
    x: Vector<F, N>,
    shift: f32,
    norm: f32,
    #[comptime] variant: SoftmaxVariant,
) -> Vector<F, N> {
    match variant {
        SoftmaxVariant::LogSoftmax => {
            Vector::cast_from(Vector::<f32, N>::cast_from(x) - Vector::new(norm))
        }
        _ => Vector::cast_from(vector_exp(x, shift) * Vector::new(norm)),
    }
}

/// `e^(x − shift)` element-wise, in f32.
#[cube]
fn vector_exp<F: Float, N: Size>(x: Vector<F, N>, shift: f32) -> Vector<f32, N> {
    Vector::exp(Vector::<f32, N>::cast_from(x) - Vector::new(shift))
}

#[cube]
fn vector_max<F: Float, N: Size>(acc: f32, v: Vector<F, N>) -> f32 {
    let vf = Vector::<f32, N>::cast_from(v);
    let mut m = acc;
    #[unroll]
    for i in 0..N::value() {
        m = f32::max(m, vf[i]);
    }
    m
}

#[cube]
fn vector_exp_sum<F: Float, N: Size>(acc: f32, v: Vector<F, N>, shift: f32) -> f32 {
    vector_sum(acc, vector_exp(v, shift))
}

#[cube]
fn vector_sum<N: Size>(acc: f32, v: Vector<f32, N>) -> f32 {
    let mut s = acc;
    #[unroll]
    for i in 0..N::value() {
        s += v[i];
    }
    s
}

/// The row length and, with [`RowConfig::flat_rows`], the row strides of a launch's tensors,
/// in elements, in the order of the kernel's tensor arguments (unused ones are 0). Runtime
/// scalars: the kernel reads them from its parameters, not from the tensors' metadata in
/// global memory.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct RowStarts {
    /// Vectors per row.
    pub vectors: usize,
    /// Row stride of the first tensor, in elements: the kernels divide the start by the vector
    /// width (a shift), which tells the compiler that adding a unit's vector index cannot wrap,
    /// so that it addresses a unit's vectors from one base with immediate offsets (a stride in
    /// vectors made it compute an address per vector).
    pub first: usize,
    /// Row stride of the second tensor.
    pub second: usize,
    /// Row stride of the third tensor.
    pub third: usize,
}

/// First vector of `row` in `t`: `row · stride` for flat rows, else from `t`'s shape and
/// strides (the softmax dimension last).
#[cube]
fn row_start<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    row: usize,
    stride: usize,
    #[comptime] flat: bool,
) -> usize {
    if comptime!(flat) {
        row * stride / N::value()
    } else {
        row_offset(t, row, t.rank() - 1) / N::value()
    }
}

/// The element-wise maximum of `a` and `b`, in their own type (exact; two 16-bit lanes per
/// instruction on CUDA): the register tiers take each vector's maximum this way and convert
/// to f32 once per unit ([`vector_max`]) rather than once per element.
#[cube]
fn vector_max_in<F: Float, N: Size>(a: Vector<F, N>, b: Vector<F, N>) -> Vector<F, N> {
    max(a, b)
}

/// Index of the first row of this cube and whether the calling unit's row exists.
#[cube]
fn cube_row(num_rows: usize, #[comptime] group: GroupShape) -> (usize, bool) {
    let row = CUBE_POS * comptime!(group.rows_per_cube as usize) + UNIT_POS_Y as usize;
    let active = row < num_rows;
    (select(active, row, 0), active)
}

/// The register tiers (a row per plane or cube, up to 512 threads, 128 B of row a unit), forward
/// and backward: two cubes per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const ROWS_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(2);

/// Forward, whole row in registers: one read and one write per element.
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_rows<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    starts: RowStarts,
    num_rows: usize,
    neg_inf: f32,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let (row, active) = cube_row(num_rows, cfg.group);
    let n_vec = starts.vectors;
    let in_base = row_start(input, row, starts.first, cfg.flat_rows);
    let out_base = row_start(output, row, starts.second, cfg.flat_rows);
    let mut smem_max = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));
    let mut smem_sum = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));

    // -- load the row once, track the maximum --
    let mut regs = Array::<Vector<F, N>>::new(comptime!(k_count as usize));
    let mut vmax = Vector::<F, N>::new(F::cast_from(neg_inf));
    #[unroll]
    for k in 0..k_count {
        let j = (UNIT_POS_X + k * x) as usize;
        let mut v = Vector::<F, N>::new(F::cast_from(neg_inf));
        if active && j < n_vec {
            v = input[in_base + j];
        }
        regs[k as usize] = v;
        vmax = vector_max_in(vmax, v);
    }
    let m = group_reduce(vector_max(neg_inf, vmax), &mut smem_max, true, cfg.group);
    let shift = softmax_shift(m, neg_inf, cfg.variant);

    // -- l = Σ e^(x − shift) (kept, with `cache_exp`) --
    let mut local_sum = 0.0f32;
    let mut kept =
        Array::<Vector<f32, N>>::new(comptime!(if cfg.cache_exp { k_count as usize } else { 1 }));
    #[unroll]
    for k in 0..k_count {
        if comptime!(cfg.cache_exp) {
            let e = vector_exp(regs[k as usize], shift);
            kept[k as usize] = e;
            local_sum = vector_sum(local_sum, e);
        } else {
            local_sum = vector_exp_sum(local_sum, regs[k as usize], shift);
        }
    }
    let s = group_reduce(local_sum, &mut smem_sum, false, cfg.group);
    let norm = softmax_norm(s, shift, neg_inf, cfg.variant);

    // -- write once --
    #[unroll]
    for k in 0..k_count {
        let j = (UNIT_POS_X + k * x) as usize;
        if active && j < n_vec {
            if comptime!(cfg.cache_exp) {
                output[out_base + j] = Vector::cast_from(kept[k as usize] * Vector::new(norm));
            } else {
                output[out_base + j] = softmax_apply(regs[k as usize], shift, norm, cfg.variant);
            }
        }
    }
}

/// Merges the partial `(pm, pl)` into `(m, l)`, each sum relative to its [`reference()`]:
/// `M = max(m, pm)`, `L = l·e^(m − M) + pl·e^(pm − M)`, a −inf part adding nothing.
#[cube]
fn merge_partial(m: f32, l: f32, pm: f32, pl: f32, neg_inf: f32) -> (f32, f32) {
    let merged = f32::max(m, pm);
    let r = reference(merged, neg_inf);
    let mut own = rebase(m, l, r, neg_inf);
    if comptime!(crate::mutation::no_rescale()) {
        own = l;
    }
    (merged, own + rebase(pm, pl, r, neg_inf))
}

/// The row's shift and norm from every unit's merged `(m, l)`: the row maximum, then the
/// units' sums moved to the shift and summed.
#[cube]
fn row_norm(
    m: f32,
    l: f32,
    smem_max: &mut SharedMemory<f32>,
    smem_sum: &mut SharedMemory<f32>,
    neg_inf: f32,
    #[comptime] cfg: RowConfig,
) -> (f32, f32) {
    let row_max = group_reduce(m, smem_max, true, cfg.group);
    let shift = softmax_shift(row_max, neg_inf, cfg.variant);
    let s = group_reduce(rebase(m, l, shift, neg_inf), smem_sum, false, cfg.group);
    (shift, softmax_norm(s, shift, neg_inf, cfg.variant))
}

/// The row, the chunk and the chunk's first vector of `t = row · num_chunks + chunk` (a cube
/// position, or the exchange tiers' ticket); a cube past the last row stops here.
#[cube]
fn split_chunk(
    t: usize,
    num_rows: usize,
    num_chunks: usize,
    #[comptime] cfg: RowConfig,
) -> (usize, usize, usize) {
    let row = t / num_chunks;
    let chunk = t % num_chunks;
    if row >= num_rows {
        terminate!();
    }
    let chunk_vectors = comptime!((cfg.group.units_per_row * cfg.vectors_per_unit) as usize);
    (row, chunk, chunk * chunk_vectors)
}

/// Loads this unit's vectors of the chunk from `chunk_start` into `regs` (−inf past the row)
/// and returns the chunk's `(m, l)`: its maximum and `l = Σ e^(x − m)` (shifted by 0 if the
/// chunk is fully −inf).
#[cube]
fn chunk_partial<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    regs: &mut Array<Vector<F, N>>,
    in_base: usize,
    chunk_start: usize,
    n_vec: usize,
    smem_max: &mut SharedMemory<f32>,
    smem_sum: &mut SharedMemory<f32>,
    neg_inf: f32,
    #[comptime] cfg: RowConfig,
) -> (f32, f32) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let mut vmax = Vector::<F, N>::new(F::cast_from(neg_inf));
    #[unroll]
    for k in 0..k_count {
        let j = chunk_start + (UNIT_POS_X + k * x) as usize;
        let mut v = Vector::<F, N>::new(F::cast_from(neg_inf));
        if j < n_vec {
            v = input[in_base + j];
        }
        regs[k as usize] = v;
        vmax = vector_max_in(vmax, v);
    }
    let local_max = vector_max(neg_inf, vmax);
    let m = group_reduce(local_max, smem_max, true, cfg.group);
    let shift = reference(m, neg_inf);
    let mut local_sum = 0.0f32;
    #[unroll]
    for k in 0..k_count {
        local_sum = vector_exp_sum(local_sum, regs[k as usize], shift);
    }
    (m, group_reduce(local_sum, smem_sum, false, cfg.group))
}

/// The split, exchange and strided tiers stream, forward and backward: three cubes per SM
/// (the exchange tier holds 63 registers, at four cubes' edge).
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const STREAM_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(3);

/// Forward, split rows, first pass: each cube writes its chunk's `(m, l)` with
/// `l = Σ e^(x − m)` (shifted by 0 if the chunk is fully −inf).
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_split_partials<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    partial_max: &mut Array<f32>,
    partial_sum: &mut Array<f32>,
    starts: RowStarts,
    num_rows: usize,
    num_chunks: usize,
    neg_inf: f32,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let (row, _, chunk_start) = split_chunk(CUBE_POS, num_rows, num_chunks, cfg);
    let in_base = row_start(input, row, starts.first, cfg.flat_rows);
    let mut smem_max = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));
    let mut smem_sum = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));
    let mut regs = Array::<Vector<F, N>>::new(comptime!(cfg.vectors_per_unit as usize));
    let (m, l) = chunk_partial(
        input,
        &mut regs,
        in_base,
        chunk_start,
        starts.vectors,
        &mut smem_max,
        &mut smem_sum,
        neg_inf,
        cfg,
    );
    if UNIT_POS == 0 {
        partial_max[CUBE_POS] = m;
        partial_sum[CUBE_POS] = l;
    }
}

/// Forward, split rows, second pass: merge the row's partials and normalise this cube's chunk.
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_split_finish<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    partial_max: &Array<f32>,
    partial_sum: &Array<f32>,
    starts: RowStarts,
    num_rows: usize,
    num_chunks: usize,
    neg_inf: f32,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let (row, _, chunk_start) = split_chunk(CUBE_POS, num_rows, num_chunks, cfg);
    let n_vec = starts.vectors;
    let in_base = row_start(input, row, starts.first, cfg.flat_rows);
    let out_base = row_start(output, row, starts.second, cfg.flat_rows);
    let mut smem_max = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));
    let mut smem_sum = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));

    // -- merge the partials: each unit a strided share of them, then the units --
    let mut m = neg_inf;
    let mut l = 0.0f32;
    let mut p = UNIT_POS_X as usize;
    while p < num_chunks {
        let at = row * num_chunks + p;
        let (merged, sum) = merge_partial(m, l, partial_max[at], partial_sum[at], neg_inf);
        m = merged;
        l = sum;
        p += x as usize;
    }
    let (shift, norm) = row_norm(m, l, &mut smem_max, &mut smem_sum, neg_inf, cfg);

    #[unroll]
    for k in 0..k_count {
        let j = chunk_start + (UNIT_POS_X + k * x) as usize;
        if j < n_vec {
            output[out_base + j] = softmax_apply(input[in_base + j], shift, norm, cfg.variant);
        }
    }
}

/// Marks a published word: the exchange buffer starts zeroed, and a published `f32`'s bits
/// are stored complemented, which is zero only for the bits `0xFFFF_FFFF` (a NaN no max or sum
/// produces).
pub const PUBLISHED: u32 = 0xFFFF_FFFF;

/// This cube's ticket in an exchange tier: word 0 of `exchange`, drawn once per cube when it
/// starts (see [`softmax_split_exchange()`]).
#[cube]
fn draw_ticket(exchange: &Array<Atomic<u32>>) -> usize {
    let mut ticket = SharedMemory::<u32>::new(1usize);
    if UNIT_POS == 0 {
        ticket[0] = exchange[0].fetch_add(1u32);
    }
    sync_cube();
    ticket[0] as usize
}

/// Publishes `value` in word `at` of `exchange`, its bits complemented ([`PUBLISHED`]).
#[cube]
fn publish(exchange: &Array<Atomic<u32>>, at: usize, value: f32) {
    exchange[at].store(u32::reinterpret(value) ^ PUBLISHED);
}

/// Waits until word `at` of `exchange` is published, and returns its value.
#[cube]
fn published(exchange: &Array<Atomic<u32>>, at: usize) -> f32 {
    let mut word = exchange[at].load();
    while word == 0u32 {
        word = exchange[at].load();
    }
    f32::reinterpret(word ^ PUBLISHED)
}

/// Forward, split rows in one pass (CUDA): each cube holds its chunk in registers, publishes the
/// chunk's `(m, l)`, waits for the other chunks of its row, merges, and writes its chunk from
/// registers — every element read once from memory, where the two-kernel split reads it twice
/// (with [`RowConfig::reread`], bf16, the write pass reads the chunk again from L2).
///
/// `exchange` (zeroed before the launch): word 0 hands out tickets, then two words per
/// (row, chunk), `m` and `l` with their bits complemented ([`PUBLISHED`]). A cube takes its
/// (row, chunk) from the ticket it draws when it starts, not from `CUBE_POS`: every ticket
/// below a cube's own then belongs to a cube that has started, so the cubes of the last,
/// partly started row are the only ones waiting, and they cannot hold every slot of the device
/// while the device holds at least `num_chunks` cubes at once (the host checks this). Each word
/// is written and read with atomics, and a reader spins on the word itself, so no ordering
/// between different words is needed.
#[cube(launch_unchecked, fast_math = exp_modes(cfg.fast_exp))]
pub fn softmax_split_exchange<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    exchange: &mut Array<Atomic<u32>>,
    starts: RowStarts,
    num_rows: usize,
    num_chunks: usize,
    neg_inf: f32,
    #[comptime] cfg: RowConfig,
    #[define(F)] _dtype: StorageType,
) {
    let x = comptime!(cfg.group.units_per_row);
    let k_count = comptime!(cfg.vectors_per_unit);
    let (row, chunk, chunk_start) = split_chunk(draw_ticket(exchange), num_rows, num_chunks, cfg);
    let n_vec = starts.vectors;
    let in_base = row_start(input, row, starts.first, cfg.flat_rows);
    let out_base = row_start(output, row, starts.second, cfg.flat_rows);
    let mut smem_max = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));
    let mut smem_sum = SharedMemory::<f32>::new(comptime!(cfg.group.shared_len()));

    // -- this chunk's (m, l), as the two-kernel split's first pass --
    let mut regs = Array::<Vector<F, N>>::new(comptime!(k_count as usize));
    let (chunk_max, chunk_sum) = chunk_partial(
        input,
        &mut regs,
        in_base,
        chunk_start,
        n_vec,
        &mut smem_max,
        &mut smem_sum,
        neg_inf,
        cfg,
    );
    let words = 1 + 2 * (row * num_chunks);
    if UNIT_POS == 0 {
        publish(exchange, words + 2 * chunk, chunk_max);
        publish(exchange, words + 2 * chunk + 1, chunk_sum);
    }

    // -- wait for the row's chunks and merge, as the two-kernel split's second pass --
    let mut m = neg_inf;
    let mut l = 0.0f32;
    let mut p = UNIT_POS_X as usize;
    while p < num_chunks {
        let at = words + 2 * p;
        let (pm, pl) = (published(exchange, at), published(exchange, at + 1));
        let (merged, sum) = merge_partial(m, l, pm, pl, neg_inf);
        m = merged;
        l = sum;
        p += x as usize;
    }
    let (shift, norm) = row_norm(m, l, &mut smem_max, &mut smem_sum, neg_inf, cfg);

    #[unroll]
    for k in 0..k_count {
        let j = chunk_start + (UNIT_POS_X + k * x) as usize;
        if j < n_vec {
            let v = if comptime!(cfg.reread) {
                input[in_base + j]
            } else {
                regs[k as usize]
            };
            output[out_base + j] = softmax_apply(v, shift, norm, cfg.variant);
        }
    }
}

/// Forward for a non-contiguous softmax dimension: one unit per row, online `(m, l)` then a
/// writing pass.
#[cube(launch_unchecked)]
pub fn softmax_strided<F: Float>(
    input: &Tensor<F>,
    output: &mut Tensor<F>,
    num_rows: usize,
    neg_inf: f32,
    #[comptime] variant: SoftmaxVariant,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS;
    if row >= num_rows {
        terminate!();
    }
    let dim = input.rank() - 1;
    let n = input.shape(dim);
    let in_stride = input.stride(dim);
    let out_stride = output.stride(dim);
    let in_base = row_offset(input, row, dim);
    let out_base = row_offset(output, row, dim);

    // -- online: m' = max(m, x), l' = l·e^(m − m') + e^(x − m') --
    let mut m = neg_inf;
    let mut l = 0.0f32;
    for j in 0..n {
        let v = f32::cast_from(input[in_base + j * in_stride]);
        let (merged, sum) = merge_partial(m, l, v, 1.0f32, neg_inf);
        m = merged;
        l = sum;
    }
    let shift = softmax_shift(m, neg_inf, variant);
    let s = rebase(m, l, shift, neg_inf);
    let norm = softmax_norm(s, shift, neg_inf, variant);
    for j in 0..n {
        let v = f32::cast_from(input[in_base + j * in_stride]);
        let y = match variant {
            SoftmaxVariant::LogSoftmax => v - norm,
            _ => f32::exp(v - shift) * norm,
        };
        output[out_base + j * out_stride] = F::cast_from(y);
    }
}
