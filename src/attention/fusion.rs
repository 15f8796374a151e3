//! Attention on `Fusion<B>`: one opaque custom operation (two outputs) that runs `B`'s kernel.

use core::marker::PhantomData;

use burn::backend::ir::{HandleContainer, OperationOutput, TensorId, TensorIr};
use burn::tensor::{
    DType, Shape,
    ops::{BoolTensor, FloatTensor},
};
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime,
    stream::{Operation, OperationStreams},
};

use super::{AttentionGrads, FlashAttentionOptions};
use crate::FlashBackend;
use crate::fusion::{custom_op, register};

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
    let [out, lse] = register(&client, streams, desc, op).outputs();
    (out, lse)
}

#[derive(Debug)]
struct BackwardOp<B> {
    /// `query`, `key`, `value`, the mask and the bias where given, `out`, `lse`, `d_out`.
    inputs: Vec<TensorIr>,
    has_mask: bool,
    has_bias: bool,
    /// `dq`, `dk`, `dv`, then `ds` where asked for.
    outputs: Vec<TensorId>,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for BackwardOp<B> {
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
        let bias = self.has_bias.then(|| {
            next += 1;
            handles.get_float_tensor::<B>(&self.inputs[next - 1])
        });
        let out = handles.get_float_tensor::<B>(&self.inputs[next]);
        let lse = handles.get_float_tensor::<B>(&self.inputs[next + 1]);
        let d_out = handles.get_float_tensor::<B>(&self.inputs[next + 2]);
        let want_ds = self.outputs.len() == 4;
        let grads = B::flash_attention_backward(
            q,
            k,
            v,
            mask,
            bias,
            out,
            lse,
            d_out,
            self.options,
            want_ds,
        );
        handles.register_float_tensor::<B>(&self.outputs[0], grads.dq);
        handles.register_float_tensor::<B>(&self.outputs[1], grads.dk);
        handles.register_float_tensor::<B>(&self.outputs[2], grads.dv);
        if let Some(ds) = grads.ds {
            handles.register_float_tensor::<B>(&self.outputs[3], ds);
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B: FusionBackend + FlashBackend>(
    query: FloatTensor<Fusion<B>>,
    key: FloatTensor<Fusion<B>>,
    value: FloatTensor<Fusion<B>>,
    mask: Option<BoolTensor<Fusion<B>>>,
    bias: Option<FloatTensor<Fusion<B>>>,
    out: FloatTensor<Fusion<B>>,
    lse: FloatTensor<Fusion<B>>,
    d_out: FloatTensor<Fusion<B>>,
    options: FlashAttentionOptions,
    want_ds: bool,
) -> AttentionGrads<Fusion<B>> {
    let client = query.client.clone();
    let dtype = query.dtype;
    let full = Shape::from([query.shape[0], query.shape[1], query.shape[2], key.shape[2]]);
    let mut tensors = vec![&query, &key, &value];
    tensors.extend(mask.as_ref());
    tensors.extend(bias.as_ref());
    tensors.extend([&out, &lse, &d_out]);
    let streams = OperationStreams::with_inputs(tensors);
    let mut outputs = vec![
        TensorIr::uninit(client.create_empty_handle(), query.shape.clone(), dtype),
        TensorIr::uninit(client.create_empty_handle(), key.shape.clone(), dtype),
        TensorIr::uninit(client.create_empty_handle(), value.shape.clone(), dtype),
    ];
    if want_ds {
        outputs.push(TensorIr::uninit(client.create_empty_handle(), full, dtype));
    }
    let (has_mask, has_bias) = (mask.is_some(), bias.is_some());
    let mut inputs = vec![query.into_ir(), key.into_ir(), value.into_ir()];
    inputs.extend(mask.map(|m| m.into_ir()));
    inputs.extend(bias.map(|t| t.into_ir()));
    inputs.extend([out.into_ir(), lse.into_ir(), d_out.into_ir()]);
    let op = BackwardOp::<B> {
        inputs: inputs.clone(),
        has_mask,
        has_bias,
        outputs: outputs.iter().map(|t| t.id).collect(),
        options,
        _backend: PhantomData,
    };
    let desc = custom_op("burn_flash::attention_backward", inputs, outputs);
    let mut grads = register(&client, streams, desc, op).into_iter();
    let mut next = || grads.next().expect("registered output");
    let (dq, dk, dv) = (next(), next(), next());
    AttentionGrads {
        dq,
        dk,
        dv,
        ds: want_ds.then(next),
    }
}
