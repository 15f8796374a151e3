//! CubeCL kernels of burn-flash, usable without Burn: device code plus host launch functions
//! that take a cubecl `ComputeClient` and device buffers.
//!
//! - [`softmax`]: fused row softmax, log-softmax and quiet softmax (forward and backward);
//! - [`softmax_matmul`]: `softmax(X)·V` without the softmax matrix (forward and backward);
//! - [`copy`]: a vectorised copy, the bandwidth ceiling benchmarks compare against.

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod reduce;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod copy;
pub mod softmax;
pub mod softmax_matmul;
