//! The Hopper attention forward (issue 35) on the GPU, through `launch_attention` with no Burn:
//! the plan picks it on sm_90 for f16/bf16, and every case is checked against an f64 reference
//! and against the `mma.sync` kernel forced on the same inputs (the Hopper kernel's error may
//! be at most twice the `mma` kernel's, plus a floor of a quarter of an output ulp). Needs a
//! Hopper GPU: built with `cuda`, run in the GPU suite.

#![cfg(feature = "cuda")]

mod common;

use common::{Case, Half, contiguous, download, draw, max_error, poisoned, t, timed, upload};

use burn_flash_kernels::attention::{AttentionKernel, AttentionPlan, launch_attention};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;

type Client = ComputeClient<CudaRuntime>;

const WHAT: &str = "the Hopper forward tests";

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Inputs {
    /// `q`, `k`, `v` of case `c` from `seed` ([`draw`]), in `[B, H, S, D]` order.
    fn new(c: &Case, seed: u64) -> Self {
        let n = |h: usize, s: usize, d: usize| c.b * h * s * d;
        Self {
            q: draw(n(c.hq, c.sq, c.d), seed ^ 1),
            k: draw(n(c.hkv, c.sk, c.d), seed ^ 2),
            v: draw(n(c.hkv, c.sk, c.dv), seed ^ 3),
        }
    }
}

struct Outputs {
    out: Vec<f64>,
    lse: Vec<f32>,
    plan: AttentionPlan,
    millis: f64,
}

/// Runs the case (`repeats` timed launches after one warm-up when `repeats > 0`); returns the
/// outputs in `[B, Hq, Sq, Dv]` order.
fn run(
    client: &Client,
    c: &Case,
    half: Half,
    inputs: &Inputs,
    kernel: Option<AttentionKernel>,
    repeats: usize,
) -> Outputs {
    let (q_shape, k_shape, v_shape, out_shape) =
        (c.q_shape(), c.k_shape(), c.v_shape(), c.out_shape());
    let lse_shape = [c.b, c.hq, c.sq];
    let (q_strides, out_strides) = (c.query_strides(q_shape), c.query_strides(out_shape));
    let (k_strides, v_strides, lse_strides) = (
        contiguous(&k_shape),
        contiguous(&v_shape),
        contiguous(&lse_shape),
    );
    let q_h = upload(client, half, &inputs.q, q_shape, &q_strides);
    let k_h = upload(client, half, &inputs.k, k_shape, &k_strides);
    let v_h = upload(client, half, &inputs.v, v_shape, &v_strides);
    let out_h = poisoned(client, out_shape, &out_strides);
    let lse_h = client.create_from_slice(
        &vec![f32::NAN; lse_shape.iter().product()]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    let options = c.options(kernel);
    let launch = || {
        launch_attention(
            client,
            t(&q_h, &q_shape, &q_strides),
            t(&k_h, &k_shape, &k_strides),
            t(&v_h, &v_shape, &v_strides),
            None,
            None,
            None,
            None,
            None,
            t(&out_h, &out_shape, &out_strides),
            t(&lse_h, &lse_shape, &lse_strides),
            half.dtype(),
            &options,
        )
        .unwrap_or_else(|e| panic!("{c:?} {kernel:?}: {e}"))
    };
    let (plan, millis) = timed(client, repeats, launch);
    let out = download(client, half, out_h, out_shape, &out_strides);
    let lse = client
        .read_one(lse_h)
        .expect("reads `lse`")
        .chunks_exact(4)
        .map(|p| f32::from_le_bytes([p[0], p[1], p[2], p[3]]))
        .collect();
    Outputs {
        out,
        lse,
        plan,
        millis,
    }
}

/// The f64 reference: `out` `[B, Hq, Sq, Dv]` and `lse` (`-inf` for rows without a key).
fn reference(c: &Case, inputs: &Inputs) -> (Vec<f64>, Vec<f64>) {
    let scale = 1.0 / (c.d as f64).sqrt();
    let group = c.hq / c.hkv;
    let mut out = vec![0.0; c.b * c.hq * c.sq * c.dv];
    let mut lse = vec![f64::NEG_INFINITY; c.b * c.hq * c.sq];
    let mut scores = vec![0.0; c.sk];
    for b in 0..c.b {
        for h in 0..c.hq {
            let hk = h / group;
            for i in 0..c.sq {
                let qrow = &inputs.q[((b * c.hq + h) * c.sq + i) * c.d..][..c.d];
                let mut max = f64::NEG_INFINITY;
                for (j, score) in scores.iter_mut().enumerate() {
                    let visible = !c.causal || j as i64 <= i as i64 + c.sk as i64 - c.sq as i64;
                    *score = if visible {
                        let krow = &inputs.k[((b * c.hkv + hk) * c.sk + j) * c.d..][..c.d];
                        let dot: f64 = qrow
                            .iter()
                            .zip(krow)
                            .map(|(&x, &y)| f64::from(x) * f64::from(y))
                            .sum();
                        let s = dot * scale;
                        match c.softcap {
                            Some(cap) => f64::from(cap) * (s / f64::from(cap)).tanh(),
                            None => s,
                        }
                    } else {
                        f64::NEG_INFINITY
                    };
                    max = max.max(*score);
                }
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let sum: f64 = scores.iter().map(|&s| (s - max).exp()).sum();
                lse[(b * c.hq + h) * c.sq + i] = max + sum.ln();
                let orow = &mut out[((b * c.hq + h) * c.sq + i) * c.dv..][..c.dv];
                for (j, &s) in scores.iter().enumerate() {
                    let p = (s - max).exp() / sum;
                    if p == 0.0 {
                        continue;
                    }
                    let vrow = &inputs.v[((b * c.hkv + hk) * c.sk + j) * c.dv..][..c.dv];
                    for (o, &x) in orow.iter_mut().zip(vrow) {
                        *o += p * f64::from(x);
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Checks one case in both types: the plan picked the Hopper kernel, the output and lse
/// against f64, the error against the `mma` kernel's.
fn check(client: &Client, c: Case, seed: u64) {
    let inputs = Inputs::new(&c, seed);
    let (want, want_lse) = reference(&c, &inputs);
    for half in [Half::F16, Half::Bf16] {
        let hopper = run(client, &c, half, &inputs, None, 0);
        assert_eq!(
            hopper.plan.kernel,
            AttentionKernel::Hopper,
            "{c:?} {half:?}"
        );
        let mma = run(
            client,
            &c,
            half,
            &inputs,
            Some(AttentionKernel::MatrixUnits),
            0,
        );
        let (err, err_mma) = (max_error(&hopper.out, &want), max_error(&mma.out, &want));
        let allowed = 2.0 * err_mma + 0.25 * half.half_ulp();
        println!("{c:?} {half:?}: max error {err:.3e} (mma {err_mma:.3e})");
        assert!(
            err <= allowed,
            "{c:?} {half:?}: max error {err:e} > {allowed:e} (mma kernel {err_mma:e})"
        );
        for (i, (&got, &w)) in hopper.lse.iter().zip(&want_lse).enumerate() {
            let ok = if w == f64::NEG_INFINITY {
                got == f32::NEG_INFINITY
            } else {
                (f64::from(got) - w).abs() <= 1e-3 * w.abs().max(1.0)
            };
            assert!(ok, "{c:?} {half:?}: lse[{i}] = {got}, want {w}");
        }
    }
}

/// Non-causal calls: both head dims and their rounding (D 64, 128, 96, 72 with Dv ≠ D),
/// lengths that leave partial row and key blocks, grouped-query heads, softcap, `q` and `out`
/// read and written through `[B, S, H, D]` strides.
#[test]
fn hopper_forward_matches_f64() {
    common::check_cases(WHAT, common::grid(), 0, check);
}

/// Causal calls, bottom-right aligned: `Sq = Sk`, `Sq < Sk`, and `Sq > Sk`, whose first
/// `Sq − Sk` rows see no key (zeros, `lse = −inf`).
#[test]
fn hopper_causal_forward_matches_f64() {
    common::check_cases(WHAT, common::causal_grid(), 100, check);
}

/// The measured shapes ([`common::at_size_cases`]): the Hopper output equals the `mma`
/// kernel's to a few output ulps, and both times are printed (wall time per call over 20
/// calls).
#[test]
fn hopper_forward_at_size() {
    common::at_size(WHAT, 1.0, false, Inputs::new, |client, c, half, inputs| {
        let hopper = run(client, c, half, inputs, None, 20);
        let mma = run(
            client,
            c,
            half,
            inputs,
            Some(AttentionKernel::MatrixUnits),
            20,
        );
        assert_eq!(hopper.plan.kernel, AttentionKernel::Hopper);
        common::AtSize {
            hopper_ms: hopper.millis,
            mma_ms: mma.millis,
            outputs: vec![("out", hopper.out, mma.out)],
        }
    });
}

/// Shapes below one TMA box (`Sq` 17 under causal, head dims 8 and 32, whose boxes reach past
/// the rows), against f64 and the `mma` kernel.
#[test]
fn hopper_forward_small_shapes() {
    let cases = [
        Case {
            causal: true,
            ..Case::new(1, 2, 2, 17, 17, 32, 32)
        },
        Case::new(1, 2, 2, 37, 70, 8, 8),
        Case::new(2, 2, 1, 5, 3, 16, 24),
    ];
    common::check_cases(WHAT, cases, 200, check);
}

/// Inputs written on one thread and the forward launched from another (Burn's streams follow
/// threads): the same result as one thread.
#[test]
fn hopper_forward_across_threads() {
    let seed = common::seed();
    let c = Case::new(1, 2, 2, 200, 300, 64, 64);
    let inputs = Inputs::new(&c, seed);
    let (want, _) = reference(&c, &inputs);
    let client = common::hopper_client(WHAT);
    let encode = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|&x| Half::F16.bits(x).to_le_bytes())
            .collect()
    };
    let (q_h, k_h, v_h) = std::thread::scope(|s| {
        s.spawn(|| {
            let client = CudaRuntime::client(&CudaDevice::default());
            (
                client.create_from_slice(&encode(&inputs.q)),
                client.create_from_slice(&encode(&inputs.k)),
                client.create_from_slice(&encode(&inputs.v)),
            )
        })
        .join()
        .expect("the writer thread")
    });
    let q_shape = [c.b, c.hq, c.sq, c.d];
    let k_shape = [c.b, c.hkv, c.sk, c.d];
    let out_shape = [c.b, c.hq, c.sq, c.dv];
    let lse_shape = [c.b, c.hq, c.sq];
    let n_out: usize = out_shape.iter().product();
    let out_h = client.create_from_slice(&[0xc0u8, 0x7f].repeat(n_out));
    let lse_h = client.create_from_slice(&vec![0u8; 4 * lse_shape.iter().product::<usize>()]);
    let strides: Vec<Vec<usize>> = [&q_shape[..], &k_shape, &out_shape, &lse_shape]
        .iter()
        .map(|s| contiguous(s))
        .collect();
    let plan = launch_attention(
        &client,
        t(&q_h, &q_shape, &strides[0]),
        t(&k_h, &k_shape, &strides[1]),
        t(&v_h, &k_shape, &strides[1]),
        None,
        None,
        None,
        None,
        None,
        t(&out_h, &out_shape, &strides[2]),
        t(&lse_h, &lse_shape, &strides[3]),
        Half::F16.dtype(),
        &c.options(None),
    )
    .expect("launches");
    assert_eq!(plan.kernel, AttentionKernel::Hopper);
    let got: Vec<f64> = client
        .read_one(out_h)
        .expect("reads `out`")
        .chunks_exact(2)
        .map(|p| Half::F16.value(u16::from_le_bytes([p[0], p[1]])))
        .collect();
    let err = max_error(&got, &want);
    assert!(err <= 4.0 * Half::F16.half_ulp(), "max error {err:e}");
}
