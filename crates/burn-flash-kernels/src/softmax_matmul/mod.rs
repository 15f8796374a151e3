//! `softmax(X)·V` without ever writing the softmax matrix: forward (online softmax, plus the
//! row log-sum-exp the backward needs) and backward (`dX`, `dV` from the saved log-sum-exp).
//!
//! Tensors are 3-D, `[batch, rows, cols]`: `x` is `[batch, d1, d2]`, `v` is `[batch, d2, d3]`
//! or `[1, d2, d3]` (one `V` shared by every batch), the output `[batch, d1, d3]` and the
//! log-sum-exp `[batch, d1]` in f32. Any strides.
//!
//! [`plan_softmax_matmul`] picks one forward kernel ([`SmmForwardKernel`]) once; the launch
//! matches on it once. The forward is the flash loop of [`crate::flash`] with **given scores**
//! ([`crate::flash::ScoreSource::Given`]) — the loop attention runs with scores computed as `Q·Kᵀ` — on two
//! inner-product paths ([`SmmPath`]):
//! - matrix units (f32 accumulators), f16/bf16 on CUDA with 16-byte aligned rows: on Hopper
//!   GPUs (sm_90) the hand-written attention forward of [`crate::flash::forward::hopper`] with
//!   given scores (TMA, `wgmma`; starts on 16 bytes too), elsewhere `mma` m16n8k16
//!   ([`crate::flash::forward::mma`]);
//! - plain units, every runtime and float type, f32 arithmetic: [`crate::flash::forward::tiled`]
//!   (register-tiled, 128 × 128 outputs per cube) where 256 units and its shared memory fit
//!   and the output is at least 65 × 65, else [`crate::flash::forward::units`].
//!
//! The backward is the flash backward core with given scores — the kernels attention's
//! backward runs with scores computed as `Q·Kᵀ` — on the same two paths
//! ([`SmmBackwardPath`]): `dX` is the core's `dS`, `dV` its `dV`.
//!
//! f32 never runs on the matrix units: their f32 mode rounds the operands to TF32 (10-bit
//! mantissa), and a TF32 kernel measured slower than the register-tiled f32 one (RESULTS.md).
//!
//! Files: [`options`] (what a call takes, its plans and errors), [`plan`] (the heuristics),
//! [`launch`] (shape checks and launch).

pub mod launch;
pub mod options;
pub mod plan;

pub use launch::{launch_softmax_matmul, launch_softmax_matmul_backward};
pub use options::{
    BLOCK_SIZES, SmmBackwardPath, SmmBackwardPlan, SmmDims, SmmForwardKernel, SmmPath,
    SoftmaxMatmulError, SoftmaxMatmulOptions, SoftmaxMatmulPlan,
};
pub use plan::{
    P_BUFFER_MAX_D2, check_dtype, contiguous_row_vector, hopper_unavailable, mma_dx_rows,
    mma_p_buffer, plan_softmax_matmul, plan_softmax_matmul_backward,
    plan_softmax_matmul_backward_for, plan_softmax_matmul_for, row_vector,
};
