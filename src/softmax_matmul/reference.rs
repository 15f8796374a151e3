//! `softmax(X)·V` composed from stock Burn ops: the fallback of backends without fused
//! kernels. Follows burn-flash's semantics (a fully −inf row gives zeros).

use burn::tensor::{Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};
use burn_flash_kernels::softmax::SoftmaxVariant;

use crate::softmax::reference as softmax_ref;

fn tensor<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `(softmax(x)·v, logsumexp(x))` for `x` `[b, d1, d2]` and `v` `[b or 1, d2, d3]`; the
/// log-sum-exp is `[b, d1]`, −inf for a row without a finite score.
pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    v: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let x = tensor::<B>(x);
    let v = tensor::<B>(v);
    let [b, d1, d2] = x.dims();
    let d3 = v.dims()[2];
    let device = x.device();
    if d2 == 0 {
        let out = Tensor::<B, 3>::zeros([b, d1, d3], &device).cast(x.dtype());
        let lse = Tensor::<B, 2>::full([b, d1], f32::NEG_INFINITY, &device).cast(x.dtype());
        return (primitive(out), primitive(lse));
    }
    let p = tensor::<B>(softmax_ref::forward::<B>(
        primitive(x.clone()),
        2,
        SoftmaxVariant::Softmax,
    ));
    let out = p.matmul(v);
    let m = x.clone().max_dim(2);
    let m = m.clone().mask_fill(m.equal_elem(f32::NEG_INFINITY), 0.0);
    let lse = m.clone() + (x - m).exp().sum_dim(2).log();
    (primitive(out), primitive(lse.squeeze_dim::<2>(2)))
}

/// `(dx, dv)` of [`forward`] from the output gradient `d_out` (`dv` summed over batches when
/// `v` is shared).
pub fn backward<B: Backend>(
    x: FloatTensor<B>,
    v: FloatTensor<B>,
    d_out: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let x = tensor::<B>(x);
    let v = tensor::<B>(v);
    let d_out = tensor::<B>(d_out);
    let shared = v.dims()[0] == 1 && x.dims()[0] != 1;
    let p = tensor::<B>(softmax_ref::forward::<B>(
        primitive(x),
        2,
        SoftmaxVariant::Softmax,
    ));
    let mut dv = p.clone().swap_dims(1, 2).matmul(d_out.clone());
    if shared {
        dv = dv.sum_dim(0);
    }
    let dp = d_out.matmul(v.swap_dims(1, 2));
    let dx = softmax_ref::backward::<B>(primitive(p), primitive(dp), 2, SoftmaxVariant::Softmax);
    (dx, primitive(dv))
}
