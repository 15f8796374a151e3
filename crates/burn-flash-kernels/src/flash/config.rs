//! The comptime configuration of a flash kernel: where its scores come from, the score rules
//! a call asks for, and the tile a plan chose. A plan builds it once ([`FlashConfig::new`]) and
//! the launch compiles the kernel with it as it is.

/// Where a kernel's scores come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScoreSource {
    /// Read from a score tensor `X` `[B, H, Sq, Sk]` (passed in place of the queries): the
    /// scores are used as they are (no scale; softcap, mask, causal and bias are off).
    Given,
    /// `S = scale·Q·Kᵀ`, computed on chip, with the score rules of [`crate::flash::scores`].
    QueryKey,
}

/// What a call asks of its scores and of the softmax over them: everything in a
/// [`FlashConfig`] but its tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScoreRules {
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
    /// invisible ([`crate::flash::scores`]).
    pub masked_score: Option<u32>,
    /// Quiet softmax, `e^s / (1 + Σ e^s)` ([`crate::flash::online::output_sum()`],
    /// [`crate::flash::online::row_lse()`]).
    pub quiet: bool,
    /// A sliding window (local attention): query `i` sees keys `i + Sk − Sq − left ..= i + Sk −
    /// Sq + right` (bottom-right aligned like the causal mask; `left`, `right` are runtime
    /// scalars, [`crate::flash::args::ScoreArgs`]). Keys outside are skipped, not masked.
    pub window: bool,
    /// ALiBi from per-head slopes (`[Hq]`, f32): `s −= slope[h]·|i + Sk − Sq − j|`, computed in
    /// the kernel beside the bias.
    pub alibi: bool,
    /// Attention sinks (gpt-oss): a per-head logit (`[Hq]`, f32) in every row's denominator,
    /// `e^s_j / (e^sink + Σ e^s)` ([`crate::flash::online::output_sum()`]); the stored
    /// log-sum-exp includes it, so the backward kernels are unchanged.
    pub sinks: bool,
    /// A packed variable-length batch: the call's one batch holds sequences end to end, and
    /// each query position sees only its own sequence's keys, under the other rules applied
    /// per sequence (causal and the window bottom-right aligned in each). The sequences'
    /// cumulative lengths are a runtime tensor ([`crate::flash::args::ScoreInputs::seqs`]).
    pub varlen: bool,
}

impl ScoreRules {
    /// No rule: the scores as they are, a plain softmax (given scores).
    pub const NONE: Self = Self {
        causal: false,
        mask: false,
        bias: false,
        softcap: false,
        dropout: false,
        masked_score: None,
        quiet: false,
        window: false,
        alibi: false,
        sinks: false,
        varlen: false,
    };

    /// The rules as the hand-written CUDA kernels read them, a `#define NAME 0|1` each
    /// (`crate::hopper::Defines::rules`): `FILL` for a mask whose keys take the fill score (its
    /// value is a runtime scalar, so calls that differ only in it share a compiled kernel). A
    /// kernel ignores the rules it does not take.
    pub fn flags(&self) -> [(&'static str, bool); 11] {
        [
            ("CAUSAL", self.causal),
            ("SOFTCAP", self.softcap),
            ("MASK", self.mask),
            ("FILL", self.mask && self.masked_score.is_some()),
            ("BIAS", self.bias),
            ("QUIET", self.quiet),
            ("DROPOUT", self.dropout),
            ("WINDOW", self.window),
            ("ALIBI", self.alibi),
            ("SINKS", self.sinks),
            ("VARLEN", self.varlen),
        ]
    }
}

/// The tile a plan chose for a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tile {
    /// Query rows per cube (keys per cube for a backward dK/dV kernel).
    pub block_q: u32,
    /// Tiles of 16 query rows per plane (matrix-unit forward; 1 elsewhere).
    pub row_tiles: u32,
    /// Keys (score columns) per step of the online softmax (query rows per step of a dK/dV
    /// kernel).
    pub block_k: u32,
    /// Head dim of `q`/`k`, rounded up to the kernel's granule (0 for given scores).
    pub head_dim: u32,
    /// Output columns per cube: all of `Dv` rounded up to the kernel's granule, or one column
    /// tile of a wider output (the grid's x axis runs over the tiles).
    pub value_dim: u32,
}

/// Comptime configuration of a flash kernel: score source, [`ScoreRules`] and the [`Tile`]'s
/// sizes (flattened, so that kernels read `c.block_q`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlashConfig {
    /// Where the scores come from.
    pub source: ScoreSource,
    /// [`Tile::block_q`].
    pub block_q: u32,
    /// [`Tile::row_tiles`].
    pub row_tiles: u32,
    /// [`Tile::block_k`].
    pub block_k: u32,
    /// [`Tile::head_dim`].
    pub head_dim: u32,
    /// [`Tile::value_dim`].
    pub value_dim: u32,
    /// What the call asks of its scores.
    pub rules: ScoreRules,
    /// The matrix-unit products take f32 inputs rounded to TF32 (10 mantissa bits; the
    /// cooperative-matrix kernels on CUDA's `wmma` m16n16k8, [`crate::flash::forward::cmma`]);
    /// `false`: the input type as it is.
    pub tf32: bool,
}

impl FlashConfig {
    /// The configuration of a kernel with scores from `source` under `rules`, on `tile`.
    pub fn new(source: ScoreSource, rules: ScoreRules, tile: Tile) -> Self {
        let Tile {
            block_q,
            row_tiles,
            block_k,
            head_dim,
            value_dim,
        } = tile;
        Self {
            source,
            block_q,
            row_tiles,
            block_k,
            head_dim,
            value_dim,
            rules,
            tf32: false,
        }
    }

    /// This configuration with its products on TF32 where `tf32` ([`FlashConfig::tf32`]).
    pub fn with_tf32(self, tf32: bool) -> Self {
        Self { tf32, ..self }
    }

    /// The configuration's tile.
    pub fn tile(&self) -> Tile {
        Tile {
            block_q: self.block_q,
            row_tiles: self.row_tiles,
            block_k: self.block_k,
            head_dim: self.head_dim,
            value_dim: self.value_dim,
        }
    }

    /// Whether the scores are given (read from memory) rather than computed.
    pub fn given(&self) -> bool {
        self.source == ScoreSource::Given
    }

    /// Whether masked keys take [`ScoreRules::masked_score`] (a mask is read and the score
    /// is set).
    pub fn fills(&self) -> bool {
        self.rules.mask && self.rules.masked_score.is_some()
    }

    /// Whether a kernel that visits rows for a key (the dK/dV kernels) needs each row's head
    /// and position: a mask, a bias, dropout, ALiBi, a window or packed sequences.
    pub fn reads_row_terms(&self) -> bool {
        let r = self.rules;
        r.mask || r.bias || r.dropout || r.alibi || r.window || r.varlen
    }

    /// Whether rows see a range of the keys rather than all of them (the causal mask, a window
    /// or packed sequences, [`crate::flash::keys::key_range()`]): the kernels then skip key
    /// blocks outside every row's range.
    pub fn ranged(&self) -> bool {
        let r = self.rules;
        r.causal || r.window || r.varlen
    }

    /// The score of a masked key ([`ScoreRules::masked_score`]; 0 when unset, never read).
    pub fn fill_score(&self) -> f32 {
        f32::from_bits(self.rules.masked_score.unwrap_or(0))
    }
}

/// The forward kernels: what an op's plan picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlashKernel {
    /// [`crate::flash::forward::units::flash_forward_units()`]: plain units, every runtime
    /// and float type.
    Units,
    /// [`crate::flash::forward::tiled::flash_forward_tiled()`]: plain units, register-tiled.
    Tiled,
    /// [`crate::flash::forward::mma::flash_forward_mma()`]: f16/bf16 on the matrix units.
    MatrixUnits,
    /// [`crate::flash::forward::cmma::flash_forward_cmma()`]: f16/bf16 on cooperative
    /// matrices (cubecl's `cmma`: Vulkan, Metal, CUDA's `wmma`).
    CooperativeMatrix,
}

/// The backward kernels: what an op's plan picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackwardKernel {
    /// Plain units, the flash schedule ([`crate::flash::backward::units`]): every runtime and
    /// float type, f32 arithmetic; both score sources.
    Units,
    /// Plain units, the given-score products register-tiled
    /// ([`crate::flash::backward::units_given`]): `softmax(X)·V` only.
    UnitsGiven,
    /// The matrix units ([`crate::flash::backward::mma`]): f16/bf16 on CUDA sm_80+, 16-byte
    /// aligned rows; both score sources.
    MatrixUnits,
    /// Cooperative matrices ([`crate::flash::backward::cmma`]): f16/bf16 where cubecl's `cmma`
    /// runs, `D`, `Dv` up to 128; both score sources.
    CooperativeMatrix,
}
