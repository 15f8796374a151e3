//! CubeCL kernels of burn-flash, usable without Burn: device code plus host launch functions
//! that take a cubecl `ComputeClient` and device buffers.
//!
//! - [`softmax`]: fused row softmax, log-softmax and quiet softmax (forward and backward);
//! - [`softmax_matmul`]: `softmax(X)·V` without the softmax matrix (forward and backward);
//! - [`attention`]: fused attention (scale, softcap, masks, bias, ALiBi, sinks, causal and
//!   sliding windows, packed sequences, dropout), forward and backward, the scores never
//!   written; `options` (the problem, a leaf), `plan`, `launch`, `backward`;
//! - [`decode`]: split-KV decoding for few query rows against long contexts, over contiguous or
//!   paged caches, and the append (with RoPE) into paged caches;
//! - [`flash`]: the flash kernels both ops run, forward and backward, with the scores given
//!   (`softmax_matmul`) or computed as `Q·Kᵀ` (`attention`), on five paths: plain units
//!   (untiled and register-tiled), the matrix units (`mma.sync`), cooperative matrices, and
//!   Hopper's hand-written `wgmma`/TMA kernels;
//! - [`dropout`]: the counter-based keep/drop draws every kernel regenerates;
//! - [`linear`], [`norm`]: a few-rows linear layer and a layer norm, one kernel each;
//! - [`tensor`]: what every launch takes ([`tensor::TensorRef`]) and checks first (the dtype);
//! - [`cache`]: the compilation cache burn-flash turns on (where it lives, how to clear it);
//! - [`copy`]: a vectorised copy, the bandwidth ceiling benchmarks compare against;
//! - `hopper` (feature `cuda`): the door for hand-written CUDA (sm_90 and up) launched through
//!   cubecl's client (`CubeTask`), and the instruction wrappers (`sm90.cuh`) of the Hopper
//!   attention and `softmax(X)·V` kernels; `cuda_target` (feature `cuda`): CUDA kernels
//!   compiled without a GPU (`cargo xtask cuda-check`);
//! - [`occupancy`]: the SM share each CUDA kernel's schedule assumes, held by the check;
//!   [`mutation`]: the deliberate bugs of the mutation check (feature `mutants`);
//! - [`fragment`], [`staging`]: pieces shared by the matrix-unit kernels (`mma` fragment
//!   helpers, `cp.async` double buffering); [`tiling`]: the register-tiled product of the
//!   plain-unit kernels; [`reduce`]: the row reductions of the softmax kernels.

/// Runs `$body` with `$cuda` bound to `$client` as the client of a CUDA-compiled runtime
/// (`hopper::with_cuda_client!`), then returns `$ret`: the launch of a plan that took a
/// hand-written kernel, which a plan takes on CUDA clients only (a panic on any other, and
/// unreachable in builds without CUDA).
macro_rules! launch_hand_written {
    ($client:expr, |$cuda:ident| $body:expr, $ret:expr) => {{
        #[cfg(feature = "cuda")]
        {
            let launched = $crate::hopper::with_cuda_client!($client, |$cuda| $body);
            assert!(
                launched.is_some(),
                "the plan takes a hand-written kernel on CUDA clients only"
            );
            return $ret;
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("the plan takes a hand-written kernel on CUDA clients only");
    }};
}
pub(crate) use launch_hand_written;

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
pub mod softmax;
pub mod softmax_matmul;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod staging;
pub mod tensor;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod tiling;
