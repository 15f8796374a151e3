//! A small GPT-style decoder-only transformer trained on multi-query associative recall, with
//! burn-nn's transformer or burn-flash's drop-in one: the same model, the same initial weights,
//! the same batches; only the attention modules differ (`--impls burn,flash`).
//!
//! **The task** (MQAR, synthetic, defined here): each sequence of `S` tokens hides 16 key/value
//! pairs (64 possible keys, 64 values) at random places among noise tokens; its last 32 tokens
//! ask for the 16 keys again in
//! another order, each followed by its value. The loss is the cross-entropy of the value after
//! each asked key, so the model must find the key's first occurrence anywhere in the
//! sequence: attention over the whole context, unlike next-token prediction on nearby text.
//!
//! ```sh
//! # Train both on wgpu (lavapipe on a CPU-only machine: small and short), loss curves in PNG:
//! cargo run --release --example gpt -- train
//! # On a GPU: bf16, longer sequences; then step time and peak memory per S, and decoding:
//! cargo run --release --features cuda --example gpt -- train --runtime cuda --dtype bf16 \
//!     --seq 1024 --batch 16 --d-model 256 --layers 4 --steps 2000
//! cargo run --release --features cuda --example gpt -- bench --runtime cuda --dtype bf16
//! cargo run --release --features cuda --example gpt -- decode --runtime cuda --dtype bf16
//! ```
//!
//! Output under `target/bench/gpt/` (or `--out`): `loss-{burn,flash}.csv`, `loss.png`,
//! `bench.csv`, `decode.csv`. Each bench point runs in a child process of its own (a CUDA
//! out-of-memory panics; it is recorded and the sweep goes on), with cubecl's exact memory pools
//! for the peak-memory column (`tests/common/peak_memory.rs`).

#[path = "../benches/common/mod.rs"]
mod common;
#[path = "../tests/common/peak_memory.rs"]
mod peak_memory;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::transformer::{TransformerEncoder as BurnEncoder, TransformerEncoderConfig};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{
    DType, ElementConversion, FloatDType, Int, IntDType, Tensor, TensorData, backend::Backend,
};
use burn_cubecl::CubeRuntime;
use burn_flash::FlashBackend;
use burn_flash::nn::{RowCache, TransformerEncoder as FlashEncoder, TransformerEncoderInput};
use clap::{Parser, Subcommand, ValueEnum};
use common::{DTypeName, Fu, Panel, RuntimeName, add_point, plot};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};

// -- the task --

/// Key/value pairs per sequence.
const PAIRS: usize = 16;
const KEYS: usize = 64;
const VALUES: usize = 64;
const NOISE: usize = 512;
/// Ignored target.
const PAD: usize = KEYS + VALUES + NOISE;
const VOCAB: usize = PAD + 1;

/// A batch: tokens `[B, S]` and targets `[B, S]` (the value after each asked key, `PAD`
/// elsewhere).
struct Batch {
    tokens: Vec<i64>,
    targets: Vec<i64>,
}

fn batch(rng: &mut StdRng, batch: usize, seq: usize) -> Batch {
    assert!(seq >= 8 * PAIRS, "--seq must be at least {}", 8 * PAIRS);
    let mut tokens = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut keys: Vec<usize> = (0..KEYS).collect();
        keys.shuffle(rng);
        let keys = &keys[..PAIRS];
        let values: Vec<usize> = (0..PAIRS)
            .map(|_| KEYS + rng.random_range(0..VALUES))
            .collect();
        let context = seq - 2 * PAIRS;
        let mut seq_tokens: Vec<usize> = (0..context)
            .map(|_| KEYS + VALUES + rng.random_range(0..NOISE))
            .collect();
        // The pairs at distinct even offsets of the context.
        let mut slots: Vec<usize> = (0..context / 2).collect();
        slots.shuffle(rng);
        for (p, &slot) in slots[..PAIRS].iter().enumerate() {
            seq_tokens[2 * slot] = keys[p];
            seq_tokens[2 * slot + 1] = values[p];
        }
        let mut seq_targets = vec![PAD; context];
        let mut order: Vec<usize> = (0..PAIRS).collect();
        order.shuffle(rng);
        for p in order {
            seq_tokens.push(keys[p]);
            seq_targets.push(values[p]);
            seq_tokens.push(values[p]);
            seq_targets.push(PAD);
        }
        tokens.extend(seq_tokens.iter().map(|&t| t as i64));
        targets.extend(seq_targets.iter().map(|&t| t as i64));
    }
    Batch { tokens, targets }
}

// -- the model --

/// Which transformer the model runs.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Impl {
    /// burn-nn's `TransformerEncoder`, causal by `generate_autoregressive_mask`.
    Burn,
    /// burn-flash's drop-in `TransformerEncoder`, `causal()`.
    Flash,
}

impl Impl {
    fn name(self) -> &'static str {
        match self {
            Impl::Burn => "burn",
            Impl::Flash => "flash",
        }
    }
}

/// Token and learned position embeddings, a pre-LN transformer stack, a final norm and the
/// vocabulary head. Exactly one of the two stacks is present.
#[derive(Module, Debug)]
struct Gpt<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    burn: Option<BurnEncoder<B>>,
    flash: Option<FlashEncoder<B>>,
    norm: LayerNorm<B>,
    head: Linear<B>,
}

#[derive(Clone, Copy, Debug)]
struct ModelSize {
    d_model: usize,
    layers: usize,
    heads: usize,
    max_seq: usize,
    dropout: f64,
}

impl<B: FlashBackend> Gpt<B> {
    /// A model with burn-nn's stack; [`Gpt::into_impl`] moves its weights into ours.
    fn new(size: ModelSize, device: &B::Device) -> Self {
        let stack =
            TransformerEncoderConfig::new(size.d_model, 4 * size.d_model, size.heads, size.layers)
                .with_norm_first(true)
                .with_dropout(size.dropout)
                .init(device);
        Self {
            tokens: EmbeddingConfig::new(VOCAB, size.d_model).init(device),
            positions: EmbeddingConfig::new(size.max_seq, size.d_model).init(device),
            burn: Some(stack),
            flash: None,
            norm: LayerNormConfig::new(size.d_model).init(device),
            head: LinearConfig::new(size.d_model, VOCAB).init(device),
        }
    }

    /// The same weights with the stack of `which`.
    fn into_impl(mut self, which: Impl) -> Self {
        if which == Impl::Flash
            && let Some(stack) = self.burn.take()
        {
            self.flash = Some(stack.into());
        }
        self
    }

    /// Token plus position embeddings of `tokens` at positions `start..`.
    fn embed(&self, tokens: Tensor<B, 2, Int>, start: usize) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let pos = Tensor::<B, 1, Int>::arange(start as i64..(start + seq) as i64, &device)
            .reshape([1, seq])
            .expand([batch, seq]);
        self.tokens.forward(tokens) + self.positions.forward(pos)
    }

    /// Logits `[B, S, VOCAB]`.
    fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let x = self.embed(tokens, 0);
        let x = match (&self.burn, &self.flash) {
            (Some(stack), _) => stack.forward(
                burn::nn::transformer::TransformerEncoderInput::new(x)
                    .mask_attn(generate_autoregressive_mask(batch, seq, &device)),
            ),
            (_, Some(stack)) => stack.forward(TransformerEncoderInput::new(x).causal()),
            _ => unreachable!("a stack"),
        };
        self.head.forward(self.norm.forward(x))
    }

    /// The mean cross-entropy of the answers, and their accuracy (read back: a sync).
    fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> (Tensor<B, 1>, f64) {
        let [batch, seq] = tokens.dims();
        let logits = self
            .forward(tokens)
            .reshape([batch * seq, VOCAB])
            .cast(DType::F32);
        let loss = answer_loss(logits.clone(), targets.clone(), batch);
        let targets = targets.reshape([batch * seq]);
        let asked = targets.clone().not_equal_elem(PAD as i64);
        let hits = logits
            .argmax(1)
            .reshape([batch * seq])
            .equal(targets)
            .bool_and(asked);
        let hits = hits.int().sum().into_scalar().elem::<f64>();
        (loss, hits / (batch * PAIRS) as f64)
    }
}

/// The mean cross-entropy over the answers only (`batch · PAIRS` of them): `−log p(value)` at
/// each asked key.
fn answer_loss<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 2, Int>,
    batch: usize,
) -> Tensor<B, 1> {
    let n = logits.dims()[0];
    let targets = targets.reshape([n, 1]);
    let asked = targets
        .clone()
        .not_equal_elem(PAD as i64)
        .float()
        .cast(DType::F32);
    let log_p = burn::tensor::activation::log_softmax(logits, 1).gather(1, targets);
    (log_p * asked)
        .sum()
        .neg()
        .div_scalar((batch * PAIRS) as f64)
}

// -- command line --

#[derive(Parser, Debug)]
#[command(about = "A GPT-style model on multi-query associative recall, burn-nn vs burn-flash")]
struct Cli {
    #[command(subcommand)]
    task: Task,
    /// Runtime.
    #[arg(long, value_enum, global = true, default_value = "wgpu")]
    runtime: RuntimeName,
    /// Float type of the whole model.
    #[arg(long, value_enum, global = true, default_value = "f32")]
    dtype: DTypeName,
    /// Model width.
    #[arg(long, global = true, default_value_t = 64)]
    d_model: usize,
    /// Transformer layers.
    #[arg(long, global = true, default_value_t = 2)]
    layers: usize,
    /// Attention heads.
    #[arg(long, global = true, default_value_t = 4)]
    heads: usize,
    /// Output directory [default: target/bench/gpt].
    #[arg(long, global = true)]
    out: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Task {
    /// Train each implementation from the same weights on the same batches; loss curves.
    Train {
        #[arg(long, default_value_t = 256)]
        seq: usize,
        #[arg(long, default_value_t = 8)]
        batch: usize,
        #[arg(long, default_value_t = 300)]
        steps: usize,
        #[arg(long, default_value_t = 2e-3)]
        lr: f64,
        #[arg(long, default_value_t = 0.0)]
        dropout: f64,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Impl::Burn, Impl::Flash])]
        impls: Vec<Impl>,
        #[arg(long, default_value_t = 20)]
        log_every: usize,
    },
    /// Training step time and peak memory per sequence length (tokens per step fixed).
    Bench {
        #[arg(long, value_delimiter = ',', default_values_t = [1024, 2048, 4096, 8192])]
        seqs: Vec<usize>,
        /// Tokens per step (batch = tokens / S, at least 1).
        #[arg(long, default_value_t = 16384)]
        tokens: usize,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Impl::Burn, Impl::Flash])]
        impls: Vec<Impl>,
        /// Timed steps (after 2 warm-up steps).
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Skip the peak-memory children (time only).
        #[arg(long)]
        no_memory: bool,
        /// Skip the timing children (memory only).
        #[arg(long)]
        no_time: bool,
    },
    /// Per-token decoding latency with the KV cache against recomputing the prefix.
    Decode {
        /// On the bare CubeCL backend instead of Burn's Fusion (`Cuda`/`Wgpu`).
        #[arg(long)]
        bare: bool,
        #[arg(long, default_value_t = 4096)]
        context: usize,
        #[arg(long, default_value_t = 16)]
        tokens: usize,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Impl::Burn, Impl::Flash])]
        impls: Vec<Impl>,
    },
    /// One bench point (run by `bench` in a child process).
    #[command(hide = true)]
    Point {
        #[arg(long)]
        which: Impl,
        #[arg(long)]
        seq: usize,
        #[arg(long)]
        batch: usize,
        #[arg(long)]
        steps: usize,
        #[arg(long)]
        memory: bool,
    },
}

impl Cli {
    fn out(&self) -> PathBuf {
        let dir = self.out.clone().unwrap_or_else(|| {
            let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
            Path::new(&target).join("bench").join("gpt")
        });
        std::fs::create_dir_all(&dir).expect("output directory");
        dir
    }

    fn size(&self, max_seq: usize, dropout: f64) -> ModelSize {
        ModelSize {
            d_model: self.d_model,
            layers: self.layers,
            heads: self.heads,
            max_seq,
            dropout,
        }
    }
}

type Train<R> = Autodiff<Fu<R, u8>>;

fn main() {
    let cli = Cli::parse();
    if !cli.runtime.built_in() {
        eprintln!(
            "gpt: runtime `{0}` is not built in (build with `--features {0}`)",
            cli.runtime.name()
        );
        std::process::exit(2);
    }
    if let Task::Point { memory: true, .. } = cli.task {
        // Before any device starts.
        peak_memory::use_exact_pool();
    }
    match cli.runtime {
        #[cfg(feature = "cuda")]
        RuntimeName::Cuda => run::<cubecl::cuda::CudaRuntime>(&cli),
        #[cfg(feature = "wgpu")]
        RuntimeName::Wgpu => run::<burn::backend::wgpu::WgpuRuntime>(&cli),
        #[allow(unreachable_patterns)]
        _ => unreachable!("checked above"),
    }
}

fn run<R: CubeRuntime>(cli: &Cli) {
    let device = R::Device::default();
    if cli.dtype != DTypeName::F32 {
        let dtype: FloatDType = cli.dtype.dtype();
        burn::tensor::set_default_dtypes::<Train<R>>(&device, dtype, IntDType::I32)
            .expect("default dtypes");
    }
    match &cli.task {
        Task::Train {
            seq,
            batch,
            steps,
            lr,
            dropout,
            impls,
            log_every,
        } => train::<R>(
            cli, &device, *seq, *batch, *steps, *lr, *dropout, impls, *log_every,
        ),
        Task::Bench {
            seqs,
            tokens,
            impls,
            steps,
            no_memory,
            no_time,
        } => bench(cli, seqs, *tokens, impls, *steps, *no_memory, *no_time),
        Task::Decode {
            bare,
            context,
            tokens,
            impls,
        } => decode::<R>(cli, &device, *context, *tokens, impls, *bare),
        Task::Point {
            which,
            seq,
            batch,
            steps,
            memory,
        } => point::<R>(cli, &device, *which, *seq, *batch, *steps, *memory),
    }
}

fn ints<B: Backend>(values: &[i64], dims: [usize; 2], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), device)
}

fn sync<B: Backend>(device: &B::Device) {
    B::sync(device).expect("sync");
}

#[allow(clippy::too_many_arguments)]
fn train<R: CubeRuntime>(
    cli: &Cli,
    device: &R::Device,
    seq: usize,
    batch_size: usize,
    steps: usize,
    lr: f64,
    dropout: f64,
    impls: &[Impl],
    log_every: usize,
) {
    type B<R> = Train<R>;
    // One initial model for both: burn-nn's stack, moved into ours for `flash`.
    let initial = Gpt::<B<R>>::new(cli.size(seq, dropout), device);
    let initial = initial.clone().load_record(initial.into_record());
    let mut panels: Vec<Panel> = Vec::new();
    let out = cli.out();
    for &which in impls {
        let mut model = initial.clone().into_impl(which);
        let mut optim = AdamWConfig::new().init::<B<R>, Gpt<B<R>>>();
        let mut rng = StdRng::seed_from_u64(2026);
        burn_flash::nn::seed(2026);
        let mut csv = String::from("step,loss,accuracy,seconds\n");
        let start = Instant::now();
        println!(
            "gpt train: {} stack, {} {:?}, S {seq}, batch {batch_size}, d_model {}, {} layers, {} heads",
            which.name(),
            cli.runtime.name(),
            cli.dtype,
            cli.d_model,
            cli.layers,
            cli.heads
        );
        for step in 1..=steps {
            let b = batch(&mut rng, batch_size, seq);
            let tokens = ints::<B<R>>(&b.tokens, [batch_size, seq], device);
            let targets = ints::<B<R>>(&b.targets, [batch_size, seq], device);
            let (loss, accuracy) = model.loss(tokens, targets);
            let value = loss.clone().into_scalar().elem::<f64>();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(lr, model, grads);
            let seconds = start.elapsed().as_secs_f64();
            csv.push_str(&format!("{step},{value},{accuracy},{seconds}\n"));
            add_point(
                &mut panels,
                "training loss",
                "cross-entropy",
                which.name(),
                step as f64,
                value,
            );
            add_point(
                &mut panels,
                "answer accuracy",
                "accuracy",
                which.name(),
                step as f64,
                accuracy,
            );
            if step % log_every == 0 || step == steps {
                println!(
                    "  step {step:>5}/{steps}  loss {value:.4}  accuracy {accuracy:.3}  {seconds:.1} s"
                );
            }
        }
        let path = out.join(format!("loss-{}.csv", which.name()));
        std::fs::write(&path, csv).expect("write csv");
        println!("  wrote {}", path.display());
        generate::<R>(&model.valid(), device, seq);
    }
    let png = out.join("loss.png");
    plot(&png, "step (log2)", &panels);
    println!("wrote {}", png.display());
}

/// Greedy answers to the asked keys of a fresh sequence, one token at a time with the KV cache
/// (ours) or burn-nn's autoregressive cache; prints the accuracy of the generated answers.
fn generate<R: CubeRuntime>(model: &Gpt<Fu<R, u8>>, device: &R::Device, seq: usize) {
    let mut rng = StdRng::seed_from_u64(99);
    let b = batch(&mut rng, 1, seq);
    // The prompt: the whole sequence but the answers, which the model writes itself.
    let context = seq - 2 * PAIRS;
    let mut tokens: Vec<i64> = b.tokens[..context].to_vec();
    let mut hits = 0;
    let mut cache = Cache::new(model);
    for p in 0..PAIRS {
        tokens.push(b.tokens[context + 2 * p]);
        let next = cache.next_token(model, &tokens, device);
        hits += usize::from(next == b.targets[context + 2 * p]);
        // The true value goes in (teacher forcing keeps the questions the same).
        tokens.push(b.tokens[context + 2 * p + 1]);
        let _ = cache.next_token(model, &tokens, device);
    }
    println!(
        "  generation with the KV cache: {hits}/{PAIRS} answers right ({})",
        if model.flash.is_some() {
            "burn-flash MhaCache"
        } else {
            "burn-nn MhaCache"
        }
    );
}

/// The autoregressive cache of either stack, and the embeddings of the tokens seen.
struct Cache<B: FlashBackend> {
    stack: StackCache<B>,
    embedded: RowCache<B>,
}

enum StackCache<B: FlashBackend> {
    Burn(burn::nn::transformer::TransformerEncoderAutoregressiveCache<B>),
    Flash(burn_flash::nn::TransformerEncoderAutoregressiveCache<B>),
}

impl<B: FlashBackend> Cache<B> {
    fn new(model: &Gpt<B>) -> Self {
        let stack = match (&model.burn, &model.flash) {
            (Some(s), _) => StackCache::Burn(s.new_autoregressive_cache()),
            (_, Some(s)) => StackCache::Flash(s.new_autoregressive_cache()),
            _ => unreachable!("a stack"),
        };
        Self {
            stack,
            embedded: RowCache::new(),
        }
    }

    /// The greedy next token after `tokens` (the whole sequence so far; only the tokens not
    /// seen yet are embedded and uploaded). Both stacks take the whole sequence so far, as
    /// burn-nn's autoregressive inference does.
    fn next_token(&mut self, model: &Gpt<B>, tokens: &[i64], device: &B::Device) -> i64 {
        let seq = tokens.len();
        let start = self.embedded.len();
        let new = &tokens[start..];
        let x_new = model.embed(ints::<B>(new, [1, new.len()], device), start);
        let x = self.embedded.append(x_new);
        let x = match &mut self.stack {
            StackCache::Burn(cache) => model
                .burn
                .as_ref()
                .expect("stack")
                .forward_autoregressive_inference(
                    burn::nn::transformer::TransformerEncoderInput::new(x)
                        .mask_attn(generate_autoregressive_mask(1, seq, device)),
                    cache,
                ),
            StackCache::Flash(cache) => model
                .flash
                .as_ref()
                .expect("stack")
                .forward_autoregressive_inference(TransformerEncoderInput::new(x).causal(), cache),
        };
        let last = x.slice([0..1, seq - 1..seq]);
        let logits = model.head.forward(model.norm.forward(last));
        logits
            .argmax(2)
            .flatten::<1>(0, 2)
            .into_scalar()
            .elem::<i64>()
    }
}

/// Step time and peak memory per S, each point in a child process.
fn bench(
    cli: &Cli,
    seqs: &[usize],
    tokens: usize,
    impls: &[Impl],
    steps: usize,
    no_memory: bool,
    no_time: bool,
) {
    let out = cli.out();
    let mut csv = String::from("impl,runtime,dtype,seq,batch,step_ms,tokens_per_s,peak_mib,note\n");
    let mut panels: Vec<Panel> = Vec::new();
    let exe = std::env::current_exe().expect("own path");
    for &seq in seqs {
        let batch = (tokens / seq).max(1);
        for &which in impls {
            let child = |memory: bool| {
                let mut cmd = std::process::Command::new(&exe);
                cmd.args([
                    "--runtime",
                    cli.runtime.name(),
                    "--dtype",
                    cli.dtype.label(),
                    "--d-model",
                    &cli.d_model.to_string(),
                    "--layers",
                    &cli.layers.to_string(),
                    "--heads",
                    &cli.heads.to_string(),
                    "point",
                    "--which",
                    which.name(),
                    "--seq",
                    &seq.to_string(),
                    "--batch",
                    &batch.to_string(),
                    "--steps",
                    &steps.to_string(),
                ]);
                if memory {
                    cmd.arg("--memory");
                }
                let output = cmd.output().expect("run a bench point");
                let stdout = String::from_utf8_lossy(&output.stdout).to_string();
                match stdout.lines().find_map(|l| l.strip_prefix("result ")) {
                    Some(v) => Ok(v.trim().parse::<f64>().expect("a number")),
                    None => {
                        let err = String::from_utf8_lossy(&output.stderr);
                        let why = if err.contains("OutOfMemory") || err.contains("out of memory") {
                            "out of memory".to_string()
                        } else {
                            err.lines()
                                .rev()
                                .find(|l| l.contains("panicked") || l.contains("rror"))
                                .unwrap_or("failed")
                                .chars()
                                .take(120)
                                .collect()
                        };
                        Err(why)
                    }
                }
            };
            let time = match no_time {
                true => Err("not timed".to_string()),
                false => child(false),
            };
            let peak = match no_memory {
                true => Err("not measured".to_string()),
                false => child(true),
            };
            let (ms, tps, note) = match &time {
                Ok(s) => (
                    format!("{:.2}", s * 1e3),
                    format!("{:.0}", (batch * seq) as f64 / s),
                    String::new(),
                ),
                Err(e) => (String::new(), String::new(), e.clone()),
            };
            let mib = match &peak {
                Ok(b) => format!("{:.0}", b / (1 << 20) as f64),
                Err(e) if note.is_empty() => format!("({e})"),
                Err(_) => String::new(),
            };
            println!(
                "gpt bench {} S {seq} batch {batch}: step {} ms, {} tokens/s, peak {} MiB {}",
                which.name(),
                ms,
                tps,
                mib,
                note
            );
            csv.push_str(&format!(
                "{},{},{},{seq},{batch},{ms},{tps},{mib},{note}\n",
                which.name(),
                cli.runtime.name(),
                cli.dtype.label()
            ));
            if let Ok(s) = time {
                add_point(
                    &mut panels,
                    "training step",
                    "ms",
                    which.name(),
                    seq as f64,
                    s * 1e3,
                );
            }
            if let Ok(b) = peak {
                add_point(
                    &mut panels,
                    "peak memory",
                    "MiB",
                    which.name(),
                    seq as f64,
                    b / (1 << 20) as f64,
                );
            }
        }
    }
    let name = match (no_time, no_memory) {
        (true, false) => "bench-memory",
        (false, true) => "bench-time",
        _ => "bench",
    };
    let path = out.join(format!("{name}.csv"));
    std::fs::write(&path, csv).expect("write csv");
    plot(&out.join(format!("{name}.png")), "S", &panels);
    println!("wrote {}", path.display());
}

/// One bench point: `steps` timed training steps after two warm-up ones (prints
/// `result <median seconds>`), or with `memory` the peak bytes of one step (`result <bytes>`).
#[allow(clippy::too_many_arguments)]
fn point<R: CubeRuntime>(
    cli: &Cli,
    device: &R::Device,
    which: Impl,
    seq: usize,
    batch_size: usize,
    steps: usize,
    memory: bool,
) {
    type B<R> = Train<R>;
    let model = Gpt::<B<R>>::new(cli.size(seq, 0.0), device).into_impl(which);
    let mut model = model.clone().load_record(model.into_record());
    let mut optim = AdamWConfig::new().init::<B<R>, Gpt<B<R>>>();
    let mut rng = StdRng::seed_from_u64(1);
    let mut step = |model: Gpt<B<R>>| {
        let b = batch(&mut rng, batch_size, seq);
        let tokens = ints::<B<R>>(&b.tokens, [batch_size, seq], device);
        let targets = ints::<B<R>>(&b.targets, [batch_size, seq], device);
        let logits = model
            .forward(tokens)
            .reshape([batch_size * seq, VOCAB])
            .cast(DType::F32);
        let loss = answer_loss(logits, targets, batch_size);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        optim.step(1e-3, model, grads)
    };
    model = step(model);
    sync::<B<R>>(device);
    if memory {
        let client = R::client(device);
        let (model, m) = peak_memory::peak_memory(&client, || sync::<B<R>>(device), || step(model));
        drop(model);
        println!("result {}", m.peak);
        return;
    }
    model = step(model);
    sync::<B<R>>(device);
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let start = Instant::now();
        model = step(model);
        sync::<B<R>>(device);
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    println!("result {}", times[times.len() / 2]);
}

/// Per-token latency at `context` tokens: one cached step against a full forward of the
/// prefix, for each implementation (untrained weights: the work is the same).
fn decode<R: CubeRuntime>(
    cli: &Cli,
    device: &R::Device,
    context: usize,
    tokens: usize,
    impls: &[Impl],
    bare: bool,
) {
    match bare {
        true => decode_on::<common::Un<R, u8>>(cli, device, context, tokens, impls, "bare"),
        false => decode_on::<Fu<R, u8>>(cli, device, context, tokens, impls, "fusion"),
    }
}

/// [`decode`] on backend `B` (`backend` names it in the CSV).
fn decode_on<B: FlashBackend>(
    cli: &Cli,
    device: &B::Device,
    context: usize,
    tokens: usize,
    impls: &[Impl],
    backend: &str,
) {
    let out = cli.out();
    let mut csv = String::from("impl,runtime,backend,dtype,context,cached_ms,recompute_ms,ratio\n");
    let initial = Gpt::<B>::new(cli.size(context + tokens + 1, 0.0), device);
    let initial = initial.clone().load_record(initial.into_record());
    let mut rng = StdRng::seed_from_u64(5);
    let prompt: Vec<i64> = (0..context + tokens)
        .map(|_| rng.random_range(0..VOCAB as i64 - 1))
        .collect();
    for &which in impls {
        let model = initial.clone().into_impl(which);
        // Cached: fill the cache with the prompt, then time single-token steps.
        let mut cache = Cache::new(&model);
        cache.next_token(&model, &prompt[..context], device);
        sync::<B>(device);
        let mut cached = Vec::new();
        for t in 0..tokens {
            let start = Instant::now();
            cache.next_token(&model, &prompt[..context + t + 1], device);
            sync::<B>(device);
            cached.push(start.elapsed().as_secs_f64());
        }
        // Recompute: the whole prefix each token.
        let mut full = Vec::new();
        for t in 0..tokens.min(8) {
            let seq = context + t + 1;
            let start = Instant::now();
            let logits = model.forward(ints::<B>(&prompt[..seq], [1, seq], device));
            let _ = logits.slice([0..1, seq - 1..seq]).argmax(2).into_data();
            full.push(start.elapsed().as_secs_f64());
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (c, f) = (median(&mut cached), median(&mut full));
        println!(
            "gpt decode {} ({backend}) at {context} tokens: cached {:.2} ms/token, recompute {:.2} ms/token ({:.1}x)",
            which.name(),
            c * 1e3,
            f * 1e3,
            f / c
        );
        csv.push_str(&format!(
            "{},{},{backend},{},{context},{:.3},{:.3},{:.2}\n",
            which.name(),
            cli.runtime.name(),
            cli.dtype.label(),
            c * 1e3,
            f * 1e3,
            f / c
        ));
    }
    let path = out.join(format!("decode-{backend}.csv"));
    std::fs::write(&path, csv).expect("write csv");
    println!("wrote {}", path.display());
}
