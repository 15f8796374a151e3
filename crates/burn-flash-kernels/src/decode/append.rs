//! Appending new keys and values to a KV cache in place, optionally rotating them (and the
//! queries) with RoPE on the way: FlashAttention's `flash_attn_with_kvcache` append, one launch.
//!
//! One unit per pair of elements of one new row: for keys (and, with `rope_q`, queries) the
//! rotated pair of RoPE — `(x₀·cos − x₁·sin, x₀·sin + x₁·cos)` at the token's position,
//! interleaved pairs `(2i, 2i + 1)` (burn-nn's `RotaryEncoding`) or halves `(i, i + R/2)`
//! (GPT-NeoX, Llama's Hugging Face layout), over the first `R = 2·cos.shape(1)` dims; the rest
//! copied — and for values a copy. Token `s` of batch `b` lands at position `lengths[b] + s`:
//! contiguous caches `[B, Hkv, S_max, D]`, or through the block table into the pool
//! `[blocks, block_size, Hkv, D]` (the decoding kernel's layouts, [`super::kernel`]).

use cubecl::prelude::*;

/// The comptime configuration of [`kv_append()`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AppendConfig {
    /// The caches are block pools read through the table.
    pub paged: bool,
    /// Keys are rotated.
    pub rope: bool,
    /// Queries are rotated too (written to `q_out`).
    pub rope_q: bool,
    /// RoPE pairs are interleaved `(2i, 2i + 1)`; halves `(i, i + R/2)` otherwise.
    pub interleaved: bool,
}

/// What [`kv_append()`] reads.
#[derive(CubeLaunch, CubeType)]
pub struct AppendSources<F: CubePrimitive> {
    /// New keys `[B, Hkv, S, D]`.
    pub k_new: Tensor<F>,
    /// New values `[B, Hkv, S, Dv]`.
    pub v_new: Tensor<F>,
    /// Queries `[B, Hq, S, D]` (read with `rope_q`).
    pub q: Tensor<F>,
    /// Keys already cached per batch `[B]` (u32).
    pub lengths: Tensor<u32>,
    /// Block table `[B, max_blocks]` (u32; paged).
    pub table: Tensor<u32>,
    /// RoPE cosines `[positions, R/2]` (f32).
    pub cos: Tensor<f32>,
    /// RoPE sines `[positions, R/2]` (f32).
    pub sin: Tensor<f32>,
}

/// What [`kv_append()`] writes.
#[derive(CubeLaunch, CubeType)]
pub struct AppendTargets<F: CubePrimitive> {
    /// The key cache.
    pub k: Tensor<F>,
    /// The value cache.
    pub v: Tensor<F>,
    /// Rotated queries `[B, Hq, S, D]` (written with `rope_q`).
    pub q_out: Tensor<F>,
}

/// Offset of row `pos` of batch `batch`, head `head` in a cache: contiguous `[B, H, S, ·]`,
/// or the pool `[blocks, block_size, H, ·]` through `table`.
#[cube]
fn cache_offset<F: CubePrimitive>(
    t: &Tensor<F>,
    table: &Tensor<u32>,
    batch: usize,
    head: usize,
    pos: usize,
    #[comptime] paged: bool,
) -> usize {
    if comptime!(paged) {
        let bs = t.shape(1);
        let entry = table[batch * table.stride(0) + (pos / bs) * table.stride(1)] as usize;
        // The host checks every entry against the pool; the clamp keeps writes inside it.
        let block = usize::min(entry, t.shape(0) - 1);
        block * t.stride(0) + (pos % bs) * t.stride(1) + head * t.stride(2)
    } else {
        batch * t.stride(0) + head * t.stride(1) + pos * t.stride(2)
    }
}

/// Reads pair `(e0, e1)` of the row at `at` of `x` (`width` columns; 0 past them), rotates it
/// by `(cos, sin)` when `rotate`, and writes it to the row at `dst` of `y`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn move_pair<F: Float>(
    x: &Tensor<F>,
    y: &mut Tensor<F>,
    at: usize,
    dst: usize,
    e0: usize,
    e1: usize,
    width: usize,
    cos: f32,
    sin: f32,
    rotate: bool,
) {
    let (sx, sy) = (x.stride(3), y.stride(3));
    let x0 = f32::cast_from(x[at + usize::min(e0, width - 1) * sx]);
    let x1 = f32::cast_from(x[at + usize::min(e1, width - 1) * sx]);
    let mut y0 = x0;
    let mut y1 = x1;
    if rotate {
        y0 = x0 * cos - x1 * sin;
        y1 = x0 * sin + x1 * cos;
    }
    if e0 < width {
        y[dst + e0 * sy] = F::cast_from(y0);
    }
    if e1 < width {
        y[dst + e1 * sy] = F::cast_from(y1);
    }
}

/// The append streams: four cubes per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(4);

/// Appends `k_new`, `v_new` at each batch's length (module docs). Grid: linear over
/// `B · H · S · pairs` units (`H = max(Hkv, Hq)` with `rope_q`, `pairs = ⌈max(D, Dv) / 2⌉`), as
/// `(x, y)` cubes of `CUBE_DIM` units.
#[cube(launch_unchecked)]
pub fn kv_append<F: Float>(
    src: &AppendSources<F>,
    dst: &mut AppendTargets<F>,
    #[comptime] a: AppendConfig,
    #[define(F)] _dtype: StorageType,
) {
    let (k_new, v_new, q) = (&src.k_new, &src.v_new, &src.q);
    let (batches, heads_kv, new) = (k_new.shape(0), k_new.shape(1), k_new.shape(2));
    let (head_dim, value_dim) = (k_new.shape(3), v_new.shape(3));
    let mut heads = heads_kv;
    if comptime!(a.rope_q) {
        heads = usize::max(heads_kv, q.shape(1));
    }
    let pairs = usize::max(head_dim, value_dim).div_ceil(2);
    let idx =
        (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM as usize + UNIT_POS as usize;
    let p = idx % pairs;
    let s = (idx / pairs) % new;
    let h = (idx / (pairs * new)) % heads;
    let b = idx / (pairs * new * heads);
    if b < batches {
        let pos = src.lengths[b * src.lengths.stride(0)] as usize + s;
        // The pair's elements and rotation: interleaved (2p, 2p + 1), or halves (p, p + R/2)
        // inside the rotary dims; past them (2p, 2p + 1) unrotated.
        let half = src.cos.shape(1);
        let mut rotated = false;
        let mut cos = 1.0f32;
        let mut sin = 0.0f32;
        let mut e0 = 2 * p;
        let mut e1 = 2 * p + 1;
        if comptime!(a.rope) {
            rotated = p < half;
            if rotated {
                let pc = usize::min(p, half - 1);
                cos = src.cos[pos * src.cos.stride(0) + pc * src.cos.stride(1)];
                sin = src.sin[pos * src.sin.stride(0) + pc * src.sin.stride(1)];
                if comptime!(!a.interleaved) {
                    e0 = p;
                    e1 = p + half;
                }
            }
        }
        if h < heads_kv {
            let at = b * k_new.stride(0) + h * k_new.stride(1) + s * k_new.stride(2);
            let to = cache_offset(&dst.k, &src.table, b, h, pos, a.paged);
            if p * 2 < head_dim {
                move_pair(
                    k_new, &mut dst.k, at, to, e0, e1, head_dim, cos, sin, rotated,
                );
            }
            let at = b * v_new.stride(0) + h * v_new.stride(1) + s * v_new.stride(2);
            let to = cache_offset(&dst.v, &src.table, b, h, pos, a.paged);
            if p * 2 < value_dim {
                move_pair(
                    v_new,
                    &mut dst.v,
                    at,
                    to,
                    2 * p,
                    2 * p + 1,
                    value_dim,
                    cos,
                    sin,
                    false,
                );
            }
        }
        if comptime!(a.rope_q) && h < q.shape(1) && p * 2 < head_dim {
            let at = b * q.stride(0) + h * q.stride(1) + s * q.stride(2);
            let out = &mut dst.q_out;
            let to = b * out.stride(0) + h * out.stride(1) + s * out.stride(2);
            move_pair(q, out, at, to, e0, e1, head_dim, cos, sin, rotated);
        }
    }
}
