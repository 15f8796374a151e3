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
    Bool, DType, ElementConversion, FloatDType, Int, IntDType, Tensor, TensorData, backend::Backend,
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
    /// The decoding kernel's schedule, `KEYS:CUBES` (keys per step 4, 8 or 16; cubes per
    /// multiprocessor 1–64) [default: the standard 8:16].
    #[arg(long, global = true)]
    decode_schedule: Option<String>,
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
    /// Per-token decoding latency with each KV cache against recomputing the prefix.
    Decode {
        /// On the bare CubeCL backend instead of Burn's Fusion (`Cuda`/`Wgpu`).
        #[arg(long)]
        bare: bool,
        #[arg(long, default_value_t = 4096)]
        context: usize,
        #[arg(long, default_value_t = 16)]
        tokens: usize,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = [CacheKind::Burn, CacheKind::Contiguous, CacheKind::Paged])]
        caches: Vec<CacheKind>,
        /// Also count the kernels launched per token (two child processes per cache).
        #[arg(long)]
        count_kernels: bool,
    },
    /// Serving: N requests with different prompt lengths; tokens/s and per-request latency.
    Serve {
        #[command(flatten)]
        args: ServeArgs,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = [CacheKind::Burn, CacheKind::Contiguous, CacheKind::Paged])]
        caches: Vec<CacheKind>,
    },
    /// Decodes with one cache for a kernel count (run by `decode --count-kernels`).
    #[command(hide = true)]
    Kernels {
        #[arg(long, value_enum)]
        cache: CacheKind,
        #[arg(long)]
        context: usize,
        #[arg(long)]
        tokens: usize,
        #[arg(long)]
        bare: bool,
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

/// The requests of the `serve` task.
#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Requests.
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Prompt lengths drawn from this range, `MINxMAX`.
    #[arg(long, value_parser = common::parse_pair, default_value = "64x1024")]
    prompt: (usize, usize),
    /// Tokens generated per request drawn from this range, `MINxMAX`.
    #[arg(long, value_parser = common::parse_pair, default_value = "16x64")]
    new: (usize, usize),
    #[arg(long, default_value_t = 3)]
    seed: u64,
    /// Timed runs after a warm-up run (the median run is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

impl Cli {
    /// The global arguments a child process needs to build the same model.
    fn model_args(&self) -> Vec<String> {
        [
            ("--runtime", self.runtime.name().to_string()),
            ("--dtype", self.dtype.label().to_string()),
            ("--d-model", self.d_model.to_string()),
            ("--layers", self.layers.to_string()),
            ("--heads", self.heads.to_string()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect()
    }

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
    if let Some(s) = &cli.decode_schedule {
        let (keys, cubes) = s.split_once(':').unwrap_or((s, ""));
        match burn_flash::PlanDefaults::from_names(None, Some(keys), Some(cubes)) {
            Ok(d) => burn_flash::set_plan_defaults(d),
            Err(e) => {
                eprintln!("gpt: --decode-schedule {s}: {e}");
                std::process::exit(2);
            }
        }
    }
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
            caches,
            count_kernels,
        } => decode::<R>(
            cli,
            &device,
            *context,
            *tokens,
            caches,
            *bare,
            *count_kernels,
        ),
        Task::Serve { args, caches } => serve::<Fu<R, u8>>(cli, &device, args, caches),
        Task::Kernels {
            cache,
            context,
            tokens,
            bare,
        } => match bare {
            true => kernels_child::<common::Un<R, u8>>(cli, &device, *cache, *context, *tokens),
            false => kernels_child::<Fu<R, u8>>(cli, &device, *cache, *context, *tokens),
        },
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
        let start = self.embedded.len();
        let new = &tokens[start..];
        let x_new = model.embed(ints::<B>(new, [1, new.len()], device), start);
        self.next_tokens(model, x_new, None, device)[0]
    }

    /// The greedy next token of each row of a batch after its new positions' embeddings
    /// `x_new` `[B, n, d_model]`, under the padding mask `mask_pad` `[B, S]` of every position
    /// so far (`true` = a pad).
    fn next_tokens(
        &mut self,
        model: &Gpt<B>,
        x_new: Tensor<B, 3>,
        mask_pad: Option<Tensor<B, 2, Bool>>,
        device: &B::Device,
    ) -> Vec<i64> {
        let x = self.embedded.append(x_new);
        let [batch, seq, _] = x.dims();
        let x = match &mut self.stack {
            StackCache::Burn(cache) => {
                let input = burn::nn::transformer::TransformerEncoderInput::new(x)
                    .mask_attn(generate_autoregressive_mask(batch, seq, device));
                let input = match mask_pad {
                    Some(m) => input.mask_pad(m),
                    None => input,
                };
                model
                    .burn
                    .as_ref()
                    .expect("stack")
                    .forward_autoregressive_inference(input, cache)
            }
            StackCache::Flash(cache) => {
                let input = TransformerEncoderInput::new(x).causal();
                let input = match mask_pad {
                    Some(m) => input.mask_pad(m),
                    None => input,
                };
                model
                    .flash
                    .as_ref()
                    .expect("stack")
                    .forward_autoregressive_inference(input, cache)
            }
        };
        model.greedy(x.slice([0..batch, seq - 1..seq]), false)
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
                cmd.args(cli.model_args()).args([
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

/// The KV caches a decoding run can use.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum CacheKind {
    /// burn-nn's stack and its autoregressive cache (`forward_autoregressive_inference`).
    Burn,
    /// burn-flash's stack and its contiguous autoregressive cache, burn-nn's calling convention.
    Contiguous,
    /// burn-flash's stack arranged for serving (`TransformerEncoder::serving`): varlen prefill,
    /// paged KV cache, one fused projection and one append + attention op per layer.
    Paged,
}

impl CacheKind {
    fn name(self) -> &'static str {
        match self {
            CacheKind::Burn => "burn",
            CacheKind::Contiguous => "flash-contiguous",
            CacheKind::Paged => "flash-paged",
        }
    }

    /// Its value on the command line.
    fn arg(self) -> &'static str {
        match self {
            CacheKind::Burn => "burn",
            CacheKind::Contiguous => "contiguous",
            CacheKind::Paged => "paged",
        }
    }

    /// The stack the cache belongs to.
    fn stack(self) -> Impl {
        match self {
            CacheKind::Burn => Impl::Burn,
            _ => Impl::Flash,
        }
    }
}

/// Positions of a paged cache's blocks.
const BLOCK_SIZE: usize = 64;

impl<B: FlashBackend> Gpt<B> {
    /// Token plus position embeddings of `tokens` `[n, S]` at `positions` `[n, S]`:
    /// `[n, S, d_model]`.
    fn embed_at(&self, tokens: &[i64], positions: &[i64], dims: [usize; 2]) -> Tensor<B, 3> {
        let device = self.norm.gamma.device();
        let (t, p) = (
            ints::<B>(tokens, dims, &device),
            ints::<B>(positions, dims, &device),
        );
        self.tokens.forward(t) + self.positions.forward(p)
    }

    /// The greedy next token after each row of the stack's output `[n, 1, d_model]` (read
    /// back: a sync); with `fused` (the serving path) the final norm and the head as one op
    /// each (`burn_flash::layer_norm`, `burn_flash::linear`), else burn-nn's modules.
    fn greedy(&self, last: Tensor<B, 3>, fused: bool) -> Vec<i64> {
        let n = last.dims()[0];
        let logits = match fused {
            true => {
                let beta = self.norm.beta.as_ref().map(|b| b.val());
                let normed = burn_flash::layer_norm(last, self.norm.gamma.val(), beta, 1e-5);
                let bias = self.head.bias.as_ref().map(|b| b.val());
                burn_flash::linear(normed, self.head.weight.val(), bias)
            }
            false => self.head.forward(self.norm.forward(last)),
        };
        logits
            .argmax(2)
            .reshape([n])
            .into_data()
            .convert::<i64>()
            .to_vec()
            .expect("tokens")
    }
}

/// A decoder of one sequence over one cache kind.
enum Decoder<B: FlashBackend> {
    /// burn-nn's calling convention (the whole sequence each call): burn-nn's cache or ours.
    Stack { cache: Cache<B>, tokens: Vec<i64> },
    /// The serving stack and its paged cache.
    Paged {
        serving: burn_flash::nn::ServingEncoder<B>,
        cache: burn_flash::nn::PagedKvCache<B>,
        id: usize,
        len: usize,
    },
}

impl<B: FlashBackend> Decoder<B> {
    /// A decoder for `capacity` positions.
    fn new(kind: CacheKind, model: &Gpt<B>, capacity: usize, device: &B::Device) -> Self {
        match kind {
            CacheKind::Paged => {
                let serving = model.flash.as_ref().expect("our stack").serving();
                let mut cache =
                    serving.new_paged_cache(capacity.div_ceil(BLOCK_SIZE), BLOCK_SIZE, device);
                let id = cache.add_sequence();
                Decoder::Paged {
                    serving,
                    cache,
                    id,
                    len: 0,
                }
            }
            _ => Decoder::Stack {
                cache: Cache::new(model),
                tokens: Vec::new(),
            },
        }
    }

    /// Feeds `new` tokens (the prompt, then one at a time); the greedy next token.
    fn feed(&mut self, model: &Gpt<B>, new: &[i64], device: &B::Device) -> i64 {
        match self {
            Decoder::Stack { cache, tokens } => {
                tokens.extend_from_slice(new);
                cache.next_token(model, tokens, device)
            }
            Decoder::Paged {
                serving,
                cache,
                id,
                len,
            } => {
                let n = new.len();
                let positions: Vec<i64> = (*len..*len + n).map(|p| p as i64).collect();
                let x = model.embed_at(new, &positions, [1, n]);
                let y = if *len == 0 {
                    let d = x.dims()[2];
                    let y = serving.prefill(x.reshape([n, d]), &[*id], &[n], cache);
                    y.narrow(0, n - 1, 1).reshape([1, 1, d])
                } else {
                    let y = serving.decode(x, &[*id], cache);
                    y.narrow(1, n - 1, 1)
                };
                *len += n;
                model.greedy(y, true)[0]
            }
        }
    }
}

/// Per-token latency at `context` tokens: one cached step against a full forward of the
/// prefix, for each cache (untrained weights: the work is the same).
fn decode<R: CubeRuntime>(
    cli: &Cli,
    device: &R::Device,
    context: usize,
    tokens: usize,
    caches: &[CacheKind],
    bare: bool,
    count: bool,
) {
    match bare {
        true => decode_on::<common::Un<R, u8>>(cli, device, context, tokens, caches, "bare", count),
        false => decode_on::<Fu<R, u8>>(cli, device, context, tokens, caches, "fusion", count),
    }
}

/// [`decode`] on backend `B` (`backend` names it in the CSV).
fn decode_on<B: FlashBackend>(
    cli: &Cli,
    device: &B::Device,
    context: usize,
    tokens: usize,
    caches: &[CacheKind],
    backend: &str,
    count: bool,
) {
    let out = cli.out();
    let mut csv = String::from(
        "impl,runtime,backend,dtype,context,cached_ms,recompute_ms,ratio,kernels_per_token\n",
    );
    let initial = Gpt::<B>::new(cli.size(context + tokens + 1, 0.0), device);
    let initial = initial.clone().load_record(initial.into_record());
    let mut rng = StdRng::seed_from_u64(5);
    let prompt: Vec<i64> = (0..context + tokens)
        .map(|_| rng.random_range(0..VOCAB as i64 - 1))
        .collect();
    for &kind in caches {
        let model = initial.clone().into_impl(kind.stack());
        // Cached: fill the cache with the prompt, then time single-token steps.
        let mut decoder = Decoder::new(kind, &model, context + tokens + 1, device);
        decoder.feed(&model, &prompt[..context], device);
        sync::<B>(device);
        let mut cached = Vec::new();
        for t in 0..tokens {
            let start = Instant::now();
            decoder.feed(&model, &prompt[context + t..context + t + 1], device);
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
        let kernels = match count {
            true => match kernels_per_token(cli, kind, context, backend == "bare") {
                Ok((per_token, top)) => {
                    println!(
                        "  {} kernels per token: {per_token:.1}; most launched:",
                        kind.name()
                    );
                    for (name, n) in top.iter().take(12) {
                        println!("    {n:>5.1}  {name}");
                    }
                    format!("{per_token:.1}")
                }
                Err(e) => {
                    println!("  {} kernels per token: not counted ({e})", kind.name());
                    String::new()
                }
            },
            false => String::new(),
        };
        println!(
            "gpt decode {} ({backend}) at {context} tokens: cached {:.2} ms/token, recompute {:.2} ms/token ({:.1}x)",
            kind.name(),
            c * 1e3,
            f * 1e3,
            f / c
        );
        csv.push_str(&format!(
            "{},{},{backend},{},{context},{:.3},{:.3},{:.2},{kernels}\n",
            kind.name(),
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

/// Kernels launched per decoded token with cache `kind`, counted by cubecl's execution log
/// (`[profiling.logger] level = "minimal"`, which names each kernel as it is launched and
/// changes nothing else): two child processes decode 2 and 10 tokens after the same prompt,
/// and the difference of their counts is 8 tokens' kernels. Returns the count per token and
/// the kernels by name, most launched first.
fn kernels_per_token(
    cli: &Cli,
    kind: CacheKind,
    context: usize,
    bare: bool,
) -> Result<(f64, Vec<(String, f64)>), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("gpt-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    std::fs::write(
        dir.join("cubecl.toml"),
        "[profiling.logger]\nlevel = \"minimal\"\nstdout = true\n",
    )
    .map_err(|e| e.to_string())?;
    let run = |tokens: usize| -> Result<std::collections::BTreeMap<String, usize>, String> {
        let mut cmd = std::process::Command::new(&exe);
        cmd.current_dir(&dir).args(cli.model_args()).args([
            "kernels",
            "--cache",
            kind.arg(),
            "--context",
            &context.to_string(),
            "--tokens",
            &tokens.to_string(),
        ]);
        if bare {
            cmd.arg("--bare");
        }
        let output = cmd.output().map_err(|e| e.to_string())?;
        if !output.status.success() {
            let err = String::from_utf8_lossy(&output.stderr);
            return Err(err.lines().last().unwrap_or("failed").to_string());
        }
        let mut names = std::collections::BTreeMap::new();
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if let Some(name) = line.trim().strip_prefix("Executing ") {
                *names.entry(name.to_string()).or_insert(0) += 1;
            }
        }
        Ok(names)
    };
    let (few, many) = (run(2)?, run(10)?);
    let mut per: Vec<(String, f64)> = many
        .iter()
        .map(|(name, &n)| {
            let base = few.get(name).copied().unwrap_or(0);
            (name.clone(), (n as f64 - base as f64) / 8.0)
        })
        .filter(|(_, n)| *n > 0.0)
        .collect();
    per.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total = per.iter().map(|(_, n)| n).sum();
    let _ = std::fs::remove_dir_all(&dir);
    Ok((total, per))
}

/// The child of [`kernels_per_token`]: a prompt of `context` tokens, then `tokens` decoded.
fn kernels_child<B: FlashBackend>(
    cli: &Cli,
    device: &B::Device,
    kind: CacheKind,
    context: usize,
    tokens: usize,
) {
    let model = Gpt::<B>::new(cli.size(context + tokens + 1, 0.0), device);
    let model = model
        .clone()
        .load_record(model.into_record())
        .into_impl(kind.stack());
    let mut rng = StdRng::seed_from_u64(5);
    let prompt: Vec<i64> = (0..context + tokens)
        .map(|_| rng.random_range(0..VOCAB as i64 - 1))
        .collect();
    let mut decoder = Decoder::new(kind, &model, context + tokens + 1, device);
    decoder.feed(&model, &prompt[..context], device);
    for t in 0..tokens {
        decoder.feed(&model, &prompt[context + t..context + t + 1], device);
    }
    sync::<B>(device);
    // cubecl's logger prints from a task of its own: let it drain.
    std::thread::sleep(std::time::Duration::from_millis(500));
}

// -- serving --

/// One request: a prompt and how many tokens to generate.
struct Request {
    prompt: Vec<i64>,
    new: usize,
}

/// What serving the requests took: per request the time to its first token and to its last,
/// in seconds from the start; the whole run; the tokens generated.
struct Served {
    first: Vec<f64>,
    last: Vec<f64>,
    wall: f64,
    generated: Vec<Vec<i64>>,
}

/// `n` requests with prompts of `prompt.0 ..= prompt.1` tokens and `new.0 ..= new.1` tokens to
/// generate, drawn with `seed`.
fn requests(n: usize, prompt: (usize, usize), new: (usize, usize), seed: u64) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(prompt.0..=prompt.1);
            Request {
                prompt: (0..len)
                    .map(|_| rng.random_range(0..VOCAB as i64 - 1))
                    .collect(),
                new: rng.random_range(new.0..=new.1),
            }
        })
        .collect()
}

/// Serves `requests` with the serving stack and a paged cache: every prompt prefilled as one
/// packed batch, then one decoding step per token for the requests still generating (a
/// finished request leaves the batch and returns its blocks).
fn serve_paged<B: FlashBackend>(
    model: &Gpt<B>,
    requests: &[Request],
    device: &B::Device,
) -> Served {
    let serving = model.flash.as_ref().expect("our stack").serving();
    let blocks: usize = requests
        .iter()
        .map(|r| (r.prompt.len() + r.new).div_ceil(BLOCK_SIZE))
        .sum();
    let mut cache = serving.new_paged_cache(blocks, BLOCK_SIZE, device);
    let n = requests.len();
    let start = Instant::now();
    let ids: Vec<usize> = (0..n).map(|_| cache.add_sequence()).collect();
    let lengths: Vec<usize> = requests.iter().map(|r| r.prompt.len()).collect();
    let total: usize = lengths.iter().sum();
    let tokens: Vec<i64> = requests.iter().flat_map(|r| r.prompt.clone()).collect();
    let positions: Vec<i64> = lengths
        .iter()
        .flat_map(|&l| (0..l as i64).collect::<Vec<_>>())
        .collect();
    let x = model.embed_at(&tokens, &positions, [1, total]);
    let d = x.dims()[2];
    let y = serving.prefill(x.reshape([total, d]), &ids, &lengths, &mut cache);
    let ends: Vec<i64> = lengths
        .iter()
        .scan(0, |end, &l| {
            *end += l;
            Some(*end as i64 - 1)
        })
        .collect();
    let last = y.select(0, Tensor::<B, 1, Int>::from_ints(ends.as_slice(), device));
    let next = model.greedy(last.reshape([n, 1, d]), true);
    let first_at = start.elapsed().as_secs_f64();
    let mut served = Served {
        first: vec![first_at; n],
        last: vec![first_at; n],
        wall: 0.0,
        generated: next.iter().map(|&t| vec![t]).collect(),
    };
    let mut live: Vec<usize> = (0..n).filter(|&i| requests[i].new > 1).collect();
    for &i in (0..n)
        .filter(|i| !live.contains(i))
        .collect::<Vec<_>>()
        .iter()
    {
        cache.release(ids[i]);
    }
    while !live.is_empty() {
        let step_ids: Vec<usize> = live.iter().map(|&i| ids[i]).collect();
        let toks: Vec<i64> = live
            .iter()
            .map(|&i| *served.generated[i].last().expect("a token"))
            .collect();
        let pos: Vec<i64> = live
            .iter()
            .map(|&i| (lengths[i] + served.generated[i].len() - 1) as i64)
            .collect();
        let x = model.embed_at(&toks, &pos, [live.len(), 1]);
        let y = serving.decode(x, &step_ids, &mut cache);
        let next = model.greedy(y, true);
        let now = start.elapsed().as_secs_f64();
        for (&i, &t) in live.iter().zip(&next) {
            served.generated[i].push(t);
            served.last[i] = now;
        }
        live.retain(|&i| {
            let done = served.generated[i].len() >= requests[i].new;
            if done {
                cache.release(ids[i]);
            }
            !done
        });
    }
    served.wall = start.elapsed().as_secs_f64();
    served
}

/// Serves `requests` as one left-padded batch through a stack's autoregressive cache
/// (burn-nn's or ours, burn-nn's calling convention: the whole sequence so far each call, a
/// padding mask over the pads): the prompts in one call, then one call per token until the
/// longest request is done; a request that is done rides along.
fn serve_padded<B: FlashBackend>(
    model: &Gpt<B>,
    requests: &[Request],
    device: &B::Device,
) -> Served {
    let n = requests.len();
    let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let steps = requests.iter().map(|r| r.new).max().unwrap_or(0);
    let pads: Vec<usize> = requests.iter().map(|r| longest - r.prompt.len()).collect();
    let start = Instant::now();
    let mut cache = Cache::new(model);
    let mut generated: Vec<Vec<i64>> = vec![Vec::new(); n];
    let mut first = vec![0.0; n];
    let mut last = vec![0.0; n];
    for step in 0..steps {
        // The new columns of the padded batch: the prompts, then one token.
        let (cols, from) = match step {
            0 => (longest, 0),
            _ => (1, longest + step - 1),
        };
        let mut toks = Vec::with_capacity(n * cols);
        let mut pos = Vec::with_capacity(n * cols);
        for (i, r) in requests.iter().enumerate() {
            for c in from..from + cols {
                let (t, p) = match (step, c.checked_sub(pads[i])) {
                    (0, None) => (PAD as i64, 0),
                    (0, Some(j)) => (r.prompt[j], j as i64),
                    (_, _) => (*generated[i].last().expect("a token"), (c - pads[i]) as i64),
                };
                toks.push(t);
                pos.push(p);
            }
        }
        let seq = longest + step;
        let pad: Vec<bool> = (0..n)
            .flat_map(|i| {
                let p = pads[i];
                (0..seq).map(move |c| c < p)
            })
            .collect();
        let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(pad, [n, seq]), device);
        let x_new = model.embed_at(&toks, &pos, [n, cols]);
        let next = cache.next_tokens(model, x_new, Some(mask), device);
        let now = start.elapsed().as_secs_f64();
        for (i, &t) in next.iter().enumerate() {
            if generated[i].len() < requests[i].new {
                generated[i].push(t);
                last[i] = now;
                if step == 0 {
                    first[i] = now;
                }
            }
        }
    }
    Served {
        first,
        last,
        wall: start.elapsed().as_secs_f64(),
        generated,
    }
}

/// The `serve` task: the same requests through each cache; tokens/s and per-request latency.
fn serve<B: FlashBackend>(cli: &Cli, device: &B::Device, args: &ServeArgs, caches: &[CacheKind]) {
    let out = cli.out();
    let reqs = requests(args.requests, args.prompt, args.new, args.seed);
    let max_seq = reqs
        .iter()
        .map(|r| r.prompt.len() + r.new)
        .max()
        .unwrap_or(1)
        .max(args.prompt.1 + args.new.1);
    let initial = Gpt::<B>::new(cli.size(max_seq + 1, 0.0), device);
    let initial = initial.clone().load_record(initial.into_record());
    let total_new: usize = reqs.iter().map(|r| r.new).sum();
    let prompt_tokens: usize = reqs.iter().map(|r| r.prompt.len()).sum();
    println!(
        "gpt serve: {} requests, prompts {}..={} tokens ({prompt_tokens} in all), {}..={} new ({total_new} in all), {} {:?}",
        reqs.len(),
        args.prompt.0,
        args.prompt.1,
        args.new.0,
        args.new.1,
        cli.runtime.name(),
        cli.dtype
    );
    let mut csv = String::from(
        "cache,runtime,dtype,requests,prompt_tokens,new_tokens,run,wall_s,tokens_per_s,first_token_p50_ms,latency_p50_ms,latency_p90_ms,latency_max_ms\n",
    );
    let mut per_request = String::from("cache,request,prompt,new,first_token_ms,latency_ms\n");
    let mut panels: Vec<Panel> = Vec::new();
    let mut finished: Vec<Panel> = Vec::new();
    let mut reference: Option<Vec<Vec<i64>>> = None;
    for &kind in caches {
        let model = initial.clone().into_impl(kind.stack());
        let run = |model: &Gpt<B>| match kind {
            CacheKind::Paged => serve_paged(model, &reqs, device),
            _ => serve_padded(model, &reqs, device),
        };
        // A warm-up run compiles the kernels (and lets Burn's autotune settle); then timed runs.
        let mut runs: Vec<Served> = Vec::new();
        for r in 0..=args.runs {
            let served = run(&model);
            sync::<B>(device);
            if r > 0 {
                runs.push(served);
            }
        }
        runs.sort_by(|a, b| a.wall.total_cmp(&b.wall));
        let served = runs.swap_remove(runs.len() / 2);
        let quantile = |v: &[f64], q: f64| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v[((v.len() - 1) as f64 * q).round() as usize]
        };
        let tps = total_new as f64 / served.wall;
        let agree = reference.as_ref().map(|r| {
            let same = r
                .iter()
                .zip(&served.generated)
                .filter(|(a, b)| a.first() == b.first())
                .count();
            format!(
                " (first tokens as {}'s: {same}/{})",
                caches[0].name(),
                reqs.len()
            )
        });
        println!(
            "  {:<17} {:.3} s, {:.0} tokens/s; first token p50 {:.1} ms; latency p50 {:.1} / p90 {:.1} / max {:.1} ms{}",
            kind.name(),
            served.wall,
            tps,
            quantile(&served.first, 0.5) * 1e3,
            quantile(&served.last, 0.5) * 1e3,
            quantile(&served.last, 0.9) * 1e3,
            quantile(&served.last, 1.0) * 1e3,
            agree.unwrap_or_default()
        );
        csv.push_str(&format!(
            "{},{},{},{},{prompt_tokens},{total_new},median of {},{:.4},{:.1},{:.2},{:.2},{:.2},{:.2}\n",
            kind.name(),
            cli.runtime.name(),
            cli.dtype.label(),
            reqs.len(),
            args.runs,
            served.wall,
            tps,
            quantile(&served.first, 0.5) * 1e3,
            quantile(&served.last, 0.5) * 1e3,
            quantile(&served.last, 0.9) * 1e3,
            quantile(&served.last, 1.0) * 1e3,
        ));
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&i| reqs[i].prompt.len());
        for &i in &order {
            per_request.push_str(&format!(
                "{},{i},{},{},{:.2},{:.2}\n",
                kind.name(),
                reqs[i].prompt.len(),
                reqs[i].new,
                served.first[i] * 1e3,
                served.last[i] * 1e3
            ));
            add_point(
                &mut panels,
                "request latency (last token)",
                "ms",
                kind.name(),
                reqs[i].prompt.len() as f64,
                served.last[i] * 1e3,
            );
        }
        let mut done: Vec<(f64, usize)> = (0..reqs.len())
            .map(|i| (served.last[i], reqs[i].new))
            .collect();
        done.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut tokens = 0;
        for (at, new) in done {
            tokens += new;
            add_point(
                &mut finished,
                "tokens of finished requests",
                "tokens",
                kind.name(),
                at * 1e3,
                tokens as f64,
            );
        }
        if reference.is_none() {
            reference = Some(served.generated);
        }
    }
    for (name, text) in [("serve.csv", csv), ("serve-requests.csv", per_request)] {
        let path = out.join(name);
        std::fs::write(&path, text).expect("write csv");
        println!("wrote {}", path.display());
    }
    let png = out.join("serve.png");
    plot(&png, "prompt tokens (log2)", &panels);
    let finished_png = out.join("serve-finished.png");
    plot(&finished_png, "ms since the start (log2)", &finished);
    println!("wrote {} and {}", png.display(), finished_png.display());
}
