//! # burn-flash
//!
//! Fused softmax-family kernels, `softmax(X)·V` and flash attention (forward and backward) for
//! [Burn](https://burn.dev), written once as CubeCL kernels and run on both the CUDA and wgpu
//! runtimes, forward and backward.
//!
//! ```no_run
//! use burn::backend::{Autodiff, Wgpu};
//! use burn::tensor::{Distribution, Tensor};
//!
//! let device = Default::default();
//! let x = Tensor::<Autodiff<Wgpu>, 3>::random([8, 128, 1000], Distribution::Default, &device)
//!     .require_grad();
//! // Same signature as `burn::tensor::activation::softmax`.
//! let y = burn_flash::softmax(x.clone(), 2);
//! let grads = (y * 2.0).sum().backward();
//! let dx = x.grad(&grads).unwrap();
//! ```
//!
//! The ops live on [`FlashBackend`], implemented for CubeCL backends (fused kernels), `Fusion`,
//! `Autodiff`, and NdArray (stock-ops fallback).

pub mod attention;
mod backend;
mod cube;
mod fusion;
mod linear;
pub mod nn;
mod norm;
mod plan_defaults;
mod planner;
pub mod softmax;
pub mod softmax_matmul;

pub use attention::backend::AttentionBackend;
pub use attention::{
    AttentionBackwardKernel, AttentionDropout, AttentionGrads, AttentionInputs, AttentionKernel,
    BlockTable, FlashAttentionOptions, HeadOperands, HeadTerms, KvCache, NewKeys, PagedAppend,
    Rope, ScoreOperands, ScoreTerms, VarlenBatch, append_attention_paged, append_paged, attention,
    attention_backward_plan, attention_backward_plan_with, attention_paged, attention_plan,
    attention_plan_with, attention_varlen, attention_with_alibi, attention_with_heads,
    attention_with_lse,
};
pub use backend::{FlashAutodiffBackend, FlashBackend};
pub use burn_flash_kernels as kernels;
pub use burn_flash_kernels::attention::{
    AmpereTile, AmpereUse, BackwardOverlap, DecodeSchedule, HopperUse, TileSchedule,
};
pub use burn_flash_kernels::softmax::{RowLimits, SoftmaxError, SoftmaxPlan};
pub use linear::linear;
pub use norm::layer_norm;
pub use plan_defaults::{PlanDefaults, plan_defaults, set_plan_defaults};
pub use planner::Planner;
pub use softmax::backend::SoftmaxBackend;
pub use softmax::{
    SoftmaxOptions, SoftmaxTier, SoftmaxVariant, log_softmax, quiet_softmax, softmax, softmax_plan,
    softmax_row_limits, softmax_with,
};
pub use softmax_matmul::backend::SoftmaxMatmulBackend;
pub use softmax_matmul::{
    SoftmaxMatmulOptions, softmax_matmul, softmax_matmul_plan, softmax_matmul_with,
};
