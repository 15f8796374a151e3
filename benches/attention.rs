//! Attention forward: burn-flash's fused kernels against Burn's own `module::attention` and its
//! `attention_fallback`, on Burn's Fusion backend (what `burn::backend::Cuda`/`Wgpu` are).
//!
//! `cargo bench --bench attention -- [--quick] [--out DIR] [--runtimes cuda,wgpu]
//! [--dtypes bf16,f16,f32] [--seqs 512,1024] [--dims 64,128] [--causal false,true]
//! [--sweeps main,gqa,bias,mask,alibi,window] [--window W]
//! [--impls burn-flash,burn-attention,burn-fallback]
//! [--burn-max-s 4096] [--bias-full-max-s 4096] [--bias-tracked] [--passes N] [--no-memory]
//! [--dropout P]
//! [--block-k N] [--kernel units|tiled|mma|cooperative|hopper]
//! [--plot CSV]`
//! (`--help` lists them): wgpu by default, CUDA with `--features cuda` (both in one process when
//! both are built; wgpu's files then end in `-wgpu`). `--plot CSV` redraws the PNG of an earlier
//! run's `attention.csv`. The PyTorch peer with the same shapes and columns is
//! `benches/sdpa.py` (`python3 benches/sdpa.py --out DIR`, its docstring gives the details);
//! `--plot DIR/sdpa.csv` draws its CSV too.
//!
//! # Configurations
//! Inputs `q` `[B, Hq, S, D]`, `k`, `v` `[B, Hkv, S, D]` (Normal(0, 1), cast to the dtype),
//! default scale `1/√D`, no softcap, causal (bottom-right aligned, Sq = Sk) and not (`--causal`).
//! Sweeps (`variant` column, `--sweeps`):
//! - `main`: B 4, H 16, S ∈ {512, 1024, 2048, 4096, 8192, 16384} (`--seqs`), D ∈ {64, 128}
//!   (`--dims`).
//! - `gqa`: Hq 32, Hkv 8 (grouped-query attention; burn-flash reads each K/V head for its 4
//!   query heads, nothing is repeated in memory).
//! - `bias`: an additive ALiBi bias, `−slope_h·|i − j|` with the ALiBi slopes `2^(−8(h+1)/H)`, of
//!   shape `[1, H, S, S]` (a full per-head bias, the shape that cannot be broadcast: what
//!   relative-position biases need) up to S = `--bias-full-max-s` (4096: 1 GiB in f32 at H 16),
//!   above it the broadcast key-position form `−slope_h·(S − 1 − j)` of shape `[1, H, 1, S]`
//!   (softmax-equivalent to causal ALiBi). Each row's note gives the shape.
//! - `mask`: a padding mask `[B, 1, 1, S]`, the last ⌈S/10⌉ keys of every batch masked out.
//! - `alibi`: the `bias` sweep's ALiBi (`[1, H, S, S]` form) computed in the kernel from the
//!   slopes ([`burn_flash::attention_with_alibi`]); Burn's rows get the materialised bias of the
//!   `bias` sweep (they have no other way to run it).
//! - `window`: sliding-window attention, causal with a window of `--window` keys (`(W − 1, 0)`,
//!   Mistral's), causal rows only; Burn's rows get the band as a bool mask `[1, 1, S, S]`. FLOP
//!   count only the `(query, key)` pairs inside the window (`Σ_i min(i + 1, W)` per head).
//!
//! `gqa`, `bias` and `mask` run at the largest head dim of `--dims` (128 by default), all dtypes
//! and causal settings of the run. `--quick`: B 1, H 2 (GQA: Hq 4, Hkv 1), S ∈ {128, 256}, D 64,
//! one warm-up call and 3 passes of one call (a smoke run for lavapipe).
//!
//! # Implementations (`impl` column)
//! - `burn-flash`: [`burn_flash::attention`]; `kernel` is the kernel its plan
//!   ([`burn_flash::attention_plan`]) launches (`MatrixUnits`: FlashAttention-2 on the matrix
//!   units, f16/bf16 on CUDA; `Units`: plain units), the note its tiles.
//! - `burn-attention`: Burn's `module::attention` with its default strategy. Burn's Fusion
//!   registers it as one operation that calls `CubeBackend::attention`, which takes
//!   `attention_fallback` (unfused kernels on the bare backend) whenever a bias is given, and
//!   otherwise burn-cubecl's `AttentionStrategy::default()`: autotuning between its flash
//!   kernels and the fallback when burn-cubecl's `autotune` feature is on (which pauses for up to
//!   a minute on the first call of a new shape on CUDA), the fallback when it is off (as in this
//!   crate's build, where burn-cubecl has no default features).
//! - `burn-fallback`: Burn's `module::attention_fallback` through Fusion (Burn's fuser fuses its
//!   element-wise steps): the `B·Hq·S·S` scores in memory.
//!
//! Burn's ops have no grouped heads: their `gqa` rows get K/V repeated to Hq heads (reshape,
//! expand, reshape: a copy), their `bias` and `mask` rows the bias and mask expanded to
//! `[B, Hq, S, S]` (views, no copy), both before the first call and outside every timing; their
//! peak memory counts the repeated K/V as inputs. Burn's rows above S = `--burn-max-s` (4096 by
//! default, every dtype: at S 8192 the f32 scores alone are 16 GiB at B 4, H 16) are written
//! with the note `skipped (--burn-max-s)` and not run. bf16 on wgpu, and a dtype the device
//! lacks, give rows with a `skipped: …` note.
//!
//! # Protocol
//! Per row: the inputs are made and synced; `first_call_ms` is the very first call (sync, call,
//! sync, host clock), before any warm-up: it includes compiling the kernels (and autotuning
//! where Burn's strategy autotunes) unless an earlier row of the process already compiled the
//! same kernel (compiled kernels are cached per process, and burn-flash's kernels are
//! specialised on dtype, tiles, head dim, causal, mask and bias, not on B, H or S). Then
//! `common::measure` (its docs give the details): 3 warm-up calls, then `--passes` (10) passes,
//! each as many calls as make it last ≥ 10 ms (at most 50) between two syncs, timed on the host:
//! `wall_ms_median` is the median pass per call. `TFLOP_per_s = FLOP / wall_ms_median` with
//! `FLOP = 4·B·Hq·S·S·D` (two matmuls of 2·S·S·D per head), halved when causal; masked keys are
//! counted (the dense count, as FlashAttention's benchmarks do).
//!
//! `device_ms_median`, `device_TFLOP_per_s`: the median of as many passes of the row's *twin*,
//! the same op on the same shapes run on the runtime's bare `CubeBackend` inside
//! `ComputeClient::profile` (Fusion launches from its own thread, which the profiler does not
//! see; see `benches/common`). burn-flash's Fusion op calls the `CubeBackend` one, and Burn's
//! `module::attention` is one Fusion operation calling `CubeBackend::attention`, so both twins
//! run the rows' kernels (on inputs of the same shapes and distributions, not the same values);
//! `burn-fallback`'s kernels are made by Fusion and have no twin (empty device columns). Wall −
//! device is the host's cost per call (Fusion's queue, launches). `timing_method`: `device`
//! (GPU timestamps: wgpu) or `system` (cubecl's CUDA runtime: the device thread's clock between
//! two stream syncs).
//!
//! `peak_MiB`: the call's inputs (q, k, v, the mask at its own shape, the bias at its own
//! shape; Burn's GQA rows: K/V as repeated) plus the most it held beyond what was in use before
//! it (output, scores, scratch), measured by the same program in a child process
//! (`--memory-only`: one untimed call per row first, so that compilation and autotuning stay
//! outside, then one call with cubecl's exact pools, `tests/common/peak_memory.rs`); the child's
//! rows are in `attention.peak.csv`, merged into the CSV by configuration. `--no-memory` skips
//! the child (empty `peak_MiB`).
//!
//! # Training rows (`pass` column, `--modes`)
//! `fwd`: the forward alone (everything above). `fwd+bwd`: one training step of the attention,
//! under `Autodiff`: `q`, `k`, `v` tracked (the mask not; the bias with `--bias-tracked`, whose
//! gradient then sums the `dS` the backward writes, and the note says so), the forward, then
//! `(out ⊙ g).backward()` with a random `g` (Normal(0, 1)), the call returning `dQ` (the
//! gradients stay alive until the pass's sync). Autodiff seeds the root `out ⊙ g` with ones, so
//! the attention's output gradient is `g`, as in the SDPA peer's `out.backward(g)`; the step
//! adds Burn's product `out ⊙ g`, the ones and the product's backward (three element-wise
//! kernels) where the peer adds none. A loss `.sum()` would add Burn's reduction to a scalar,
//! whose last stage is one block (RESULTS §5.0). FLOP = 3.5 × the forward's (FlashAttention's
//! convention: the backward is 2.5 × the forward). `bwd`: derived, the `fwd+bwd` row's medians
//! minus the `fwd` row's (wall and device), FLOP = 2.5 × the forward's; its note says so.
//! burn-flash's training step runs its fused backward (`kernel` names the backward plan's
//! kernels: on Hopper GPUs the Hopper backward after the plan's forward or `--kernel hopper`,
//! the `mma.sync` backward after `--kernel mma`); Burn's rows run Burn's autodiff of its own op (`burn-attention`: the autodiff of
//! `module::attention`, `burn-fallback`: of `attention_fallback`). Peak memory of a `fwd+bwd`
//! row is the whole step's (the forward's saved state, the gradients and the backward's
//! scratch).
//!
//! # Files (under `target/bench/` or `--out`)
//! A row per (configuration, implementation); a failure (out of memory, an unsupported
//! configuration, a panic) is a row with empty measurements and a `failed: …` note, and the
//! sweep goes on.
//! - `attention.csv` (`attention-wgpu.csv` for wgpu when CUDA is built too): `runtime, dtype,
//!   batch, heads_q, heads_kv, seq, head_dim, causal, variant, pass, impl, kernel, first_call_ms,
//!   wall_ms_median, TFLOP_per_s, device_ms_median, device_TFLOP_per_s, timing_method, peak_MiB,
//!   note`.
//! - `attention.png`: wall TFLOP/s against S, a panel per dtype, head dim, causal setting and
//!   pass, a line per implementation (`impl (variant)` for the gqa/bias/mask sweeps).

mod common;
#[path = "../tests/common/peak_memory.rs"]
mod peak_memory;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::{
    Bool, DType, Distribution, FloatDType, Int, Tensor, TensorData, backend::Backend, module,
    ops::AttentionModuleOptions,
};
use burn_cubecl::{BoolElement, CubeRuntime};
use burn_flash::{
    FlashAttentionOptions, FlashAutodiffBackend, FlashBackend, attention::AttentionDims,
};

/// `--block-k`, set once from the command line.
static BLOCK_K: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();

fn forced_block_k() -> Option<usize> {
    BLOCK_K.get().copied().flatten()
}

/// `--kernel`, set once from the command line.
static KERNEL: std::sync::OnceLock<Option<KernelName>> = std::sync::OnceLock::new();

/// burn-flash's forward kernel of `--kernel` (the plan's by default).
fn forced_kernel() -> Option<burn_flash::AttentionKernel> {
    KERNEL.get().copied().flatten().map(|k| match k {
        KernelName::Units => burn_flash::AttentionKernel::Units,
        KernelName::Tiled => burn_flash::AttentionKernel::Tiled,
        KernelName::Mma => burn_flash::AttentionKernel::MatrixUnits,
        KernelName::Cooperative => burn_flash::AttentionKernel::CooperativeMatrix,
        KernelName::Hopper => burn_flash::AttentionKernel::Hopper,
    })
}

/// The forward kernels `--kernel` names.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum KernelName {
    /// Plain units, small tiles.
    Units,
    /// Plain units, register-tiled.
    Tiled,
    /// The matrix units by hand (`mma`, CUDA).
    Mma,
    /// Cooperative matrices (cubecl's `cmma`: Vulkan, Metal, CUDA's `wmma`).
    Cooperative,
    /// Hand-written CUDA for sm_90 (TMA, `wgmma`; the plan's choice on H100/H200).
    Hopper,
}

/// `--dropout`, set once from the command line.
static DROPOUT: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();

/// burn-flash's in-kernel dropout of `--dropout` (a fixed seed: the timing does not depend on
/// which weights are dropped).
fn bench_dropout() -> Option<burn_flash::AttentionDropout> {
    DROPOUT
        .get()
        .copied()
        .flatten()
        .map(|prob| burn_flash::AttentionDropout { prob, seed: 7 })
}
use clap::{CommandFactory, Parser, ValueEnum, error::ErrorKind};
use common::*;
use cubecl::client::ComputeClient;
use serde::{Deserialize, Serialize};

const BATCH: usize = 4;
const HEADS: usize = 16;
/// Query and key/value heads of the `gqa` sweep.
const GQA_HEADS: (usize, usize) = (32, 8);
const SEQS: [usize; 6] = [512, 1024, 2048, 4096, 8192, 16384];
const DIMS: [usize; 2] = [64, 128];
/// `--quick`: batch, heads, GQA heads, sequence lengths, head dims.
const QUICK_BATCH: usize = 1;
const QUICK_HEADS: usize = 2;
const QUICK_GQA_HEADS: (usize, usize) = (4, 1);
const QUICK_SEQS: [usize; 2] = [128, 256];
const QUICK_DIMS: [usize; 1] = [64];
/// Fraction of the keys the padding mask masks out (the last ones).
const MASKED_FRACTION: f64 = 0.1;

/// Attention forward bench (module docs of benches/attention.rs give the CSV columns).
#[derive(Parser, Debug)]
#[command(name = "attention", bin_name = "attention")]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// Element types.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [DTypeName::Bf16, DTypeName::F16, DTypeName::F32])]
    dtypes: Vec<DTypeName>,
    /// Sequence lengths S (= Sq = Sk) [default: 512,1024,…,16384; 128,256 with --quick].
    #[arg(long, value_delimiter = ',')]
    seqs: Vec<usize>,
    /// Head dims of the main sweep; the other sweeps run at the largest [default: 64,128; 64
    /// with --quick].
    #[arg(long, value_delimiter = ',')]
    dims: Vec<usize>,
    /// Causal settings [default: false,true].
    #[arg(long, value_delimiter = ',')]
    causal: Vec<bool>,
    /// Sweeps to run [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    sweeps: Vec<Variant>,
    /// Implementations to run [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    impls: Vec<Impl>,
    /// Passes to time: the forward, a training step (forward + backward; a derived
    /// backward-only row follows it when both ran) [default: fwd,train].
    #[arg(long, value_enum, value_delimiter = ',')]
    modes: Vec<Mode>,
    /// Burn's rows (burn-attention, burn-fallback) above this S are written as skipped, not run
    /// (their scores grow as S²).
    #[arg(long, default_value_t = 4096, value_name = "S")]
    burn_max_s: usize,
    /// The bias sweep's bias is [1, H, S, S] up to this S, [1, H, 1, S] above it.
    #[arg(long, default_value_t = 4096, value_name = "S")]
    bias_full_max_s: usize,
    /// Track the bias sweep's bias in training rows (its gradient: `dS` written).
    #[arg(long)]
    bias_tracked: bool,
    /// Keys of the window sweep's causal window.
    #[arg(long, default_value_t = 1024, value_name = "W")]
    window: usize,
    /// Force burn-flash's keys per step (a tuning experiment; the plan's choice by default).
    #[arg(long, value_name = "N")]
    block_k: Option<usize>,
    /// Force burn-flash's forward kernel (the plan's choice by default); a kernel a row cannot
    /// run makes that row a failure.
    #[arg(long, value_enum)]
    kernel: Option<KernelName>,
    /// In-kernel dropout of this probability on burn-flash's rows (Burn's ops have none: their
    /// rows stay without; each burn-flash row's note says so).
    #[arg(long, value_name = "P")]
    dropout: Option<f64>,
    /// Timed passes per row [default: 10; 3 with --quick].
    #[arg(long)]
    passes: Option<usize>,
    /// Skip the peak-memory child process (the peak_MiB column stays empty).
    #[arg(long)]
    no_memory: bool,
    /// Redraw the PNG of an earlier run's attention.csv, then exit.
    #[arg(long, value_name = "CSV")]
    plot: Option<PathBuf>,
    /// Measure only the peak memory of each row (one call each, in a process whose memory
    /// pools are exact: `tests/common/peak_memory.rs`), into `*.peak.csv`. A timing run starts
    /// itself with this flag first and takes its peak column from that file.
    #[arg(long, hide = true)]
    memory_only: bool,
}

/// What a row times (module docs, "Training rows").
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The forward.
    Fwd,
    /// Forward + backward under `Autodiff`.
    Train,
}

impl Mode {
    /// The `pass` column.
    fn name(self) -> &'static str {
        match self {
            Mode::Fwd => "fwd",
            Mode::Train => "fwd+bwd",
        }
    }

    /// FLOP of the pass over the forward's.
    fn flop_factor(self) -> f64 {
        match self {
            Mode::Fwd => 1.0,
            Mode::Train => 3.5,
        }
    }
}

/// One training step (module docs): forward, `(out ⊙ g).backward()`, returns `dQ`.
fn train_step<B: FlashAutodiffBackend>(
    imp: Impl,
    x: &Inputs<B>,
    g: &Tensor<B, 4>,
    options: AttentionModuleOptions,
) -> Tensor<B::InnerBackend, 4> {
    let out = imp.call(x, options);
    let grads = (out * g.clone()).backward();
    x.q.grad(&grads).expect("dq")
}

/// A sweep, and the `variant` column of its rows.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// B 4, H 16, every S, D and causal setting.
    Main,
    /// Grouped-query heads: Hq 32, Hkv 8.
    Gqa,
    /// An additive ALiBi bias.
    Bias,
    /// A padding mask [B, 1, 1, S].
    Mask,
    /// ALiBi from slopes, computed in the kernel.
    Alibi,
    /// A causal sliding window of `--window` keys.
    Window,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Main => "main",
            Variant::Gqa => "gqa",
            Variant::Bias => "bias",
            Variant::Mask => "mask",
            Variant::Alibi => "alibi",
            Variant::Window => "window",
        }
    }
}

/// One implementation under test (the `impl` column).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Impl {
    /// `burn_flash::attention`.
    #[value(name = "burn-flash")]
    Flash,
    /// Burn's `module::attention` (its default strategy).
    #[value(name = "burn-attention")]
    Attention,
    /// Burn's `module::attention_fallback`.
    #[value(name = "burn-fallback")]
    Fallback,
}

impl Impl {
    const ALL: [Impl; 3] = [Impl::Flash, Impl::Attention, Impl::Fallback];

    fn name(self) -> &'static str {
        match self {
            Impl::Flash => "burn-flash",
            Impl::Attention => "burn-attention",
            Impl::Fallback => "burn-fallback",
        }
    }

    /// Burn's own ops: no grouped heads, bounded by `--burn-max-s`.
    fn is_burn(self) -> bool {
        !matches!(self, Impl::Flash)
    }

    /// Whether the same op on the bare `CubeBackend` runs the row's kernels (module docs).
    fn has_twin(self) -> bool {
        !matches!(self, Impl::Fallback)
    }

    /// One call on inputs made for this implementation ([`Inputs::for_burn`] for Burn's).
    fn call<B: FlashBackend>(self, x: &Inputs<B>, options: AttentionModuleOptions) -> Tensor<B, 4> {
        let (q, k, v) = (x.q.clone(), x.k.clone(), x.v.clone());
        let (mask, bias) = (x.mask.clone(), x.bias.clone());
        match self {
            Impl::Flash => {
                let options = FlashAttentionOptions {
                    block_k: forced_block_k(),
                    kernel: forced_kernel(),
                    dropout: bench_dropout(),
                    window: x.window,
                    ..options.into()
                };
                burn_flash::attention_with_alibi(q, k, v, mask, bias, x.slopes.clone(), options).0
            }
            Impl::Attention => module::attention(q, k, v, mask, bias, options),
            Impl::Fallback => module::attention_fallback(q, k, v, mask, bias, options),
        }
    }
}

/// A row of `attention.csv` (module docs).
#[derive(Serialize, Deserialize, Default, Debug)]
#[serde(default)]
struct Row {
    runtime: String,
    dtype: String,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq: usize,
    head_dim: usize,
    causal: bool,
    variant: String,
    pass: String,
    #[serde(rename = "impl")]
    implementation: String,
    kernel: String,
    first_call_ms: Option<f64>,
    wall_ms_median: Option<f64>,
    #[serde(rename = "TFLOP_per_s")]
    tflop_per_s: Option<f64>,
    device_ms_median: Option<f64>,
    #[serde(rename = "device_TFLOP_per_s")]
    device_tflop_per_s: Option<f64>,
    timing_method: Option<String>,
    #[serde(rename = "peak_MiB")]
    peak_mib: Option<f64>,
    note: String,
}

impl Row {
    /// The configuration, for matching a row with its `--memory-only` twin row.
    fn key(&self) -> String {
        format!(
            "{} {} {} {} {} {} {} {} {} {} {}",
            self.runtime,
            self.dtype,
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seq,
            self.head_dim,
            self.causal,
            self.variant,
            self.pass,
            self.implementation
        )
    }
}

/// One configuration of a sweep.
#[derive(Clone, Copy, Debug)]
struct Config {
    variant: Variant,
    dtype: DTypeName,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq: usize,
    head_dim: usize,
    causal: bool,
    /// The bias's shape, if any.
    bias: Option<[usize; 4]>,
    /// The bias is tracked in training rows (`--bias-tracked`).
    bias_tracked: bool,
    /// Masked keys (the last ones) of the padding mask `[B, 1, 1, S]`, if any.
    masked: Option<usize>,
    /// ALiBi from slopes (burn-flash; Burn's rows: the bias of shape `bias`).
    alibi: bool,
    /// A sliding window `(left, right)`.
    window: Option<(usize, usize)>,
}

impl Config {
    /// `4·B·Hq·S·S·D`, halved when causal; with a causal window of `W` keys the pairs inside
    /// it, `Σ_i min(i + 1, W)` for `S·S / 2` (module docs).
    fn flop(&self) -> f64 {
        let per_pair = 4.0 * (self.batch * self.heads_q * self.head_dim) as f64;
        if let Some((left, _)) = self.window {
            let w = (left + 1).min(self.seq) as f64;
            let pairs = w * (w + 1.0) / 2.0 + (self.seq as f64 - w) * w;
            return per_pair * pairs;
        }
        let dense = per_pair * (self.seq * self.seq) as f64;
        if self.causal { dense / 2.0 } else { dense }
    }

    fn options(&self) -> AttentionModuleOptions {
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: self.causal,
        }
    }

    fn dims(&self) -> AttentionDims {
        AttentionDims {
            batch: self.batch,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            seq_q: self.seq,
            seq_k: self.seq,
            head_dim: self.head_dim,
            value_dim: self.head_dim,
        }
    }

    /// Bytes of the inputs implementation `imp` gets: K/V with `kv_heads` heads, the mask and
    /// bias at their own shapes (Burn's expanded views hold no memory of their own; burn-flash's
    /// ALiBi: the slopes; Burn's window: the band mask).
    fn input_bytes(&self, imp: Impl, kv_heads: usize, bool_bytes: usize) -> u64 {
        let elem = DType::from(self.dtype.dtype()).size();
        let (b, s, d) = (self.batch, self.seq, self.head_dim);
        let qkv = (self.heads_q + 2 * kv_heads) * b * s * d * elem;
        let mut mask = self.masked.map_or(0, |_| b * s * bool_bytes);
        if self.window.is_some() && imp.is_burn() {
            mask = s * s * bool_bytes;
        }
        let bias = match (self.bias, self.alibi && !imp.is_burn()) {
            (Some(_), true) => self.heads_q * 4,
            (Some(shape), false) => shape.iter().product::<usize>() * elem,
            (None, _) => 0,
        };
        (qkv + mask + bias) as u64
    }

    /// What the note says about the mask or bias.
    fn describe(&self) -> Option<String> {
        if let Some((left, right)) = self.window {
            return Some(format!("window ({left}, {right})"));
        }
        if let (true, Some(shape)) = (self.alibi, self.bias) {
            return Some(format!(
                "ALiBi from slopes [{}] (Burn's rows: the bias {shape:?})",
                shape[1]
            ));
        }
        if let Some(shape) = self.bias {
            let tracked = if self.bias_tracked { ", tracked" } else { "" };
            return Some(format!("ALiBi bias {shape:?}{tracked}"));
        }
        self.masked.map(|n| {
            format!(
                "padding mask [{}, 1, 1, {}], last {n} keys masked",
                self.batch, self.seq
            )
        })
    }
}

/// The inputs of one call on backend `B`.
struct Inputs<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    bias: Option<Tensor<B, 4>>,
    /// ALiBi slopes `[H]` (f32; burn-flash only).
    slopes: Option<Tensor<B, 1>>,
    /// A sliding window (burn-flash only; Burn's ops get it as a mask).
    window: Option<(usize, usize)>,
}

impl<B: Backend> Inputs<B> {
    /// The inputs of `imp` for `cfg`: [`Inputs::new`], as [`Inputs::for_burn`] for Burn's ops.
    fn of(cfg: &Config, imp: Impl, device: &B::Device) -> Self {
        Self::tracked(cfg, imp, false, device)
    }

    /// [`Inputs::of`], with `q`, `k`, `v` tracked (before Burn's repeat) when `track`.
    fn tracked(cfg: &Config, imp: Impl, track: bool, device: &B::Device) -> Self {
        let mut inputs = Self::new(cfg, device);
        if track {
            inputs.q = inputs.q.require_grad();
            inputs.k = inputs.k.require_grad();
            inputs.v = inputs.v.require_grad();
            if cfg.bias_tracked {
                inputs.bias = inputs.bias.map(|b| b.require_grad());
            }
        }
        if imp.is_burn() {
            inputs.for_burn()
        } else {
            inputs
        }
    }

    /// Random q, k, v (Normal(0, 1)) in the config's dtype, and its mask and bias.
    fn new(cfg: &Config, device: &B::Device) -> Self {
        let dtype = cfg.dtype.dtype();
        let (b, s, d) = (cfg.batch, cfg.seq, cfg.head_dim);
        let random = |heads: usize| {
            Tensor::<B, 4>::random([b, heads, s, d], Distribution::Normal(0.0, 1.0), device)
                .cast(dtype)
        };
        Self {
            q: random(cfg.heads_q),
            k: random(cfg.heads_kv),
            v: random(cfg.heads_kv),
            mask: cfg.masked.map(|n| padding_mask::<B>(b, s, n, device)),
            bias: cfg
                .bias
                .filter(|_| !cfg.alibi)
                .map(|shape| alibi_bias::<B>(shape, device).cast(dtype)),
            slopes: cfg.alibi.then(|| {
                Tensor::<B, 1>::from_data(
                    TensorData::new(alibi_slopes(cfg.heads_q), [cfg.heads_q]),
                    device,
                )
            }),
            window: cfg.window,
        }
    }

    /// The inputs as Burn's ops take them: K/V repeated to `Hq` heads (query head `h` reads
    /// key/value head `h / (Hq / Hkv)`, burn-flash's rule), mask and bias expanded to
    /// `[B, Hq, S, S]`.
    fn for_burn(self) -> Self {
        let [b, hq, s, _] = self.q.dims();
        let [_, hkv, _, _] = self.k.dims();
        let g = hq / hkv;
        let repeat = |t: Tensor<B, 4>| {
            if g == 1 {
                return t;
            }
            let d = t.dims()[3];
            t.reshape([b, hkv, 1, s * d])
                .expand([b, hkv, g, s * d])
                .reshape([b, hq, s, d])
        };
        let full = [b, hq, s, s];
        let device = self.q.device();
        let dtype = self.q.dtype();
        // ALiBi and the window as Burn's ops take them: the bias, a band mask.
        let bias = match self.slopes {
            Some(_) => Some(alibi_bias::<B>([1, hq, s, s], &device).cast(dtype)),
            None => self.bias,
        };
        let mask = match self.window {
            Some(w) => Some(band_mask::<B>(s, w, &device)),
            None => self.mask,
        };
        Self {
            q: self.q,
            k: repeat(self.k),
            v: repeat(self.v),
            mask: mask.map(|m| m.expand(full)),
            bias: bias.map(|x| x.expand(full)),
            slopes: None,
            window: None,
        }
    }
}

/// `[b, 1, 1, s]`, true (masked out) on the last `masked` keys.
fn padding_mask<B: Backend>(
    b: usize,
    s: usize,
    masked: usize,
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let values: Vec<bool> = (0..b * s).map(|i| i % s >= s - masked).collect();
    Tensor::from_data(TensorData::new(values, [b, 1, 1, s]), device)
}

/// The ALiBi slopes of `h` heads, `2^(−8(i+1)/h)`.
fn alibi_slopes(h: usize) -> Vec<f32> {
    (0..h)
        .map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32))
        .collect()
}

/// `[1, 1, s, s]`, true (masked out) outside the window `(left, right)` around the diagonal.
fn band_mask<B: Backend>(
    s: usize,
    (left, right): (usize, usize),
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let values: Vec<bool> = (0..s * s)
        .map(|n| {
            let (i, j) = ((n / s) as i64, (n % s) as i64);
            j < i - left as i64 || j > i + right as i64
        })
        .collect();
    Tensor::from_data(TensorData::new(values, [1, 1, s, s]), device)
}

/// ALiBi (module docs), in f32: `[1, H, S, S]` = `−slope_h·|i − j|`, or `[1, H, 1, S]` =
/// `−slope_h·(S − 1 − j)`.
fn alibi_bias<B: Backend>(shape: [usize; 4], device: &B::Device) -> Tensor<B, 4> {
    let [_, h, rows, s] = shape;
    let slopes = alibi_slopes(h);
    let slopes = Tensor::<B, 1>::from_data(TensorData::new(slopes, [h]), device)
        .reshape([1, h, 1, 1])
        .expand(shape);
    let keys = || {
        Tensor::<B, 1, Int>::arange(0..s as i64, device)
            .float()
            .reshape([1, 1, 1, s])
    };
    let distance = if rows == 1 {
        keys().neg().add_scalar((s - 1) as f32)
    } else {
        let queries = Tensor::<B, 1, Int>::arange(0..s as i64, device)
            .float()
            .reshape([1, 1, s, 1]);
        (queries.expand([1, 1, s, s]) - keys().expand([1, 1, s, s])).abs()
    };
    (distance.expand(shape) * slopes).neg()
}

/// Peak memory of one call in MiB, in a `--memory-only` process: the call's inputs plus the
/// most it held beyond what was in use before it, measured with exact pools (`peak_memory`).
fn peak_memory_mib<R: CubeRuntime, T>(
    client: &ComputeClient<R>,
    inputs_bytes: u64,
    run: impl FnOnce() -> T,
    sync: &dyn Fn(),
) -> f64 {
    let (out, m) = peak_memory::peak_memory(client, sync, run);
    drop(out);
    (inputs_bytes + m.peak.saturating_sub(m.before)) as f64 / (1 << 20) as f64
}

/// Seconds of one call between two syncs.
fn first_call_seconds<T>(sync: &dyn Fn(), call: impl FnOnce() -> T) -> f64 {
    sync();
    let start = Instant::now();
    let out = call();
    sync();
    let seconds = start.elapsed().as_secs_f64();
    drop(out);
    seconds
}

/// What one row measured: in a timing run the first call and the timings, in a
/// `--memory-only` run the peak.
struct Measured {
    first_call: Option<f64>,
    timings: Option<Timings>,
    peak_mib: Option<f64>,
}

/// One runtime's sweeps.
struct Bench<'a, R: CubeRuntime, BT: BoolElement> {
    cli: &'a Cli,
    device: R::Device,
    client: ComputeClient<R>,
    runtime: RuntimeName,
    protocol: Protocol,
    _bool: std::marker::PhantomData<BT>,
}

impl<R: CubeRuntime, BT: BoolElement> Bench<'_, R, BT> {
    fn sync(&self) {
        // Fusion's sync drains its lazy queue, then syncs the device both backends share.
        Fu::<R, BT>::sync(&self.device).expect("sync");
    }

    /// `attention{-wgpu}.csv`, or `….peak.csv` in a `--memory-only` run.
    fn path(&self) -> PathBuf {
        let kind = if self.cli.memory_only {
            "peak.csv"
        } else {
            "csv"
        };
        let name = format!("attention{}.{kind}", self.runtime.suffix());
        self.cli.common.out_path(&name)
    }

    /// Every configuration of the run, sweep by sweep, S ascending innermost.
    fn configs(&self) -> Vec<Config> {
        let cli = self.cli;
        let quick = cli.common.quick;
        let (batch, heads, gqa) = if quick {
            (QUICK_BATCH, QUICK_HEADS, QUICK_GQA_HEADS)
        } else {
            (BATCH, HEADS, GQA_HEADS)
        };
        let seqs = match (&cli.seqs[..], quick) {
            ([], true) => QUICK_SEQS.to_vec(),
            ([], false) => SEQS.to_vec(),
            (seqs, _) => seqs.to_vec(),
        };
        let dims = match (&cli.dims[..], quick) {
            ([], true) => QUICK_DIMS.to_vec(),
            ([], false) => DIMS.to_vec(),
            (dims, _) => dims.to_vec(),
        };
        let variant_dim = dims.iter().copied().max().unwrap_or(128);
        let causals = if cli.causal.is_empty() {
            vec![false, true]
        } else {
            cli.causal.clone()
        };
        let sweeps = [
            Variant::Main,
            Variant::Gqa,
            Variant::Bias,
            Variant::Mask,
            Variant::Alibi,
            Variant::Window,
        ];
        let mut configs = Vec::new();
        for variant in sweeps
            .into_iter()
            .filter(|v| cli.sweeps.is_empty() || cli.sweeps.contains(v))
        {
            let (heads_q, heads_kv) = match variant {
                Variant::Gqa => gqa,
                _ => (heads, heads),
            };
            let head_dims = match variant {
                Variant::Main => dims.clone(),
                _ => vec![variant_dim],
            };
            for &dtype in &cli.dtypes {
                for &head_dim in &head_dims {
                    for &causal in &causals {
                        if variant == Variant::Window && !causal {
                            continue;
                        }
                        for &seq in &seqs {
                            let alibi = variant == Variant::Alibi;
                            let bias = (variant == Variant::Bias || alibi).then(|| {
                                let full = seq <= cli.bias_full_max_s || alibi;
                                [1, heads_q, if full { seq } else { 1 }, seq]
                            });
                            let window =
                                (variant == Variant::Window).then(|| (cli.window.max(1) - 1, 0));
                            let masked = (variant == Variant::Mask)
                                .then(|| ((seq as f64 * MASKED_FRACTION).ceil() as usize).max(1));
                            configs.push(Config {
                                variant,
                                dtype,
                                batch,
                                heads_q,
                                heads_kv,
                                seq,
                                head_dim,
                                causal,
                                bias,
                                bias_tracked: cli.bias_tracked && bias.is_some() && !alibi,
                                masked,
                                alibi,
                                window,
                            });
                        }
                    }
                }
            }
        }
        configs
    }

    fn run(&self) {
        let mut csv = CsvOut::<Row>::create(self.path());
        let impls: Vec<Impl> = Impl::ALL
            .into_iter()
            .filter(|i| self.cli.impls.is_empty() || self.cli.impls.contains(i))
            .collect();
        let modes = match &self.cli.modes[..] {
            [] => vec![Mode::Fwd, Mode::Train],
            modes => modes.to_vec(),
        };
        for cfg in self.configs() {
            for &imp in &impls {
                let mut done: Vec<Row> = Vec::new();
                for &mode in &modes {
                    let row = self.row(&cfg, imp, mode);
                    print_row(&row);
                    csv.push(&row);
                    self.client.memory_cleanup();
                    done.push(row);
                }
                if let [fwd, train] = &done[..]
                    && let Some(bwd) = backward_row(&cfg, fwd, train)
                {
                    print_row(&bwd);
                    csv.push(&bwd);
                }
            }
        }
        println!("wrote {}", csv.path().display());
        if self.cli.memory_only {
            return;
        }
        if !self.cli.no_memory {
            merge_peaks::<Row>(
                csv.path(),
                &csv.path().with_extension("peak.csv"),
                Row::key,
                |row, p| row.peak_mib = p.peak_mib,
            );
        }
        draw(csv.path());
    }

    /// Why `cfg` cannot run on this device, if so.
    fn unsupported(&self, cfg: &Config) -> Option<String> {
        let dtype = cfg.dtype.dtype();
        if self.runtime == RuntimeName::Wgpu && dtype == FloatDType::BF16 {
            return Some("skipped: bf16 is not supported on wgpu".into());
        }
        // A dtype the device lacks is recorded, not run (a failed launch would poison Fusion's
        // stream for the rest of the process).
        if !Fu::<R, BT>::supports_dtype(&self.device, dtype.into()) {
            return Some("skipped: dtype not supported by the device".into());
        }
        None
    }

    /// The row of one (configuration, implementation, pass): measured, skipped or failed.
    fn row(&self, cfg: &Config, imp: Impl, mode: Mode) -> Row {
        let mut row = Row {
            runtime: self.runtime.name().into(),
            dtype: cfg.dtype.label().into(),
            batch: cfg.batch,
            heads_q: cfg.heads_q,
            heads_kv: cfg.heads_kv,
            seq: cfg.seq,
            head_dim: cfg.head_dim,
            causal: cfg.causal,
            variant: cfg.variant.name().into(),
            pass: mode.name().into(),
            implementation: imp.name().into(),
            ..Default::default()
        };
        // A skipped row's note is the reason alone.
        let skipped = self.unsupported(cfg).or_else(|| {
            (imp.is_burn() && cfg.seq > self.cli.burn_max_s)
                .then(|| "skipped (--burn-max-s)".to_string())
        });
        if let Some(why) = skipped {
            row.note = why;
            return row;
        }
        let mut notes: Vec<String> = cfg.describe().into_iter().collect();
        if imp == Impl::Flash {
            let dtype = DType::from(cfg.dtype.dtype());
            let options = FlashAttentionOptions {
                block_k: forced_block_k(),
                kernel: forced_kernel(),
                dropout: bench_dropout(),
                window: cfg.window,
                ..cfg.options().into()
            };
            if let Some(d) = bench_dropout() {
                notes.push(format!("dropout {}", d.prob));
            }
            // The plan of this row's call: its mask and bias (tracked only with
            // `--bias-tracked`) change the kernels the plan picks.
            let terms = burn_flash::ScoreTerms {
                mask: cfg.masked.is_some(),
                bias: cfg.bias.is_some() && !cfg.alibi,
                bias_tracked: cfg.bias_tracked,
                bias_rows_broadcast: cfg.bias.is_some_and(|s| s[2] == 1),
                alibi: cfg.alibi,
                sinks: false,
                varlen: false,
            };
            match burn_flash::attention_plan_with::<Fu<R, BT>>(
                &self.device,
                cfg.dims(),
                dtype,
                options,
                terms,
            ) {
                Some(Ok(plan)) => {
                    row.kernel = format!("{:?}", plan.kernel);
                    notes.push(format!(
                        "tiles {}x{}, {} units",
                        plan.config.block_q, plan.config.block_k, plan.units
                    ));
                    if mode == Mode::Train {
                        let backward = burn_flash::attention_backward_plan_with::<Fu<R, BT>>(
                            &self.device,
                            cfg.dims(),
                            dtype,
                            options,
                            terms,
                        );
                        if let Some(Ok(b)) = backward {
                            row.kernel = format!("{} + bwd {:?}", row.kernel, b.kernel);
                            notes.push(format!(
                                "backward blocks {} rows / {} keys, {} per step",
                                b.config.block_q, b.block_keys, b.config.block_k
                            ));
                        }
                    }
                }
                Some(Err(err)) => {
                    notes.push(format!("failed: unsupported: {err}"));
                    row.note = notes.join("; ");
                    return row;
                }
                None => row.kernel = "composed".into(),
            }
        } else if imp.is_burn() && cfg.heads_kv != cfg.heads_q {
            notes.push(format!(
                "K/V repeated to {} heads before the call",
                cfg.heads_q
            ));
        }
        match attempt(|| self.measure(cfg, imp, mode)) {
            Ok(m) => {
                let flop = cfg.flop() * mode.flop_factor();
                row.first_call_ms = m.first_call.map(ms);
                row.peak_mib = m.peak_mib.map(|p| sig(p, 4));
                if let Some(t) = m.timings {
                    row.wall_ms_median = Some(ms(t.wall.median));
                    row.tflop_per_s = Some(tflops(flop, t.wall.median));
                    row.device_ms_median = t.device_median().map(ms);
                    row.device_tflop_per_s = t.device_median().map(|d| tflops(flop, d));
                    row.timing_method = t.timing_method();
                    if t.calls_per_pass > 1 {
                        notes.push(format!("{} calls per pass", t.calls_per_pass));
                    }
                    let device_note = t.device_note();
                    if !device_note.is_empty() {
                        notes.push(device_note);
                    }
                }
            }
            Err(e) => notes.push(format!("failed: {e}")),
        }
        row.note = notes.join("; ");
        row
    }

    /// Makes the inputs and measures one row (module docs: protocol, peak memory).
    fn measure(&self, cfg: &Config, imp: Impl, mode: Mode) -> Measured {
        let options = cfg.options();
        let device = &self.device;
        match mode {
            Mode::Fwd => {
                let inputs = Inputs::<Fu<R, BT>>::of(cfg, imp, device);
                let twin = imp
                    .has_twin()
                    .then(|| Inputs::<Un<R, BT>>::of(cfg, imp, device));
                let twin_call = twin.as_ref().map(|t| move || imp.call(t, options));
                self.measure_calls(cfg, imp, || imp.call(&inputs, options), twin_call)
            }
            Mode::Train => {
                type Ad<B> = Autodiff<B>;
                let shape = [cfg.batch, cfg.heads_q, cfg.seq, cfg.head_dim];
                let normal = Distribution::Normal(0.0, 1.0);
                let inputs = Inputs::<Ad<Fu<R, BT>>>::tracked(cfg, imp, true, device);
                let g = Tensor::<Ad<Fu<R, BT>>, 4>::random(shape, normal, device)
                    .cast(cfg.dtype.dtype());
                let twin = imp.has_twin().then(|| {
                    let g = Tensor::<Ad<Un<R, BT>>, 4>::random(shape, normal, device)
                        .cast(cfg.dtype.dtype());
                    (Inputs::<Ad<Un<R, BT>>>::tracked(cfg, imp, true, device), g)
                });
                let twin_call = twin
                    .as_ref()
                    .map(|(t, g)| move || train_step(imp, t, g, options));
                self.measure_calls(
                    cfg,
                    imp,
                    || train_step(imp, &inputs, &g, options),
                    twin_call,
                )
            }
        }
    }

    /// Measures `call` (and device time through `twin_call` on the bare backend, where given).
    fn measure_calls<T, U: Send + 'static>(
        &self,
        cfg: &Config,
        imp: Impl,
        call: impl Fn() -> T,
        twin_call: Option<impl FnMut() -> U + Send>,
    ) -> Measured {
        let sync = || self.sync();
        sync();
        if self.cli.memory_only {
            // Compilation (and autotuning) outside the measured call.
            drop(call());
            sync();
            let kv_heads = if imp.is_burn() {
                cfg.heads_q
            } else {
                cfg.heads_kv
            };
            let bytes = cfg.input_bytes(imp, kv_heads, std::mem::size_of::<BT>());
            let peak = peak_memory_mib(&self.client, bytes, &call, &sync);
            return Measured {
                first_call: None,
                timings: None,
                peak_mib: Some(peak),
            };
        }
        let first_call = first_call_seconds(&sync, &call);
        let timings = match twin_call {
            Some(mut twin_call) => {
                // The twin's first call outside the profiled regions: nothing that compiles or
                // tunes runs inside `ComputeClient::profile`.
                drop(twin_call());
                Un::<R, BT>::sync(&self.device).expect("sync");
                let mut twin = Twin {
                    client: &self.client,
                    call: twin_call,
                };
                measure(self.protocol, &sync, &call, Ok(&mut twin))
            }
            None => measure(self.protocol, &sync, &call, Err(NO_TWIN_FUSION)),
        };
        Measured {
            first_call: Some(first_call),
            timings: Some(timings),
            peak_mib: None,
        }
    }
}

/// The derived backward-only row of a configuration: the training step's medians minus the
/// forward's (module docs); `None` unless both were measured.
fn backward_row(cfg: &Config, fwd: &Row, train: &Row) -> Option<Row> {
    // Differences of 4-digit medians, rounded as the medians are.
    let wall = sig(train.wall_ms_median? - fwd.wall_ms_median?, 4);
    let device = match (train.device_ms_median, fwd.device_ms_median) {
        (Some(t), Some(f)) => Some(sig(t - f, 4)),
        _ => None,
    };
    let flop = cfg.flop() * 2.5;
    let rate = |ms: f64| (ms > 0.0).then(|| tflops(flop, ms / 1e3));
    Some(Row {
        pass: "bwd".into(),
        kernel: train.kernel.clone(),
        first_call_ms: None,
        wall_ms_median: Some(wall),
        tflop_per_s: rate(wall),
        device_ms_median: device,
        device_tflop_per_s: device.and_then(rate),
        timing_method: train.timing_method.clone(),
        peak_mib: None,
        note: "derived: fwd+bwd minus fwd medians".into(),
        ..Row {
            runtime: train.runtime.clone(),
            dtype: train.dtype.clone(),
            batch: train.batch,
            heads_q: train.heads_q,
            heads_kv: train.heads_kv,
            seq: train.seq,
            head_dim: train.head_dim,
            causal: train.causal,
            variant: train.variant.clone(),
            implementation: train.implementation.clone(),
            ..Default::default()
        }
    })
}

fn fmt(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

fn print_row(r: &Row) {
    println!(
        "{} {:>4} B{} H{}/{} S{:>5} D{:>3} {:<6} {:<5} {:<7} {:<14} {:<11} first {:>9} ms  wall {:>9} ms {:>7} TFLOP/s  device {:>9} ms {:>7} TFLOP/s  peak {:>8} MiB  {}",
        r.runtime,
        r.dtype,
        r.batch,
        r.heads_q,
        r.heads_kv,
        r.seq,
        r.head_dim,
        if r.causal { "causal" } else { "full" },
        r.variant,
        r.pass,
        r.implementation,
        r.kernel,
        fmt(r.first_call_ms),
        fmt(r.wall_ms_median),
        fmt(r.tflop_per_s),
        fmt(r.device_ms_median),
        fmt(r.device_tflop_per_s),
        fmt(r.peak_mib),
        r.note,
    );
}

/// Wall TFLOP/s against S, a panel per dtype, head dim and causal setting, a line per
/// implementation (and variant, for the gqa/bias/mask sweeps); the PNG goes next to the CSV.
fn draw(csv: &Path) {
    let rows: Vec<Row> = match read_rows(csv) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("plot: {e}");
            return;
        }
    };
    let mut panels: Vec<Panel> = Vec::new();
    for r in &rows {
        let Some(rate) = r.tflop_per_s else {
            continue;
        };
        let causal = if r.causal { "causal" } else { "non-causal" };
        let pass = if r.pass.is_empty() { "fwd" } else { &r.pass };
        let title = format!("{} {} D {} {causal} {pass}", r.runtime, r.dtype, r.head_dim);
        let label = match r.variant.as_str() {
            "main" | "" => r.implementation.clone(),
            variant => format!("{} ({variant})", r.implementation),
        };
        add_point(
            &mut panels,
            &title,
            "TFLOP/s (median, wall)",
            &label,
            r.seq as f64,
            rate,
        );
    }
    let png = csv.with_extension("png");
    plot(&png, "S (sequence length)", &panels);
    println!("wrote {}", png.display());
}

fn bench<R: CubeRuntime, BT: BoolElement>(device: R::Device, runtime: RuntimeName, cli: &Cli) {
    let quick = cli.common.quick;
    let passes = cli.passes.unwrap_or(if quick { 3 } else { 10 }).max(1);
    let protocol = if quick {
        Protocol {
            warmup: 1,
            passes,
            calls: Calls::Fixed(1),
        }
    } else {
        Protocol {
            warmup: 3,
            passes,
            calls: Calls::AtLeast {
                seconds: 0.01,
                max: 50,
            },
        }
    };
    let bench = Bench::<R, BT> {
        cli,
        client: R::client(&device),
        device,
        runtime,
        protocol,
        _bool: std::marker::PhantomData,
    };
    bench.run();
}

fn main() {
    common::plan_inputs_from_env();
    let cli = Cli::parse();
    BLOCK_K.set(cli.block_k).expect("set once");
    KERNEL.set(cli.kernel).expect("set once");
    DROPOUT.set(cli.dropout).expect("set once");
    if let Some(why) = cli.common.missing_runtime() {
        Cli::command().error(ErrorKind::InvalidValue, why).exit();
    }
    if let Some(csv) = &cli.plot {
        draw(csv);
        return;
    }
    if cli.memory_only {
        // Before any device starts: exact pools for the whole process.
        peak_memory::use_exact_pool();
    } else if !cli.no_memory {
        // Peak memory is measured first, by this program in a process of its own (exact pools
        // would slow this one's timings down).
        run_memory_child();
    }
    #[cfg(feature = "cuda")]
    if cli.common.runs(RuntimeName::Cuda) {
        bench::<cubecl::cuda::CudaRuntime, u8>(Default::default(), RuntimeName::Cuda, &cli);
    }
    #[cfg(feature = "wgpu")]
    if cli.common.runs(RuntimeName::Wgpu) {
        bench::<burn::backend::wgpu::WgpuRuntime, u32>(Default::default(), RuntimeName::Wgpu, &cli);
    }
}
