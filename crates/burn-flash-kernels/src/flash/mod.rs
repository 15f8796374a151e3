//! The flash kernels of both ops, forward and backward. The forward is the online softmax:
//! `softmax(S)·V` over the columns of `S` in steps, never holding a whole row of `S`; the
//! backward ([`backward`] on plain units, [`mma_backward`] on the matrix units) rebuilds `P`
//! block by block from the forward's log-sum-exp.
//!
//! Per row, after the columns `0..j` the kernel holds a reference maximum `m`, the sum
//! `l = Σ e^(s − m)` and the unnormalised output `O = Σ e^(s − m)·v`. A step with scores `S`
//! (and `P = e^(S − m')`) updates them as
//!
//! ```text
//! m' = max(m, rowmax(S))
//! α  = e^(m − m')
//! l' = α·l + rowsum(P)
//! O' = α·O + P·V
//! ```
//!
//! and the result is `O / l` with the row log-sum-exp `lse = m + ln l`. Both start from the
//! lowest finite value (`m`) and 0, so `m − m'` is never `−inf − (−inf)`; a row with no visible
//! column keeps `l = 0` and gets the output 0 and `lse = −inf`.
//!
//! **Lazy rescale.** `m` only has to bound the scores closely enough that `e^(s − m)` neither
//! overflows nor loses the row's largest terms. The matrix-unit kernels keep `m` until a row's
//! maximum exceeds it by more than [`LAZY_RESCALE`]: then `P ≤ e^8 ≈ 2981` (well inside f16's
//! range) and most steps skip the rescale of `O` (whose cost grows with the output width).
//! The result is exact either way: `O / l` and `m + ln l` do not depend on which `m` was used.
//!
//! **One forward loop, two score sources.** The loop is written once per inner-product path
//! and takes the source of its scores as a comptime choice ([`ScoreSource`]):
//! [`ScoreSource::Given`] reads a score matrix `X` from memory (`softmax(X)·V`, the
//! `softmax_matmul` op), [`ScoreSource::QueryKey`] computes `S = scale·Q·Kᵀ` on chip and never
//! writes it (attention). Everything after the scores is shared: the score rules
//! ([`scores`]: softcap, mask, causal, bias — attention only), the update below, `P·V`, the
//! normalisation and the stores.
//! - [`mma`]: FlashAttention-2's schedule on the matrix units (f16/bf16, CUDA sm_80+);
//! - [`units`]: plain units, every runtime and float type, f32 arithmetic, up to 64 × 64
//!   outputs per cube;
//! - [`tiled`]: the same on plain units with a register-tiled `P·V` (128 × 128 outputs per
//!   cube, 8 × 8 per unit), for outputs of at least 65 × 65.

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod backward;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod given_tiled;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod mma;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod mma_backward;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod scores;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod tiled;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod units;

use cubecl::{CubeCount, CubeDim, prelude::*};

use crate::dropout::DropoutParams;

/// Where a forward kernel's scores come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScoreSource {
    /// Read from a score tensor `X` `[B, H, Sq, Sk]` (passed in place of the queries): the
    /// scores are used as they are (no scale; softcap, mask, causal and bias must be off).
    Given,
    /// Read from a tensor `P` laid out as [`ScoreSource::Given`]'s scores that already holds
    /// the softmax weights (each row normalised, finite): the forward computes `P·V` only, with
    /// no maxima, sums or `lse` (matrix-unit forward only; `softmax_matmul`'s P-buffer plan,
    /// whose softmax kernel writes `P` and `lse`).
    Probabilities,
    /// `S = scale·Q·Kᵀ`, computed on chip, with the score rules of [`scores`].
    QueryKey,
}

/// Comptime configuration of a forward kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlashConfig {
    /// Where the scores come from.
    pub source: ScoreSource,
    /// Query rows per cube.
    pub block_q: u32,
    /// Tiles of 16 query rows per plane (matrix-unit kernel; 1 elsewhere).
    pub row_tiles: u32,
    /// Keys (score columns) per step of the online softmax.
    pub block_k: u32,
    /// Head dim of `q`/`k`, rounded up to the kernel's granule (unused for given scores).
    pub head_dim: u32,
    /// Output columns per cube: all of `Dv` rounded up to the kernel's granule, or one column
    /// tile of a wider output (the grid's third axis runs over the tiles).
    pub value_dim: u32,
    /// Bottom-right aligned causal mask.
    pub causal: bool,
    /// A bool mask is read.
    pub mask: bool,
    /// An additive bias is read.
    pub bias: bool,
    /// Scores are softcapped.
    pub softcap: bool,
    /// Dropout on the weights ([`crate::dropout`]; the plain-unit and matrix-unit kernels).
    pub dropout: bool,
    /// With a mask, the score a masked key takes (the bits of an `f32`; burn-nn's `min_float`
    /// fill). The key stays in the softmax, so a fully masked row is uniform; its score is a
    /// constant, so its `dS` reaches neither `Q`, `K` nor a bias. `None`: masked keys are
    /// invisible ([`scores`]).
    pub masked_score: Option<u32>,
    /// Quiet softmax, `e^s / (1 + Σ e^s)` ([`output_sum()`], [`row_lse()`]).
    pub quiet: bool,
}

impl FlashConfig {
    /// Whether the scores are given (read from memory) rather than computed: raw scores or
    /// [`ScoreSource::Probabilities`].
    pub fn given(&self) -> bool {
        matches!(self.source, ScoreSource::Given | ScoreSource::Probabilities)
    }

    /// Whether the given scores are already the softmax weights
    /// ([`ScoreSource::Probabilities`]).
    pub fn probabilities(&self) -> bool {
        self.source == ScoreSource::Probabilities
    }

    /// Whether masked keys take [`FlashConfig::masked_score`] (a mask is read and the score
    /// is set).
    pub fn fills(&self) -> bool {
        self.mask && self.masked_score.is_some()
    }

    /// The score of a masked key ([`FlashConfig::masked_score`]; 0 when unset, never read).
    pub fn fill_score(&self) -> f32 {
        f32::from_bits(self.masked_score.unwrap_or(0))
    }
}

/// The forward kernels of this module: what an op's plan picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlashKernel {
    /// [`units::flash_forward_units()`].
    Units,
    /// [`tiled::flash_forward_tiled()`].
    Tiled,
    /// [`mma::flash_forward_mma()`].
    MatrixUnits,
}

/// The tensors of a forward launch (shapes and strides in [`mma::flash_forward_mma()`]'s
/// terms; stand-ins for the ones the configuration never reads).
pub struct FlashTensors<R: Runtime> {
    /// Queries, or the given scores `X`.
    pub q: TensorArg<R>,
    /// Keys.
    pub k: TensorArg<R>,
    /// Values.
    pub v: TensorArg<R>,
    /// The bool mask, in the element type (1 = masked out).
    pub mask: TensorArg<R>,
    /// The additive bias.
    pub bias: TensorArg<R>,
    /// The output.
    pub out: TensorArg<R>,
    /// The row log-sum-exp (f32).
    pub lse: TensorArg<R>,
}

/// Launches `kernel` with configuration `c` on grid `count` of `dim` units: the one place where
/// both ops (`softmax_matmul`, attention) start a forward. `dropout` is read only by the
/// plain-unit and matrix-unit kernels, and only when `c.dropout`. `vector` is the tiled kernel's
/// vector width (the matrix-unit kernel always reads 16-byte vectors, [`mma::NV8`]).
///
/// # Safety
/// The tensors' shapes and strides describe their buffers, and the kernel's conditions hold:
/// 16-byte aligned rows for the matrix units ([`mma::flash_forward_mma()`]), `vector` dividing
/// the rows and strides of `q`, `k`, `v` and `out` for the tiled kernel.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    kernel: FlashKernel,
    count: CubeCount,
    dim: CubeDim,
    vector: usize,
    t: FlashTensors<R>,
    scale: f32,
    softcap: f32,
    dropout: DropoutParams,
    c: FlashConfig,
    dtype: StorageType,
) {
    let FlashTensors {
        q,
        k,
        v,
        mask,
        bias,
        out,
        lse,
    } = t;
    // SAFETY: the caller's (see above).
    unsafe {
        match kernel {
            FlashKernel::MatrixUnits => mma::flash_forward_mma::launch_unchecked::<R>(
                client,
                count,
                dim,
                mma::NV8,
                mma::out_vector(c),
                q,
                k,
                v,
                mask,
                bias,
                out,
                lse,
                scale,
                softcap,
                dropout.seed_lo,
                dropout.seed_hi,
                dropout.threshold,
                dropout.inv_keep(),
                c,
                dtype,
            ),
            FlashKernel::Tiled => tiled::flash_forward_tiled::launch_unchecked::<R>(
                client,
                count,
                dim,
                vector,
                q,
                k,
                v,
                mask,
                bias,
                out,
                lse,
                scale,
                softcap,
                c,
                tiled::planes(client),
                dtype,
            ),
            FlashKernel::Units => units::flash_forward_units::launch_unchecked::<R>(
                client,
                count,
                dim,
                q,
                k,
                v,
                mask,
                bias,
                out,
                lse,
                scale,
                softcap,
                dropout.seed_lo,
                dropout.seed_hi,
                dropout.threshold,
                dropout.inv_keep(),
                c,
                dtype,
            ),
        }
    }
}

/// The grid of a forward launch: `x` cubes along the output's column tiles, and `row_blocks`
/// row blocks for each of `pairs` (batch, key/value head) pairs, the pairs folded over y and z
/// (`y = fold·row_blocks`, `z = ⌈pairs / fold⌉`, with `fold` the fewest copies that keep `z`
/// within `max.2`), so that any `B·Hkv` runs. `None` when even that exceeds the device's
/// limits `max`.
pub fn fold_grid(
    x: usize,
    row_blocks: usize,
    pairs: usize,
    max: (u32, u32, u32),
) -> Option<(usize, usize, usize)> {
    let (x, row_blocks, pairs) = (x.max(1), row_blocks.max(1), pairs.max(1));
    let fold = pairs.div_ceil(max.2 as usize);
    let cubes = (x, row_blocks * fold, pairs.div_ceil(fold));
    (cubes.0 <= max.0 as usize && cubes.1 <= max.1 as usize).then_some(cubes)
}

/// The part of the problem one cube of a flash kernel owns, read from the grid position
/// `(x, y, z)` = (output column tile, block of query rows, batch × key/value head; the last two
/// folded as [`fold_grid`] lays them out, and cubes past the last pair exit): query rows
/// `row0 .. row0 + block_q` of key/value head `hkv` of batch `batch` (rows run over the `G`
/// query heads of the group, `Sq` positions each: row `r` is head `head0 + r / Sq`, position
/// `r % Sq`) and output columns `col0 .. col0 + value_dim`. The column tiles of a row block are
/// adjacent in the grid, so they run together and read the block's scores from L2 (given
/// scores: `X` is read once per column tile).
#[derive(CubeType)]
pub struct CubeBlock {
    /// `Sq`.
    pub seq_q: usize,
    /// `Sk`.
    pub seq_k: usize,
    /// Query rows of a key/value head: `G·Sq`.
    pub rows: usize,
    /// The batch.
    pub batch: usize,
    /// The key/value head.
    pub hkv: usize,
    /// The group's first query head.
    pub head0: usize,
    /// The first row.
    pub row0: usize,
    /// The first output column.
    pub col0: usize,
    /// Whether this is the first column tile (the one that writes the log-sum-exp).
    pub first_tile: bool,
    /// The keys any of the rows sees: `0 .. kv_end` (all of them but under a causal mask).
    pub kv_end: usize,
    /// The keys every row sees: `0 .. full_end`.
    pub full_end: usize,
}

/// The [`CubeBlock`] of this cube for queries `q` (the scores `X` when they are given) and
/// keys `k`.
#[cube]
pub fn cube_block<Q: CubePrimitive, K: CubePrimitive>(
    q: &Tensor<Q>,
    k: &Tensor<K>,
    #[comptime] c: FlashConfig,
) -> CubeBlock {
    let seq_q = q.shape(2);
    let mut seq_k = k.shape(2);
    let mut heads_kv = k.shape(1);
    if comptime!(c.given()) {
        seq_k = q.shape(3);
        heads_kv = q.shape(1);
    }
    let group = q.shape(1) / heads_kv;
    let rows = group * seq_q;
    // `B·Hkv` folded over y and z ([`fold_grid`]): y runs over `fold` copies of the row blocks.
    let row_blocks = rows.div_ceil(comptime!(c.block_q as usize));
    let fold = CUBE_COUNT_Y as usize / row_blocks;
    let pair = CUBE_POS_Z as usize * fold + CUBE_POS_Y as usize / row_blocks;
    if pair >= q.shape(0) * heads_kv {
        terminate!();
    }
    let hkv = pair % heads_kv;
    let row0 = (CUBE_POS_Y as usize % row_blocks) * comptime!(c.block_q as usize);
    // With a causal mask: up to the last row's diagonal, and all keys up to the first row's.
    let last = usize::min(row0 + comptime!(c.block_q as usize), rows) - 1;
    let one_head = row0 / seq_q == last / seq_q;
    let mut kv_end = seq_k;
    let mut full_end = seq_k;
    if comptime!(c.causal) {
        // Largest / smallest position among the rows (all of them when they span heads).
        let pos_hi = select(one_head, last % seq_q, seq_q - 1);
        let pos_lo = select(one_head, row0 % seq_q, 0);
        kv_end = scores::causal_end(pos_hi, seq_q, seq_k);
        full_end = scores::causal_end(pos_lo, seq_q, seq_k);
    }
    CubeBlock {
        seq_q,
        seq_k,
        rows,
        batch: pair / heads_kv,
        hkv,
        head0: hkv * group,
        row0,
        col0: (CUBE_POS_X * c.value_dim) as usize,
        first_tile: CUBE_POS_X == 0,
        kv_end,
        full_end,
    }
}

/// How far a row's maximum may rise above the reference `m` before `m` (and the
/// accumulators) move (module docs).
pub const LAZY_RESCALE: f32 = 8.0;

/// The new reference maximum of a row from its current one `m` and the step's maximum:
/// `m' = max(m, step_max)`, or with `lazy`, `m` itself unless the step's maximum exceeds it by
/// more than [`LAZY_RESCALE`].
#[cube]
pub fn next_reference(m: f32, step_max: f32, #[comptime] lazy: bool) -> f32 {
    let exact = f32::max(m, step_max);
    if comptime!(lazy) {
        select(step_max > m + LAZY_RESCALE, exact, m)
    } else {
        exact
    }
}

/// The scale `α = e^(m − m')` of a row's sum and accumulators when its reference moves from
/// `m` to `m_new` (1 when it does not move).
#[cube]
pub fn rescale_factor(m: f32, m_new: f32) -> f32 {
    let mut alpha = f32::exp(m - m_new);
    if comptime!(crate::mutation::no_rescale()) {
        alpha = 1.0f32;
    }
    alpha
}

/// `P = e^(s − m)` of one score, 0 where the column is not `visible` (masked, or past the
/// end of the row).
#[cube]
pub fn probability(s: f32, m: f32, visible: bool) -> f32 {
    select(visible, f32::exp(s - m), 0.0f32)
}

/// The output scale `1 / l` of a row (0 for a row without a visible column, `l = 0`).
#[cube]
pub fn inverse_sum(l: f32) -> f32 {
    select(l == 0.0f32, 0.0f32, 1.0f32 / l)
}

/// The row log-sum-exp `m + ln l` (`−inf` when `l = 0`).
#[cube]
pub fn log_sum_exp(m: f32, l: f32) -> f32 {
    m + f32::ln(l)
}

/// The sum a row's output is divided by: `l`, or with quiet softmax `l + e^(−m)` (the `1` of
/// `1 + Σ e^s` against the reference `m`; infinite, and the output 0, for a row without a
/// visible key or whose scores are all far below 0).
#[cube]
pub fn output_sum(m: f32, l: f32, #[comptime] c: FlashConfig) -> f32 {
    let mut total = l;
    if comptime!(c.quiet && !crate::mutation::quiet_off()) {
        total += f32::exp(-m);
    }
    total
}

/// The log-sum-exp a row stores for the backward: [`log_sum_exp()`], or with quiet softmax
/// [`quiet_lse()`] of it.
#[cube]
pub fn row_lse(m: f32, l: f32, #[comptime] c: FlashConfig) -> f32 {
    let mut lse = log_sum_exp(m, l);
    if comptime!(c.quiet) {
        lse = quiet_lse(lse);
    }
    lse
}

/// The log of the quiet softmax's denominator, `ln(1 + Σ e^s) = softplus(L)` for `L = lse`,
/// computed without overflow: `max(L, 0) + ln(1 + e^(−|L|))` (0 for `L = −inf`). The backward
/// rebuilds the quiet weights `e^(s − softplus(L))` from it; nothing else changes there, as
/// `∂p_j/∂s_k = p_j(δ_jk − p_k)` holds for the quiet weights too.
#[cube]
pub fn quiet_lse(lse: f32) -> f32 {
    f32::max(lse, 0.0f32) + f32::ln(1.0f32 + f32::exp(-f32::abs(lse)))
}
