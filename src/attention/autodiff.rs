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

use super::FlashAttentionOptions;
use super::operands::{AttentionInputs, HeadOperands, ScoreOperands};
use crate::FlashBackend;

/// Two float tensors of `Autodiff<B, C>`: the op's two results.
type Pair<B, C> = (FloatTensor<Autodiff<B, C>>, FloatTensor<Autodiff<B, C>>);

/// The backward step; `N` parents: `q`, `k`, `v`, then the bias and the attention sinks where
/// there are.
#[derive(Debug)]
struct AttentionBackward;

/// What the backward needs: the call's inputs, the output and `lse`, the options.
type State<B> = (
    AttentionInputs<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FlashAttentionOptions,
);

impl<B: FlashBackend, const N: usize> Backward<B, N> for AttentionBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<B>(&ops.node);
        let (inputs, out, lse, options) = ops.state;
        let (bias, sinks) = (&inputs.scores.bias, &inputs.scores.heads.sinks);
        let bias_node = bias.as_ref().and_then(|_| ops.parents[3].clone());
        let sinks_node = sinks
            .as_ref()
            .and_then(|_| ops.parents[3 + usize::from(bias.is_some())].clone());
        let bias_dims = bias.as_ref().map(|b| b.shape().dims::<4>());
        let want_ds = bias_node.is_some();
        // dSinks needs the output and the log-sum-exp after the backward took them.
        let sink_grad = match (&sinks_node, sinks) {
            (Some(_), Some(s)) => Some((s.clone(), out.clone(), lse.clone(), d_out.clone())),
            _ => None,
        };
        let g = B::flash_attention_backward(inputs, out, lse, d_out, options, want_ds);
        for (parent, grad) in ops.parents.iter().zip([g.dq, g.dk, g.dv]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
        if let (Some(node), Some(ds), Some(dims)) = (bias_node, g.ds, bias_dims) {
            grads.register::<B>(node.id, reduce_to::<B>(ds, dims));
        }
        if let (Some(node), Some((sinks, out, lse, d_out))) = (sinks_node, sink_grad) {
            grads.register::<B>(node.id, sinks_grad::<B>(sinks, out, lse, d_out));
        }
    }
}

/// The gradient of the attention-sink logits `sinks` (`[Hq]`, f32): the sink's weight in row
/// `i` is `e^(sink − lse_i)` and it carries no value, so `dSink_h = −Σ_{b,i} e^(sink_h −
/// lse_{b,h,i})·δ_{b,h,i}` with `δ = rowsum(dO ⊙ O)` (f32).
fn sinks_grad<B: FlashBackend>(
    sinks: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_out: FloatTensor<B>,
) -> FloatTensor<B> {
    use burn::tensor::DType;
    let f32_4 = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t)).cast(DType::F32);
    let sinks = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(sinks));
    let heads = sinks.dims()[0];
    let delta = (f32_4(out) * f32_4(d_out)).sum_dim(3).squeeze_dim::<3>(3);
    let lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse));
    let weight = (sinks.clone().reshape([1, heads, 1]) - lse).exp();
    let grad = (weight * delta)
        .sum_dim(2)
        .sum_dim(0)
        .reshape([heads])
        .neg();
    grad.cast(sinks.dtype()).into_primitive().tensor()
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
    inputs: AttentionInputs<Autodiff<B, C>>,
    options: FlashAttentionOptions,
) -> Pair<B, C> {
    let (query, key, value, scores) = (inputs.query, inputs.key, inputs.value, inputs.scores);
    let sinks_node = scores.heads.sinks.as_ref().map(|s| s.node.clone());
    // The slopes are not tracked (no gradient flows to them); the bias and the sinks are
    // parents where given.
    let inner = |bias| ScoreOperands::<B> {
        mask: scores.mask.clone(),
        bias,
        heads: HeadOperands {
            slopes: scores.heads.slopes.as_ref().map(|s| s.primitive.clone()),
            sinks: scores.heads.sinks.as_ref().map(|s| s.primitive.clone()),
        },
        seqs: scores.seqs.clone(),
    };
    let run = |query, key, value, bias| {
        let inputs = AttentionInputs {
            query,
            key,
            value,
            scores: inner(bias),
        };
        B::flash_attention(inputs, options)
    };
    let [a, b, c] = [query.node.clone(), key.node.clone(), value.node.clone()];
    let (q, k, v) = (query.primitive, key.primitive, value.primitive);
    // One state type for every arity; the bias and the sinks are parents only where given.
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
                    let inputs = AttentionInputs {
                        query: q,
                        key: k,
                        value: v,
                        scores: inner(bias),
                    };
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
    match (scores.bias, sinks_node) {
        (Some(bias), Some(s)) => {
            let node = bias.node.clone();
            tracked!([a, b, c, node, s], Some(bias.primitive.clone()))
        }
        (Some(bias), None) => {
            tracked!([a, b, c, bias.node.clone()], Some(bias.primitive.clone()))
        }
        (None, Some(s)) => tracked!([a, b, c, s], None),
        (None, None) => tracked!([a, b, c], None),
    }
}
