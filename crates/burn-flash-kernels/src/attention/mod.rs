//! Fused attention forward: `out = softmax(S)·V` with `S` computed on chip from `Q·Kᵀ` and
//! never written, plus the row log-sum-exp of `S` (what a backward needs).
//!
//! Tensors are 4-D and read through their strides: `q` `[B, Hq, Sq, D]`, `k` `[B, Hkv, Sk, D]`,
//! `v` `[B, Hkv, Sk, Dv]`, `out` `[B, Hq, Sq, Dv]`, `lse` `[B, Hq, Sq]` (f32). `Hkv` divides
//! `Hq` (grouped-query attention: query head `h` reads key/value head `h / (Hq / Hkv)`).
//! Optional `mask` (1 = masked out, 0 = visible, in the element type of `q`) and `bias`,
//! `[B or 1, Hq or 1, Sq or 1, Sk]`: dimensions of size 1 broadcast.
//!
//! The score of query `i` and key `j` is, in this order (Burn's `attention_fallback`'s):
//! `s = scale·q·k`, `s = c·tanh(s / c)` (softcap), masked keys removed, causal (bottom-right
//! aligned: `j ≤ i + Sk − Sq`) keys removed, `s += bias`. A row without a visible key gives
//! zeros and `lse = −inf`.
//!
//! [`plan_attention`] picks one kernel ([`AttentionKernel`]); all are the flash forward loops
//! of [`crate::flash`] with computed scores ([`QueryKey`](crate::flash::ScoreSource::QueryKey)):
//! - [`mma`](crate::flash::forward::mma): FlashAttention-2's schedule on the matrix units,
//!   f16/bf16 on CUDA (sm_80+) with 16-byte aligned rows;
//! - [`cmma`](crate::flash::forward::cmma): the same loop on cooperative matrices, f16/bf16
//!   where the device offers them and has no manual `mma` (Vulkan through SPIR-V, Metal);
//! - [`tiled`](crate::flash::forward::tiled): plain units, every runtime and float type, f32
//!   arithmetic, register-tiled 128 × 128 outputs per cube (outputs of at least 65 × 65);
//! - [`units`](crate::flash::forward::units): plain units for the rest (and where 256 units or
//!   the tiled kernel's shared memory are missing);
//! - [`hopper`](crate::flash::forward::hopper) on sm_90 and [`crate::decode`] for few query
//!   rows against long contexts ([`AttentionKernel`]).
//!
//! Files: [`options`] (the problem: what a call takes, its plans and errors, and their
//! checks; a leaf), [`plan`] (the heuristic and the tiles), [`launch`] (the forward's launch),
//! [`backward`] (the backward's plan and launch).

pub mod backward;
pub mod launch;
pub mod options;
pub mod plan;

pub use backward::{
    AttentionBackwardKernel, AttentionBackwardPlan, BackwardLaunch, ampere_reason,
    launch_attention_backward, plan_attention_backward, plan_attention_backward_writing,
    recent_backward_launches,
};
pub use launch::launch_attention;
pub use options::{
    AmpereTile, AmpereUse, AttentionDims, AttentionError, AttentionFeatures, AttentionKernel,
    AttentionOptions, AttentionPlan, BackwardOverlap, BackwardTensors, DecodeSchedule, HopperUse,
    MAX_HEAD_DIM, TileSchedule, attention_dims, bias_row_tiles, bias_tiles, check_seqs,
    rows_aligned, starts_aligned, validate,
};
pub(crate) use plan::sm90;
pub use plan::{cmma_tile, mma_tile, plan_attention, units_tile};
