//! The split-KV decoding kernels: [`flash_decode()`] (one cube per key split of one (batch,
//! key/value head) and chunk of its query rows) and [`decode_merge()`] (the splits' partial
//! online-softmax states into the output and its log-sum-exp, FlashDecoding's second pass).
//!
//! Decoding reads every key and value once per key/value head and computes little per byte, so
//! the schedule is about memory: a cube's [`UNITS`] units form groups of `key_units` (8, or 16
//! for head dims from 128: [`DecodeConfig::key_units`]); a group reads one key row (`D`
//! elements, `key_units` vectors side by side: coalesced) per slot of a step,
//! [`DecodeConfig::keys`] slots per step, so a step reads `UNITS / key_units · keys`
//! consecutive keys and their values with every load issued before the first product. The group's units hold disjoint columns of the rows' queries (in registers) and of
//! their output accumulators; a score is the group's sum of its units' partial products
//! (plane shuffles, or shared memory where the device has no fixed plane of a multiple of 8).
//! Each group runs its own online softmax over its keys; the groups' states meet in shared
//! memory at the end (the same rescale as [`crate::flash::online`]), and the splits' in
//! [`decode_merge()`].
//!
//! Keys are addressed contiguously (`[B, Hkv, Sk, D]`, any strides) or through a block table
//! (a pool `[blocks, block_size, Hkv, D]` and `table [B, max_blocks]`): key `j` of batch `b`
//! lives in block `table[b, j / block_size]` at row `j % block_size`. Each batch has its own
//! length (`lengths [B]`), and its keys split evenly over the splits.

use cubecl::prelude::*;

use crate::flash::args::{ForwardOutputs, ScoreArgs};
use crate::flash::config::FlashConfig;
use crate::flash::keys::local_range;
use crate::flash::online::{inverse_sum, output_sum, rescale_factor, row_lse};
use crate::flash::scores::capped;

/// Units per cube of [`flash_decode()`].
pub const UNITS: u32 = 128;
/// Units per cube of [`decode_merge()`].
pub const MERGE_UNITS: u32 = 128;

/// The comptime configuration of [`flash_decode()`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeConfig {
    /// The score rules (causal, window, softcap, ALiBi, sinks, quiet; no mask, bias, dropout
    /// or packed sequences) and, in its tile, the padded head dims.
    pub flash: FlashConfig,
    /// Query rows per cube (of the `G·Sq` rows of a key/value head).
    pub rows: u32,
    /// Units that share one key row (8 or 16): fewer registers per unit for wide heads.
    pub key_units: u32,
    /// Vectors of `q`/`k` per unit (`head_dim / (key_units · vector)`).
    pub head_vecs: u32,
    /// Vectors of `v`/`out` per unit.
    pub value_vecs: u32,
    /// Keys are read through a block table.
    pub paged: bool,
    /// More than one split: the cube writes its partial state, not the output.
    pub split: bool,
    /// Group sums by plane shuffles (else through shared memory).
    pub planes: bool,
    /// Each batch's keys are read from `lengths` (else every batch has the cache's `S`).
    pub lengths: bool,
    /// Keys each group takes per step (its slots): the keys and values a unit has in flight.
    pub keys: u32,
}

/// What [`flash_decode()`] reads.
#[derive(CubeLaunch, CubeType)]
pub struct DecodeInputs<E: CubePrimitive> {
    /// Queries `[B, Hq, Sq, D]`.
    pub q: Tensor<E>,
    /// Keys: `[B, Hkv, Sk, D]`, or the pool `[blocks, block_size, Hkv, D]`.
    pub k: Tensor<E>,
    /// Values, as the keys with `Dv` columns.
    pub v: Tensor<E>,
    /// ALiBi slopes `[Hq]` (f32).
    pub slopes: Tensor<f32>,
    /// Attention-sink logits `[Hq]` (f32).
    pub sinks: Tensor<f32>,
    /// Keys of each batch `[B]` (u32).
    pub lengths: Tensor<u32>,
    /// Block table `[B, max_blocks]` (u32; read only when paged).
    pub table: Tensor<u32>,
}

/// The splits' partial states, written by [`flash_decode()`] and read by [`decode_merge()`]:
/// row `r = (b·Hq + h)·Sq + i`, split `s`.
#[derive(CubeLaunch, CubeType)]
pub struct DecodePartials {
    /// Unnormalised outputs `[rows · splits · Dv]` (f32).
    pub acc: Tensor<f32>,
    /// Reference maximum and sum `[rows · splits · 2]` (f32).
    pub ml: Tensor<f32>,
}

/// Where each slot `t` of group `g` reads its key and value rows in the step from key `j0`:
/// key `j0 + t·groups + g` (the split's first key `kb` where that is past its end `ke`), in `k`
/// and `v` contiguous `[B, H, S, ·]`, or through `table` into the pools `[blocks, block_size,
/// H, ·]` (one table lookup per key for both pools).
#[cube]
fn slot_offsets<E: CubePrimitive>(
    k: &Tensor<E>,
    v: &Tensor<E>,
    table: &Tensor<u32>,
    batch: usize,
    head: usize,
    j0: usize,
    kb: usize,
    ke: usize,
    g: usize,
    groups: usize,
    k_off: &mut Array<usize>,
    v_off: &mut Array<usize>,
    #[comptime] kpg: usize,
    #[comptime] paged: bool,
) {
    #[unroll]
    for t in 0..kpg {
        let key = j0 + t * groups + g;
        let key = select(key < ke, key, kb);
        if comptime!(paged) {
            let bs = k.shape(1);
            let mut row = batch;
            if comptime!(crate::mutation::paged_lookup()) {
                row = 0;
            }
            let entry = table[row * table.stride(0) + (key / bs) * table.stride(1)] as usize;
            // The host checks every entry against the pool; the clamp keeps reads inside it.
            let block = usize::min(entry, k.shape(0) - 1);
            let at = key % bs;
            k_off[t] = block * k.stride(0) + at * k.stride(1) + head * k.stride(2);
            v_off[t] = block * v.stride(0) + at * v.stride(1) + head * v.stride(2);
        } else {
            k_off[t] = batch * k.stride(0) + head * k.stride(1) + key * k.stride(2);
            v_off[t] = batch * v.stride(0) + head * v.stride(1) + key * v.stride(2);
        }
    }
}

/// Loads each slot's row of `t` (`vecs` vectors per unit of a group of `ku`, columns past
/// `dim` clamped onto its last vector) from `offsets` into `regs`.
#[cube]
fn load_slots<F: Float, NV: Size>(
    t: &Tensor<Vector<F, NV>>,
    offsets: &Array<usize>,
    regs: &mut Array<Vector<F, NV>>,
    sub: usize,
    dim: usize,
    #[comptime] kpg: usize,
    #[comptime] vecs: usize,
    #[comptime] ku: usize,
) {
    let nv = NV::value();
    #[unroll]
    for slot in 0..kpg {
        #[unroll]
        for s in 0..vecs {
            let col = usize::min((s * ku + sub) * nv, dim - nv);
            regs[slot * vecs + s] = t[(offsets[slot] + col * t.stride(3)) / nv];
        }
    }
}

/// Sums each of `vals` over the `ku` units of a group: by plane shuffles, or through `red`
/// (every unit of the cube must call this then).
#[cube]
fn group_sums(
    vals: &mut Array<f32>,
    red: &mut SharedMemory<f32>,
    #[comptime] n: usize,
    #[comptime] ku: u32,
    #[comptime] planes: bool,
) {
    if comptime!(planes) {
        #[unroll]
        for i in 0..n {
            let mut x = vals[i];
            x += plane_shuffle_xor(x, 1u32);
            x += plane_shuffle_xor(x, 2u32);
            x += plane_shuffle_xor(x, 4u32);
            if comptime!(ku == 16) {
                x += plane_shuffle_xor(x, 8u32);
            }
            vals[i] = x;
        }
    } else {
        let base = (UNIT_POS / ku * ku) as usize;
        #[unroll]
        for i in 0..n {
            red[i * UNITS as usize + UNIT_POS as usize] = vals[i];
        }
        sync_cube();
        #[unroll]
        for i in 0..n {
            let mut x = 0.0f32;
            #[unroll]
            for u in 0..ku as usize {
                x += red[i * UNITS as usize + base + u];
            }
            vals[i] = x;
        }
        sync_cube();
    }
}

/// Register-limited split-KV schedule (NOTES §6): two cubes per SM at the most registers.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(2);

/// Attention of the last `Sq` positions of each batch against its `lengths[b]` keys, split
/// over the grid's x axis (module docs). Grid: `(splits, row chunks of G·Sq, B·Hkv)`,
/// [`UNITS`] units. Writes `out`, `lse` with one split; the partials otherwise.
#[cube(launch_unchecked)]
pub fn flash_decode<F: Float, NV: Size>(
    inputs: &DecodeInputs<Vector<F, NV>>,
    outputs: &mut ForwardOutputs<F>,
    partials: &mut DecodePartials,
    args: ScoreArgs,
    #[comptime] d: DecodeConfig,
    #[define(F)] _dtype: StorageType,
) {
    let c = comptime!(d.flash);
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let table = &inputs.table;
    let nv = NV::value();
    let rc = comptime!(d.rows as usize);
    let hv = comptime!(d.head_vecs as usize);
    let vv = comptime!(d.value_vecs as usize);
    let kpg = comptime!(d.keys as usize);
    let ku = comptime!(d.key_units);
    let groups = comptime!((UNITS / d.key_units) as usize);
    let step_keys = comptime!(groups * d.keys as usize);
    let width = comptime!(vv * d.key_units as usize * nv);

    let split = CUBE_POS_X as usize;
    let splits = CUBE_COUNT_X as usize;
    let mut heads_kv = k.shape(1);
    if comptime!(d.paged) {
        heads_kv = k.shape(2);
    }
    let batch = CUBE_POS_Z as usize / heads_kv;
    let hkv = CUBE_POS_Z as usize % heads_kv;
    let (heads_q, seq_q) = (q.shape(1), q.shape(2));
    let group = heads_q / heads_kv;
    let rows = group * seq_q;
    let row0 = CUBE_POS_Y as usize * rc;
    let head_dim = q.shape(3);
    let value_dim = v.shape(3);
    // The batch's keys, at most the cache's capacity.
    let mut len = k.shape(2);
    if comptime!(d.paged) {
        len = table.shape(1) * k.shape(1);
    }
    if comptime!(d.lengths) {
        len = usize::min(
            len,
            inputs.lengths[batch * inputs.lengths.stride(0)] as usize,
        );
    }
    let g = (UNIT_POS / ku) as usize;
    let sub = (UNIT_POS % ku) as usize;

    // -- the rows: queries in registers (f32), key ranges, ALiBi terms, the cube's keys --
    let mut qr = Array::<f32>::new(comptime!(rc * hv * nv));
    let mut starts = Array::<usize>::new(rc);
    let mut ends = Array::<usize>::new(rc);
    let mut slope = Array::<f32>::new(rc);
    let mut diag = Array::<f32>::new(rc);
    let mut lo = len;
    let mut hi = 0usize;
    #[unroll]
    for r in 0..rc {
        let row = usize::min(row0 + r, rows - 1);
        let head = hkv * group + row / seq_q;
        let pos = row % seq_q;
        let keys = local_range(pos, seq_q, len, &args, c);
        starts[r] = keys.start;
        ends[r] = keys.end;
        if row0 + r < rows {
            lo = usize::min(lo, keys.start);
            hi = usize::max(hi, keys.end);
        }
        slope[r] = 0.0f32;
        diag[r] = 0.0f32;
        if comptime!(c.rules.alibi) {
            slope[r] = inputs.slopes[head * inputs.slopes.stride(0)];
            diag[r] = f32::cast_from(pos + len) - f32::cast_from(seq_q);
        }
        let q_at = batch * q.stride(0) + head * q.stride(1) + pos * q.stride(2);
        #[unroll]
        for s in 0..hv {
            let col = (s * ku as usize + sub) * nv;
            let vec = q[(q_at + usize::min(col, head_dim - nv) * q.stride(3)) / nv];
            #[unroll]
            for e in 0..nv {
                qr[(r * hv + s) * nv + e] = select(col < head_dim, f32::cast_from(vec[e]), 0.0f32);
            }
        }
    }
    // This split's share of the batch's keys, inside the rows' ranges.
    let share = len.div_ceil(splits);
    let share = share.div_ceil(step_keys) * step_keys;
    let kb = usize::max(split * share, lo);
    let ke = usize::min(usize::min(split * share + share, len), hi);
    let mut steps = 0usize;
    if ke > kb {
        steps = (ke - kb).div_ceil(step_keys);
    }

    let mut red = SharedMemory::<f32>::new(comptime!(if d.planes {
        1usize
    } else {
        rc * d.keys as usize * UNITS as usize
    }));
    let mut m = Array::<f32>::new(rc);
    let mut l = Array::<f32>::new(rc);
    let mut acc = Array::<f32>::new(comptime!(rc * vv * nv));
    #[unroll]
    for r in 0..rc {
        m[r] = f32::min_value();
        l[r] = 0.0f32;
    }
    #[unroll]
    for i in 0..comptime!(rc * vv * nv) {
        acc[i] = 0.0f32;
    }

    let mut kreg = Array::<Vector<F, NV>>::new(comptime!(kpg * hv));
    let mut vreg = Array::<Vector<F, NV>>::new(comptime!(kpg * vv));
    let mut k_off = Array::<usize>::new(kpg);
    let mut v_off = Array::<usize>::new(kpg);
    let mut sc = Array::<f32>::new(comptime!(rc * kpg));
    let kuz = comptime!(ku as usize);
    for st in 0..steps {
        let j0 = kb + st * step_keys;
        let (kk, vo) = (&mut k_off, &mut v_off);
        slot_offsets(
            k, v, table, batch, hkv, j0, kb, ke, g, groups, kk, vo, kpg, d.paged,
        );
        load_slots(k, &k_off, &mut kreg, sub, head_dim, kpg, hv, kuz);
        load_slots(v, &v_off, &mut vreg, sub, value_dim, kpg, vv, kuz);
        // -- the scores: each unit's share of q·k, summed over the group --
        #[unroll]
        for r in 0..rc {
            #[unroll]
            for t in 0..kpg {
                let mut x = 0.0f32;
                #[unroll]
                for s in 0..hv {
                    let kv = kreg[t * hv + s];
                    #[unroll]
                    for e in 0..nv {
                        x += qr[(r * hv + s) * nv + e] * f32::cast_from(kv[e]);
                    }
                }
                sc[r * kpg + t] = x;
            }
        }
        group_sums(&mut sc, &mut red, comptime!(rc * kpg), ku, d.planes);
        // -- the online softmax of each row over the group's keys, and O += P·V --
        #[unroll]
        for r in 0..rc {
            let mut step_max = f32::min_value();
            let mut p = Array::<f32>::new(kpg);
            let mut vis = Array::<bool>::new(kpg);
            #[unroll]
            for t in 0..kpg {
                let key = j0 + t * groups + g;
                let mut s = capped(sc[r * kpg + t], &args, c);
                if comptime!(c.rules.alibi) {
                    s -= slope[r] * f32::abs(f32::cast_from(key) - diag[r]);
                }
                let ok = key < ke && key >= starts[r] && key < ends[r];
                sc[r * kpg + t] = s;
                vis[t] = ok;
                step_max = select(ok, f32::max(step_max, s), step_max);
            }
            let m_new = f32::max(m[r], step_max);
            let alpha = rescale_factor(m[r], m_new);
            m[r] = m_new;
            let mut psum = 0.0f32;
            #[unroll]
            for t in 0..kpg {
                p[t] = select(vis[t], f32::exp(sc[r * kpg + t] - m_new), 0.0f32);
                psum += p[t];
            }
            l[r] = l[r] * alpha + psum;
            #[unroll]
            for s in 0..vv {
                #[unroll]
                for e in 0..nv {
                    let mut o = acc[(r * vv + s) * nv + e] * alpha;
                    #[unroll]
                    for t in 0..kpg {
                        o += p[t] * f32::cast_from(vreg[t * vv + s][e]);
                    }
                    acc[(r * vv + s) * nv + e] = o;
                }
            }
        }
    }

    // -- the groups' states meet in shared memory --
    let mut sm_ml = SharedMemory::<f32>::new(comptime!(2 * groups * rc));
    let mut sm_acc = SharedMemory::<f32>::new(comptime!(groups * rc * width));
    #[unroll]
    for r in 0..rc {
        if sub == 0 {
            sm_ml[2 * (g * rc + r)] = m[r];
            sm_ml[2 * (g * rc + r) + 1] = l[r];
        }
        #[unroll]
        for s in 0..vv {
            #[unroll]
            for e in 0..nv {
                let col = (s * ku as usize + sub) * nv + e;
                sm_acc[(g * rc + r) * width + col] = acc[(r * vv + s) * nv + e];
            }
        }
    }
    sync_cube();
    let per_unit = comptime!((rc * vv * d.key_units as usize * nv).div_ceil(UNITS as usize));
    for i in 0..per_unit {
        let idx = UNIT_POS as usize + i * UNITS as usize;
        let r = idx / width;
        let col = idx % width;
        let row = row0 + r;
        if r < rc && row < rows && col < value_dim {
            let mut big = f32::min_value();
            for gg in 0..groups {
                big = f32::max(big, sm_ml[2 * (gg * rc + r)]);
            }
            let mut total = 0.0f32;
            let mut o = 0.0f32;
            for gg in 0..groups {
                let w = f32::exp(sm_ml[2 * (gg * rc + r)] - big);
                total += sm_ml[2 * (gg * rc + r) + 1] * w;
                o += sm_acc[(gg * rc + r) * width + col] * w;
            }
            let head = hkv * group + row / seq_q;
            let pos = row % seq_q;
            let flat = (batch * heads_q + head) * seq_q + pos;
            if comptime!(d.split) {
                partials.acc[(flat * splits + split) * value_dim + col] = o;
                if col == 0 {
                    partials.ml[(flat * splits + split) * 2] = big;
                    partials.ml[(flat * splits + split) * 2 + 1] = total;
                }
            } else {
                let mut sink = 0.0f32;
                if comptime!(c.rules.sinks) {
                    sink = inputs.sinks[head * inputs.sinks.stride(0)];
                }
                let out = &mut outputs.out;
                let at = batch * out.stride(0) + head * out.stride(1) + pos * out.stride(2);
                out[at + col * out.stride(3)] =
                    F::cast_from(o * inverse_sum(output_sum(big, total, sink, c)));
                if col == 0 {
                    let lse = &mut outputs.lse;
                    lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)] =
                        row_lse(big, total, sink, c);
                }
            }
        }
    }
}

/// The merge of the splits' states streams: four cubes per SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const MERGE_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(4);

/// The output and log-sum-exp of each query row from the splits' partial states (module
/// docs). Grid: one cube per row `(b·Hq + h)·Sq + i` (x, then y), [`MERGE_UNITS`] units, each
/// taking columns `u, u + MERGE_UNITS, …`.
#[cube(launch_unchecked)]
pub fn decode_merge<F: Float>(
    partials: &DecodePartials,
    sinks: &Tensor<f32>,
    outputs: &mut ForwardOutputs<F>,
    #[comptime] c: FlashConfig,
    #[define(F)] _dtype: StorageType,
) {
    let out = &mut outputs.out;
    let (heads_q, seq_q, value_dim) = (out.shape(1), out.shape(2), out.shape(3));
    let flat = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let splits = partials.ml.shape(0) / (2 * out.shape(0) * heads_q * seq_q);
    if flat < out.shape(0) * heads_q * seq_q {
        let mut used = splits;
        if comptime!(crate::mutation::drop_split()) {
            used = splits - 1;
        }
        let ml = &partials.ml;
        let mut big = f32::min_value();
        for s in 0..used {
            big = f32::max(big, ml[(flat * splits + s) * 2]);
        }
        let mut total = 0.0f32;
        for s in 0..used {
            total += ml[(flat * splits + s) * 2 + 1] * f32::exp(ml[(flat * splits + s) * 2] - big);
        }
        let head = (flat / seq_q) % heads_q;
        let batch = flat / (seq_q * heads_q);
        let pos = flat % seq_q;
        let mut sink = 0.0f32;
        if comptime!(c.rules.sinks) {
            sink = sinks[head * sinks.stride(0)];
        }
        let inv = inverse_sum(output_sum(big, total, sink, c));
        let at = batch * out.stride(0) + head * out.stride(1) + pos * out.stride(2);
        for i in 0..value_dim.div_ceil(MERGE_UNITS as usize) {
            let col = UNIT_POS as usize + i * MERGE_UNITS as usize;
            let mut o = 0.0f32;
            for s in 0..used {
                let w = f32::exp(ml[(flat * splits + s) * 2] - big);
                o += partials.acc[(flat * splits + s) * value_dim + col] * w;
            }
            if col < value_dim {
                out[at + col * out.stride(3)] = F::cast_from(o * inv);
            }
        }
        if UNIT_POS == 0 {
            let lse = &mut outputs.lse;
            lse[batch * lse.stride(0) + head * lse.stride(1) + pos * lse.stride(2)] =
                row_lse(big, total, sink, c);
        }
    }
}
