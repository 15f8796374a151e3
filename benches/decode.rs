//! Decoding attention: one query row per sequence against a long KV cache, contiguous
//! ([`burn_flash::attention`], whose plan takes the split-KV kernel) and paged
//! ([`burn_flash::attention_paged`]), against a copy of the same bytes and Burn's attention.
//!
//! `cargo bench --bench decode -- [--quick] [--out DIR] [--runtimes cuda,wgpu] [--dtypes bf16]
//! [--batches 1,8,32,64] [--contexts 1024,8192,32768,131072] [--heads 32x8] [--dim 128]
//! [--block-size 64] [--passes N]`
//!
//! # Rows (`impl` column), per (batch `B`, context `S`)
//! - `copy`: a device-to-device copy of the KV cache's bytes (`K` and `V`, read and written);
//! - `contiguous`: `attention(q [B, Hq, 1, D], k [B, Hkv, S, D], v)` (the plan's kernel in the
//!   `kernel` column);
//! - `paged`: `attention_paged` over pools of `--block-size` blocks, each sequence's blocks
//!   shuffled over the pool;
//! - `mma-forced` (CUDA, 16-bit): the same contiguous call with the matrix-unit forward forced:
//!   what the plan ran before the decoding kernel;
//! - `burn`: Burn's `module::attention` with the key/value heads repeated per query head
//!   (the repeat is made once, outside the timed region); skipped (a note) where the repeated
//!   cache exceeds 24 GB. A cache over 12 GB is skipped for every row (each row holds its
//!   inputs twice: the Fusion call and its bare twin).
//!
//! `kv_GB_per_s`: the bytes of `K` and `V` read (`2·B·Hkv·S·D·size`) per second; for `copy`
//! the bytes read and written. `pct_of_copy = 100 · kv_GB_per_s / copy's`, from wall and
//! device times alike (the copy measured in the same run). Timing: `common::measure` (wall on
//! Fusion; device on the bare `CubeBackend` twin).
//!
//! # Files (under `target/bench/` or `--out`)
//! `decode.csv` (`decode-wgpu.csv` for wgpu when CUDA is built too) and `decode.png`: KV GB/s
//! (wall) per implementation against the context, a panel per batch.

mod common;

use burn::tensor::{
    DType, Distribution, FloatDType, Tensor, backend::Backend, module, ops::AttentionModuleOptions,
};
use burn_cubecl::{BoolElement, CubeRuntime};
use burn_flash::{AttentionKernel, BlockTable, FlashAttentionOptions, FlashBackend, HeadTerms};
use clap::{CommandFactory, Parser, error::ErrorKind};
use common::*;
use serde::{Deserialize, Serialize};

/// Decoding attention bench (module docs).
#[derive(Parser, Debug)]
#[command(name = "decode", bin_name = "decode")]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// Element types.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [DTypeName::Bf16])]
    dtypes: Vec<DTypeName>,
    /// Rows to run besides the copy [default: contiguous, paged, mma-forced (CUDA, 16-bit),
    /// burn].
    #[arg(long, value_delimiter = ',')]
    impls: Vec<String>,
    /// Batches [default: 1,8,32,64; 1,4 with --quick].
    #[arg(long, value_delimiter = ',')]
    batches: Vec<usize>,
    /// Context lengths [default: 1024,8192,32768,131072; 256,2048 with --quick].
    #[arg(long, value_delimiter = ',')]
    contexts: Vec<usize>,
    /// Query heads x key/value heads.
    #[arg(long, default_value = "32x8", value_parser = parse_pair)]
    heads: (usize, usize),
    /// Head dim.
    #[arg(long, default_value_t = 128)]
    dim: usize,
    /// Keys per block of the paged cache.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Timed passes per row [default: 10; 3 with --quick].
    #[arg(long)]
    passes: Option<usize>,
}

/// A row of `decode.csv` (module docs).
#[derive(Serialize, Deserialize, Default, Debug)]
#[serde(default)]
struct Row {
    runtime: String,
    dtype: String,
    batch: usize,
    context: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    #[serde(rename = "impl")]
    implementation: String,
    kernel: String,
    wall_ms_median: Option<f64>,
    #[serde(rename = "kv_GB_per_s")]
    kv_gb_per_s: Option<f64>,
    pct_of_copy: Option<f64>,
    device_ms_median: Option<f64>,
    #[serde(rename = "device_kv_GB_per_s")]
    device_kv_gb_per_s: Option<f64>,
    device_pct_of_copy: Option<f64>,
    timing_method: Option<String>,
    note: String,
}

/// The tensors of one (batch, context) on backend `B`.
struct Cache<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
}

impl<B: FlashBackend> Cache<B> {
    fn new(batch: usize, context: usize, cli: &Cli, dtype: FloatDType, device: &B::Device) -> Self {
        let (hq, hkv) = cli.heads;
        let random = |shape: [usize; 4]| {
            Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
        };
        Self {
            q: random([batch, hq, 1, cli.dim]),
            k: random([batch, hkv, context, cli.dim]),
            v: random([batch, hkv, context, cli.dim]),
        }
    }
}

/// A paged cache of `batch` sequences of `context` keys (random pools of `block_size` keys;
/// each sequence's blocks a shuffled run of the pool) and the queries.
fn paged<B: FlashBackend>(
    batch: usize,
    context: usize,
    cli: &Cli,
    dtype: FloatDType,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, BlockTable<B>) {
    let (hq, hkv) = cli.heads;
    let bs = cli.block_size;
    let per = context.div_ceil(bs);
    let blocks = batch * per;
    // A fixed shuffle (multiplicative hash), so that no sequence's blocks are contiguous.
    let mut order: Vec<usize> = (0..blocks).collect();
    order.sort_by_key(|&i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let table: Vec<Vec<usize>> = (0..batch)
        .map(|b| order[b * per..(b + 1) * per].to_vec())
        .collect();
    let random = |shape: [usize; 4]| {
        Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
    };
    let table = BlockTable::new(table, vec![context; batch], bs, blocks, device);
    (
        random([batch, hq, 1, cli.dim]),
        random([blocks, bs, hkv, cli.dim]),
        random([blocks, bs, hkv, cli.dim]),
        table,
    )
}

fn bench<R: CubeRuntime, BT: BoolElement>(runtime: RuntimeName, cli: &Cli) {
    let device = R::Device::default();
    let client = R::client(&device);
    let quick = cli.common.quick;
    let batches = match &cli.batches[..] {
        [] if quick => vec![1, 4],
        [] => vec![1, 8, 32, 64],
        b => b.to_vec(),
    };
    let contexts = match &cli.contexts[..] {
        [] if quick => vec![256, 2048],
        [] => vec![1024, 8192, 32768, 131072],
        c => c.to_vec(),
    };
    let protocol = Protocol {
        warmup: if quick { 1 } else { 3 },
        passes: cli.passes.unwrap_or(if quick { 3 } else { 10 }),
        calls: Calls::AtLeast {
            seconds: 0.01,
            max: 200,
        },
    };
    let (hq, hkv) = cli.heads;
    let file = format!("decode{}.csv", runtime.suffix());
    let mut csv = CsvOut::<Row>::create(cli.common.out_path(&file));
    let sync = || Fu::<R, BT>::sync(&device).expect("sync");
    let cuda = runtime.name() == "cuda";
    for &dtype_name in &cli.dtypes {
        let dtype = dtype_name.dtype();
        let elem = DType::from(dtype).size();
        for &batch in &batches {
            for &context in &contexts {
                let kv_bytes = (2 * batch * hkv * context * cli.dim * elem) as f64;
                let mut copy_rate: (Option<f64>, Option<f64>) = (None, None);
                let mut impls = vec!["copy", "contiguous", "paged"];
                if cuda && dtype != FloatDType::F32 {
                    impls.push("mma-forced");
                }
                impls.push("burn");
                if !cli.impls.is_empty() {
                    impls.retain(|i| *i == "copy" || cli.impls.iter().any(|a| a == i));
                }
                for imp in impls {
                    let mut row = Row {
                        runtime: runtime.name().into(),
                        dtype: dtype_name.label().into(),
                        batch,
                        context,
                        heads_q: hq,
                        heads_kv: hkv,
                        head_dim: cli.dim,
                        implementation: imp.into(),
                        ..Default::default()
                    };
                    if runtime == RuntimeName::Wgpu && dtype == FloatDType::BF16 {
                        row.note = "skipped: bf16 is not supported on wgpu".into();
                        csv.push(&row);
                        continue;
                    }
                    // Each row holds its cache twice (the Fusion call and its bare twin).
                    if kv_bytes > 12e9 {
                        row.note = "skipped: the cache exceeds 12 GB".into();
                        csv.push(&row);
                        continue;
                    }
                    if imp == "burn" && kv_bytes * (hq / hkv) as f64 > 24e9 {
                        row.note = "skipped: the repeated cache exceeds 24 GB".into();
                        csv.push(&row);
                        continue;
                    }
                    let options = |kernel| FlashAttentionOptions {
                        kernel,
                        ..Default::default()
                    };
                    let forced = (imp == "mma-forced").then_some(AttentionKernel::MatrixUnits);
                    let dims = burn_flash::attention::AttentionDims {
                        batch,
                        heads_q: hq,
                        heads_kv: hkv,
                        seq_q: 1,
                        seq_k: context,
                        head_dim: cli.dim,
                        value_dim: cli.dim,
                    };
                    row.kernel = match imp {
                        "copy" => "copy".into(),
                        "burn" => "burn module::attention".into(),
                        "paged" => format!("SplitDecode (paged, blocks of {})", cli.block_size),
                        _ => burn_flash::attention_plan::<Fu<R, BT>>(
                            &device,
                            dims,
                            dtype.into(),
                            options(forced),
                        )
                        .and_then(Result::ok)
                        .map(|p| format!("{:?} {:?}", p.kernel, p.cubes))
                        .unwrap_or_default(),
                    };
                    let measured = attempt(|| {
                        let fu = Cache::<Fu<R, BT>>::new(batch, context, cli, dtype, &device);
                        let un = Cache::<Un<R, BT>>::new(batch, context, cli, dtype, &device);
                        match imp {
                            "copy" => {
                                let k = un.k.clone().into_primitive().tensor();
                                let v = un.v.clone().into_primitive().tensor();
                                let n = batch * hkv * context * cli.dim;
                                let (ko, vo) = (k.client.empty(n * elem), k.client.empty(n * elem));
                                let copy = || {
                                    for (x, o) in [(&k, &ko), (&v, &vo)] {
                                        burn_flash::kernels::copy::launch_copy(
                                            &x.client,
                                            &x.handle,
                                            o,
                                            n,
                                            x.dtype.into(),
                                        );
                                    }
                                };
                                let mut twin = Twin {
                                    client: &client,
                                    call: copy,
                                };
                                measure(protocol, &sync, copy, Ok(&mut twin))
                            }
                            "contiguous" | "mma-forced" => {
                                let run = |c: &Cache<Fu<R, BT>>| {
                                    burn_flash::attention_with_heads(
                                        c.q.clone(),
                                        c.k.clone(),
                                        c.v.clone(),
                                        None,
                                        None,
                                        HeadTerms::default(),
                                        options(forced),
                                    )
                                };
                                let mut twin = Twin {
                                    client: &client,
                                    call: || {
                                        burn_flash::attention_with_heads(
                                            un.q.clone(),
                                            un.k.clone(),
                                            un.v.clone(),
                                            None,
                                            None,
                                            HeadTerms::default(),
                                            options(forced),
                                        )
                                    },
                                };
                                measure(protocol, &sync, || run(&fu), Ok(&mut twin))
                            }
                            "paged" => {
                                drop((fu, un));
                                let (q, kp, vp, table) =
                                    paged::<Fu<R, BT>>(batch, context, cli, dtype, &device);
                                let (uq, ukp, uvp, utable) =
                                    paged::<Un<R, BT>>(batch, context, cli, dtype, &device);
                                let mut twin = Twin {
                                    client: &client,
                                    call: || {
                                        burn_flash::attention_paged(
                                            uq.clone(),
                                            ukp.clone(),
                                            uvp.clone(),
                                            &utable,
                                            HeadTerms::default(),
                                            options(None),
                                        )
                                    },
                                };
                                let call = || {
                                    burn_flash::attention_paged(
                                        q.clone(),
                                        kp.clone(),
                                        vp.clone(),
                                        &table,
                                        HeadTerms::default(),
                                        options(None),
                                    )
                                };
                                measure(protocol, &sync, call, Ok(&mut twin))
                            }
                            _ => {
                                let repeat = |t: &Tensor<Fu<R, BT>, 4>| {
                                    t.clone()
                                        .unsqueeze_dim::<5>(2)
                                        .repeat_dim(2, hq / hkv)
                                        .reshape([batch, hq, context, cli.dim])
                                };
                                let (k, v) = (repeat(&fu.k), repeat(&fu.v));
                                drop(un);
                                let opts = AttentionModuleOptions::default();
                                let call = || {
                                    module::attention(
                                        fu.q.clone(),
                                        k.clone(),
                                        v.clone(),
                                        None,
                                        None,
                                        opts,
                                    )
                                };
                                measure::<Tensor<Fu<R, BT>, 4>>(
                                    protocol,
                                    &sync,
                                    call,
                                    Err(NO_TWIN_FUSION),
                                )
                            }
                        }
                    });
                    match measured {
                        Ok(t) => {
                            let gbps =
                                |s: f64| kv_bytes * if imp == "copy" { 2.0 } else { 1.0 } / s / 1e9;
                            let wall = gbps(t.wall.median);
                            row.wall_ms_median = Some(sig(ms(t.wall.median), 4));
                            row.kv_gb_per_s = Some(sig(wall, 4));
                            let device_rate = t.device_median().map(gbps);
                            if let Some(d) = t.device_median() {
                                row.device_ms_median = Some(sig(ms(d), 4));
                                row.device_kv_gb_per_s = device_rate.map(|r| sig(r, 4));
                            }
                            if imp == "copy" {
                                copy_rate = (Some(wall), device_rate);
                            }
                            row.pct_of_copy = copy_rate.0.map(|c| sig(100.0 * wall / c, 3));
                            row.device_pct_of_copy = copy_rate
                                .1
                                .zip(device_rate)
                                .map(|(c, r)| sig(100.0 * r / c, 3));
                            row.timing_method = t.timing_method();
                            row.note = t.device_note();
                        }
                        Err(why) => row.note = format!("failed: {why}"),
                    }
                    println!(
                        "{} {} B {batch} S {context} {:>11} {:>40}: {:?} ms, {:?} GB/s ({:?} % of copy; device {:?} ms, {:?} %) {}",
                        row.runtime,
                        row.dtype,
                        row.implementation,
                        row.kernel,
                        row.wall_ms_median,
                        row.kv_gb_per_s,
                        row.pct_of_copy,
                        row.device_ms_median,
                        row.device_pct_of_copy,
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

/// `decode.png` beside the CSV: KV GB/s (wall) per implementation against the context.
fn draw(csv: &std::path::Path) {
    let Ok(rows) = read_rows::<Row>(csv) else {
        return;
    };
    let mut panels = Vec::new();
    for r in &rows {
        if let Some(g) = r.kv_gb_per_s {
            let title = format!(
                "{} B {} (Hq {} / Hkv {}, D {})",
                r.dtype, r.batch, r.heads_q, r.heads_kv, r.head_dim
            );
            add_point(
                &mut panels,
                &title,
                "KV GB/s (wall)",
                &r.implementation,
                r.context as f64,
                g,
            );
        }
    }
    if !panels.is_empty() {
        plot(&csv.with_extension("png"), "context (keys)", &panels);
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
