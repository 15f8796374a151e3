//! `softmax(X)·V` on `CubeBackend`: validate, allocate, launch.

use burn::tensor::DType;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use burn_flash_kernels::softmax_matmul::{
    SoftmaxMatmulOptions, launch_softmax_matmul, launch_softmax_matmul_backward,
};

use super::dims_of;
use crate::cube::{empty, tensor_ref};

fn check<R: CubeRuntime>(x: &CubeTensor<R>, v: &CubeTensor<R>) {
    super::check_dtypes(x.dtype, v.dtype);
    x.assert_is_on_same_device(v);
}

pub(crate) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    v: CubeTensor<R>,
    options: SoftmaxMatmulOptions,
) -> (CubeTensor<R>, CubeTensor<R>) {
    check(&x, &v);
    let dims = dims_of(x.meta.shape(), v.meta.shape());
    let out = empty(&x, [dims.batch, dims.d1, dims.d3], x.dtype);
    let lse = empty(&x, [dims.batch, dims.d1], DType::F32);
    launch_softmax_matmul::<R>(
        &x.client,
        tensor_ref(&x),
        tensor_ref(&v),
        tensor_ref(&out),
        tensor_ref(&lse),
        x.dtype.into(),
        options,
    )
    .unwrap_or_else(|err| panic!("burn_flash::softmax_matmul: {err}"));
    (out, lse)
}

pub(crate) fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_out: CubeTensor<R>,
    options: SoftmaxMatmulOptions,
) -> (CubeTensor<R>, CubeTensor<R>) {
    check(&x, &v);
    if d_out.dtype != x.dtype {
        panic!(
            "burn_flash::softmax_matmul backward: `grad` has dtype {:?}, `x` has {:?}",
            d_out.dtype, x.dtype
        );
    }
    let dx = empty(&x, x.meta.shape(), x.dtype);
    let dv = empty(&v, v.meta.shape(), v.dtype);
    launch_softmax_matmul_backward::<R>(
        &x.client,
        tensor_ref(&x),
        tensor_ref(&v),
        tensor_ref(&out),
        tensor_ref(&lse),
        tensor_ref(&d_out),
        tensor_ref(&dx),
        tensor_ref(&dv),
        x.dtype.into(),
        options,
    )
    .unwrap_or_else(|err| panic!("burn_flash::softmax_matmul backward: {err}"));
    (dx, dv)
}
