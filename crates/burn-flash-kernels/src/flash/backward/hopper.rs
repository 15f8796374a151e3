//! The attention backward on Hopper (sm_90a), FlashAttention-3's schedule: one block per 128
//! keys keeps `K`, `V` in shared memory and `dK`, `dV` in registers while a producer warpgroup
//! streams `Q`, `dO` and the rows' statistics through TMA; two consumer warpgroups compute the
//! five products on `wgmma` and add `dQ` into an f32 accumulator through shared memory and one
//! TMA bulk reduce per consumer and step ([`dq_tiled`]; at `D` 256, or with the
//! `hopper-atomic-dq` feature, with vector reductions per thread). A
//! prepass (`δ`, the base-2 log-sum-exp, the accumulator zeroed) runs before and a conversion
//! (`dQ` in the element type) after. The sources are `hopper.cu` and `hopper_rows.cu` next to
//! this file, on the wrappers of `crate::hopper` (`sm90.cuh`) and the score helpers of
//! `flash/scores.cuh`.
//!
//! Variants ([`Variant`]): element type × `D` (64, 128, 256: the head dims rounded up; with
//! one of them 256 the other at least 128, 64 keys per block) × `Dv` × causal,
//! softcap, mask (hiding or filling), bias (loaded per step by TMA where its rows allow,
//! [`Variant::bias_tiles`]; else read per element), dropout, written `dS` (a tracked bias's
//! gradient, [`Variant::write_ds`]). Not taken: `dS` under a softcap ([`takes_ds`]) and what
//! [`unavailable`] names; the plan then runs the `mma.sync` backward.

#[cfg(feature = "cuda")]
use crate::hopper::CudaCompiled;
use cubecl::prelude::*;

use crate::attention::options::{
    AttentionDims, AttentionFeatures, BackwardOverlap, HopperUse, TileSchedule,
};
#[cfg(feature = "cuda")]
use crate::attention::options::{AttentionOptions, BackwardTensors};
use crate::flash::{FlashConfig, ScoreRules, Tile};
#[cfg(feature = "cuda")]
use crate::hopper::task::{HandWritten, tensor_map};
#[cfg(feature = "cuda")]
use crate::hopper::{Defines, words};

/// Query rows per step.
pub const BLOCK_Q: usize = 64;
/// Keys per block (64 per consumer warpgroup); 64 where a head dim is 256 ([`tile`]).
pub const BLOCK_K: usize = 128;
/// `Q`/`dO` slots of the pipeline.
pub const STAGES: usize = 2;
/// Threads per block: one producer and two consumer warpgroups.
pub const UNITS: u32 = 384;
/// Rows of the backward's per-row scratch (`δ`, the base-2 lse, the f32 `dQ` accumulator):
/// every (batch, query head)'s `Sq` padded to [`BLOCK_Q`].
pub fn padded_rows(dims: AttentionDims) -> usize {
    dims.batch * dims.heads_q * dims.seq_q.next_multiple_of(BLOCK_Q)
}

/// Rows per block of the per-row kernels (one warp each).
#[cfg(feature = "cuda")]
const ROWS_PER_BLOCK: usize = 8;
/// Rows of `dQ` per block of its conversion (two a warp: `hopper_rows.cu`).
#[cfg(feature = "cuda")]
const DQ_ROWS_PER_BLOCK: usize = 16;

/// Warp-specialised (384 threads, `setmaxnreg`): one block per SM. Known spills: the masked,
/// biased and dropout variants (RESULTS §15; 432 B stored and loaded at most since the `dQ`
/// writer warp, s43, against 404 before).
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(1, 432);

#[cfg(feature = "cuda")]
const ENTRY: &str = "burn_flash_hopper_backward";

/// Words of the main kernel's parameter struct (`BwdParams`, which the source asserts); every
/// launch passes exactly these.
#[cfg(feature = "cuda")]
const PARAM_WORDS: usize = 31;

/// The per-row pre- and post-passes (`δ`, the log-sum-exp in base 2, `dQ` in the element
/// type) stream: six blocks of 256 threads per SM (48 warps, 42 registers), which their
/// row-major accumulator's variants need (up to 38 registers on sm_86 / sm_89; the tiled ones
/// take 32).
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const ROWS_OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(6);

#[cfg(feature = "cuda")]
const ROWS_ENTRY: &str = "burn_flash_hopper_backward_rows";
#[cfg(feature = "cuda")]
const DQ_ENTRY: &str = "burn_flash_hopper_backward_dq";

/// The CUDA source of the main kernel: the instruction wrappers, the score helpers, the kernel's
/// tile, parameters and helpers, the kernel.
#[cfg(feature = "cuda")]
pub const SOURCE: &str = concat!(
    include_str!("../../hopper/sm90.cuh"),
    include_str!("../scores.cuh"),
    include_str!("hopper.cuh"),
    include_str!("hopper.cu")
);

/// The CUDA source of the per-row kernels (prepass and `dQ` conversion).
#[cfg(feature = "cuda")]
pub const ROWS_SOURCE: &str = concat!(
    include_str!("../scores.cuh"),
    include_str!("hopper_rows.cu")
);

#[cfg(feature = "cuda")]
const SOURCE_HASH: u64 = crate::hopper::source_hash(SOURCE);
#[cfg(feature = "cuda")]
const ROWS_SOURCE_HASH: u64 = crate::hopper::source_hash(ROWS_SOURCE);

/// One compiled variant of the main kernel: the plan's tile and score rules, the element type,
/// whether `dS` is written ([`takes_ds`]) and how `dQ` is added ([`dq_tiled`]). Its `#define`s
/// are the tile's and [`ScoreRules::flags`]; its id is a hash of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// bf16 (else f16).
    pub bf16: bool,
    /// `D` rounded up ([`tile`]).
    pub head_dim: u32,
    /// `Dv` rounded up ([`tile`]).
    pub value_dim: u32,
    /// `dS` is written (a tracked bias's gradient; never with a softcap, [`takes_ds`]).
    pub write_ds: bool,
    /// `dQ` through shared memory and TMA bulk reduces ([`dq_tiled`]).
    pub dq_bulk: bool,
    /// The bulk reduces into each row block in key-block order: the same bits every run
    /// ([`AttentionOptions::deterministic`]; only with `dq_bulk`).
    pub deterministic: bool,
    /// The bias is loaded per step by TMA into the `dSᵀ` buffer of the step's parity, not
    /// read per element (a bias whose rows TMA can load, [`crate::attention::bias_tiles`]).
    pub bias_tiles: bool,
    /// Each step's `dQ` is issued in the next step (`DEFER_DQ`, [`Variant::with_overlap`]).
    pub defer_dq: bool,
    /// With `defer_dq`: the second consumer starts half a step behind the first (`STAGGER`).
    pub stagger: bool,
    /// Blocks run several tiles in rounds (`PERSISTENT`, [`Variant::with_schedule`]).
    pub persistent: bool,
    /// The score rules.
    pub rules: ScoreRules,
}

impl Variant {
    /// The variant the plan's `config` (tile and score rules) compiles, in `bf16` or f16,
    /// writing `dS` where `write_ds`, in key-block order where `deterministic` (which the
    /// plan asks only where [`dq_tiled`]), loading its bias by TMA where `bias_tiles`.
    pub fn new(
        config: FlashConfig,
        bf16: bool,
        write_ds: bool,
        deterministic: bool,
        bias_tiles: bool,
    ) -> Self {
        let dq_bulk = dq_tiled(config);
        Self {
            bf16,
            head_dim: config.head_dim,
            value_dim: config.value_dim,
            write_ds,
            dq_bulk,
            deterministic: deterministic && dq_bulk,
            bias_tiles: bias_tiles && config.rules.bias,
            defer_dq: false,
            stagger: false,
            persistent: false,
            rules: config.rules,
        }
    }

    /// This variant with its consumers meeting over `dSᵀ` as `overlap` says, where it can:
    /// the `dQ` writer at head dim 128, no bias by TMA, no written `dS`, not deterministic.
    pub fn with_overlap(self, overlap: BackwardOverlap) -> Self {
        let can = self.dq_bulk
            && self.head_dim == 128
            && self.value_dim <= 128
            && !self.bias_tiles
            && !self.write_ds
            && !self.deterministic;
        let (defer_dq, stagger) = overlap.deferred_staggered();
        Self {
            defer_dq: can && defer_dq,
            stagger: can && stagger,
            ..self
        }
    }

    /// This variant with persistent blocks where `schedule` asks for them
    /// ([`TileSchedule::Persistent`], `Blocks`, `Dynamic`, `DynamicBlocks`: static rounds in
    /// each) and it can take them: not deterministic (a block waits for the key blocks before
    /// its own), not deferring `dQ`, `tiles` numbered in 32 bits. The plan's schedule keeps
    /// one block per tile: the persistent backward has not been measured faster yet.
    pub fn with_schedule(self, schedule: TileSchedule, tiles: usize) -> Self {
        let asked = !matches!(schedule, TileSchedule::Planned | TileSchedule::PerTile);
        Self {
            persistent: asked
                && !self.deterministic
                && !self.defer_dq
                && u32::try_from(tiles).is_ok(),
            ..self
        }
    }

    /// The `#define`s the source is compiled with; their key is the variant's id.
    #[cfg(feature = "cuda")]
    fn defines(self) -> Defines {
        Defines::elem(self.bf16)
            .word("HEAD_DIM", self.head_dim)
            .word("VALUE_DIM", self.value_dim)
            .word("WRITE_DS", self.write_ds)
            .word("DQ_BULK", self.dq_bulk)
            .word("DETERMINISTIC", self.deterministic)
            .word("BIAS_TILES", self.bias_tiles)
            .word("DEFER_DQ", self.defer_dq)
            .word("STAGGER", self.stagger)
            .word("PERSISTENT", self.persistent)
            .word("PARAM_WORDS", PARAM_WORDS as u32)
            .rules(&self.rules)
    }
}

/// The tile of a call: [`BLOCK_Q`] rows per step, [`BLOCK_K`] keys per block, the head dims
/// rounded up to 64 or 128. Where one is over 128 (wide): 64 keys per block, both consumers
/// on the same keys and each on half of the columns of `dK`, `dV`, `dQ`, so the head dims are
/// rounded up to 128 or 256 (two halves of 64 or 128 columns).
pub fn tile(dims: AttentionDims) -> Tile {
    let wide = dims.head_dim.max(dims.value_dim) > 128;
    // Whole 64-column atoms per consumer: 64 or 128, or wide 128 or 256 (head dims ≤ 256).
    let rounded = |dim: usize| dim.max(if wide { 128 } else { 64 }).next_power_of_two() as u32;
    Tile {
        block_q: BLOCK_Q as u32,
        row_tiles: 1,
        block_k: if wide { 64 } else { BLOCK_K as u32 },
        head_dim: rounded(dims.head_dim),
        value_dim: rounded(dims.value_dim),
    }
}

/// Whether the consumers add `dQ` through shared memory and one TMA bulk reduce per 64 × 64
/// tile (FlashAttention-3's path) into an accumulator tiled in their order (`hopper_rows.cu`,
/// its header), rather than with vector reductions per thread into a row-major one: for every
/// tile but the wide one (64 keys per block, [`tile`]: no shared memory left for the tiles),
/// unless the `hopper-atomic-dq` feature asks for the per-thread reductions everywhere.
pub fn dq_tiled(config: FlashConfig) -> bool {
    !cfg!(feature = "hopper-atomic-dq") && config.block_k as usize == BLOCK_K
}

/// Dynamic shared memory for `config`'s tile: `K` and `V` of the block (`block_k` rows × 128
/// bytes per 64 columns), two `dSᵀ` buffers (`block_k` × 64 × 2 bytes), [`STAGES`] slots of
/// `Q` and `dO` (64 rows) and of the rows' statistics (2 × 256 bytes), where [`dq_tiled`] two
/// 16 KiB `dQ` tiles per consumer, the barriers (13 mbarriers), and 1 KiB to align the swizzle
/// atoms: 226 KiB at head dim 128, 210 KiB at head dims of 256.
pub fn shared_bytes(config: FlashConfig) -> usize {
    let (d, dv) = (
        config.head_dim as usize / 64,
        config.value_dim as usize / 64,
    );
    let keys = config.block_k as usize;
    let (kv_atom, row_atom) = (keys * 128, BLOCK_Q * 128);
    let dq_tiles = if dq_tiled(config) {
        4 * BLOCK_Q * 64 * 4
    } else {
        0
    };
    1024 + kv_atom * (d + dv)
        + 2 * keys * BLOCK_Q * 2
        + STAGES * (row_atom * (d + dv) + 512)
        + dq_tiles
        + 128
}

/// Whether the plan picks the Hopper backward for a call it can run with `features` under
/// `hopper`: under [`HopperUse::Faster`], every call but one with a bias of rows of its own
/// that TMA cannot load as tiles. With the bias by TMA ([`Variant::bias_tiles`]) the training
/// step with a full `[1, H, S, S]` bias runs 1.8–2.5× the `mma.sync` backward's, tracked or
/// not; a bias broadcast along the rows (`[1, H, 1, S]`), read per element from cache, 1.4–1.75×
/// (RESULTS.md §5.2, H100). A full bias read per element (keys strided, rows not whole 16
/// bytes) measured 19 % slower than `mma.sync` (§5.2, H200) and keeps the `mma.sync` backward.
pub fn preferred(features: AttentionFeatures, hopper: HopperUse) -> bool {
    hopper.wanted(!features.bias || features.bias_tiles || features.bias_rows_broadcast)
}

/// Whether the Hopper backward takes a call that writes `dS` (a tracked bias's gradient) with
/// `softcap`: not under a softcap, where the `dSᵀ` tile its consumers hold for `dQ` is `dS`
/// times the softcap's derivative and `dS` itself is not kept.
pub fn takes_ds(softcap: bool) -> bool {
    !softcap
}

/// Why the Hopper backward cannot run a call (`None`: it can). `hopper` says whether the device
/// is an sm_90 GPU; `features.aligned` covers `q`, `k`, `v` and `dO` (rows and starts).
pub fn unavailable(
    hopper: bool,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
) -> Option<String> {
    use cubecl::ir::{ElemType, FloatKind};
    let reason = if !hopper {
        "the device is not a Hopper GPU (sm_90)"
    } else if !matches!(
        dtype,
        StorageType::Scalar(ElemType::Float(FloatKind::F16 | FloatKind::BF16))
    ) {
        "the Hopper backward takes f16 and bf16"
    } else if dims.head_dim > 256 || dims.value_dim > 256 {
        "the Hopper backward takes head dims up to 256"
    } else if !features.aligned {
        "the Hopper backward reads rows through TMA: unit stride along the head dim, head dims and strides multiples of 8 elements, buffers starting on 16 bytes"
    } else if dims.seq_q == 0 || dims.seq_k == 0 {
        "the Hopper backward takes non-empty sequences"
    } else if dims.heads_kv > 65_535 || dims.batch > 65_535 {
        "the Hopper backward launches one block row per key/value head and batch: at most 65535 each"
    } else if dims.seq_q > i32::MAX as usize / 2 || dims.seq_k > i32::MAX as usize / 2 {
        "the Hopper backward indexes positions with 32-bit integers"
    } else {
        return None;
    };
    Some(reason.into())
}

/// Launches the backward of `dims` on `client`: `δ` and the statistics, the main kernel on the
/// plan's grid (`config`'s variant, `units`, shared memory), then `dQ`. `t` was checked by the
/// caller (shapes, [`unavailable`] `None`; a `ds` only where [`takes_ds`]); `mask_strides` and
/// `bias_strides` are those of `t.mask` and `t.bias` over `[B, Hq, Sq, Sk]`, 0 along broadcast
/// dimensions. Returns whether the bias came by TMA ([`Variant::bias_tiles`]).
///
/// # Safety
/// The shapes and strides of `t` describe the buffers.
#[cfg(feature = "cuda")]
pub unsafe fn launch<R: CudaCompiled>(
    client: &ComputeClient<R>,
    t: &BackwardTensors<'_>,
    dims: AttentionDims,
    dtype: StorageType,
    options: &AttentionOptions,
    config: FlashConfig,
    (mask_strides, bias_strides): (Option<&[usize]>, Option<&[usize]>),
    units: u32,
    shared: usize,
    cubes: (usize, usize, usize),
) -> bool {
    use crate::mutation;
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    // The grid's tiles: key blocks · key/value heads · batches.
    let tiles = cubes.0 * cubes.1 * cubes.2;
    // The bias's TMA map (64 rows × 64 keys), where its rows can be loaded as tiles, and which
    // of its batch and head coordinates are read.
    let bias_map = t
        .bias
        .as_ref()
        .zip(bias_strides)
        .filter(|(b, strides)| crate::attention::bias_tiles(b, strides))
        .map(|term| crate::flash::forward::hopper::bias_map(term, dims, dtype, BLOCK_Q));
    let variant = Variant::new(
        config,
        bf16,
        t.ds.is_some(),
        options.deterministic,
        bias_map.is_some(),
    )
    .with_overlap(options.backward_overlap)
    .with_schedule(options.schedule, tiles);
    let rows_pad = dims.seq_q.next_multiple_of(BLOCK_Q);
    let passes = RowPasses::new(
        client,
        t,
        dims,
        options,
        bf16,
        (
            config.head_dim as usize,
            dq_tiled(config),
            variant.deterministic,
        ),
    );

    let (source, hash) = crate::hopper::mutated(
        SOURCE,
        SOURCE_HASH,
        &[
            (mutation::zero_dk(), "dk_acc, p.scale,", "dk_acc, 0.0f,"),
            (
                mutation::causal_top_left(),
                "const int diag = (int)p.seq_k - (int)p.seq_q;",
                "const int diag = 0;",
            ),
            (
                mutation::gqa_modulo(),
                "head_kv * p.group + (u32)(it / per_head)",
                "head_kv + gridDim.y * (u32)(it / per_head)",
            ),
            (
                mutation::dropout_fresh_mask(),
                "threefry((u32)key, (u32)(m0 + col),",
                "threefry((u32)(m0 + col), (u32)key,",
            ),
            (
                mutation::hopper_no_wait(),
                "if (g >= STAGES) mbar_wait(",
                "if (false) mbar_wait(",
            ),
            (mutation::fill_grad(), "live = false;", "live = true;"),
            (
                mutation::window_right(),
                "hidden = hidden || key > m0 + col + diag + (int)p.s.window_right",
                "hidden = hidden || key > m0 + col + diag + (int)p.s.window_right + 1",
            ),
            (
                mutation::varlen_first_row(),
                "if ((int)seqs[mid] <= pos) a = mid;",
                "if ((int)seqs[mid] < pos) a = mid;",
            ),
            (
                mutation::dq_skip_tile(),
                "bulk_reduce_add_f32(dq_rows +",
                "if (c == 0u) bulk_reduce_add_f32(dq_rows +",
            ),
            (mutation::dq_bulk_no_wait(), "bulk_wait_read<0>();", ""),
            (
                mutation::defer_wrong_buffer(),
                "issue_dq_128(dq, sds + (u32)((g - 1) % 2) * DS_BYTES, sk, c);",
                "issue_dq_128(dq, buf, sk, c);",
            ),
            (
                mutation::kv_early(),
                "if (kv_use > 0) mbar_wait(KV_EMPTY,",
                "if (false) mbar_wait(KV_EMPTY,",
            ),
            (
                mutation::dq_unordered(),
                "wait_count(lock, visitors_before(seqs, p, m, (int)blockIdx.x));",
                "",
            ),
            (
                mutation::bias_block_bwd(),
                "n0 + 64 * a, m * BLOCK_M, bias_head, bias_batch);",
                "(n0 ^ BLOCK_N) + 64 * a, m * BLOCK_M, bias_head, bias_batch);",
            ),
            (
                mutation::ds_skipped_rows(),
                "dst[(u64)r * p.ds_stride_s] = 0;",
                "dst[(u64)r * p.ds_stride_s] = 0x4000;",
            ),
        ],
    );
    let defines = variant.defines();
    let kernel = HandWritten::new_hashed(
        client,
        source,
        hash,
        ENTRY,
        CubeDim::new_1d(units),
        shared,
        defines.key(),
    )
    .with_defines(&defines);
    let mut params = strides(t.dk.strides);
    params.extend(strides(t.dv.strides));
    let ([mask_handle, bias_handle, ds_handle], n_seqs) = call_words(
        t,
        dims,
        options,
        rows_pad,
        (mask_strides, bias_strides),
        &mut params,
    );
    let planes = bias_map.as_ref().map_or(0, |(_, planes)| *planes);
    params.push(words(n_seqs as u32, planes));
    params.push(words(tiles as u32, 0));
    assert_eq!(
        params.len(),
        PARAM_WORDS,
        "the Hopper backward's parameter words"
    );
    let mut maps = vec![
        tensor_map(&t.q, dtype, BLOCK_Q),
        tensor_map(&t.k, dtype, config.block_k as usize),
        tensor_map(&t.v, dtype, config.block_k as usize),
        tensor_map(&t.d_out, dtype, BLOCK_Q),
    ];
    // The bias's 64 rows × 64 keys (a variant with `BIAS_TILES` takes a fifth map).
    maps.extend(bias_map.map(|(map, _)| map));
    // Persistent: one block per SM (or the schedule's count), each taking tiles in rounds.
    let (x, y, z) = if variant.persistent {
        let sms = client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .unwrap_or(1) as usize;
        (options.schedule.blocks(tiles, sms, true), 1, 1)
    } else {
        cubes
    };
    // SAFETY: the per-row passes' ([`RowPasses::prepass`], [`RowPasses::convert`]). The main
    // kernel's loads stay in `q`, `k`, `v`, `dO`, a bias by TMA (TMA clips every box to the
    // shapes; the bias's view describes its buffer) and the scratch rows of its (batch, head)
    // pairs; block (n, h, b) writes its `block_k` keys below `Sk` of
    // `dK[b, h]` and `dV[b, h]`, columns below `D` and `Dv`, and (with `ds`) those keys of
    // `dS[b, h·group ..][rows below Sq]` through `ds`'s strides. The mask and bias reads stay in
    // theirs: rows below `Sq`, keys below `Sk`, through the broadcast strides checked by the
    // caller.
    unsafe {
        passes.prepass(t);
        kernel.launch_with_maps(
            CubeCount::Static(x as u32, y as u32, z as u32),
            maps,
            vec![
                passes.lse2.clone().binding(),
                passes.delta.clone().binding(),
                passes.dq_acc.clone().binding(),
                t.dk.handle.clone().binding(),
                t.dv.handle.clone().binding(),
                mask_handle.binding(),
                bias_handle.binding(),
                ds_handle.binding(),
                // Absent slopes or sequences are never read: `lse` (f32) stands in.
                t.slopes.as_ref().unwrap_or(&t.lse).handle.clone().binding(),
                t.seqs.as_ref().unwrap_or(&t.lse).handle.clone().binding(),
                passes.dq_lock.clone().binding(),
            ],
            params,
        );
        passes.convert(t);
    }
    variant.bias_tiles
}

/// The parameter words both hand-written backwards (this one and [`super::sm80`]) take after
/// their strides, in their structs' order: `Sq, Sk | rows_pad, Hq | group, D | Dv, scale`, the
/// score scalars, then the mask's, the bias's and `dS`'s strides over `[B, Hq, Sq, Sk]` (0 where
/// absent). Returns the mask, bias and `dS` buffers to bind (`q` or `dQ` standing in for an
/// absent one, never touched) and the count of packed sequences (0 without).
#[cfg(feature = "cuda")]
pub(crate) fn call_words(
    t: &BackwardTensors<'_>,
    dims: AttentionDims,
    options: &AttentionOptions,
    rows_pad: usize,
    (mask_strides, bias_strides): (Option<&[usize]>, Option<&[usize]>),
    params: &mut Vec<u64>,
) -> ([cubecl::server::Handle; 3], usize) {
    params.push(words(dims.seq_q as u32, dims.seq_k as u32));
    params.push(words(rows_pad as u32, dims.heads_q as u32));
    params.push(words(dims.group() as u32, dims.head_dim as u32));
    params.push(words(dims.value_dim as u32, options.scale.to_bits()));
    params.extend(options.scalars().hopper_words(options.masked_score));
    let [mask, bias] = crate::flash::forward::hopper::bind_terms(
        t.mask.as_ref().zip(mask_strides),
        t.bias.as_ref().zip(bias_strides),
        &t.q,
        params,
    );
    // dS [B, Hq, Sq, Sk] where written; otherwise never touched, `dQ` stands in.
    let ds = match &t.ds {
        Some(ds) => {
            params.extend(strides(ds.strides));
            ds.handle.clone()
        }
        None => {
            params.extend([0; 4]);
            t.dq.handle.clone()
        }
    };
    // The packed sequences: `[2·(n + 1)]` cumulative lengths.
    let n_seqs = t.seqs.as_ref().map_or(0, |s| s.shape[0] / 2 - 1);
    ([mask, bias, ds], n_seqs)
}

/// Strides as the hand-written kernels' parameter words.
#[cfg(feature = "cuda")]
pub(crate) fn strides(s: &[usize]) -> Vec<u64> {
    s.iter().map(|&x| x as u64).collect()
}

/// The per-row passes around a backward's main kernel (`hopper_rows.cu`) and the scratch they
/// share with it: the prepass writes `δ` and the base-2 log-sum-exp of every row (numbered
/// `(b·Hq + h)·rows_pad + i`, `rows_pad` = `Sq` rounded up to [`BLOCK_Q`]) and zeroes the f32
/// `dQ` accumulator (and the deterministic counters); the conversion writes `dQ` in the element
/// type. The Hopper backward and the Ampere backward ([`super::sm80`]) run between them.
#[cfg(feature = "cuda")]
pub(crate) struct RowPasses<R: CudaCompiled> {
    client: ComputeClient<R>,
    source: &'static str,
    hash: u64,
    defines: Defines,
    variant: u64,
    params: Vec<u64>,
    /// Rows of the scratch ([`padded_rows`]).
    pub rows: usize,
    /// The base-2 log-sum-exp per row (+inf past `Sq` and for rows that see no key).
    pub lse2: cubecl::server::Handle,
    /// `δ = rowsum(dO ⊙ O)` per row.
    pub delta: cubecl::server::Handle,
    /// The f32 `dQ` accumulator: `acc_dim` columns a row, row-major or tiled ([`dq_tiled`]).
    pub dq_acc: cubecl::server::Handle,
    /// A counter per 64-row block of `dQ` (deterministic); 4 bytes otherwise.
    pub dq_lock: cubecl::server::Handle,
}

#[cfg(feature = "cuda")]
impl<R: CudaCompiled> RowPasses<R> {
    /// The passes of a call of `dims` with `options` over `t`, in bf16 (else f16), with an
    /// accumulator of `acc_dim` columns, tiled where `tiled`, ordered where `deterministic`.
    pub(crate) fn new(
        client: &ComputeClient<R>,
        t: &BackwardTensors<'_>,
        dims: AttentionDims,
        options: &AttentionOptions,
        bf16: bool,
        (acc_dim, tiled, deterministic): (usize, bool, bool),
    ) -> Self {
        use crate::mutation;
        let rows_pad = dims.seq_q.next_multiple_of(BLOCK_Q);
        let rows = padded_rows(dims);
        let (source, hash) = crate::hopper::mutated(
            ROWS_SOURCE,
            ROWS_SOURCE_HASH,
            &[
                (
                    mutation::drop_delta(),
                    "delta[r] = sum;",
                    "delta[r] = 0.0f;",
                ),
                (
                    mutation::zero_dq(),
                    "const float scale = p.scale;",
                    "const float scale = 0.0f;",
                ),
            ],
        );
        let defines = Defines::empty()
            .word("ELEM_BF16", bf16)
            .word("ACC_DIM", acc_dim as u32)
            .word("DQ_TILED", tiled)
            .word("DETERMINISTIC", deterministic);
        let mut params = strides(t.out.strides);
        params.extend(strides(t.d_out.strides));
        params.extend(strides(t.lse.strides));
        params.extend(strides(t.dq.strides));
        params.push(rows as u64);
        params.push(words(dims.heads_q as u32, dims.seq_q as u32));
        params.push(words(rows_pad as u32, dims.head_dim as u32));
        params.push(words(dims.value_dim as u32, options.scale.to_bits()));
        Self {
            client: client.clone(),
            source,
            hash,
            defines,
            variant: acc_dim as u64 | u64::from(tiled) << 16 | u64::from(deterministic) << 17,
            params,
            rows,
            lse2: client.empty(rows * 4),
            delta: client.empty(rows * 4),
            dq_acc: client.empty(rows * acc_dim * 4),
            dq_lock: client.empty(if deterministic { rows / BLOCK_Q * 4 } else { 4 }),
        }
    }

    fn kernel(&self, entry: &'static str) -> HandWritten<R> {
        HandWritten::new_hashed(
            &self.client,
            self.source,
            self.hash,
            entry,
            CubeDim::new_1d(32 * ROWS_PER_BLOCK as u32),
            0,
            self.variant,
        )
        .with_defines(&self.defines)
    }

    /// Launches the prepass over `t` (the tensors [`Self::new`] took).
    ///
    /// # Safety
    /// `t`'s shapes and strides describe its buffers.
    pub(crate) unsafe fn prepass(&self, t: &BackwardTensors<'_>) {
        // SAFETY: the prepass touches rows below `rows` of the scratch (allocated for exactly
        // those) and, through the strides given, positions below `Sq` and columns below `Dv`
        // of `out`, `dO` and `lse` (the caller's).
        unsafe {
            self.kernel(ROWS_ENTRY).launch(
                CubeCount::Static(self.rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
                vec![
                    t.out.handle.clone().binding(),
                    t.d_out.handle.clone().binding(),
                    t.lse.handle.clone().binding(),
                    self.lse2.clone().binding(),
                    self.delta.clone().binding(),
                    self.dq_acc.clone().binding(),
                    self.dq_lock.clone().binding(),
                ],
                self.params.clone(),
            );
        }
    }

    /// Launches the conversion of the accumulator into `t.dq`.
    ///
    /// # Safety
    /// `t.dq`'s shape and strides describe its buffer.
    pub(crate) unsafe fn convert(&self, t: &BackwardTensors<'_>) {
        // SAFETY: the conversion reads the accumulator's rows below `rows` and writes positions
        // below `Sq` and columns below `D` of `dQ` through its strides (the caller's).
        unsafe {
            self.kernel(DQ_ENTRY).launch(
                CubeCount::Static(self.rows.div_ceil(DQ_ROWS_PER_BLOCK) as u32, 1, 1),
                vec![self.dq_acc.clone().binding(), t.dq.handle.clone().binding()],
                self.params.clone(),
            );
        }
    }
}
