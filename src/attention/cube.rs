//! Attention on `CubeBackend`: validate, convert the mask, allocate, launch.

use burn::tensor::{DType, FloatDType, Shape, ops::BoolTensorOps};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement,
    ops::numeric::empty_device_dtype, tensor::CubeTensor,
};
use burn_flash_kernels::attention::{
    AttentionBackwardPlan, AttentionDims, AttentionError, AttentionFeatures, AttentionOptions,
    AttentionPlan, BackwardTensors, launch_attention, launch_attention_backward, plan_attention,
    plan_attention_backward,
};
use burn_flash_kernels::tensor::TensorRef;
use cubecl::prelude::ComputeClient;

use super::{AttentionGrads, FlashAttentionOptions, OP, scale_of};

fn tensor_ref<R: CubeRuntime>(t: &CubeTensor<R>) -> TensorRef<'_> {
    TensorRef {
        handle: &t.handle,
        shape: t.meta.shape(),
        strides: t.meta.strides(),
    }
}

/// The kernels crate's options for a call with head dim `head_dim`.
pub(crate) fn kernel_options(options: FlashAttentionOptions, head_dim: usize) -> AttentionOptions {
    let module = options.module;
    AttentionOptions {
        scale: scale_of(&module, head_dim) as f32,
        softcap: module.softcap.map(|c| c as f32),
        causal: module.is_causal,
        kernel: options.kernel,
        block_k: options.block_k,
        dropout: options.dropout.and_then(|d| d.params()),
        masked_score: options.masked_score.map(|f| f as f32),
        quiet: options.quiet,
    }
}

/// Contiguous tensors of `dims`, with or without a mask and a bias.
fn features(dims: AttentionDims, mask: bool, bias: bool) -> AttentionFeatures {
    AttentionFeatures {
        aligned: dims.head_dim.is_multiple_of(8) && dims.value_dim.is_multiple_of(8),
        mask,
        bias,
    }
}

/// The plan for contiguous tensors of `dims`, without a mask or bias.
pub(crate) fn plan<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
) -> Result<AttentionPlan, AttentionError> {
    plan_attention(
        client,
        dims,
        dtype.into(),
        features(dims, false, false),
        &kernel_options(options, dims.head_dim),
    )
}

pub(crate) fn forward<R, F, I, BT>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    mask: Option<CubeTensor<R>>,
    bias: Option<CubeTensor<R>>,
    options: FlashAttentionOptions,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let dtype = query.dtype;
    // The kernels read the mask as 1 / 0 in the queries' float type.
    let mask = mask.map(|m| B::<R, F, I, BT>::bool_into_float(m, FloatDType::from(dtype)));
    let [batch, heads_q, seq_q, head_dim]: [usize; 4] = query
        .meta
        .shape()
        .to_vec()
        .try_into()
        .unwrap_or_else(|_| panic!("{OP}: `query` must be 4-D"));
    let value_dim = value.meta.shape()[3];
    let client = query.client.clone();
    let device = query.device.clone();
    let out = empty_device_dtype(
        client.clone(),
        device.clone(),
        Shape::from([batch, heads_q, seq_q, value_dim]),
        dtype,
    );
    let lse = empty_device_dtype(
        client.clone(),
        device,
        Shape::from([batch, heads_q, seq_q]),
        DType::F32,
    );
    launch_attention::<R>(
        &client,
        tensor_ref(&query),
        tensor_ref(&key),
        tensor_ref(&value),
        mask.as_ref().map(tensor_ref),
        bias.as_ref().map(tensor_ref),
        tensor_ref(&out),
        tensor_ref(&lse),
        dtype.into(),
        &kernel_options(options, head_dim),
    )
    .unwrap_or_else(|err| panic!("{OP}: {err}"));
    (out, lse)
}

/// The backward plan for contiguous tensors of `dims`.
pub(crate) fn backward_plan<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
    mask: bool,
    bias: bool,
) -> Result<AttentionBackwardPlan, AttentionError> {
    plan_attention_backward(
        client,
        dims,
        dtype.into(),
        features(dims, mask, bias),
        &kernel_options(options, dims.head_dim),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R, F, I, BT>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    mask: Option<CubeTensor<R>>,
    bias: Option<CubeTensor<R>>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_out: CubeTensor<R>,
    options: FlashAttentionOptions,
    want_ds: bool,
) -> AttentionGrads<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let dtype = query.dtype;
    let mask = mask.map(|m| B::<R, F, I, BT>::bool_into_float(m, FloatDType::from(dtype)));
    let client = query.client.clone();
    let device = query.device.clone();
    let empty = |shape: &[usize]| {
        empty_device_dtype(
            client.clone(),
            device.clone(),
            Shape::from(shape.to_vec()),
            dtype,
        )
    };
    let dq = empty(query.meta.shape());
    let dk = empty(key.meta.shape());
    let dv = empty(value.meta.shape());
    let q_shape = query.meta.shape();
    let full = [q_shape[0], q_shape[1], q_shape[2], key.meta.shape()[2]];
    let ds = want_ds.then(|| empty(&full));
    let head_dim = q_shape[3];
    launch_attention_backward::<R>(
        &client,
        BackwardTensors {
            q: tensor_ref(&query),
            k: tensor_ref(&key),
            v: tensor_ref(&value),
            mask: mask.as_ref().map(tensor_ref),
            bias: bias.as_ref().map(tensor_ref),
            out: tensor_ref(&out),
            lse: tensor_ref(&lse),
            d_out: tensor_ref(&d_out),
            dq: tensor_ref(&dq),
            dk: tensor_ref(&dk),
            dv: tensor_ref(&dv),
            ds: ds.as_ref().map(tensor_ref),
        },
        dtype.into(),
        &kernel_options(options, head_dim),
    )
    .unwrap_or_else(|err| panic!("{OP}: backward: {err}"));
    AttentionGrads { dq, dk, dv, ds }
}
