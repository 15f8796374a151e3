//! What the fused kernels would launch, without tensors: one [`Planner`] per device.
//!
//! A backend with fused kernels (every CubeCL backend) hands out a planner for a device
//! ([`SoftmaxBackend::flash_planner`](crate::SoftmaxBackend::flash_planner)); `Fusion` and
//! `Autodiff` hand out their inner backend's, and a backend without fused kernels none (the
//! composed fallbacks run). The ops ask it before recording or launching (a forced option the
//! device cannot run is refused before any kernel), and the free functions
//! ([`crate::softmax_plan`], [`crate::softmax_matmul_plan`], [`crate::attention_plan`] …) pass
//! its answers to users. A new op's plan is one method here and one in [`CubePlanner`]; the
//! backend traits and their wrappers do not change.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_flash_kernels::attention::{
    AttentionBackwardPlan, AttentionDims, AttentionError, AttentionPlan,
};
use burn_flash_kernels::softmax::{
    RowLimits, SoftmaxError, SoftmaxOptions, SoftmaxPlan, SoftmaxVariant,
};
use burn_flash_kernels::softmax_matmul::{
    SmmDims, SoftmaxMatmulError, SoftmaxMatmulOptions, SoftmaxMatmulPlan, contiguous_row_vector,
    plan_softmax_matmul,
};
use cubecl::prelude::ComputeClient;

use crate::{FlashAttentionOptions, ScoreTerms};

/// The plans of the fused ops on one device. Every method answers what the op would launch for
/// the given sizes (contiguous tensors unless strides are given), or why it cannot.
pub trait Planner {
    /// The softmax family's launch (or its `backward`) along `dim` of tensors of `shape` and
    /// `strides` (the input's; the outputs are made alike).
    fn softmax(
        &self,
        shape: &[usize],
        strides: &[usize],
        dim: usize,
        dtype: DType,
        backward: bool,
        options: SoftmaxOptions,
    ) -> Result<SoftmaxPlan, SoftmaxError>;

    /// The longest rows each register tier of the softmax family takes.
    fn softmax_row_limits(
        &self,
        dtype: DType,
        options: SoftmaxOptions,
    ) -> Result<RowLimits, SoftmaxError>;

    /// The forward launch of `softmax(X)·V` of `dims`.
    fn softmax_matmul(
        &self,
        dims: SmmDims,
        dtype: DType,
        options: SoftmaxMatmulOptions,
    ) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError>;

    /// The attention forward's launch for `dims` with the score terms `terms`.
    fn attention(
        &self,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Result<AttentionPlan, AttentionError>;

    /// The attention backward's launch for `dims` with the score terms `terms` (a tracked
    /// bias's `dS` written where `terms.bias_tracked`).
    fn attention_backward(
        &self,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Result<AttentionBackwardPlan, AttentionError>;
}

/// The planner of a CubeCL runtime's device: the kernels crate's planners on its client.
pub(crate) struct CubePlanner<R: CubeRuntime> {
    client: ComputeClient<R>,
}

impl<R: CubeRuntime> CubePlanner<R> {
    /// The planner of `device`.
    pub(crate) fn new(device: &R::Device) -> Self {
        Self {
            client: R::client(device),
        }
    }
}

impl<R: CubeRuntime> Planner for CubePlanner<R> {
    fn softmax(
        &self,
        shape: &[usize],
        strides: &[usize],
        dim: usize,
        dtype: DType,
        backward: bool,
        options: SoftmaxOptions,
    ) -> Result<SoftmaxPlan, SoftmaxError> {
        // What the op does with a non-contiguous softmax dim and few rows: relay out first.
        let relaid;
        let strides = if crate::softmax::cube::relayout_first(shape, strides, dim, &options) {
            relaid = crate::softmax::cube::dim_last_strides(shape, dim);
            &relaid[..]
        } else {
            strides
        };
        let tensors: &[&[usize]] = if backward {
            &[strides, strides, strides]
        } else {
            &[strides, strides]
        };
        burn_flash_kernels::softmax::plan_softmax(
            &self.client,
            shape,
            tensors,
            dim,
            dtype.into(),
            SoftmaxVariant::Softmax,
            options,
        )
    }

    fn softmax_row_limits(
        &self,
        dtype: DType,
        options: SoftmaxOptions,
    ) -> Result<RowLimits, SoftmaxError> {
        burn_flash_kernels::softmax::row_limits(&self.client, dtype.into(), options)
    }

    fn softmax_matmul(
        &self,
        dims: SmmDims,
        dtype: DType,
        options: SoftmaxMatmulOptions,
    ) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
        let dtype = dtype.into();
        // Contiguous tensors: the layout Burn gives new tensors.
        let vector = contiguous_row_vector(dims, dtype);
        plan_softmax_matmul(&self.client, dims, dtype, vector, options)
    }

    fn attention(
        &self,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Result<AttentionPlan, AttentionError> {
        crate::attention::cube::plan(&self.client, dims, dtype, options, terms)
    }

    fn attention_backward(
        &self,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Result<AttentionBackwardPlan, AttentionError> {
        crate::attention::cube::backward_plan(&self.client, dims, dtype, options, terms)
    }
}
