//! The softmax family composed from stock Burn ops: the fallback of backends without fused
//! kernels, and what the tests compare gradients against.
//!
//! It follows burn-flash's semantics for fully masked rows (zeros, or −inf for log-softmax),
//! which Burn's own composition does not (it gives NaN).

use burn::tensor::{
    DType, FloatDType, Shape, Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor,
};
use burn_flash_kernels::softmax::SoftmaxVariant;

/// The tensor as `[outer, dim, inner]`, so one rank-3 expression serves every rank.
fn as_rank3<B: Backend>(x: FloatTensor<B>, dim: usize) -> (Tensor<B, 3>, Shape) {
    use burn::tensor::TensorMetadata;
    let shape = x.shape();
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let x = B::float_reshape(x, Shape::new([outer, shape[dim], inner]));
    (Tensor::from_primitive(TensorPrimitive::Float(x)), shape)
}

fn from_rank3<B: Backend>(x: Tensor<B, 3>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(x.into_primitive().tensor(), shape)
}

/// Runs `f` in f64 where the backend has it (the stock sums accumulate in the tensor's dtype:
/// a 2^20-element f32 row sum drifts by ~1e-3 on NdArray), else in the tensor's own dtype.
fn in_f64<B: Backend>(
    tensors: Vec<Tensor<B, 3>>,
    f: impl FnOnce(Vec<Tensor<B, 3>>) -> Tensor<B, 3>,
) -> Tensor<B, 3> {
    let dtype = tensors[0].dtype();
    let device = tensors[0].device();
    if tensors[0].shape().num_elements() == 0 {
        return tensors.into_iter().next().expect("one tensor");
    }
    if dtype != DType::F64 && B::supports_dtype(&device, DType::F64) {
        let up = tensors
            .into_iter()
            .map(|t| t.cast(FloatDType::F64))
            .collect();
        let out = f(up);
        out.cast(FloatDType::from(dtype))
    } else {
        f(tensors)
    }
}

/// Forward of `variant` along `dim`, composed from stock ops.
pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    variant: SoftmaxVariant,
) -> FloatTensor<B> {
    let (x, shape) = as_rank3::<B>(x, dim);
    let y = in_f64(vec![x], |t| {
        let [x] = <[_; 1]>::try_from(t).expect("one tensor");
        forward_rank3(x, variant)
    });
    from_rank3(y, shape)
}

/// Forward on a rank-3 tensor along dim 1 (tracked by autodiff if `x` is).
pub fn forward_rank3<B: Backend>(x: Tensor<B, 3>, variant: SoftmaxVariant) -> Tensor<B, 3> {
    let m = x.clone().detach().max_dim(1);
    // A row whose max is −inf is fully masked: shift it by 0 instead of −inf.
    let m = m.clone().mask_fill(m.equal_elem(f32::NEG_INFINITY), 0.0);
    match variant {
        SoftmaxVariant::Softmax => {
            let e = (x - m).exp();
            let s = e.clone().sum_dim(1);
            let s = s.clone().mask_fill(s.equal_elem(0.0), 1.0);
            e / s
        }
        SoftmaxVariant::QuietSoftmax => {
            let shift = m.clamp_min(0.0);
            let e = (x - shift.clone()).exp();
            let s = e.clone().sum_dim(1);
            e / (s + shift.neg().exp())
        }
        SoftmaxVariant::LogSoftmax => {
            let shifted = x - m;
            let s = shifted.clone().exp().sum_dim(1);
            let lse = s.clone().log().mask_fill(s.equal_elem(0.0), f32::INFINITY);
            shifted - lse
        }
    }
}

/// Backward of `variant` from its output `y` and the output gradient `dy`, composed.
pub fn backward<B: Backend>(
    y: FloatTensor<B>,
    dy: FloatTensor<B>,
    dim: usize,
    variant: SoftmaxVariant,
) -> FloatTensor<B> {
    let (y, shape) = as_rank3::<B>(y, dim);
    let (dy, _) = as_rank3::<B>(dy, dim);
    let dx = in_f64(vec![y, dy], |t| {
        let [y, dy] = <[_; 2]>::try_from(t).expect("two tensors");
        match variant {
            // dx = dy − e^y ⊙ Σ dy
            SoftmaxVariant::LogSoftmax => dy.clone() - y.exp() * dy.sum_dim(1),
            // dx = y ⊙ (dy − Σ dy ⊙ y)
            _ => y.clone() * (dy.clone() - (dy * y).sum_dim(1)),
        }
    });
    from_rank3(dx, shape)
}
