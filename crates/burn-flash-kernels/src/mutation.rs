//! Deliberate bugs, to show that the test suites fail when a kernel is wrong.
//!
//! Compiled in only with the `mutants` feature (never in a release of the crate); the variable
//! `BURN_FLASH_MUTATION` then names the one bug a process runs with. Without the feature every
//! query is the constant `false` and the kernels are unchanged. The kernels ask at expansion
//! time (`comptime!`), so a mutation changes the generated code, not a runtime branch.
//!
//! ```sh
//! BURN_FLASH_MUTATION=zero-dx cargo test --features mutants --test softmax_matmul
//! ```

/// A bug the kernels can be built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// `zero-dx`: every backward kernel writes `dX = 0`.
    ZeroDx,
    /// `drop-delta`: the backward drops its row term, `δ = rowsum(dO ⊙ O)` for `softmax(X)·V`,
    /// `Σ dy ⊙ y` (softmax) or `Σ dy` (log-softmax), as if it were 0.
    DropDelta,
    /// `no-rescale`: the online softmax never rescales what it accumulated when the running
    /// maximum grows (`e^(m − m')` forced to 1).
    NoRescale,
    /// `causal-top-left`: attention's causal mask aligned top-left (`j ≤ i`) instead of
    /// bottom-right (`j ≤ i + Sk − Sq`); the same when `Sq = Sk`.
    CausalTopLeft,
    /// `zero-dq`: the attention backward writes `dQ = 0`.
    ZeroDq,
    /// `gqa-modulo`: the attention backward sums the query heads of key/value head `h` as
    /// `h % Hkv` (interleaved) instead of the group `h / (Hq / Hkv)` (contiguous).
    GqaModulo,
    /// `dropout-fresh-mask`: the attention backward draws its dropout mask under another key
    /// instead of regenerating the forward's.
    DropoutFreshMask,
    /// `fill-grad`: the attention backward lets `dS` flow through masked keys that took the
    /// fill score (a constant, whose `dS` must reach nothing).
    FillGrad,
    /// `quiet-off`: the attention forward ignores quiet softmax's `1 +` in the denominator.
    QuietOff,
    /// `stage-head-start`: the `dK`/`dV` kernel stages every query block that lies inside one
    /// head from that head's first row (its position `p0` taken as 0).
    StageHeadStart,
    /// `dx-narrow-blocks`: the `dX` kernel places its row blocks [`DQ_ROWS`] apart whatever
    /// its rows per cube (the 128-row cube of given scores then overlaps and skips rows).
    ///
    /// [`DQ_ROWS`]: crate::flash::backward::mma::DQ_ROWS
    DxNarrowBlocks,
    /// `keep-fragments`: the cooperative-matrix forward never rescales its output fragments
    /// when a row's reference maximum moves (its row sums still are).
    KeepFragments,
    /// `zero-dk`: the cooperative-matrix, Hopper and Ampere backwards write `dK = 0`.
    ZeroDk,
    /// `wgmma-strides`: the hand-written `wgmma` kernel (`hopper::door`) swaps its descriptors'
    /// leading and stride byte offsets.
    WgmmaStrides,
    /// `hopper-no-wait`: the Hopper kernels' producers refill a slot (`K`/`V` in the forward,
    /// `Q`/`dO` in the backward) without waiting for the consumers to release it (the
    /// pipeline's empty-barrier waits dropped).
    HopperNoWait,
    /// `dq-skip-tile`: the Hopper backward's `dQ` writer never issues the bulk reduce of the
    /// second consumer warpgroup's tile (head dim 128: columns 64–127; 64: its keys' share).
    DqSkipTile,
    /// `dq-bulk-no-wait`: the Hopper backward's `dQ` writer hands a tile back to its consumer
    /// without waiting for the bulk reduce to have read it (a race).
    DqBulkNoWait,
    /// `dq-unordered`: the deterministic Hopper backward's `dQ` writer adds without waiting
    /// for its turn (the key blocks' adds in any order: different bits from run to run).
    DqUnordered,
    /// `bias-block`: the Hopper forward loads the bias tile of the wrong key block (block
    /// `j ^ 1` for block `j`) into a step's slot.
    BiasBlock,
    /// `bias-block-bwd`: the Hopper backward loads the bias tile of the wrong key block (block
    /// `n ^ 1` for block `n`) into a step's `dSᵀ` buffer.
    BiasBlockBwd,
    /// `ds-skipped-rows`: the Hopper and Ampere backwards writing `dS` (a tracked bias) fill
    /// the rows a causal key block skips with 2 (`0x4000` in f16 and bf16) instead of 0.
    DsSkippedRows,
    /// `window-right`: a sliding window's right edge is one key too far (`j ≤ i + Sk − Sq +
    /// right + 1`), in every kernel's visibility test and key range alike.
    WindowRight,
    /// `varlen-first-row`: a packed batch's sequence lookup takes each sequence's first query
    /// row for the previous sequence's (`cu_q[b] < pos` instead of `≤`).
    VarlenFirstRow,
    /// `paged-lookup`: the paged decoding kernel looks every batch's keys up in the block
    /// table's first row (batch 0's blocks).
    PagedLookup,
    /// `drop-split`: the split-KV merge leaves out the last split's partial state.
    DropSplit,
    /// `biased-norm`: the layer norm divides the centred squares by `d − 1` (the unbiased
    /// variance) instead of `d`.
    BiasedNorm,
    /// `skip-k-lane`: the few-rows linear kernel leaves out its last lane of the reduction
    /// dimension (every `K_LANES`-th row of `W` from the last lane's first).
    SkipKLane,
    /// `forced-spill`: the Hopper forward's two consumer warpgroups claim 176 registers a
    /// thread instead of 240 (`setmaxnreg`), which forces ptxas to spill (`cargo xtask
    /// cuda-check`).
    ForcedSpill,
    /// `register-budget`: the `mma.sync` forward's stated occupancy is four times what its
    /// schedule assumes, a register budget under its count (`cargo xtask cuda-check`).
    RegisterBudget,
    /// `hopper-syntax`: a semicolon of the Hopper forward's source is dropped, a syntax error
    /// NVRTC reports (`cargo xtask cuda-check`).
    HopperSyntax,
    /// `dropped-parameter`: the Hopper forward's source leaves out the pointer to its `K` map's
    /// buffer, so every argument after it lands one parameter early (`cargo xtask cuda-check`).
    DroppedParameter,
    /// `uncounted-barriers`: the `mma.sync` forward's plan leaves its two barriers out of its
    /// shared memory, so a D 256 plan on sm_86 / sm_89 asks 16 bytes over the device's limit
    /// (`cargo xtask cuda-check`).
    UncountedBarriers,
    /// `q-early`: the persistent Hopper forward's producer loads a tile's `Q` without waiting
    /// for the consumers' last `Q·Kᵀ` of the block's previous tile.
    QEarly,
    /// `tile-skip`: the dynamic Hopper forward's counter hands out every other tile: half of
    /// the tiles after the first round never run.
    TileSkip,
    /// `defer-wrong-buffer`: the Hopper backward with `dQ` deferred by a step reads the `dSᵀ`
    /// buffer of the current step for the previous step's `dQ`.
    DeferWrongBuffer,
    /// `kv-early`: the persistent Hopper backward's producer loads a tile's `K` and `V` without
    /// waiting for the consumers' last products of the block's previous tile.
    KvEarly,
    /// `ds-store-skipped`: the Ampere backward (`flash/backward/sm80.cu`) stores only the first
    /// 16-row tile of each warp's `dS` to shared memory; `dK` and `dQ` read what the second
    /// tile's rows held before.
    DsStoreSkipped,
    /// `warp-cols`: the Ampere backward's `dQ` warps take columns `P3_COLS · (warp % 2)`
    /// instead of `% 4` (a wrong warp tile offset: half of `dQ`'s columns added twice, half
    /// never).
    WarpCols,
    /// `ds-tile-rows`: the Ampere backward writing `dS` (a tracked bias) copies row `r ^ 8` of
    /// each step's `dS` tile to row `r` (rows swapped in pairs of 8-row groups).
    DsTileRows,
}

impl Mutation {
    /// The name `BURN_FLASH_MUTATION` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::ZeroDx => "zero-dx",
            Self::DropDelta => "drop-delta",
            Self::NoRescale => "no-rescale",
            Self::CausalTopLeft => "causal-top-left",
            Self::ZeroDq => "zero-dq",
            Self::GqaModulo => "gqa-modulo",
            Self::DropoutFreshMask => "dropout-fresh-mask",
            Self::FillGrad => "fill-grad",
            Self::QuietOff => "quiet-off",
            Self::StageHeadStart => "stage-head-start",
            Self::DxNarrowBlocks => "dx-narrow-blocks",
            Self::KeepFragments => "keep-fragments",
            Self::ZeroDk => "zero-dk",
            Self::WgmmaStrides => "wgmma-strides",
            Self::HopperNoWait => "hopper-no-wait",
            Self::DqSkipTile => "dq-skip-tile",
            Self::DqBulkNoWait => "dq-bulk-no-wait",
            Self::DqUnordered => "dq-unordered",
            Self::BiasBlock => "bias-block",
            Self::BiasBlockBwd => "bias-block-bwd",
            Self::DsSkippedRows => "ds-skipped-rows",
            Self::WindowRight => "window-right",
            Self::VarlenFirstRow => "varlen-first-row",
            Self::PagedLookup => "paged-lookup",
            Self::DropSplit => "drop-split",
            Self::BiasedNorm => "biased-norm",
            Self::SkipKLane => "skip-k-lane",
            Self::ForcedSpill => "forced-spill",
            Self::RegisterBudget => "register-budget",
            Self::HopperSyntax => "hopper-syntax",
            Self::UncountedBarriers => "uncounted-barriers",
            Self::DroppedParameter => "dropped-parameter",
            Self::QEarly => "q-early",
            Self::TileSkip => "tile-skip",
            Self::DeferWrongBuffer => "defer-wrong-buffer",
            Self::KvEarly => "kv-early",
            Self::DsStoreSkipped => "ds-store-skipped",
            Self::WarpCols => "warp-cols",
            Self::DsTileRows => "ds-tile-rows",
        }
    }
}

/// Whether the kernels are built with `mutation`.
#[cfg(feature = "mutants")]
pub fn active(mutation: Mutation) -> bool {
    chosen_name() == Some(mutation.name())
}

/// The mutation this process runs with (`BURN_FLASH_MUTATION`), checked against the known
/// names on first use.
#[cfg(feature = "mutants")]
pub fn chosen_name() -> Option<&'static str> {
    static CHOSEN: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let chosen = CHOSEN.get_or_init(|| {
        let name = std::env::var("BURN_FLASH_MUTATION").ok()?;
        let known = [
            Mutation::ZeroDx,
            Mutation::DropDelta,
            Mutation::NoRescale,
            Mutation::CausalTopLeft,
            Mutation::ZeroDq,
            Mutation::GqaModulo,
            Mutation::DropoutFreshMask,
            Mutation::FillGrad,
            Mutation::QuietOff,
            Mutation::StageHeadStart,
            Mutation::DxNarrowBlocks,
            Mutation::KeepFragments,
            Mutation::ZeroDk,
            Mutation::WgmmaStrides,
            Mutation::HopperNoWait,
            Mutation::DqSkipTile,
            Mutation::DqBulkNoWait,
            Mutation::DqUnordered,
            Mutation::BiasBlock,
            Mutation::BiasBlockBwd,
            Mutation::DsSkippedRows,
            Mutation::WindowRight,
            Mutation::VarlenFirstRow,
            Mutation::PagedLookup,
            Mutation::DropSplit,
            Mutation::BiasedNorm,
            Mutation::SkipKLane,
            Mutation::ForcedSpill,
            Mutation::RegisterBudget,
            Mutation::HopperSyntax,
            Mutation::UncountedBarriers,
            Mutation::DroppedParameter,
            Mutation::QEarly,
            Mutation::TileSkip,
            Mutation::DeferWrongBuffer,
            Mutation::KvEarly,
            Mutation::DsStoreSkipped,
            Mutation::WarpCols,
            Mutation::DsTileRows,
        ];
        assert!(
            known.iter().any(|m| m.name() == name),
            "BURN_FLASH_MUTATION={name}: not one of {}",
            known.map(Mutation::name).join(", ")
        );
        eprintln!("burn-flash: kernels built with the mutation `{name}`");
        Some(name)
    });
    chosen.as_deref()
}

/// Whether the kernels are built with `mutation`: never, without the `mutants` feature.
#[cfg(not(feature = "mutants"))]
pub fn active(mutation: Mutation) -> bool {
    let _ = mutation;
    false
}

/// The mutation this process runs with: none, without the `mutants` feature.
#[cfg(not(feature = "mutants"))]
pub fn chosen_name() -> Option<&'static str> {
    None
}

/// [`Mutation::ZeroDx`] is active.
pub fn zero_dx() -> bool {
    active(Mutation::ZeroDx)
}

/// [`Mutation::DropDelta`] is active.
pub fn drop_delta() -> bool {
    active(Mutation::DropDelta)
}

/// [`Mutation::NoRescale`] is active.
pub fn no_rescale() -> bool {
    active(Mutation::NoRescale)
}

/// [`Mutation::CausalTopLeft`] is active.
pub fn causal_top_left() -> bool {
    active(Mutation::CausalTopLeft)
}

/// [`Mutation::ZeroDq`] is active.
pub fn zero_dq() -> bool {
    active(Mutation::ZeroDq)
}

/// [`Mutation::GqaModulo`] is active.
pub fn gqa_modulo() -> bool {
    active(Mutation::GqaModulo)
}

/// [`Mutation::DropoutFreshMask`] is active.
pub fn dropout_fresh_mask() -> bool {
    active(Mutation::DropoutFreshMask)
}

/// [`Mutation::FillGrad`] is active.
pub fn fill_grad() -> bool {
    active(Mutation::FillGrad)
}

/// [`Mutation::QuietOff`] is active.
pub fn quiet_off() -> bool {
    active(Mutation::QuietOff)
}

/// [`Mutation::StageHeadStart`] is active.
pub fn stage_head_start() -> bool {
    active(Mutation::StageHeadStart)
}

/// [`Mutation::DxNarrowBlocks`] is active.
pub fn dx_narrow_blocks() -> bool {
    active(Mutation::DxNarrowBlocks)
}

/// [`Mutation::KeepFragments`] is active.
pub fn keep_fragments() -> bool {
    active(Mutation::KeepFragments)
}

/// [`Mutation::DqSkipTile`] is active.
pub fn dq_skip_tile() -> bool {
    active(Mutation::DqSkipTile)
}

/// [`Mutation::DqBulkNoWait`] is active.
pub fn dq_bulk_no_wait() -> bool {
    active(Mutation::DqBulkNoWait)
}

/// [`Mutation::DqUnordered`] is active.
pub fn dq_unordered() -> bool {
    active(Mutation::DqUnordered)
}

/// [`Mutation::BiasBlock`] is active.
pub fn bias_block() -> bool {
    active(Mutation::BiasBlock)
}

/// [`Mutation::ZeroDk`] is active.
pub fn zero_dk() -> bool {
    active(Mutation::ZeroDk)
}

/// [`Mutation::WgmmaStrides`] is active.
pub fn wgmma_strides() -> bool {
    active(Mutation::WgmmaStrides)
}

/// [`Mutation::HopperNoWait`] is active.
pub fn hopper_no_wait() -> bool {
    active(Mutation::HopperNoWait)
}

/// [`Mutation::QEarly`] is active.
pub fn q_early() -> bool {
    active(Mutation::QEarly)
}

/// [`Mutation::TileSkip`] is active.
pub fn tile_skip() -> bool {
    active(Mutation::TileSkip)
}

/// [`Mutation::DeferWrongBuffer`] is active.
pub fn defer_wrong_buffer() -> bool {
    active(Mutation::DeferWrongBuffer)
}

/// [`Mutation::KvEarly`] is active.
pub fn kv_early() -> bool {
    active(Mutation::KvEarly)
}

/// [`Mutation::BiasBlockBwd`] is active.
pub fn bias_block_bwd() -> bool {
    active(Mutation::BiasBlockBwd)
}

/// [`Mutation::DsSkippedRows`] is active.
pub fn ds_skipped_rows() -> bool {
    active(Mutation::DsSkippedRows)
}

/// [`Mutation::WindowRight`] is active.
pub fn window_right() -> bool {
    active(Mutation::WindowRight)
}

/// [`Mutation::VarlenFirstRow`] is active.
pub fn varlen_first_row() -> bool {
    active(Mutation::VarlenFirstRow)
}

/// [`Mutation::PagedLookup`] is active.
pub fn paged_lookup() -> bool {
    active(Mutation::PagedLookup)
}

/// [`Mutation::DropSplit`] is active.
pub fn drop_split() -> bool {
    active(Mutation::DropSplit)
}

/// [`Mutation::BiasedNorm`] is active.
pub fn biased_norm() -> bool {
    active(Mutation::BiasedNorm)
}

/// [`Mutation::SkipKLane`] is active.
pub fn skip_k_lane() -> bool {
    active(Mutation::SkipKLane)
}

/// [`Mutation::ForcedSpill`] is active.
pub fn forced_spill() -> bool {
    active(Mutation::ForcedSpill)
}

/// [`Mutation::RegisterBudget`] is active.
pub fn register_budget() -> bool {
    active(Mutation::RegisterBudget)
}

/// [`Mutation::HopperSyntax`] is active.
pub fn hopper_syntax() -> bool {
    active(Mutation::HopperSyntax)
}

/// [`Mutation::UncountedBarriers`] is active.
pub fn uncounted_barriers() -> bool {
    active(Mutation::UncountedBarriers)
}

/// [`Mutation::DroppedParameter`] is active.
pub fn dropped_parameter() -> bool {
    active(Mutation::DroppedParameter)
}

/// [`Mutation::DsStoreSkipped`] is active.
pub fn ds_store_skipped() -> bool {
    active(Mutation::DsStoreSkipped)
}

/// [`Mutation::WarpCols`] is active.
pub fn warp_cols() -> bool {
    active(Mutation::WarpCols)
}

/// [`Mutation::DsTileRows`] is active.
pub fn ds_tile_rows() -> bool {
    active(Mutation::DsTileRows)
}
