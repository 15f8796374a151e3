//! The hand-written attention backwards on the GPU, through `launch_attention_backward` with
//! no Burn: the Hopper one (issue 35), which the plan picks on sm_90 for f16/bf16 calls without
//! a mask or bias, and the Ampere one (issue 56, `ampere_*` tests: forced ahead of the Hopper
//! one by `AmpereUse::Always`, any sm_80+ GPU). Every case's `dQ`, `dK`, `dV` are
//! checked against an f64 reference and against the `mma.sync` backward run on the same forward
//! outputs (the error may be at most twice the `mma` error, plus a floor of a quarter of an
//! output ulp of the largest gradient). Built with `cuda`, run in the GPU suite.

#![cfg(feature = "cuda")]

mod common;

use burn_flash_kernels::attention::{
    AmpereTile, AttentionBackwardKernel, AttentionKernel, AttentionOptions, BackwardTensors,
    TileSchedule, launch_attention, launch_attention_backward,
};
use common::{Case, Half, contiguous, download, draw, max_error, poisoned, t, timed, upload};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

type Client = ComputeClient<CudaRuntime>;

const WHAT: &str = "the Hopper backward tests";

/// `q`, `k`, `v`, `dO` in `[B, H, S, D]` order.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_out: Vec<f32>,
}

impl Inputs {
    fn new(c: &Case, seed: u64) -> Self {
        let n = |s: [usize; 4]| s.iter().product();
        Self {
            q: draw(n(c.q_shape()), seed ^ 1),
            k: draw(n(c.k_shape()), seed ^ 2),
            v: draw(n(c.v_shape()), seed ^ 3),
            d_out: draw(n(c.out_shape()), seed ^ 4),
        }
    }
}

/// `dQ`, `dK`, `dV` in `[B, H, S, D]` order.
struct Grads {
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Elements added at the end of each row of `out` and of `dQ`: buffers that neither TMA nor the
/// row kernels' wide loads and paired stores can take on every row (the per-row kernels read
/// `out` and write `dQ`; `q`, `k`, `v`, `dO` keep their TMA layouts).
#[derive(Clone, Copy)]
struct RowPads {
    out: usize,
    dq: usize,
}

impl RowPads {
    const NONE: Self = Self { out: 0, dq: 0 };
}

/// `[B, H, S, D]` row-major strides with `pad` elements after each row.
fn padded(shape: [usize; 4], pad: usize) -> Vec<usize> {
    let row = shape[3] + pad;
    vec![shape[1] * shape[2] * row, shape[2] * row, row, 1]
}

/// [`run_with`] without row pads.
fn run(
    client: &Client,
    c: &Case,
    half: Half,
    inputs: &Inputs,
    kernel: Option<AttentionKernel>,
    repeats: usize,
) -> (Grads, AttentionBackwardKernel, f64) {
    run_with(client, c, half, inputs, kernel, repeats, RowPads::NONE)
}

/// The forward (the plan's kernel) and then the backward with `kernel` forced for the plan
/// (`None`: the plan's choice); `repeats > 0` times that many backward calls after one; `out`
/// and `dQ` laid out with `pads` (rows padded where nonzero, else the case's strides). Returns
/// the gradients, the backward kernel and the wall milliseconds per backward call.
fn run_with(
    client: &Client,
    c: &Case,
    half: Half,
    inputs: &Inputs,
    kernel: Option<AttentionKernel>,
    repeats: usize,
    pads: RowPads,
) -> (Grads, AttentionBackwardKernel, f64) {
    let dtype = half.dtype();
    let (qs, ks, vs, os) = (c.q_shape(), c.k_shape(), c.v_shape(), c.out_shape());
    let (q_st, do_st) = (c.query_strides(qs), c.query_strides(os));
    let o_st = match pads.out {
        0 => do_st.clone(),
        pad => padded(os, pad),
    };
    let dq_st = match pads.dq {
        0 => q_st.clone(),
        pad => padded(qs, pad),
    };
    let (k_st, v_st) = (contiguous(&ks), contiguous(&vs));
    let lse_shape = [c.b, c.hq, c.sq];
    let lse_st = contiguous(&lse_shape);
    let q_h = upload(client, half, &inputs.q, qs, &q_st);
    let k_h = upload(client, half, &inputs.k, ks, &k_st);
    let v_h = upload(client, half, &inputs.v, vs, &v_st);
    let do_h = upload(client, half, &inputs.d_out, os, &do_st);
    let out_h = poisoned(client, os, &o_st);
    let lse_h = client.empty(lse_shape.iter().product::<usize>() * 4);
    launch_attention(
        client,
        t(&q_h, &qs, &q_st),
        t(&k_h, &ks, &k_st),
        t(&v_h, &vs, &v_st),
        None,
        None,
        None,
        None,
        None,
        t(&out_h, &os, &o_st),
        t(&lse_h, &lse_shape, &lse_st),
        dtype,
        &c.options(None),
    )
    .unwrap_or_else(|e| panic!("{c:?} forward: {e}"));
    let (dq_h, dk_h, dv_h) = (
        poisoned(client, qs, &dq_st),
        poisoned(client, ks, &k_st),
        poisoned(client, vs, &v_st),
    );
    let options = c.options(kernel);
    let tensors = || BackwardTensors {
        q: t(&q_h, &qs, &q_st),
        k: t(&k_h, &ks, &k_st),
        v: t(&v_h, &vs, &v_st),
        mask: None,
        bias: None,
        slopes: None,
        seqs: None,
        out: t(&out_h, &os, &o_st),
        lse: t(&lse_h, &lse_shape, &lse_st),
        d_out: t(&do_h, &os, &do_st),
        dq: t(&dq_h, &qs, &dq_st),
        dk: t(&dk_h, &ks, &k_st),
        dv: t(&dv_h, &vs, &v_st),
        ds: None,
    };
    let backward = || {
        launch_attention_backward(client, tensors(), dtype, &options)
            .unwrap_or_else(|e| panic!("{c:?} {kernel:?} backward: {e}"))
            .kernel
    };
    let (ran, millis) = timed(client, repeats, backward);
    let grads = Grads {
        dq: download(client, half, dq_h, qs, &dq_st),
        dk: download(client, half, dk_h, ks, &k_st),
        dv: download(client, half, dv_h, vs, &v_st),
    };
    (grads, ran, millis)
}

/// The f64 reference gradients of `sum(out ⊙ dO)`.
fn reference(c: &Case, x: &Inputs) -> Grads {
    let scale = c.scale();
    let group = c.hq / c.hkv;
    let mut g = Grads {
        dq: vec![0.0; x.q.len()],
        dk: vec![0.0; x.k.len()],
        dv: vec![0.0; x.v.len()],
    };
    let row = |v: &[f32], i: usize, n: usize| -> Vec<f64> {
        v[i * n..][..n].iter().map(|&a| f64::from(a)).collect()
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for b in 0..c.b {
        for h in 0..c.hq {
            let hk = h / group;
            let k_rows: Vec<Vec<f64>> = (0..c.sk)
                .map(|j| row(&x.k, (b * c.hkv + hk) * c.sk + j, c.d))
                .collect();
            let v_rows: Vec<Vec<f64>> = (0..c.sk)
                .map(|j| row(&x.v, (b * c.hkv + hk) * c.sk + j, c.dv))
                .collect();
            for i in 0..c.sq {
                let qi = (b * c.hq + h) * c.sq + i;
                let q = row(&x.q, qi, c.d);
                let d_o = row(&x.d_out, qi, c.dv);
                // Capped scores and the softcap's derivative factor.
                let mut s = vec![f64::NEG_INFINITY; c.sk];
                let mut cap_grad = vec![1.0; c.sk];
                for j in 0..c.sk {
                    if c.causal && j as i64 > i as i64 + c.sk as i64 - c.sq as i64 {
                        continue;
                    }
                    let raw = scale * dot(&q, &k_rows[j]);
                    s[j] = match c.softcap {
                        Some(cap) => {
                            let th = (raw / f64::from(cap)).tanh();
                            cap_grad[j] = 1.0 - th * th;
                            f64::from(cap) * th
                        }
                        None => raw,
                    };
                }
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let sum: f64 = s.iter().map(|&v| (v - max).exp()).sum();
                let p: Vec<f64> = s.iter().map(|&v| (v - max).exp() / sum).collect();
                let dp: Vec<f64> = v_rows.iter().map(|v| dot(&d_o, v)).collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..c.sk {
                    if p[j] == 0.0 {
                        continue;
                    }
                    let ds = p[j] * (dp[j] - delta) * cap_grad[j] * scale;
                    let kj = (b * c.hkv + hk) * c.sk + j;
                    let dq = &mut g.dq[qi * c.d..][..c.d];
                    for (acc, &k) in dq.iter_mut().zip(&k_rows[j]) {
                        *acc += ds * k;
                    }
                    let dk = &mut g.dk[kj * c.d..][..c.d];
                    for (acc, &q) in dk.iter_mut().zip(&q) {
                        *acc += ds * q;
                    }
                    let dv = &mut g.dv[kj * c.dv..][..c.dv];
                    for (acc, &o) in dv.iter_mut().zip(&d_o) {
                        *acc += p[j] * o;
                    }
                }
            }
        }
    }
    g
}

/// How many values of `a` and `b` differ in their bits.
fn bits_differ(a: &[f64], b: &[f64]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// Checks one case in both types: the plan ran the Hopper backward (the Ampere one where
/// `c.ampere`), and each gradient's error against f64 is at most twice the `mma` backward's
/// plus a quarter ulp of its largest value (head dims over 128: twice the plain-unit
/// backward's plus a whole half-ulp), and at most a tenth of its largest value.
fn check(client: &Client, c: Case, seed: u64) {
    check_with(client, c, seed, RowPads::NONE);
}

/// [`check`] with the Hopper backward's `out` and `dQ` laid out with `pads` (the `mma`
/// baseline's unpadded).
fn check_with(client: &Client, c: Case, seed: u64, pads: RowPads) {
    let inputs = Inputs::new(&c, seed);
    let want = reference(&c, &inputs);
    for half in [Half::F16, Half::Bf16] {
        let (hopper, kernel, _) = run_with(client, &c, half, &inputs, None, 0, pads);
        let expected = if c.ampere {
            AttentionBackwardKernel::Ampere
        } else {
            AttentionBackwardKernel::Hopper
        };
        assert_eq!(kernel, expected, "{c:?} {half:?}");
        let (mma, kernel, _) = run(
            client,
            &c,
            half,
            &inputs,
            Some(AttentionKernel::MatrixUnits),
            0,
        );
        // The `mma.sync` backward takes head dims up to 128; above, the forced `mma` forward's
        // backward is the plain-unit one (f32 accumulators: the stricter baseline).
        let baseline = if c.d.max(c.dv) > 128 {
            AttentionBackwardKernel::Units
        } else {
            AttentionBackwardKernel::MatrixUnits
        };
        assert_eq!(kernel, baseline, "{c:?} {half:?}");
        for (name, got, base, want) in [
            ("dQ", &hopper.dq, &mma.dq, &want.dq),
            ("dK", &hopper.dk, &mma.dk, &want.dk),
            ("dV", &hopper.dv, &mma.dv, &want.dv),
        ] {
            let (err, err_mma) = (max_error(got, want), max_error(base, want));
            // Against the plain units, which keep `P` and `dS` in f32 where the matrix-unit
            // kernels round them to the element type, the floor is a whole half-ulp (the
            // root suite holds these head dims to the 2×-naive rule).
            let floor = if baseline == AttentionBackwardKernel::Units {
                1.0
            } else {
                0.25
            };
            let allowed = 2.0 * err_mma + floor * half.half_ulp() * max_abs(want);
            println!("{c:?} {half:?} {name}: max error {err:.3e} (mma {err_mma:.3e})");
            assert!(
                err <= allowed,
                "{c:?} {half:?} {name}: max error {err:e} > {allowed:e} (mma {err_mma:e})"
            );
            // Whatever the baseline: a bug it shares (a mutation of both backwards, as
            // `zero-dq`) must not pass as "twice the baseline's error".
            assert!(
                err <= 0.1 * max_abs(want),
                "{c:?} {half:?} {name}: max error {err:e} over 10 % of the largest gradient"
            );
        }
    }
}

/// Non-causal calls: head dims 64 and 128 and their rounding (96, 72; Dv ≠ D), lengths that
/// leave partial row and key blocks, grouped-query heads, softcap, `[B, S, H, D]` strides.
#[test]
fn hopper_backward_matches_f64() {
    common::check_cases(WHAT, common::grid(), 0, check);
}

/// Causal calls, bottom-right aligned: `Sq = Sk`, `Sq < Sk`, and `Sq > Sk` (rows without a key
/// give nothing), small shapes below one block.
#[test]
fn hopper_causal_backward_matches_f64() {
    let small = [
        Case {
            causal: true,
            ..Case::new(1, 2, 2, 17, 17, 32, 32)
        },
        Case::new(2, 2, 1, 5, 3, 16, 24),
    ];
    common::check_cases(
        WHAT,
        common::causal_grid().into_iter().chain(small),
        100,
        check,
    );
}

/// The per-row kernels' layouts (`hopper_rows.cu`): `out` rows of `Dv + 2` elements (every
/// other row's `O` not 8-byte aligned: `δ` by single elements there, by 4-element loads on the
/// others) and `dQ` rows of `D + 1` (every other row's pairs not 4-byte aligned: single
/// stores), `dQ` rows past `Sq` inside a 16-row group (the second row of a warp's pair), a head
/// dim below the accumulator's columns (96 of 128), the tiled and the deterministic
/// accumulators.
#[test]
fn hopper_backward_row_layouts() {
    let pads = RowPads { out: 2, dq: 1 };
    let cases = [
        Case::new(2, 4, 2, 200, 150, 128, 128),
        Case::new(1, 2, 1, 77, 130, 96, 72),
        Case::new(1, 2, 2, 40, 64, 64, 64),
        Case {
            deterministic: true,
            causal: true,
            ..Case::new(1, 2, 1, 100, 120, 64, 64)
        },
    ];
    common::check_cases(WHAT, cases, 400, |client, c, seed| {
        check_with(client, c, seed, pads)
    });
}

/// The CUDA client of the default device, which must have the matrix units (sm_80+): what the
/// Ampere backward runs on.
fn ampere_client() -> Client {
    let client = CudaRuntime::client(&cubecl::cuda::CudaDevice::default());
    let mma = burn_flash_kernels::fragment::unavailable(&client, Half::F16.dtype(), true);
    assert!(
        mma.is_none(),
        "the Ampere backward tests need an sm_80+ GPU: {mma:?}"
    );
    client
}

/// The Ampere backward (forced: [`AttentionOptions::ampere_backward`]) meets [`check`]'s rule
/// on the calls it takes: head dims 64 and 128 and their rounding (96, 72, 32, 16; `Dv ≠ D`),
/// partial row and key blocks, grouped-query heads (groups of 2 and 4), `[B, S, H, D]` strides,
/// causal with `Sq = Sk`, `Sq < Sk` and `Sq > Sk` (rows without a key), a softcap, several key
/// blocks and many steps per block; and with `out` and `dQ` rows padded (the per-row passes'
/// row-major accumulator). The `ds-store-skipped`, `warp-cols` and `zero-dk` mutations must
/// fail it. (The other score rules: the root suite's `ampere_backward_rules`.)
///
/// [`AttentionOptions::ampere_backward`]: burn_flash_kernels::attention::AttentionOptions::ampere_backward
#[test]
fn ampere_backward_matches_f64() {
    let takes = |c: &Case| c.d.max(c.dv) <= 128;
    let causal = |c: Case| Case { causal: true, ..c };
    let extra = [
        causal(Case::new(1, 2, 2, 17, 17, 32, 32)),
        Case::new(2, 2, 1, 5, 3, 16, 24),
        causal(Case::new(2, 4, 1, 700, 900, 128, 128)),
        Case::new(1, 8, 2, 300, 260, 64, 64),
    ];
    let cases = common::grid()
        .into_iter()
        .chain(common::causal_grid())
        .filter(takes)
        .chain(extra)
        .map(|c| Case { ampere: true, ..c });
    let client = ampere_client();
    common::check_cases_on(&client, cases, 600, check);
    let padded = [
        Case::new(2, 4, 2, 200, 150, 128, 128),
        causal(Case::new(1, 2, 1, 77, 130, 96, 72)),
    ]
    .map(|c| Case { ampere: true, ..c });
    let pads = RowPads { out: 2, dq: 1 };
    common::check_cases_on(&client, padded, 700, |client, c, seed| {
        check_with(client, c, seed, pads)
    });
}

/// The Ampere backward's other block shapes, forced on this GPU ([`AmpereTile`]): `Narrow`
/// (64 keys, one stage — what the plan gives GPUs with 99 KiB of shared memory a block,
/// sm_86 and sm_89, at D 128) and `Paired` (64 keys, two blocks a SM at 128 registers, two
/// stages where they fit): [`check`]'s rule at D 128 and 64 and a rounded head dim, causal
/// with `Sq <, > Sk`, GQA, partial key blocks.
#[test]
fn ampere_backward_shapes_match_f64() {
    let causal = |c: Case| Case { causal: true, ..c };
    let cases = [
        Case::new(2, 4, 2, 200, 333, 128, 128),
        causal(Case::new(1, 4, 1, 300, 260, 64, 64)),
        causal(Case::new(1, 2, 2, 77, 150, 96, 72)),
        Case::new(1, 8, 2, 130, 700, 64, 128),
    ];
    for tile in [AmpereTile::Narrow, AmpereTile::Paired] {
        let cases = cases.map(|c| Case {
            ampere: true,
            ampere_tile: tile,
            ..c
        });
        common::check_cases_on(&ampere_client(), cases, 800, check);
    }
}

#[test]
fn ampere_backward_declines() {
    use burn_flash_kernels::attention::{AttentionDims, AttentionFeatures, ampere_reason};
    let client = ampere_client();
    let dims = |d: usize| AttentionDims {
        batch: 1,
        heads_q: 2,
        heads_kv: 2,
        seq_q: 100,
        seq_k: 100,
        head_dim: d,
        value_dim: d,
    };
    let aligned = AttentionFeatures {
        aligned: true,
        ..Default::default()
    };
    let base = Case {
        ampere: true,
        ..Case::new(1, 2, 2, 100, 100, 128, 128)
    }
    .options(None);
    let dtype = Half::Bf16.dtype();
    assert_eq!(
        ampere_reason(&client, dims(128), dtype, aligned, &base, false),
        None
    );
    for (what, dims, options, write_ds) in [
        ("head dim", dims(256), base, false),
        (
            "dS under a softcap",
            dims(128),
            AttentionOptions {
                softcap: Some(5.0),
                ..base
            },
            true,
        ),
        (
            "deterministic",
            dims(128),
            AttentionOptions {
                deterministic: true,
                ..base
            },
            false,
        ),
    ] {
        let reason = ampere_reason(&client, dims, dtype, aligned, &options, write_ds);
        println!("{what}: {reason:?}");
        assert!(
            reason.is_some(),
            "{what}: the Ampere backward took the call"
        );
    }
    // A forced forward kernel keeps its own backward.
    let c = Case {
        ampere: true,
        ..Case::new(1, 2, 2, 100, 100, 64, 64)
    };
    let inputs = Inputs::new(&c, common::seed());
    let (_, kernel, _) = run(
        &client,
        &c,
        Half::Bf16,
        &inputs,
        Some(AttentionKernel::MatrixUnits),
        0,
    );
    assert_eq!(kernel, AttentionBackwardKernel::MatrixUnits);
}

/// The persistent backward ([`TileSchedule::Blocks`], [`TileSchedule::Persistent`]): blocks
/// that run many tiles in rounds give the per-tile backward's `dK` and `dV` bit for bit (each
/// tile's arithmetic is the same) and its `dQ` within a few ulps (the adds into the accumulator
/// come in another order), on head dims 64, 128 and 256, causal and grouped-query calls, with
/// partial key blocks and rows that see no key. The `kv-early` mutation must fail it.
#[test]
fn hopper_persistent_backward() {
    let client = common::hopper_client(WHAT);
    let seed = common::seed();
    let cases = [
        Case::new(2, 4, 2, 300, 700, 128, 128),
        Case {
            causal: true,
            ..Case::new(2, 4, 1, 900, 500, 128, 128)
        },
        Case::new(1, 6, 3, 260, 520, 64, 64),
        Case {
            causal: true,
            ..Case::new(1, 4, 4, 333, 333, 256, 256)
        },
    ];
    for (i, c) in cases.into_iter().enumerate() {
        let inputs = Inputs::new(&c, seed.wrapping_add(500 + i as u64));
        for half in [Half::Bf16, Half::F16] {
            let (per_tile, kernel, _) = run(&client, &c, half, &inputs, None, 0);
            assert_eq!(kernel, AttentionBackwardKernel::Hopper, "{c:?} {half:?}");
            for schedule in [TileSchedule::Blocks(3), TileSchedule::Persistent] {
                let p = Case { schedule, ..c };
                let (got, kernel, _) = run(&client, &p, half, &inputs, None, 0);
                assert_eq!(kernel, AttentionBackwardKernel::Hopper, "{p:?} {half:?}");
                for (name, a, b) in [("dK", &got.dk, &per_tile.dk), ("dV", &got.dv, &per_tile.dv)] {
                    let differ = bits_differ(a, b);
                    assert_eq!(
                        differ, 0,
                        "{p:?} {half:?} {name}: {differ} values differ from one block per tile"
                    );
                }
                let diff = max_error(&got.dq, &per_tile.dq);
                println!("{p:?} {half:?}: dK, dV equal; |dQ − per tile| {diff:.2e}");
                assert!(
                    diff <= 4.0 * half.half_ulp() * max_abs(&per_tile.dq).max(1e-3),
                    "{p:?} {half:?} dQ: |persistent − per tile| = {diff:e}"
                );
            }
        }
    }
}

/// Small deterministic calls ([`AttentionOptions::deterministic`]) meet [`check`]'s rule: D 64
/// causal with `Sq < Sk`, D 128 with grouped-query heads and a partial last key block (small
/// enough for compute-sanitizer).
///
/// [`AttentionOptions::deterministic`]: burn_flash_kernels::attention::AttentionOptions::deterministic
#[test]
fn hopper_deterministic_backward_matches_f64() {
    let cases = [
        Case {
            deterministic: true,
            causal: true,
            ..Case::new(1, 4, 2, 300, 333, 64, 64)
        },
        Case {
            deterministic: true,
            ..Case::new(2, 4, 1, 130, 300, 128, 128)
        },
    ];
    common::check_cases(WHAT, cases, 200, check);
}

/// The deterministic option ([`AttentionOptions::deterministic`]): the plan keeps the Hopper
/// backward, and at sizes where 16–32 key blocks add into
/// each 64-row block of `dQ` (D 64, whose two consumers add into one tile; D 128 causal with
/// `Sq < Sk`; grouped-query heads) two runs give the same bits of `dQ`, `dK` and `dV`, within a
/// few ulps of the default (unordered) backward's. The `dq-unordered` mutation must fail it.
///
/// [`AttentionOptions::deterministic`]: burn_flash_kernels::attention::AttentionOptions::deterministic
#[test]
fn hopper_deterministic_backward_bits() {
    let client = common::hopper_client(WHAT);
    let seed = common::seed();
    let cases = [
        Case {
            deterministic: true,
            ..Case::new(2, 8, 4, 1500, 2048, 64, 64)
        },
        Case {
            deterministic: true,
            causal: true,
            ..Case::new(1, 8, 2, 2048, 4096, 128, 128)
        },
    ];
    for (i, c) in cases.into_iter().enumerate() {
        let inputs = Inputs::new(&c, seed.wrapping_add(300 + i as u64));
        for half in [Half::Bf16, Half::F16] {
            let (first, kernel, _) = run(&client, &c, half, &inputs, None, 0);
            assert_eq!(kernel, AttentionBackwardKernel::Hopper, "{c:?} {half:?}");
            let (second, _, _) = run(&client, &c, half, &inputs, None, 0);
            let unordered = Case {
                deterministic: false,
                ..c
            };
            let (default, _, _) = run(&client, &unordered, half, &inputs, None, 0);
            for (name, a, b, base) in [
                ("dQ", &first.dq, &second.dq, &default.dq),
                ("dK", &first.dk, &second.dk, &default.dk),
                ("dV", &first.dv, &second.dv, &default.dv),
            ] {
                let differ = bits_differ(a, b);
                let diff = max_error(a, base);
                println!(
                    "{c:?} {half:?} {name}: {differ} of {} differ between runs, |ordered − default| {diff:.2e}",
                    a.len()
                );
                assert_eq!(differ, 0, "{c:?} {half:?} {name}: runs differ");
                assert!(
                    diff <= 8.0 * half.half_ulp() * max_abs(base).max(1.0),
                    "{c:?} {half:?} {name}: |ordered − default| = {diff:e}"
                );
            }
        }
    }
}

/// The measured shapes ([`common::at_size_cases`]): the Hopper gradients equal the `mma`
/// backward's to a few ulps of the largest, and both times are printed (wall time per backward
/// call over 10 calls, TFLOP/s counting 2.5 × the forward).
#[test]
fn hopper_backward_at_size() {
    common::at_size(WHAT, 2.5, true, Inputs::new, |client, c, half, inputs| {
        let (hopper, kernel, hopper_ms) = run(client, c, half, inputs, None, 10);
        assert_eq!(kernel, AttentionBackwardKernel::Hopper);
        let (mma, _, mma_ms) = run(
            client,
            c,
            half,
            inputs,
            Some(AttentionKernel::MatrixUnits),
            10,
        );
        common::AtSize {
            hopper_ms,
            mma_ms,
            outputs: vec![
                ("dQ", hopper.dq, mma.dq),
                ("dK", hopper.dk, mma.dk),
                ("dV", hopper.dv, mma.dv),
            ],
        }
    });
}
