//! The flash kernels of both ops, forward and backward, written once for both score sources
//! ([`ScoreSource`]): scores given as a matrix `X` (`softmax(X)·V`, the `softmax_matmul` op)
//! or computed as `S = scale·Q·Kᵀ` on chip (attention).
//!
//! The forward ([`forward`]) is the online softmax ([`online`]): `softmax(S)·V` over the
//! columns of `S` in steps, never holding a whole row of `S`. The backward ([`backward`])
//! rebuilds `P` block by block from the forward's log-sum-exp. Both see the same keys per row
//! ([`keys`]: causal, window, packed sequences), apply the same score rules ([`scores`]:
//! scale, softcap, mask, bias, ALiBi), address their cube's share of the problem
//! the same way ([`block`]) and take the same argument bundles ([`args`]); a plan hands each
//! kernel its comptime [`FlashConfig`] ([`config`]).
//!
//! Each direction has one schedule per inner-product path: plain units (every runtime and float
//! type, f32 arithmetic: `units`, and the register-tiled `tiled` / `units_given`), the matrix
//! units (`mma`: `mma.sync` m16n8k16, f16/bf16 on CUDA sm_80+), cooperative matrices (`cmma`:
//! cubecl's `cmma`, Vulkan through SPIR-V, Metal), and on Hopper the hand-written `wgmma`/TMA
//! kernels (`hopper`, `hopper_given`: CUDA C++ through `crate::hopper`'s door, feature
//! `cuda`).

// `#[derive(CubeLaunch)]` expands every bundle into undocumented launch items.
#[allow(missing_docs)]
pub mod args;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod backward;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod block;
pub mod config;
pub mod forward;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod keys;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod online;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod scores;

pub use args::{BackwardOperands, FlashTensors, Operand, Scalars};
pub use config::{BackwardKernel, FlashConfig, FlashKernel, ScoreRules, ScoreSource, Tile};
