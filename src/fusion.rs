//! What every op's `Fusion<B>` implementation shares: recording an opaque custom operation on
//! Fusion's stream.
//!
//! Each op (forward and backward) runs on `Fusion<B>` as one custom operation that runs `B`'s
//! kernels. It ends the fused block around it (Burn's fuser cannot see inside). The operation
//! structs keep the tensors' IR they need, not a second copy of the whole `CustomOpIr`.

use burn::backend::ir::{
    CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorId, TensorIr,
};
use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime, FusionTensor,
    client::GlobalFusionClient,
    stream::{Operation, OperationStreams},
};

/// The tensors an operation reads and writes when it runs on `B`'s device thread.
pub(crate) type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// A new tensor of `shape` and `dtype` on `like`'s client, for an operation to write.
pub(crate) fn uninit<R: FusionRuntime>(
    like: &FusionTensor<R>,
    shape: Shape,
    dtype: DType,
) -> TensorIr {
    TensorIr::uninit(like.client.create_empty_handle(), shape, dtype)
}

/// The outputs of a fused `softmax(·)·V`: `out`, `rows` by `width` in `like`'s dtype, and the
/// log-sum-exp of each row, `rows` in `f32`.
pub(crate) fn out_and_lse<R: FusionRuntime>(
    like: &FusionTensor<R>,
    rows: &[usize],
    width: usize,
) -> [TensorIr; 2] {
    let out = uninit(like, Shape::from([rows, &[width]].concat()), like.dtype);
    let lse = uninit(like, Shape::from(rows.to_vec()), DType::F32);
    [out, lse]
}

/// Records the custom operation `name`, which reads `inputs` and writes `outputs` (made by
/// [`uninit`]), and returns the outputs' tensors. `op` builds the operation from the inputs'
/// IR and the outputs' ids, in the same order.
pub(crate) fn record<R: FusionRuntime, O: Operation<R> + 'static>(
    name: &'static str,
    inputs: Vec<FusionTensor<R>>,
    outputs: Vec<TensorIr>,
    op: impl FnOnce(Vec<TensorIr>, Vec<TensorId>) -> O,
) -> Vec<FusionTensor<R>> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let inputs: Vec<TensorIr> = inputs.into_iter().map(FusionTensor::into_ir).collect();
    let op = op(inputs.clone(), outputs.iter().map(|t| t.id).collect());
    register(&client, streams, custom_op(name, inputs, outputs), op)
}

/// The inner backend's op of a [`record_rows_op`]: two tensors, an optional third and a scalar.
pub(crate) type RowsFn<B> =
    fn(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, f64) -> FloatTensor<B>;

/// The inputs of a [`record_rows_op`]: `x`, a parameter and an optional one.
pub(crate) type RowsArgs<B> = (
    FloatTensor<Fusion<B>>,
    FloatTensor<Fusion<B>>,
    Option<FloatTensor<Fusion<B>>>,
);

/// A row-wise op over `x`, a parameter and an optional one (a layer norm's `γ`, `β`; a
/// linear's weight and bias), run by `run` on `B`'s tensors.
#[derive(Debug)]
struct RowsOp<B: FusionBackend> {
    inputs: Vec<TensorIr>,
    out: TensorId,
    scalar: f64,
    run: RowsFn<B>,
}

impl<B: FusionBackend> Operation<B::FusionRuntime> for RowsOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self.inputs.iter().map(|t| handles.get_float_tensor::<B>(t));
        let (x, p) = (
            inputs.next().expect("x"),
            inputs.next().expect("a parameter"),
        );
        let out = (self.run)(x, p, inputs.next(), self.scalar);
        handles.register_float_tensor::<B>(&self.out, out);
    }
}

/// Records `run(x, p, q, scalar)` as the custom operation `name` writing `out` (made by
/// [`uninit`]), and returns the output.
pub(crate) fn record_rows_op<B: FusionBackend>(
    name: &'static str,
    (x, p, q): RowsArgs<B>,
    out: TensorIr,
    scalar: f64,
    run: RowsFn<B>,
) -> FloatTensor<Fusion<B>> {
    let mut tensors = vec![x, p];
    tensors.extend(q);
    let op = |inputs, outputs: Vec<TensorId>| RowsOp::<B> {
        inputs,
        out: outputs[0],
        scalar,
        run,
    };
    record(name, tensors, vec![out], op).output()
}

/// The IR Fusion records for a custom operation (`CustomOpIr::new` would copy both lists).
fn custom_op(name: &'static str, inputs: Vec<TensorIr>, outputs: Vec<TensorIr>) -> CustomOpIr {
    CustomOpIr {
        id: name.to_owned(),
        inputs,
        outputs,
    }
}

/// Records a custom op on Fusion's stream, then hands Fusion's task queue to its device thread
/// at once. Fusion's channel otherwise holds tasks until 32 have queued or the user syncs, so a
/// custom op (which no fuser takes: it runs as soon as the device thread sees it) would wait
/// for unrelated later tasks, and a lone call would start its kernel only at the sync.
fn register<R: FusionRuntime, O: Operation<R> + 'static>(
    client: &GlobalFusionClient<R>,
    streams: OperationStreams,
    desc: CustomOpIr,
    op: O,
) -> Vec<FusionTensor<R>> {
    let outputs = client.register(streams, OperationIr::Custom(desc), op);
    client.flush_queue();
    outputs
}
