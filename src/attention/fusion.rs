//! Attention on `Fusion<B>`: one opaque custom operation (two outputs) that runs `B`'s kernel.

use core::marker::PhantomData;

use burn::backend::ir::{HandleContainer, OperationIr, OperationOutput, TensorId, TensorIr};
use burn::tensor::{
    DType, Shape,
    ops::{BoolTensor, FloatTensor},
};
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime,
    stream::{Operation, OperationStreams},
};

use super::FlashAttentionOptions;
use crate::FlashBackend;
use crate::softmax::fusion::custom_op;

#[derive(Debug)]
struct ForwardOp<B> {
    /// `query`, `key`, `value`, then the mask and the bias where given.
    inputs: Vec<TensorIr>,
    has_mask: bool,
    has_bias: bool,
    /// `out`, `lse`.
    outputs: [TensorId; 2],
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for ForwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let q = handles.get_float_tensor::<B>(&self.inputs[0]);
        let k = handles.get_float_tensor::<B>(&self.inputs[1]);
        let v = handles.get_float_tensor::<B>(&self.inputs[2]);
        let mut next = 3;
        let mask = self.has_mask.then(|| {
            next += 1;
            handles.get_bool_tensor::<B>(&self.inputs[next - 1])
        });
        let bias = self
            .has_bias
            .then(|| handles.get_float_tensor::<B>(&self.inputs[next]));
        let (o, l) = B::flash_attention(q, k, v, mask, bias, self.options);
        let [out, lse] = &self.outputs;
        handles.register_float_tensor::<B>(out, o);
        handles.register_float_tensor::<B>(lse, l);
    }
}

pub(crate) fn forward<B: FusionBackend + FlashBackend>(
    query: FloatTensor<Fusion<B>>,
    key: FloatTensor<Fusion<B>>,
    value: FloatTensor<Fusion<B>>,
    mask: Option<BoolTensor<Fusion<B>>>,
    bias: Option<FloatTensor<Fusion<B>>>,
    options: FlashAttentionOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    let client = query.client.clone();
    let (b, hq, sq) = (query.shape[0], query.shape[1], query.shape[2]);
    let dv = value.shape[3];
    let dtype = query.dtype;
    let mut tensors = vec![&query, &key, &value];
    tensors.extend(mask.as_ref());
    tensors.extend(bias.as_ref());
    let streams = OperationStreams::with_inputs(tensors);
    let out = TensorIr::uninit(
        client.create_empty_handle(),
        Shape::from([b, hq, sq, dv]),
        dtype,
    );
    let lse = TensorIr::uninit(
        client.create_empty_handle(),
        Shape::from([b, hq, sq]),
        DType::F32,
    );
    let (has_mask, has_bias) = (mask.is_some(), bias.is_some());
    let mut inputs = vec![query.into_ir(), key.into_ir(), value.into_ir()];
    inputs.extend(mask.map(|m| m.into_ir()));
    inputs.extend(bias.map(|t| t.into_ir()));
    let op = ForwardOp::<B> {
        inputs: inputs.clone(),
        has_mask,
        has_bias,
        outputs: [out.id, lse.id],
        options,
        _backend: PhantomData,
    };
    let desc = custom_op("burn_flash::attention", inputs, vec![out, lse]);
    let [out, lse] = client
        .register(streams, OperationIr::Custom(desc), op)
        .outputs();
    (out, lse)
}
