//! `softmax(X)·V` on `Fusion<B>`: opaque custom operations (two outputs forward, two
//! gradients backward) that run `B`'s kernels. The operation structs keep the tensors' IR they
//! need, not a second copy of the whole `CustomOpIr`.

use core::marker::PhantomData;

use burn::backend::ir::{HandleContainer, OperationOutput, TensorId, TensorIr};
use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_flash_kernels::softmax_matmul::SoftmaxMatmulOptions;
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime,
    stream::{Operation, OperationStreams},
};

use super::dims_of;
use crate::FlashBackend;
use crate::fusion::{custom_op, register};

#[derive(Debug)]
struct ForwardOp<B> {
    /// `x`, `v`.
    inputs: [TensorIr; 2],
    /// `out`, `lse`.
    outputs: [TensorId; 2],
    options: SoftmaxMatmulOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for ForwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let [x, v] = &self.inputs;
        let [out, lse] = &self.outputs;
        let x = handles.get_float_tensor::<B>(x);
        let v = handles.get_float_tensor::<B>(v);
        let (o, l) = B::flash_softmax_matmul(x, v, self.options);
        handles.register_float_tensor::<B>(out, o);
        handles.register_float_tensor::<B>(lse, l);
    }
}

#[derive(Debug)]
struct BackwardOp<B> {
    /// `x`, `v`, `out`, `lse`, `d_out`.
    inputs: [TensorIr; 5],
    /// `dx`, `dv`.
    outputs: [TensorId; 2],
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for BackwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let [x, v, out, lse, d_out] = &self.inputs;
        let [dx, dv] = &self.outputs;
        let x = handles.get_float_tensor::<B>(x);
        let v = handles.get_float_tensor::<B>(v);
        let out = handles.get_float_tensor::<B>(out);
        let lse = handles.get_float_tensor::<B>(lse);
        let d_out = handles.get_float_tensor::<B>(d_out);
        let (gx, gv) = B::flash_softmax_matmul_backward(x, v, out, lse, d_out);
        handles.register_float_tensor::<B>(dx, gx);
        handles.register_float_tensor::<B>(dv, gv);
    }
}

/// Fusion runs the op later, on its own thread, where a panic would only surface at the next
/// sync: check dtypes and the plan now. The default plan can fail too (a dtype the device
/// lacks, more cubes than it launches), and planning is cheap (~500 instructions with the
/// client lookup, measured with callgrind), so it stays here.
fn validate<B: FusionBackend + FlashBackend>(
    x: &FloatTensor<Fusion<B>>,
    v: &FloatTensor<Fusion<B>>,
    options: SoftmaxMatmulOptions,
) {
    super::check_dtypes(x.dtype, v.dtype);
    let dims = dims_of(&x.shape, &v.shape);
    let device = x.client.device().clone();
    if let Some(Err(err)) = B::flash_softmax_matmul_plan(&device, dims, x.dtype, options) {
        panic!("burn_flash::softmax_matmul: {err}");
    }
}

fn uninit<B: FusionBackend>(like: &FloatTensor<Fusion<B>>, shape: Shape, dtype: DType) -> TensorIr {
    TensorIr::uninit(like.client.create_empty_handle(), shape, dtype)
}

pub(crate) fn forward<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    v: FloatTensor<Fusion<B>>,
    options: SoftmaxMatmulOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    validate::<B>(&x, &v, options);
    let dims = dims_of(&x.shape, &v.shape);
    let client = x.client.clone();
    let streams = OperationStreams::with_inputs([&x, &v]);
    let out = uninit::<B>(&x, Shape::from([dims.batch, dims.d1, dims.d3]), x.dtype);
    let lse = uninit::<B>(&x, Shape::from([dims.batch, dims.d1]), DType::F32);
    let inputs = [x.into_ir(), v.into_ir()];
    let op = ForwardOp::<B> {
        inputs: inputs.clone(),
        outputs: [out.id, lse.id],
        options,
        _backend: PhantomData,
    };
    let desc = custom_op("burn_flash::softmax_matmul", inputs.into(), vec![out, lse]);
    let [out, lse] = register(&client, streams, desc, op).outputs();
    (out, lse)
}

pub(crate) fn backward<B: FusionBackend + FlashBackend>(
    x: FloatTensor<Fusion<B>>,
    v: FloatTensor<Fusion<B>>,
    out: FloatTensor<Fusion<B>>,
    lse: FloatTensor<Fusion<B>>,
    d_out: FloatTensor<Fusion<B>>,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    validate::<B>(&x, &v, SoftmaxMatmulOptions::default());
    if d_out.dtype != x.dtype || d_out.shape != out.shape {
        panic!(
            "burn_flash::softmax_matmul backward: `grad` is {:?} {:?}, the output {:?} {:?}",
            d_out.dtype, d_out.shape, out.dtype, out.shape
        );
    }
    let client = x.client.clone();
    let streams = OperationStreams::with_inputs([&x, &v, &out, &lse, &d_out]);
    let dx = uninit::<B>(&x, x.shape.clone(), x.dtype);
    let dv = uninit::<B>(&v, v.shape.clone(), v.dtype);
    let inputs = [
        x.into_ir(),
        v.into_ir(),
        out.into_ir(),
        lse.into_ir(),
        d_out.into_ir(),
    ];
    let op = BackwardOp::<B> {
        inputs: inputs.clone(),
        outputs: [dx.id, dv.id],
        _backend: PhantomData,
    };
    let desc = custom_op(
        "burn_flash::softmax_matmul_backward",
        inputs.into(),
        vec![dx, dv],
    );
    let [dx, dv] = register(&client, streams, desc, op).outputs();
    (dx, dv)
}
