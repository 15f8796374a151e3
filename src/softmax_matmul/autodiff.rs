//! `softmax(X)·V` on `Autodiff<B>`: the forward runs `B`'s fused op and keeps `x`, `v`, the
//! output and the row log-sum-exp; the backward runs `B`'s fused backward op.

use burn::backend::{
    Autodiff,
    autodiff::{
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
};
use burn::tensor::ops::FloatTensor;
use burn_flash_kernels::softmax_matmul::SoftmaxMatmulOptions;

use crate::FlashBackend;

/// Two float tensors of `Autodiff<B, C>`: the op's two results.
type Pair<B, C> = (FloatTensor<Autodiff<B, C>>, FloatTensor<Autodiff<B, C>>);

#[derive(Debug)]
struct SoftmaxMatmulBackward;

impl<B: FlashBackend> Backward<B, 2> for SoftmaxMatmulBackward {
    /// `x`, `v`, the output, the log-sum-exp and the forward's options: all the backward
    /// needs.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        SoftmaxMatmulOptions,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_v] = ops.parents;
        let d_out = grads.consume::<B>(&ops.node);
        let (x, v, out, lse, options) = ops.state;
        let (dx, dv) = B::flash_softmax_matmul_backward(x, v, out, lse, d_out, options);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_v {
            grads.register::<B>(node.id, dv);
        }
    }
}

pub(crate) fn forward<B: FlashBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    options: SoftmaxMatmulOptions,
) -> Pair<B, C> {
    let (out, lse) = match SoftmaxMatmulBackward
        .prepare::<C>([x.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, lse) =
                B::flash_softmax_matmul(x.primitive.clone(), v.primitive.clone(), options);
            let state = (x.primitive, v.primitive, out.clone(), lse.clone(), options);
            (prep.finish(state, out), lse)
        }
        OpsKind::UnTracked(prep) => {
            let (out, lse) = B::flash_softmax_matmul(x.primitive, v.primitive, options);
            (prep.finish(out), lse)
        }
    };
    // The log-sum-exp is an auxiliary output, not differentiated.
    (
        out,
        <Autodiff<B, C> as burn::tensor::backend::AutodiffBackend>::from_inner(lse),
    )
}

/// The backward op is not differentiated again (no double backward).
pub(crate) fn backward<B: FlashBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    out: FloatTensor<Autodiff<B, C>>,
    lse: FloatTensor<Autodiff<B, C>>,
    d_out: FloatTensor<Autodiff<B, C>>,
    options: SoftmaxMatmulOptions,
) -> Pair<B, C> {
    use burn::tensor::backend::AutodiffBackend;
    let (dx, dv) = B::flash_softmax_matmul_backward(
        x.primitive,
        v.primitive,
        out.primitive,
        lse.primitive,
        d_out.primitive,
        options,
    );
    (
        <Autodiff<B, C> as AutodiffBackend>::from_inner(dx),
        <Autodiff<B, C> as AutodiffBackend>::from_inner(dv),
    )
}
