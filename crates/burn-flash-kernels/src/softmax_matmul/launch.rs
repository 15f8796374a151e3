//! Launch of `softmax(X)·V`, forward and backward: shape checks, the plan, the flash kernels'
//! 4-D views of the 3-D tensors.

use cubecl::{CubeCount, CubeDim, prelude::*};

use super::options::SmmForwardKernel;
use super::options::{
    SmmBackwardPath, SmmDims, SoftmaxMatmulError, SoftmaxMatmulOptions, SoftmaxMatmulPlan,
};
use super::plan::{
    check_dtype, plan_softmax_matmul_backward_for, plan_softmax_matmul_for, row_vector,
};
use crate::flash::backward::{Schedule, launch_backward, launch_delta};
use crate::flash::forward::launch_forward;
use crate::flash::{BackwardOperands, FlashTensors, Operand, Scalars};
use crate::tensor::TensorRef;

/// Reads the sizes of a call from `x` and `v` and checks every tensor's shape.
fn dims_of(
    x: &TensorRef<'_>,
    v: &TensorRef<'_>,
    others: &[(&'static str, &TensorRef<'_>, [usize; 3])],
) -> Result<SmmDims, SoftmaxMatmulError> {
    if x.shape.len() != 3 || x.strides.len() != 3 {
        return Err(SoftmaxMatmulError::ShapeMismatch {
            arg: "x",
            expected: vec![0, 0, 0],
            got: x.shape.to_vec(),
        });
    }
    let dims = SmmDims {
        batch: x.shape[0],
        d1: x.shape[1],
        d2: x.shape[2],
        d3: v.shape.get(2).copied().unwrap_or(0),
    };
    let v_ok = v.shape.len() == 3
        && v.strides.len() == 3
        && (v.shape[0] == dims.batch || v.shape[0] == 1)
        && v.shape[1] == dims.d2;
    if !v_ok {
        return Err(SoftmaxMatmulError::ShapeMismatch {
            arg: "v",
            expected: vec![dims.batch, dims.d2, dims.d3],
            got: v.shape.to_vec(),
        });
    }
    for (arg, t, expected) in others {
        let expected = expected.map(|e| match e {
            BATCH => dims.batch,
            D1 => dims.d1,
            D2 => dims.d2,
            D3 => dims.d3,
            other => other,
        });
        let expected: Vec<usize> = expected.into_iter().filter(|&e| e != NONE).collect();
        if t.shape != expected || t.strides.len() != expected.len() {
            return Err(SoftmaxMatmulError::ShapeMismatch {
                arg,
                expected,
                got: t.shape.to_vec(),
            });
        }
    }
    Ok(dims)
}

// Placeholders of `dims_of`'s expected shapes.
const BATCH: usize = usize::MAX;
const D1: usize = usize::MAX - 1;
const D2: usize = usize::MAX - 2;
const D3: usize = usize::MAX - 3;
const NONE: usize = usize::MAX - 4;

/// `out = softmax(x)·v` along the last dimension of `x`, and `lse` = the row log-sum-exp of
/// `x` (f32; −inf for a row without a finite score, whose output row is 0).
///
/// Returns the plan that ran. Nothing is launched when an error is returned; with an empty
/// tensor, nothing is launched either and the plan is returned.
#[allow(clippy::too_many_arguments)]
pub fn launch_softmax_matmul<R: Runtime>(
    client: &ComputeClient<R>,
    x: TensorRef<'_>,
    v: TensorRef<'_>,
    out: TensorRef<'_>,
    lse: TensorRef<'_>,
    dtype: StorageType,
    options: SoftmaxMatmulOptions,
) -> Result<SoftmaxMatmulPlan, SoftmaxMatmulError> {
    crate::cache::ensure_linked();
    let dims = dims_of(
        &x,
        &v,
        &[
            ("out", &out, [BATCH, D1, D3]),
            ("lse", &lse, [BATCH, D1, NONE]),
        ],
    )?;
    let mut v_strides = v.strides.to_vec();
    if v.shape[0] == 1 {
        // A shared `v` is read at batch stride 0.
        v_strides[0] = 0;
    }
    let vector = row_vector(
        &[
            (x.shape, x.strides),
            (v.shape, &v_strides),
            (out.shape, out.strides),
        ],
        dtype,
    );
    // What the Hopper kernel's TMA maps need beyond the vector: 16-byte starts, and rows read
    // at a nonzero stride (a batch read at stride 0 is read as one batch).
    let strided_rows = |t: &TensorRef<'_>| t.shape[1] <= 1 || t.strides[1] != 0;
    let tma =
        crate::attention::starts_aligned(&[&x, &v, &out]) && strided_rows(&x) && strided_rows(&v);
    let plan = plan_softmax_matmul_for(client, dims, dtype, vector, tma, options)?;
    if dims.batch * dims.d1 * dims.d3 == 0 {
        return Ok(plan);
    }
    if plan.kernel == SmmForwardKernel::Hopper {
        // SAFETY: `dims_of` checked the shapes, which describe the buffers; the plan took the
        // Hopper kernel, so `hopper_unavailable` found nothing against this call (TMA layout,
        // non-empty tensors, grid limits).
        crate::launch_hand_written!(
            client,
            |cuda| unsafe {
                crate::flash::forward::hopper::launch_given(
                    cuda,
                    &x,
                    &v,
                    &out,
                    &lse,
                    dtype,
                    plan.config,
                    plan.units,
                    plan.cubes.0,
                )
            },
            Ok(plan)
        );
    }
    let flash_kernel = plan
        .kernel
        .flash()
        .expect("every kernel but Hopper's is a flash loop");
    let shared_v = v.shape[0] == 1 && dims.batch > 1;
    let units = CubeDim::new_1d(plan.units);
    // The flash kernels see 4-D tensors with one head: X `[batch, 1, d1, d2]` as the given
    // scores, V `[batch or 1, 1, d2, d3]`, out `[batch, 1, d1, d3]`, lse `[batch, 1, d1]`.
    let (cx, cy, cz) = plan.cubes;
    let count = CubeCount::Static(cx as u32, cy as u32, cz as u32);
    let heads = |t: &TensorRef<'_>, batch_stride: usize| {
        let mut shape = t.shape.to_vec();
        let mut strides = t.strides.to_vec();
        shape.insert(1, 1);
        strides[0] = batch_stride;
        strides.insert(1, 0);
        // SAFETY: shape and strides describe the caller's buffer with a head axis of size 1;
        // zero strides only make every index along them read the same element.
        unsafe { TensorArg::<R>::from_raw_parts(t.handle.clone(), strides.into(), shape.into()) }
    };
    let v_batch_stride = if shared_v { 0 } else { v.strides[0] };
    let tensors = FlashTensors {
        q: heads(&x, x.strides[0]),
        k: heads(&x, x.strides[0]),
        v: heads(&v, v_batch_stride),
        mask: heads(&x, x.strides[0]),
        bias: heads(&x, x.strides[0]),
        slopes: heads(&lse, lse.strides[0]),
        sinks: heads(&lse, lse.strides[0]),
        seqs: heads(&lse, lse.strides[0]),
        out: heads(&out, out.strides[0]),
        lse: heads(&lse, lse.strides[0]),
    };
    // SAFETY: as above; the matrix-unit kernel runs only on 16-byte aligned rows (the plan's
    // vector of 8), the tiled kernel's vector (the plan's) divides every row and stride, and
    // `k`, `mask` and `bias` (stand-ins: `x`), `slopes`, `sinks` and `seqs` (`lse`) are never
    // read with given scores.
    unsafe {
        launch_forward(
            client,
            flash_kernel,
            count,
            units,
            plan.vector,
            tensors,
            Scalars::GIVEN,
            plan.config,
            dtype,
        );
    }
    Ok(plan)
}

/// Gradients of [`launch_softmax_matmul`]: `dx` (`[batch, d1, d2]`) and `dv` (`v`'s shape; a
/// shared `v` gets the sum over batches) from the forward's `out` and `lse` and the output
/// gradient `d_out`. Needs one f32 per row of scratch, nothing of size `d1 × d2` but `dx`.
/// `options` are the forward's: `hopper: Some(false)` keeps the backward off the Hopper kernels
/// too.
#[allow(clippy::too_many_arguments)]
pub fn launch_softmax_matmul_backward<R: Runtime>(
    client: &ComputeClient<R>,
    x: TensorRef<'_>,
    v: TensorRef<'_>,
    out: TensorRef<'_>,
    lse: TensorRef<'_>,
    d_out: TensorRef<'_>,
    dx: TensorRef<'_>,
    dv: TensorRef<'_>,
    dtype: StorageType,
    options: SoftmaxMatmulOptions,
) -> Result<(), SoftmaxMatmulError> {
    crate::cache::ensure_linked();
    let v_batch = v.shape.first().copied().unwrap_or(0);
    let dims = dims_of(
        &x,
        &v,
        &[
            ("out", &out, [BATCH, D1, D3]),
            ("lse", &lse, [BATCH, D1, NONE]),
            ("d_out", &d_out, [BATCH, D1, D3]),
            ("dx", &dx, [BATCH, D1, D2]),
            ("dv", &dv, [v_batch, D2, D3]),
        ],
    )?;
    check_dtype(client, dtype)?;
    let SmmDims { batch, d1, d2, .. } = dims;
    let shared_v = v_batch == 1 && batch > 1;
    let mut v_strides = v.strides.to_vec();
    if shared_v {
        v_strides[0] = 0;
    }
    // What the Hopper kernels' TMA maps and pair stores need beyond the vector.
    let tma = crate::attention::starts_aligned(&[&x, &v, &d_out, &dx, &dv])
        && [&x, &v, &d_out, &dx, &dv]
            .iter()
            .all(|t| t.shape[1] <= 1 || t.strides[1] != 0)
        // The Hopper kernels read dO at its own batch coordinate.
        && (d_out.shape[0] <= 1 || d_out.strides[0] != 0);
    let plan = plan_softmax_matmul_backward_for(
        client,
        dims,
        dtype,
        [
            (x.shape, x.strides),
            (v.shape, &v_strides),
            (d_out.shape, d_out.strides),
            (dx.shape, dx.strides),
            (dv.shape, dv.strides),
        ],
        tma,
        options,
    )?;
    let rows = batch * d1;
    // The flash kernels' 4-D view of a 3-D tensor `[batch or 1, n1, n2]`: one head per batch,
    // or, with a shared `V`, every batch a query head of the one key/value head (so that `dV`
    // sums over the batches in the kernel, as grouped-query attention sums a group).
    let view = |t: &TensorRef<'_>| {
        let (mut shape, mut strides) = (t.shape.to_vec(), t.strides.to_vec());
        if shared_v {
            shape.insert(0, 1);
            strides.insert(0, 0);
            if shape[1] == 1 {
                strides[1] = 0;
            }
        } else {
            shape.insert(1, 1);
            strides.insert(1, 0);
        }
        Operand {
            handle: t.handle.clone(),
            shape,
            strides,
        }
    };
    let operands = BackwardOperands {
        q: view(&x),
        k: view(&x),
        v: view(&v),
        mask: view(&x),
        bias: view(&x),
        slopes: view(&lse),
        sinks: view(&lse),
        seqs: view(&lse),
        out: view(&out),
        d_out: view(&d_out),
        lse: view(&lse),
        dq: view(&dx),
        dk: view(&x),
        dv: view(&dv),
        ds: view(&dx),
    };
    // The P-buffer plan (small d2): the dX kernel stores `P` in a buffer laid out as `dX`,
    // which the dK/dV kernel then stages instead of recomputing it from `X`.
    let p_buffer = plan.p_buffer.then(|| {
        let elems = 1 + dx
            .shape
            .iter()
            .zip(dx.strides)
            .map(|(&n, &s)| n.saturating_sub(1) * s)
            .sum::<usize>();
        let mut p = view(&dx);
        p.handle = client.empty(elems * dtype.size());
        p
    });
    let schedule = match plan.path {
        // Both gradients by the hand-written kernels below; never launched.
        SmmBackwardPath::Hopper | SmmBackwardPath::Ampere => Schedule::MatrixUnits {
            write_ds: true,
            p_buffer: None,
        },
        SmmBackwardPath::MatrixUnits => Schedule::MatrixUnits {
            write_ds: true,
            p_buffer: p_buffer.as_ref(),
        },
        SmmBackwardPath::Tiled => Schedule::UnitsGiven {
            vector: plan.vector,
        },
        SmmBackwardPath::CooperativeMatrix => Schedule::CooperativeMatrix {
            write_ds: true,
            vector: plan.vector,
        },
        SmmBackwardPath::Units => Schedule::Units { write_ds: true },
    };
    let dv_nonempty = dv.shape.iter().product::<usize>() > 0;
    // The tiled products write dX for every row block; the flash schedules skip empty steps.
    let (dv_cubes, dx_cubes) = match plan.path {
        SmmBackwardPath::Tiled => (dv_nonempty.then_some(plan.dv_cubes), Some(plan.dx_cubes)),
        SmmBackwardPath::Hopper | SmmBackwardPath::Ampere => (None, None),
        _ => (
            (dv_nonempty && d2 > 0).then_some(plan.dv_cubes),
            (rows > 0 && d2 > 0).then_some(plan.dx_cubes),
        ),
    };
    // SAFETY: every index is bounds-checked against the shapes passed here, which describe the
    // caller's buffers (`dims_of` checked that they agree); the plan checked the 16-byte rows
    // of `x`, `v` and `d_out` for the matrix units and the vector of the tiled products; the
    // grids are the plan's.
    unsafe {
        let delta = launch_delta(client, &operands.out, &operands.d_out, rows, dtype);
        if matches!(plan.path, SmmBackwardPath::Hopper | SmmBackwardPath::Ampere) {
            // The plan took the hand-written kernels: `hopper_unavailable` (Hopper) or
            // `ampere_unavailable` (Ampere) found nothing against `x`, `v`, `d_out`, `dx`, `dv`
            // (16-byte rows and starts, no size 0), and `delta` holds `batch · d1` rows.
            crate::launch_hand_written!(
                client,
                |cuda| {
                    use crate::flash::backward::{hopper_given, sm80_given};
                    let delta = &delta.handle;
                    if plan.path == SmmBackwardPath::Hopper {
                        hopper_given::launch(cuda, &x, &v, &d_out, &lse, delta, &dx, dtype);
                        hopper_given::launch_dv(cuda, &x, &d_out, &lse, &dv, dtype);
                    } else {
                        sm80_given::launch(cuda, &x, &v, &d_out, &lse, delta, &dx, dtype);
                        sm80_given::launch_dv(cuda, &x, &d_out, &lse, &dv, dtype);
                    }
                },
                Ok(())
            );
        }
        launch_backward(
            client,
            schedule,
            &operands,
            &delta,
            dv_cubes,
            dx_cubes,
            Scalars::GIVEN,
            plan.config,
            dtype,
        );
    }
    Ok(())
}
