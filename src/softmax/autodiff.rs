//! Softmax on `Autodiff<B>`: the forward runs `B`'s fused op and keeps only its output `y`;
//! the backward runs `B`'s fused backward op.

use burn::backend::{
    Autodiff,
    autodiff::{
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
};
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};
use burn_flash_kernels::softmax::{SoftmaxOptions, SoftmaxVariant};

use crate::FlashBackend;

#[derive(Debug)]
struct SoftmaxBackward;

impl<B: FlashBackend> Backward<B, 1> for SoftmaxBackward {
    /// The forward output and the op's arguments: all the backward needs.
    type State = (FloatTensor<B>, usize, SoftmaxVariant, SoftmaxOptions);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (y, dim, variant, options) = ops.state;
        if let Some(node) = parent {
            grads.register::<B>(
                node.id,
                B::flash_softmax_backward(y, dy, dim, variant, options),
            );
        }
    }
}

pub(crate) fn forward<B: FlashBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> FloatTensor<Autodiff<B, C>> {
    match SoftmaxBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::flash_softmax(x.primitive, dim, variant, options);
            prep.finish((y.clone(), dim, variant, options), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(B::flash_softmax(x.primitive, dim, variant, options))
        }
    }
}

/// The backward op itself is not differentiated again (no double backward): its result is a
/// new untracked tensor.
pub(crate) fn backward<B: FlashBackend, C: CheckpointStrategy>(
    y: FloatTensor<Autodiff<B, C>>,
    dy: FloatTensor<Autodiff<B, C>>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> FloatTensor<Autodiff<B, C>> {
    let dx = B::flash_softmax_backward(y.primitive, dy.primitive, dim, variant, options);
    <Autodiff<B, C> as AutodiffBackend>::from_inner(dx)
}
