//! Softmax on `CubeBackend`: validate, allocate, launch.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::{CubeRuntime, kernel::into_contiguous, ops::permute, tensor::CubeTensor};
use burn_flash_kernels::softmax::{
    STRIDED_MAX_LEN, SoftmaxOptions, SoftmaxTier, SoftmaxVariant, launch_softmax,
    launch_softmax_backward,
};

use super::check_input;
use crate::cube::{empty, tensor_ref};

/// Panics unless `dtype` is one the kernels run (the message names the argument).
pub(crate) fn check_dtype(op: &str, arg: &str, dtype: DType) {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        panic!("burn_flash::{op}: `{arg}` has dtype {dtype:?}; supported: F32, F16, BF16");
    }
}

/// Fewest rows (fibres along the softmax dim) for which the heuristic reads a non-contiguous
/// softmax dim in place with the strided scheme; below, it copies to a dim-last layout first.
/// The strided scheme runs one unit per row, so with few rows it leaves the GPU idle; the
/// crossover with copying first lies between 2^14 and 2^16 rows (`benches/softmax.rs`, strided
/// rows; RESULTS.md §2.4).
pub(crate) const STRIDED_MIN_ROWS: usize = 1 << 16;

/// Whether the op copies a tensor of this layout to a dim-last layout before launching: a forced
/// row scheme reads the softmax dim with unit stride, and the heuristic avoids the strided
/// scheme below [`STRIDED_MIN_ROWS`] rows or above [`STRIDED_MAX_LEN`] elements per row.
pub(crate) fn relayout_first(
    shape: &[usize],
    strides: &[usize],
    dim: usize,
    options: &SoftmaxOptions,
) -> bool {
    let strided = shape[dim] > 1 && strides[dim] != 1;
    let rows = shape.iter().product::<usize>() / shape[dim].max(1);
    match options.tier {
        Some(tier) => tier != SoftmaxTier::Strided && strided,
        None => strided && (rows < STRIDED_MIN_ROWS || shape[dim] > STRIDED_MAX_LEN),
    }
}

/// Strides of `shape` laid out with `dim` contiguous and the other dims in order.
pub(crate) fn dim_last_strides(shape: &[usize], dim: usize) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for d in core::iter::once(dim).chain((0..shape.len()).rev().filter(|&d| d != dim)) {
        strides[d] = acc;
        acc *= shape[d];
    }
    strides
}

fn needs_relayout<R: CubeRuntime>(t: &CubeTensor<R>, dim: usize, options: &SoftmaxOptions) -> bool {
    relayout_first(t.meta.shape(), t.meta.strides(), dim, options)
}

/// `t` with `dim` moved last and made contiguous, and the permutation that undoes the move.
fn dim_last_contiguous<R: CubeRuntime>(
    t: CubeTensor<R>,
    dim: usize,
) -> (CubeTensor<R>, Vec<usize>) {
    let rank = t.meta.num_dims();
    let perm: Vec<usize> = (0..rank).filter(|&d| d != dim).chain([dim]).collect();
    (into_contiguous(permute(t, &perm)), inverse(&perm))
}

/// The permutation that undoes `perm`.
fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0; perm.len()];
    for (i, &d) in perm.iter().enumerate() {
        inverse[d] = i;
    }
    inverse
}

/// An uninitialised tensor of `like`'s shape whose dimensions are laid out in the same order
/// of strides as `like`'s (a transposed input gives a transposed output), so that the kernels
/// read and write with the same access pattern.
pub(crate) fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    let shape = like.meta.shape();
    let strides = like.meta.strides();
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    let permuted: Shape = order.iter().map(|&d| shape[d]).collect();
    let out = empty(like, permuted, like.dtype);
    if order.iter().enumerate().all(|(i, &d)| i == d) {
        return out;
    }
    permute(out, &inverse(&order))
}

pub(crate) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> CubeTensor<R> {
    let op = check_input(variant, dim, x.shape().num_dims(), "tensor", x.dtype);
    if x.meta.num_elements() == 0 {
        // Nothing to compute: an empty tensor of the right shape is the input itself.
        return x;
    }
    if needs_relayout(&x, dim, &options) {
        let (x, inverse) = dim_last_contiguous(x, dim);
        let last = x.meta.num_dims() - 1;
        return permute(forward(x, last, variant, options), &inverse);
    }
    let output = empty_like(&x);
    launch_softmax::<R>(
        &x.client,
        tensor_ref(&x),
        tensor_ref(&output),
        dim,
        x.dtype.into(),
        variant,
        options,
    )
    .unwrap_or_else(|err| panic!("burn_flash::{op}: {err}"));
    output
}

pub(crate) fn backward<R: CubeRuntime>(
    y: CubeTensor<R>,
    dy: CubeTensor<R>,
    dim: usize,
    variant: SoftmaxVariant,
    options: SoftmaxOptions,
) -> CubeTensor<R> {
    let op = check_input(variant, dim, y.shape().num_dims(), "output", y.dtype);
    y.assert_is_on_same_device(&dy);
    if dy.dtype != y.dtype {
        panic!(
            "burn_flash::{op} backward: `grad` has dtype {:?}, the output has {:?}",
            dy.dtype, y.dtype
        );
    }
    if y.meta.num_elements() == 0 {
        return dy;
    }
    if needs_relayout(&y, dim, &options) || needs_relayout(&dy, dim, &options) {
        let (y, inverse) = dim_last_contiguous(y, dim);
        let (dy, _) = dim_last_contiguous(dy, dim);
        let last = y.meta.num_dims() - 1;
        return permute(backward(y, dy, last, variant, options), &inverse);
    }
    let dx = empty_like(&y);
    launch_softmax_backward::<R>(
        &y.client,
        tensor_ref(&y),
        tensor_ref(&dy),
        tensor_ref(&dx),
        dim,
        y.dtype.into(),
        variant,
        options,
    )
    .unwrap_or_else(|err| panic!("burn_flash::{op} backward: {err}"));
    dx
}
