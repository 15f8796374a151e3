//! Benchmark machinery shared by the benches: timing, CSV, PNG plots, failure capture.

#![allow(dead_code)]

use std::{
    fmt::Write as _,
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    time::Instant,
};

use plotters::{prelude::*, style::register_font};

/// Median time of one call, in microseconds.
///
/// `run` launches one call and returns what it produced; `sync` waits for the device. Each
/// sample times a batch of calls, synchronised inside the timed region, long enough (≥ 2 ms)
/// that the host sync does not dominate short kernels; outputs stay alive until the batch is
/// synced so that a lazy (fusion) backend cannot skip their computation. Warm-up first.
pub fn median_us<T>(mut run: impl FnMut() -> T, sync: impl Fn(), samples: usize) -> f64 {
    // Ten warm-up calls: compilation, Burn's autotuning and the memory pool settle first.
    for _ in 0..10 {
        let out = run();
        sync();
        drop(out);
    }
    let start = Instant::now();
    let out = run();
    sync();
    drop(out);
    let one = start.elapsed().as_secs_f64();
    let batch = ((2e-3 / one).ceil() as usize).clamp(1, 200);
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let mut outs = Vec::with_capacity(batch);
        sync();
        let start = Instant::now();
        for _ in 0..batch {
            outs.push(run());
        }
        sync();
        times.push(start.elapsed().as_secs_f64() / batch as f64);
        drop(outs);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2] * 1e6
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
            .replace(',', ";")
    })
}

/// A CSV table written as rows arrive (so a crash keeps what was measured).
pub struct Csv {
    path: PathBuf,
    text: String,
}

impl Csv {
    pub fn new(path: &Path, header: &[&str]) -> Self {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("create bench output dir");
        }
        let mut csv = Self {
            path: path.to_owned(),
            text: String::new(),
        };
        csv.push(header.iter().map(|s| s.to_string()).collect());
        csv
    }

    pub fn push(&mut self, row: Vec<String>) {
        let _ = writeln!(self.text, "{}", row.join(","));
        std::fs::write(&self.path, &self.text).expect("write csv");
    }
}

/// Command-line value of `--name VALUE`.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

pub fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// `target/bench/NAME` unless `--out DIR` says otherwise.
pub fn out_path(name: &str) -> PathBuf {
    let dir = arg("--out").map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        Path::new(&target).join("bench")
    });
    dir.join(name)
}

/// Loads a TrueType font for plot labels: `BURN_FLASH_FONT`, then DejaVu where Debian or
/// matplotlib put it. Without one the plot is drawn without text.
fn load_font() -> bool {
    let mut candidates: Vec<PathBuf> = std::env::var("BURN_FLASH_FONT")
        .ok()
        .map(PathBuf::from)
        .into_iter()
        .collect();
    candidates.push("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf".into());
    for root in [
        "/usr/lib",
        "/usr/local/lib",
        "/opt/conda/lib",
        "/root/.local/lib",
    ] {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                for site in ["site-packages", "dist-packages"] {
                    candidates.push(
                        e.path()
                            .join(site)
                            .join("matplotlib/mpl-data/fonts/ttf/DejaVuSans.ttf"),
                    );
                }
            }
        }
    }
    for path in candidates {
        if let Ok(bytes) = std::fs::read(&path) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    eprintln!("bench: no TrueType font found (set BURN_FLASH_FONT); plot drawn without labels");
    false
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

/// Draws panels two per row in a PNG, x on a log2 axis.
pub fn plot(path: &Path, x_label: &str, panels: &[Panel]) {
    let text = load_font();
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
