//! The parts of the plain-unit backward kernels: the swizzled shared tiles and their staging, the
//! score rebuild (`P`, `dP`, `dS` of a tile from `Q`, `K`, `lse`, `δ`), and the tile products
//! on plain units.

use super::*;

/// Where 4-vector `qv` of row `r` of a shared tile lies: rows of [`PITCH`] 4-vectors, the
/// 4-vector index XOR-swizzled by `r mod 8`, so that 8 consecutive rows at one `qv` (a score
/// product's `B` reads) and 8 consecutive `qv` of one row (stages, gradient products) each
/// hit every bank once.
#[cube]
pub(super) fn slot(r: u32, qv: u32) -> usize {
    (r * PITCH + (qv ^ (r & 7))) as usize
}

/// Cubes along x of [`flash_backward_dkv()`] for `seq_k` keys: key blocks × column tiles
/// (`D` and `Dv` for computed scores, `Dv` for given ones).
pub fn dkv_blocks(seq_k: usize, head_dim: usize, value_dim: usize, given: bool) -> usize {
    let cols = if given {
        value_dim
    } else {
        head_dim.max(value_dim)
    };
    seq_k.div_ceil(BLOCK_KEYS as usize) * cols.div_ceil(COL_TILE as usize).max(1)
}

/// The query head of index `g` in the group of key/value head `hkv` (`G = Hq / Hkv` heads).
#[cube]
pub(super) fn group_head(hkv: usize, g: usize, group: usize, heads_kv: usize) -> usize {
    let mut head = hkv * group + g;
    if comptime!(crate::mutation::gqa_modulo()) {
        head = hkv + heads_kv * g;
    }
    head
}

/// Offset of `t[b, h, p, 0]`.
#[cube]
pub(super) fn row_at<F: CubePrimitive>(t: &Tensor<F>, b: usize, h: usize, p: usize) -> usize {
    b * t.stride(0) + h * t.stride(1) + p * t.stride(2)
}

/// Columns `c0 + 4·qv ..` of the tensor row at `base` as an f32 4-vector (0 where `ok` is
/// false or past `cols`).
#[cube]
pub(super) fn load4<F: Float>(
    t: &Tensor<F>,
    ok: bool,
    base: usize,
    c0: usize,
    qv: u32,
    cols: usize,
) -> V4 {
    let mut vec = V4::empty();
    #[unroll]
    for e in 0..4u32 {
        let col = c0 + (4 * qv + e) as usize;
        let mut val = 0.0f32;
        if ok && col < cols {
            val = f32::cast_from(t[base + col * t.stride(3)]);
        }
        vec[e as usize] = val;
    }
    vec
}

/// Stages `n` rows × [`CHUNK`] columns (from `c0`) into the tile at `at`: row `r` is the
/// tensor row at `base + r·pitch` (positions of one head), zeros past `valid` rows and `cols`
/// columns.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn stage<F: Float>(
    t: &Tensor<F>,
    sh: &mut SharedMemory<V4>,
    at: usize,
    base: usize,
    pitch: usize,
    valid: usize,
    c0: usize,
    cols: usize,
    #[comptime] n: u32,
) {
    #[unroll]
    for e in 0..comptime!(n * (CHUNK / 4) / UNITS) {
        let idx = UNIT_POS + e * UNITS;
        let (r, qv) = (idx / (CHUNK / 4), idx % (CHUNK / 4));
        let ok = (r as usize) < valid;
        let row = select(ok, base + r as usize * pitch, 0);
        sh[at + slot(r, qv)] = load4::<F>(t, ok, row, c0, qv, cols);
    }
}

/// Stages `n` query rows `r0..` of the key/value head's group of `blk` (row `r` is head
/// `group_head(r / Sq)`, position `r % Sq`) × [`CHUNK`] columns into the tile at `at`, zeros
/// past the rows.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_rows<F: Float>(
    t: &Tensor<F>,
    sh: &mut SharedMemory<V4>,
    at: usize,
    blk: &PairBlock,
    r0: usize,
    c0: usize,
    cols: usize,
    #[comptime] n: u32,
) {
    let (rows, seq_q) = (blk.rows, blk.seq_q);
    #[unroll]
    for e in 0..comptime!(n * (CHUNK / 4) / UNITS) {
        let idx = UNIT_POS + e * UNITS;
        let (r, qv) = (idx / (CHUNK / 4), idx % (CHUNK / 4));
        let row = r0 + r as usize;
        let ok = row < rows;
        let rr = usize::min(row, rows - 1);
        let head = group_head(blk.hkv, rr / seq_q, blk.group, blk.heads_kv);
        let base = row_at(t, blk.batch, head, rr % seq_q);
        sh[at + slot(r, qv)] = load4::<F>(t, ok, base, c0, qv, cols);
    }
}

/// The given scores of the unit's `ri × rj` elements (rows `r0 + ty + 16·i`, keys
/// `j0 + tx + 16·j`) from `x` (`[B, H, Sq, Sk]`, rows over the group as in [`stage_rows()`]);
/// 0 past the edges.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn read_scores<F: Float>(
    x: &Tensor<F>,
    raw: &mut Array<f32>,
    blk: &PairBlock,
    r0: usize,
    j0: usize,
    ty: u32,
    tx: u32,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    let (rows, seq_q) = (blk.rows, blk.seq_q);
    #[unroll]
    for i in 0..ri {
        let row = r0 + (ty + GRID * i) as usize;
        #[unroll]
        for j in 0..rj {
            let key = j0 + (tx + GRID * j) as usize;
            if row < rows && key < blk.seq_k {
                let head = group_head(blk.hkv, row / seq_q, blk.group, blk.heads_kv);
                let at = row_at(x, blk.batch, head, row % seq_q) + key * x.stride(3);
                raw[(i * rj + j) as usize] = f32::cast_from(x[at]);
            }
        }
    }
}

/// `acc[i·rj + j] += Σ_c A[ty + 16·i][c] · B[tx + 16·j][c]` over one chunk: the unit's
/// scores of `A·Bᵀ` (`A`, `B` tiles at `a_at`, `b_at`, rows along the reduction).
#[cube]
pub(super) fn product_abt(
    sh: &SharedMemory<V4>,
    a_at: usize,
    b_at: usize,
    acc: &mut Array<f32>,
    ty: u32,
    tx: u32,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    #[unroll]
    for qv in 0..comptime!(CHUNK / 4) {
        let mut a = Array::<V4>::new(comptime!(ri as usize));
        let mut b = Array::<V4>::new(comptime!(rj as usize));
        #[unroll]
        for i in 0..ri {
            a[i as usize] = sh[a_at + slot(ty + GRID * i, qv)];
        }
        #[unroll]
        for j in 0..rj {
            b[j as usize] = sh[b_at + slot(tx + GRID * j, qv)];
        }
        #[unroll]
        for i in 0..ri {
            #[unroll]
            for j in 0..rj {
                let at = (i * rj + j) as usize;
                let (x, y) = (a[i as usize], b[j as usize]);
                acc[at] += x[0usize] * y[0usize];
                acc[at] += x[1usize] * y[1usize];
                acc[at] += x[2usize] * y[2usize];
                acc[at] += x[3usize] * y[3usize];
            }
        }
    }
}

/// `acc[at + a] += W[r][ty][a] · B[r][tx]` over the tiles' first `n` rows: the unit's outputs
/// `ty + 16·a` (the columns of `W`'s 4-vector `ty`) by columns `4·tx ..` of `Wᵀ·B`.
#[cube]
pub(super) fn product_wb(
    sh: &SharedMemory<V4>,
    w_at: usize,
    b_at: usize,
    acc: &mut Array<V4>,
    ty: u32,
    tx: u32,
    #[comptime] at: u32,
    #[comptime] n: u32,
) {
    #[unroll]
    for r in 0..n {
        let w = sh[w_at + slot(r, ty)];
        let b = sh[b_at + slot(r, tx)];
        #[unroll]
        for a in 0..4u32 {
            acc[(at + a) as usize] += V4::new(w[a as usize]) * b;
        }
    }
}

/// The unit's `ri × rj` (at most 8) score terms: the raw products `raw` (`Q·Kᵀ` before the
/// scale, or the given scores), `dP` (`dp`), and what [`rebuild()`] makes of `raw`.
#[derive(CubeType)]
pub(super) struct Weights {
    pub(super) raw: Array<f32>,
    pub(super) dp: Array<f32>,
    pub(super) p: Array<f32>,
    pub(super) dfac: Array<f32>,
    pub(super) gate: Array<f32>,
    pub(super) z: Array<f32>,
}

#[cube]
pub(super) fn new_weights() -> Weights {
    Weights {
        raw: Array::new(8usize),
        dp: Array::new(8usize),
        p: Array::new(8usize),
        dfac: Array::new(8usize),
        gate: Array::new(8usize),
        z: Array::new(8usize),
    }
}

/// The unit's raw scores of rows `r0 + ty + 16·i` and keys `j0 + tx + 16·j` into `w.raw`,
/// with `w.dp` zeroed: the given scores read from `X`, or `Q·Kᵀ` over the chunks of `D`,
/// staging `n_rows` query rows at `a_at` and `n_keys` keys (`keys` valid, from `k_base`) at
/// `b_at`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn raw_scores<F: Float>(
    inputs: &ScoreInputs<F, F>,
    sh: &mut SharedMemory<V4>,
    w: &mut Weights,
    blk: &PairBlock,
    r0: usize,
    j0: usize,
    k_base: usize,
    keys: usize,
    a_at: usize,
    b_at: usize,
    ty: u32,
    tx: u32,
    #[comptime] c: FlashConfig,
    #[comptime] n_rows: u32,
    #[comptime] n_keys: u32,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    let (q, k) = (&inputs.q, &inputs.k);
    #[unroll]
    for n in 0..8usize {
        w.raw[n] = 0.0f32;
        w.dp[n] = 0.0f32;
    }
    if comptime!(c.given()) {
        read_scores::<F>(q, &mut w.raw, blk, r0, j0, ty, tx, ri, rj);
    }
    for dc in 0..comptime!(c.head_dim / CHUNK) {
        let c0 = (dc * CHUNK) as usize;
        stage_rows::<F>(q, sh, a_at, blk, r0, c0, blk.head_dim, n_rows);
        stage::<F>(
            k,
            sh,
            b_at,
            k_base,
            k.stride(2),
            keys,
            c0,
            blk.head_dim,
            n_keys,
        );
        sync_cube();
        product_abt(sh, a_at, b_at, &mut w.raw, ty, tx, ri, rj);
        sync_cube();
    }
}

/// The weights of the unit's `ri × rj` scores of rows `rw`, rebuilt from their raw products
/// `w.raw`: `P` (`w.p`, before dropout), the softcap's derivative (`w.dfac`), whether `dS`
/// flows (`w.gate`: 0 where a masked key took the fill score,
/// [`crate::flash::scores::live_score()`]) and the dropout factor `w.z` (`keep / (1 − p)`, 1
/// without dropout), the forward's own mask drawn again. Keys are `j0 + tx + 16·j`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn rebuild<F: Float>(
    inputs: &ScoreInputs<F, F>,
    rw: &Rows,
    w: &mut Weights,
    blk: &PairBlock,
    j0: usize,
    tx: u32,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] ri: u32,
    #[comptime] rj: u32,
) {
    let (mask, bias, refs) = (&inputs.mask, &inputs.bias, &rw.refs);
    let (seq_q, seq_k) = (blk.seq_q, blk.seq_k);
    let drop = &args.dropout;
    #[unroll]
    for i in 0..ri {
        let slot = i as usize;
        #[unroll]
        for j in 0..rj {
            let at = (i * rj + j) as usize;
            let key = j0 + (tx + GRID * j) as usize;
            let sc = capped(w.raw[at], args, c);
            let fac = cap_slope(sc, args, c);
            let s = add_bias::<F>(bias, refs, slot, sc, key, seq_k, c);
            let s = filled::<F>(mask, refs, slot, s, key, seq_k, c);
            let ok = rw.ok[slot] && visible::<F>(mask, refs, slot, key, seq_q, seq_k, c, true);
            // A row without a visible key has lse = −inf (and every P = 0).
            let live = ok && rw.lse[slot] > f32::min_value();
            w.p[at] = select(live, f32::exp(s - rw.lse[slot]), 0.0f32);
            w.dfac[at] = fac;
            if comptime!(c.fills()) {
                w.gate[at] = select(
                    live_score::<F>(mask, refs, slot, key, seq_k, c),
                    1.0f32,
                    0.0f32,
                );
            }
            w.z[at] = 1.0f32;
            if comptime!(c.rules.dropout) {
                w.z[at] = keep_weight(
                    drop.seed_lo,
                    drop.seed_hi,
                    drop.threshold,
                    drop.inv_keep,
                    rw.pair[slot],
                    refs.pos[slot],
                    key,
                    true,
                );
            }
        }
    }
}

/// The per-row state of the unit's `ri` query rows `r0 + ty + 16·i`: mask/bias references,
/// whether the row exists, its `lse`, `δ` and (batch, head) pair index, and (`ds_rows`) the
/// offset of its `dS` row.
#[derive(CubeType)]
pub(super) struct Rows {
    pub(super) refs: RowRefs,
    pub(super) ok: Array<bool>,
    pub(super) lse: Array<f32>,
    pub(super) delta: Array<f32>,
    pub(super) pair: Array<usize>,
    pub(super) ds: Array<usize>,
}

/// Fills [`Rows`] for rows `r0 + ty + 16·i` (i < `ri`) of the group of `blk`'s key/value head.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_rows<F: Float>(
    inputs: &ScoreInputs<F, F>,
    grads: &GradInputs<F>,
    ds: &Tensor<F>,
    blk: &PairBlock,
    r0: usize,
    ty: u32,
    args: &ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] ri: u32,
    #[comptime] ds_rows: bool,
) -> Rows {
    let (lse, delta) = (&grads.lse, &grads.delta);
    let (batch, hkv, group, heads_kv) = (blk.batch, blk.hkv, blk.group, blk.heads_kv);
    let (rows, seq_q) = (blk.rows, blk.seq_q);
    let heads_q = inputs.q.shape(1);
    let n = comptime!(ri as usize);
    let mut out = Rows {
        refs: new_refs(n),
        ok: Array::new(n),
        lse: Array::new(n),
        delta: Array::new(n),
        pair: Array::new(n),
        ds: Array::new(n),
    };
    let q_group = pair_group(blk);
    #[unroll]
    for i in 0..ri {
        let slot = i as usize;
        let row = r0 + (ty + GRID * i) as usize;
        set_row(
            &mut out.refs,
            slot,
            inputs,
            &q_group,
            row,
            blk.seq_k,
            args,
            c,
        );
        let rr = usize::min(row, rows - 1);
        let head = group_head(hkv, rr / seq_q, group, heads_kv);
        let pos = rr % seq_q;
        out.ok[slot] = row < rows;
        out.lse[slot] = lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)];
        out.delta[slot] = delta[(batch * heads_q + head) * seq_q + pos];
        out.pair[slot] = batch * heads_q + head;
        out.ds[slot] = 0usize;
        if comptime!(ds_rows) {
            out.ds[slot] = row_at(ds, batch, head, pos);
        }
    }
    out
}
