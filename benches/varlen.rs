//! Packed variable-length attention ([`burn_flash::attention_varlen`]) against the dense call
//! at the same token count and the padded batch, forward and training step.
//!
//! `cargo bench --bench varlen -- [--quick] [--out DIR] [--runtimes cuda,wgpu] [--dtypes bf16]
//! [--tokens 65536] [--lengths 64,4096] [--dim 128] [--heads 16] [--causal false,true]
//! [--modes fwd,train] [--seed 7] [--passes N]`
//!
//! # Configurations
//! Sequence lengths are drawn uniformly from `--lengths` (64–4096) with `--seed` until they hold
//! `--tokens` (65 536) tokens, the last one cut to fit (at least the shortest length; the draw
//! is printed and in each row's note). H heads (`--heads`, 16, no GQA), head dim `--dim` (128),
//! causal and not. Rows (`impl` column):
//! - `varlen`: `attention_varlen` over the packed `[T, H, D]` tensors;
//! - `dense`: `attention` over `[T / 4096, H, 4096, D]`, the same tokens in sequences of the
//!   longest length (the throughput a packed batch aims at);
//! - `padded`: `attention` over `[n, H, max length, D]` with a key padding mask `[n, 1, 1,
//!   max]` (what a batch of mixed lengths costs without varlen: every padded query row and key
//!   is computed);
//! - `burn-padded`: Burn's `module::attention` on the padded batch (its mask expanded per head),
//!   fwd only; a failure (memory) is a row with the reason.
//!
//! FLOP: each row's own useful work, `Σ_b 4·H·l_b²·D` (halved when causal) for `varlen`,
//! `padded` and `burn-padded` (so their TFLOP/s compare as time), `4·B·H·S²·D` for `dense`;
//! ×3.5 for a training step (the forward, then `(out ⊙ g).backward()` with a random `g`, as the
//! attention bench's step). Timing: `common::measure` (3 warm-up calls,
//! `--passes` passes of calls lasting ≥ 10 ms between two syncs, the median per call) on
//! Fusion (`wall_ms_median`), and the same op on the bare `CubeBackend` inside
//! `ComputeClient::profile` for `device_ms_median`.
//!
//! # Files (under `target/bench/` or `--out`)
//! `varlen.csv` (`varlen-wgpu.csv` for wgpu when CUDA is built too): `runtime, dtype, tokens,
//! sequences, max_len, heads, head_dim, causal, pass, impl, kernel, wall_ms_median,
//! TFLOP_per_s, device_ms_median, device_TFLOP_per_s, note`; `varlen.png`: wall TFLOP/s per
//! implementation, a panel per dtype, causal setting and pass.

mod common;

use burn::backend::Autodiff;
use burn::tensor::{
    Bool, DType, Distribution, Tensor, TensorData, backend::Backend, module,
    ops::AttentionModuleOptions,
};
use burn_cubecl::{BoolElement, CubeRuntime};
use burn_flash::{
    FlashAttentionOptions, FlashBackend, HeadTerms, VarlenBatch, attention::AttentionDims,
};
use clap::{CommandFactory, Parser, ValueEnum, error::ErrorKind};
use common::*;
use serde::{Deserialize, Serialize};

/// Packed variable-length attention bench (module docs).
#[derive(Parser, Debug)]
#[command(name = "varlen", bin_name = "varlen")]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// Element types.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [DTypeName::Bf16])]
    dtypes: Vec<DTypeName>,
    /// Tokens per batch [default: 65536; 2048 with --quick].
    #[arg(long)]
    tokens: Option<usize>,
    /// Shortest and longest sequence drawn [default: 64,4096; 16,512 with --quick].
    #[arg(long, value_delimiter = ',')]
    lengths: Vec<usize>,
    /// Head dim.
    #[arg(long, default_value_t = 128)]
    dim: usize,
    /// Heads (query and key/value).
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// Causal settings [default: false,true].
    #[arg(long, value_delimiter = ',')]
    causal: Vec<bool>,
    /// Passes to time [default: fwd,train].
    #[arg(long, value_enum, value_delimiter = ',')]
    modes: Vec<Mode>,
    /// Seed of the length draw.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Timed passes per row [default: 10; 3 with --quick].
    #[arg(long)]
    passes: Option<usize>,
}

/// What a row times.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The forward.
    Fwd,
    /// Forward + backward under `Autodiff`.
    Train,
}

/// One implementation (the `impl` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Impl {
    Varlen,
    Dense,
    Padded,
    BurnPadded,
}

impl Impl {
    fn name(self) -> &'static str {
        match self {
            Impl::Varlen => "varlen",
            Impl::Dense => "dense",
            Impl::Padded => "padded",
            Impl::BurnPadded => "burn-padded",
        }
    }
}

/// A row of `varlen.csv` (module docs).
#[derive(Serialize, Deserialize, Default, Debug)]
#[serde(default)]
struct Row {
    runtime: String,
    dtype: String,
    tokens: usize,
    sequences: usize,
    max_len: usize,
    heads: usize,
    head_dim: usize,
    causal: bool,
    pass: String,
    #[serde(rename = "impl")]
    implementation: String,
    kernel: String,
    wall_ms_median: Option<f64>,
    #[serde(rename = "TFLOP_per_s")]
    tflop_per_s: Option<f64>,
    device_ms_median: Option<f64>,
    #[serde(rename = "device_TFLOP_per_s")]
    device_tflop_per_s: Option<f64>,
    note: String,
}

/// Lengths drawn uniformly from `lo ..= hi` until they hold `tokens` (a SplitMix64 stream from
/// `seed`); the last one cut to fit, and dropped below `lo`.
fn draw_lengths(tokens: usize, lo: usize, hi: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut lengths = Vec::new();
    let mut left = tokens;
    while left >= lo {
        let l = (lo + (next() % (hi - lo + 1) as u64) as usize).min(left);
        lengths.push(l);
        left -= l;
    }
    lengths
}

/// The tensors of one row on backend `B`: `q`, `k`, `v` (packed `[T, H, D]` for varlen, `[B,
/// H, S, D]` otherwise) and the padded rows' mask.
struct Call<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    batch: Option<VarlenBatch<B>>,
}

impl<B: FlashBackend> Call<B> {
    fn new(imp: Impl, lengths: &[usize], cfg: &Cfg, device: &B::Device) -> Self {
        let tokens: usize = lengths.iter().sum();
        let max = lengths.iter().copied().max().unwrap_or(0);
        let (b, s) = match imp {
            Impl::Varlen => (1, tokens),
            Impl::Dense => (tokens / cfg.dense_len, cfg.dense_len),
            Impl::Padded | Impl::BurnPadded => (lengths.len(), max),
        };
        // A packed batch as a model holds it, `[T, H, D]` contiguous (here `[1, T, H, D]`); the
        // others `[B, H, S, D]`.
        let shape = match imp {
            Impl::Varlen => [1, s, cfg.heads, cfg.dim],
            _ => [b, cfg.heads, s, cfg.dim],
        };
        let random = || {
            Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(cfg.dtype)
        };
        let mask = matches!(imp, Impl::Padded | Impl::BurnPadded).then(|| {
            let values: Vec<bool> = lengths
                .iter()
                .flat_map(|&l| (0..max).map(move |j| j >= l))
                .collect();
            Tensor::from_data(TensorData::new(values, [b, 1, 1, max]), device)
        });
        let batch = (imp == Impl::Varlen).then(|| VarlenBatch::self_attention(lengths, device));
        Self {
            q: random(),
            k: random(),
            v: random(),
            mask,
            batch,
        }
    }

    /// A training step's output gradient: Normal(0, 1) in the output's shape (`q`'s).
    fn output_grad(&self, cfg: &Cfg, device: &B::Device) -> Tensor<B, 4> {
        Tensor::<B, 4>::random(self.q.shape(), Distribution::Normal(0.0, 1.0), device)
            .cast(cfg.dtype)
    }

    fn tracked(mut self) -> Self {
        self.q = self.q.require_grad();
        self.k = self.k.require_grad();
        self.v = self.v.require_grad();
        self
    }

    /// One call of `imp`; the output as `[B, H, S, D]` (`[1, T, H, D]` for the packed batch: no
    /// copy outside the call).
    fn run(&self, imp: Impl, causal: bool) -> Tensor<B, 4> {
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        let (q, k, v) = (self.q.clone(), self.k.clone(), self.v.clone());
        match imp {
            Impl::Varlen => {
                let tokens = |t: Tensor<B, 4>| t.squeeze_dim::<3>(0);
                let batch = self.batch.as_ref().expect("packed batch");
                let (out, _) = burn_flash::attention_varlen(
                    tokens(q),
                    tokens(k),
                    tokens(v),
                    batch,
                    None,
                    None,
                    HeadTerms::default(),
                    FlashAttentionOptions::from(options),
                );
                out.unsqueeze_dim::<4>(0)
            }
            Impl::Dense | Impl::Padded => {
                burn_flash::attention(q, k, v, self.mask.clone(), None, options)
            }
            Impl::BurnPadded => {
                let [b, h, s, _] = q.dims();
                let mask = self.mask.clone().map(|m| m.expand([b, h, s, s]));
                module::attention(q, k, v, mask, None, options)
            }
        }
    }
}

/// The configuration of one row.
#[derive(Clone, Copy)]
struct Cfg {
    dtype: burn::tensor::FloatDType,
    heads: usize,
    dim: usize,
    dense_len: usize,
}

fn bench<R: CubeRuntime, BT: BoolElement>(runtime: RuntimeName, cli: &Cli) {
    let device = R::Device::default();
    let client = R::client(&device);
    let quick = cli.common.quick;
    let tokens = cli.tokens.unwrap_or(if quick { 2048 } else { 65536 });
    let (lo, hi) = match cli.lengths[..] {
        [lo, hi] => (lo, hi),
        _ if quick => (16, 512),
        _ => (64, 4096),
    };
    let lengths = draw_lengths(tokens, lo, hi, cli.seed);
    let tokens: usize = lengths.iter().sum();
    let max = lengths.iter().copied().max().unwrap_or(0);
    println!(
        "{} sequences, {tokens} tokens, lengths {lo}..={hi} (seed {}): {lengths:?}",
        lengths.len(),
        cli.seed
    );
    let protocol = Protocol {
        warmup: if quick { 1 } else { 3 },
        passes: cli.passes.unwrap_or(if quick { 3 } else { 10 }),
        calls: Calls::AtLeast {
            seconds: 0.01,
            max: 50,
        },
    };
    let file = format!("varlen{}.csv", runtime.suffix());
    let mut csv = CsvOut::<Row>::create(cli.common.out_path(&file));
    let modes = match &cli.modes[..] {
        [] => vec![Mode::Fwd, Mode::Train],
        m => m.to_vec(),
    };
    let causals = match &cli.causal[..] {
        [] => vec![false, true],
        c => c.to_vec(),
    };
    let sync = || Fu::<R, BT>::sync(&device).expect("sync");
    for &dtype_name in &cli.dtypes {
        let dtype = dtype_name.dtype();
        let cfg = Cfg {
            dtype,
            heads: cli.heads,
            dim: cli.dim,
            dense_len: hi.min(tokens),
        };
        // Burn's padded rows last: where one fails inside cubecl (it did on an H200, s35),
        // Fusion's device thread stops and every later row of the process fails too.
        let order = [Impl::Varlen, Impl::Dense, Impl::Padded, Impl::BurnPadded];
        let mut runs = Vec::new();
        for imp in order {
            for &causal in &causals {
                runs.extend(modes.iter().map(|&mode| (imp, causal, mode)));
            }
        }
        for (imp, causal, mode) in runs {
            let useful: f64 = lengths
                .iter()
                .map(|&l| 4.0 * (cli.heads * cli.dim) as f64 * (l * l) as f64)
                .sum::<f64>()
                * if causal { 0.5 } else { 1.0 };
            let dense_b = tokens / cfg.dense_len;
            let dense = 4.0
                * (dense_b * cli.heads * cli.dim) as f64
                * (cfg.dense_len * cfg.dense_len) as f64
                * if causal { 0.5 } else { 1.0 };
            {
                {
                    let mut row = Row {
                        runtime: runtime.name().into(),
                        dtype: dtype_name.label().into(),
                        tokens,
                        sequences: lengths.len(),
                        max_len: max,
                        heads: cli.heads,
                        head_dim: cli.dim,
                        causal,
                        pass: match mode {
                            Mode::Fwd => "fwd".into(),
                            Mode::Train => "fwd+bwd".into(),
                        },
                        implementation: imp.name().into(),
                        ..Default::default()
                    };
                    let shape = match imp {
                        Impl::Varlen => format!("packed [{tokens}, {}, {}]", cli.heads, cli.dim),
                        Impl::Dense => {
                            format!("[{dense_b}, {}, {}, {}]", cli.heads, cfg.dense_len, cli.dim)
                        }
                        _ => format!(
                            "[{}, {}, {max}, {}] + padding mask",
                            lengths.len(),
                            cli.heads,
                            cli.dim
                        ),
                    };
                    row.note = format!("{shape}; lengths seed {}", cli.seed);
                    if imp == Impl::BurnPadded && mode == Mode::Train {
                        continue;
                    }
                    if runtime == RuntimeName::Wgpu && dtype == burn::tensor::FloatDType::BF16 {
                        row.note = "skipped: bf16 is not supported on wgpu".into();
                        csv.push(&row);
                        continue;
                    }
                    let flop = match imp {
                        Impl::Dense => dense,
                        _ => useful,
                    } * match mode {
                        Mode::Fwd => 1.0,
                        Mode::Train => 3.5,
                    };
                    let (b, s) = match imp {
                        Impl::Varlen => (1, tokens),
                        Impl::Dense => (dense_b, cfg.dense_len),
                        _ => (lengths.len(), max),
                    };
                    let dims = AttentionDims {
                        batch: b,
                        heads_q: cli.heads,
                        heads_kv: cli.heads,
                        seq_q: s,
                        seq_k: s,
                        head_dim: cli.dim,
                        value_dim: cli.dim,
                    };
                    if imp != Impl::BurnPadded {
                        let terms = burn_flash::ScoreTerms {
                            mask: matches!(imp, Impl::Padded),
                            varlen: imp == Impl::Varlen,
                            ..Default::default()
                        };
                        let options = FlashAttentionOptions::from(AttentionModuleOptions {
                            is_causal: causal,
                            ..Default::default()
                        });
                        let dt = DType::from(dtype);
                        if let Some(Ok(p)) = burn_flash::attention_plan_with::<Fu<R, BT>>(
                            &device, dims, dt, options, terms,
                        ) {
                            row.kernel = format!("{:?}", p.kernel);
                        }
                        if mode == Mode::Train
                            && let Some(Ok(p)) = burn_flash::attention_backward_plan_with::<Fu<R, BT>>(
                                &device, dims, dt, options, terms,
                            )
                        {
                            row.kernel = format!("{} + bwd {:?}", row.kernel, p.kernel);
                        }
                    }
                    let measured = attempt(|| match mode {
                        Mode::Fwd => {
                            let call = Call::<Fu<R, BT>>::new(imp, &lengths, &cfg, &device);
                            let twin = Call::<Un<R, BT>>::new(imp, &lengths, &cfg, &device);
                            let mut twin = Twin {
                                client: &client,
                                call: || twin.run(imp, causal),
                            };
                            measure(protocol, &sync, || call.run(imp, causal), Ok(&mut twin))
                        }
                        Mode::Train => {
                            type Ad<B> = Autodiff<B>;
                            let call =
                                Call::<Ad<Fu<R, BT>>>::new(imp, &lengths, &cfg, &device).tracked();
                            let twin =
                                Call::<Ad<Un<R, BT>>>::new(imp, &lengths, &cfg, &device).tracked();
                            let g = call.output_grad(&cfg, &device);
                            let twin_g = twin.output_grad(&cfg, &device);
                            let step = |c: &Call<Ad<Fu<R, BT>>>| {
                                let grads = (c.run(imp, causal) * g.clone()).backward();
                                c.q.grad(&grads).expect("dq")
                            };
                            let mut twin = Twin {
                                client: &client,
                                call: || {
                                    let grads = (twin.run(imp, causal) * twin_g.clone()).backward();
                                    twin.q.grad(&grads).expect("dq")
                                },
                            };
                            measure(protocol, &sync, || step(&call), Ok(&mut twin))
                        }
                    });
                    match measured {
                        Ok(t) => {
                            row.wall_ms_median = Some(sig(ms(t.wall.median), 4));
                            row.tflop_per_s = Some(sig(tflops(flop, t.wall.median), 4));
                            if let Some(d) = t.device_median() {
                                row.device_ms_median = Some(sig(ms(d), 4));
                                row.device_tflop_per_s = Some(sig(tflops(flop, d), 4));
                            }
                        }
                        Err(why) => row.note = format!("{}; failed: {why}", row.note),
                    }
                    println!(
                        "{} {} causal {} {} {:>12} {:>24}: {:?} ms, {:?} TFLOP/s (device {:?} ms) {}",
                        row.runtime,
                        row.dtype,
                        row.causal,
                        row.pass,
                        row.implementation,
                        row.kernel,
                        row.wall_ms_median,
                        row.tflop_per_s,
                        row.device_ms_median,
                        row.note
                    );
                    csv.push(&row);
                    client.memory_cleanup();
                }
            }
        }
    }
    println!("wrote {}", csv.path().display());
    draw(csv.path());
}

/// `varlen.png` beside the CSV: wall TFLOP/s per implementation (x: the tokens).
fn draw(csv: &std::path::Path) {
    let Ok(rows) = read_rows::<Row>(csv) else {
        return;
    };
    let mut panels = Vec::new();
    for r in &rows {
        if let Some(t) = r.tflop_per_s {
            let title = format!("{} {} causal {}", r.dtype, r.pass, r.causal);
            add_point(
                &mut panels,
                &title,
                "TFLOP/s (wall)",
                &r.implementation,
                r.tokens as f64,
                t,
            );
        }
    }
    if !panels.is_empty() {
        plot(&csv.with_extension("png"), "tokens", &panels);
    }
}

fn main() {
    common::plan_inputs_from_env();
    let cli = Cli::parse();
    if let Some(why) = cli.common.missing_runtime() {
        Cli::command().error(ErrorKind::InvalidValue, why).exit();
    }
    #[cfg(feature = "cuda")]
    if cli.common.runs(RuntimeName::Cuda) {
        bench::<cubecl::cuda::CudaRuntime, u8>(RuntimeName::Cuda, &cli);
    }
    #[cfg(feature = "wgpu")]
    if cli.common.runs(RuntimeName::Wgpu) {
        bench::<burn::backend::wgpu::WgpuRuntime, u32>(RuntimeName::Wgpu, &cli);
    }
}
