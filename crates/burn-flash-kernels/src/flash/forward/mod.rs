//! The flash forward: one online-softmax loop ([`crate::flash::online`]) per inner-product
//! path, the score source a comptime choice ([`ScoreSource`]):
//! [`ScoreSource::Given`] reads a score matrix `X` from memory (`softmax(X)·V`),
//! [`ScoreSource::QueryKey`] computes `S = scale·Q·Kᵀ` on chip and never writes it
//! (attention). Everything after the scores is shared: the score rules
//! ([`crate::flash::scores`]), the update, `P·V`, the normalisation and the stores.
//! - [`mma`]: FlashAttention-2's schedule on the matrix units (f16/bf16, CUDA sm_80+);
//! - [`cmma`]: the same loop on cooperative matrices (f16/bf16 wherever cubecl's `cmma` runs:
//!   Vulkan, Metal, CUDA), `P` and the output rescale through shared memory;
//! - [`units`]: plain units, every runtime and float type, f32 arithmetic, up to 64 × 64
//!   outputs per cube;
//! - [`tiled`]: the same on plain units with a register-tiled `P·V` (128 × 128 outputs per
//!   cube, 8 × 8 per unit), for outputs of at least 65 × 65;
//! - [`hopper`]: attention only, hand-written CUDA for sm_90 (TMA, `wgmma`, warp
//!   specialisation), launched through cubecl's client on CUDA builds.
//!
//! [`ScoreSource`]: crate::flash::ScoreSource
//! [`ScoreSource::Given`]: crate::flash::ScoreSource::Given
//! [`ScoreSource::QueryKey`]: crate::flash::ScoreSource::QueryKey

// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod cmma;
pub mod hopper;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod mma;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod tiled;
// `#[cube]` expands every function into undocumented helper items.
#[allow(missing_docs)]
pub mod units;

use cubecl::{CubeCount, CubeDim, prelude::*};

use crate::flash::args::{FlashTensors, ForwardOutputsLaunch, Scalars, ScoreInputsLaunch};
use crate::flash::config::{FlashConfig, FlashKernel};

/// Launches `kernel` with configuration `c` on grid `count` of `dim` units: the one place where
/// both ops (`softmax_matmul`, attention) start a forward. The dropout of `scalars` is read
/// only by the plain-unit and matrix-unit kernels, and only when `c.rules.dropout`. `vector` is the
/// tiled kernel's vector width (the matrix-unit kernel always reads 16-byte vectors,
/// [`mma::NV8`]) and the cooperative-matrix kernel's, which runs `(plane, planes)` units of the
/// device's fragment ([`cmma::fragment`]) whatever `dim` says.
///
/// # Safety
/// The tensors' shapes and strides describe their buffers, and the kernel's conditions hold:
/// 16-byte aligned rows for the matrix units ([`mma::flash_forward_mma()`]), `vector` dividing
/// the rows and strides of `q`, `k`, `v` and `out` for the tiled and cooperative-matrix
/// kernels, a [`cmma::fragment`] for `dtype` on the device for the latter.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    kernel: FlashKernel,
    count: CubeCount,
    dim: CubeDim,
    vector: usize,
    t: FlashTensors<R>,
    scalars: Scalars,
    c: FlashConfig,
    dtype: StorageType,
) {
    let FlashTensors {
        q,
        k,
        v,
        mask,
        bias,
        slopes,
        sinks,
        seqs,
        out,
        lse,
    } = t;
    let args = scalars.arg::<R>();
    // SAFETY: the caller's (see above).
    unsafe {
        match kernel {
            FlashKernel::MatrixUnits => mma::flash_forward_mma::launch_unchecked::<R>(
                client,
                count,
                dim,
                mma::NV8,
                mma::out_vector(c),
                ScoreInputsLaunch::new(q, k, v, mask, bias, slopes, sinks, seqs),
                ForwardOutputsLaunch::new(out, lse),
                args,
                c,
                dtype,
            ),
            FlashKernel::Tiled => tiled::flash_forward_tiled::launch_unchecked::<R>(
                client,
                count,
                dim,
                vector,
                ScoreInputsLaunch::new(q, k, v, mask, bias, slopes, sinks, seqs),
                ForwardOutputsLaunch::new(out, lse),
                args,
                c,
                tiled::planes(client),
                dtype,
            ),
            FlashKernel::CooperativeMatrix => {
                let f = cmma::fragment(client, dtype, c.tf32)
                    .expect("a plan picks the cooperative matrices only where they exist");
                cmma::flash_forward_cmma::launch_unchecked::<R>(
                    client,
                    count,
                    CubeDim::new_2d(f.plane, f.planes(c.block_q)),
                    vector,
                    ScoreInputsLaunch::new(q, k, v, mask, bias, slopes, sinks, seqs),
                    ForwardOutputsLaunch::new(out, lse),
                    args,
                    c,
                    f,
                    [dtype, f.operand(dtype)],
                )
            }
            FlashKernel::Units => units::flash_forward_units::launch_unchecked::<R>(
                client,
                count,
                dim,
                ScoreInputsLaunch::new(q, k, v, mask, bias, slopes, sinks, seqs),
                ForwardOutputsLaunch::new(out, lse),
                args,
                c,
                dtype,
            ),
        }
    }
}
