//! Softmax bandwidth: burn-flash against Burn's own softmax, the naive five-op decomposition
//! and a device-to-device copy, forward and backward.
//!
//! `cargo bench --bench softmax -- [--quick] [--out DIR] [--runtimes cuda,wgpu]
//! [--dtypes f32,f16,bf16] [--m M] [--ns N1,N2] [--tiers exchange,split] [--profile] [--plot CSV]`
//! (`--help` lists them):
//! wgpu by default, CUDA with `--features cuda` (both in one process when both are built; wgpu's
//! files then end in `-wgpu`). `--profile`: one forward and one backward call per shape, to
//! run under `ncu`. `--plot CSV`: redraw the PNG of an earlier run's `softmax.csv`.
//!
//! Timing: `common::measure` (its docs give the protocol): after 10 warm-up calls, 20 passes
//! (5 with `--quick`), each a batch of calls long enough (≥ 10 ms, ≤ 2000 calls) between two
//! syncs; per-call medians. A model syncs once per step, not once per op: the pass length
//! spreads each sync's fixed cost (Fusion's hand-off to its device thread, then cubecl's) as a
//! step does; `softmax_marginal.csv` gives the per-call cost without it. The bare-`CubeBackend` burn-flash row issues as many calls per pass
//! as the Fusion one. Rows through Burn's Fusion backend (`burn::backend::Cuda`/`Wgpu`) take
//! their device time from the same op on the bare `CubeBackend`.
//!
//! `softmax.csv`, one row per (dtype, N, direction, implementation):
//! - `backend, dtype, M, N, direction, impl`: the case; `direction` is `copy`, `forward`,
//!   `backward`, or `strided` (the section below, where `M` is the number of rows).
//! - `calls_per_pass`; `wall_us_median`: host time per call; `device_us_median`: profiled time
//!   per call; `timing_method`: `device` (GPU timestamps) or `system` (see `common`).
//! - `wall_GB_per_s = bytes / wall time`, `device_GB_per_s = bytes / device time`, where bytes
//!   count each element read once and written once: forward 2·M·N·size, backward 3·M·N·size
//!   (reads y and dy, writes dx), copy 2·M·N·size.
//! - `pct_of_copy = 100 · wall_GB_per_s / (copy's wall_GB_per_s)`, `device_pct_of_copy` the
//!   same with device figures: the copy kernel runs on the same bytes in the same run.
//! - `note`: why a field is empty (a failed or unsupported case, no device time).
//!
//! `softmax_marginal.csv`: the host's cost per call, apart from batching effects (Fusion hands
//! its queue to the device thread 32 tasks at a time). A chain `y = softmax(y)` of 50 calls and
//! one of 400 are each timed between two syncs (f32, M·N ≤ 2^26, where the kernel is short);
//! `marginal_us_per_call = (wall_us_large − wall_us_small) / 350`, for burn-flash through
//! Fusion and on the bare `CubeBackend` with the same call counts. `device_us_per_call`: the
//! profiled time of one chained call on the bare backend (the same kernel for both rows):
//! where the marginal cost is above it, the host sets the pace.
//!
//! Strided section (full runs only): a non-contiguous softmax dim, `x = a.swap_dims(0, 1)`
//! with `a` contiguous `[N, rows]`: the strided kernel in place against a copy to a dim-last
//! layout first; 2^26 f32 elements; GB/s counts the softmax's own 2·rows·N elements for each.

mod common;

use std::path::{Path, PathBuf};

use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive, activation, backend::Backend};
use burn_cubecl::{BoolElement, CubeRuntime};
use burn_flash::{FlashBackend, SoftmaxBackend, SoftmaxOptions, SoftmaxVariant};
use clap::{CommandFactory, Parser, error::ErrorKind};
use common::*;
use serde::{Deserialize, Serialize};

const M: usize = 4096;
const NS: [usize; 6] = [256, 1024, 4096, 16384, 65536, 262144];
/// Call counts of the two chains of the marginal-cost section.
const CHAIN: (usize, usize) = (50, 400);
/// The marginal-cost section runs where M·N is at most this.
const MARGINAL_MAX_ELEMENTS: usize = 1 << 26;

/// Softmax bandwidth bench (module docs of benches/softmax.rs give the CSV columns).
#[derive(Parser, Debug)]
#[command(name = "softmax", bin_name = "softmax")]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// Element types.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [DTypeName::F32, DTypeName::F16, DTypeName::Bf16])]
    dtypes: Vec<DTypeName>,
    /// Rows [default: 4096; 64 with --quick].
    #[arg(long)]
    m: Option<usize>,
    /// Row lengths [default: 256,1024,…,262144; the first four with --quick].
    #[arg(long, value_delimiter = ',')]
    ns: Vec<usize>,
    /// One forward and one backward call per shape (to run under `ncu`), no timing.
    #[arg(long)]
    profile: bool,
    /// Forward rows with these row schemes forced, beside the plan's choice (on the bare
    /// `CubeBackend`, `impl` = `burn-flash TIER (CubeBackend)`; a scheme the shape or device
    /// cannot run gives a row with the reason). With `--profile`, one forced call each.
    #[arg(long, value_enum, value_delimiter = ',')]
    tiers: Vec<TierName>,
    /// Forward rows with `SoftmaxOptions::unit_vectors` forced to each of these (vectors per
    /// unit of the cube tier), beside the plan's choice, on the bare `CubeBackend`; shapes
    /// outside the cube tier are skipped.
    #[arg(long, value_delimiter = ',')]
    unit_vectors: Vec<usize>,
    /// Redraw the PNG of an earlier run's CSV, then exit.
    #[arg(long, value_name = "CSV")]
    plot: Option<PathBuf>,
}

/// A row scheme to force (`--tiers`).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum TierName {
    Plane,
    Cube,
    Split,
    Exchange,
}

impl TierName {
    fn tier(self) -> burn_flash::SoftmaxTier {
        use burn_flash::SoftmaxTier as T;
        match self {
            Self::Plane => T::Plane,
            Self::Cube => T::Cube,
            Self::Split => T::Split,
            Self::Exchange => T::Exchange,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Plane => "burn-flash plane (CubeBackend)",
            Self::Cube => "burn-flash cube (CubeBackend)",
            Self::Split => "burn-flash split (CubeBackend)",
            Self::Exchange => "burn-flash exchange (CubeBackend)",
        }
    }

    fn options(self) -> SoftmaxOptions {
        SoftmaxOptions {
            tier: Some(self.tier()),
            plane_ops: None,
            unit_vectors: None,
        }
    }
}

/// A row of `softmax.csv` (module docs). Reading accepts the older column names.
#[derive(Serialize, Deserialize, Default, Debug)]
#[serde(default)]
struct Row {
    backend: String,
    dtype: String,
    #[serde(rename = "M")]
    m: usize,
    #[serde(rename = "N")]
    n: usize,
    direction: String,
    #[serde(rename = "impl")]
    implementation: String,
    calls_per_pass: Option<usize>,
    #[serde(alias = "median_us")]
    wall_us_median: Option<f64>,
    device_us_median: Option<f64>,
    timing_method: Option<String>,
    #[serde(rename = "wall_GB_per_s", alias = "GB_per_s")]
    wall_gb_per_s: Option<f64>,
    #[serde(rename = "device_GB_per_s")]
    device_gb_per_s: Option<f64>,
    pct_of_copy: Option<f64>,
    device_pct_of_copy: Option<f64>,
    note: String,
}

/// A row of `softmax_marginal.csv` (module docs).
#[derive(Serialize, Deserialize, Default, Debug)]
struct MarginalRow {
    backend: String,
    dtype: String,
    #[serde(rename = "M")]
    m: usize,
    #[serde(rename = "N")]
    n: usize,
    #[serde(rename = "impl")]
    implementation: String,
    calls_small: usize,
    calls_large: usize,
    wall_us_small: Option<f64>,
    wall_us_large: Option<f64>,
    marginal_us_per_call: Option<f64>,
    device_us_per_call: Option<f64>,
    timing_method: Option<String>,
    note: String,
}

/// One measured case before its GB/s are known (they need the copy's).
struct Case {
    direction: &'static str,
    implementation: &'static str,
    result: Result<Timings, String>,
}

fn bench<R: CubeRuntime, BT: BoolElement>(device: R::Device, runtime: RuntimeName, cli: &Cli) {
    let backend = runtime.name();
    let quick = cli.common.quick;
    let m = cli.m.unwrap_or(if quick { 64 } else { M });
    let ns: Vec<usize> = match (&cli.ns[..], quick) {
        ([], true) => NS[..4].to_vec(),
        ([], false) => NS.to_vec(),
        (ns, _) => ns.to_vec(),
    };
    let protocol = Protocol {
        warmup: 10,
        passes: if quick { 5 } else { 20 },
        calls: Calls::AtLeast {
            seconds: 10e-3,
            max: 2000,
        },
    };
    let csv_path = cli
        .common
        .out_path(&format!("softmax{}.csv", runtime.suffix()));
    let mut csv = (!cli.profile).then(|| CsvOut::<Row>::create(csv_path.clone()));
    let client = R::client(&device);
    // Fusion's sync drains its lazy queue, then syncs the device both backends share.
    let sync = || Fu::<R, BT>::sync(&device).expect("sync");

    for &name in &cli.dtypes {
        let (dtype, label) = (name.dtype(), name.label());
        let supported = Un::<R, BT>::supports_dtype(&device, DType::from(dtype));
        for &n in &ns {
            let elem = DType::from(dtype).size();
            // The same values on the bare backend (twins, unfused rows) and through Fusion.
            let inputs = || {
                let u =
                    Tensor::<Un<R, BT>, 2>::random([m, n], Distribution::Normal(0.0, 2.0), &device)
                        .cast(dtype);
                let f = Tensor::<Fu<R, BT>, 2>::from_data(u.to_data(), (&device, dtype.into()));
                (u, f)
            };
            if !supported {
                let row = Row {
                    backend: backend.into(),
                    dtype: label.into(),
                    m,
                    n,
                    direction: "forward".into(),
                    implementation: "burn-flash".into(),
                    note: "failed: dtype unsupported on this device".into(),
                    ..Default::default()
                };
                print_row(&row);
                if let Some(csv) = csv.as_mut() {
                    csv.push(&row);
                }
                continue;
            }
            if cli.profile {
                let x = || {
                    Tensor::<Un<R, BT>, 2>::random([m, n], Distribution::Normal(0.0, 2.0), &device)
                        .cast(dtype)
                };
                let y = burn_flash::softmax(x(), 1);
                let dy = x().into_primitive().tensor();
                let dx = Un::<R, BT>::flash_softmax_backward(
                    y.into_primitive().tensor(),
                    dy,
                    1,
                    SoftmaxVariant::Softmax,
                    SoftmaxOptions::default(),
                );
                drop(dx);
                for tier in &cli.tiers {
                    if let Ok(y) = attempt(|| {
                        burn_flash::softmax_with(x(), 1, SoftmaxVariant::Softmax, tier.options())
                    }) {
                        drop(y);
                    }
                }
                sync();
                println!("profiled {label} M={m} N={n}");
                continue;
            }
            let mut cases: Vec<Case> = Vec::new();
            let mut record = |direction, implementation, result| {
                cases.push(Case {
                    direction,
                    implementation,
                    result,
                })
            };

            // -- device-to-device copy of one tensor (read + write) --
            record(
                "copy",
                "copy",
                attempt(|| {
                    let x = inputs().0.into_primitive().tensor();
                    let out = x.client.empty(m * n * elem);
                    let copy = || {
                        burn_flash::kernels::copy::launch_copy(
                            &x.client,
                            &x.handle,
                            &out,
                            m * n,
                            x.dtype.into(),
                        )
                    };
                    let mut twin = Twin {
                        client: &client,
                        call: copy,
                    };
                    measure(protocol, &sync, copy, Ok(&mut twin))
                }),
            );

            // -- forward --
            let flash = attempt(|| {
                let (xu, xf) = inputs();
                let mut twin = Twin {
                    client: &client,
                    call: || burn_flash::softmax(xu.clone(), 1),
                };
                let call = || burn_flash::softmax(xf.clone(), 1);
                measure(protocol, &sync, call, Ok(&mut twin))
            });
            // The same kernel without Burn's Fusion wrapper, as many calls per pass: the
            // difference is Fusion's per-op host cost (see also softmax_marginal.csv).
            let same_calls = match &flash {
                Ok(t) => Protocol {
                    calls: Calls::Fixed(t.calls_per_pass),
                    ..protocol
                },
                Err(_) => protocol,
            };
            record("forward", "burn-flash", flash);
            record(
                "forward",
                "burn-flash (CubeBackend)",
                attempt(|| {
                    let (xu, _) = inputs();
                    let call = || burn_flash::softmax(xu.clone(), 1);
                    let mut twin = Twin {
                        client: &client,
                        call,
                    };
                    measure(same_calls, &sync, call, Ok(&mut twin))
                }),
            );
            // A forced forward on the bare backend (a forced scheme the shape cannot run panics
            // in its first call, before any timing).
            let forced = |options: SoftmaxOptions| {
                attempt(|| {
                    let (xu, _) = inputs();
                    let call = || {
                        burn_flash::softmax_with(xu.clone(), 1, SoftmaxVariant::Softmax, options)
                    };
                    drop(call());
                    let mut twin = Twin {
                        client: &client,
                        call,
                    };
                    measure(same_calls, &sync, call, Ok(&mut twin))
                })
            };
            for &k in &cli.unit_vectors {
                let options = SoftmaxOptions {
                    unit_vectors: Some(k),
                    ..Default::default()
                };
                let cube = burn_flash::softmax_plan::<Un<R, BT>>(
                    &device,
                    &[m, n],
                    &[n, 1],
                    1,
                    dtype.into(),
                    false,
                    options,
                )
                .and_then(|plan| plan.ok())
                .is_some_and(|plan| plan.tier == burn_flash::SoftmaxTier::Cube);
                if cube {
                    let label = format!("burn-flash cube, {k} vectors a unit (CubeBackend)");
                    record("forward", Box::leak(label.into()), forced(options));
                }
            }
            for tier in &cli.tiers {
                record("forward", tier.label(), forced(tier.options()));
            }
            record(
                "forward",
                "burn (fused)",
                attempt(|| {
                    let (_, xf) = inputs();
                    let call = || activation::softmax(xf.clone(), 1);
                    measure(protocol, &sync, call, Err(NO_TWIN_FUSION))
                }),
            );
            record(
                "forward",
                "naive 5-op",
                attempt(|| {
                    let (xu, _) = inputs();
                    let call = || {
                        let max = xu.clone().max_dim(1);
                        let e = (xu.clone() - max).exp();
                        let s = e.clone().sum_dim(1);
                        e / s
                    };
                    let mut twin = Twin {
                        client: &client,
                        call,
                    };
                    measure(protocol, &sync, call, Ok(&mut twin))
                }),
            );

            // -- backward: dx = y ⊙ (dy − Σ dy ⊙ y) --
            record(
                "backward",
                "burn-flash",
                attempt(|| {
                    let (xu, xf) = inputs();
                    let (dyu, dyf) = inputs();
                    let yu = burn_flash::softmax(xu, 1).into_primitive().tensor();
                    let yf = burn_flash::softmax(xf, 1).into_primitive().tensor();
                    let (dyu, dyf) = (dyu.into_primitive().tensor(), dyf.into_primitive().tensor());
                    let variant = SoftmaxVariant::Softmax;
                    let options = SoftmaxOptions::default();
                    let mut twin = Twin {
                        client: &client,
                        call: || {
                            Un::<R, BT>::flash_softmax_backward(
                                yu.clone(),
                                dyu.clone(),
                                1,
                                variant,
                                options,
                            )
                        },
                    };
                    let call = || {
                        Fu::<R, BT>::flash_softmax_backward(
                            yf.clone(),
                            dyf.clone(),
                            1,
                            variant,
                            options,
                        )
                    };
                    measure(protocol, &sync, call, Ok(&mut twin))
                }),
            );
            record(
                "backward",
                "burn (fused)",
                attempt(|| {
                    let y = activation::softmax(inputs().1, 1);
                    let dy = inputs().1;
                    let call = || y.clone() * (dy.clone() - (dy.clone() * y.clone()).sum_dim(1));
                    measure(protocol, &sync, call, Err(NO_TWIN_FUSION))
                }),
            );
            record(
                "backward",
                "naive",
                attempt(|| {
                    let y = activation::softmax(inputs().0, 1);
                    let dy = inputs().0;
                    let call = || y.clone() * (dy.clone() - (dy.clone() * y.clone()).sum_dim(1));
                    let mut twin = Twin {
                        client: &client,
                        call,
                    };
                    measure(protocol, &sync, call, Ok(&mut twin))
                }),
            );

            let bytes = |direction: &str| {
                let elements = if direction == "backward" { 3 } else { 2 } * m * n;
                (elements * elem) as f64
            };
            let copy_rate = cases
                .iter()
                .find(|c| c.direction == "copy")
                .and_then(|c| c.result.as_ref().ok())
                .map(|t| {
                    let b = bytes("copy");
                    (b / t.wall.median, t.device_median().map(|d| b / d))
                });
            for case in cases {
                let b = bytes(case.direction);
                let mut row = Row {
                    backend: backend.into(),
                    dtype: label.into(),
                    m,
                    n,
                    direction: case.direction.into(),
                    implementation: case.implementation.into(),
                    ..Default::default()
                };
                match &case.result {
                    Ok(t) => {
                        let wall_rate = b / t.wall.median;
                        let device_rate = t.device_median().map(|d| b / d);
                        row.calls_per_pass = Some(t.calls_per_pass);
                        row.wall_us_median = Some(sig(t.wall.median * 1e6, 4));
                        row.device_us_median = t.device_median().map(|d| sig(d * 1e6, 4));
                        row.timing_method = t.timing_method();
                        row.wall_gb_per_s = Some(sig(wall_rate / 1e9, 4));
                        row.device_gb_per_s = device_rate.map(|r| sig(r / 1e9, 4));
                        row.pct_of_copy = copy_rate.map(|(c, _)| sig(100.0 * wall_rate / c, 3));
                        row.device_pct_of_copy = match (device_rate, copy_rate) {
                            (Some(r), Some((_, Some(c)))) => Some(sig(100.0 * r / c, 3)),
                            _ => None,
                        };
                        row.note = t.device_note();
                    }
                    Err(e) => row.note = format!("failed: {e}"),
                }
                print_row(&row);
                csv.as_mut().expect("csv").push(&row);
            }
        }
    }
    if cli.profile {
        return;
    }
    marginal_section::<R, BT>(&device, runtime, cli, m, &ns, protocol);
    if !quick {
        strided_section::<R, BT>(&device, backend, protocol, csv.as_mut().expect("csv"));
    }
    println!("wrote {}", csv_path.display());
    plot_csv(&csv_path);
}

fn fmt(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

fn print_row(r: &Row) {
    println!(
        "{:6} {:5} M={:<6} N={:<7} {:9} {:25} wall {:>9} us  device {:>9} us  {:>8} GB/s ({:>8} device)  {:>5} % of copy  {}",
        r.backend,
        r.dtype,
        r.m,
        r.n,
        r.direction,
        r.implementation,
        fmt(r.wall_us_median),
        fmt(r.device_us_median),
        fmt(r.wall_gb_per_s),
        fmt(r.device_gb_per_s),
        fmt(r.pct_of_copy),
        r.note
    );
}

/// The marginal host cost of one call (module docs): chains of `CHAIN.0` and `CHAIN.1`
/// calls `y = softmax(y)`, through Fusion and on the bare `CubeBackend`, and the device time
/// of one chained call.
fn marginal_section<R: CubeRuntime, BT: BoolElement>(
    device: &R::Device,
    runtime: RuntimeName,
    cli: &Cli,
    m: usize,
    ns: &[usize],
    protocol: Protocol,
) {
    let path = cli
        .common
        .out_path(&format!("softmax_marginal{}.csv", runtime.suffix()));
    let mut csv = CsvOut::<MarginalRow>::create(path.clone());
    let client = R::client(device);
    let sync = || Fu::<R, BT>::sync(device).expect("sync");
    let protocol = Protocol {
        warmup: 2,
        calls: Calls::Fixed(1),
        ..protocol
    };
    fn chain<B: FlashBackend>(x: &Tensor<B, 2>, calls: usize) -> Tensor<B, 2> {
        (0..calls).fold(x.clone(), |y, _| burn_flash::softmax(y, 1))
    }
    for &n in ns.iter().filter(|&&n| m * n <= MARGINAL_MAX_ELEMENTS) {
        let xu = Tensor::<Un<R, BT>, 2>::random([m, n], Distribution::Normal(0.0, 2.0), device);
        let xf = Tensor::<Fu<R, BT>, 2>::from_data(xu.to_data(), device);
        // Device time of one chained call (the same kernel for both rows), median of passes
        // of `CHAIN.1` calls.
        let device_time = attempt(|| {
            let mut y = xu.clone();
            let mut twin = Twin {
                client: &client,
                call: move || y = burn_flash::softmax(y.clone(), 1),
            };
            twin.profile(protocol.warmup)?;
            let mut per_call = Vec::with_capacity(protocol.passes);
            let mut method = None;
            for _ in 0..protocol.passes {
                let (seconds, m) = twin.profile(CHAIN.1)?;
                per_call.push(seconds / CHAIN.1 as f64);
                method = Some(m);
            }
            per_call.sort_by(f64::total_cmp);
            Ok::<_, String>((per_call[per_call.len() / 2], method))
        })
        .and_then(|r| r);
        for implementation in ["burn-flash", "burn-flash (CubeBackend)"] {
            let time = |calls: usize| {
                attempt(|| {
                    let why = Err("see device_us_per_call");
                    if implementation == "burn-flash" {
                        measure(protocol, &sync, || chain(&xf, calls), why)
                    } else {
                        measure(protocol, &sync, || chain(&xu, calls), why)
                    }
                })
            };
            let (small, large) = (time(CHAIN.0), time(CHAIN.1));
            let mut row = MarginalRow {
                backend: runtime.name().into(),
                dtype: "f32".into(),
                m,
                n,
                implementation: implementation.into(),
                calls_small: CHAIN.0,
                calls_large: CHAIN.1,
                ..Default::default()
            };
            match &device_time {
                Ok((seconds, method)) => {
                    row.device_us_per_call = Some(sig(seconds * 1e6, 4));
                    row.timing_method = method.map(|m| m.to_string());
                }
                Err(e) => row.note = format!("no device time: {e}"),
            }
            match (&small, &large) {
                (Ok(s), Ok(l)) => {
                    let extra = (CHAIN.1 - CHAIN.0) as f64;
                    row.wall_us_small = Some(sig(s.wall.median * 1e6, 4));
                    row.wall_us_large = Some(sig(l.wall.median * 1e6, 4));
                    row.marginal_us_per_call =
                        Some(sig((l.wall.median - s.wall.median) / extra * 1e6, 3));
                }
                (Err(e), _) | (_, Err(e)) => row.note = format!("failed: {e}"),
            }
            println!(
                "{:6} f32   M={m:<6} N={n:<7} marginal  {implementation:25} {:>7} us per call \
                 ({:>7} us device); chains of {} / {} calls: {} / {} us  {}",
                row.backend,
                fmt(row.marginal_us_per_call),
                fmt(row.device_us_per_call),
                CHAIN.0,
                CHAIN.1,
                fmt(row.wall_us_small),
                fmt(row.wall_us_large),
                row.note
            );
            csv.push(&row);
        }
    }
    println!("wrote {}", path.display());
}

/// A non-contiguous softmax dim (module docs): the strided kernel in place, a copy to a
/// dim-last layout first, and the heuristic's choice, each with a twin on the same tensor.
fn strided_section<R: CubeRuntime, BT: BoolElement>(
    device: &R::Device,
    backend: &str,
    protocol: Protocol,
    csv: &mut CsvOut<Row>,
) {
    let client = R::client(device);
    let sync = || Fu::<R, BT>::sync(device).expect("sync");
    let total = 1usize << 26;
    let strided = SoftmaxOptions {
        tier: Some(burn_flash::SoftmaxTier::Strided),
        plane_ops: None,
        unit_vectors: None,
    };
    for rows in [1usize << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20] {
        let n = total / rows;
        let x = Tensor::<Un<R, BT>, 2>::random([n, rows], Distribution::Normal(0.0, 2.0), device)
            .swap_dims(0, 1);
        let in_place = || burn_flash::softmax_with(x.clone(), 1, SoftmaxVariant::Softmax, strided);
        let contiguous_first = || {
            let c = burn_cubecl::kernel::into_contiguous(x.clone().into_primitive().tensor());
            burn_flash::softmax(
                Tensor::<Un<R, BT>, 2>::from_primitive(TensorPrimitive::Float(c)),
                1,
            )
        };
        let heuristic = || burn_flash::softmax(x.clone(), 1);
        let cases = [
            (
                "strided kernel (in place)",
                time_twin(&client, protocol, &sync, in_place),
            ),
            (
                "contiguous first",
                time_twin(&client, protocol, &sync, contiguous_first),
            ),
            (
                "burn-flash (heuristic)",
                time_twin(&client, protocol, &sync, heuristic),
            ),
        ];
        let bytes = (2 * total * 4) as f64;
        for (name, result) in cases {
            let mut row = Row {
                backend: backend.into(),
                dtype: "f32".into(),
                m: rows,
                n,
                direction: "strided".into(),
                implementation: name.into(),
                ..Default::default()
            };
            match result {
                Ok(t) => {
                    row.calls_per_pass = Some(t.calls_per_pass);
                    row.wall_us_median = Some(sig(t.wall.median * 1e6, 4));
                    row.device_us_median = t.device_median().map(|d| sig(d * 1e6, 4));
                    row.timing_method = t.timing_method();
                    row.wall_gb_per_s = Some(sig(bytes / t.wall.median / 1e9, 4));
                    row.device_gb_per_s = t.device_median().map(|d| sig(bytes / d / 1e9, 4));
                    row.note = t.device_note();
                }
                Err(e) => row.note = format!("failed: {e}"),
            }
            print_row(&row);
            csv.push(&row);
        }
    }
}

/// [`measure`] of an op on the bare backend, its own twin.
fn time_twin<R: CubeRuntime, T: Send + 'static>(
    client: &cubecl::client::ComputeClient<R>,
    protocol: Protocol,
    sync: &dyn Fn(),
    call: impl Fn() -> T + Send + Copy,
) -> Result<Timings, String> {
    attempt(|| {
        let mut twin = Twin { client, call };
        measure(protocol, sync, call, Ok(&mut twin))
    })
}

/// Wall GB/s against N, one line per implementation, one panel per dtype and direction, with
/// the peers of `torch_softmax.csv` beside the CSV where it exists; the PNG goes next to the CSV.
fn plot_csv(csv: &Path) {
    let mut rows: Vec<Row> = match read_rows(csv) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("plot: {e}");
            return;
        }
    };
    // The peers' rows (`benches/softmax_peers.py`, same columns) where they ran in the same
    // directory.
    let peers = csv.with_file_name("torch_softmax.csv");
    if peers.exists() {
        match read_rows::<Row>(&peers) {
            Ok(more) => rows.extend(more),
            Err(e) => eprintln!("plot: {e}"),
        }
    }
    let mut panels: Vec<Panel> = Vec::new();
    for r in rows.iter().filter(|r| r.direction != "strided") {
        let Some(rate) = r.wall_gb_per_s else {
            continue;
        };
        // The copy line goes on every panel of its dtype.
        let directions: &[&str] = match r.direction.as_str() {
            "copy" => &["forward", "backward"],
            d => &[d][..],
        };
        for d in directions {
            let title = format!("{} {d} (wall)", r.dtype);
            add_point(
                &mut panels,
                &title,
                "GB/s",
                &r.implementation,
                r.n as f64,
                rate,
            );
        }
    }
    let png = csv.with_extension("png");
    plot(&png, "N (row length)", &panels);
    println!("wrote {}", png.display());
}

fn main() {
    common::plan_inputs_from_env();
    let cli = Cli::parse();
    if let Some(why) = cli.common.missing_runtime() {
        Cli::command().error(ErrorKind::InvalidValue, why).exit();
    }
    if let Some(csv) = &cli.plot {
        plot_csv(csv);
        return;
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
