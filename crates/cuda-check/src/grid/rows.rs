//! Row kernels: the softmax family, `softmax(X)·V`, and the serving pieces (the few-rows
//! linear, the layer norm, the copy benchmarks compare with).

use burn_flash_kernels::attention::AmpereUse;
use burn_flash_kernels::copy::launch_copy;
use burn_flash_kernels::linear::{LinearTensors, launch_linear_rows};
use burn_flash_kernels::norm::{LayerNormTensors, launch_layer_norm};
use burn_flash_kernels::softmax::{
    SoftmaxOptions, SoftmaxTier, SoftmaxVariant, launch_softmax, launch_softmax_backward,
};
use burn_flash_kernels::softmax_matmul::{
    SmmPath, SoftmaxMatmulOptions, launch_softmax_matmul, launch_softmax_matmul_backward,
};
use cubecl::ir::FloatKind;

use super::{Arch, Call, F32, Owned, dtype_name, dtypes, float, push};

/// The softmax family: each tier × variant × direction, at a width the tier takes.
pub(super) fn softmax(calls: &mut Vec<Call>, archs: &[Arch], all: bool) {
    let kinds = dtypes(all, &[FloatKind::F32, FloatKind::BF16]);
    for &kind in kinds {
        let dtype = float(kind);
        for (tier, width, dim) in [
            (SoftmaxTier::Plane, 512, 1),
            (SoftmaxTier::Cube, 8192, 1),
            (SoftmaxTier::Split, 65_536, 1),
            (SoftmaxTier::Exchange, 65_536, 1),
            (SoftmaxTier::Strided, 64, 0),
        ] {
            for variant in [
                SoftmaxVariant::Softmax,
                SoftmaxVariant::LogSoftmax,
                SoftmaxVariant::QuietSoftmax,
            ] {
                if !all && kind != FloatKind::F32 && variant != SoftmaxVariant::Softmax {
                    continue;
                }
                let shape = if dim == 1 { [32, width] } else { [width, 96] };
                let name = format!(
                    "softmax {tier:?} {variant:?} {} {shape:?} dim {dim}",
                    dtype_name(kind)
                );
                let o = SoftmaxOptions {
                    tier: Some(tier),
                    ..Default::default()
                };
                push(calls, format!("{name} fwd"), archs.to_vec(), move |c| {
                    let x = Owned::new(c, &shape, dtype);
                    let y = Owned::new(c, &shape, dtype);
                    launch_softmax(c, x.r(), y.r(), dim, dtype, variant, o)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                });
                push(calls, format!("{name} bwd"), archs.to_vec(), move |c| {
                    let y = Owned::new(c, &shape, dtype);
                    let dy = Owned::new(c, &shape, dtype);
                    let dx = Owned::new(c, &shape, dtype);
                    launch_softmax_backward(c, y.r(), dy.r(), dx.r(), dim, dtype, variant, o)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                });
            }
        }
    }
}

/// `softmax(X)·V`: each path (plain units, matrix units, Hopper) × dtype × value widths.
pub(super) fn softmax_matmul(calls: &mut Vec<Call>, archs: &[Arch], all: bool) {
    for (path, hopper, ampere, kinds) in [
        (SmmPath::Units, false, false, vec![FloatKind::F32]),
        (
            SmmPath::MatrixUnits,
            false,
            false,
            vec![FloatKind::F16, FloatKind::BF16],
        ),
        (SmmPath::MatrixUnits, true, false, vec![FloatKind::BF16]),
        // The Ampere backward (`sm80_given`, forced: opt-in), every arch.
        (
            SmmPath::MatrixUnits,
            false,
            true,
            vec![FloatKind::F16, FloatKind::BF16],
        ),
    ] {
        let archs: Vec<Arch> = archs
            .iter()
            .copied()
            .filter(|a| !hopper || a.cc == 90)
            .collect();
        for kind in kinds {
            for d3 in if all {
                vec![64, 128, 256, 512]
            } else {
                vec![128, 512]
            } {
                let dtype = float(kind);
                let o = SoftmaxMatmulOptions {
                    path: Some(path),
                    hopper: Some(hopper),
                    ampere: if ampere {
                        AmpereUse::Always
                    } else {
                        AmpereUse::Off
                    },
                    ..Default::default()
                };
                let name = format!(
                    "softmax_matmul {path:?}{}{} {} d3 {d3}",
                    if hopper { " Hopper" } else { "" },
                    if ampere { " Ampere" } else { "" },
                    dtype_name(kind)
                );
                let (b, d1, d2) = (2, 300, 1024);
                // The Ampere rows differ from the matrix units' in the backward only.
                let fwd_archs = if ampere { Vec::new() } else { archs.clone() };
                push(calls, format!("{name} fwd"), fwd_archs, move |c| {
                    let t = |shape: &[usize], dt| Owned::new(c, shape, dt);
                    let (x, v) = (t(&[b, d1, d2], dtype), t(&[b, d2, d3], dtype));
                    let (out, lse) = (t(&[b, d1, d3], dtype), t(&[b, d1], F32));
                    launch_softmax_matmul(c, x.r(), v.r(), out.r(), lse.r(), dtype, o)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                });
                push(calls, format!("{name} bwd"), archs.clone(), move |c| {
                    let t = |shape: &[usize], dt| Owned::new(c, shape, dt);
                    let (x, v) = (t(&[b, d1, d2], dtype), t(&[b, d2, d3], dtype));
                    let (out, lse) = (t(&[b, d1, d3], dtype), t(&[b, d1], F32));
                    let (d_out, dx, dv) = (
                        t(&[b, d1, d3], dtype),
                        t(&[b, d1, d2], dtype),
                        t(&[b, d2, d3], dtype),
                    );
                    launch_softmax_matmul_backward(
                        c,
                        x.r(),
                        v.r(),
                        out.r(),
                        lse.r(),
                        d_out.r(),
                        dx.r(),
                        dv.r(),
                        dtype,
                        o,
                    )
                    .map_err(|e| e.to_string())
                });
            }
        }
    }
}

/// The serving pieces: the few-rows linear, the layer norm, the copy benchmarks compare with.
pub(super) fn rows(calls: &mut Vec<Call>, archs: &[Arch], all: bool) {
    let kinds = dtypes(all, &[FloatKind::F32, FloatKind::BF16]);
    for &kind in kinds {
        let dtype = float(kind);
        for (m, bias) in [(1, true), (16, false)] {
            push(
                calls,
                format!(
                    "linear {} M{m}{}",
                    dtype_name(kind),
                    if bias { " bias" } else { "" }
                ),
                archs.to_vec(),
                move |c| {
                    let t = |shape: &[usize], dt| Owned::new(c, shape, dt);
                    let (x, w, b, out) = (
                        t(&[m, 512], dtype),
                        t(&[512, 1536], dtype),
                        t(&[1536], dtype),
                        t(&[m, 1536], dtype),
                    );
                    let lt = LinearTensors {
                        x: x.r(),
                        w: w.r(),
                        bias: bias.then(|| b.r()),
                        out: out.r(),
                    };
                    launch_linear_rows(c, lt, dtype).map_err(|e| e.to_string())
                },
            );
        }
        for width in [512, 4096] {
            push(
                calls,
                format!("layer_norm {} width {width}", dtype_name(kind)),
                archs.to_vec(),
                move |c| {
                    let t = |shape: &[usize], dt| Owned::new(c, shape, dt);
                    let (x, g, b, out) = (
                        t(&[64, width], dtype),
                        t(&[width], dtype),
                        t(&[width], dtype),
                        t(&[64, width], dtype),
                    );
                    let lt = LayerNormTensors {
                        x: x.r(),
                        gamma: g.r(),
                        beta: Some(b.r()),
                        out: out.r(),
                    };
                    launch_layer_norm(c, lt, 1e-5, dtype).map_err(|e| e.to_string())
                },
            );
        }
        push(
            calls,
            format!("copy {}", dtype_name(kind)),
            archs.to_vec(),
            move |c| {
                let len = 1 << 20;
                let (a, b) = (c.empty(len * dtype.size()), c.empty(len * dtype.size()));
                launch_copy(c, &a, &b, len, dtype);
                Ok(())
            },
        );
    }
}
