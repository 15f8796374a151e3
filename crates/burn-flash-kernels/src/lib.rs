//! CubeCL kernels of burn-flash, usable without Burn: device code plus host launch functions
//! that take a cubecl `ComputeClient` and device buffers.
//!
//! - [`softmax`]: fused row softmax, log-softmax and quiet softmax (forward and backward);
//! - [`softmax_matmul`]: `softmax(X)·V` without the softmax matrix (forward and backward);
//! - [`attention`]: fused attention forward (`Q·Kᵀ` → scale/softcap/mask/bias/causal → online
//!   softmax → `·V`), the scores never written;
//! - [`flash`]: the flash kernels both ops run, forward and backward, with the scores given
//!   (`softmax_matmul`) or computed as `Q·Kᵀ` (`attention`);
//! - [`tensor`]: what every launch takes ([`tensor::TensorRef`]) and checks first (the dtype);
//! - [`cache`]: the compilation cache burn-flash turns on (where it lives, how to clear it);
//! - [`norm`]: layer normalisation of rows in one kernel;
//! - [`copy`]: a vectorised copy, the bandwidth ceiling benchmarks compare against;
//! - `hopper` (feature `cuda`): hand-written CUDA for sm_90 launched through cubecl's client
//!   (issue 35; so far the door: a TMA bulk copy completed on an `mbarrier`);
//! - [`fragment`], [`staging`]: pieces shared by the matrix-unit kernels (`mma` fragment
//!   helpers, `cp.async` double buffering); [`tiling`]: the register-tiled product of the
//!   plain-unit kernels.

pub mod attention;
pub mod cache;
pub mod decode;
pub mod flash;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod reduce;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda_target;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod dropout;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod fragment;
#[cfg(feature = "cuda")]
pub mod hopper;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod linear;
pub mod mutation;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod norm;
pub mod occupancy;
// `#[cube]` expands every function into undocumented helper items.
pub mod softmax;
pub mod softmax_matmul;
#[allow(missing_docs)]
pub mod staging;
pub mod tensor;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod tiling;
