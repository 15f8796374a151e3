//! Benchmark machinery shared by the benches: command-line pieces, the timing protocol (wall
//! time of each pass, device time of its twin), CSV rows, PNG plots, failure capture.
//!
//! # Timing protocol ([`measure`])
//! Warm-up calls first (compilation, autotuning and the memory pool settle), then `passes`
//! passes. A pass issues `calls` calls (outputs kept alive, so that a lazy Fusion backend cannot
//! skip them) between two syncs, timed on the host: the **wall** time, per call. After the
//! timed passes, as many passes of the row's *twin* (the same op on the same inputs, run on the
//! runtime's own `CubeBackend`) run inside [`ComputeClient::profile`]: the **device** time, per
//! call too. Reported: mean, standard deviation and median of
//! each, and the runtime's timing method.
//!
//! Why a twin and not the pass itself: `ComputeClient::profile` (cubecl 0.10) runs its closure
//! on the runtime's device thread, so only kernels launched *from that closure* fall inside the
//! profiled region. A Fusion backend launches from its own thread: profiling a Fusion op
//! measured 0 ns on lavapipe, and syncing Fusion inside the closure deadlocks (the Fusion thread
//! waits for the device thread, which waits for it). burn 0.21 has no profiling of its own to
//! copy. The twin runs the same kernel for burn-flash's ops (the Fusion op calls the
//! `CubeBackend` one); kernels that Fusion generates (Burn's fused softmax, its composed
//! `softmax·matmul`) have no twin and get no device time.
//!
//! Timing methods (`timing_method` column): `device` = GPU timestamps (wgpu with
//! `TIMESTAMP_QUERY`, lavapipe included): the kernels alone, one profiled region per call
//! (see [`Twin`]). `system` = cubecl's CUDA runtime in 0.10: the device thread's clock between
//! a stream sync before and one after all the calls of the pass, so it includes the launch cost
//! on that thread but not the hand-off from the calling thread nor Fusion's work. Wall − device
//! is the host's per-call cost either way.

#![allow(dead_code)]

use std::{
    fs::File,
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    sync::OnceLock,
    time::Instant,
};

use burn::tensor::FloatDType;
use burn_cubecl::CubeBackend;
use burn_fusion::Fusion;
use clap::{Args, ValueEnum};
use cubecl::{Runtime, client::ComputeClient, profile::TimingMethod};
use plotters::{prelude::*, style::register_font};
use serde::{Serialize, de::DeserializeOwned};

/// The bare CubeCL backend every bench times (f32 default float; a row's dtype is cast to).
pub type Un<R, BT> = CubeBackend<R, f32, i32, BT>;
/// The same backend through Fusion, as Burn's `Cuda`/`Wgpu` backends run it.
pub type Fu<R, BT> = Fusion<CubeBackend<R, f32, i32, BT>>;

/// The plan inputs the GPU scripts set through the environment (`BURN_FLASH_HOPPER`,
/// `BURN_FLASH_DECODE_KEYS`, `BURN_FLASH_DECODE_CUBES`, `BURN_FLASH_DETERMINISTIC`), made the
/// process's plan defaults: every bench calls this first (the library reads no environment).
pub fn plan_inputs_from_env() {
    let d = burn_flash::PlanDefaults::from_settings(|name| std::env::var(name).ok())
        .unwrap_or_else(|e| panic!("BURN_FLASH_HOPPER / BURN_FLASH_DECODE_*: {e}"));
    burn_flash::set_plan_defaults(d);
}

// -- command line --

/// An element type on the command line (`--dtypes f32,f16,bf16`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeName {
    F32,
    F16,
    Bf16,
}

impl DTypeName {
    /// Burn's float type.
    pub fn dtype(self) -> FloatDType {
        match self {
            DTypeName::F32 => FloatDType::F32,
            DTypeName::F16 => FloatDType::F16,
            DTypeName::Bf16 => FloatDType::BF16,
        }
    }

    /// The CSV label.
    pub fn label(self) -> &'static str {
        match self {
            DTypeName::F32 => "f32",
            DTypeName::F16 => "f16",
            DTypeName::Bf16 => "bf16",
        }
    }
}

/// Options every bench takes.
#[derive(Args, Debug)]
pub struct CommonArgs {
    /// Small shapes and few passes (a smoke run, e.g. on lavapipe).
    #[arg(long)]
    pub quick: bool,
    /// Directory for the CSV and PNG files [default: $CARGO_TARGET_DIR/bench, else target/bench].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Runtimes to run [default: all built in: wgpu by default, CUDA with `--features cuda`].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub runtimes: Vec<RuntimeName>,
    /// Passed by `cargo bench` to `harness = false` binaries; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}

impl CommonArgs {
    /// `DIR/name`, DIR from `--out`.
    pub fn out_path(&self, name: &str) -> PathBuf {
        let dir = self.out.clone().unwrap_or_else(|| {
            let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
            Path::new(&target).join("bench")
        });
        dir.join(name)
    }

    /// Whether `runtime` runs: asked for, or built in when none was asked for.
    pub fn runs(&self, runtime: RuntimeName) -> bool {
        runtime.built_in() && (self.runtimes.is_empty() || self.runtimes.contains(&runtime))
    }

    /// The command-line error for a runtime asked for but not built in, if any.
    pub fn missing_runtime(&self) -> Option<String> {
        self.runtimes.iter().find(|r| !r.built_in()).map(|r| {
            format!(
                "runtime `{}` is not built into this binary (build with `--features {}`)",
                r.name(),
                r.name()
            )
        })
    }
}

/// A CubeCL runtime.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeName {
    /// CUDA (`--features cuda`).
    Cuda,
    /// wgpu (the default feature; lavapipe on CPU-only machines).
    Wgpu,
}

impl RuntimeName {
    pub fn name(self) -> &'static str {
        match self {
            RuntimeName::Cuda => "cuda",
            RuntimeName::Wgpu => "wgpu",
        }
    }

    pub fn built_in(self) -> bool {
        match self {
            RuntimeName::Cuda => cfg!(feature = "cuda"),
            RuntimeName::Wgpu => cfg!(feature = "wgpu"),
        }
    }

    /// Output files of wgpu get a `-wgpu` suffix when CUDA runs in the same binary.
    pub fn suffix(self) -> &'static str {
        match self {
            RuntimeName::Wgpu if cfg!(feature = "cuda") => "-wgpu",
            _ => "",
        }
    }
}

/// Parses `64x32` into `(64, 32)`.
pub fn parse_pair(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s
        .split_once('x')
        .ok_or_else(|| format!("`{s}`: expected B1xB2, e.g. 64x32"))?;
    let parse = |v: &str| v.parse::<usize>().map_err(|e| format!("`{s}`: {e}"));
    Ok((parse(a)?, parse(b)?))
}

// -- timing protocol --

/// How many calls a pass issues between its two syncs.
#[derive(Clone, Copy, Debug)]
pub enum Calls {
    /// Exactly this many.
    Fixed(usize),
    /// Enough that a pass lasts at least `seconds` (from one call timed after the warm-up), at
    /// most `max`: short kernels are then not dominated by the sync.
    AtLeast { seconds: f64, max: usize },
}

/// Warm-up, number of timed passes, calls per pass.
#[derive(Clone, Copy, Debug)]
pub struct Protocol {
    pub warmup: usize,
    pub passes: usize,
    pub calls: Calls,
}

/// Mean, standard deviation (n − 1) and median of per-call times, in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub mean: f64,
    pub std: f64,
    pub median: f64,
}

impl Stats {
    fn of(mut samples: Vec<f64>) -> Self {
        let n = samples.len().max(1) as f64;
        let mean = samples.iter().sum::<f64>() / n;
        let var = samples.iter().map(|t| (t - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        samples.sort_by(f64::total_cmp);
        Self {
            mean,
            std: var.sqrt(),
            median: samples.get(samples.len() / 2).copied().unwrap_or(f64::NAN),
        }
    }
}

/// What [`measure`] found.
#[derive(Clone, Debug)]
pub struct Timings {
    pub calls_per_pass: usize,
    /// Host clock around each pass (sync, calls, sync), per call.
    pub wall: Stats,
    /// [`ComputeClient::profile`] of the twin after each pass, per call; `Err` says why not.
    pub device: Result<Stats, String>,
    /// How the runtime measured `device` (`device` = GPU timestamps, `system` = host clock on
    /// the device thread); `None` without device time.
    pub timing_method: Option<TimingMethod>,
}

impl Timings {
    pub fn device_median(&self) -> Option<f64> {
        self.device.as_ref().ok().map(|s| s.median)
    }

    pub fn timing_method(&self) -> Option<String> {
        self.timing_method.map(|m| m.to_string())
    }

    /// Why there is no device time, for a row's note (empty when there is one).
    pub fn device_note(&self) -> String {
        match &self.device {
            Ok(_) => String::new(),
            Err(why) => format!("no device time: {why}"),
        }
    }
}

/// Something whose device time can be taken: `calls` calls of an op, profiled.
pub trait DeviceCall {
    /// Seconds for `calls` calls by the runtime's profiler, and its timing method.
    fn profile(&mut self, calls: usize) -> Result<(f64, TimingMethod), String>;
}

/// The twin of a row: an op run on the runtime's `CubeBackend` inside
/// [`ComputeClient::profile`] (on the device thread, so its launches are inside the region).
pub struct Twin<'a, R: Runtime, F> {
    pub client: &'a ComputeClient<R>,
    pub call: F,
}

impl<R: Runtime, U: Send + 'static, F: FnMut() -> U + Send> Twin<'_, R, F> {
    /// One profiled region of `calls` calls.
    fn region(&mut self, calls: usize) -> Result<(f64, TimingMethod), String> {
        let call = &mut self.call;
        let (outs, duration) = self
            .client
            .profile(move || (0..calls).fold(None, |_, _| Some(call())), "bench")
            .map_err(|err| format!("profile failed: {err}"))?;
        let method = duration.timing_method();
        let ticks = cubecl::future::block_on(duration.resolve());
        drop(outs);
        Ok((ticks.duration().as_secs_f64(), method))
    }
}

impl<R: Runtime, U: Send + 'static, F: FnMut() -> U + Send> DeviceCall for Twin<'_, R, F> {
    /// GPU timestamps: one region per call, summed. cubecl 0.10's wgpu profiler stamps only the
    /// first compute pass of a region, and a pass ends after 32 dispatches: on lavapipe one region
    /// of 400 chained softmax calls measured about as long as one of 50. Host clock (`system`): one
    /// region for all calls, so that the two stream syncs around it are paid once.
    fn profile(&mut self, calls: usize) -> Result<(f64, TimingMethod), String> {
        match self.client.properties().timing_method {
            TimingMethod::Device => {
                let mut total = 0.0;
                let mut method = TimingMethod::Device;
                for _ in 0..calls {
                    let (seconds, m) = self.region(1)?;
                    total += seconds;
                    method = m;
                }
                Ok((total, method))
            }
            TimingMethod::System => self.region(calls),
        }
    }
}

/// Why a row has no twin, for the rows whose kernels only Fusion makes.
pub const NO_TWIN_FUSION: &str = "Fusion-generated kernels cannot be profiled (see benches/common)";

/// The timing protocol of every bench (module docs): `call` issues one call on the row's
/// backend, `sync` waits for the device (Fusion's sync drains its queue first), `twin` is
/// profiled after each pass, or `Err(why)` where there is none.
pub fn measure<T>(
    protocol: Protocol,
    sync: &dyn Fn(),
    mut call: impl FnMut() -> T,
    mut twin: Result<&mut dyn DeviceCall, &str>,
) -> Timings {
    for _ in 0..protocol.warmup {
        let out = call();
        sync();
        drop(out);
        if let Ok(twin) = twin.as_mut() {
            let _ = twin.profile(1);
        }
    }
    let calls = match protocol.calls {
        Calls::Fixed(n) => n.max(1),
        Calls::AtLeast { seconds, max } => {
            sync();
            let start = Instant::now();
            let out = call();
            sync();
            let one = start.elapsed().as_secs_f64();
            drop(out);
            ((seconds / one).ceil() as usize).clamp(1, max.max(1))
        }
    };
    let mut wall = Vec::with_capacity(protocol.passes);
    for _ in 0..protocol.passes {
        // Each output is dropped when the next call returns, as in a model: the memory pool
        // reuses it (holding every output would cap the calls per pass by memory).
        let mut last = None;
        sync();
        let start = Instant::now();
        for _ in 0..calls {
            last = Some(call());
        }
        sync();
        wall.push(start.elapsed().as_secs_f64() / calls as f64);
        drop(last);
    }
    // The twin's passes after all the timed ones: interleaved, the twin's buffers (another
    // stream's, on CUDA) disturbed the next timed pass.
    let mut device = Ok(Vec::with_capacity(protocol.passes));
    let mut timing_method = None;
    for _ in 0..protocol.passes {
        device = match (device, twin.as_mut()) {
            (Ok(mut times), Ok(twin)) => twin.profile(calls).map(|(seconds, method)| {
                timing_method = Some(method);
                times.push(seconds / calls as f64);
                times
            }),
            (Ok(_), Err(why)) => Err(why.to_string()),
            (Err(e), _) => Err(e),
        };
    }
    Timings {
        calls_per_pass: calls,
        wall: Stats::of(wall),
        device: device.map(Stats::of),
        timing_method: timing_method.filter(|_| twin.is_ok()),
    }
}

/// Runs `f`, turning a panic (out of memory, unsupported configuration) into an error string.
pub fn attempt<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|err| {
        err.downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into())
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    })
}

/// `x` rounded to `digits` significant digits, so that the CSV holds short numbers.
pub fn sig(x: f64, digits: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(digits - 1 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// Milliseconds, to 4 significant digits.
pub fn ms(seconds: f64) -> f64 {
    sig(seconds * 1e3, 4)
}

/// TFLOP/s of `flop` in `seconds`, to 4 significant digits.
pub fn tflops(flop: f64, seconds: f64) -> f64 {
    sig(flop / seconds / 1e12, 4)
}

// -- CSV --

/// A CSV file written one row at a time, flushed after each (a crash keeps what was measured).
pub struct CsvOut<T> {
    path: PathBuf,
    writer: csv::Writer<File>,
    _row: std::marker::PhantomData<T>,
}

impl<T: Serialize> CsvOut<T> {
    pub fn create(path: PathBuf) -> Self {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("create bench output dir");
        }
        let writer = csv::Writer::from_path(&path)
            .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        Self {
            path,
            writer,
            _row: std::marker::PhantomData,
        }
    }

    pub fn push(&mut self, row: &T) {
        self.writer.serialize(row).expect("write csv row");
        self.writer.flush().expect("flush csv");
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The rows of a CSV file, by column name.
pub fn read_rows<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>, String> {
    let mut reader =
        csv::Reader::from_path(path).map_err(|e| format!("{}: {e}", path.display()))?;
    reader
        .deserialize()
        .collect::<Result<Vec<T>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))
}

// -- plots --

/// DejaVu Sans, embedded so that plots carry labels on machines without fonts (licence in
/// `benches/assets/DejaVuSans-LICENSE.txt`). No system font is looked up.
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Registers [`FONT`] as plotters' `sans-serif` once; false if that failed.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(
        || match register_font("sans-serif", FontStyle::Normal, FONT) {
            Ok(()) => true,
            Err(_) => {
                eprintln!("bench: the embedded font did not load; plot drawn without labels");
                false
            }
        },
    )
}

/// One line of a plot.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel of a figure.
pub struct Panel {
    pub title: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

/// Adds `(x, y)` to the series `label` of the panel `title`, creating either as needed.
pub fn add_point(panels: &mut Vec<Panel>, title: &str, y_label: &str, label: &str, x: f64, y: f64) {
    let i = match panels.iter().position(|p| p.title == title) {
        Some(i) => i,
        None => {
            panels.push(Panel {
                title: title.into(),
                y_label: y_label.into(),
                series: vec![],
            });
            panels.len() - 1
        }
    };
    let panel = &mut panels[i];
    match panel.series.iter_mut().find(|s| s.label == label) {
        Some(s) => s.points.push((x, y)),
        None => panel.series.push(Series {
            label: label.into(),
            points: vec![(x, y)],
        }),
    }
}

/// Draws panels two per row in a PNG, x on a log2 axis.
pub fn plot(path: &Path, x_label: &str, panels: &[Panel]) {
    let text = font_ready();
    let cols = panels.len().clamp(1, 2);
    let rows = panels.len().div_ceil(cols).max(1);
    let size = (640 * cols as u32, 400 * rows as u32);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).expect("plot");
    let areas = root.split_evenly((rows, cols));
    // One colour per label across all panels.
    let mut labels: Vec<&str> = Vec::new();
    for s in panels.iter().flat_map(|p| &p.series) {
        if !labels.contains(&s.label.as_str()) {
            labels.push(&s.label);
        }
    }
    for (area, panel) in areas.iter().zip(panels) {
        let points = panel.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
        for &(x, y) in points {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
        if x0 > x1 {
            continue;
        }
        let mut chart = ChartBuilder::on(area);
        chart.margin(12).x_label_area_size(40).y_label_area_size(60);
        if text {
            chart.caption(&panel.title, ("sans-serif", 18));
        }
        let mut chart = chart
            .build_cartesian_2d((x0.log2() - 0.2)..(x1.log2() + 0.2), 0.0..y1 * 1.1)
            .expect("plot");
        if text {
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(&panel.y_label)
                .x_label_formatter(&|v| format!("{}", 2f64.powf(*v).round()))
                .draw()
                .expect("plot");
        } else {
            chart
                .configure_mesh()
                .disable_x_mesh()
                .disable_y_mesh()
                .draw()
                .ok();
        }
        for s in &panel.series {
            let i = labels.iter().position(|l| *l == s.label).unwrap_or(0);
            let color = Palette99::pick(i).to_rgba();
            let line = chart
                .draw_series(LineSeries::new(
                    s.points.iter().map(|&(x, y)| (x.log2(), y)),
                    color.stroke_width(2),
                ))
                .expect("plot");
            if text {
                line.label(s.label.clone()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
            }
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .expect("plot");
        }
    }
    root.present().expect("write png");
}

/// Fills the peak column of each row of `csv` from the row with the same configuration in the
/// `--memory-only` run's `peak` file (rows without one keep an empty peak).
pub fn merge_peaks<T: Serialize + DeserializeOwned>(
    csv: &Path,
    peak: &Path,
    key: impl Fn(&T) -> String,
    set: impl Fn(&mut T, &T),
) {
    let read = |path: &Path| -> Vec<T> {
        csv::Reader::from_path(path)
            .map(|mut r| r.deserialize().filter_map(Result::ok).collect())
            .unwrap_or_default()
    };
    let peaks = read(peak);
    let mut rows = read(csv);
    for row in &mut rows {
        if let Some(p) = peaks.iter().find(|p| key(p) == key(row)) {
            set(row, p);
        }
    }
    let mut out = csv::Writer::from_path(csv).expect("rewrite csv");
    for row in &rows {
        out.serialize(row).expect("csv row");
    }
    out.flush().expect("flush csv");
}

/// Runs this bench again with its arguments plus `--memory-only`, in a process of its own
/// (whose exact memory pools would slow this one's timings down), its output discarded; the
/// peak columns stay empty if it fails.
pub fn run_memory_child() {
    let args = std::env::args().skip(1).filter(|a| a != "--bench");
    let exe = std::env::current_exe().expect("own path");
    match std::process::Command::new(exe)
        .args(args)
        .arg("--memory-only")
        .stdout(std::process::Stdio::null())
        .status()
    {
        Ok(status) if status.success() => {}
        other => eprintln!("memory run failed ({other:?}): the peak columns stay empty"),
    }
}
