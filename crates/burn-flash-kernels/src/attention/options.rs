//! The attention problem: what a call takes ([`AttentionOptions`], [`AttentionFeatures`],
//! [`AttentionDims`], the backward's [`BackwardTensors`]), what a plan is
//! ([`AttentionKernel`], [`AttentionPlan`]), why a call is refused ([`AttentionError`]) and the
//! checks every plan makes first ([`validate`], [`attention_dims`], [`check_seqs`]). A leaf:
//! the kernel modules that take these types ([`crate::decode`], the Hopper kernels) import
//! them from here, never from the dispatcher that calls them.

use core::fmt;

use cubecl::prelude::*;

use crate::dropout::DropoutParams;
use crate::flash::{FlashConfig, FlashKernel, Scalars, ScoreRules};
use crate::fragment::MatrixUnitsUnavailable;
use crate::tensor::{TensorRef, UnsupportedDType};

/// Largest head dim (of queries/keys and of values) any kernel takes.
pub const MAX_HEAD_DIM: usize = 256;

/// The kernel of a launch, chosen once by [`plan_attention`](super::plan_attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKernel {
    /// [`flash_forward_units()`](crate::flash::forward::units::flash_forward_units()): plain
    /// units, every runtime and float type.
    Units,
    /// [`flash_forward_tiled()`](crate::flash::forward::tiled::flash_forward_tiled()): plain
    /// units, every runtime and float type, register-tiled (128 query rows × 128 output
    /// columns per cube, 16 keys per step).
    Tiled,
    /// [`flash_forward_mma()`](crate::flash::forward::mma::flash_forward_mma()): f16/bf16 on
    /// the matrix units with `cp.async` double buffering (CUDA sm_80+, 16-byte aligned rows).
    MatrixUnits,
    /// [`flash_forward_cmma()`](crate::flash::forward::cmma::flash_forward_cmma()): f16/bf16
    /// on cooperative matrices (cubecl's `cmma`): where the device offers them
    /// ([`fragment`](crate::flash::forward::cmma::fragment)) — Vulkan through SPIR-V, Metal,
    /// and CUDA's `wmma` when forced.
    CooperativeMatrix,
    /// [`hopper`](crate::flash::forward::hopper): f16/bf16 on Hopper GPUs (sm_90) with TMA,
    /// `wgmma` and warp specialisation (FlashAttention-3's schedule), hand-written CUDA (CUDA
    /// builds only; what it takes: [`unavailable`](crate::flash::forward::hopper::unavailable)).
    Hopper,
    /// [`crate::decode`]: split-KV decoding (FlashDecoding), for few query rows per key/value
    /// head ([`crate::decode::DECODE_ROWS`]) against long contexts: the keys split over cubes,
    /// the splits' states merged by a second kernel. Every runtime and float type; no mask,
    /// bias, dropout or packed sequences.
    SplitDecode,
}

impl AttentionKernel {
    /// The `#[cube]` forward loop of this kernel (`None`: the hand-written Hopper kernel).
    pub(crate) fn flash_kernel(self) -> Option<FlashKernel> {
        match self {
            Self::Units => Some(FlashKernel::Units),
            Self::Tiled => Some(FlashKernel::Tiled),
            Self::MatrixUnits => Some(FlashKernel::MatrixUnits),
            Self::CooperativeMatrix => Some(FlashKernel::CooperativeMatrix),
            Self::Hopper | Self::SplitDecode => None,
        }
    }
}

/// How the Hopper forward's blocks take its tiles (a block of query rows of one head and
/// batch; with given scores, of rows and output columns of one batch). A plan input like
/// [`HopperUse`]: the test suites and benches set it (from `BURN_FLASH_PERSISTENT`).
///
/// The Hopper backward's tiles (a block of keys of one key/value head and batch) run one block
/// each under `Planned` and `PerTile`; under the others its blocks are persistent, taking the
/// tiles in static rounds (`Persistent` and `Dynamic`: one block per SM; `Blocks(n)` and
/// `DynamicBlocks(n)`: n blocks), each loading the next tile's `K` and `V` under the last
/// one's epilogue ([`crate::flash::backward::hopper::Variant::with_schedule`]; not for the
/// deterministic backward or a deferred `dQ`). The plan keeps one block per tile until the
/// persistent backward measures faster.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum TileSchedule {
    /// The plan's: persistent ([`crate::flash::forward::hopper::blocks`]), the tiles in
    /// static rounds, or from the counter for causal and windowed calls with 128-row tiles
    /// ([`crate::flash::forward::hopper::dynamic`]).
    #[default]
    Planned,
    /// One block per tile: the hardware hands the tiles to the SMs as blocks finish.
    PerTile,
    /// Persistent: one block per SM (fewer where the tiles are fewer), each taking the tiles in
    /// rounds, so that a tile's epilogue runs under the loads of the block's next one.
    Persistent,
    /// Persistent with this many blocks (at least 1, at most the tiles), causal tiles in chunks
    /// of two heads ([`crate::flash::forward::hopper::TEST_CHUNK`]): how the test suites make
    /// every block run many tiles, and causal calls several chunks, on small shapes.
    Blocks(usize),
    /// Persistent, one block per SM, each block's tiles after its first taken from a counter
    /// as it finishes them (FlashAttention-3's dynamic scheduler), causal tiles each head's
    /// longest first: the blocks end together whatever the tiles' lengths. Attention only
    /// (`softmax(X)·V` runs it as [`TileSchedule::Persistent`]).
    Dynamic,
    /// [`TileSchedule::Dynamic`] with this many blocks (at least 1, at most the tiles): the
    /// test suites' way to make a few blocks share many tiles through the counter.
    DynamicBlocks(usize),
}

impl TileSchedule {
    /// The schedule a name stands for: `planned`, `off` or `0` (one block per tile), `on` or
    /// `1` (persistent), a number of blocks above 1, `dynamic`, or `d` and a number of blocks
    /// (`d3`: dynamic, 3 blocks); `None` for any other.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "planned" => Some(Self::Planned),
            "off" | "0" => Some(Self::PerTile),
            "on" | "1" => Some(Self::Persistent),
            "dynamic" => Some(Self::Dynamic),
            n => match (n.strip_prefix('d'), n.parse::<usize>()) {
                (Some(d), _) => d
                    .parse::<usize>()
                    .ok()
                    .filter(|&b| b > 0)
                    .map(Self::DynamicBlocks),
                (None, Ok(b)) if b > 1 => Some(Self::Blocks(b)),
                _ => None,
            },
        }
    }

    /// The blocks of a launch over `tiles` tiles on a device of `sms` multiprocessors, where
    /// the plan would run persistent blocks if `planned` (at least 1).
    pub fn blocks(self, tiles: usize, sms: usize, planned: bool) -> usize {
        let tiles = tiles.max(1);
        match self {
            Self::Planned if planned => tiles.min(sms.max(1)),
            Self::Planned | Self::PerTile => tiles,
            Self::Persistent | Self::Dynamic => tiles.min(sms.max(1)),
            Self::Blocks(b) | Self::DynamicBlocks(b) => tiles.min(b.max(1)),
        }
    }

    /// Whether this schedule asks for the tiles from a counter ([`TileSchedule::Dynamic`]; the
    /// plan's own choice: [`crate::flash::forward::hopper::dynamic`]).
    pub fn dynamic(self) -> bool {
        matches!(self, Self::Dynamic | Self::DynamicBlocks(_))
    }
}

/// How the Hopper backward's two consumer warpgroups meet over a step's `dSᵀ`, whose halves
/// both read for `dQ`: at head dim 128 with the `dQ` writer warp (no bias loaded by TMA, no
/// written `dS`, not deterministic); other calls run `Lockstep`. A plan input like
/// [`TileSchedule`]: the test suites and benches set it (from `BURN_FLASH_BWD_OVERLAP`).
/// `Deferred` and `Staggered` measured 7–8 % slower than `Lockstep` (RESULTS.md §5.0): kept as
/// experiments, not a speed option.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum BackwardOverlap {
    /// The plan's: `Lockstep`.
    #[default]
    Planned,
    /// Both consumers meet at a named barrier in every step, then issue the step's `dQ`.
    Lockstep,
    /// Each step's `dQ` is issued in the next step, after its `dK`; a consumer waits only for
    /// the other to have finished the step before, so they may run up to a step apart.
    Deferred,
    /// `Deferred`, with the second consumer started half a step behind the first.
    Staggered,
}

impl BackwardOverlap {
    /// The overlap a name stands for: `planned`, `lockstep`, `deferred` or `staggered`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "planned" => Some(Self::Planned),
            "lockstep" => Some(Self::Lockstep),
            "deferred" => Some(Self::Deferred),
            "staggered" => Some(Self::Staggered),
            _ => None,
        }
    }

    /// Whether a call that can take them defers `dQ` by a step, and staggers the consumers.
    pub fn deferred_staggered(self) -> (bool, bool) {
        match self {
            Self::Planned | Self::Lockstep => (false, false),
            Self::Deferred => (true, false),
            Self::Staggered => (true, true),
        }
    }
}

/// How a plan uses the Hopper kernels (sm_90) for the calls they can run. A plan input like
/// every other option, so that one call plans the same way in every process; the test suites
/// and benches set it (from `BURN_FLASH_HOPPER`, which the library never reads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum HopperUse {
    /// For the calls where they measured faster than the `mma.sync` kernels: the forward
    /// without a mask or a bias, the backward without a bias (they read those per element;
    /// RESULTS.md).
    #[default]
    Faster,
    /// For every call they can run (how the test suites force them).
    Always,
    /// Never: a plan does not take them, and forcing them is an error (the escape hatch; how
    /// the suites run with them off).
    Off,
}

impl HopperUse {
    /// Whether a plan takes a Hopper kernel that can run the call; `faster` says whether it
    /// measured faster than the `mma.sync` kernel for such calls.
    pub fn wanted(self, faster: bool) -> bool {
        match self {
            Self::Always => true,
            Self::Faster => faster,
            Self::Off => false,
        }
    }

    /// Why no Hopper kernel runs under this use (`None`: they may).
    pub fn switched_off(self) -> Option<String> {
        (self == Self::Off).then(|| "the Hopper kernels are switched off (HopperUse::Off)".into())
    }

    /// The use a name stands for: `off` or `0`, `always`, `faster` or `on` (how the test
    /// suites and benches spell `BURN_FLASH_HOPPER`); `None` for any other.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "off" | "0" => Some(Self::Off),
            "always" => Some(Self::Always),
            "faster" | "on" => Some(Self::Faster),
            _ => None,
        }
    }
}

/// How a plan uses the Ampere backward ([`crate::flash::backward::sm80`]: FlashAttention-2's
/// data flow, hand-written CUDA for sm_80 and later) for the calls it can run. A plan input
/// like [`HopperUse`]; the test suites and benches set it from `BURN_FLASH_AMPERE_BWD`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum AmpereUse {
    /// Where the Hopper backward does not take the call, on the GPUs where it has run
    /// ([`crate::flash::backward::sm80::default_on`]: sm_90 with the Hopper path off or
    /// declining, 1.27–1.58× the `mma.sync` backward there, RESULTS.md §5.0.2; sm_80–89 once a
    /// GPU run has verified their variants), for the score rules a GPU run has verified in it
    /// ([`crate::flash::backward::sm80::default_rules`]).
    #[default]
    Faster,
    /// Wherever it runs the call, ahead of the Hopper backward too (how the suites force it on
    /// an H100/H200, and how an sm_80–89 GPU takes it today).
    Always,
    /// Never (the escape hatch: the `mma.sync` backward takes its calls).
    Off,
}

impl AmpereUse {
    /// The use a name stands for: `off` or `0`, `always` or `1`, `faster` or `on` (how the
    /// test suites and benches spell `BURN_FLASH_AMPERE_BWD`); `None` for any other.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "off" | "0" => Some(Self::Off),
            "always" | "1" => Some(Self::Always),
            "faster" | "on" => Some(Self::Faster),
            _ => None,
        }
    }
}

/// The block shape the Ampere backward ([`crate::flash::backward::sm80::Shape`]) runs: a plan
/// input for A/Bs of its tiles; the suites and benches set it from `BURN_FLASH_AMPERE_TILE`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum AmpereTile {
    /// The measured best for the call and device ([`crate::flash::backward::sm80::shape`]).
    #[default]
    Planned,
    /// 128 keys a block, two `Q`/`dO` stages, one block a SM (up to 255 registers a thread):
    /// GPUs with ~161 KiB of shared memory a block (sm_80, sm_90).
    Wide,
    /// 64 keys a block, one stage, one block a SM: what fits 99 KiB (sm_86, sm_89) at D 128.
    Narrow,
    /// 64 keys a block, two blocks a SM (128 registers a thread), two stages where two blocks
    /// of them fit the SM's shared memory, else one.
    Paired,
}

impl AmpereTile {
    /// The tile a name stands for: `planned`, `wide`, `narrow` or `paired`; `None` for any
    /// other.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "planned" => Some(Self::Planned),
            "wide" => Some(Self::Wide),
            "narrow" => Some(Self::Narrow),
            "paired" => Some(Self::Paired),
            _ => None,
        }
    }
}

/// The split-KV decoding kernel's schedule ([`crate::decode`]): a plan input, set for A/Bs of
/// the schedule (the default is the measured best on an H200, RESULTS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeSchedule {
    /// Keys each group of units takes per step: 4, 8 or 16.
    pub keys_per_step: u32,
    /// Cubes per multiprocessor the splits aim at: 1 to 64.
    pub cubes_per_sm: usize,
}

impl Default for DecodeSchedule {
    fn default() -> Self {
        Self::STANDARD
    }
}

impl DecodeSchedule {
    /// 8 keys per step, 16 cubes per multiprocessor.
    pub const STANDARD: Self = Self {
        keys_per_step: 8,
        cubes_per_sm: 16,
    };

    /// Why the schedule is out of range (`None`: it is not).
    pub fn invalid(&self) -> Option<String> {
        if !matches!(self.keys_per_step, 4 | 8 | 16) {
            Some(format!(
                "decode keys_per_step must be 4, 8 or 16, got {}",
                self.keys_per_step
            ))
        } else if !(1..=64).contains(&self.cubes_per_sm) {
            Some(format!(
                "decode cubes_per_sm must be 1 to 64, got {}",
                self.cubes_per_sm
            ))
        } else {
            None
        }
    }
}

/// What the scores are made of, and overrides of the host heuristic. The default: scale 1, no
/// score term, the plan's kernel and tile, the Hopper kernels where faster, the default
/// decoding schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Factor of `q·k`.
    pub scale: f32,
    /// Softcap `c` (`s = c·tanh(s / c)`), positive and finite.
    pub softcap: Option<f32>,
    /// Bottom-right aligned causal mask.
    pub causal: bool,
    /// Force a kernel; an impossible choice is an error, never a silent fallback.
    pub kernel: Option<AttentionKernel>,
    /// Force the keys per step: a multiple of 16 up to 128 on the matrix units,
    /// [`BLOCK_K`](crate::flash::forward::units::BLOCK_K) or
    /// [`BLOCK_K`](crate::flash::forward::tiled::BLOCK_K) of the plain-unit kernels (untiled,
    /// tiled); an impossible choice is an error.
    pub block_k: Option<usize>,
    /// Dropout on the attention weights ([`crate::dropout`]): `None` or a probability of 0 is
    /// none. Every forward kernel but the register-tiled one ([`AttentionKernel::Tiled`])
    /// takes it.
    pub dropout: Option<DropoutParams>,
    /// The score a key masked by the bool mask takes, instead of leaving the softmax
    /// (burn-nn's `mask_fill(mask, min_float)`): finite, so a fully masked row is uniform.
    /// After scale, softcap and bias; the causal mask and keys past the end still leave.
    /// `None`: masked keys are invisible.
    pub masked_score: Option<f32>,
    /// Quiet softmax, `e^s / (1 + Σ e^s)` (burn's `quiet_softmax`): the stored log-sum-exp
    /// is `ln(1 + Σ e^s)`.
    pub quiet: bool,
    /// Sliding window `(left, right)`: query `i` sees keys from `a − left` to `a + right`
    /// inclusive, `a = i + Sk − Sq` (bottom-right aligned, as the causal mask; with `causal`
    /// the right side is 0). Key blocks outside every row's window are skipped. A side wider
    /// than the sequence sees every key on that side.
    pub window: Option<(usize, usize)>,
    /// How the plan uses the Hopper kernels.
    pub hopper: HopperUse,
    /// How the Hopper forward's blocks take its tiles, and whether the Hopper backward's are
    /// persistent ([`TileSchedule`]).
    pub schedule: TileSchedule,
    /// The decoding kernel's schedule.
    pub decode: DecodeSchedule,
    /// The backward returns the same bits on every run. Every backward but the Hopper one is
    /// deterministic by construction (each gradient element is summed by one cube in a fixed
    /// order); the Hopper backward adds `dQ` from every key block into an f32 accumulator, and
    /// with this set it adds in key-block order (at a cost, RESULTS.md) — at head dims up to
    /// 128; wider calls take the `mma.sync` backward.
    pub deterministic: bool,
    /// How the Hopper backward's consumers meet over a step's `dSᵀ`.
    pub backward_overlap: BackwardOverlap,
    /// How the plan uses the Ampere backward ([`crate::flash::backward::sm80`]) where it runs
    /// the call and no forward kernel is forced.
    pub ampere_backward: AmpereUse,
    /// The Ampere backward's block shape ([`AmpereTile::Planned`]: the measured best).
    pub ampere_tile: AmpereTile,
    /// f32 calls may run their products on the tensor cores as TF32 (10 mantissa bits, f32
    /// accumulators; torch's `allow_tf32`): the cooperative-matrix kernels on CUDA's `wmma`
    /// m16n16k8 (sm_80+), forward and backward, every score rule. A permission: where the
    /// device has no TF32 fragment (wgpu, CUDA before sm_80) f32 stays exact; 16-bit calls
    /// ignore it. Off: exact f32 on plain units.
    pub tf32: bool,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        Self {
            scale: 1.0,
            softcap: None,
            causal: false,
            kernel: None,
            block_k: None,
            dropout: None,
            masked_score: None,
            quiet: false,
            window: None,
            hopper: HopperUse::Faster,
            schedule: TileSchedule::Planned,
            decode: DecodeSchedule::STANDARD,
            deterministic: false,
            backward_overlap: BackwardOverlap::Planned,
            ampere_backward: AmpereUse::Faster,
            ampere_tile: AmpereTile::Planned,
            tf32: false,
        }
    }
}

impl AttentionOptions {
    /// Whether a call of `dtype` takes its products as TF32: [`AttentionOptions::tf32`] and an
    /// f32 `dtype`.
    pub fn tf32_for(&self, dtype: StorageType) -> bool {
        self.tf32
            && dtype == StorageType::Scalar(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::F32))
    }

    /// The score rules of a call with these options and `features`.
    pub fn rules(&self, features: AttentionFeatures) -> ScoreRules {
        ScoreRules {
            causal: self.causal,
            mask: features.mask,
            bias: features.bias,
            softcap: self.softcap.is_some(),
            dropout: self.dropout.is_some(),
            masked_score: self.masked_score.map(f32::to_bits),
            quiet: self.quiet,
            window: self.window.is_some(),
            alibi: features.alibi,
            sinks: features.sinks,
            varlen: features.varlen,
        }
    }

    /// The kernels' runtime scalars.
    pub fn scalars(&self) -> Scalars {
        Scalars {
            scale: self.scale,
            softcap: self.softcap,
            dropout: self.dropout,
            window: self.window,
        }
    }
}

/// What of a call beyond its sizes a plan depends on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionFeatures {
    /// The rows of `q`, `k`, `v` and `out` (backward: `dO`) are 16-byte aligned
    /// ([`rows_aligned`]).
    pub aligned: bool,
    /// A mask is given.
    pub mask: bool,
    /// A bias is given (backward: or `dS` is asked for).
    pub bias: bool,
    /// The bias's rows can be loaded as tiles by TMA ([`bias_tiles`]): the Hopper forward
    /// then reads it from shared memory instead of per element from global memory.
    pub bias_tiles: bool,
    /// The bias is broadcast along the rows and TMA can load its one row of keys
    /// ([`bias_row_tiles`]): a Hopper forward loads it per step into the bias slot (`BIAS_ROW`).
    /// Its one-row load passed the forced-Hopper tests on an H100 (s49) but its speed against
    /// the `mma.sync` forward is unmeasured, so the plan does not prefer the Hopper forward
    /// for it; a forced one takes it (and the plan sizes its shared memory).
    pub bias_row_tiles: bool,
    /// The bias is broadcast along the query rows (`[·, ·, 1, Sk]`, stride 0 along `Sq`): every
    /// row of a head reads the same keys' values, which per-element reads find in cache.
    pub bias_rows_broadcast: bool,
    /// ALiBi slopes are given.
    pub alibi: bool,
    /// Attention-sink logits are given (forward only: the backward kernels read the stored
    /// log-sum-exp, which includes them).
    pub sinks: bool,
    /// The call is a packed variable-length batch (`seqs` given, [`check_seqs`]).
    pub varlen: bool,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionDims {
    /// Batch.
    pub batch: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads (divides `heads_q`).
    pub heads_kv: usize,
    /// Query positions.
    pub seq_q: usize,
    /// Key/value positions.
    pub seq_k: usize,
    /// Head dim of queries and keys.
    pub head_dim: usize,
    /// Head dim of values and of the output.
    pub value_dim: usize,
}

impl AttentionDims {
    /// Query heads per key/value head, `G = Hq / Hkv`.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// The shape of the output (and of its gradient), `[B, Hq, Sq, Dv]`.
    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.value_dim]
    }

    /// The shape of the row log-sum-exp, `[B, Hq, Sq]`.
    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seq_q]
    }

    /// The shape of the scores (a full mask, a bias, `dS`), `[B, Hq, Sq, Sk]`.
    pub fn scores_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.seq_k]
    }
}

/// The launch [`plan_attention`](super::plan_attention) chose: the kernel and the
/// configuration it is compiled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionPlan {
    /// The kernel that runs.
    pub kernel: AttentionKernel,
    /// Its configuration: score rules and tile (query rows per cube, keys per step, head dims
    /// rounded up, output columns per cube).
    pub config: FlashConfig,
    /// Units per cube.
    pub units: u32,
    /// Shared memory per cube, in bytes.
    pub shared_bytes: usize,
    /// Cubes along `(x, y, z)` = (column tiles of `Dv`, row blocks of `G·Sq`, `B·Hkv`), the
    /// last two folded so that any `B·Hkv` runs ([`crate::flash::block::fold_grid`]); the
    /// Hopper forward's is `(blocks, 1, 1)`, blocks taking its tiles in rounds
    /// ([`crate::flash::forward::hopper::blocks`]).
    pub cubes: (usize, usize, usize),
    /// Why the matrix units do not run this call (`None`: they do, or could).
    pub matrix_units: Option<MatrixUnitsUnavailable>,
}

/// Why an attention launch was refused. Nothing is launched when one is returned.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionError {
    /// A tensor's shape does not fit the others.
    ShapeMismatch {
        /// Which argument.
        arg: &'static str,
        /// What it should be.
        expected: String,
        /// Its shape.
        got: Vec<usize>,
    },
    /// The element type is not f32, f16 or bf16, or the device cannot run it.
    UnsupportedDType {
        /// The element type, as cubecl names it.
        dtype: String,
    },
    /// A head dim no kernel takes.
    UnsupportedHeadDim {
        /// `D`.
        head_dim: usize,
        /// `Dv`.
        value_dim: usize,
    },
    /// An option is out of range.
    InvalidOption {
        /// Why.
        reason: String,
    },
    /// The forced kernel cannot run this call on this device.
    KernelUnavailable {
        /// The forced kernel.
        kernel: AttentionKernel,
        /// Why not.
        reason: String,
    },
    /// More cubes along one grid axis than the device can launch.
    TooLarge {
        /// Cubes along each axis the launch would need.
        cubes: (usize, usize, usize),
    },
}

impl fmt::Display for AttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ShapeMismatch { arg, expected, got } => {
                write!(f, "`{arg}` has shape {got:?}, expected {expected}")
            }
            Self::UnsupportedDType { dtype } => write!(
                f,
                "dtype {dtype} is not supported (f32, f16 and bf16 are, where the device has them)"
            ),
            Self::UnsupportedHeadDim {
                head_dim,
                value_dim,
            } => write!(
                f,
                "head dims D = {head_dim}, Dv = {value_dim} are not supported (1 ..= {MAX_HEAD_DIM} each)"
            ),
            Self::InvalidOption { reason } => write!(f, "invalid option: {reason}"),
            Self::KernelUnavailable { kernel, reason } => {
                write!(f, "kernel {kernel:?} is not available: {reason}")
            }
            Self::TooLarge { cubes } => write!(
                f,
                "the launch needs {cubes:?} cubes along (x, y, z), more than the device allows"
            ),
        }
    }
}

impl core::error::Error for AttentionError {}

impl From<UnsupportedDType> for AttentionError {
    fn from(e: UnsupportedDType) -> Self {
        Self::UnsupportedDType { dtype: e.dtype }
    }
}

/// Whether the matrix-unit kernel can read these `q`, `k`, `v` and write this `out` (shape,
/// strides): unit stride along the head dim, head dims and every other stride multiples of 8
/// elements (16 bytes).
pub fn rows_aligned(tensors: &[(&[usize], &[usize])]) -> bool {
    tensors.iter().all(|(shape, strides)| {
        strides.len() == 4
            && strides[3] == 1
            && shape[3].is_multiple_of(8)
            && strides[..3].iter().all(|s| s.is_multiple_of(8))
    })
}

/// Whether a bias with `strides` over `[B, Hq, Sq, Sk]` (0 along broadcast dimensions,
/// `broadcast_strides`) can be loaded by TMA a tile of rows × keys at a time: unit key
/// stride, rows of their own (not broadcast), every other stride a multiple of 8 elements
/// (16 bytes of a 16-bit type) and the buffer starting on 16 bytes.
pub fn bias_tiles(bias: &TensorRef<'_>, strides: &[usize]) -> bool {
    tma_loads_bias(bias, strides) && strides[2] != 0
}

/// Whether a bias with `strides` over `[B, Hq, Sq, Sk]` is broadcast along the rows (stride 0)
/// and TMA can load its one row of keys per batch and head: [`bias_tiles`]'s other rules.
pub fn bias_row_tiles(bias: &TensorRef<'_>, strides: &[usize]) -> bool {
    tma_loads_bias(bias, strides) && strides[2] == 0
}

/// What TMA needs of a bias over `[B, Hq, Sq, Sk]` with `strides`: unit key stride, every other
/// stride a multiple of 8 elements (0, a broadcast dimension, is one), a 16-byte start.
fn tma_loads_bias(bias: &TensorRef<'_>, strides: &[usize]) -> bool {
    strides.len() == 4
        && strides[3] == 1
        && strides[..3].iter().all(|s| s.is_multiple_of(8))
        && starts_aligned(&[bias])
}

impl AttentionFeatures {
    /// `self` with the bias fields of a call's bias (its strides over `[B, Hq, Sq, Sk]`, from
    /// `broadcast_strides`), or of none.
    pub fn with_bias(self, bias: Option<(&TensorRef<'_>, &[usize])>) -> Self {
        Self {
            bias: bias.is_some(),
            bias_tiles: bias.is_some_and(|(b, s)| bias_tiles(b, s)),
            bias_row_tiles: bias.is_some_and(|(b, s)| bias_row_tiles(b, s)),
            bias_rows_broadcast: bias.is_some_and(|(_, s)| s[2] == 0),
            ..self
        }
    }
}

/// Whether each buffer starts on 16 bytes, as 16-byte row loads (and TMA) need.
pub fn starts_aligned(tensors: &[&TensorRef<'_>]) -> bool {
    tensors
        .iter()
        .all(|t| t.handle.offset_start.unwrap_or(0).is_multiple_of(16))
}

/// Checks what every attention plan needs, forward and backward: a float type the device
/// runs, `Hkv` dividing `Hq`, head dims in `1..=`[`MAX_HEAD_DIM`], finite options.
pub fn validate<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: StorageType,
    options: &AttentionOptions,
) -> Result<(), AttentionError> {
    crate::tensor::check_dtype(client, dtype)?;
    let (heads_q, heads_kv) = (dims.heads_q, dims.heads_kv);
    let (head_dim, value_dim) = (dims.head_dim, dims.value_dim);
    if heads_kv == 0 || !heads_q.is_multiple_of(heads_kv) {
        return Err(AttentionError::ShapeMismatch {
            arg: "k",
            expected: format!("a number of heads dividing Hq = {heads_q}"),
            got: vec![dims.batch, heads_kv, dims.seq_k, head_dim],
        });
    }
    if !(1..=MAX_HEAD_DIM).contains(&head_dim) || !(1..=MAX_HEAD_DIM).contains(&value_dim) {
        return Err(AttentionError::UnsupportedHeadDim {
            head_dim,
            value_dim,
        });
    }
    let invalid = |reason: String| Err(AttentionError::InvalidOption { reason });
    if !options.scale.is_finite() {
        return invalid(format!("scale must be finite, got {}", options.scale));
    }
    if let Some(cap) = options.softcap
        && !(cap > 0.0 && cap.is_finite())
    {
        return invalid(format!("softcap must be positive and finite, got {cap}"));
    }
    if let Some(fill) = options.masked_score
        && !fill.is_finite()
    {
        return invalid(format!("masked_score must be finite, got {fill}"));
    }
    if let Some(reason) = options.decode.invalid() {
        return invalid(reason);
    }
    Ok(())
}

/// Checks a mask or bias shape against `[B or 1, Hq or 1, Sq or 1, Sk]` and returns its
/// strides with 0 along broadcast dimensions.
pub(crate) fn broadcast_strides(
    name: &'static str,
    t: &TensorRef<'_>,
    full: [usize; 4],
) -> Result<Vec<usize>, AttentionError> {
    let ok = t.shape.len() == 4
        && t.strides.len() == 4
        && t.shape[3] == full[3]
        && (0..3).all(|d| t.shape[d] == full[d] || t.shape[d] == 1);
    if !ok {
        return Err(AttentionError::ShapeMismatch {
            arg: name,
            expected: format!(
                "[{} or 1, {} or 1, {} or 1, {}]",
                full[0], full[1], full[2], full[3]
            ),
            got: t.shape.to_vec(),
        });
    }
    Ok((0..4)
        .map(|d| if t.shape[d] == 1 { 0 } else { t.strides[d] })
        .collect())
}

/// Checks that `t` has exactly the shape `expected`.
pub(crate) fn expect_shape(
    name: &'static str,
    t: &TensorRef<'_>,
    expected: &[usize],
) -> Result<(), AttentionError> {
    if t.shape != expected || t.strides.len() != expected.len() {
        return Err(AttentionError::ShapeMismatch {
            arg: name,
            expected: format!("{expected:?}"),
            got: t.shape.to_vec(),
        });
    }
    Ok(())
}

/// Reads the sizes of a call from `q`, `k`, `v` and checks every shape.
pub fn attention_dims(
    q: &TensorRef<'_>,
    k: &TensorRef<'_>,
    v: &TensorRef<'_>,
) -> Result<AttentionDims, AttentionError> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.shape.len() != 4 || t.strides.len() != 4 {
            return Err(AttentionError::ShapeMismatch {
                arg: name,
                expected: "a 4-D tensor".into(),
                got: t.shape.to_vec(),
            });
        }
    }
    let dims = AttentionDims {
        batch: q.shape[0],
        heads_q: q.shape[1],
        heads_kv: k.shape[1],
        seq_q: q.shape[2],
        seq_k: k.shape[2],
        head_dim: q.shape[3],
        value_dim: v.shape[3],
    };
    expect_shape(
        "k",
        k,
        &[dims.batch, dims.heads_kv, dims.seq_k, dims.head_dim],
    )?;
    expect_shape(
        "v",
        v,
        &[dims.batch, dims.heads_kv, dims.seq_k, dims.value_dim],
    )?;
    Ok(dims)
}

/// Checks the sequences of a packed variable-length call (`seqs`: `[2·(n + 1)]`, u32 or i32,
/// the cumulative query lengths then the cumulative key lengths) against its sizes: one
/// batch, `n ≥ 1`. Their values (starting at 0, non-decreasing, ending at `Sq` and `Sk`) are
/// the caller's to check: reading them here would wait for the device.
pub fn check_seqs(seqs: &TensorRef<'_>, dims: AttentionDims) -> Result<(), AttentionError> {
    let n = seqs.shape.first().copied().unwrap_or(0);
    if seqs.shape.len() != 1 || n < 4 || n % 2 != 0 {
        return Err(AttentionError::ShapeMismatch {
            arg: "seqs",
            expected: "[2·(n + 1)] with n ≥ 1 sequences (cu_q then cu_k)".to_string(),
            got: seqs.shape.to_vec(),
        });
    }
    if dims.batch != 1 {
        return Err(AttentionError::ShapeMismatch {
            arg: "q",
            expected: "one batch of packed sequences".to_string(),
            got: vec![dims.batch, dims.heads_q, dims.seq_q, dims.head_dim],
        });
    }
    Ok(())
}

/// The tensors of a backward launch.
pub struct BackwardTensors<'a> {
    /// The forward's queries `[B, Hq, Sq, D]`.
    pub q: TensorRef<'a>,
    /// Keys `[B, Hkv, Sk, D]`.
    pub k: TensorRef<'a>,
    /// Values `[B, Hkv, Sk, Dv]`.
    pub v: TensorRef<'a>,
    /// The forward's mask (1 = masked out, in the element type), broadcasting.
    pub mask: Option<TensorRef<'a>>,
    /// The forward's bias, broadcasting.
    pub bias: Option<TensorRef<'a>>,
    /// The forward's ALiBi slopes `[Hq]`, f32.
    pub slopes: Option<TensorRef<'a>>,
    /// The forward's packed sequences ([`check_seqs`]).
    pub seqs: Option<TensorRef<'a>>,
    /// The forward's output `[B, Hq, Sq, Dv]`.
    pub out: TensorRef<'a>,
    /// The forward's row log-sum-exp `[B, Hq, Sq]`, f32.
    pub lse: TensorRef<'a>,
    /// The output's gradient `[B, Hq, Sq, Dv]`.
    pub d_out: TensorRef<'a>,
    /// `dQ` (written), `q`'s shape.
    pub dq: TensorRef<'a>,
    /// `dK` (written), `k`'s shape.
    pub dk: TensorRef<'a>,
    /// `dV` (written), `v`'s shape.
    pub dv: TensorRef<'a>,
    /// Where given, `dS` (written) `[B, Hq, Sq, Sk]`: the gradient of every score, which a
    /// bias's gradient sums over its broadcast dimensions.
    pub ds: Option<TensorRef<'a>>,
}
