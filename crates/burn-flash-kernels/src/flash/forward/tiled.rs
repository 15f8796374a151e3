//! The register-tiled flash forward on plain units (every runtime and float type; f32
//! arithmetic), with the score source a comptime choice ([`crate::flash::ScoreSource`]): the loop of
//! [`super::units`] with the `P·V` product of [`crate::tiling`] (8 × 8 outputs per unit from
//! 4-vectors), for outputs of at least 65 × 65.
//!
//! One cube of [`UNITS`] units per block of [`BLOCK_Q`] query rows of one (batch, key/value
//! head) and one tile of [`TILE_N`] output columns, rows running over the group's query heads
//! as in [`super::mma`]. Per step of [`BLOCK_K`] keys, *score units* hold 4 rows × 4 keys
//! (given scores: units 0..128, the others stage `V`) or 4 rows × 2 keys (computed scores: every
//! unit, which spreads the `Q·Kᵀ` work; each also stages a part of `V`) — [`Roles`]:
//!
//! 1. **the scores**: given (read from `X` in the previous step, so that the loads overlap its
//!    product), or `S = Q·Kᵀ` over `D` in chunks of [`D_CHUNK`]: `Q`ᵀ and `K`ᵀ chunks staged in
//!    shared memory, one query 4-vector by 2 keys per unit and `d`;
//! 2. the finished scores ([`crate::flash::scores`]), the row maxima over the units of a row (plane
//!    shuffles, or shared memory), the lazy online-softmax update ([`crate::flash::online`]), and `P`ᵀ into
//!    shared memory, 4-vectors along the rows (swizzled as [`crate::tiling`] reads them), with
//!    the row scales; the `V` units write the step's `V` tile, loaded in the previous step;
//! 3. the next step's `V` (and `X`) loads, one `sync_cube`, then `O += P·V`
//!    ([`crate::tiling::product_step()`]).
//!
//! Buffers: given scores with plane shuffles need two of each (nothing else separates a step's
//! writes from the previous step's product); computed scores (the `Q`/`K` chunk barriers) and
//! maxima through shared memory (their barrier) take one, which fits 32 KiB.
//!
//! Causal: the key blocks after every row's diagonal are skipped.

use cubecl::{features::Plane, prelude::*};

use crate::flash::args::{ForwardOutputs, ScoreArgs, ScoreInputs};
use crate::flash::block::{cube_block, cube_group};
use crate::flash::config::{FlashConfig, Tile};
use crate::flash::online::{
    inverse_sum, next_reference, output_sum, probability, rescale_factor, row_lse,
};
use crate::flash::scores::{new_refs, score, set_row, visible};
use crate::reduce::combine;
use crate::tiling::{BUF, TILE_M, VECS, pre_at, product_step};

pub use crate::tiling::{TILE_N, UNITS};

/// Query rows per cube.
pub const BLOCK_Q: u32 = TILE_M;
/// Keys per step.
pub const BLOCK_K: u32 = crate::tiling::STEP;
/// Head dims per staged chunk of `Q` and `K`.
pub const D_CHUNK: u32 = 16;

/// How the units share a step's scores and its `V` tile. Given scores: 128 *score units* hold
/// 4 rows × 4 keys each (a row over 4 units), the other 128 stage `V` (4 4-vectors each);
/// computed scores: all 256 hold 4 rows × 2 keys (a row over 8 units; the `Q·Kᵀ` work is
/// spread over every unit) and stage 2 4-vectors of `V` each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Roles {
    /// Keys per score unit.
    pub keys: u32,
    /// Score units per row (group of 4 rows).
    pub row_units: u32,
    /// Score units (the first ones of the cube).
    pub score_units: u32,
    /// Units that stage `V` (the last ones of the cube).
    pub v_units: u32,
}

/// The [`Roles`] of `c`'s score source.
pub fn roles(c: FlashConfig) -> Roles {
    let keys = if c.given() { 4 } else { 2 };
    let row_units = BLOCK_K / keys;
    let score_units = (BLOCK_Q / 4) * row_units;
    Roles {
        keys,
        row_units,
        score_units,
        v_units: if c.given() {
            UNITS - score_units
        } else {
            UNITS
        },
    }
}

/// 4-vectors of shared memory: `P`ᵀ, `V`, row scales (per buffer) and row sums, without plane
/// shuffles the units' partial maxima, with computed scores the `Q`ᵀ chunk and the `K`ᵀ chunk
/// (2-vectors, counted as 4-vectors).
fn shared_vecs(c: FlashConfig, planes: bool) -> u32 {
    let bufs = buffers(c, planes);
    let mut vecs = 2 * bufs * BUF + (bufs + 1) * VECS;
    if !planes {
        vecs += UNITS;
    }
    if !c.given() {
        vecs += D_CHUNK * VECS + D_CHUNK * (BLOCK_K / 2) / 2;
    }
    vecs
}

/// Buffers of `P`ᵀ, `V` and the row scales: two for given scores with plane shuffles (see the
/// module docs), else one.
fn buffers(c: FlashConfig, planes: bool) -> u32 {
    if c.given() && planes { 2 } else { 1 }
}

/// Shared memory of [`flash_forward_tiled()`] for `c`, in bytes.
pub fn shared_bytes(c: FlashConfig, planes: bool) -> usize {
    shared_vecs(c, planes) as usize * 16
}

/// Whether `client` exchanges row maxima and sums by plane shuffles: plane operations over a
/// fixed plane width that is a multiple of 8 (the most units of a row, [`Roles`]).
pub fn planes<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let props = client.properties();
    let hw = &props.hardware;
    props.features.plane.contains(Plane::Ops)
        && hw.plane_size_min == hw.plane_size_max
        && hw.plane_size_max.is_multiple_of(8)
}

/// Whether [`flash_forward_tiled()`] runs `c` on `client`: [`UNITS`] units and its shared
/// memory.
pub fn fits<R: Runtime>(client: &ComputeClient<R>, c: FlashConfig) -> bool {
    let hw = &client.properties().hardware;
    hw.max_units_per_cube >= UNITS && hw.max_shared_memory_size >= shared_bytes(c, planes(client))
}

/// The kernel's tile: its own rows, keys per step and output columns, `D` rounded up to
/// [`D_CHUNK`].
pub fn tile(head_dim: usize) -> Tile {
    Tile {
        block_q: BLOCK_Q,
        row_tiles: 1,
        block_k: BLOCK_K,
        head_dim: head_dim.next_multiple_of(D_CHUNK as usize) as u32,
        value_dim: TILE_N,
    }
}

/// The largest vector width (4, 2 or 1) of the kernel's `q`, `k`, `v`, `out`: unit stride along
/// the last dim, whose length and every other stride it divides.
pub fn vector(tensors: &[(&[usize], &[usize])]) -> usize {
    [4, 2]
        .into_iter()
        .find(|&n| {
            tensors.iter().all(|(shape, strides)| {
                let last = strides.len() - 1;
                strides[last] == 1
                    && shape[last].is_multiple_of(n)
                    && strides[..last].iter().all(|s| s.is_multiple_of(n))
            })
        })
        .unwrap_or(1)
}

/// Shared memory of one cube.
#[derive(CubeType)]
struct Shared {
    /// `P`ᵀ, `[key][row 4-vector]`, swizzled.
    p_s: SharedMemory<Vector<f32, Const<4>>>,
    /// The step's `V` tile, `[key][column 4-vector]`.
    v_s: SharedMemory<Vector<f32, Const<4>>>,
    /// Row scales (one 4-vector per 4 rows and buffer), then the row sums.
    a_s: SharedMemory<Vector<f32, Const<4>>>,
    /// Without plane shuffles: each unit's 4 partial row maxima (then sums).
    mx_s: SharedMemory<Vector<f32, Const<4>>>,
    /// Computed scores: the `Q`ᵀ chunk, `[d][row 4-vector]`.
    q_s: SharedMemory<Vector<f32, Const<4>>>,
    /// Computed scores: the `K`ᵀ chunk, `[d][key pair]`.
    k_s: SharedMemory<Vector<f32, Const<2>>>,
}

/// The sum (`max = false`) or maximum of `x` over the `row_units` (4 or 8) units of a row,
/// by plane shuffles (consecutive units of one plane).
#[cube]
fn row_reduce(x: f32, #[comptime] row_units: u32, #[comptime] max: bool) -> f32 {
    let a = plane_shuffle_xor(x, 1);
    let mut r = combine(x, a, max);
    let b = plane_shuffle_xor(r, 2);
    r = combine(r, b, max);
    if comptime!(row_units == 8) {
        let d = plane_shuffle_xor(r, 4);
        r = combine(r, d, max);
    }
    r
}

/// Through shared memory: every score unit writes its 4 values `x`, and gets into `r` the sums
/// (`max = false`) or maxima over the units of its row group. Every unit of the cube must call
/// this.
#[cube]
fn row_reduce_shared(
    mx_s: &mut SharedMemory<Vector<f32, Const<4>>>,
    x: &Array<f32>,
    r: &mut Array<f32>,
    #[comptime] roles: Roles,
    #[comptime] max: bool,
) {
    if UNIT_POS < roles.score_units {
        let mut mine = Vector::<f32, Const<4>>::empty();
        #[unroll]
        for i in 0..4usize {
            mine[i] = x[i];
        }
        mx_s[UNIT_POS as usize] = mine;
    }
    sync_cube();
    if UNIT_POS < roles.score_units {
        let first = ((UNIT_POS / roles.row_units) * roles.row_units) as usize;
        #[unroll]
        for i in 0..4usize {
            r[i] = mx_s[first][i];
        }
        #[unroll]
        for t in 1..roles.row_units as usize {
            let other = mx_s[first + t];
            #[unroll]
            for i in 0..4usize {
                r[i] = combine(r[i], other[i], max);
            }
        }
    }
}

/// Loads this unit's part of the step at `j0` into registers: a score unit its 4 × 4 given
/// scores (rows at `x_rows`, keys `j0 + 4·kg ..`) when the scores are given, a `V` unit its
/// 4-vectors of the `V` tile (key `j0 + idx / 32`, columns `col0 + 4·(idx % 32) ..`).
/// Addresses are clamped into the tensors (`seq_k ≥ 1`).
#[cube]
// A comptime `if` stays apart from the runtime one inside it.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn load_step<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    pre_x: &mut Array<Vector<F, NV>>,
    pre_v: &mut Array<Vector<F, NV>>,
    x_rows: &Array<usize>,
    j0: usize,
    col0: usize,
    v_base: usize,
    seq_k: usize,
    #[comptime] roles: Roles,
    #[comptime] given: bool,
) {
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    if comptime!(given) {
        if UNIT_POS < roles.score_units {
            let kg = (UNIT_POS % roles.row_units) as usize;
            #[unroll]
            for i in 0..4usize {
                #[unroll]
                for qv in 0..per4 {
                    let key = j0 + 4 * kg + qv * nv;
                    let key = select(key < seq_k, key, 0);
                    pre_x[i * per4 + qv] = x[(x_rows[i] + key * x.stride(3)) / nv];
                }
            }
        }
    }
    let first_v = comptime!(UNITS - roles.v_units);
    if UNIT_POS >= first_v {
        let value_dim = v.shape(3);
        #[unroll]
        for e in 0..comptime!((BUF / roles.v_units) as usize) {
            let idx = (UNIT_POS - first_v) as usize + e * roles.v_units as usize;
            let key = usize::min(j0 + idx / VECS as usize, seq_k - 1);
            #[unroll]
            for qv in 0..per4 {
                let col = col0 + 4 * (idx % VECS as usize) + qv * nv;
                let col = select(col < value_dim, col, 0);
                pre_v[e * per4 + qv] = v[(v_base + key * v.stride(2) + col * v.stride(3)) / nv];
            }
        }
    }
}

/// `S = Q·Kᵀ` of this unit's 4 rows × 2 keys of the step at `j0` (raw products, no scale),
/// over `D` in chunks staged in shared memory: units 0..128 stage a 4-row × 4-dim block of `Q`
/// (rows at `q_rows`), units 128..144 a 4-key × 4-dim block of `K`. The chunks' barriers also
/// separate the previous step's product from this step's writes.
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_key<F: Float, NV: Size>(
    q: &Tensor<Vector<F, NV>>,
    k: &Tensor<Vector<F, NV>>,
    sh: &mut Shared,
    s: &mut Array<f32>,
    q_rows: &Array<usize>,
    k_base: usize,
    j0: usize,
    seq_k: usize,
    #[comptime] c: FlashConfig,
) {
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    let head_dim = q.shape(3);
    let rg = (UNIT_POS / 8) as usize;
    let kg = (UNIT_POS % 8) as usize;
    #[unroll]
    for i in 0..8usize {
        s[i] = 0.0f32;
    }
    let zero = Vector::<F, NV>::new(F::from_int(0));
    for dc in 0..comptime!(c.head_dim / D_CHUNK) {
        if dc > 0 {
            sync_cube();
        }
        let d0 = (dc * D_CHUNK) as usize;
        let dg = (UNIT_POS % 4) as usize;
        // 4 rows (keys) × 4 dims d0 + 4·dg .. of this unit, group r of `blk` = row (key) r.
        let mut blk = Array::<Vector<F, NV>>::new(comptime!(4 * per4));
        if UNIT_POS < 128 {
            // Rows 4·(u / 4) ..
            #[unroll]
            for i in 0..4usize {
                #[unroll]
                for qv in 0..per4 {
                    let d = d0 + 4 * dg + qv * nv;
                    let at = select(d < head_dim, q_rows[i] + d * q.stride(3), 0);
                    blk[i * per4 + qv] = select(d < head_dim, q[at / nv], zero);
                }
            }
            #[unroll]
            for jd in 0..4usize {
                let mut vec = Vector::<f32, Const<4>>::empty();
                #[unroll]
                for i in 0..4usize {
                    vec[i] = pre_at::<F, NV>(&blk, i, jd);
                }
                sh.q_s[(4 * dg + jd) * VECS as usize + (UNIT_POS / 4) as usize] = vec;
            }
        } else if UNIT_POS < 128 + BLOCK_K {
            // Keys 4·kq ..
            let kq = ((UNIT_POS - 128) / 4) as usize;
            #[unroll]
            for r in 0..4usize {
                let key = usize::min(j0 + 4 * kq + r, seq_k - 1);
                #[unroll]
                for qv in 0..per4 {
                    let d = d0 + 4 * dg + qv * nv;
                    let at = select(
                        d < head_dim,
                        k_base + key * k.stride(2) + d * k.stride(3),
                        0,
                    );
                    blk[r * per4 + qv] = select(d < head_dim, k[at / nv], zero);
                }
            }
            #[unroll]
            for jd in 0..4usize {
                #[unroll]
                for half in 0..2usize {
                    let mut pair = Vector::<f32, Const<2>>::empty();
                    #[unroll]
                    for n in 0..2usize {
                        pair[n] = pre_at::<F, NV>(&blk, 2 * half + n, jd);
                    }
                    sh.k_s[(4 * dg + jd) * 8 + 2 * kq + half] = pair;
                }
            }
        }
        sync_cube();
        #[unroll]
        for d in 0..D_CHUNK as usize {
            let a = sh.q_s[d * VECS as usize + rg];
            let b = sh.k_s[d * 8 + kg];
            #[unroll]
            for i in 0..4usize {
                #[unroll]
                for n in 0..2usize {
                    s[i * 2 + n] += a[i] * b[n];
                }
            }
        }
    }
}

/// 256 threads of 8 × 8 register tiles: one cube per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(1);

/// `out`, `lse` as [`super::mma::flash_forward_mma()`] (same tensors for each score source),
/// for any float type and layout, with the tiles of the module docs. `c.head_dim` is `D`
/// rounded up to [`D_CHUNK`]; `c.block_q`, `c.block_k`, `c.value_dim` are [`BLOCK_Q`],
/// [`BLOCK_K`], [`TILE_N`]. `NV` (1, 2 or 4) divides the rows and strides of `q` (`X`), `k`, `v`
/// and `out` (last stride 1); `planes`: plane shuffles over groups of 8 consecutive units.
/// Grid: `(column tiles of Dv, row blocks of G·Sq, B·Hkv)`, [`UNITS`] units.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_tiled<F: Float, NV: Size>(
    inputs: &ScoreInputs<Vector<F, NV>, F>,
    outputs: &mut ForwardOutputs<Vector<F, NV>>,
    args: ScoreArgs,
    #[comptime] c: FlashConfig,
    #[comptime] planes: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let (mask, bias) = (&inputs.mask, &inputs.bias);
    let (out, lse) = (&mut outputs.out, &mut outputs.lse);
    let given = comptime!(c.given());
    let ro = comptime!(roles(c));
    let ku = comptime!(ro.keys as usize);
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    let bufs = comptime!(buffers(c, planes) as usize);

    let blk = cube_block(q, k, &inputs.seqs, &args, c);
    let group = cube_group(&blk);
    let (seq_q, seq_k, rows) = (blk.seq_q, blk.seq_k, blk.rows);
    let (batch, hkv, head0, row0) = (blk.batch, blk.hkv, blk.head0, blk.row0);
    let kv_end = blk.kv_end;
    let value_dim = out.shape(3);
    let col0 = blk.col0;
    // Score unit: rows 4·rg .., keys ku·kg ... Product unit: (ty, tx) of crate::tiling.
    let is_score = UNIT_POS < ro.score_units;
    let rg = (UNIT_POS % ro.score_units) / ro.row_units;
    let kg = UNIT_POS % ro.row_units;
    let plane = UNIT_POS / 32;
    let ty = (plane / 2) * 4 + (UNIT_POS % 32) / 8;
    let tx = (plane % 2) * 8 + UNIT_POS % 8;

    let steps = blk.steps(c);
    let k_base = batch * k.stride(0) + hkv * k.stride(1);
    let v_base = batch * v.stride(0) + hkv * v.stride(1);

    let mut sh = Shared {
        p_s: SharedMemory::new(comptime!(bufs * BUF as usize)),
        v_s: SharedMemory::new(comptime!(bufs * BUF as usize)),
        a_s: SharedMemory::new(comptime!((bufs + 1) * VECS as usize)),
        mx_s: SharedMemory::new(comptime!(if planes { 1usize } else { UNITS as usize })),
        q_s: SharedMemory::new(comptime!(if given {
            1usize
        } else {
            (D_CHUNK * VECS) as usize
        })),
        k_s: SharedMemory::new(comptime!(if given {
            1usize
        } else {
            (D_CHUNK * BLOCK_K / 2) as usize
        })),
    };

    // The score unit's rows: mask/bias references and where they start in `q` (`X`); the
    // `Q` staging rows 4·(u / 4) .. of units 0..128.
    let mut refs = new_refs(4usize);
    let mut x_rows = Array::<usize>::new(4usize);
    let mut q_rows = Array::<usize>::new(4usize);
    let mut m = Array::<f32>::new(4usize);
    let mut l = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        let row = row0 + 4 * rg as usize + i;
        set_row(&mut refs, i, inputs, &group, row, seq_k, &args, c);
        x_rows[i] = group.offset(q, row);
        q_rows[i] = group.offset(q, row0 + 4 * (UNIT_POS / 4) as usize + i);
        m[i] = f32::min_value();
        l[i] = 0.0f32;
    }
    let mut acc = Array::<Vector<f32, Const<4>>>::new(16usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = Vector::new(0.0f32);
    }
    let mut pre_x = Array::<Vector<F, NV>>::new(comptime!(if given { 4 * per4 } else { 1usize }));
    let v_vecs = comptime!((BUF / ro.v_units) as usize);
    let mut pre_v = Array::<Vector<F, NV>>::new(comptime!(v_vecs * per4));
    if steps > 0 {
        load_step::<F, NV>(
            q,
            v,
            &mut pre_x,
            &mut pre_v,
            &x_rows,
            blk.kv_start,
            col0,
            v_base,
            seq_k,
            ro,
            given,
        );
    }

    for st in 0..steps {
        let j0 = blk.step_key(st, c);
        let full = blk.full_step(st, c);
        let mut parity = 0usize;
        if comptime!(bufs == 2) {
            parity = st % 2;
        }
        let pbuf = parity * BUF as usize;
        let abuf = parity * VECS as usize;

        // -- 1. the scores: s[ku·i + n] is row 4·rg + i, key j0 + ku·kg + n --
        let mut s = Array::<f32>::new(comptime!(4 * ku));
        if comptime!(given) {
            #[unroll]
            for i in 0..4usize {
                #[unroll]
                for n in 0..ku {
                    s[i * ku + n] = pre_at::<F, NV>(&pre_x, i, n);
                }
            }
        } else {
            query_key::<F, NV>(q, k, &mut sh, &mut s, &q_rows, k_base, j0, seq_k, c);
        }

        // -- 2. finished scores (invisible: the lowest value), row maxima, update, P --
        let mut step_max = Array::<f32>::new(4usize);
        #[unroll]
        for i in 0..4usize {
            step_max[i] = f32::min_value();
        }
        // Whole planes (given scores: the `V` units' planes skip it).
        if is_score {
            #[unroll]
            for i in 0..4usize {
                #[unroll]
                for n in 0..ku {
                    let key = j0 + ku * kg as usize + n;
                    let mut x = s[i * ku + n];
                    if comptime!(!given) {
                        x = score::<F>(mask, bias, &refs, i, x, key, seq_k, &args, c);
                    }
                    let ok = visible::<F>(mask, &refs, i, key, seq_q, seq_k, c, false)
                        && (full || visible::<F>(mask, &refs, i, key, seq_q, seq_k, c, true));
                    x = select(ok, x, f32::min_value());
                    s[i * ku + n] = x;
                    step_max[i] = f32::max(step_max[i], x);
                }
            }
        }
        let mut rmax = Array::<f32>::new(4usize);
        if comptime!(planes) {
            #[unroll]
            for i in 0..4usize {
                rmax[i] = row_reduce(step_max[i], ro.row_units, true);
            }
        } else {
            row_reduce_shared(&mut sh.mx_s, &step_max, &mut rmax, ro, true);
        }
        if is_score {
            let mut alpha = Vector::<f32, Const<4>>::empty();
            #[unroll]
            for i in 0..4usize {
                // The lazy rule of `crate::flash`: most steps keep the reference (α = 1).
                let mut a = 1.0f32;
                let m_new = next_reference(m[i], rmax[i], true);
                if m_new != m[i] {
                    a = rescale_factor(m[i], m_new);
                    m[i] = m_new;
                    l[i] *= a;
                }
                alpha[i] = a;
                #[unroll]
                for n in 0..ku {
                    // `P` replaces the score in place.
                    let x = s[i * ku + n];
                    let e = probability(x, m[i], x > f32::min_value());
                    s[i * ku + n] = e;
                    l[i] += e;
                }
            }
            #[unroll]
            for n in 0..ku {
                let key = ku * kg as usize + n;
                let mut vec = Vector::<f32, Const<4>>::empty();
                #[unroll]
                for i in 0..4usize {
                    vec[i] = s[i * ku + n];
                }
                sh.p_s[pbuf + key * VECS as usize + (rg as usize ^ (2 * (key / 4)))] = vec;
            }
            if kg == 0 {
                sh.a_s[abuf + rg as usize] = alpha;
            }
        }
        let first_v = comptime!(UNITS - ro.v_units);
        if UNIT_POS >= first_v {
            #[unroll]
            for e in 0..v_vecs {
                let idx = (UNIT_POS - first_v) as usize + e * ro.v_units as usize;
                let mut vec = Vector::<f32, Const<4>>::empty();
                #[unroll]
                for cc in 0..4usize {
                    vec[cc] = pre_at::<F, NV>(&pre_v, e, cc);
                }
                // Keys past the visible end: zeros (their P is 0; the clamped row may hold
                // anything).
                if !full && j0 + idx / VECS as usize >= kv_end {
                    vec = Vector::new(0.0f32);
                }
                sh.v_s[pbuf + idx] = vec;
            }
        }

        // -- 3. the next step's loads in flight, then O += P·V --
        let next = blk.step_key(usize::min(st + 1, steps - 1), c);
        load_step::<F, NV>(
            q, v, &mut pre_x, &mut pre_v, &x_rows, next, col0, v_base, seq_k, ro, given,
        );
        sync_cube();
        product_step(
            &mut acc, &sh.p_s, &sh.v_s, &sh.a_s, pbuf, abuf, ty, tx, true, false,
        );
    }

    // -- row sums and log-sum-exp, then normalise and store --
    let mut sums = Array::<f32>::new(4usize);
    if comptime!(planes) {
        #[unroll]
        for i in 0..4usize {
            sums[i] = row_reduce(l[i], ro.row_units, false);
        }
    } else {
        // The last step's maxima were read before its barrier.
        row_reduce_shared(&mut sh.mx_s, &l, &mut sums, ro, false);
    }
    let l_at = comptime!(bufs * VECS as usize);
    if is_score && kg == 0 {
        let mut vec = Vector::<f32, Const<4>>::empty();
        #[unroll]
        for i in 0..4usize {
            vec[i] = output_sum(m[i], sums[i], refs.sink[i], c);
            let row = row0 + 4 * rg as usize + i;
            if row < rows && blk.first_tile {
                let head = head0 + row / seq_q;
                let at =
                    batch * lse.stride(0) + head * lse.stride(1) + (row % seq_q) * lse.stride(2);
                lse[at] = row_lse(m[i], sums[i], refs.sink[i], c);
            }
        }
        sh.a_s[l_at + rg as usize] = vec;
    }
    sync_cube();
    #[unroll]
    for h in 0..2u32 {
        let totals = sh.a_s[l_at + (16 * h + ty) as usize];
        #[unroll]
        for i in 0..4u32 {
            let inv = inverse_sum(totals[i as usize]);
            let row = row0 + (64 * h + 4 * ty + i) as usize;
            if row < rows {
                let o_base = batch * out.stride(0)
                    + (head0 + row / seq_q) * out.stride(1)
                    + (row % seq_q) * out.stride(2);
                #[unroll]
                for g in 0..2u32 {
                    let vec = acc[((4 * h + i) * 2 + g) as usize];
                    #[unroll]
                    for qv in 0..per4 {
                        let col = col0 + (64 * g + 4 * tx) as usize + qv * nv;
                        if col < value_dim {
                            let mut o = Vector::<F, NV>::empty();
                            #[unroll]
                            for cc in 0..nv {
                                o[cc] = F::cast_from(vec[qv * nv + cc] * inv);
                            }
                            out[(o_base + col * out.stride(3)) / nv] = o;
                        }
                    }
                }
            }
        }
    }
}
