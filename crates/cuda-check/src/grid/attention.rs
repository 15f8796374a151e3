//! Attention calls (each kernel path × dtype × head-dim class × feature set, forward and
//! backward) and decoding calls (split-KV over contiguous and paged caches, the cache appends).

use burn_flash_kernels::attention::{
    AmpereTile, AmpereUse, AttentionBackwardKernel, AttentionDims, AttentionKernel,
    AttentionOptions, BackwardOverlap, BackwardTensors, TileSchedule, launch_attention,
    launch_attention_backward,
};
use burn_flash_kernels::decode::{
    AppendTensors, DecodeTensors, Paged, Rope, launch_append, launch_decode,
};
use burn_flash_kernels::dropout::DropoutParams;
use cubecl::ir::FloatKind;
use cubecl::prelude::*;

use super::{Arch, Call, Client, F32, Owned, U32, dtype_name, dtypes, float, push};

/// The score features of an attention call.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
struct Features {
    causal: bool,
    mask: bool,
    fill: bool,
    bias: bool,
    /// The bias is broadcast along the rows (`[1, Hq, 1, Sk]`).
    rows: bool,
    softcap: bool,
    quiet: bool,
    dropout: bool,
    window: bool,
    alibi: bool,
    sinks: bool,
    varlen: bool,
    /// Backward: `dS` written (a tracked bias).
    ds: bool,
}

impl Features {
    fn name(&self) -> String {
        let f = [
            (self.causal, "causal"),
            (self.mask, "mask"),
            (self.fill, "fill"),
            (self.bias, "bias"),
            (self.rows, "rows"),
            (self.softcap, "softcap"),
            (self.quiet, "quiet"),
            (self.dropout, "dropout"),
            (self.window, "window"),
            (self.alibi, "alibi"),
            (self.sinks, "sinks"),
            (self.varlen, "varlen"),
            (self.ds, "ds"),
        ];
        let on: Vec<_> = f.iter().filter(|(b, _)| *b).map(|(_, n)| *n).collect();
        if on.is_empty() {
            "plain".into()
        } else {
            on.join("+")
        }
    }
}

/// The feature sets of the grid: each feature at least once, the common pairs together.
fn feature_sets(all: bool) -> Vec<Features> {
    let none = Features::default();
    let mut sets = vec![
        none,
        Features {
            causal: true,
            ..none
        },
        Features {
            mask: true,
            bias: true,
            softcap: true,
            ..none
        },
        Features {
            mask: true,
            fill: true,
            quiet: true,
            causal: true,
            ..none
        },
        Features {
            dropout: true,
            causal: true,
            ..none
        },
        Features {
            window: true,
            alibi: true,
            sinks: true,
            ..none
        },
        Features {
            varlen: true,
            causal: true,
            ..none
        },
        Features {
            bias: true,
            rows: true,
            causal: true,
            ..none
        },
    ];
    if all {
        sets.extend([
            Features { bias: true, ..none },
            Features {
                softcap: true,
                causal: true,
                ..none
            },
            Features {
                window: true,
                causal: true,
                ..none
            },
            Features {
                dropout: true,
                mask: true,
                bias: true,
                ..none
            },
        ]);
    }
    sets
}

/// Options of a call with `f` forced onto `kernel`.
fn options(f: Features, kernel: Option<AttentionKernel>) -> AttentionOptions {
    AttentionOptions {
        scale: 0.125,
        softcap: f.softcap.then_some(30.0),
        causal: f.causal,
        kernel,
        block_k: None,
        dropout: f.dropout.then(|| DropoutParams::new(0.1, 7)),
        masked_score: f.fill.then_some(-1e4),
        quiet: f.quiet,
        window: f.window.then_some((64, 16)),
        ..Default::default()
    }
}

/// The sizes of an attention call.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_k: usize,
    d: usize,
    dv: usize,
}

/// The tensors of an attention call (forward and backward).
struct AttentionCall {
    q: Owned,
    k: Owned,
    v: Owned,
    mask: Option<Owned>,
    bias: Option<Owned>,
    slopes: Option<Owned>,
    sinks: Option<Owned>,
    seqs: Option<Owned>,
    out: Owned,
    lse: Owned,
}

impl AttentionCall {
    fn new(client: &Client, s: Sizes, f: Features, dtype: StorageType) -> Self {
        let t = |shape: &[usize], dtype| Owned::new(client, shape, dtype);
        let (b, hq, hkv) = (s.batch, s.heads_q, s.heads_kv);
        Self {
            q: t(&[b, hq, s.seq_q, s.d], dtype),
            k: t(&[b, hkv, s.seq_k, s.d], dtype),
            v: t(&[b, hkv, s.seq_k, s.dv], dtype),
            mask: f.mask.then(|| t(&[b, 1, s.seq_q, s.seq_k], dtype)),
            bias: f
                .bias
                .then(|| t(&[1, hq, if f.rows { 1 } else { s.seq_q }, s.seq_k], dtype)),
            slopes: f.alibi.then(|| t(&[hq], F32)),
            sinks: f.sinks.then(|| t(&[hq], F32)),
            seqs: f.varlen.then(|| t(&[2 * 3], U32)),
            out: t(&[b, hq, s.seq_q, s.dv], dtype),
            lse: t(&[b, hq, s.seq_q], F32),
        }
    }

    fn forward(
        &self,
        client: &Client,
        dtype: StorageType,
        o: &AttentionOptions,
    ) -> Result<(), String> {
        launch_attention(
            client,
            self.q.r(),
            self.k.r(),
            self.v.r(),
            self.mask.as_ref().map(Owned::r),
            self.bias.as_ref().map(Owned::r),
            self.slopes.as_ref().map(Owned::r),
            self.sinks.as_ref().map(Owned::r),
            self.seqs.as_ref().map(Owned::r),
            self.out.r(),
            self.lse.r(),
            dtype,
            o,
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    }

    fn backward(
        &self,
        client: &Client,
        dtype: StorageType,
        o: &AttentionOptions,
        ds: bool,
    ) -> Result<AttentionBackwardKernel, String> {
        let like = |t: &Owned| Owned::new(client, &t.shape, dtype);
        let (d_out, dq, dk, dv) = (like(&self.out), like(&self.q), like(&self.k), like(&self.v));
        let full = [
            self.q.shape[0],
            self.q.shape[1],
            self.q.shape[2],
            self.k.shape[2],
        ];
        let ds = ds.then(|| Owned::new(client, &full, dtype));
        let t = BackwardTensors {
            q: self.q.r(),
            k: self.k.r(),
            v: self.v.r(),
            mask: self.mask.as_ref().map(Owned::r),
            bias: self.bias.as_ref().map(Owned::r),
            slopes: self.slopes.as_ref().map(Owned::r),
            seqs: self.seqs.as_ref().map(Owned::r),
            out: self.out.r(),
            lse: self.lse.r(),
            d_out: d_out.r(),
            dq: dq.r(),
            dk: dk.r(),
            dv: dv.r(),
            ds: ds.as_ref().map(Owned::r),
        };
        launch_attention_backward(client, t, dtype, o)
            .map(|plan| plan.kernel)
            .map_err(|e| e.to_string())
    }
}

/// Which architectures a forced attention kernel runs on.
fn kernel_archs(kernel: AttentionKernel, archs: &[Arch]) -> Vec<Arch> {
    archs
        .iter()
        .copied()
        .filter(|a| kernel != AttentionKernel::Hopper || a.cc == 90)
        .collect()
}

/// Attention forward and backward: each kernel path × dtype × head dims × feature sets.
pub(super) fn attention(calls: &mut Vec<Call>, archs: &[Arch], all: bool) {
    use AttentionKernel::*;
    // Head-dim classes: (D, Dv). Odd sizes round up inside the kernels.
    let dims_all: &[(usize, usize)] = &[
        (64, 64),
        (128, 128),
        (256, 256),
        (80, 80),
        (64, 128),
        (32, 32),
    ];
    let dims_few: &[(usize, usize)] = &[(64, 64), (128, 128), (256, 256), (80, 80)];
    let head_dims = if all { dims_all } else { dims_few };
    let matrix = [FloatKind::F16, FloatKind::BF16];
    for kernel in [MatrixUnits, Hopper, CooperativeMatrix, Tiled, Units] {
        let kinds: &[FloatKind] = match kernel {
            MatrixUnits | Hopper | CooperativeMatrix => &matrix,
            Tiled | Units if all => &[FloatKind::F32, FloatKind::F16, FloatKind::BF16],
            _ => &[FloatKind::F32],
        };
        for (i, &kind) in kinds.iter().enumerate() {
            for (j, &(d, dv)) in head_dims.iter().enumerate() {
                for (k, f) in feature_sets(all).into_iter().enumerate() {
                    // The representative grid, on sm_80 and sm_90a: every feature set at one
                    // head dim and dtype, every head dim plain and causal, the second dtype
                    // plain; on sm_86 and sm_89 (sm_80's code with less shared memory, which
                    // only the tile choice sees) the first dtype at D 128 and 256, plain and
                    // causal.
                    let primary = archs.iter().any(|a| a.cc == 80 || a.cc == 90);
                    let wanted = if primary {
                        i == 0 && (j == 1 || k <= 1) || k == 0 && j <= 1
                    } else {
                        i == 0 && (j == 1 || j == 2) && k <= 1
                    };
                    if !all && !wanted {
                        continue;
                    }
                    if kernel == Tiled && f.dropout {
                        continue; // the tiled kernel takes no dropout (the plan refuses it)
                    }
                    let s = Sizes {
                        batch: if f.varlen { 1 } else { 2 },
                        heads_q: 4,
                        heads_kv: 2,
                        seq_q: 200,
                        seq_k: 328,
                        d,
                        dv,
                    };
                    let name = format!(
                        "attention {kernel:?} {} D{d}/{dv} {}",
                        dtype_name(kind),
                        f.name()
                    );
                    let dtype = float(kind);
                    let o = options(f, Some(kernel));
                    push(
                        calls,
                        format!("{name} fwd"),
                        kernel_archs(kernel, archs),
                        move |c| AttentionCall::new(c, s, f, dtype).forward(c, dtype, &o),
                    );
                    // The Hopper forward whose tiles come from a counter: plain and causal.
                    if kernel == Hopper && k <= 1 {
                        let o = AttentionOptions {
                            schedule: TileSchedule::Dynamic,
                            ..o
                        };
                        push(
                            calls,
                            format!("{name} dynamic fwd"),
                            kernel_archs(kernel, archs),
                            move |c| AttentionCall::new(c, s, f, dtype).forward(c, dtype, &o),
                        );
                    }
                    // Backward: no sinks (they are forward-only); `dS` with a bias.
                    if f.sinks || (kernel == Tiled) {
                        continue;
                    }
                    for ds in [false, true] {
                        if ds && !f.bias {
                            continue;
                        }
                        let f = Features { ds, ..f };
                        push(
                            calls,
                            format!("{name}{} bwd", if ds { "+ds" } else { "" }),
                            kernel_archs(kernel, archs),
                            move |c| {
                                AttentionCall::new(c, s, f, dtype)
                                    .backward(c, dtype, &o, f.ds)
                                    .map(|_| ())
                            },
                        );
                    }
                    // The Hopper backward with dQ deferred by a step, and staggered: plain and
                    // causal (head dim 128 takes them; the others compile as lockstep).
                    if kernel == Hopper && k <= 1 {
                        for overlap in [BackwardOverlap::Deferred, BackwardOverlap::Staggered] {
                            let o = AttentionOptions {
                                backward_overlap: overlap,
                                ..o
                            };
                            push(
                                calls,
                                format!("{name} {} bwd", format!("{overlap:?}").to_lowercase()),
                                kernel_archs(kernel, archs),
                                move |c| {
                                    AttentionCall::new(c, s, f, dtype)
                                        .backward(c, dtype, &o, false)
                                        .map(|_| ())
                                },
                            );
                        }
                    }
                    // The persistent Hopper backward (blocks taking tiles in rounds): plain and
                    // causal.
                    if kernel == Hopper && k <= 1 {
                        let o = AttentionOptions {
                            schedule: TileSchedule::Persistent,
                            ..o
                        };
                        push(
                            calls,
                            format!("{name} persistent bwd"),
                            kernel_archs(kernel, archs),
                            move |c| {
                                AttentionCall::new(c, s, f, dtype)
                                    .backward(c, dtype, &o, false)
                                    .map(|_| ())
                            },
                        );
                    }
                    // The deterministic Hopper backward (ordered dQ adds): plain, causal, packed.
                    if kernel == Hopper && !f.bias && !f.mask && !f.dropout {
                        let o = AttentionOptions {
                            deterministic: true,
                            ..o
                        };
                        push(
                            calls,
                            format!("{name} deterministic bwd"),
                            kernel_archs(kernel, archs),
                            move |c| {
                                AttentionCall::new(c, s, f, dtype)
                                    .backward(c, dtype, &o, false)
                                    .map(|_| ())
                            },
                        );
                    }
                }
            }
        }
    }
}

/// The Ampere backward (forced ahead of the Hopper one: `AmpereUse::Always`) on every architecture:
/// both 16-bit types, head dims 64, 128 and 64 / 128, plain and causal (with `--all` also 80 and
/// 32, the rounded-up head dims), in each block shape (`AmpereTile`): the planned one (128 keys
/// on sm_80 and sm_90a, 64 on sm_86 and sm_89 at D 128), `Narrow` (64 keys, one stage) and
/// `Paired` (two blocks a SM) where two blocks fit the architecture's shared memory; and in the
/// planned shape the grid's other score-rule sets (sinks aside: forward-only), a tracked bias's
/// `dS` with each bias (not under a softcap) — at D 128 in bf16 (the most registers), with
/// `--all` at every head dim in both types. A call the plan did not give it fails.
pub(super) fn ampere_backward(calls: &mut Vec<Call>, archs: &[Arch], all: bool) {
    use burn_flash_kernels::flash::backward::sm80;
    let mut dims = vec![(64, 64), (128, 128), (64, 128)];
    if all {
        dims.extend([(80, 80), (32, 32)]);
    }
    let plain = Features::default();
    let causal = Features {
        causal: true,
        ..plain
    };
    for tile in [AmpereTile::Planned, AmpereTile::Narrow, AmpereTile::Paired] {
        for kind in [FloatKind::F16, FloatKind::BF16] {
            for &(d, dv) in &dims {
                let mut sets = vec![plain, causal];
                if tile == AmpereTile::Planned
                    && (all || (kind == FloatKind::BF16 && d == 128 && dv == 128))
                {
                    for f in feature_sets(all) {
                        let f = Features { sinks: false, ..f };
                        if f == plain || f == causal || sets.contains(&f) {
                            continue;
                        }
                        sets.push(f);
                        if f.bias && !f.softcap {
                            sets.push(Features { ds: true, ..f });
                        }
                    }
                }
                for f in sets {
                    let s = Sizes {
                        batch: if f.varlen { 1 } else { 2 },
                        heads_q: 4,
                        heads_kv: 2,
                        seq_q: 200,
                        seq_k: 328,
                        d,
                        dv,
                    };
                    let attention_dims = AttentionDims {
                        batch: s.batch,
                        heads_q: s.heads_q,
                        heads_kv: s.heads_kv,
                        seq_q: s.seq_q,
                        seq_k: s.seq_k,
                        head_dim: d,
                        value_dim: dv,
                    };
                    let fitting: Vec<Arch> = archs
                        .iter()
                        .copied()
                        .filter(|a| sm80::shape(attention_dims, tile, a.max_shared).is_some())
                        .collect();
                    if fitting.is_empty() {
                        continue;
                    }
                    let dtype = float(kind);
                    let o = AttentionOptions {
                        ampere_backward: AmpereUse::Always,
                        ampere_tile: tile,
                        ..options(f, None)
                    };
                    let name = format!(
                        "attention Ampere {tile:?} {} D{d}/{dv} {} bwd",
                        dtype_name(kind),
                        f.name()
                    );
                    push(calls, name, fitting, move |c| {
                        match AttentionCall::new(c, s, f, dtype).backward(c, dtype, &o, f.ds)? {
                            AttentionBackwardKernel::Ampere => Ok(()),
                            other => {
                                Err(format!("the plan ran {other:?}, not the Ampere backward"))
                            }
                        }
                    });
                }
            }
        }
    }
}

/// A key/value cache: contiguous `[B, Hkv, S_max, D]`, or a pool of `block`-key blocks
/// `[blocks, block, Hkv, D]` with its table `[B, S_max / block]`.
struct Cache {
    k: Owned,
    v: Owned,
    table: Option<Owned>,
}

impl Cache {
    fn new(
        c: &Client,
        paged: bool,
        (b, hkv, smax, block, d): (usize, usize, usize, usize, usize),
        dtype: StorageType,
    ) -> Self {
        let shape = if paged {
            [b * smax / block, block, hkv, d]
        } else {
            [b, hkv, smax, d]
        };
        Self {
            k: Owned::new(c, &shape, dtype),
            v: Owned::new(c, &shape, dtype),
            table: paged.then(|| Owned::new(c, &[b, smax / block], U32)),
        }
    }
}

/// Decoding: split-KV over a contiguous cache (planned and forced), paged, with ALiBi and
/// sinks; appends with and without RoPE.
pub(super) fn decode(calls: &mut Vec<Call>, archs: &[Arch], all: bool) {
    let kinds = dtypes(all, &[FloatKind::F16, FloatKind::F32]);
    for &kind in kinds {
        let dtype = float(kind);
        for d in if all { vec![64, 128, 256] } else { vec![128] } {
            for (paged, f) in [
                (false, Features::default()),
                (true, Features::default()),
                (
                    true,
                    Features {
                        alibi: true,
                        sinks: true,
                        window: true,
                        ..Default::default()
                    },
                ),
            ] {
                let name = format!(
                    "decode {} {} D{d} {}",
                    if paged { "paged" } else { "contiguous" },
                    dtype_name(kind),
                    f.name()
                );
                push(calls, name, archs.to_vec(), move |c| {
                    let (b, hq, hkv, smax, block) = (4, 8, 2, 2048, 64);
                    let t = |shape: &[usize], dt| Owned::new(c, shape, dt);
                    let q = t(&[b, hq, 1, d], dtype);
                    let Cache { k, v, table } =
                        Cache::new(c, paged, (b, hkv, smax, block, d), dtype);
                    let lengths = t(&[b], U32);
                    let slopes = f.alibi.then(|| t(&[hq], F32));
                    let sinks = f.sinks.then(|| t(&[hq], F32));
                    let out = t(&[b, hq, 1, d], dtype);
                    let lse = t(&[b, hq, 1], F32);
                    let dt = DecodeTensors {
                        q: q.r(),
                        k: k.r(),
                        v: v.r(),
                        paged: table.as_ref().map(|t| Paged { table: t.r() }),
                        lengths: Some(lengths.r()),
                        slopes: slopes.as_ref().map(Owned::r),
                        sinks: sinks.as_ref().map(Owned::r),
                        out: out.r(),
                        lse: lse.r(),
                    };
                    launch_decode(c, dt, dtype, &options(f, None))
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                });
            }
            // The planner's own pick for one query row against a long contiguous cache.
            let s = Sizes {
                batch: 2,
                heads_q: 8,
                heads_kv: 2,
                seq_q: 1,
                seq_k: 4096,
                d,
                dv: d,
            };
            push(
                calls,
                format!(
                    "attention planned {} D{d} decode-shaped fwd",
                    dtype_name(kind)
                ),
                archs.to_vec(),
                move |c| {
                    let f = Features::default();
                    AttentionCall::new(c, s, f, dtype).forward(c, dtype, &options(f, None))
                },
            );
            for (paged, rope) in [(false, false), (true, true)] {
                push(
                    calls,
                    format!(
                        "append {} {} D{d}{}",
                        if paged { "paged" } else { "contiguous" },
                        dtype_name(kind),
                        if rope { " rope" } else { "" }
                    ),
                    archs.to_vec(),
                    move |c| {
                        let (b, hkv, hq, s_new, smax, block) = (2, 2, 4, 3, 512, 64);
                        let t = |shape: &[usize], dt| Owned::new(c, shape, dt);
                        let k_new = t(&[b, hkv, s_new, d], dtype);
                        let v_new = t(&[b, hkv, s_new, d], dtype);
                        let Cache { k, v, table } =
                            Cache::new(c, paged, (b, hkv, smax, block, d), dtype);
                        let lengths = t(&[b], U32);
                        let cos = t(&[smax, d / 2], F32);
                        let sin = t(&[smax, d / 2], F32);
                        let q = t(&[b, hq, s_new, d], dtype);
                        let q_out = t(&[b, hq, s_new, d], dtype);
                        let at = AppendTensors {
                            k_new: k_new.r(),
                            v_new: v_new.r(),
                            k: k.r(),
                            v: v.r(),
                            paged: table.as_ref().map(|t| Paged { table: t.r() }),
                            lengths: lengths.r(),
                            rope: rope.then(|| Rope {
                                cos: cos.r(),
                                sin: sin.r(),
                                interleaved: false,
                                q: Some((q.r(), q_out.r())),
                            }),
                        };
                        launch_append(c, at, dtype).map_err(|e| e.to_string())
                    },
                );
            }
        }
    }
}

/// f32 attention with TF32 allowed (`AttentionOptions::tf32`, no kernel forced) on every
/// architecture: the plan takes the cooperative-matrix kernels on TF32 fragments (`wmma`
/// m16n16k8) forward and backward; head dims 64 and 128 plain and causal, and every feature
/// set at 128 (with `--all`, every feature set at both); a backward the plan did not give the
/// cooperative matrices fails.
pub(super) fn tf32(calls: &mut Vec<Call>, archs: &[Arch], all: bool) {
    let dtype = float(FloatKind::F32);
    for (d, dv) in [(64, 64), (128, 128)] {
        for (k, f) in feature_sets(all).into_iter().enumerate() {
            if !all && k > 1 && d != 128 {
                continue;
            }
            let s = Sizes {
                batch: if f.varlen { 1 } else { 2 },
                heads_q: 4,
                heads_kv: 2,
                seq_q: 200,
                seq_k: 328,
                d,
                dv,
            };
            let o = AttentionOptions {
                tf32: true,
                ..options(f, None)
            };
            let name = format!("attention TF32 f32 D{d}/{dv} {}", f.name());
            push(calls, format!("{name} fwd"), archs.to_vec(), move |c| {
                AttentionCall::new(c, s, f, dtype).forward(c, dtype, &o)
            });
            if f.sinks {
                continue;
            }
            push(
                calls,
                format!("{name} bwd"),
                archs.to_vec(),
                move |c| match AttentionCall::new(c, s, f, dtype).backward(c, dtype, &o, false)? {
                    AttentionBackwardKernel::CooperativeMatrix => Ok(()),
                    other => Err(format!("the plan ran {other:?}, not the TF32 backward")),
                },
            );
        }
    }
}
