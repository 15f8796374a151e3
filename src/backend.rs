//! The backend extension: the ops burn-flash adds to a Burn backend, one trait per op
//! ([`SoftmaxBackend`], [`SoftmaxMatmulBackend`], [`AttentionBackend`]); [`FlashBackend`] is
//! all three.
//!
//! Each trait is implemented for
//! - `CubeBackend<R, F, I, BT>` for every CubeCL runtime (one impl serves CUDA and wgpu): our
//!   kernels;
//! - `Fusion<B>`: an opaque custom operation that runs `B`'s kernels;
//! - `Autodiff<B, C>`: forward through `B`, gradients through `B`'s backward op;
//! - NdArray (feature `ndarray`): the trait's default bodies, composed from stock Burn ops.
//!
//! Any other backend gets the composed fallbacks with three empty impls
//! (`impl SoftmaxBackend for … {}` …).

use burn::tensor::{
    DType,
    backend::Backend,
    ops::{BoolTensor, FloatTensor},
};
use burn_flash_kernels::attention::{
    AttentionBackwardPlan, AttentionDims, AttentionError, AttentionPlan,
};
use burn_flash_kernels::softmax::{
    RowLimits, SoftmaxError, SoftmaxOptions, SoftmaxPlan, SoftmaxVariant,
};

use burn_flash_kernels::softmax_matmul::{
    SmmDims, SoftmaxMatmulError, SoftmaxMatmulOptions, SoftmaxMatmulPlan,
};

use crate::attention::{self, AttentionGrads, FlashAttentionOptions};
use crate::{softmax, softmax_matmul};

/// A Burn backend with all of burn-flash's fused operations.
pub trait FlashBackend: SoftmaxBackend + SoftmaxMatmulBackend + AttentionBackend {}

impl<B: SoftmaxBackend + SoftmaxMatmulBackend + AttentionBackend> FlashBackend for B {}

/// The fused softmax family ([`crate::softmax()`] …).
///
/// The provided method bodies are the always-correct fallback made of stock Burn ops; the
/// CubeCL backends override them with fused kernels. Users call the free functions, not these.
pub trait SoftmaxBackend: Backend {
    /// Softmax family along `dim` of a float tensor of any rank.
    fn flash_softmax(
        x: FloatTensor<Self>,
        dim: usize,
        variant: SoftmaxVariant,
        options: SoftmaxOptions,
    ) -> FloatTensor<Self> {
        let _ = options;
        softmax::reference::forward::<Self>(x, dim, variant)
    }

    /// Gradient of [`SoftmaxBackend::flash_softmax`] from its output `y` and the output gradient
    /// `dy`.
    fn flash_softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dim: usize,
        variant: SoftmaxVariant,
        options: SoftmaxOptions,
    ) -> FloatTensor<Self> {
        let _ = options;
        softmax::reference::backward::<Self>(y, dy, dim, variant)
    }

    /// The launch the fused softmax (or its `backward`) would make for tensors of `shape` and
    /// `strides` (`None`: this backend has no fused kernel and uses the composed fallback).
    fn flash_softmax_plan(
        device: &Self::Device,
        shape: &[usize],
        strides: &[usize],
        dim: usize,
        dtype: DType,
        backward: bool,
        options: SoftmaxOptions,
    ) -> Option<Result<SoftmaxPlan, SoftmaxError>> {
        let _ = (device, shape, strides, dim, dtype, backward, options);
        None
    }

    /// Longest rows of the register tiers on `device` (`None` without fused kernels).
    fn flash_softmax_row_limits(
        device: &Self::Device,
        dtype: DType,
        options: SoftmaxOptions,
    ) -> Option<Result<RowLimits, SoftmaxError>> {
        let _ = (device, dtype, options);
        None
    }
}

/// The fused `softmax(X)·V` ([`crate::softmax_matmul()`]); provided bodies as
/// [`SoftmaxBackend`]'s.
pub trait SoftmaxMatmulBackend: Backend {
    /// `(softmax(x)·v, logsumexp(x))` for `x` of shape `[batch, d1, d2]` and `v` of shape
    /// `[batch or 1, d2, d3]`; the log-sum-exp (`[batch, d1]`) is what the backward needs.
    fn flash_softmax_matmul(
        x: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: SoftmaxMatmulOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _ = options;
        softmax_matmul::reference::forward::<Self>(x, v)
    }

    /// Gradients `(dx, dv)` of [`SoftmaxMatmulBackend::flash_softmax_matmul`] from its inputs, its
    /// outputs and the output gradient `d_out`.
    fn flash_softmax_matmul_backward(
        x: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _ = (out, lse);
        softmax_matmul::reference::backward::<Self>(x, v, d_out)
    }

    /// The forward launch the fused `softmax(X)·V` would make (`None`: composed fallback).
    fn flash_softmax_matmul_plan(
        device: &Self::Device,
        dims: SmmDims,
        dtype: DType,
        options: SoftmaxMatmulOptions,
    ) -> Option<Result<SoftmaxMatmulPlan, SoftmaxMatmulError>> {
        let _ = (device, dims, dtype, options);
        None
    }
}

/// Fused attention ([`crate::attention()`]); provided bodies as [`SoftmaxBackend`]'s.
pub trait AttentionBackend: SoftmaxMatmulBackend {
    /// `(out, lse)` of attention (see [`crate::attention()`]) over `query` `[B, Hq, Sq, D]`,
    /// `key` `[B, Hkv, Sk, D]`, `value` `[B, Hkv, Sk, Dv]`, with `mask`/`bias` broadcasting
    /// to `[B, Hq, Sq, Sk]`; `lse` (`[B, Hq, Sq]`, f32) is the row log-sum-exp of the scores.
    /// Arguments are checked by the caller.
    fn flash_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::composed::forward::<Self>(query, key, value, mask, bias, options)
    }

    /// Gradients of [`AttentionBackend::flash_attention`] (same arguments and options) from
    /// its output `out`, its `lse` and the output gradient `d_out`; the score gradient `ds`
    /// only when `want_ds` (a tracked bias). Arguments are checked by the caller.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
        want_ds: bool,
    ) -> AttentionGrads<Self> {
        attention::composed::backward::<Self>(
            query, key, value, mask, bias, out, lse, d_out, options, want_ds,
        )
    }

    /// The launch the fused attention backward would make for contiguous tensors, with or
    /// without a `mask` and a `bias` (`None`: composed fallback).
    fn flash_attention_backward_plan(
        device: &Self::Device,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        mask: bool,
        bias: bool,
    ) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
        let _ = (device, dims, dtype, options, mask, bias);
        None
    }

    /// The launch the fused attention would make for contiguous tensors (`None`: this backend
    /// uses the composed fallback).
    fn flash_attention_plan(
        device: &Self::Device,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
    ) -> Option<Result<AttentionPlan, AttentionError>> {
        let _ = (device, dims, dtype, options);
        None
    }
}

/// The softmax planning methods pass through wrappers (`Fusion`, `Autodiff`) unchanged.
macro_rules! softmax_planning {
    ($inner:ty) => {
        fn flash_softmax_plan(
            device: &Self::Device,
            shape: &[usize],
            strides: &[usize],
            dim: usize,
            dtype: DType,
            backward: bool,
            options: SoftmaxOptions,
        ) -> Option<Result<SoftmaxPlan, SoftmaxError>> {
            <$inner>::flash_softmax_plan(device, shape, strides, dim, dtype, backward, options)
        }

        fn flash_softmax_row_limits(
            device: &Self::Device,
            dtype: DType,
            options: SoftmaxOptions,
        ) -> Option<Result<RowLimits, SoftmaxError>> {
            <$inner>::flash_softmax_row_limits(device, dtype, options)
        }
    };
}

/// The `softmax(X)·V` planning method passes through wrappers unchanged.
macro_rules! softmax_matmul_planning {
    ($inner:ty) => {
        fn flash_softmax_matmul_plan(
            device: &Self::Device,
            dims: SmmDims,
            dtype: DType,
            options: SoftmaxMatmulOptions,
        ) -> Option<Result<SoftmaxMatmulPlan, SoftmaxMatmulError>> {
            <$inner>::flash_softmax_matmul_plan(device, dims, dtype, options)
        }
    };
}

/// The attention planning methods pass through wrappers unchanged.
macro_rules! attention_planning {
    ($inner:ty) => {
        fn flash_attention_plan(
            device: &Self::Device,
            dims: AttentionDims,
            dtype: DType,
            options: FlashAttentionOptions,
        ) -> Option<Result<AttentionPlan, AttentionError>> {
            <$inner>::flash_attention_plan(device, dims, dtype, options)
        }

        fn flash_attention_backward_plan(
            device: &Self::Device,
            dims: AttentionDims,
            dtype: DType,
            options: FlashAttentionOptions,
            mask: bool,
            bias: bool,
        ) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
            <$inner>::flash_attention_backward_plan(device, dims, dtype, options, mask, bias)
        }
    };
}

/// An autodiff backend whose inner backend has burn-flash's ops.
pub trait FlashAutodiffBackend: FlashBackend + burn::tensor::backend::AutodiffBackend {}

impl<B: FlashBackend + burn::tensor::backend::AutodiffBackend> FlashAutodiffBackend for B {}

mod cube {
    use super::*;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

    impl<R, F, I, BT> SoftmaxBackend for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn flash_softmax(
            x: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            softmax::cube::forward(x, dim, variant, options)
        }

        fn flash_softmax_backward(
            y: FloatTensor<Self>,
            dy: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            softmax::cube::backward(y, dy, dim, variant, options)
        }

        fn flash_softmax_plan(
            device: &Self::Device,
            shape: &[usize],
            strides: &[usize],
            dim: usize,
            dtype: DType,
            backward: bool,
            options: SoftmaxOptions,
        ) -> Option<Result<SoftmaxPlan, SoftmaxError>> {
            let client = R::client(device);
            // What the op does with a non-contiguous softmax dim and few rows: relay out first.
            let relaid;
            let strides = if softmax::cube::relayout_first(shape, strides, dim, &options) {
                relaid = softmax::cube::dim_last_strides(shape, dim);
                &relaid[..]
            } else {
                strides
            };
            let tensors: &[&[usize]] = if backward {
                &[strides, strides, strides]
            } else {
                &[strides, strides]
            };
            Some(burn_flash_kernels::softmax::plan_softmax(
                &client,
                shape,
                tensors,
                dim,
                dtype.into(),
                SoftmaxVariant::Softmax,
                options,
            ))
        }

        fn flash_softmax_row_limits(
            device: &Self::Device,
            dtype: DType,
            options: SoftmaxOptions,
        ) -> Option<Result<RowLimits, SoftmaxError>> {
            let client = R::client(device);
            Some(burn_flash_kernels::softmax::row_limits(
                &client,
                dtype.into(),
                options,
            ))
        }
    }

    impl<R, F, I, BT> SoftmaxMatmulBackend for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn flash_softmax_matmul(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            options: SoftmaxMatmulOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            softmax_matmul::cube::forward(x, v, options)
        }

        fn flash_softmax_matmul_backward(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            softmax_matmul::cube::backward(x, v, out, lse, d_out)
        }

        fn flash_softmax_matmul_plan(
            device: &Self::Device,
            dims: SmmDims,
            dtype: DType,
            options: SoftmaxMatmulOptions,
        ) -> Option<Result<SoftmaxMatmulPlan, SoftmaxMatmulError>> {
            use burn_flash_kernels::softmax_matmul::{contiguous_row_vector, plan_softmax_matmul};
            let client = R::client(device);
            let dtype = dtype.into();
            // Contiguous tensors: the layout Burn gives new tensors.
            let vector = contiguous_row_vector(dims, dtype);
            Some(plan_softmax_matmul(&client, dims, dtype, vector, options))
        }
    }

    impl<R, F, I, BT> AttentionBackend for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn flash_attention(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            mask: Option<BoolTensor<Self>>,
            bias: Option<FloatTensor<Self>>,
            options: FlashAttentionOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            attention::cube::forward::<R, F, I, BT>(query, key, value, mask, bias, options)
        }

        fn flash_attention_backward(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            mask: Option<BoolTensor<Self>>,
            bias: Option<FloatTensor<Self>>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
            options: FlashAttentionOptions,
            want_ds: bool,
        ) -> AttentionGrads<Self> {
            attention::cube::backward::<R, F, I, BT>(
                query, key, value, mask, bias, out, lse, d_out, options, want_ds,
            )
        }

        fn flash_attention_backward_plan(
            device: &Self::Device,
            dims: AttentionDims,
            dtype: DType,
            options: FlashAttentionOptions,
            mask: bool,
            bias: bool,
        ) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
            let client = R::client(device);
            Some(attention::cube::backward_plan(
                &client, dims, dtype, options, mask, bias,
            ))
        }

        fn flash_attention_plan(
            device: &Self::Device,
            dims: AttentionDims,
            dtype: DType,
            options: FlashAttentionOptions,
        ) -> Option<Result<AttentionPlan, AttentionError>> {
            let client = R::client(device);
            Some(attention::cube::plan(&client, dims, dtype, options))
        }
    }
}

mod fusion {
    use super::*;
    use burn_fusion::{Fusion, FusionBackend};

    impl<B: FusionBackend + FlashBackend> SoftmaxBackend for Fusion<B> {
        fn flash_softmax(
            x: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            softmax::fusion::forward::<B>(x, dim, variant, options)
        }

        fn flash_softmax_backward(
            y: FloatTensor<Self>,
            dy: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            softmax::fusion::backward::<B>(y, dy, dim, variant, options)
        }

        softmax_planning!(B);
    }

    impl<B: FusionBackend + FlashBackend> SoftmaxMatmulBackend for Fusion<B> {
        fn flash_softmax_matmul(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            options: SoftmaxMatmulOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            softmax_matmul::fusion::forward::<B>(x, v, options)
        }

        fn flash_softmax_matmul_backward(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            softmax_matmul::fusion::backward::<B>(x, v, out, lse, d_out)
        }

        softmax_matmul_planning!(B);
    }

    impl<B: FusionBackend + FlashBackend> AttentionBackend for Fusion<B> {
        fn flash_attention(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            mask: Option<BoolTensor<Self>>,
            bias: Option<FloatTensor<Self>>,
            options: FlashAttentionOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            attention::fusion::forward::<B>(query, key, value, mask, bias, options)
        }

        fn flash_attention_backward(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            mask: Option<BoolTensor<Self>>,
            bias: Option<FloatTensor<Self>>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
            options: FlashAttentionOptions,
            want_ds: bool,
        ) -> AttentionGrads<Self> {
            attention::fusion::backward::<B>(
                query, key, value, mask, bias, out, lse, d_out, options, want_ds,
            )
        }

        attention_planning!(B);
    }
}

mod autodiff {
    use super::*;
    use burn::backend::{Autodiff, autodiff::checkpoint::strategy::CheckpointStrategy};

    impl<B: FlashBackend, C: CheckpointStrategy> SoftmaxBackend for Autodiff<B, C> {
        fn flash_softmax(
            x: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            softmax::autodiff::forward::<B, C>(x, dim, variant, options)
        }

        fn flash_softmax_backward(
            y: FloatTensor<Self>,
            dy: FloatTensor<Self>,
            dim: usize,
            variant: SoftmaxVariant,
            options: SoftmaxOptions,
        ) -> FloatTensor<Self> {
            softmax::autodiff::backward::<B, C>(y, dy, dim, variant, options)
        }

        softmax_planning!(B);
    }

    impl<B: FlashBackend, C: CheckpointStrategy> SoftmaxMatmulBackend for Autodiff<B, C> {
        fn flash_softmax_matmul(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            options: SoftmaxMatmulOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            softmax_matmul::autodiff::forward::<B, C>(x, v, options)
        }

        fn flash_softmax_matmul_backward(
            x: FloatTensor<Self>,
            v: FloatTensor<Self>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            softmax_matmul::autodiff::backward::<B, C>(x, v, out, lse, d_out)
        }

        softmax_matmul_planning!(B);
    }

    /// The forward runs `B`'s attention and keeps its inputs, output and `lse`; the backward
    /// runs `B`'s attention backward (fused kernels on CubeCL backends, the composed gradient
    /// on the fallback).
    impl<B: FlashBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
        fn flash_attention(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            mask: Option<BoolTensor<Self>>,
            bias: Option<FloatTensor<Self>>,
            options: FlashAttentionOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            attention::autodiff::forward::<B, C>(query, key, value, mask, bias, options)
        }

        attention_planning!(B);
    }
}

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
