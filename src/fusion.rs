//! What every op's `Fusion<B>` implementation shares: the recorded IR of an opaque custom
//! operation, and its registration on Fusion's stream.
//!
//! Each op runs on `Fusion<B>` as one custom operation that runs `B`'s kernels. It ends the
//! fused block around it (Burn's fuser cannot see inside). The operation structs keep the
//! tensors' IR they need, not a second copy of the whole `CustomOpIr`.

use burn::backend::ir::{CustomOpIr, OperationIr, TensorIr};
use burn_fusion::{
    FusionRuntime, FusionTensor,
    client::GlobalFusionClient,
    stream::{Operation, OperationStreams},
};

/// The IR Fusion records for a custom operation (`CustomOpIr::new` would copy both lists).
pub(crate) fn custom_op(
    name: &'static str,
    inputs: Vec<TensorIr>,
    outputs: Vec<TensorIr>,
) -> CustomOpIr {
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
pub(crate) fn register<R: FusionRuntime, O: Operation<R> + 'static>(
    client: &GlobalFusionClient<R>,
    streams: OperationStreams,
    desc: CustomOpIr,
    op: O,
) -> Vec<FusionTensor<R>> {
    let outputs = client.register(streams, OperationIr::Custom(desc), op);
    client.flush_queue();
    outputs
}
