//! The attention forward on Hopper (sm_90a), FlashAttention-3's schedule: TMA loads into a ring
//! of shared-memory slots, a producer warpgroup and two consumer warpgroups with register
//! reallocation, `wgmma` for `Q·Kᵀ` (both operands in shared memory) and `P·V` (`P` in
//! registers). The source is `hopper.cu` next to this file, on the shared instruction wrappers
//! of `crate::hopper` (`sm90.cuh`); it is compiled by cubecl-cuda's NVRTC and launched through
//! the caller's client ([`crate::hopper::task::HandWritten`]).
//!
//! Variants: element type (f16, bf16) × `D` (64, 128: the head dims rounded up) × `Dv` (64,
//! 128) × causal × softcap, each compiled on first use. What it does not take (masks, bias,
//! dropout, `masked_score`, quiet softmax, head dims over 128, rows not 16-byte aligned) is
//! named by [`unavailable`]; the plan then runs the `mma.sync` kernel.

#[cfg(feature = "cuda")]
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
#[cfg(feature = "cuda")]
use cubecl::server::{TensorMapBinding, TensorMapMeta};
#[cfg(feature = "cuda")]
use cubecl::zspace::metadata::Metadata;
#[cfg(feature = "cuda")]
use cubecl::zspace::{Shape, Strides};

use crate::attention::{AttentionDims, AttentionFeatures, AttentionOptions};
use crate::flash::{FlashConfig, Tile};
#[cfg(feature = "cuda")]
use crate::hopper::task::HandWritten;
#[cfg(feature = "cuda")]
use crate::tensor::TensorRef;

/// Query rows per block (two consumer warpgroups of 64).
pub const BLOCK_Q: usize = 128;
/// Keys per step.
pub const BLOCK_K: usize = 128;
/// `K`/`V` slots of the pipeline (a third measured no faster on an H200, RESULTS §14).
pub const STAGES: usize = 2;
/// Threads per block: one producer and two consumer warpgroups.
pub const UNITS: u32 = 384;

#[cfg(feature = "cuda")]
const ENTRY: &str = "burn_flash_hopper_forward";

/// The CUDA source: the instruction wrappers, then the kernel.
#[cfg(feature = "cuda")]
pub const SOURCE: &str = concat!(
    include_str!("../../hopper/sm90.cuh"),
    include_str!("hopper.cu")
);

/// One compiled variant of the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Variant {
    /// bf16 (else f16).
    pub bf16: bool,
    /// `D` rounded up to 64 or 128.
    pub head_dim: u32,
    /// `Dv` rounded up to 64 or 128.
    pub value_dim: u32,
    /// Bottom-right causal mask.
    pub causal: bool,
    /// Softcap.
    pub softcap: bool,
}

impl Variant {
    /// The variant for a call.
    pub fn new(dims: AttentionDims, bf16: bool, options: &AttentionOptions) -> Self {
        Self {
            bf16,
            head_dim: rounded(dims.head_dim),
            value_dim: rounded(dims.value_dim),
            causal: options.causal,
            softcap: options.softcap.is_some(),
        }
    }

    /// The `#define`s the source is compiled with.
    #[cfg(feature = "cuda")]
    fn defines(self) -> String {
        format!(
            "#define WG_ELEM \"{}\"\n#define HEAD_DIM {}\n#define VALUE_DIM {}\n#define CAUSAL {}\n#define SOFTCAP {}\n",
            if self.bf16 { "bf16" } else { "f16" },
            self.head_dim,
            self.value_dim,
            u32::from(self.causal),
            u32::from(self.softcap),
        )
    }

    /// The variant as one word of the kernel's id.
    #[cfg(feature = "cuda")]
    fn key(self) -> u64 {
        u64::from(self.bf16)
            | u64::from(self.head_dim) << 8
            | u64::from(self.value_dim) << 16
            | u64::from(self.causal) << 24
            | u64::from(self.softcap) << 25
    }
}

/// The tile of a call: [`BLOCK_Q`] rows, [`BLOCK_K`] keys per step, the head dims rounded up
/// to 64 or 128.
pub fn tile(dims: AttentionDims) -> Tile {
    Tile {
        block_q: BLOCK_Q as u32,
        row_tiles: 2,
        block_k: BLOCK_K as u32,
        head_dim: rounded(dims.head_dim),
        value_dim: rounded(dims.value_dim),
    }
}

/// A head dim rounded up to the 64-column swizzle atoms: 64 or 128.
fn rounded(dim: usize) -> u32 {
    if dim <= 64 { 64 } else { 128 }
}

/// Dynamic shared memory for `config`'s head dims: `Q`, [`STAGES`] slots of `K` and `V` (128
/// rows × 128 bytes per 64 columns), the barriers, and 1 KiB to align the swizzle atoms.
pub fn shared_bytes(config: FlashConfig) -> usize {
    let atom = BLOCK_K * 128;
    let (d, dv) = (
        config.head_dim as usize / 64,
        config.value_dim as usize / 64,
    );
    1024 + atom * (d + STAGES * (d + dv)) + 128
}

/// Whether the Hopper kernels may run: unless the environment variable `BURN_FLASH_HOPPER` is
/// `off` (or `0`), read once per process. Switched off, the plan takes the `mma.sync` kernels
/// on Hopper GPUs too (the escape hatch, and how the test suite runs with the path off).
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        !matches!(
            std::env::var("BURN_FLASH_HOPPER").as_deref(),
            Ok("off") | Ok("0")
        )
    })
}

/// Why the Hopper forward cannot run a call (`None`: it can). `hopper` says whether the device
/// is an sm_90 GPU ([`crate::hopper::sm90`]).
pub fn unavailable(
    hopper: bool,
    dims: AttentionDims,
    dtype: StorageType,
    features: AttentionFeatures,
    options: &AttentionOptions,
) -> Option<String> {
    use cubecl::ir::{ElemType, FloatKind};
    let reason = if !hopper {
        "the device is not a Hopper GPU (sm_90)"
    } else if !matches!(
        dtype,
        StorageType::Scalar(ElemType::Float(FloatKind::F16 | FloatKind::BF16))
    ) {
        "the Hopper forward takes f16 and bf16"
    } else if dims.head_dim > 128 || dims.value_dim > 128 {
        "the Hopper forward takes head dims up to 128"
    } else if !features.aligned {
        "the Hopper forward reads rows through TMA: unit stride along the head dim, head dims and strides multiples of 8 elements"
    } else if features.mask || features.bias {
        "the Hopper forward takes no mask or bias yet"
    } else if options.dropout.is_some() {
        "the Hopper forward takes no dropout yet"
    } else if options.masked_score.is_some() || options.quiet {
        "the Hopper forward takes no masked_score or quiet softmax yet"
    } else if dims.heads_q > 65_535 || dims.batch > 65_535 {
        "the Hopper forward launches one block row per head and batch: at most 65535 each"
    } else if dims.seq_q > i32::MAX as usize / 2 || dims.seq_k > i32::MAX as usize / 2 {
        "the Hopper forward indexes positions with 32-bit integers"
    } else {
        return None;
    };
    Some(reason.into())
}

#[cfg(feature = "cuda")]
/// The TMA map of a `[B, H, S, D]` tensor: boxes of 128 rows × 64 columns, 128-byte swizzled,
/// zeros past the ends.
fn tensor_map(t: &TensorRef<'_>, dtype: StorageType) -> TensorMapBinding {
    TensorMapBinding::new(
        t.handle.clone().binding(),
        TensorMapMeta {
            format: TensorMapFormat::Tiled(TiledArgs::new(Shape::from(vec![
                1usize, 1, BLOCK_K, 64,
            ]))),
            metadata: Metadata::new(
                Shape::from(t.shape.to_vec()),
                Strides::from(t.strides.to_vec()),
            ),
            elem_stride: Strides::from(vec![1usize; 4]),
            interleave: TensorMapInterleave::None,
            swizzle: TensorMapSwizzle::B128,
            prefetch: TensorMapPrefetch::None,
            oob_fill: OobFill::Zero,
            storage_ty: dtype,
        },
    )
}

/// Launches the forward of `dims` on `client`: `out` and `lse` of attention over `q`, `k`, `v`
/// (shapes checked by the caller, [`unavailable`] `None` for this call, buffers starting on
/// 16 bytes ([`crate::attention::starts_aligned`])).
///
/// # Safety
/// The shapes and strides describe the buffers.
#[cfg(feature = "cuda")]
pub unsafe fn launch(
    client: &ComputeClient<CudaRuntime>,
    q: &TensorRef<'_>,
    k: &TensorRef<'_>,
    v: &TensorRef<'_>,
    out: &TensorRef<'_>,
    lse: &TensorRef<'_>,
    dims: AttentionDims,
    dtype: StorageType,
    options: &AttentionOptions,
) {
    use cubecl::ir::{ElemType, FloatKind};
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let variant = Variant::new(dims, bf16, options);
    let shared = shared_bytes(FlashConfig::new(
        crate::flash::ScoreSource::QueryKey,
        options.rules(AttentionFeatures::default()),
        tile(dims),
    ));
    let mut source = SOURCE;
    for (active, from, to) in [
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
            crate::mutation::hopper_no_wait(),
            "if (j >= STAGES) mbar_wait(",
            "if (false) mbar_wait(",
        ),
    ] {
        if active {
            source = Box::leak(source.replace(from, to).into_boxed_str());
        }
    }
    let kernel = HandWritten::new(
        client,
        source,
        ENTRY,
        CubeDim::new_1d(UNITS),
        shared,
        variant.key(),
    )
    .with_defines(variant.defines());
    let log2e = core::f32::consts::LOG2_E;
    let cap = options.softcap.unwrap_or(1.0);
    let words = |lo: u32, hi: u32| u64::from(lo) | u64::from(hi) << 32;
    let params = vec![
        out.strides[0] as u64,
        out.strides[1] as u64,
        out.strides[2] as u64,
        lse.strides[0] as u64,
        lse.strides[1] as u64,
        lse.strides[2] as u64,
        words(dims.seq_q as u32, dims.seq_k as u32),
        words(dims.group() as u32, dims.value_dim as u32),
        words(
            (options.scale * log2e).to_bits(),
            (options.scale / cap).to_bits(),
        ),
        words((cap * log2e).to_bits(), 0),
    ];
    let m_blocks = dims.seq_q.div_ceil(BLOCK_Q) as u32;
    let count = CubeCount::Static(m_blocks, dims.heads_q as u32, dims.batch as u32);
    let maps = vec![
        tensor_map(q, dtype),
        tensor_map(k, dtype),
        tensor_map(v, dtype),
    ];
    // SAFETY: the loads stay inside `q`, `k`, `v` (TMA clips every box to the shapes given);
    // block (m, h, b) writes rows 128m .. 128m + 127 below `Sq` of `out[b, h]` and `lse[b, h]`,
    // columns below `Dv`, through the strides given.
    unsafe {
        kernel.launch_with_maps(
            count,
            maps,
            vec![out.handle.clone().binding(), lse.handle.clone().binding()],
            params,
        );
    }
}
