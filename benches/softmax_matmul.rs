//! `softmax(X)·V`: burn-flash's fused op at each block size and the heuristic's choice, against
//! Burn's composed `softmax(x).matmul(v)` on the same backend (Burn's Fusion backend, what
//! `burn::backend::Cuda`/`Wgpu` are).
//!
//! `cargo bench --bench softmax_matmul -- [--quick] [--out DIR] [--runtimes cuda,wgpu]
//! [--d2s 64,128] [--sweeps f32,lowp,backward] [--lowp-blocks 64x64,64x32]
//! [--plot CSV]` (`--help` lists them): wgpu by default, CUDA with `--features cuda` (both in
//! one process when both are built; wgpu's files then end in `-wgpu`). `--sweeps` and
//! `--runtimes` pick a subset (all by default); `--lowp-blocks` adds forced `(block_1,
//! block_2)` rows to the f16/bf16 sweep; `--plot CSV` redraws the
//! PNG of an earlier run from its `softmax_matmul.csv` and the `_lowp`/`_backward` files
//! beside it.
//!
//! Protocol (the issue's): batch 16, d1 2048, d3 512, d2 ∈ {64 … 8192}; 10 warm-up passes and
//! 100 timed passes (2 and 5 with `--quick`, on batch 2, d1 256, d3 64), each one call between
//! two syncs (`common::measure`, whose docs give the details). `TFLOP_per_s = 2·batch·d1·d2·d3
//! / median wall time`; `device_TFLOP_per_s` the same over the median device time, which
//! burn-flash's rows take from the same op on the bare `CubeBackend` (Burn's composed op has
//! Fusion-made kernels and no device time). Forward + backward counts 3.5× the forward's FLOPs
//! (backward 2.5×). `peak_MiB` / `forward_peak_MiB`: the call's inputs plus the most it held
//! beyond what was in use before it (outputs, intermediates, scratch), measured by the same
//! program in a child process (`--memory-only`, one call per configuration) whose memory pools
//! allocate exactly and release nothing during the call (`tests/common/peak_memory.rs`, the
//! memory test's method): the default pools reserve memory ahead of use and would hide a
//! `d1 × d2` buffer. The child's rows are in `*.peak.csv`.
//!
//! Files (under `target/bench/` or `--out`), a row per configuration; a failed configuration
//! (out of memory, unsupported block) is a row with empty measurements and a note, and the
//! sweep goes on:
//! - `softmax_matmul.csv`, f32 forward: the columns first, unchanged
//!   (`batch_size,d1,d2,d3,impl,BLOCK,forward_ms_mean,forward_ms_std,forward_peak_MiB`: mean and
//!   standard deviation of the wall time), then `forward_ms_median, TFLOP_per_s,
//!   device_ms_median, device_TFLOP_per_s, timing_method, note`.
//! - `softmax_matmul_lowp.csv`, f16/bf16 forward, and `softmax_matmul_backward.csv`, forward +
//!   backward through `Autodiff` in f32, f16 and bf16 (d2 ≤ 4096; `(out ⊙ w).backward()`, so the
//!   output gradient is `w`): `dtype, batch_size, d1, d2, d3, impl, wall_ms_mean, wall_ms_std,
//!   wall_ms_median, TFLOP_per_s, device_ms_median, device_TFLOP_per_s, timing_method,
//!   peak_MiB, note`. The f16/bf16 sweep adds a `…_back_to_back` row per configuration: 20
//!   calls between two syncs, the rate without each pass's launch and sync cost (the note gives
//!   the median time of an idle sync, through Fusion and on the bare backend).
//! - `matmul_precision.csv`: how Burn's f32 matmul rounds (see [`matmul_precision`]).
//! - `softmax_matmul.png`: median wall time and peak memory against d2, per sweep.
//!
//! `timing_method`: `device` (GPU timestamps) or `system` (cubecl's CUDA runtime: the device
//! thread's clock between two stream syncs); see `benches/common`.

mod common;
#[path = "../tests/common/peak_memory.rs"]
mod peak_memory;

use std::path::{Path, PathBuf};

use burn::backend::Autodiff;
use burn::tensor::{
    DType, Distribution, FloatDType, Tensor, TensorData, activation,
    backend::{AutodiffBackend, Backend},
};
use burn_cubecl::{BoolElement, CubeRuntime};
use burn_flash::{FlashBackend, SoftmaxMatmulOptions, softmax_matmul_with};
use clap::{CommandFactory, Parser, ValueEnum, error::ErrorKind};
use common::*;
use cubecl::client::ComputeClient;
use serde::{Deserialize, Serialize};

const BATCH: usize = 16;
const D1: usize = 2048;
const D3: usize = 512;
const D2S: [usize; 8] = [64, 128, 256, 512, 1024, 2048, 4096, 8192];
const BLOCKS: [usize; 3] = [16, 32, 64];
/// Calls between the two syncs of a back-to-back row.
const BACK_TO_BACK: usize = 20;

/// softmax(X)·V bench (module docs of benches/softmax_matmul.rs give the CSV columns).
#[derive(Parser, Debug)]
#[command(name = "softmax_matmul", bin_name = "softmax_matmul")]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// Values of d2 [default: 64,128,…,8192; the first four with --quick].
    #[arg(long, value_delimiter = ',')]
    d2s: Vec<usize>,
    /// Sweeps to run [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    sweeps: Vec<Sweep>,
    /// Forced (block_1, block_2) rows added to the f16/bf16 sweep, as B1xB2 (e.g. 64x32).
    #[arg(long, value_delimiter = ',', value_parser = parse_pair, value_name = "B1xB2")]
    lowp_blocks: Vec<(usize, usize)>,
    /// Redraw the PNG from an earlier run's softmax_matmul.csv (and its _lowp/_backward
    /// files), then exit.
    #[arg(long, value_name = "CSV")]
    plot: Option<PathBuf>,
    /// Measure only the peak memory of each configuration (one call each, in a process whose
    /// memory pools are exact: `tests/common/peak_memory.rs`), into `*.peak.csv`. A timing run
    /// starts itself with this flag first and takes its peak columns from those files.
    #[arg(long, hide = true)]
    memory_only: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Sweep {
    /// f32 forward, every block size (softmax_matmul.csv).
    F32,
    /// f16/bf16 forward (softmax_matmul_lowp.csv).
    Lowp,
    /// f32/f16/bf16 forward + backward (softmax_matmul_backward.csv).
    Backward,
}

impl Cli {
    fn runs(&self, sweep: Sweep) -> bool {
        self.sweeps.is_empty() || self.sweeps.contains(&sweep)
    }
}

/// A row of `softmax_matmul.csv` (module docs).
#[derive(Serialize, Deserialize, Default, Debug)]
#[serde(default)]
struct ForwardRow {
    batch_size: usize,
    d1: usize,
    d2: usize,
    d3: usize,
    #[serde(rename = "impl")]
    implementation: String,
    #[serde(rename = "BLOCK")]
    block: Option<usize>,
    forward_ms_mean: Option<f64>,
    forward_ms_std: Option<f64>,
    #[serde(rename = "forward_peak_MiB")]
    forward_peak_mib: Option<f64>,
    forward_ms_median: Option<f64>,
    #[serde(rename = "TFLOP_per_s")]
    tflop_per_s: Option<f64>,
    device_ms_median: Option<f64>,
    #[serde(rename = "device_TFLOP_per_s")]
    device_tflop_per_s: Option<f64>,
    timing_method: Option<String>,
    note: String,
}

/// A row of `softmax_matmul_lowp.csv` and `softmax_matmul_backward.csv` (module docs).
/// Reading accepts the older column names.
#[derive(Serialize, Deserialize, Default, Debug)]
#[serde(default)]
struct SweepRow {
    dtype: String,
    batch_size: usize,
    d1: usize,
    d2: usize,
    d3: usize,
    #[serde(rename = "impl")]
    implementation: String,
    #[serde(alias = "ms_mean")]
    wall_ms_mean: Option<f64>,
    #[serde(alias = "ms_std")]
    wall_ms_std: Option<f64>,
    #[serde(alias = "ms_median")]
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

/// The row of `matmul_precision.csv`.
#[derive(Serialize, Deserialize, Debug)]
struct PrecisionRow {
    m: usize,
    k: usize,
    n: usize,
    max_error_over_sum_abs_products: f64,
    verdict: String,
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
            Impl::Flash(o) if o.hopper == Some(false) => "burn_flash_no_hopper",
            Impl::Flash(o) if o.blocks.is_none() => "burn_flash_heuristic",
            Impl::Flash(_) => "burn_flash",
        }
    }

    fn block(&self) -> Option<usize> {
        match self {
            Impl::Flash(SoftmaxMatmulOptions {
                blocks: Some((b, _)),
                ..
            }) => Some(*b),
            _ => None,
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

    /// Forward, then backward with output gradient `w`: `backward` seeds a non-scalar root
    /// with ones, so no reduction (Burn's `sum` of the whole output) is timed with the op.
    fn forward_backward<B: AutodiffBackend + FlashBackend>(
        &self,
        x: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        w: &Tensor<B, 3>,
    ) -> [Option<Tensor<B::InnerBackend, 3>>; 2] {
        let out = self.forward(x.clone(), v.clone());
        let grads = (out * w.clone()).backward();
        [x.grad(&grads), v.grad(&grads)]
    }
}

/// The f32 sweep: forced blocks, the heuristic, Burn's composed op.
fn f32_impls() -> Vec<Impl> {
    let forced = BLOCKS.iter().map(|&b| {
        Impl::Flash(SoftmaxMatmulOptions {
            blocks: Some((b, b)),
            ..Default::default()
        })
    });
    forced
        .chain([Impl::Flash(Default::default()), Impl::Composed])
        .collect()
}

/// The f16/bf16 sweep: the heuristic, the `--lowp-blocks` pairs, on CUDA the heuristic with the
/// Hopper kernel off (the `mma.sync` kernel it replaces on sm_90; the heuristic's own choice
/// elsewhere), Burn's composed op.
fn lowp_impls(cli: &Cli, runtime: RuntimeName) -> Vec<Impl> {
    let forced = cli.lowp_blocks.iter().map(|&blocks| {
        Impl::Flash(SoftmaxMatmulOptions {
            blocks: Some(blocks),
            ..Default::default()
        })
    });
    [Impl::Flash(Default::default())]
        .into_iter()
        .chain(forced)
        .chain((runtime == RuntimeName::Cuda).then_some(NO_HOPPER))
        .chain([Impl::Composed])
        .collect()
}

/// The heuristic with the Hopper kernel off.
const NO_HOPPER: Impl = Impl::Flash(SoftmaxMatmulOptions {
    blocks: None,
    path: None,
    hopper: Some(false),
    schedule: burn_flash::TileSchedule::Planned,
    ampere: burn_flash::AmpereUse::Faster,
});

fn flops(batch: usize, d1: usize, d2: usize, d3: usize) -> f64 {
    2.0 * (batch * d1 * d2 * d3) as f64
}

/// Peak memory of one call in MiB, in a `--memory-only` process: the call's inputs plus the
/// most it held beyond what was in use before it (outputs, intermediates), measured with exact
/// pools (`peak_memory`). A timing process returns `None`: its pools reserve ahead of use, and
/// its peak columns come from the `--memory-only` run instead (`merge_peaks`).
fn peak_memory_mib<R: CubeRuntime, T>(
    memory_only: bool,
    client: &ComputeClient<R>,
    inputs_bytes: u64,
    run: impl FnOnce() -> T,
    sync: &dyn Fn(),
) -> Option<f64> {
    if !memory_only {
        return None;
    }
    let (out, m) = peak_memory::peak_memory(client, sync, run);
    drop(out);
    Some((inputs_bytes + m.peak.saturating_sub(m.before)) as f64 / (1 << 20) as f64)
}

/// The same values on the bare backend and through Fusion.
type Pair<R, BT> = (Tensor<Un<R, BT>, 3>, Tensor<Fu<R, BT>, 3>);

/// One runtime's sweeps.
struct Bench<'a, R: CubeRuntime, BT: BoolElement> {
    cli: &'a Cli,
    device: R::Device,
    client: ComputeClient<R>,
    runtime: RuntimeName,
    batch: usize,
    d1: usize,
    d3: usize,
    d2s: Vec<usize>,
    protocol: Protocol,
    _bool: std::marker::PhantomData<BT>,
}

impl<R: CubeRuntime, BT: BoolElement> Bench<'_, R, BT> {
    fn sync(&self) {
        // Fusion's sync drains its lazy queue, then syncs the device both backends share.
        Fu::<R, BT>::sync(&self.device).expect("sync");
    }

    /// The same random values on the bare backend (for twins) and through Fusion, in `dtype`.
    fn pair(
        &self,
        shape: [usize; 3],
        distribution: Distribution,
        dtype: FloatDType,
    ) -> Pair<R, BT> {
        let u = Tensor::<Un<R, BT>, 3>::random(shape, distribution, &self.device);
        let f = Tensor::<Fu<R, BT>, 3>::from_data(u.to_data(), &self.device);
        (u.cast(dtype), f.cast(dtype))
    }

    /// `softmax_matmul{-wgpu}{stem}.csv`, or `….peak.csv` in a `--memory-only` run.
    fn path(&self, stem: &str) -> PathBuf {
        let kind = if self.cli.memory_only {
            "peak.csv"
        } else {
            "csv"
        };
        self.cli.common.out_path(&format!(
            "softmax_matmul{}{stem}.{kind}",
            self.runtime.suffix()
        ))
    }

    /// Peak memory and timings of one forward configuration; `back_to_back` also times
    /// `BACK_TO_BACK` calls between two syncs.
    fn forward(
        &self,
        imp: Impl,
        dtype: FloatDType,
        d2: usize,
        back_to_back: bool,
    ) -> Result<(Timings, Option<f64>, Option<Timings>), String> {
        let (batch, d1, d3) = (self.batch, self.d1, self.d3);
        attempt(|| {
            let (xu, xf) = self.pair([batch, d1, d2], Distribution::Normal(0.0, 2.0), dtype);
            let (vu, vf) = self.pair([batch, d2, d3], Distribution::Default, dtype);
            let elem = DType::from(dtype).size();
            let inputs = ((batch * d1 * d2 + batch * d2 * d3) * elem) as u64;
            let sync = || self.sync();
            let call = || imp.forward(xf.clone(), vf.clone());
            let peak = peak_memory_mib(self.cli.memory_only, &self.client, inputs, call, &sync);
            let mut twin = Twin {
                client: &self.client,
                call: || imp.forward(xu.clone(), vu.clone()),
            };
            let has_twin = matches!(imp, Impl::Flash(_));
            let timings = if has_twin {
                measure(self.protocol, &sync, call, Ok(&mut twin))
            } else {
                measure(self.protocol, &sync, call, Err(NO_TWIN_FUSION))
            };
            let b2b = back_to_back.then(|| {
                let protocol = Protocol {
                    warmup: 0,
                    passes: 1,
                    calls: Calls::Fixed(BACK_TO_BACK),
                };
                if has_twin {
                    measure(protocol, &sync, call, Ok(&mut twin))
                } else {
                    measure(protocol, &sync, call, Err(NO_TWIN_FUSION))
                }
            });
            (timings, peak, b2b)
        })
    }

    /// Peak memory and timings of forward + backward through `Autodiff`.
    fn forward_backward(
        &self,
        imp: Impl,
        dtype: FloatDType,
        d2: usize,
    ) -> Result<(Timings, Option<f64>), String> {
        let (batch, d1, d3) = (self.batch, self.d1, self.d3);
        type Au<R, BT> = Autodiff<Un<R, BT>>;
        type Af<R, BT> = Autodiff<Fu<R, BT>>;
        attempt(|| {
            let (xu, xf) = self.pair([batch, d1, d2], Distribution::Normal(0.0, 2.0), dtype);
            let (vu, vf) = self.pair([batch, d2, d3], Distribution::Default, dtype);
            let (wu, wf) = self.pair([batch, d1, d3], Distribution::Default, dtype);
            let (xu, vu, wu) = (
                Tensor::<Au<R, BT>, 3>::from_inner(xu).require_grad(),
                Tensor::<Au<R, BT>, 3>::from_inner(vu).require_grad(),
                Tensor::<Au<R, BT>, 3>::from_inner(wu),
            );
            let (xf, vf, wf) = (
                Tensor::<Af<R, BT>, 3>::from_inner(xf).require_grad(),
                Tensor::<Af<R, BT>, 3>::from_inner(vf).require_grad(),
                Tensor::<Af<R, BT>, 3>::from_inner(wf),
            );
            let elem = DType::from(dtype).size();
            let inputs = ((2 * batch * d1 * d2 + batch * d2 * d3 + batch * d1 * d3) * elem) as u64;
            let sync = || self.sync();
            let call = || imp.forward_backward(&xf, &vf, &wf);
            let peak = peak_memory_mib(self.cli.memory_only, &self.client, inputs, call, &sync);
            let mut twin = Twin {
                client: &self.client,
                call: || imp.forward_backward(&xu, &vu, &wu),
            };
            let twin: Result<&mut dyn DeviceCall, &str> = match imp {
                Impl::Composed => Err(NO_TWIN_FUSION),
                Impl::Flash(_) => Ok(&mut twin),
            };
            (measure(self.protocol, &sync, call, twin), peak)
        })
    }

    fn run(&self) {
        let (batch, d1, d3) = (self.batch, self.d1, self.d3);
        // -- f32 forward: the CSV, then device time --
        let mut csv = CsvOut::<ForwardRow>::create(self.path(""));
        for &d2 in self.d2s.iter().filter(|_| self.cli.runs(Sweep::F32)) {
            for imp in f32_impls() {
                let mut row = ForwardRow {
                    batch_size: batch,
                    d1,
                    d2,
                    d3,
                    implementation: imp.name().into(),
                    block: imp.block(),
                    ..Default::default()
                };
                let flop = flops(batch, d1, d2, d3);
                match self.forward(imp, FloatDType::F32, d2, false) {
                    Ok((t, peak, _)) => {
                        row.forward_ms_mean = Some(ms(t.wall.mean));
                        row.forward_ms_std = Some(ms(t.wall.std));
                        row.forward_peak_mib = peak.map(|p| sig(p, 4));
                        row.forward_ms_median = Some(ms(t.wall.median));
                        row.tflop_per_s = Some(tflops(flop, t.wall.median));
                        row.device_ms_median = t.device_median().map(ms);
                        row.device_tflop_per_s = t.device_median().map(|d| tflops(flop, d));
                        row.timing_method = t.timing_method();
                        row.note = t.device_note();
                    }
                    Err(e) => row.note = format!("failed: {e}"),
                }
                report(
                    "f32",
                    "forward",
                    d2,
                    &imp.label(),
                    row.forward_ms_median,
                    row.device_ms_median,
                    row.tflop_per_s,
                    row.device_tflop_per_s,
                    row.forward_peak_mib,
                    &row.note,
                );
                csv.push(&row);
                self.client.memory_cleanup();
            }
        }

        // -- f16 / bf16 forward --
        let mut lowp = CsvOut::<SweepRow>::create(self.path("_lowp"));
        let lowp_dtypes = [(FloatDType::F16, "f16"), (FloatDType::BF16, "bf16")];
        for (dtype, label) in lowp_dtypes
            .into_iter()
            .filter(|_| self.cli.runs(Sweep::Lowp))
        {
            // A dtype the device lacks is recorded, not run (a failed launch would poison
            // Fusion's stream for the rest of the process).
            let supported = Fu::<R, BT>::supports_dtype(&self.device, dtype.into());
            if !supported {
                println!("{label}: not supported by this device, skipped");
            }
            for &d2 in &self.d2s {
                for imp in lowp_impls(self.cli, self.runtime) {
                    let name = imp.label();
                    if !supported {
                        lowp.push(&self.unsupported(label, d2, &name));
                        continue;
                    }
                    let flop = flops(batch, d1, d2, d3);
                    let (result, b2b) = match self.forward(imp, dtype, d2, true) {
                        Ok((t, peak, b2b)) => (Ok((t, peak)), b2b),
                        Err(e) => (Err(e), None),
                    };
                    let row = self.sweep_row(label, d2, &name, &result, flop);
                    report_row(label, "forward", &row);
                    lowp.push(&row);
                    if let Some(t) = b2b {
                        let idle = idle_sync_seconds(&|| self.sync());
                        // The bare backend's sync crosses one device thread, Fusion's two.
                        let idle_bare =
                            idle_sync_seconds(&|| Un::<R, BT>::sync(&self.device).expect("sync"));
                        let row = SweepRow {
                            wall_ms_median: Some(ms(t.wall.median)),
                            tflop_per_s: Some(tflops(flop, t.wall.median)),
                            device_ms_median: t.device_median().map(ms),
                            device_tflop_per_s: t.device_median().map(|d| tflops(flop, d)),
                            timing_method: t.timing_method(),
                            note: format!(
                                "{BACK_TO_BACK} calls between two syncs (not the issue's \
                                 protocol); idle sync {:.4} ms (bare backend {:.4} ms)",
                                idle * 1e3,
                                idle_bare * 1e3
                            ),
                            ..self.base_row(label, d2, &format!("{name}_back_to_back"))
                        };
                        report_row(label, "forward", &row);
                        lowp.push(&row);
                    }
                    self.client.memory_cleanup();
                }
            }
        }

        // -- forward + backward (d2 ≤ 4096) --
        let mut bwd = CsvOut::<SweepRow>::create(self.path("_backward"));
        let bwd_dtypes = [
            (FloatDType::F32, "f32"),
            (FloatDType::F16, "f16"),
            (FloatDType::BF16, "bf16"),
        ];
        for (dtype, label) in bwd_dtypes
            .into_iter()
            .filter(|_| self.cli.runs(Sweep::Backward))
        {
            let supported = Fu::<R, BT>::supports_dtype(&self.device, dtype.into());
            if !supported {
                println!("{label} backward: not supported by this device, skipped");
            }
            for &d2 in self.d2s.iter().filter(|&&d2| d2 <= 4096) {
                let no_hopper = (self.runtime == RuntimeName::Cuda && dtype != FloatDType::F32)
                    .then_some(NO_HOPPER);
                let impls = [Impl::Flash(Default::default())]
                    .into_iter()
                    .chain(no_hopper)
                    .chain([Impl::Composed]);
                for imp in impls {
                    if !supported {
                        bwd.push(&self.unsupported(label, d2, imp.name()));
                        continue;
                    }
                    let result = self.forward_backward(imp, dtype, d2);
                    let flop = 3.5 * flops(batch, d1, d2, d3);
                    let row = self.sweep_row(label, d2, imp.name(), &result, flop);
                    report_row(label, "fwd+bwd", &row);
                    bwd.push(&row);
                    self.client.memory_cleanup();
                }
            }
        }

        if self.cli.memory_only {
            return;
        }
        let precision = format!("matmul_precision{}.csv", self.runtime.suffix());
        matmul_precision::<Fu<R, BT>>(&self.device, &self.cli.common.out_path(&precision));
        let peak_file = |stem: &str| self.path(stem).with_extension("peak.csv");
        merge_peaks::<ForwardRow>(
            &self.path(""),
            &peak_file(""),
            |r| format!("{} {} {:?}", r.d2, r.implementation, r.block),
            |r, p| r.forward_peak_mib = p.forward_peak_mib,
        );
        for stem in ["_lowp", "_backward"] {
            merge_peaks::<SweepRow>(
                &self.path(stem),
                &peak_file(stem),
                |r| format!("{} {} {}", r.dtype, r.d2, r.implementation),
                |r, p| r.peak_mib = p.peak_mib,
            );
        }
        draw(csv.path());
    }

    /// The row of a configuration whose dtype the device lacks.
    fn unsupported(&self, dtype: &str, d2: usize, name: &str) -> SweepRow {
        SweepRow {
            note: "failed: dtype not supported by the device".into(),
            ..self.base_row(dtype, d2, name)
        }
    }

    /// A sweep row with its configuration and no measurement.
    fn base_row(&self, dtype: &str, d2: usize, name: &str) -> SweepRow {
        SweepRow {
            dtype: dtype.into(),
            batch_size: self.batch,
            d1: self.d1,
            d2,
            d3: self.d3,
            implementation: name.into(),
            ..Default::default()
        }
    }

    fn sweep_row(
        &self,
        dtype: &str,
        d2: usize,
        name: &str,
        result: &Result<(Timings, Option<f64>), String>,
        flop: f64,
    ) -> SweepRow {
        let mut row = self.base_row(dtype, d2, name);
        match result {
            Ok((t, peak)) => {
                row.wall_ms_mean = Some(ms(t.wall.mean));
                row.wall_ms_std = Some(ms(t.wall.std));
                row.wall_ms_median = Some(ms(t.wall.median));
                row.tflop_per_s = Some(tflops(flop, t.wall.median));
                row.device_ms_median = t.device_median().map(ms);
                row.device_tflop_per_s = t.device_median().map(|d| tflops(flop, d));
                row.timing_method = t.timing_method();
                row.peak_mib = peak.map(|p| sig(p, 4));
                row.note = t.device_note();
            }
            Err(e) => row.note = format!("failed: {e}"),
        }
        row
    }
}

/// Seconds of a sync with nothing queued: the median of 21.
fn idle_sync_seconds(sync: &dyn Fn()) -> f64 {
    sync();
    let mut times: Vec<f64> = (0..21)
        .map(|_| {
            let start = std::time::Instant::now();
            sync();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn fmt(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

fn report(
    dtype: &str,
    what: &str,
    d2: usize,
    name: &str,
    wall_ms: Option<f64>,
    device_ms: Option<f64>,
    tflops: Option<f64>,
    device_tflops: Option<f64>,
    peak_mib: Option<f64>,
    note: &str,
) {
    println!(
        "{dtype:>5} {what:<8} d2 {d2:>5} {name:<34} wall {:>9} ms {:>7} TFLOP/s  device {:>9} ms {:>7} TFLOP/s  peak {:>7} MiB  {note}",
        fmt(wall_ms),
        fmt(tflops),
        fmt(device_ms),
        fmt(device_tflops),
        fmt(peak_mib),
    );
}

fn report_row(dtype: &str, what: &str, r: &SweepRow) {
    report(
        dtype,
        what,
        r.d2,
        &r.implementation,
        r.wall_ms_median,
        r.device_ms_median,
        r.tflop_per_s,
        r.device_tflop_per_s,
        r.peak_mib,
        &r.note,
    );
}

/// Whether Burn's f32 matmul rounds its operands: max |error| / Σ|a·b| over the outputs of a
/// 256×1024×256 product, against an f64 product on the host. Expected figures at K = 1024:
/// full f32 accumulation of f32 products, ~1e-7; operands rounded to a 10-bit mantissa (TF32,
/// or f16: unit roundoff 2^-11, averaging down by ~√K), ~2e-5 (Burn 0.21's CUDA matmul is in
/// this class); a 7-bit mantissa (bf16, 2^-8), ~8× that, ~1.5e-4. The thresholds sit between
/// the classes.
fn matmul_precision<B: Backend>(device: &B::Device, path: &Path) {
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
    let verdict = if worst < 1e-6 {
        "full f32"
    } else if worst < 5e-5 {
        "TF32-class: operands rounded to a 10-bit mantissa (TF32 or f16)"
    } else if worst < 1e-3 {
        "bf16-class: operands rounded to a 7-bit mantissa"
    } else {
        "lower than bf16"
    };
    println!("Burn f32 matmul {m}x{k}x{n}: max |error| / Σ|a·b| = {worst:.2e} → {verdict}");
    CsvOut::create(path.to_owned()).push(&PrecisionRow {
        m,
        k,
        n,
        max_error_over_sum_abs_products: sig(worst, 3),
        verdict: verdict.into(),
    });
    println!("wrote {}", path.display());
}

/// `PATH` with `_lowp`/`_backward` before its extension.
fn sibling(csv: &Path, stem: &str) -> PathBuf {
    let name = csv.file_stem().unwrap_or_default().to_string_lossy();
    csv.with_file_name(format!("{name}{stem}.csv"))
}

/// Median wall time and peak memory against d2, a pair of panels per sweep, from the CSVs
/// (`softmax_matmul.csv` and its `_lowp`/`_backward` files where present, and the peers'
/// `torch_softmax_matmul_forward.csv` / `_backward.csv` beside them); the PNG goes next to
/// the first.
fn draw(csv: &Path) {
    let mut panels: Vec<Panel> = Vec::new();
    let mut add = |sweep: &str, label: &str, d2: usize, ms: Option<f64>, mib: Option<f64>| {
        if let Some(ms) = ms {
            let title = format!("{sweep} time");
            add_point(
                &mut panels,
                &title,
                "ms (median, wall)",
                label,
                d2 as f64,
                ms,
            );
        }
        if let Some(mib) = mib {
            let title = format!("{sweep} peak memory");
            add_point(&mut panels, &title, "MiB", label, d2 as f64, mib);
        }
    };
    match read_rows::<ForwardRow>(csv) {
        Ok(rows) => {
            for r in rows {
                let label = match r.block {
                    Some(b) => format!("{} {b}", r.implementation),
                    None => r.implementation.clone(),
                };
                // Files from before the median column: the mean.
                let ms = r.forward_ms_median.or(r.forward_ms_mean);
                add("f32 forward", &label, r.d2, ms, r.forward_peak_mib);
            }
        }
        Err(e) => eprintln!("plot: {e}"),
    }
    let peers = |name: &str| csv.with_file_name(name);
    for (path, what) in [
        (sibling(csv, "_lowp"), "forward"),
        (sibling(csv, "_backward"), "forward + backward"),
        // The peers (`benches/softmax_peers.py`, same columns), f32 included.
        (peers("torch_softmax_matmul_forward.csv"), "forward"),
        (
            peers("torch_softmax_matmul_backward.csv"),
            "forward + backward",
        ),
    ] {
        if !path.exists() {
            continue;
        }
        match read_rows::<SweepRow>(&path) {
            Ok(rows) => {
                for r in rows
                    .iter()
                    .filter(|r| !r.implementation.ends_with("_back_to_back"))
                {
                    let sweep = format!("{} {what}", r.dtype);
                    add(
                        &sweep,
                        &r.implementation,
                        r.d2,
                        r.wall_ms_median,
                        r.peak_mib,
                    );
                }
            }
            Err(e) => eprintln!("plot: {e}"),
        }
    }
    let png = csv.with_extension("png");
    plot(&png, "d2", &panels);
    println!("wrote {}", png.display());
}

fn bench<R: CubeRuntime, BT: BoolElement>(device: R::Device, runtime: RuntimeName, cli: &Cli) {
    let quick = cli.common.quick;
    let (batch, d1, d3) = if quick { (2, 256, 64) } else { (BATCH, D1, D3) };
    let d2s = match (&cli.d2s[..], quick) {
        ([], true) => D2S[..4].to_vec(),
        ([], false) => D2S.to_vec(),
        (d2s, _) => d2s.to_vec(),
    };
    let (warmup, passes) = match (cli.memory_only, quick) {
        // One call per configuration: only its memory is kept.
        (true, _) => (0, 1),
        (false, true) => (2, 5),
        (false, false) => (10, 100),
    };
    let bench = Bench::<R, BT> {
        cli,
        client: R::client(&device),
        device,
        runtime,
        batch,
        d1,
        d3,
        d2s,
        protocol: Protocol {
            warmup,
            passes,
            calls: Calls::Fixed(1),
        },
        _bool: std::marker::PhantomData,
    };
    bench.run();
}

fn main() {
    common::plan_inputs_from_env();
    let cli = Cli::parse();
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
    } else {
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
