//! The backend extension: the ops burn-flash adds to a Burn backend, one trait per op, each
//! next to its op ([`SoftmaxBackend`] in `softmax/backend.rs`, [`SoftmaxMatmulBackend`] in
//! `softmax_matmul/backend.rs`, [`AttentionBackend`] in `attention/backend.rs`);
//! [`FlashBackend`] is all three. What the fused kernels would launch comes from one
//! [`Planner`](crate::Planner) per device (`SoftmaxBackend::flash_planner`).
//!
//! Each trait is implemented for
//! - `CubeBackend<R, F, I, BT>` for every CubeCL runtime (one impl serves CUDA and wgpu): our
//!   kernels;
//! - `Fusion<B>`: an opaque custom operation that runs `B`'s kernels;
//! - `Autodiff<B, C>`: forward through `B`, gradients through `B`'s backward op;
//! - NdArray (feature `ndarray`): the trait's default bodies, composed from stock Burn ops
//!   (below).
//!
//! Any other backend gets the composed fallbacks with three empty impls
//! (`impl SoftmaxBackend for … {}` …).

use crate::{AttentionBackend, SoftmaxBackend, SoftmaxMatmulBackend};

/// A Burn backend with all of burn-flash's fused operations.
pub trait FlashBackend: SoftmaxBackend + SoftmaxMatmulBackend + AttentionBackend {}

impl<B: SoftmaxBackend + SoftmaxMatmulBackend + AttentionBackend> FlashBackend for B {}

/// An autodiff backend whose inner backend has burn-flash's ops.
pub trait FlashAutodiffBackend: FlashBackend + burn::tensor::backend::AutodiffBackend {}

impl<B: FlashBackend + burn::tensor::backend::AutodiffBackend> FlashAutodiffBackend for B {}

/// NdArray runs the composed fallbacks: the traits' provided bodies.
#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    use burn::backend::NdArray;
    use burn::backend::ndarray::{
        FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
    };

    macro_rules! composed {
        ($($op:ident),*) => {$(
            impl<E, I, Q> $op for NdArray<E, I, Q>
            where
                E: FloatNdArrayElement,
                I: IntNdArrayElement,
                Q: QuantElement,
                NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
            {
            }
        )*};
    }

    composed!(SoftmaxBackend, SoftmaxMatmulBackend, AttentionBackend);
}
