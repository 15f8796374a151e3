//! [`SoftmaxBackend`](crate::SoftmaxBackend): the softmax family as a Burn backend extension,
//! and its implementations for CubeCL backends (fused kernels), `Fusion` and `Autodiff`
//! ([`crate::FlashBackend`] lists the backends).

use burn::backend::{Autodiff, autodiff::checkpoint::strategy::CheckpointStrategy};
use burn::tensor::{backend::Backend, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_flash_kernels::softmax::{SoftmaxOptions, SoftmaxVariant};
use burn_fusion::{Fusion, FusionBackend};

use super::{autodiff, cube, fusion};
use crate::FlashBackend;
use crate::planner::{CubePlanner, Planner};

/// The methods an implementation passes on, written once (the trait's provided bodies are
/// written with it too). `ops: m::<G, …>` forwards the ops to `m::forward` and `m::backward`
/// (`m`: `composed`, `cube`, `fusion`, `autodiff`) with the generic arguments `G, …`; `layers:
/// m::<G, …>` the layer norm and the linear layer to `crate::norm::m` and `crate::linear::m`;
/// `planning: B` hands out a wrapper's (`Fusion`, `Autodiff`) inner backend `B`'s planner.
macro_rules! delegate {
    (ops: $m:ident::<$($g:ty),+>) => {
        /// Softmax family along `dim` of a float tensor of any rank.
        fn flash_softmax(
            x: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            $m::forward::<$($g),+>(x, dim, variant, options)
        }

        /// Gradient of [`SoftmaxBackend::flash_softmax`] from its output `y` and the output
        /// gradient `dy`.
        fn flash_softmax_backward(
            y: FloatTensor<Self>,
            dy: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            $m::backward::<$($g),+>(y, dy, dim, variant, options)
        }
    };
    (layers: $m:ident::<$($g:ty),+>) => {
        /// Layer normalisation over the last dimension ([`crate::layer_norm`]): Burn's
        /// composed `layer_norm` by default, one kernel on CubeCL backends. Arguments are
        /// checked by the caller.
        fn flash_layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: Option<FloatTensor<Self>>,
            epsilon: f64,
        ) -> FloatTensor<Self> {
            crate::norm::$m::<$($g),+>(x, gamma, beta, epsilon)
        }

        /// `x·w + bias` for `x` `[M, K]`, `w` `[K, N]`, `bias` `[N]` ([`crate::linear`]):
        /// Burn's matmul and add by default, one kernel for a few rows on CubeCL backends.
        /// Arguments are checked by the caller.
        fn flash_linear(
            x: FloatTensor<Self>,
            w: FloatTensor<Self>,
            bias: Option<FloatTensor<Self>>,
        ) -> FloatTensor<Self> {
            crate::linear::$m::<$($g),+>(x, w, bias)
        }
    };
    (planning: $inner:ty) => {
        fn flash_planner(device: &Self::Device) -> Option<Box<dyn Planner>> {
            <$inner>::flash_planner(device)
        }
    };
}

/// The provided bodies: the reference ops from stock Burn ops (the options only choose among
/// fused kernels).
mod composed {
    use super::*;

    pub(super) fn forward<B: Backend>(
        x: FloatTensor<B>,
        dim: usize,
        variant: SoftmaxVariant,
        _: SoftmaxOptions,
    ) -> FloatTensor<B> {
        crate::softmax::reference::forward::<B>(x, dim, variant)
    }

    pub(super) fn backward<B: Backend>(
        y: FloatTensor<B>,
        dy: FloatTensor<B>,
        dim: usize,
        variant: SoftmaxVariant,
        _: SoftmaxOptions,
    ) -> FloatTensor<B> {
        crate::softmax::reference::backward::<B>(y, dy, dim, variant)
    }
}

/// The fused softmax family ([`crate::softmax()`] …).
///
/// The provided method bodies are the always-correct fallback made of stock Burn ops; the
/// CubeCL backends override them with fused kernels. Users call the free functions, not these.
pub trait SoftmaxBackend: Backend {
    delegate!(ops: composed::<Self>);
    delegate!(layers: composed::<Self>);

    /// The planner of the fused kernels on `device` ([`Planner`]; `None`: this backend has
    /// no fused kernel and runs the composed fallbacks).
    fn flash_planner(device: &Self::Device) -> Option<Box<dyn Planner>> {
        let _ = device;
        None
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> SoftmaxBackend
    for CubeBackend<R, F, I, BT>
{
    delegate!(ops: cube::<R>);
    delegate!(layers: cube::<R, F, I, BT>);

    fn flash_planner(device: &Self::Device) -> Option<Box<dyn Planner>> {
        Some(Box::new(CubePlanner::<R>::new(device)))
    }
}

impl<B: FusionBackend + FlashBackend> SoftmaxBackend for Fusion<B> {
    delegate!(ops: fusion::<B>);
    delegate!(layers: fusion::<B>);
    delegate!(planning: B);
}

impl<B: FlashBackend, C: CheckpointStrategy> SoftmaxBackend for Autodiff<B, C> {
    delegate!(ops: autodiff::<B, C>);
    delegate!(planning: B);
}
