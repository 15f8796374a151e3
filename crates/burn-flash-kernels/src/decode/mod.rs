//! Decoding: attention of a few query rows against long key/value caches, contiguous or paged
//! ([`kernel`]: split-KV, FlashDecoding's two passes), and appending to those caches with an
//! optional RoPE rotation on the way ([`append`]).
//!
//! - [`launch_decode`]: `q [B, Hq, Sq, D]` against each batch's first `lengths[b]` keys of a
//!   contiguous cache `[B, Hkv, S_max, D]` or of a block pool `[blocks, block_size, Hkv, D]`
//!   through `table [B, max_blocks]`; the query rows are each batch's last `Sq` positions
//!   (bottom-right, as [`crate::attention`]'s causal mask and window). Every score rule of
//!   attention but the mask, the bias, dropout and packed sequences.
//! - [`launch_append`]: the new keys and values `[B, Hkv, S, D]` written at positions
//!   `lengths[b] ..` of either cache, in place, keys (and optionally queries) rotated.
//!
//! [`crate::attention::plan_attention`] also plans the decoding kernel for contiguous caches
//! ([`crate::attention::AttentionKernel::SplitDecode`]) where the query rows of a key/value head
//! are few ([`DECODE_ROWS`]).

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod append;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod kernel;

use cubecl::{CubeCount, CubeDim, prelude::*};

use crate::attention::options::{
    AttentionDims, AttentionError, AttentionFeatures, AttentionKernel, AttentionOptions,
    DecodeSchedule, attention_dims, validate,
};
use crate::flash::args::ForwardOutputsLaunch;
use crate::flash::config::{FlashConfig, ScoreSource, Tile};
use crate::tensor::TensorRef;
use append::{AppendConfig, AppendSourcesLaunch, AppendTargetsLaunch};
use kernel::{DecodeConfig, DecodeInputsLaunch, DecodePartialsLaunch};

/// Most query rows per key/value head (`G·Sq`) for which the plan takes the decoding kernel.
pub const DECODE_ROWS: usize = 16;
/// Fewest keys a split takes.
pub const MIN_SPLIT_KEYS: usize = 256;
/// Most splits of a batch's keys.
pub const MAX_SPLITS: usize = 128;

/// The block table of a paged cache as the kernels read it.
#[derive(Debug, Clone, Copy)]
pub struct Paged<'a> {
    /// `[B, max_blocks]`, u32 (or i32 of non-negative values), every entry below the pool's
    /// block count (the caller's to check: reading it here would wait for the device).
    pub table: TensorRef<'a>,
}

/// The tensors of a decoding call.
#[derive(Debug, Clone, Copy)]
pub struct DecodeTensors<'a> {
    /// Queries `[B, Hq, Sq, D]`.
    pub q: TensorRef<'a>,
    /// Keys: `[B, Hkv, S_max, D]`, or with `paged` the pool `[blocks, block_size, Hkv, D]`.
    pub k: TensorRef<'a>,
    /// Values, as the keys with `Dv` columns.
    pub v: TensorRef<'a>,
    /// The block table, for a paged cache.
    pub paged: Option<Paged<'a>>,
    /// Keys of each batch `[B]` (u32 / i32), each at least `Sq` under a causal mask and at most
    /// the cache's capacity (the caller's to check); `None`: every batch has `S_max` (contiguous
    /// caches only).
    pub lengths: Option<TensorRef<'a>>,
    /// ALiBi slopes `[Hq]` (f32).
    pub slopes: Option<TensorRef<'a>>,
    /// Attention-sink logits `[Hq]` (f32).
    pub sinks: Option<TensorRef<'a>>,
    /// The output `[B, Hq, Sq, Dv]`.
    pub out: TensorRef<'a>,
    /// The row log-sum-exp `[B, Hq, Sq]` (f32).
    pub lse: TensorRef<'a>,
}

/// The launch [`plan_decode`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodePlan {
    /// Key splits per batch (1: no merge pass).
    pub splits: usize,
    /// Query rows per cube.
    pub rows: usize,
    /// Cubes along `(splits, row chunks of G·Sq, B·Hkv)`.
    pub cubes: (usize, usize, usize),
    /// The score rules and padded head dims.
    pub config: FlashConfig,
}

/// Why the decoding kernel cannot take a call with `features` and `options` (`None`: it can).
pub fn unavailable(features: AttentionFeatures, options: &AttentionOptions) -> Option<String> {
    let why = if features.mask || features.bias {
        "it reads no mask or bias"
    } else if options.dropout.is_some() {
        "it applies no dropout"
    } else if features.varlen {
        "it takes no packed sequences (one length per batch instead)"
    } else if options.block_k.is_some() {
        "its keys per step are fixed"
    } else {
        return None;
    };
    Some(why.to_string())
}

/// The plan for `dims` (`seq_k`: the keys of the longest batch, or the cache's capacity) on
/// `client`: rows per cube from the head dims (each unit holds `rows · D / key_units` query and
/// accumulator values), then enough splits for the schedule's cubes per multiprocessor
/// ([`DecodeSchedule`], 16 by default),
/// each of at least [`MIN_SPLIT_KEYS`].
pub fn plan_decode<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> Result<DecodePlan, AttentionError> {
    validate(client, dims, dtype, options)?;
    if let Some(reason) = unavailable(features, options) {
        return Err(AttentionError::KernelUnavailable {
            kernel: AttentionKernel::SplitDecode,
            reason,
        });
    }
    let ku = key_units(dims.head_dim, dims.value_dim);
    let key_units = ku as usize;
    let head_dim = dims.head_dim.next_multiple_of(key_units);
    let value_dim = dims.value_dim.next_multiple_of(key_units);
    let per_unit = head_dim.max(value_dim) / key_units;
    let group_rows = (dims.group() * dims.seq_q).max(1);
    let planes = planes(client, ku);
    let DecodeSchedule {
        keys_per_step: keys,
        cubes_per_sm,
    } = options.decode;
    let max_shared = client.properties().hardware.max_shared_memory_size;
    let mut rows = (64 / per_unit).clamp(1, 8).min(group_rows);
    while rows > 1 && shared_for(rows, dims.value_dim, ku, keys, planes) > max_shared {
        rows -= 1;
    }
    let chunks = group_rows.div_ceil(rows);
    let hw = &client.properties().hardware;
    let sms = hw.num_streaming_multiprocessors.unwrap_or(16) as usize;
    let base = (dims.batch * dims.heads_kv * chunks).max(1);
    let splits = (cubes_per_sm * sms)
        .div_ceil(base)
        .min(dims.seq_k.div_ceil(MIN_SPLIT_KEYS))
        .clamp(1, MAX_SPLITS);
    let cubes = (splits, chunks, dims.batch * dims.heads_kv);
    if shared_for(rows, dims.value_dim, ku, keys, planes) > max_shared {
        return Err(AttentionError::KernelUnavailable {
            kernel: AttentionKernel::SplitDecode,
            reason: format!("needs more shared memory than the device's {max_shared} B"),
        });
    }
    let max = hw.max_cube_count;
    if cubes.1 > max.1 as usize || cubes.2 > max.2 as usize {
        return Err(AttentionError::TooLarge { cubes });
    }
    let config = FlashConfig::new(
        ScoreSource::QueryKey,
        options.rules(features),
        Tile {
            block_q: rows as u32,
            row_tiles: 1,
            block_k: kernel::UNITS / ku * keys,
            head_dim: head_dim as u32,
            value_dim: value_dim as u32,
        },
    );
    Ok(DecodePlan {
        splits,
        rows,
        cubes,
        config,
    })
}

/// Units per key row for head dims `D`, `Dv`: 16 from 128 columns (each unit then holds
/// `D / 16` of every query row and accumulator, leaving registers for the loads in flight),
/// 8 below.
pub fn key_units(head_dim: usize, value_dim: usize) -> u32 {
    if head_dim.max(value_dim) >= 128 {
        16
    } else {
        8
    }
}

/// Whether `client` sums a key group's products by plane shuffles: plane operations over a
/// fixed plane width that is a multiple of the group's `key_units` (else through shared
/// memory).
pub fn planes<R: Runtime>(client: &ComputeClient<R>, key_units: u32) -> bool {
    let props = client.properties();
    let hw = &props.hardware;
    props.features.plane.contains(cubecl::features::Plane::Ops)
        && hw.plane_size_min == hw.plane_size_max
        && hw.plane_size_max.is_multiple_of(key_units)
}

/// Shared memory of the decoding kernel with `rows` rows per cube, `Dv` columns and
/// `key_units` per key and `keys` per group and step, in bytes: the groups' row states and
/// accumulators (the value width rounded up to the widest vector row of a group, 8 elements
/// per unit), and the group sums' scratch without plane shuffles.
fn shared_for(rows: usize, value_dim: usize, key_units: u32, keys: u32, planes: bool) -> usize {
    let groups = (kernel::UNITS / key_units) as usize;
    let width = value_dim.next_multiple_of(8 * key_units as usize);
    let sums = if planes {
        1
    } else {
        rows * (keys * kernel::UNITS) as usize
    };
    (2 * groups * rows + groups * rows * width + sums) * 4
}

/// The keys each group of `key_units` takes per step under `config`: a step's `block_k` keys are
/// `UNITS / key_units` groups of that many slots.
fn keys_per_group(config: &FlashConfig, key_units: u32) -> u32 {
    config.block_k * key_units / kernel::UNITS
}

/// Shared memory of the decoding kernel under `plan` on `client`, in bytes (at most).
pub fn shared_bytes<R: Runtime>(client: &ComputeClient<R>, plan: &DecodePlan) -> usize {
    let c = plan.config;
    let ku = key_units(c.head_dim as usize, c.value_dim as usize);
    let keys = keys_per_group(&c, ku);
    shared_for(
        plan.rows,
        c.value_dim as usize,
        ku,
        keys,
        planes(client, ku),
    )
}

/// The widest vector (16 bytes at most, one the device loads) that divides `D`, `Dv` and
/// every stride but the last of `q`, `k`, `v`, whose last stride is 1.
fn vector_width<R: Runtime>(
    client: &ComputeClient<R>,
    t: &DecodeTensors<'_>,
    elem: usize,
) -> usize {
    let sizes: Vec<usize> = client.io_optimized_vector_sizes(elem).collect();
    [8usize, 4, 2]
        .into_iter()
        .filter(|&n| n * elem <= 16 && sizes.contains(&n))
        .find(|&n| {
            [&t.q, &t.k, &t.v].iter().all(|x| {
                x.strides[3] == 1
                    && x.shape[3].is_multiple_of(n)
                    && x.strides[..3].iter().all(|s| s.is_multiple_of(n))
            })
        })
        .unwrap_or(1)
}

fn shape_error(arg: &'static str, expected: String, got: &[usize]) -> AttentionError {
    AttentionError::ShapeMismatch {
        arg,
        expected,
        got: got.to_vec(),
    }
}

/// The sizes of a decoding call, with `seq_k` the cache's capacity per batch, after checking
/// every shape.
pub fn decode_dims(t: &DecodeTensors<'_>) -> Result<AttentionDims, AttentionError> {
    for (name, x) in [("q", &t.q), ("k", &t.k), ("v", &t.v)] {
        if x.shape.len() != 4 || x.strides.len() != 4 {
            return Err(shape_error(name, "a 4-D tensor".into(), x.shape));
        }
    }
    let (q, k, v) = (t.q.shape, t.k.shape, t.v.shape);
    let dims = match &t.paged {
        None => attention_dims(&t.q, &t.k, &t.v)?,
        Some(p) => {
            let [blocks, block_size, heads_kv] = [k[0], k[1], k[2]];
            if v[..3] != k[..3] {
                return Err(shape_error(
                    "v",
                    format!("[{blocks}, {block_size}, {heads_kv}, Dv] (the key pool's blocks)"),
                    v,
                ));
            }
            if p.table.shape.len() != 2 || p.table.shape[0] != q[0] {
                return Err(shape_error(
                    "table",
                    format!("[{}, max_blocks]", q[0]),
                    p.table.shape,
                ));
            }
            if k[3] != q[3] {
                return Err(shape_error(
                    "k",
                    format!("[blocks, block_size, Hkv, {}]", q[3]),
                    k,
                ));
            }
            AttentionDims {
                batch: q[0],
                heads_q: q[1],
                heads_kv,
                seq_q: q[2],
                seq_k: p.table.shape[1] * block_size,
                head_dim: q[3],
                value_dim: v[3],
            }
        }
    };
    match &t.lengths {
        Some(l) if l.shape != [dims.batch] => {
            return Err(shape_error("lengths", format!("[{}]", dims.batch), l.shape));
        }
        None if t.paged.is_some() => {
            return Err(AttentionError::InvalidOption {
                reason: "a paged cache needs the lengths of its sequences".into(),
            });
        }
        _ => {}
    }
    if t.out.shape != dims.out_shape() {
        return Err(shape_error(
            "out",
            format!("{:?}", dims.out_shape()),
            t.out.shape,
        ));
    }
    if t.lse.shape != dims.lse_shape() {
        return Err(shape_error(
            "lse",
            format!("{:?}", dims.lse_shape()),
            t.lse.shape,
        ));
    }
    for (name, x) in [("slopes", &t.slopes), ("sinks", &t.sinks)] {
        if let Some(x) = x
            && x.shape != [dims.heads_q]
        {
            return Err(shape_error(name, format!("[{}]", dims.heads_q), x.shape));
        }
    }
    Ok(dims)
}

/// Attention of `t.q` against the caches (module docs), planned by [`plan_decode`]. Returns
/// the plan; nothing is launched when an error is returned, nor for an empty output.
pub fn launch_decode<R: Runtime>(
    client: &ComputeClient<R>,
    t: DecodeTensors<'_>,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<DecodePlan, AttentionError> {
    crate::cache::ensure_linked();
    let dims = decode_dims(&t)?;
    let features = AttentionFeatures {
        alibi: t.slopes.is_some(),
        sinks: t.sinks.is_some(),
        ..Default::default()
    };
    let plan = plan_decode(client, dims, dtype, features, options)?;
    if dims.out_shape().contains(&0) {
        return Ok(plan);
    }
    // SAFETY: the shapes were checked above and describe the caller's buffers.
    unsafe { launch_planned(client, &t, &plan, dtype, options) };
    Ok(plan)
}

/// A tensor argument of `t` as it is.
fn whole<R: Runtime>(t: &TensorRef<'_>) -> TensorArg<R> {
    // SAFETY: the shape and strides describe the caller's buffer.
    unsafe { TensorArg::from_raw_parts(t.handle.clone(), t.strides.into(), t.shape.into()) }
}

/// Launches `plan` (and the merge where it splits).
///
/// # Safety
/// The tensors' shapes and strides describe their buffers and fit [`decode_dims`].
pub(crate) unsafe fn launch_planned<R: Runtime>(
    client: &ComputeClient<R>,
    t: &DecodeTensors<'_>,
    plan: &DecodePlan,
    dtype: StorageType,
    options: &AttentionOptions,
) {
    let vector = vector_width(client, t, dtype.size());
    let ku = key_units(t.q.shape[3], t.v.shape[3]);
    let head_vecs = t.q.shape[3].div_ceil(ku as usize * vector);
    let value_vecs = t.v.shape[3].div_ceil(ku as usize * vector);
    let hw = &client.properties().hardware;
    let planes = planes(client, ku);
    let split = plan.splits > 1;
    let lengths = t.lengths.is_some();
    let d = DecodeConfig {
        flash: plan.config,
        rows: plan.rows as u32,
        key_units: ku,
        head_vecs: head_vecs as u32,
        value_vecs: value_vecs as u32,
        paged: t.paged.is_some(),
        split,
        planes,
        lengths,
        keys: keys_per_group(&plan.config, ku),
    };
    // Absent tensors are never read: `lse` (f32) stands in for f32 ones; the u32 ones are
    // read only when given, so `lse`'s buffer stands in for them as well.
    let or_lse = |x: &Option<TensorRef<'_>>| x.as_ref().map_or(whole::<R>(&t.lse), whole::<R>);
    let table = t.paged.map(|p| p.table);
    let rows_total = dims_rows(t);
    let (acc, ml) = if split {
        let n = rows_total * plan.splits;
        (client.empty(n * t.v.shape[3] * 4), client.empty(n * 2 * 4))
    } else {
        (client.empty(4), client.empty(8))
    };
    let flat = |h: &cubecl::server::Handle, len: usize| {
        // SAFETY: a fresh contiguous buffer of `len` f32.
        unsafe { TensorArg::from_raw_parts(h.clone(), [1usize].into(), [len].into()) }
    };
    let n_acc = if split {
        rows_total * plan.splits * t.v.shape[3]
    } else {
        1
    };
    let n_ml = if split {
        rows_total * plan.splits * 2
    } else {
        2
    };
    // The decoding kernel reads no dropout (its rules have none).
    let args = options.scalars().arg::<R>();
    let count = CubeCount::Static(
        plan.cubes.0 as u32,
        plan.cubes.1 as u32,
        plan.cubes.2 as u32,
    );
    // SAFETY: every index is bounds-checked or clamped against the shapes passed here, which
    // describe the caller's buffers; `vector` divides the rows and strides of `q`, `k`, `v`;
    // block entries are clamped to the pool.
    unsafe {
        kernel::flash_decode::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(kernel::UNITS),
            vector,
            DecodeInputsLaunch::new(
                whole(&t.q),
                whole(&t.k),
                whole(&t.v),
                or_lse(&t.slopes),
                or_lse(&t.sinks),
                or_lse(&t.lengths),
                or_lse(&table),
            ),
            ForwardOutputsLaunch::new(whole(&t.out), whole(&t.lse)),
            DecodePartialsLaunch::new(flat(&acc, n_acc), flat(&ml, n_ml)),
            args,
            d,
            dtype,
        );
        if split {
            let max_x = hw.max_cube_count.0 as usize;
            let y = rows_total.div_ceil(max_x);
            kernel::decode_merge::launch_unchecked::<R>(
                client,
                CubeCount::Static(rows_total.div_ceil(y) as u32, y as u32, 1),
                CubeDim::new_1d(kernel::MERGE_UNITS),
                DecodePartialsLaunch::new(flat(&acc, n_acc), flat(&ml, n_ml)),
                or_lse(&t.sinks),
                ForwardOutputsLaunch::new(whole(&t.out), whole(&t.lse)),
                plan.config,
                dtype,
            );
        }
    }
}

/// Query rows of a call, `B·Hq·Sq`.
fn dims_rows(t: &DecodeTensors<'_>) -> usize {
    t.q.shape[0] * t.q.shape[1] * t.q.shape[2]
}

/// The tensors of an append ([`launch_append`]).
#[derive(Debug, Clone, Copy)]
pub struct AppendTensors<'a> {
    /// New keys `[B, Hkv, S, D]`.
    pub k_new: TensorRef<'a>,
    /// New values `[B, Hkv, S, Dv]`.
    pub v_new: TensorRef<'a>,
    /// The key cache (written in place): `[B, Hkv, S_max, D]` or a pool.
    pub k: TensorRef<'a>,
    /// The value cache (written in place).
    pub v: TensorRef<'a>,
    /// The block table, for pools.
    pub paged: Option<Paged<'a>>,
    /// Keys already cached per batch `[B]` (u32 / i32).
    pub lengths: TensorRef<'a>,
    /// RoPE, where asked.
    pub rope: Option<Rope<'a>>,
}

/// A RoPE rotation on append.
#[derive(Debug, Clone, Copy)]
pub struct Rope<'a> {
    /// Cosines `[positions, R/2]` (f32), `R ≤ D` the rotary dims.
    pub cos: TensorRef<'a>,
    /// Sines, as the cosines.
    pub sin: TensorRef<'a>,
    /// Pairs `(2i, 2i + 1)` (burn-nn); halves `(i, i + R/2)` otherwise (GPT-NeoX).
    pub interleaved: bool,
    /// Queries `[B, Hq, S, D]` to rotate too, and where to write them.
    pub q: Option<(TensorRef<'a>, TensorRef<'a>)>,
}

/// Writes `t.k_new`, `t.v_new` into the caches at positions `lengths[b] ..` (module docs).
/// The positions must lie inside the cache (for a pool, inside blocks the table lists) and,
/// with RoPE, below the tables' positions: the caller's to check, as the lengths live on the
/// device. Nothing is launched when an error is returned.
pub fn launch_append<R: Runtime>(
    client: &ComputeClient<R>,
    t: AppendTensors<'_>,
    dtype: StorageType,
) -> Result<(), AttentionError> {
    crate::cache::ensure_linked();
    crate::tensor::check_dtype(client, dtype)?;
    for (name, x) in [
        ("k_new", &t.k_new),
        ("v_new", &t.v_new),
        ("k", &t.k),
        ("v", &t.v),
    ] {
        if x.shape.len() != 4 || x.strides.len() != 4 {
            return Err(shape_error(name, "a 4-D tensor".into(), x.shape));
        }
    }
    let [b, hkv, s, d] = [
        t.k_new.shape[0],
        t.k_new.shape[1],
        t.k_new.shape[2],
        t.k_new.shape[3],
    ];
    let dv = t.v_new.shape[3];
    if t.v_new.shape[..3] != t.k_new.shape[..3] {
        return Err(shape_error(
            "v_new",
            format!("[{b}, {hkv}, {s}, Dv]"),
            t.v_new.shape,
        ));
    }
    let (heads_at, width_ok) = match &t.paged {
        Some(p) => {
            if p.table.shape.len() != 2 || p.table.shape[0] != b {
                return Err(shape_error(
                    "table",
                    format!("[{b}, max_blocks]"),
                    p.table.shape,
                ));
            }
            (2, t.k.shape[..3] == t.v.shape[..3])
        }
        None => (1, t.k.shape[..3] == t.v.shape[..3] && t.k.shape[0] == b),
    };
    if t.k.shape[heads_at] != hkv || t.k.shape[3] != d || !width_ok {
        return Err(shape_error(
            "k",
            format!("a cache of {hkv} heads of {d} columns (and `v` of {dv}) matching `k_new`"),
            t.k.shape,
        ));
    }
    if t.v.shape[3] != dv {
        return Err(shape_error(
            "v",
            format!("a cache of {dv} columns"),
            t.v.shape,
        ));
    }
    if t.lengths.shape != [b] {
        return Err(shape_error("lengths", format!("[{b}]"), t.lengths.shape));
    }
    let mut heads = hkv;
    if let Some(r) = &t.rope {
        let half = r.cos.shape.get(1).copied().unwrap_or(0);
        if r.cos.shape.len() != 2 || r.sin.shape != r.cos.shape || half == 0 || 2 * half > d {
            return Err(shape_error(
                "cos",
                format!("[positions, R/2] with 2 ≤ R ≤ D = {d} (and `sin` alike)"),
                r.cos.shape,
            ));
        }
        if let Some((q, q_out)) = &r.q {
            if q.shape.len() != 4 || q.shape[0] != b || q.shape[2] != s || q.shape[3] != d {
                return Err(shape_error("q", format!("[{b}, Hq, {s}, {d}]"), q.shape));
            }
            if q_out.shape != q.shape {
                return Err(shape_error("q_out", format!("{:?}", q.shape), q_out.shape));
            }
            heads = heads.max(q.shape[1]);
        }
    }
    let units = b * heads * s * d.max(dv).div_ceil(2);
    if units == 0 {
        return Ok(());
    }
    let a = AppendConfig {
        paged: t.paged.is_some(),
        rope: t.rope.is_some(),
        rope_q: t.rope.is_some_and(|r| r.q.is_some()),
        interleaved: t.rope.is_some_and(|r| r.interleaved),
    };
    let table = t.paged.map_or(t.lengths, |p| p.table);
    let (cos, sin) = t.rope.map_or((t.lengths, t.lengths), |r| (r.cos, r.sin));
    let (q, q_out) = t.rope.and_then(|r| r.q).unwrap_or((t.k_new, t.k_new));
    const CUBE: usize = 256;
    let cubes = units.div_ceil(CUBE);
    let max_x = client.properties().hardware.max_cube_count.0 as usize;
    let y = cubes.div_ceil(max_x);
    // SAFETY: the shapes were checked above; every read is bounds-checked or clamped against
    // them, and every write lands in the caches at a position the caller guarantees inside
    // them (block entries clamped to the pool).
    unsafe {
        append::kv_append::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes.div_ceil(y) as u32, y as u32, 1),
            CubeDim::new_1d(CUBE as u32),
            AppendSourcesLaunch::new(
                whole(&t.k_new),
                whole(&t.v_new),
                whole(&q),
                whole(&t.lengths),
                whole(&table),
                whole(&cos),
                whole(&sin),
            ),
            AppendTargetsLaunch::new(whole(&t.k), whole(&t.v), whole(&q_out)),
            a,
            dtype,
        );
    }
    Ok(())
}
