//! Attention on `Autodiff<B>`: the forward runs `B`'s attention (the fused kernel on CubeCL
//! backends) and keeps its inputs, output and row log-sum-exp; the backward runs `B`'s
//! attention backward ([`crate::AttentionBackend::flash_attention_backward`]). Nothing of size
//! `Sq × Sk` is kept between the two.

use burn::backend::{
    Autodiff,
    autodiff::{
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
};
use burn::tensor::{
    Tensor, TensorMetadata, TensorPrimitive, backend::AutodiffBackend, ops::FloatTensor,
};

use super::{FlashAttentionOptions, Inputs};
use crate::FlashBackend;

/// Two float tensors of `Autodiff<B, C>`: the op's two results.
type Pair<B, C> = (FloatTensor<Autodiff<B, C>>, FloatTensor<Autodiff<B, C>>);

/// The backward step; `N` parents: `q`, `k`, `v`, and the bias when there is one.
#[derive(Debug)]
struct AttentionBackward;

/// What the backward needs: the call's inputs, the output and `lse`, the options.
type State<B> = (
    Inputs<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FlashAttentionOptions,
);

impl<B: FlashBackend, const N: usize> Backward<B, N> for AttentionBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<B>(&ops.node);
        let ((q, k, v, mask, bias, slopes), out, lse, options) = ops.state;
        let bias_node = ops.parents.get(3).cloned().flatten();
        let bias_dims = bias.as_ref().map(|b| b.shape().dims::<4>());
        let want_ds = bias_node.is_some();
        let g = B::flash_attention_backward(
            q, k, v, mask, bias, slopes, out, lse, d_out, options, want_ds,
        );
        for (parent, grad) in ops.parents.iter().zip([g.dq, g.dk, g.dv]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
        if let (Some(node), Some(ds), Some(dims)) = (bias_node, g.ds, bias_dims) {
            grads.register::<B>(node.id, reduce_to::<B>(ds, dims));
        }
    }
}

/// `ds` (`[B, Hq, Sq, Sk]`) summed over the dimensions a bias of `dims` broadcasts along.
fn reduce_to<B: FlashBackend>(ds: FloatTensor<B>, dims: [usize; 4]) -> FloatTensor<B> {
    let mut t = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(ds));
    let full = t.dims();
    for (d, (&want, &have)) in dims.iter().zip(&full).enumerate() {
        if want == 1 && have != 1 {
            t = t.sum_dim(d);
        }
    }
    t.into_primitive().tensor()
}

pub(crate) fn forward<B: FlashBackend, C: CheckpointStrategy>(
    (query, key, value, mask, bias, slopes): Inputs<Autodiff<B, C>>,
    options: FlashAttentionOptions,
) -> Pair<B, C> {
    // The slopes are not tracked (no gradient flows to them).
    let slopes = slopes.map(|s| s.primitive);
    let run =
        |q, k, v, bias| B::flash_attention(q, k, v, mask.clone(), bias, slopes.clone(), options);
    let nodes = [query.node.clone(), key.node.clone(), value.node.clone()];
    let (q, k, v) = (query.primitive, key.primitive, value.primitive);
    // One state type for both arities; the bias is a parent only when there is one.
    macro_rules! tracked {
        ($nodes:expr, $bias:expr) => {
            match AttentionBackward
                .prepare::<C>($nodes)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let bias: Option<FloatTensor<B>> = $bias;
                    let (out, lse) = run(q.clone(), k.clone(), v.clone(), bias.clone());
                    let inputs = (q, k, v, mask.clone(), bias, slopes.clone());
                    let state = (inputs, out.clone(), lse.clone(), options);
                    (
                        prep.finish(state, out),
                        <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
                    )
                }
                OpsKind::UnTracked(prep) => {
                    let (out, lse) = run(q, k, v, $bias);
                    (
                        prep.finish(out),
                        <Autodiff<B, C> as AutodiffBackend>::from_inner(lse),
                    )
                }
            }
        };
    }
    match bias {
        Some(bias) => {
            let [a, b, c] = nodes;
            tracked!([a, b, c, bias.node.clone()], Some(bias.primitive.clone()))
        }
        None => tracked!(nodes, None),
    }
}
