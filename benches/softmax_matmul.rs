//! `softmax(X)·V`: burn-flash's fused op at each block size and the heuristic's choice, against
//! Burn's composed `softmax(x).matmul(v)` on the same backend.
//!
//! Protocol (the issue's): batch 16, d1 2048, d3 512, d2 ∈ {64 … 8192}; 10 warm-up passes and
//! 100 timed passes, each synchronised inside its timed region; mean and standard deviation in
//! ms (the median and TFLOP/s = 2·batch·d1·d2·d3 / median are printed too). Peak memory: after
//! a pool cleanup, inputs + the growth of reserved device memory across one call (freed pages
//! stay reserved until the next cleanup, so the growth bounds the call's own allocations).
//!
//! Sweeps: f32 forward → `softmax_matmul.csv` (exact columns
//! `batch_size,d1,d2,d3,impl,BLOCK,forward_ms_mean,forward_ms_std,forward_peak_MiB`); forward +
//! backward through `Autodiff` in f32, f16 and bf16 (d2 ≤ 4096; `(out ⊙ w).backward()`, output
//! gradient `w`) →
//! `softmax_matmul_backward.csv`; f16/bf16 forward →
//! `softmax_matmul_lowp.csv`, with a `…_back_to_back` row per configuration (20 passes between
//! two syncs: the rate without each pass's launch and sync cost; the note gives the time of an
//! idle sync); whether Burn's f32 matmul rounds to TF32 → printed. A failed
//! configuration (out of memory, unsupported block) is logged and recorded with empty
//! measurements, and the sweep goes on. PNG plots next to the CSVs.
//!
//! `cargo bench --bench softmax_matmul [-- --quick] [--out DIR] [--d2s 64,128]
//! [--sweeps f32,lowp,backward] [--runtimes cuda,wgpu] [--lowp-blocks 64x64,64x32]`: wgpu by
//! default; with `--features cuda` CUDA, and wgpu too in the same process when both features
//! are on (its files then end in `-wgpu`). `--sweeps` and `--runtimes` pick a subset (all by
//! default); `--lowp-blocks` adds forced `(block_1, block_2)` rows to the f16/bf16 sweep.

mod common;

use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::{
    DType, Distribution, FloatDType, Tensor, TensorData, activation, backend::Backend,
};
use burn_cubecl::CubeRuntime;
use burn_flash::{FlashBackend, SoftmaxMatmulOptions, softmax_matmul_with};
use common::*;

const BATCH: usize = 16;
const D1: usize = 2048;
const D3: usize = 512;
const D2S: [usize; 8] = [64, 128, 256, 512, 1024, 2048, 4096, 8192];
const BLOCKS: [usize; 3] = [16, 32, 64];
/// Columns of the backward and f16/bf16 sweeps' CSVs.
const SWEEP_COLUMNS: &[&str] = &[
    "dtype",
    "batch_size",
    "d1",
    "d2",
    "d3",
    "impl",
    "ms_mean",
    "ms_std",
    "ms_median",
    "TFLOP_per_s",
    "peak_MiB",
    "note",
];

/// Timings of one configuration, in ms.
struct Stats {
    mean: f64,
    std: f64,
    median: f64,
}

/// `warmup` untimed passes, then `passes` passes each timed between two syncs.
fn time_passes<T>(
    mut run: impl FnMut() -> T,
    sync: impl Fn(),
    warmup: usize,
    passes: usize,
) -> Stats {
    for _ in 0..warmup {
        let out = run();
        sync();
        drop(out);
    }
    let mut ms = Vec::with_capacity(passes);
    for _ in 0..passes {
        sync();
        let start = Instant::now();
        let out = run();
        sync();
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        drop(out);
    }
    let mean = ms.iter().sum::<f64>() / ms.len() as f64;
    let var = ms.iter().map(|t| (t - mean).powi(2)).sum::<f64>() / (ms.len().max(2) - 1) as f64;
    ms.sort_by(f64::total_cmp);
    Stats {
        mean,
        std: var.sqrt(),
        median: ms[ms.len() / 2],
    }
}

/// Per-pass ms of `passes` calls issued back to back between two syncs (outputs kept alive
/// until the sync), and ms of a sync with nothing queued: how much of a synchronised pass is the
/// host's launch and sync cost rather than the device's work.
fn time_back_to_back<T>(mut run: impl FnMut() -> T, sync: impl Fn(), passes: usize) -> (f64, f64) {
    sync();
    let start = Instant::now();
    let outs: Vec<T> = (0..passes).map(|_| run()).collect();
    sync();
    let per_pass = start.elapsed().as_secs_f64() * 1e3 / passes as f64;
    drop(outs);
    sync();
    let start = Instant::now();
    sync();
    (per_pass, start.elapsed().as_secs_f64() * 1e3)
}

/// One implementation under test.
#[derive(Clone, Copy)]
enum Impl {
    /// Burn's `softmax(x, 2).matmul(v)`.
    Composed,
    /// burn-flash with these options.
    Flash(SoftmaxMatmulOptions),
}

impl Impl {
    fn name(&self) -> &'static str {
        match self {
            Impl::Composed => "burn_composed",
            Impl::Flash(o) if o.blocks.is_none() => "burn_flash_heuristic",
            Impl::Flash(_) => "burn_flash",
        }
    }

    fn block(&self) -> String {
        match self {
            Impl::Flash(SoftmaxMatmulOptions {
                blocks: Some((b, _)),
                ..
            }) => b.to_string(),
            _ => String::new(),
        }
    }

    /// The name, with the forced blocks `(block_1, block_2)` when there are any.
    fn label(&self) -> String {
        match self {
            Impl::Flash(SoftmaxMatmulOptions {
                blocks: Some((b1, b2)),
                ..
            }) => format!("{}_{b1}x{b2}", self.name()),
            _ => self.name().into(),
        }
    }

    fn forward<B: FlashBackend>(&self, x: Tensor<B, 3>, v: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Impl::Composed => activation::softmax(x, 2).matmul(v),
            Impl::Flash(o) => softmax_matmul_with(x, v, *o),
        }
    }
}

/// The f16/bf16 sweep's rows: the heuristic, the `(block_1, block_2)` pairs given as
/// `--lowp-blocks 64x64,64x32`, and Burn's composed op.
fn lowp_impls() -> Vec<Impl> {
    let mut v = vec![Impl::Flash(Default::default())];
    for pair in arg("--lowp-blocks").iter().flat_map(|a| a.split(',')) {
        let (b1, b2) = pair.split_once('x').expect("--lowp-blocks B1xB2,…");
        v.push(Impl::Flash(SoftmaxMatmulOptions {
            blocks: Some((b1.parse().expect("B1"), b2.parse().expect("B2"))),
            ..Default::default()
        }));
    }
    v.push(Impl::Composed);
    v
}

fn impls(with_tf32: bool) -> Vec<Impl> {
    let mut v: Vec<Impl> = BLOCKS
        .iter()
        .map(|&b| {
            Impl::Flash(SoftmaxMatmulOptions {
                blocks: Some((b, b)),
                ..Default::default()
            })
        })
        .collect();
    v.push(Impl::Flash(SoftmaxMatmulOptions::default()));
    let _ = with_tf32;
    v.push(Impl::Composed);
    v
}

/// Measures `run` (which makes its own inputs' outputs) and the peak memory of one call.
fn measure<R: CubeRuntime, T>(
    client: &cubecl::client::ComputeClient<R>,
    inputs_bytes: u64,
    mut run: impl FnMut() -> T,
    sync: &impl Fn(),
    passes: (usize, usize),
) -> (Stats, f64) {
    sync();
    client.memory_cleanup();
    let before = client.memory_usage().map(|u| u.bytes_reserved).unwrap_or(0);
    let out = run();
    sync();
    let after = client.memory_usage().map(|u| u.bytes_reserved).unwrap_or(0);
    drop(out);
    let peak_mib = (inputs_bytes + after.saturating_sub(before)) as f64 / (1 << 20) as f64;
    let stats = time_passes(run, sync, passes.0, passes.1);
    (stats, peak_mib)
}

fn flops(batch: usize, d1: usize, d2: usize, d3: usize) -> f64 {
    2.0 * (batch * d1 * d2 * d3) as f64
}

struct PlotRow {
    panel: String,
    label: String,
    d2: f64,
    ms: f64,
    mib: f64,
}

/// One runtime's sweeps; `suffix` tells the output files of a second runtime apart.
fn bench<R: CubeRuntime, BT: burn_cubecl::BoolElement>(device: R::Device, suffix: &str) {
    type B<R, BT> = burn_fusion::Fusion<burn_cubecl::CubeBackend<R, f32, i32, BT>>;
    let quick = flag("--quick");
    let (batch, d1, d3) = if quick { (2, 256, 64) } else { (BATCH, D1, D3) };
    let d2s: Vec<usize> = arg("--d2s")
        .map(|v| v.split(',').map(|n| n.parse().expect("--d2s")).collect())
        .unwrap_or_else(|| {
            if quick {
                D2S[..4].to_vec()
            } else {
                D2S.to_vec()
            }
        });
    let passes = if quick { (2, 5) } else { (10, 100) };
    let client = R::client(&device);
    let sync = || B::<R, BT>::sync(&device).expect("sync");
    let with_tf32 = cfg!(feature = "cuda");
    let mut plot_rows: Vec<PlotRow> = Vec::new();
    let sweeps = arg("--sweeps").unwrap_or_else(|| "f32,lowp,backward".into());
    let runs = |name: &str| sweeps.split(',').any(|s| s == name);

    // -- f32 forward: the exact CSV --
    let mut csv = Csv::new(
        &out_path(&format!("softmax_matmul{suffix}.csv")),
        &[
            "batch_size",
            "d1",
            "d2",
            "d3",
            "impl",
            "BLOCK",
            "forward_ms_mean",
            "forward_ms_std",
            "forward_peak_MiB",
        ],
    );
    println!(
        "{:>6} {:>5} {:>5} {:>4} {:<22} {:>5} {:>9} {:>8} {:>9} {:>8} {:>9}",
        "batch",
        "d1",
        "d2",
        "d3",
        "impl",
        "BLOCK",
        "mean_ms",
        "std_ms",
        "median_ms",
        "TFLOP/s",
        "peak_MiB"
    );
    for &d2 in d2s.iter().filter(|_| runs("f32")) {
        for imp in impls(with_tf32) {
            let result = attempt(|| {
                let x = Tensor::<B<R, BT>, 3>::random(
                    [batch, d1, d2],
                    Distribution::Normal(0.0, 2.0),
                    &device,
                );
                let v =
                    Tensor::<B<R, BT>, 3>::random([batch, d2, d3], Distribution::Default, &device);
                let inputs = ((batch * d1 * d2 + batch * d2 * d3) * 4) as u64;
                measure(
                    &client,
                    inputs,
                    || imp.forward(x.clone(), v.clone()),
                    &sync,
                    passes,
                )
            });
            let block = imp.block();
            let mut row = vec![
                batch.to_string(),
                d1.to_string(),
                d2.to_string(),
                d3.to_string(),
                imp.name().to_string(),
                block.clone(),
            ];
            match result {
                Ok((s, mib)) => {
                    let tflops = flops(batch, d1, d2, d3) / (s.median * 1e-3) / 1e12;
                    println!(
                        "{batch:>6} {d1:>5} {d2:>5} {d3:>4} {:<22} {block:>5} {:>9.3} {:>8.3} {:>9.3} {tflops:>8.1} {mib:>9.0}",
                        imp.name(),
                        s.mean,
                        s.std,
                        s.median
                    );
                    row.extend([
                        format!("{:.4}", s.mean),
                        format!("{:.4}", s.std),
                        format!("{mib:.1}"),
                    ]);
                    plot_rows.push(PlotRow {
                        panel: "f32 forward".into(),
                        label: format!("{} {block}", imp.name()),
                        d2: d2 as f64,
                        ms: s.median,
                        mib,
                    });
                }
                Err(err) => {
                    println!(
                        "{batch:>6} {d1:>5} {d2:>5} {d3:>4} {:<22} {block:>5} FAILED: {err}",
                        imp.name()
                    );
                    row.extend([String::new(), String::new(), String::new()]);
                }
            }
            csv.push(row);
            client.memory_cleanup();
        }
    }

    // -- f16 / bf16 forward (heuristic) and forward + backward (f32, d2 ≤ 4096) --
    let mut lowp = Csv::new(
        &out_path(&format!("softmax_matmul{suffix}_lowp.csv")),
        SWEEP_COLUMNS,
    );
    let lowp_dtypes = [(FloatDType::F16, "f16"), (FloatDType::BF16, "bf16")];
    for (dtype, label) in lowp_dtypes.into_iter().filter(|_| runs("lowp")) {
        // A dtype the device lacks is recorded, not run (a failed launch would poison Fusion's
        // stream for the rest of the process).
        if !B::<R, BT>::supports_dtype(&device, dtype.into()) {
            println!("{label}: not supported by this device, skipped");
            lowp.push(vec![
                label.into(),
                batch.to_string(),
                d1.to_string(),
                String::new(),
                d3.to_string(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                "FAILED: dtype not supported by the device".into(),
            ]);
            continue;
        }
        for &d2 in &d2s {
            for imp in lowp_impls() {
                let name = imp.label();
                let result = attempt(|| {
                    let x = Tensor::<B<R, BT>, 3>::random(
                        [batch, d1, d2],
                        Distribution::Normal(0.0, 2.0),
                        &device,
                    )
                    .cast(dtype);
                    let v = Tensor::<B<R, BT>, 3>::random(
                        [batch, d2, d3],
                        Distribution::Default,
                        &device,
                    )
                    .cast(dtype);
                    let inputs = ((batch * d1 * d2 + batch * d2 * d3) * 2) as u64;
                    let measured = measure(
                        &client,
                        inputs,
                        || imp.forward(x.clone(), v.clone()),
                        &sync,
                        passes,
                    );
                    let back_to_back =
                        time_back_to_back(|| imp.forward(x.clone(), v.clone()), sync, 20);
                    (measured, back_to_back)
                });
                let (result, back_to_back) = match result {
                    Ok((measured, b2b)) => (Ok(measured), Some(b2b)),
                    Err(err) => (Err(err), None),
                };
                lowp.push(stats_row(label, batch, d1, d2, d3, &name, &result, 1.0));
                if let Some((ms, idle_sync)) = back_to_back {
                    let tflops = flops(batch, d1, d2, d3) / ms / 1e9;
                    println!(
                        "  {label} d2 {d2:5} {name}: {ms:.3} ms per pass back to back \
                         ({tflops:.1} TFLOP/s), idle sync {idle_sync:.3} ms"
                    );
                    lowp.push(vec![
                        label.into(),
                        batch.to_string(),
                        d1.to_string(),
                        d2.to_string(),
                        d3.to_string(),
                        format!("{name}_back_to_back"),
                        String::new(),
                        String::new(),
                        format!("{ms:.4}"),
                        format!("{tflops:.1}"),
                        String::new(),
                        format!(
                            "20 passes between two syncs (not the issue's protocol); \
                             idle sync {idle_sync:.4} ms"
                        ),
                    ]);
                }
                report(
                    label,
                    "forward",
                    d2,
                    &name,
                    &result,
                    flops(batch, d1, d2, d3),
                );
                if let Ok((s, mib)) = &result {
                    plot_rows.push(PlotRow {
                        panel: format!("{label} forward"),
                        label: name.clone(),
                        d2: d2 as f64,
                        ms: s.median,
                        mib: *mib,
                    });
                }
                client.memory_cleanup();
            }
        }
    }

    let mut bwd = Csv::new(
        &out_path(&format!("softmax_matmul{suffix}_backward.csv")),
        SWEEP_COLUMNS,
    );
    type A<R, BT> = Autodiff<B<R, BT>>;
    let bwd_dtypes = [
        (FloatDType::F32, "f32"),
        (FloatDType::F16, "f16"),
        (FloatDType::BF16, "bf16"),
    ];
    let bwd_dtypes = bwd_dtypes.into_iter().filter(|(dtype, label)| {
        let ok = B::<R, BT>::supports_dtype(&device, (*dtype).into());
        if !ok && runs("backward") {
            println!("{label} backward: not supported by this device, skipped");
        }
        ok
    });
    for (dtype, label) in bwd_dtypes {
        for &d2 in d2s.iter().filter(|&&d2| d2 <= 4096 && runs("backward")) {
            for imp in [Impl::Flash(Default::default()), Impl::Composed] {
                let result = attempt(|| {
                    let x = Tensor::<A<R, BT>, 3>::random(
                        [batch, d1, d2],
                        Distribution::Normal(0.0, 2.0),
                        &device,
                    )
                    .cast(dtype)
                    .require_grad();
                    let v = Tensor::<A<R, BT>, 3>::random(
                        [batch, d2, d3],
                        Distribution::Default,
                        &device,
                    )
                    .cast(dtype)
                    .require_grad();
                    let w = Tensor::<A<R, BT>, 3>::random(
                        [batch, d1, d3],
                        Distribution::Default,
                        &device,
                    )
                    .cast(dtype);
                    let elem = DType::from(dtype).size();
                    let inputs =
                        ((2 * batch * d1 * d2 + batch * d2 * d3 + batch * d1 * d3) * elem) as u64;
                    measure(
                        &client,
                        inputs,
                        || {
                            let out = imp.forward(x.clone(), v.clone());
                            // `backward` seeds a non-scalar root with ones: the output
                            // gradient is `w`, and no reduction (Burn's `sum` costs ~0.7 ms
                            // here) is timed with the op.
                            let grads = (out * w.clone()).backward();
                            (x.grad(&grads), v.grad(&grads))
                        },
                        &sync,
                        passes,
                    )
                });
                // Forward + backward = 3.5 × the forward's FLOPs (backward counted as 2.5×).
                bwd.push(stats_row(
                    label,
                    batch,
                    d1,
                    d2,
                    d3,
                    imp.name(),
                    &result,
                    3.5,
                ));
                report(
                    label,
                    "fwd+bwd",
                    d2,
                    imp.name(),
                    &result,
                    3.5 * flops(batch, d1, d2, d3),
                );
                if let Ok((s, mib)) = &result {
                    plot_rows.push(PlotRow {
                        panel: format!("{label} forward + backward"),
                        label: imp.name().into(),
                        d2: d2 as f64,
                        ms: s.median,
                        mib: *mib,
                    });
                }
                client.memory_cleanup();
            }
        }
    }

    matmul_precision::<B<R, BT>>(&device, suffix);
    draw(&plot_rows, suffix);
}

#[allow(clippy::too_many_arguments)]
fn stats_row(
    dtype: &str,
    batch: usize,
    d1: usize,
    d2: usize,
    d3: usize,
    name: &str,
    result: &Result<(Stats, f64), String>,
    flop_factor: f64,
) -> Vec<String> {
    let mut row = vec![
        dtype.to_string(),
        batch.to_string(),
        d1.to_string(),
        d2.to_string(),
        d3.to_string(),
        name.to_string(),
    ];
    match result {
        Ok((s, mib)) => {
            let tflops = flop_factor * flops(batch, d1, d2, d3) / (s.median * 1e-3) / 1e12;
            row.extend([
                format!("{:.4}", s.mean),
                format!("{:.4}", s.std),
                format!("{:.4}", s.median),
                format!("{tflops:.2}"),
                format!("{mib:.1}"),
                String::new(),
            ]);
        }
        Err(err) => row.extend([
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            format!("FAILED: {err}"),
        ]),
    }
    row
}

fn report(
    dtype: &str,
    what: &str,
    d2: usize,
    name: &str,
    result: &Result<(Stats, f64), String>,
    flop: f64,
) {
    match result {
        Ok((s, mib)) => println!(
            "{dtype:>5} {what:<8} d2 {d2:>5} {name:<22} median {:>8.3} ms  {:>7.1} TFLOP/s  peak {:>7.0} MiB",
            s.median,
            flop / (s.median * 1e-3) / 1e12,
            mib
        ),
        Err(err) => println!("{dtype:>5} {what:<8} d2 {d2:>5} {name:<22} FAILED: {err}"),
    }
}

/// Whether Burn's f32 matmul rounds its operands to TF32: its error against an f64 product
/// on the host (f32 accumulation of 1024 terms: ~1e-6 relative; TF32 operands: ~1e-3).
fn matmul_precision<B: Backend>(device: &B::Device, suffix: &str) {
    let (m, k, n) = (256, 1024, 256);
    let a: Vec<f32> = (0..m * k)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|i| ((i * 104_729 % 997) as f32 / 498.5) - 1.0)
        .collect();
    let ta = Tensor::<B, 2>::from_data(TensorData::new(a.clone(), [m, k]), device);
    let tb = Tensor::<B, 2>::from_data(TensorData::new(b.clone(), [k, n]), device);
    let got = ta
        .matmul(tb)
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("data");
    let mut worst = 0.0f64;
    for i in 0..m {
        for j in 0..n {
            let mut want = 0.0f64;
            let mut scale = 0.0f64;
            for l in 0..k {
                let p = a[i * k + l] as f64 * b[l * n + j] as f64;
                want += p;
                scale += p.abs();
            }
            worst = worst.max((got[i * n + j] as f64 - want).abs() / scale);
        }
    }
    let verdict = if worst > 1e-4 {
        "rounds to TF32 (or lower)"
    } else {
        "full f32"
    };
    println!("Burn f32 matmul {m}x{k}x{n}: max |error| / Σ|a·b| = {worst:.2e} → {verdict}");
    let path = out_path(&format!("matmul_precision{suffix}.txt"));
    std::fs::write(
        &path,
        format!("burn_f32_matmul_rel_error,{worst:e},{verdict}\n"),
    )
    .expect("write");
}

fn draw(rows: &[PlotRow], suffix: &str) {
    let mut panels: Vec<Panel> = Vec::new();
    for r in rows {
        for (title, y_label, y) in [
            (format!("{} time", r.panel), "ms (median)", r.ms),
            (format!("{} peak memory", r.panel), "MiB", r.mib),
        ] {
            let i = match panels.iter().position(|p| p.title == title) {
                Some(i) => i,
                None => {
                    panels.push(Panel {
                        title: title.clone(),
                        y_label: y_label.into(),
                        series: vec![],
                    });
                    panels.len() - 1
                }
            };
            let panel = &mut panels[i];
            match panel.series.iter_mut().find(|s| s.label == r.label) {
                Some(s) => s.points.push((r.d2, y)),
                None => panel.series.push(Series {
                    label: r.label.clone(),
                    points: vec![(r.d2, y)],
                }),
            }
        }
    }
    let png = out_path(&format!("softmax_matmul{suffix}.png"));
    plot(&png, "d2", &panels);
    println!("wrote {}", png.display());
}

fn main() {
    // With both runtimes built in, both run in this process: CUDA's files keep the plain names,
    // wgpu's get a `-wgpu` suffix.
    let runtimes = arg("--runtimes").unwrap_or_else(|| "cuda,wgpu".into());
    let runs = |name: &str| runtimes.split(',').any(|s| s == name);
    #[cfg(feature = "cuda")]
    if runs("cuda") {
        bench::<cubecl::cuda::CudaRuntime, u8>(Default::default(), "");
    }
    #[cfg(feature = "wgpu")]
    if runs("wgpu") {
        let suffix = if cfg!(feature = "cuda") { "-wgpu" } else { "" };
        bench::<burn::backend::wgpu::WgpuRuntime, u32>(Default::default(), suffix);
    }
}
