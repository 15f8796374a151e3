//! CubeCL kernels of burn-flash, usable without Burn: device code plus host launch functions
//! that take a cubecl `ComputeClient` and device buffers.
//!
//! - [`softmax`]: fused row softmax, log-softmax and quiet softmax (forward and backward);
//! - [`copy`]: a vectorised copy, the bandwidth ceiling benchmarks compare against.

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod reduce;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod copy;
pub mod softmax;
