//! The attention forward on Hopper (sm_90a), FlashAttention-3's schedule: TMA loads into a ring
//! of shared-memory slots, a producer warpgroup and two consumer warpgroups with register
//! reallocation, `wgmma` for `Q·Kᵀ` (both operands in shared memory) and `P·V` (`P` in
//! registers). The source is `hopper.cu` next to this file, on the shared instruction wrappers
//! of `crate::hopper` (`sm90.cuh`); it is compiled by cubecl-cuda's NVRTC and launched through
//! the caller's client (`crate::hopper::task::HandWritten`, CUDA builds).
//!
//! Blocks take tiles (a block of query rows of one head and batch, [`tiles`]) in rounds: one
//! block per tile, or persistent blocks, one per SM, whose next tile's loads run under the
//! previous tile's epilogue ([`blocks`], [`TileSchedule`]; the plan's default is persistent).
//!
//! Variants ([`Variant`]): element type (f16, bf16) × `D` (64, 128, 256: the head dims rounded
//! up) × `Dv` (64, 128, 256) × the score rules (causal, softcap, mask, fill score, bias, quiet,
//! dropout), each compiled on first use; a head dim of 256 takes 64 keys per step. What it
//! does not take (rows not 16-byte aligned, …) is named by [`unavailable`]; the plan then runs
//! the `mma.sync` kernel.
//!
//! The same source with given scores (`GIVEN`) is `softmax(X)·V`'s forward on Hopper
//! (`launch_given`): tiles of `X` take the place of `K` in the slots and are read into the
//! registers of `S` with `ldmatrix`, `V` is read [`given_tile`]`.value_dim` columns per block.

#[cfg(feature = "cuda")]
use crate::hopper::CudaCompiled;
use cubecl::prelude::*;

use crate::attention::options::{AttentionDims, AttentionFeatures, HopperUse, TileSchedule};
#[cfg(feature = "cuda")]
use crate::attention::options::{AttentionOptions, AttentionPlan};
#[cfg(feature = "cuda")]
use crate::flash::Scalars;
use crate::flash::{FlashConfig, ScoreRules, ScoreSource, Tile};
#[cfg(feature = "cuda")]
use crate::hopper::task::{HandWritten, tensor_map};
#[cfg(feature = "cuda")]
use crate::hopper::{Defines, words};
#[cfg(feature = "cuda")]
use crate::tensor::TensorRef;

/// Query rows per block (two consumer warpgroups of 64); 192 (three) at head dims of 64
/// ([`tile`]), 128 with given scores.
pub const BLOCK_Q: usize = 128;
/// Keys per step (64 where a head dim is over 128: [`tile`]).
pub const BLOCK_K: usize = 128;
/// `K`/`V` slots of the pipeline (a third measured no faster on an H200, RESULTS §4.10.1).
pub const STAGES: usize = 2;
/// Threads per block of [`BLOCK_Q`] rows: one producer and two consumer warpgroups.
pub const UNITS: u32 = 384;

/// Threads per block of `config`: one producer warpgroup and one consumer warpgroup per 64
/// query rows.
pub fn units(config: FlashConfig) -> u32 {
    128 * (1 + config.block_q / 64)
}

/// One producer and two (three at D 64) consumer warpgroups, `setmaxnreg` 24 / 240 (160):
/// one block per SM. Known spills since the tile loop (s49): 16 B stored and loaded at D 64
/// (160 registers per consumer thread) and in masked, biased variants — the loop's per-tile
/// values (round, steps so far, the tile's place) held through the steps.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(1, 32);

#[cfg(feature = "cuda")]
const ENTRY: &str = "burn_flash_hopper_forward";

/// Words of the kernel's parameter struct (`FwdParams`, which the source asserts); every
/// launch passes exactly these.
#[cfg(feature = "cuda")]
const PARAM_WORDS: usize = 25;

/// The CUDA source: the instruction wrappers, then the kernel.
#[cfg(feature = "cuda")]
pub const SOURCE: &str = concat!(
    include_str!("../../hopper/sm90.cuh"),
    include_str!("../scores.cuh"),
    include_str!("hopper.cu")
);

/// [`crate::hopper::source_hash`] of [`SOURCE`], computed at compile time.
#[cfg(feature = "cuda")]
const SOURCE_HASH: u64 = crate::hopper::source_hash(SOURCE);

/// One compiled variant of the kernel: the plan's tile and score rules, the element type and
/// the score source. Its `#define`s are the tile's and [`ScoreRules::flags`]; its id is a
/// hash of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// bf16 (else f16).
    pub bf16: bool,
    /// Query rows per block: 128, or 192 ([`tile`]).
    pub block_q: u32,
    /// Keys per step: [`BLOCK_K`], or 64 where `head_dim` or `value_dim` is 256.
    pub block_k: u32,
    /// `D` rounded up to 64, 128 or 256 (with given scores: `block_k`, the columns of `X` per
    /// step).
    pub head_dim: u32,
    /// `Dv` rounded up to 64, 128 or 256 (with given scores: the output columns per block).
    pub value_dim: u32,
    /// Given scores (`softmax(X)·V`): no `Q`, tiles of `X` in the `K` slots.
    pub given: bool,
    /// The score rules.
    pub rules: ScoreRules,
    /// With a bias: it is loaded by TMA into each step's slot ([`bias_tiles`]), not read per
    /// element.
    pub bias_tiles: bool,
    /// With `bias_tiles`: the bias is broadcast along the rows, and each step loads one row of
    /// keys that every row reads ([`crate::attention::bias_row_tiles`]).
    pub bias_row: bool,
    /// The blocks take their tiles after the first from a counter ([`TileSchedule::Dynamic`];
    /// not with given scores).
    pub dynamic: bool,
}

impl Variant {
    /// The variant the plan's `config` (tile and score rules) compiles, in `bf16` or f16, its
    /// bias (if any) loaded by TMA where `bias_tiles` ([`bias_tiles`]).
    pub fn new(config: FlashConfig, bf16: bool, bias_tiles: bool) -> Self {
        Self {
            bf16,
            block_q: config.block_q,
            block_k: config.block_k,
            head_dim: config.head_dim,
            value_dim: config.value_dim,
            given: config.source == ScoreSource::Given,
            rules: config.rules,
            bias_tiles: bias_tiles && config.rules.bias && config.source == ScoreSource::QueryKey,
            bias_row: false,
            dynamic: false,
        }
    }

    /// This variant with its tiles handed out by a counter where `dynamic` (not with given
    /// scores).
    pub fn with_dynamic(self, dynamic: bool) -> Self {
        Self {
            dynamic: dynamic && !self.given,
            ..self
        }
    }

    /// This variant with its bias's rows broadcast (`row`, with `bias_tiles`): one row of keys
    /// loaded per step.
    pub fn with_bias_row(self, row: bool) -> Self {
        Self {
            bias_row: row && self.bias_tiles,
            ..self
        }
    }

    /// The `#define`s the source is compiled with; their key is the variant's id.
    #[cfg(feature = "cuda")]
    fn defines(self) -> Defines {
        Defines::elem(self.bf16)
            .word("BLOCK_M", self.block_q)
            .word("BLOCK_N", self.block_k)
            .word("HEAD_DIM", self.head_dim)
            .word("VALUE_DIM", self.value_dim)
            .word("GIVEN", self.given)
            .word("BIAS_TILES", self.bias_tiles)
            .word("BIAS_ROW", self.bias_row)
            .word("DYNAMIC", self.dynamic)
            .word("PARAM_WORDS", PARAM_WORDS as u32)
            .rules(&self.rules)
    }
}

/// The tile of a call: [`BLOCK_Q`] rows (192 where both head dims are at most 64: three
/// consumer warpgroups), the head dims rounded up to 64, 128 or 256, and
/// [`BLOCK_K`] keys per step, 64 where a head dim is 256: `O`'s 128 accumulator registers per
/// thread at `Dv` 256 leave room for 64 columns of scores, and at `D` 256 two slots of 64-key
/// `K` and `V` fit beside the 64 KiB of `Q` (192 KiB in all).
pub fn tile(dims: AttentionDims) -> Tile {
    let (head_dim, value_dim) = (rounded(dims.head_dim), rounded(dims.value_dim));
    // At head dims of 64 each step's products are short against its softmax: a third
    // consumer warpgroup (192 rows) keeps the tensor cores busy.
    let consumers = if head_dim.max(value_dim) == 64 { 3 } else { 2 };
    Tile {
        block_q: 64 * consumers,
        row_tiles: consumers,
        block_k: if head_dim.max(value_dim) > 128 {
            64
        } else {
            BLOCK_K as u32
        },
        head_dim,
        value_dim,
    }
}

/// The tile of `softmax(X)·V` with `d3` output columns: [`BLOCK_Q`] rows of `X`; 64, 128 or
/// 256 output columns per block for `d3` up to 64, 128 and above; [`BLOCK_K`] columns of `X`
/// per step, 64 with 256 output columns (whose 128 accumulator registers per thread leave room
/// for 64 columns of scores only). `head_dim` is the columns of `X` per step. Column tiles of
/// one row block run as adjacent blocks and share their `X` through L2, but each computes the
/// weights again: the widest tile does that least.
pub fn given_tile(d3: usize) -> Tile {
    let (block_k, value_dim) = if d3 > 128 {
        (64, 256)
    } else {
        (BLOCK_K as u32, rounded(d3))
    };
    Tile {
        block_q: BLOCK_Q as u32,
        row_tiles: 2,
        block_k,
        head_dim: block_k,
        value_dim,
    }
}

/// A head dim rounded up to a whole `wgmma` width of 64-column swizzle atoms: 64, 128 or 256.
fn rounded(dim: usize) -> u32 {
    match dim {
        0..=64 => 64,
        65..=128 => 128,
        _ => 256,
    }
}

/// The tiles of an attention forward of `dims` with `config`'s rows per block: (row blocks,
/// query heads, batches), the kernel's `tiles_x`, `tiles_y`, `tiles_z`.
pub fn tiles(dims: AttentionDims, config: FlashConfig) -> (usize, usize, usize) {
    (
        dims.seq_q.div_ceil(config.block_q as usize).max(1),
        dims.heads_q,
        dims.batch,
    )
}

/// The tiles of `softmax(X)·V` of `d1` rows and `d3` output columns per batch with `config`
/// ([`given_tile`]): (column tiles, row blocks, batches).
pub fn given_tiles(
    d1: usize,
    d3: usize,
    batch: usize,
    config: FlashConfig,
) -> (usize, usize, usize) {
    (
        d3.div_ceil(config.value_dim as usize).max(1),
        d1.div_ceil(config.block_q as usize).max(1),
        batch,
    )
}

/// Bytes of keys and values the causal tile order keeps in L2 at once: half an H100's or
/// H200's 50 MiB.
pub const CAUSAL_L2_BYTES: usize = 24 << 20;

/// The (batch, head) planes per chunk of the causal tile order (the kernel's `tile_place`): as
/// many as keep their keys and values within [`CAUSAL_L2_BYTES`] (at least one). The row
/// blocks of a chunk run longest first; ordering every plane's longest first instead measured
/// slower at long sequences (the blocks running at once read as many heads' keys and values
/// from HBM; RESULTS.md §4.0).
pub fn causal_chunk(dims: AttentionDims, elem_size: usize) -> usize {
    let plane = dims.seq_k * (dims.head_dim + dims.value_dim) * elem_size;
    (CAUSAL_L2_BYTES / plane.max(1)).clamp(1, (dims.batch * dims.heads_q).max(1))
}

/// The causal order's chunk under [`TileSchedule::Blocks`] (the test suites' schedule): two
/// planes, so that small shapes run several chunks and a partial last one.
pub const TEST_CHUNK: usize = 2;

/// Blocks of a launch over `tiles` on a device of `sms` multiprocessors under `schedule`
/// ([`TileSchedule::Planned`]: persistent, one block per SM).
pub fn blocks(tiles: (usize, usize, usize), sms: usize, schedule: TileSchedule) -> usize {
    schedule.blocks(tiles.0 * tiles.1 * tiles.2, sms, true)
}

/// Whether the forward of `config` takes its tiles after the first round from the counter
/// (`DYNAMIC`) under `schedule`: where asked ([`TileSchedule::Dynamic`]), and under the plan's
/// schedule for causal or windowed calls with 128-row tiles, whose tiles' lengths differ and
/// leave statically scheduled blocks idle (s50 c2: +10–13 % over static rounds at D 128, +3–5 %
/// over one block per tile). Not with given scores; at head dims of 64 (192-row tiles) static
/// rounds measured faster (18–20 %: short tiles expose the counter's fetch), RESULTS.md §4.0.
pub fn dynamic(config: FlashConfig, schedule: TileSchedule) -> bool {
    config.source == ScoreSource::QueryKey
        && match schedule {
            TileSchedule::Planned => {
                (config.rules.causal || config.rules.window) && config.block_q == BLOCK_Q as u32
            }
            schedule => schedule.dynamic(),
        }
}

/// Whether the Hopper forward of `config` loads its bias by TMA: a bias is read and
/// `features` says TMA can load it, as tiles ([`crate::attention::bias_tiles`]) or as one
/// broadcast row ([`crate::attention::bias_row_tiles`]).
pub fn bias_tiles(config: FlashConfig, features: AttentionFeatures) -> bool {
    config.rules.bias
        && (features.bias_tiles || features.bias_row_tiles)
        && config.source == ScoreSource::QueryKey
}

/// Dynamic shared memory for `config`'s tile: `Q` (none with given scores), [`STAGES`] slots of
/// `K` (or `X`), `V` and, where the bias comes by TMA (`bias_tiles`, [`bias_tiles`]), the
/// bias's `block_q × block_k` (128 bytes per row per 64 columns: `Q`, `X` and the bias have
/// `block_q` rows, `K` and `V` `block_k`), the barriers, and 1 KiB to align the swizzle atoms.
/// At `D` 128 with a bias that is 225 KiB of the H100's and H200's 227.
pub fn shared_bytes(config: FlashConfig, bias_tiles: bool) -> usize {
    let (d, dv) = (
        config.head_dim as usize / 64,
        config.value_dim as usize / 64,
    );
    let rows_atom = config.block_q as usize * 128;
    let keys_atom = config.block_k as usize * 128;
    let (q, k) = if config.source == ScoreSource::Given {
        (0, d * rows_atom)
    } else {
        (d * rows_atom, d * keys_atom)
    };
    let bias = if bias_tiles {
        (config.block_k as usize / 64) * rows_atom
    } else {
        0
    };
    1024 + q + STAGES * (k + dv * keys_atom + bias) + 128
}

/// Whether the plan picks the Hopper forward for a call it can run with `features` under
/// `hopper`: under [`HopperUse::Faster`], without a mask, and without a bias unless TMA loads
/// it: as tiles ([`bias_tiles`]: 2.2–2.5× the `mma.sync` kernel, RESULTS.md §4.0.1) or, broadcast
/// along the rows, as one row per step ([`Variant::bias_row`]: about 2× the `mma.sync` kernel,
/// §4.0.1). A mask, or a bias read per element, measured slower than on the `mma.sync` kernel
/// (§4.2, §5.2).
pub fn preferred(features: AttentionFeatures, hopper: HopperUse) -> bool {
    hopper.wanted(
        !features.mask && (!features.bias || features.bias_tiles || features.bias_row_tiles),
    )
}

/// Why the Hopper forward cannot run a call (`None`: it can). `hopper` says whether the device
/// is an sm_90 GPU (`crate::hopper::sm90` on CUDA builds).
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
        "the Hopper forward takes f16 and bf16"
    } else if dims.head_dim > 256 || dims.value_dim > 256 {
        "the Hopper forward takes head dims up to 256"
    } else if !features.aligned {
        "the Hopper forward reads rows through TMA: unit stride along the head dim, head dims and strides multiples of 8 elements"
    } else if dims.seq_q.div_ceil(64) * dims.heads_q * dims.batch > i32::MAX as usize {
        "the Hopper forward counts its tiles (row blocks × heads × batches) in 31 bits"
    } else if dims.seq_q > i32::MAX as usize / 2 || dims.seq_k > i32::MAX as usize / 2 {
        "the Hopper forward indexes positions with 32-bit integers"
    } else {
        return None;
    };
    Some(reason.into())
}

/// The kernel of `variant` with `units` threads and `shared_bytes` of shared memory, with the
/// active mutations (`--features mutants`) applied to its source.
#[cfg(feature = "cuda")]
fn hand_written<R: CudaCompiled>(
    client: &ComputeClient<R>,
    variant: Variant,
    units: u32,
    shared_bytes: usize,
) -> HandWritten<R> {
    let (source, hash) = crate::hopper::mutated(
        SOURCE,
        SOURCE_HASH,
        &[
            (
                crate::mutation::no_rescale(),
                "corr[r] = ex2(m_r[r] - shift[r]);",
                "corr[r] = 1.0f;",
            ),
            (
                crate::mutation::causal_top_left(),
                "const int diag = (int)p.seq_k - (int)p.seq_q;",
                "const int diag = 0;",
            ),
            (
                crate::mutation::quiet_off(),
                "float total = l + ex2(-m_r[r]);",
                "float total = l;",
            ),
            (
                crate::mutation::hopper_no_wait(),
                "if (g >= STAGES) mbar_wait(",
                "if (false) mbar_wait(",
            ),
            (
                crate::mutation::q_early(),
                "if (round > 0u) mbar_wait(q_empty,",
                "if (false) mbar_wait(q_empty,",
            ),
            (
                crate::mutation::tile_skip(),
                "tile = gridDim.x + atomicAdd(tile_counter, 1u);",
                "tile = gridDim.x + atomicAdd(tile_counter, 2u);",
            ),
            (
                crate::mutation::varlen_first_row(),
                "if ((int)seqs[mid] <= pos) a = mid;",
                "if ((int)seqs[mid] < pos) a = mid;",
            ),
            (
                crate::mutation::window_right(),
                "rows.right = (int)p.s.window_right;",
                "rows.right = (int)p.s.window_right + 1;",
            ),
            (
                crate::mutation::window_right(),
                "last_row + diag + (int)p.s.window_right);",
                "last_row + diag + (int)p.s.window_right + 1);",
            ),
            (
                crate::mutation::bias_block(),
                "j * BLOCK_N + 64 * a, bias_m, bias_head, bias_batch);",
                "(j ^ 1) * BLOCK_N + 64 * a, bias_m, bias_head, bias_batch);",
            ),
            (
                crate::mutation::forced_spill(),
                "    regs_claim<240>();",
                "    regs_claim<176>();",
            ),
            (
                crate::mutation::dropped_parameter(),
                "const unsigned short* k_buffer,\n",
                "\n",
            ),
            (
                crate::mutation::hopper_syntax(),
                "const int diag = (int)p.seq_k - (int)p.seq_q;",
                "const int diag = (int)p.seq_k - (int)p.seq_q",
            ),
        ],
    );
    let defines = variant.defines();
    HandWritten::new_hashed(
        client,
        source,
        hash,
        ENTRY,
        CubeDim::new_1d(units),
        shared_bytes,
        defines.key(),
    )
    .with_defines(&defines)
}

/// A mask or bias as the Hopper forward reads it: the buffer, and its strides over
/// `[B, Hq, Sq, Sk]` with 0 along broadcast dimensions.
#[cfg(feature = "cuda")]
pub type ScoreTerm<'a> = (&'a TensorRef<'a>, &'a [usize]);

/// The buffers of a mask and a bias as the Hopper kernels bind them, their strides (4 words
/// each) appended to `params`. An absent one is never read: `stand_in` takes its place, with
/// zero strides.
#[cfg(feature = "cuda")]
pub(crate) fn bind_terms(
    mask: Option<ScoreTerm<'_>>,
    bias: Option<ScoreTerm<'_>>,
    stand_in: &TensorRef<'_>,
    params: &mut Vec<u64>,
) -> [cubecl::server::Handle; 2] {
    [mask, bias].map(|term| match term {
        Some((t, strides)) => {
            params.extend(strides.iter().map(|&s| s as u64));
            t.handle.clone()
        }
        None => {
            params.extend([0; 4]);
            stand_in.handle.clone()
        }
    })
}

/// Launches the forward of `dims` on `client`: `out` and `lse` of attention over `q`, `k`, `v`,
/// with an optional `mask` and `bias` (shapes checked by the caller, [`unavailable`] `None`
/// for this call, buffers starting on 16 bytes ([`crate::attention::starts_aligned`])), as
/// `plan` says: its config's tile and score rules pick the [`Variant`], its units, shared
/// memory and cubes (`(blocks, 1, 1)` over the [`tiles`]) make the launch.
///
/// # Safety
/// The shapes and strides describe the buffers.
#[cfg(feature = "cuda")]
pub unsafe fn launch<R: CudaCompiled>(
    client: &ComputeClient<R>,
    q: &TensorRef<'_>,
    k: &TensorRef<'_>,
    v: &TensorRef<'_>,
    mask: Option<ScoreTerm<'_>>,
    bias: Option<ScoreTerm<'_>>,
    slopes: Option<&TensorRef<'_>>,
    sinks: Option<&TensorRef<'_>>,
    seqs: Option<&TensorRef<'_>>,
    out: &TensorRef<'_>,
    lse: &TensorRef<'_>,
    dims: AttentionDims,
    dtype: StorageType,
    options: &AttentionOptions,
    plan: &AttentionPlan,
) {
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let by_tiles = bias.is_some_and(|(b, strides)| crate::attention::bias_tiles(b, strides));
    let row = bias.is_some_and(|(b, strides)| crate::attention::bias_row_tiles(b, strides));
    let variant = Variant::new(plan.config, bf16, by_tiles || row)
        .with_bias_row(row)
        .with_dynamic(dynamic(plan.config, options.schedule));
    debug_assert_eq!(
        plan.shared_bytes,
        shared_bytes(plan.config, variant.bias_tiles),
        "the plan and the launch see the same bias"
    );
    let kernel = hand_written(client, variant, plan.units, plan.shared_bytes);
    let mut params = vec![
        out.strides[0] as u64,
        out.strides[1] as u64,
        out.strides[2] as u64,
        lse.strides[0] as u64,
        lse.strides[1] as u64,
        lse.strides[2] as u64,
        words(dims.seq_q as u32, dims.seq_k as u32),
        words(dims.group() as u32, dims.value_dim as u32),
    ];
    params.extend(options.scalars().hopper_words(options.masked_score));
    let [mask_handle, bias_handle] = bind_terms(mask, bias, out, &mut params);
    // The batch words of given scores, not read.
    params.push(0);
    // The packed sequences: `[2·(n + 1)]` cumulative lengths.
    let n_seqs = seqs.map_or(0, |s| s.shape[0] / 2 - 1);
    // The bias's TMA map and which of its batch and head coordinates are read.
    let block_q = plan.config.block_q as usize;
    let bias_map = bias
        .filter(|_| variant.bias_tiles)
        .map(|term| bias_map(term, dims, dtype, block_q));
    let planes = bias_map.as_ref().map_or(0, |(_, planes)| *planes);
    params.push(words(n_seqs as u32, planes));
    let (tx, ty, tz) = tiles(dims, plan.config);
    let chunk = match options.schedule {
        // The suites' schedule: their small shapes cross chunk boundaries too.
        TileSchedule::Blocks(_) => TEST_CHUNK,
        // Blocks that take the next tile as they finish balance any order: each head's
        // longest first, few heads' keys and values read at once.
        _ if variant.dynamic => 1,
        _ => causal_chunk(dims, dtype.size()),
    };
    params.extend([words(tx as u32, ty as u32), words(tz as u32, chunk as u32)]);
    // The plan's blocks, each taking tiles in rounds (`fwd_tile`, `round_tile`).
    let count = CubeCount::Static(plan.cubes.0 as u32, 1, 1);
    let mut maps = vec![
        tensor_map(q, dtype, block_q),
        tensor_map(k, dtype, plan.config.block_k as usize),
        tensor_map(v, dtype, plan.config.block_k as usize),
    ];
    // The bias's rows × 64 keys (a variant with `BIAS_TILES` takes a fourth map).
    maps.extend(bias_map.map(|(map, _)| map));
    // The counter of tiles handed out after the first round (`DYNAMIC`), zero at the start.
    let counter = variant.dynamic.then(|| client.create_from_slice(&[0u8; 4]));
    // SAFETY: the loads stay inside `q`, `k`, `v` and a bias by TMA (TMA clips every box to the
    // shapes given, the bias's view describes its buffer: `bias_map`),
    // and the mask and bias reads inside theirs (rows below `Sq`, keys below `Sk`, through the
    // strides checked by the caller); tile (m, h, b) writes rows `block_q`·m .. below `Sq` of
    // `out[b, h]` and `lse[b, h]`, columns below `Dv`, through the strides given, and each tile
    // is one block's in one round (`round_tile` covers 0 .. tiles once over the blocks; with
    // `DYNAMIC` the first round's tiles are the blocks' and the counter hands out each later
    // tile once).
    unsafe {
        kernel.launch_with_maps(
            count,
            maps,
            buffers(
                out,
                lse,
                [mask_handle, bias_handle],
                [
                    slopes.map(|t| t.handle.clone()),
                    sinks.map(|t| t.handle.clone()),
                    seqs.map(|t| t.handle.clone()),
                    // Read only with `DYNAMIC`.
                    counter,
                ],
            ),
            checked(params),
        );
    }
}

/// The kernel's buffers after its maps: `out`, `lse`, the mask and the bias (or their
/// stand-ins, [`bind_terms`]), then the ALiBi slopes, the sinks, the packed sequences and the
/// tile counter, an absent one of which is never read and bound as `lse` (f32).
#[cfg(feature = "cuda")]
fn buffers(
    out: &TensorRef<'_>,
    lse: &TensorRef<'_>,
    [mask, bias]: [cubecl::server::Handle; 2],
    optional: [Option<cubecl::server::Handle>; 4],
) -> Vec<cubecl::server::Binding> {
    let mut buffers = vec![
        out.handle.clone().binding(),
        lse.handle.clone().binding(),
        mask.binding(),
        bias.binding(),
    ];
    buffers.extend(
        optional
            .into_iter()
            .map(|h| h.unwrap_or_else(|| lse.handle.clone()).binding()),
    );
    buffers
}

/// `params` after checking they are the kernel's [`PARAM_WORDS`].
#[cfg(feature = "cuda")]
fn checked(params: Vec<u64>) -> Vec<u64> {
    assert_eq!(
        params.len(),
        PARAM_WORDS,
        "the Hopper forward's parameter words"
    );
    params
}

/// The TMA map of a bias `(b, strides)` over `[B, Hq, Sq, Sk]` (a
/// [`crate::attention::bias_tiles`] one), boxes of `rows` × 64 keys, and the Hopper kernels'
/// `bias_planes` word (bit 0: batches read, bit 1: heads). The map reads the bias as a 4-D
/// tensor whose broadcast batch or head dimensions have size 1 (read at coordinate 0) and the
/// strides of a contiguous layout, which the map encoder accepts. A bias broadcast along the
/// rows ([`crate::attention::bias_row_tiles`], the forward's `BIAS_ROW`) is read as one row of
/// keys per batch and head, in boxes one row high.
#[cfg(feature = "cuda")]
pub(crate) fn bias_map(
    (b, strides): ScoreTerm<'_>,
    dims: AttentionDims,
    dtype: StorageType,
    rows: usize,
) -> (cubecl::server::TensorMapBinding, u32) {
    let (batched, headed) = (strides[0] != 0, strides[1] != 0);
    // Rows broadcast: one row, whose stride (never stepped) is a whole number of 16 bytes.
    let (seq_q, row_stride, rows) = match strides[2] {
        0 => (1, dims.seq_k.next_multiple_of(8), 1),
        s => (dims.seq_q, s, rows),
    };
    let plane = seq_q * row_stride;
    let heads = if headed { dims.heads_q } else { 1 };
    let shape = [
        if batched { dims.batch } else { 1 },
        heads,
        seq_q,
        dims.seq_k,
    ];
    let view_strides = [
        if batched { strides[0] } else { heads * plane },
        if headed { strides[1] } else { plane },
        row_stride,
        1,
    ];
    let planes = u32::from(batched) | (u32::from(headed) << 1);
    (
        tensor_map(&view(b, &shape, &view_strides), dtype, rows),
        planes,
    )
}

/// A 3-D tensor `[batch, rows, cols]` as the 4-D `[batch, 1, rows, cols]` its TMA map reads,
/// and whether its batch is read (`false`: one batch for all, a batch of 1 or stride 0, read at
/// batch coordinate 0). Dimensions of size 1 get the stride of a contiguous layout, which the
/// map encoder accepts whatever the caller's stride was.
#[cfg(feature = "cuda")]
pub(crate) fn tma_view(t: &TensorRef<'_>) -> ([usize; 4], [usize; 4], bool) {
    let (rows, cols) = (t.shape[1], t.shape[2]);
    let row_stride = if rows > 1 { t.strides[1] } else { cols };
    let plane = rows * row_stride;
    let batched = t.shape[0] > 1 && t.strides[0] != 0;
    let batch_stride = if batched { t.strides[0] } else { plane };
    (
        [if batched { t.shape[0] } else { 1 }, 1, rows, cols],
        [batch_stride, plane, row_stride, 1],
        batched,
    )
}

/// `t`'s buffer seen with `shape` and `strides` (a [`tma_view`]).
#[cfg(feature = "cuda")]
pub(crate) fn view<'a>(
    t: &TensorRef<'a>,
    shape: &'a [usize],
    strides: &'a [usize],
) -> TensorRef<'a> {
    TensorRef {
        handle: t.handle,
        shape,
        strides,
    }
}

/// Launches `softmax(X)·V` on `client`: `out` (`[batch, d1, d3]`) and `lse` (`[batch, d1]`,
/// f32) of `x` (`[batch or 1, d1, d2]`) and `v` (`[batch or 1, d2, d3]`), as the plan says:
/// `config` (from [`given_tile`]) picks the [`Variant`], `units` and `blocks` (over the
/// [`given_tiles`]) make the launch. The caller checked the shapes, that `d1`, `d2`,
/// `d3` are not 0, and what `crate::softmax_matmul::hopper_unavailable` checks: rows and row
/// strides of 16 bytes, starts on 16 bytes, nonzero row strides.
///
/// # Safety
/// The shapes and strides describe the buffers.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_given<R: CudaCompiled>(
    client: &ComputeClient<R>,
    x: &TensorRef<'_>,
    v: &TensorRef<'_>,
    out: &TensorRef<'_>,
    lse: &TensorRef<'_>,
    dtype: StorageType,
    config: FlashConfig,
    units: u32,
    blocks: usize,
) {
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let variant = Variant::new(config, bf16, false);
    let kernel = hand_written(client, variant, units, shared_bytes(config, false));
    let (d1, d2, d3) = (x.shape[1], x.shape[2], v.shape[2]);
    let (x_shape, x_strides, x_batched) = tma_view(x);
    let (v_shape, v_strides, v_batched) = tma_view(v);
    let x4 = view(x, &x_shape, &x_strides);
    let v4 = view(v, &v_shape, &v_strides);
    let mut params = vec![
        out.strides[0] as u64,
        0,
        out.strides[1] as u64,
        lse.strides[0] as u64,
        0,
        lse.strides[1] as u64,
        words(d1 as u32, d2 as u32),
        words(1, d3 as u32),
    ];
    // Scale 1 and no other rule ([`Scalars::GIVEN`]).
    params.extend(Scalars::GIVEN.hopper_words(None));
    // No mask or bias: zero strides.
    params.extend([0; 8]);
    params.push(words(u32::from(x_batched), u32::from(v_batched)));
    // No packed sequences: the word is not read.
    params.push(0);
    let (tx, ty, tz) = given_tiles(d1, d3, out.shape[0], config);
    params.extend([words(tx as u32, ty as u32), words(tz as u32, 0)]);
    let count = CubeCount::Static(blocks as u32, 1, 1);
    // The `Q` map is not read with given scores: `X`'s stands in.
    let maps = vec![
        tensor_map(&x4, dtype, BLOCK_Q),
        tensor_map(&x4, dtype, BLOCK_Q),
        tensor_map(&v4, dtype, config.block_k as usize),
    ];
    // SAFETY: the loads stay inside `x` and `v` (TMA clips every box to the shapes given, the
    // views describe the caller's buffers); tile (t, m, b) writes rows 128m .. 128m + 127
    // below `d1` of `out[b]` and `lse[b]` (`lse` only for t = 0), columns `VALUE_DIM`·t .. below
    // `d3`, through the strides given. The mask, bias, slopes, sinks, sequences and counter
    // stand-ins (`out`, `lse`) are never read.
    unsafe {
        kernel.launch_with_maps(
            count,
            maps,
            buffers(
                out,
                lse,
                [out.handle.clone(), out.handle.clone()],
                [None, None, None, None],
            ),
            checked(params),
        );
    }
}
