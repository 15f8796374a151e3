//! [`SoftmaxMatmulBackend`](crate::SoftmaxMatmulBackend): the fused `softmax(X)·V` as a Burn
//! backend extension, and its implementations for CubeCL backends (fused kernels), `Fusion`
//! and `Autodiff` ([`crate::FlashBackend`] lists the backends).

use burn::backend::{Autodiff, autodiff::checkpoint::strategy::CheckpointStrategy};
use burn::tensor::{backend::Backend, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_flash_kernels::softmax_matmul::SoftmaxMatmulOptions;
use burn_fusion::{Fusion, FusionBackend};

use super::{autodiff, cube, fusion};
use crate::FlashBackend;

/// The methods an implementation passes on, written once (the trait's provided bodies are
/// written with it too). `ops: m::<G, …>` forwards the ops to `m::forward` and `m::backward`
/// (`m`: `composed`, `cube`, `fusion`, `autodiff`) with the generic arguments `G, …`. Its plan
/// is [`crate::planner::Planner::softmax_matmul`].
macro_rules! delegate {
    (ops: $m:ident::<$($g:ty),+>) => {
        /// `(softmax(x)·v, logsumexp(x))` for `x` of shape `[batch, d1, d2]` and `v` of shape
        /// `[batch or 1, d2, d3]`; the log-sum-exp (`[batch, d1]`) is what the backward needs.
        fn flash_softmax_matmul(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            options: SoftmaxMatmulOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            $m::forward::<$($g),+>(x, v, options)
        }

        /// Gradients `(dx, dv)` of [`SoftmaxMatmulBackend::flash_softmax_matmul`] from its
        /// inputs, its outputs and the output gradient `d_out`, with the forward's `options`.
        fn flash_softmax_matmul_backward(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
            options: SoftmaxMatmulOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            $m::backward::<$($g),+>(x, v, out, lse, d_out, options)
        }
    };
}

/// The provided bodies: the reference ops from stock Burn ops.
mod composed {
    use super::*;

    pub(super) fn forward<B: Backend>(
        x: FloatTensor<B>,
        v: FloatTensor<B>,
        _: SoftmaxMatmulOptions,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        crate::softmax_matmul::reference::forward::<B>(x, v)
    }

    pub(super) fn backward<B: Backend>(
        x: FloatTensor<B>,
        v: FloatTensor<B>,
        _out: FloatTensor<B>,
        _lse: FloatTensor<B>,
        d_out: FloatTensor<B>,
        _: SoftmaxMatmulOptions,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        crate::softmax_matmul::reference::backward::<B>(x, v, d_out)
    }
}

/// The fused `softmax(X)·V` ([`crate::softmax_matmul()`]); provided bodies as
/// [`SoftmaxBackend`](crate::SoftmaxBackend)'s.
pub trait SoftmaxMatmulBackend: Backend {
    delegate!(ops: composed::<Self>);
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> SoftmaxMatmulBackend
    for CubeBackend<R, F, I, BT>
{
    delegate!(ops: cube::<R>);
}

impl<B: FusionBackend + FlashBackend> SoftmaxMatmulBackend for Fusion<B> {
    delegate!(ops: fusion::<B>);
}

impl<B: FlashBackend, C: CheckpointStrategy> SoftmaxMatmulBackend for Autodiff<B, C> {
    delegate!(ops: autodiff::<B, C>);
}
