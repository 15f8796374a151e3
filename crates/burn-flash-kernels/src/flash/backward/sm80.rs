//! The attention backward on Ampere and later (sm_80 … sm_90), FlashAttention-2's data flow,
//! hand-written CUDA (`sm80.cu` next to this file, on `crate::hopper`'s `sm80.cuh` wrappers):
//! one block of 256 threads per [`Shape`]'s keys of one (batch, key/value head) keeps `K`, `V`
//! in shared memory and `dK`, `dV` in registers while it walks the group's query rows 64 at a
//! time; per step it computes `S` and `dP` in one warp layout (2 × 4 warps over rows × keys),
//! stores `P` and `dS` to shared memory, accumulates `dV += Pᵀ·dO` and `dK += dSᵀ·Q` in a
//! second (warps along the keys × along the columns, each `ldmatrix.trans` fragment feeding
//! every n-tile of its row) and adds `dQ = dS·K` into an f32 accumulator in a third. It runs
//! between the Hopper backward's per-row passes (`hopper::RowPasses`, with a
//! row-major accumulator). NOTES.md ("Issue 56") gives the design and the register counts.
//!
//! cubecl 0.10's `#[cube]` `mma` path cannot state a warp layout per product or `ldmatrix`
//! reuse across products, which is this kernel's whole change; the `#[cube]` kernels stay
//! wgpu's path and the tests' baseline.
//!
//! f16 and bf16, head dims up to 128 (rounded up to 64 or 128), grouped-query heads and every
//! score rule of the Hopper backward (causal, softcap, mask hiding or filling, bias and a
//! written `dS` — not under a softcap —, dropout, window, ALiBi, sinks, quiet softmax, packed
//! sequences); [`unavailable`] names what it does not take. Planned
//! ([`AmpereUse`](crate::attention::AmpereUse)) where the Hopper backward does not take the
//! call, by default on the GPUs where it has run ([`default_on`]) and for the rule sets a GPU
//! run has verified ([`default_rules`]); the rest under `AmpereUse::Always`, else the `mma.sync`
//! backward. RESULTS.md §5.0.2 has its measurements.

#[cfg(feature = "cuda")]
use crate::attention::options::BackwardTensors;
use crate::attention::options::{AmpereTile, AttentionDims, AttentionOptions};
#[cfg(feature = "cuda")]
use crate::flash::FlashConfig;
use crate::flash::{ScoreRules, Tile};
#[cfg(feature = "cuda")]
use crate::hopper::task::HandWritten;
#[cfg(feature = "cuda")]
use crate::hopper::{CudaCompiled, Defines, words};
use cubecl::prelude::*;

/// Query rows per step.
pub const BLOCK_M: usize = 64;
/// Threads per block (8 warps).
pub const UNITS: u32 = 256;

/// 256 threads at up to 255 registers: one block per SM ([`Shape::blocks`] 1). No spill
/// without score rules; known spills with them (NVRTC 13.5, D 128, 128 keys; bytes stored +
/// loaded; `cargo xtask cuda-check`'s grid): on sm_90a 20 + 24 B (causal, mask with the fill
/// score, quiet), 12 + 12 B (causal, dropout), 4 + 4 B (window, ALiBi); on sm_80 12 + 12 B (mask,
/// bias, softcap). Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::spilling(1, 48);

/// Two blocks of 256 threads per SM, 128 registers a thread ([`Shape::blocks`] 2, entry
/// `burn_flash_sm80_backward_paired`): no spill at D 64 (128 registers), a known spill at
/// D 128 (NVRTC 13.5: 12 + 12 B plain and 60 + 60 B causal on sm_90a's two stages, 60 + 44 B
/// and 24 + 24 B on sm_80's one).
pub const PAIRED_OCCUPANCY: crate::occupancy::Occupancy =
    crate::occupancy::Occupancy::spilling(2, 120);

#[cfg(feature = "cuda")]
const ENTRY: &str = "burn_flash_sm80_backward";
#[cfg(feature = "cuda")]
const PAIRED_ENTRY: &str = "burn_flash_sm80_backward_paired";

/// Words of the kernel's parameter struct (`Sm80BwdParams`, which the source asserts).
#[cfg(feature = "cuda")]
const PARAM_WORDS: usize = 46;

/// The CUDA source: the instruction wrappers, the score helpers, the kernel.
#[cfg(feature = "cuda")]
pub const SOURCE: &str = concat!(
    include_str!("../../hopper/sm80.cuh"),
    include_str!("../scores.cuh"),
    include_str!("sm80.cu")
);

#[cfg(feature = "cuda")]
const SOURCE_HASH: u64 = crate::hopper::source_hash(SOURCE);

/// Shared memory the driver reserves per block (and adds to the per-block maximum to make the
/// SM's): 1 KiB on sm_80 and later.
pub const RESERVED_SHARED: usize = 1 << 10;

/// A block shape of the kernel: `sm80.cu`'s `BLOCK_N`, `STAGES` and `PAIRED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Keys a block (its `K`, `V` tiles, kept for the whole query loop): 64 or 128.
    pub keys: u32,
    /// `Q`/`dO` slots: 2 (the next step's copies under this step's products) or 1.
    pub stages: u32,
    /// Blocks the kernel is built to share an SM with (`__launch_bounds__`' minimum): 1 (up to
    /// 255 registers a thread) or 2 (128).
    pub blocks: u32,
}

impl Shape {
    /// 128 keys, two stages, one block a SM ([`AmpereTile::Wide`]).
    pub const WIDE: Self = Self {
        keys: 128,
        stages: 2,
        blocks: 1,
    };
    /// 64 keys, one stage, one block a SM ([`AmpereTile::Narrow`]).
    pub const NARROW: Self = Self {
        keys: 64,
        stages: 1,
        blocks: 1,
    };

    /// The tile of `dims` in this shape: the head dims rounded up to 64 or 128.
    pub fn tile(self, dims: AttentionDims) -> Tile {
        let rounded = |dim: usize| dim.max(64).next_power_of_two() as u32;
        Tile {
            block_q: BLOCK_M as u32,
            row_tiles: 1,
            block_k: self.keys,
            head_dim: rounded(dims.head_dim),
            value_dim: rounded(dims.value_dim),
        }
    }

    /// Dynamic shared memory a block of `dims` (`sm80.cu`'s `SMEM_BYTES`): `K` and `V` of the
    /// block, `P` and `dS` (64 × keys each), and per stage `Q`, `dO` (64 rows) and the rows'
    /// `lse₂` and `δ`; 16-bit elements. D = Dv = 128: 164 864 bytes [`WIDE`](Self::WIDE),
    /// 82 432 [`NARROW`](Self::NARROW).
    pub fn shared_bytes(self, dims: AttentionDims) -> usize {
        let tile = self.tile(dims);
        let (keys, d, dv) = (
            self.keys as usize,
            tile.head_dim as usize,
            tile.value_dim as usize,
        );
        2 * keys * (d + dv)
            + 2 * 2 * BLOCK_M * keys
            + self.stages as usize * (2 * BLOCK_M * (d + dv) + 2 * 4 * BLOCK_M)
    }

    /// Whether [`blocks`](Self::blocks) blocks of `dims` fit one SM of a device with
    /// `max_shared` bytes of shared memory a block (the SM has [`RESERVED_SHARED`] more, and
    /// each block reserves that much).
    pub fn fits(self, dims: AttentionDims, max_shared: usize) -> bool {
        self.blocks as usize * (self.shared_bytes(dims) + RESERVED_SHARED)
            <= max_shared + RESERVED_SHARED
    }

    /// The entry point of this shape's variant.
    #[cfg(feature = "cuda")]
    fn entry(self) -> &'static str {
        if self.blocks == 2 {
            PAIRED_ENTRY
        } else {
            ENTRY
        }
    }
}

/// The shape `choice` gives a call of `dims` on a device with `max_shared` bytes of shared
/// memory a block; `None` where it does not fit. [`AmpereTile::Planned`] takes
/// [`Shape::WIDE`] where it fits, else [`Shape::NARROW`] (the shapes a GPU run has verified
/// as the default; RESULTS.md §5.0.2); [`AmpereTile::Paired`] two stages where two blocks of
/// them fit, else one.
pub fn shape(dims: AttentionDims, choice: AmpereTile, max_shared: usize) -> Option<Shape> {
    let fits = |shape: &Shape| shape.fits(dims, max_shared);
    let candidates: &[Shape] = match choice {
        AmpereTile::Planned => &[Shape::WIDE, Shape::NARROW],
        AmpereTile::Wide => &[Shape::WIDE],
        AmpereTile::Narrow => &[Shape::NARROW],
        AmpereTile::Paired => &[
            Shape {
                keys: 64,
                stages: 2,
                blocks: 2,
            },
            Shape {
                keys: 64,
                stages: 1,
                blocks: 2,
            },
        ],
    };
    candidates.iter().copied().find(fits)
}

/// Whether `client` is a CUDA client (a GPU's, or `cuda-check`'s stated architecture): the
/// hand-written kernels launch on nothing else.
pub fn cuda<R: Runtime>(client: &ComputeClient<R>) -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::hopper::with_cuda_client!(client, |_cuda| ()).is_some()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = client;
        false
    }
}

/// Whether [`AmpereUse::Faster`](crate::attention::AmpereUse::Faster) gives the Ampere backward
/// the calls it takes on `client`'s device: where its variants have run on a GPU and measured
/// faster than the `mma.sync` backward — sm_90 (H100, H200; RESULTS.md §5.0.2), where the
/// 128-key tile and the paired `red.global.add.v2.f32` run. sm_80–89 add `dQ` by scalar
/// `red.add.f32` pairs (no `.v2` there), a variant no GPU has run, so they take it only under
/// `AmpereUse::Always` until a GPU run verifies it (their 99 KiB tile, [`Shape::NARROW`], has
/// run on an H100: RESULTS.md §5.0.3; NOTES.md, "Issue 56's kernel").
pub fn default_on<R: Runtime>(client: &ComputeClient<R>) -> bool {
    crate::attention::plan::sm90(client)
}

/// Whether [`AmpereUse::Faster`](crate::attention::AmpereUse::Faster) gives the Ampere backward a
/// call of `rules` (writing `dS` where `write_ds`): the rule sets a GPU run has verified in
/// this kernel — causal and grouped-query calls (quiet softmax and sinks change only the stored
/// log-sum-exp, which the backward reads as it is). The other rules (softcap, mask, bias and
/// `dS`, dropout, window, ALiBi, packed sequences; s57) run under
/// [`AmpereUse::Always`](crate::attention::AmpereUse::Always) until a GPU run verifies them.
pub fn default_rules(rules: ScoreRules, write_ds: bool) -> bool {
    let plain = ScoreRules {
        causal: rules.causal,
        quiet: rules.quiet,
        sinks: rules.sinks,
        ..ScoreRules::NONE
    };
    rules == plain && !write_ds
}

/// Why the Ampere backward cannot run a call (`None`: it can). `cuda` says whether the client
/// is a CUDA one; `matrix_units` is the `mma` path's own answer for the device, type and
/// alignment ([`crate::fragment::unavailable`]); `max_shared` the device's shared memory per
/// block; `write_ds` whether the call writes `dS`.
#[allow(clippy::too_many_arguments)]
pub fn unavailable(
    cuda: bool,
    matrix_units: Option<crate::fragment::MatrixUnitsUnavailable>,
    dims: AttentionDims,
    rules: ScoreRules,
    options: &AttentionOptions,
    write_ds: bool,
    max_shared: usize,
) -> Option<String> {
    let reason = if !cuda {
        "the Ampere backward is hand-written CUDA".to_string()
    } else if let Some(reason) = matrix_units {
        format!("the Ampere backward runs on the matrix units: {reason}")
    } else if dims.head_dim > 128 || dims.value_dim > 128 {
        "the Ampere backward takes head dims up to 128".into()
    } else if write_ds && rules.softcap {
        "the Ampere backward writes no dS under a softcap (its dS tile holds dS times the softcap's derivative)".into()
    } else if options.deterministic {
        "the Ampere backward adds dQ with atomics (not deterministic)".into()
    } else if dims.seq_q == 0 || dims.seq_k == 0 {
        "the Ampere backward takes non-empty sequences".into()
    } else if dims.heads_kv > 65_535 || dims.batch > 65_535 {
        "the Ampere backward launches one block row per key/value head and batch: at most 65535 each".into()
    } else if dims.seq_q > i32::MAX as usize / 2 || dims.seq_k > i32::MAX as usize / 2 {
        "the Ampere backward indexes positions with 32-bit integers".into()
    } else if shape(dims, options.ampere_tile, max_shared).is_none() {
        let least = match options.ampere_tile {
            AmpereTile::Planned | AmpereTile::Narrow => Shape::NARROW,
            AmpereTile::Wide => Shape::WIDE,
            AmpereTile::Paired => Shape {
                stages: 1,
                blocks: 2,
                ..Shape::NARROW
            },
        };
        format!(
            "the Ampere backward's {:?} tile needs {} B of shared memory a block ({} a SM); the device has {max_shared} a block",
            options.ampere_tile,
            least.shared_bytes(dims),
            least.blocks,
        )
    } else {
        return None;
    };
    Some(reason)
}

/// Launches the backward of `dims` on `client`: the per-row prepass, the main kernel in
/// `shape` on `cubes` (key blocks of `config`'s tile — `shape`'s —, `Hkv`, `B`), then `dQ`'s
/// conversion. `t` was checked by the caller (shapes, [`unavailable`] `None`, `shape` from
/// [`shape`] for the device; a `ds` only without a softcap); `mask_strides` and `bias_strides`
/// are those of `t.mask` and `t.bias` over `[B, Hq, Sq, Sk]`, 0 along broadcast dimensions.
///
/// # Safety
/// The shapes and strides of `t` describe the buffers.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch<R: CudaCompiled>(
    client: &ComputeClient<R>,
    t: &BackwardTensors<'_>,
    dims: AttentionDims,
    dtype: StorageType,
    options: &AttentionOptions,
    config: FlashConfig,
    (mask_strides, bias_strides): (Option<&[usize]>, Option<&[usize]>),
    shape: Shape,
    cubes: (usize, usize, usize),
) {
    use super::hopper::{RowPasses, call_words, strides};
    use crate::mutation;
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    debug_assert_eq!(
        config.tile(),
        shape.tile(dims),
        "the plan's tile is the shape's"
    );
    // The accumulator is row-major, `HEAD_DIM` columns a row (`DQ_TILED 0`).
    let passes = RowPasses::new(
        client,
        t,
        dims,
        options,
        bf16,
        (config.head_dim as usize, false, false),
    );
    let (source, hash) = crate::hopper::mutated(
        SOURCE,
        SOURCE_HASH,
        &[
            (
                mutation::zero_dk(),
                "dk_acc, p.scale, key0",
                "dk_acc, 0.0f, key0",
            ),
            (
                mutation::ds_store_skipped(),
                "sm80_sts_u32(sds + PS_OFF(mt, h, nt),",
                "if (mt == 0) sm80_sts_u32(sds + PS_OFF(mt, h, nt),",
            ),
            (
                mutation::warp_cols(),
                "w3_col = P3_COLS * (warp % 4u);",
                "w3_col = P3_COLS * (warp % 2u);",
            ),
            (
                mutation::causal_top_left(),
                "const int diag = seq_k - seq_q;",
                "const int diag = 0;",
            ),
            (
                mutation::gqa_modulo(),
                "head_kv * p.group + (u32)(it / per_head)",
                "head_kv + gridDim.y * (u32)(it / per_head)",
            ),
            (mutation::fill_grad(), "live = false;", "live = true;"),
            (
                mutation::dropout_fresh_mask(),
                "threefry((u32)(n0 + key + e), (u32)q_row,",
                "threefry((u32)q_row, (u32)(n0 + key + e),",
            ),
            (
                mutation::window_right(),
                "key + e > row + diag_rel + (int)p.s.window_right",
                "key + e > row + diag_rel + (int)p.s.window_right + 1",
            ),
            (
                mutation::ds_tile_rows(),
                "sm80_lds_v4(sds + sm80_swz((u32)r, (u32)c, SM80_PS_ROW))",
                "sm80_lds_v4(sds + sm80_swz((u32)r ^ 8u, (u32)c, SM80_PS_ROW))",
            ),
            (
                mutation::ds_skipped_rows(),
                "dst[(u64)r * p.ds_stride_s] = 0;",
                "dst[(u64)r * p.ds_stride_s] = 0x4000;",
            ),
        ],
    );
    let defines = Defines::elem(bf16)
        .word("HEAD_DIM", config.head_dim)
        .word("VALUE_DIM", config.value_dim)
        .word("BLOCK_N", shape.keys)
        .word("STAGES", shape.stages)
        .word("PAIRED", u32::from(shape.blocks == 2))
        .word("PARAM_WORDS", PARAM_WORDS as u32)
        .word("WRITE_DS", t.ds.is_some())
        .rules(&config.rules);
    let kernel = HandWritten::new_hashed(
        client,
        source,
        hash,
        shape.entry(),
        CubeDim::new_1d(UNITS),
        shape.shared_bytes(dims),
        defines.key(),
    )
    .with_defines(&defines);
    let mut params = strides(t.q.strides);
    for s in [
        t.k.strides,
        t.v.strides,
        t.d_out.strides,
        t.dk.strides,
        t.dv.strides,
    ] {
        params.extend(strides(s));
    }
    let rows_pad = dims.seq_q.next_multiple_of(BLOCK_M);
    let ([mask_handle, bias_handle, ds_handle], n_seqs) = call_words(
        t,
        dims,
        options,
        rows_pad,
        (mask_strides, bias_strides),
        &mut params,
    );
    params.push(words(n_seqs as u32, 0));
    assert_eq!(
        params.len(),
        PARAM_WORDS,
        "the Ampere backward's parameter words"
    );
    // SAFETY: the per-row passes' ([`RowPasses::prepass`], [`RowPasses::convert`]). The main
    // kernel reads `q`, `k`, `v`, `dO` through their strides at positions below `Sq` / `Sk`
    // and columns below `D` / `Dv` (rows and starts 16-byte aligned, unit stride along the head
    // dim: `unavailable` found the `mma` path's alignment), the scratch rows of its (batch,
    // head) pairs (rows below `rows_pad` of each), the mask and bias at rows below `Sq` and keys
    // below `Sk` through the broadcast strides checked by the caller, the slopes at its query
    // heads and the packed lengths; block (n, h, b) writes its keys below `Sk` of `dK[b, h]`
    // and `dV[b, h]`, columns below `D` and `Dv`, (with `ds`) those keys of
    // `dS[b, h·group ..][rows below Sq]` through `ds`'s strides, and adds into the
    // accumulator's rows below `Sq` of its pairs.
    unsafe {
        passes.prepass(t);
        kernel.launch(
            CubeCount::Static(cubes.0 as u32, cubes.1 as u32, cubes.2 as u32),
            vec![
                t.q.handle.clone().binding(),
                t.k.handle.clone().binding(),
                t.v.handle.clone().binding(),
                t.d_out.handle.clone().binding(),
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
            ],
            params,
        );
        passes.convert(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(head_dim: usize, value_dim: usize) -> AttentionDims {
        AttentionDims {
            batch: 2,
            heads_q: 8,
            heads_kv: 2,
            seq_q: 300,
            seq_k: 500,
            head_dim,
            value_dim,
        }
    }

    /// The shared memory of `sm80.cu`'s header comment, and the shape each device class
    /// gets: 128 keys where 164 864 B fit (an A100's 163 KiB opt-in, an H100's 227), 64 keys on
    /// 99 KiB GPUs at D 128 (128 still fits there at D 64); the head dims rounded up to 64 or
    /// 128; two blocks a SM with two stages where two of them fit the SM (an H100 to the byte at
    /// D 128), else one stage; nothing where even the smallest does not fit.
    #[test]
    fn shapes_follow_shared_memory() {
        let d = |d: usize| dims(d, d);
        let paired = |stages| Shape {
            keys: 64,
            stages,
            blocks: 2,
        };
        assert_eq!(Shape::WIDE.shared_bytes(d(128)), 164_864);
        assert_eq!(Shape::NARROW.shared_bytes(d(128)), 82_432);
        assert_eq!(Shape::WIDE.shared_bytes(d(64)), 99_328);
        assert_eq!(Shape::NARROW.shared_bytes(d(64)), 49_664);
        assert_eq!(paired(2).shared_bytes(d(128)), 115_712);
        assert_eq!(paired(2).shared_bytes(d(64)), 66_560);
        let (a100, h100, rtx) = (163 << 10, 227 << 10, 99 << 10);
        let planned = |dims, max| shape(dims, AmpereTile::Planned, max);
        for max in [a100, h100] {
            assert_eq!(planned(d(128), max), Some(Shape::WIDE));
        }
        assert_eq!(planned(d(128), rtx), Some(Shape::NARROW));
        assert_eq!(planned(d(64), rtx), Some(Shape::WIDE));
        assert_eq!(planned(dims(72, 40), rtx), Some(Shape::NARROW));
        assert_eq!(Shape::NARROW.tile(dims(72, 40)).head_dim, 128);
        assert_eq!(Shape::NARROW.tile(dims(72, 40)).value_dim, 64);
        assert_eq!(Shape::WIDE.tile(dims(16, 24)).head_dim, 64);
        assert_eq!(planned(d(128), 48 << 10), None);
        let paired_of = |dims, max| shape(dims, AmpereTile::Paired, max);
        assert_eq!(paired_of(d(128), h100), Some(paired(2)));
        assert_eq!(paired_of(d(128), h100 - 1), Some(paired(1)));
        assert_eq!(paired_of(d(128), a100), Some(paired(1)));
        assert_eq!(paired_of(d(64), a100), Some(paired(2)));
        assert_eq!(paired_of(d(64), rtx), Some(paired(1)));
        assert_eq!(paired_of(d(128), rtx), None);
        assert_eq!(shape(d(128), AmpereTile::Wide, rtx), None);
        assert_eq!(shape(d(128), AmpereTile::Narrow, h100), Some(Shape::NARROW));
    }

    /// What the kernel takes and what it leaves to the `mma.sync` backward, each with its
    /// reason; which rule sets the default plan gives it ([`default_rules`]).
    #[test]
    fn unavailable_names_each_limit() {
        let base = AttentionOptions::default();
        let causal = ScoreRules {
            causal: true,
            quiet: true,
            sinks: true,
            ..ScoreRules::NONE
        };
        let max = 227 << 10;
        let ok = |rules, dims, options: &AttentionOptions, ds| {
            unavailable(true, None, dims, rules, options, ds, max)
        };
        assert_eq!(ok(causal, dims(128, 128), &base, false), None);
        assert_eq!(ok(ScoreRules::NONE, dims(64, 96), &base, false), None);
        let refused = |reason: Option<String>, what: &str| {
            let reason = reason.unwrap_or_else(|| panic!("{what}: taken"));
            assert!(reason.contains("Ampere backward"), "{what}: {reason}");
        };
        refused(
            unavailable(false, None, dims(64, 64), causal, &base, false, max),
            "not CUDA",
        );
        refused(
            unavailable(
                true,
                Some(crate::fragment::MatrixUnitsUnavailable::F32),
                dims(64, 64),
                causal,
                &base,
                false,
                max,
            ),
            "f32",
        );
        refused(ok(causal, dims(192, 128), &base, false), "head dim 192");
        for (what, rules) in [
            (
                "mask",
                ScoreRules {
                    mask: true,
                    ..causal
                },
            ),
            (
                "bias",
                ScoreRules {
                    bias: true,
                    ..causal
                },
            ),
            (
                "softcap",
                ScoreRules {
                    softcap: true,
                    ..causal
                },
            ),
            (
                "dropout",
                ScoreRules {
                    dropout: true,
                    ..causal
                },
            ),
            (
                "window",
                ScoreRules {
                    window: true,
                    ..causal
                },
            ),
            (
                "alibi",
                ScoreRules {
                    alibi: true,
                    ..causal
                },
            ),
            (
                "varlen",
                ScoreRules {
                    varlen: true,
                    ..causal
                },
            ),
        ] {
            // Taken (with `dS` too, but under a softcap), yet not by default: no GPU run has
            // verified them in this kernel.
            assert_eq!(ok(rules, dims(64, 64), &base, false), None, "{what}");
            assert_eq!(
                ok(rules, dims(64, 64), &base, true).is_none(),
                !rules.softcap,
                "{what}, dS"
            );
            assert!(!default_rules(rules, false), "{what}");
        }
        assert_eq!(ok(causal, dims(64, 64), &base, true), None, "dS");
        assert!(default_rules(causal, false) && !default_rules(causal, true));
        refused(
            ok(
                ScoreRules {
                    softcap: true,
                    ..causal
                },
                dims(64, 64),
                &base,
                true,
            ),
            "dS under a softcap",
        );
        let deterministic = AttentionOptions {
            deterministic: true,
            ..base
        };
        refused(
            ok(causal, dims(64, 64), &deterministic, false),
            "deterministic",
        );
        let empty = AttentionDims {
            seq_k: 0,
            ..dims(64, 64)
        };
        refused(ok(causal, empty, &base, false), "empty");
        refused(
            unavailable(true, None, dims(128, 128), causal, &base, false, 48 << 10),
            "shared memory",
        );
    }
}
