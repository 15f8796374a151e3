//! Softmax bandwidth: burn-flash against Burn's own softmax, the naive five-op decomposition
//! and a device-to-device copy, forward and backward.
//!
//! GB/s = (bytes read once + bytes written once) / time: forward moves 2·M·N elements, backward
//! 3·M·N (reads y and dy, writes dx). "% of copy" divides by the copy kernel's GB/s for the same
//! bytes, measured in the same run.
//!
//! `cargo bench --bench softmax [-- --quick] [--out DIR] [--dtypes f32,f16,bf16] [--m M]
//! [--ns N1,N2] [--profile] [--plot CSV]` (`--profile`: one call each, to run under `ncu`;
//! `--plot`: redraw the PNG of an earlier run's CSV); CUDA when
//! built with `--features cuda`, else wgpu. Writes `softmax.csv` and `softmax.png` under
//! `target/bench/` (or `--out`).

mod common;

use burn::tensor::{DType, Distribution, FloatDType, Tensor, activation, backend::Backend};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime};
use burn_flash::{FlashBackend, SoftmaxOptions, SoftmaxVariant};
use burn_fusion::Fusion;
use common::*;

const M: usize = 4096;
const NS: [usize; 6] = [256, 1024, 4096, 16384, 65536, 262144];

struct Row {
    dtype: &'static str,
    n: usize,
    direction: &'static str,
    implementation: &'static str,
    result: Result<f64, String>,
}

fn bench<R: CubeRuntime, BT: BoolElement>(device: R::Device, backend: &str, suffix: &str) {
    type Un<R, BT> = CubeBackend<R, f32, i32, BT>;
    type Fu<R, BT> = Fusion<CubeBackend<R, f32, i32, BT>>;
    let quick = flag("--quick");
    let (m, ns): (usize, Vec<usize>) = if quick {
        (64, NS[..4].to_vec())
    } else {
        (M, NS.to_vec())
    };
    let m = arg("--m").map(|v| v.parse().expect("--m")).unwrap_or(m);
    let ns: Vec<usize> = arg("--ns")
        .map(|v| v.split(',').map(|n| n.parse().expect("--ns")).collect())
        .unwrap_or(ns);
    // `--profile`: one forward and one backward call per configuration, for `ncu`.
    let profile = flag("--profile");
    let samples = if quick { 5 } else { 20 };
    let dtypes: Vec<String> = arg("--dtypes")
        .unwrap_or_else(|| "f32,f16,bf16".into())
        .split(',')
        .map(str::to_owned)
        .collect();
    let csv_path = out_path(&format!("softmax{suffix}.csv"));
    let mut csv = Csv::new(
        &csv_path,
        &[
            "backend",
            "dtype",
            "M",
            "N",
            "direction",
            "impl",
            "median_us",
            "GB_per_s",
            "pct_of_copy",
            "note",
        ],
    );
    // Fusion's sync drains its lazy queue, then syncs the device both backends share.
    let sync = || Fu::<R, BT>::sync(&device).expect("sync");
    let mut rows: Vec<Row> = Vec::new();

    for name in &dtypes {
        let (dtype, label): (FloatDType, &'static str) = match name.as_str() {
            "f32" => (FloatDType::F32, "f32"),
            "f16" => (FloatDType::F16, "f16"),
            "bf16" => (FloatDType::BF16, "bf16"),
            other => panic!("unknown dtype {other}"),
        };
        let supported = Un::<R, BT>::supports_dtype(&device, DType::from(dtype));
        for &n in &ns {
            let elem = DType::from(dtype).size();
            let bytes_fwd = (2 * m * n * elem) as f64;
            let bytes_bwd = (3 * m * n * elem) as f64;
            let mut record = |direction, implementation, result: Result<f64, String>| {
                rows.push(Row {
                    dtype: label,
                    n,
                    direction,
                    implementation,
                    result,
                });
            };
            if !supported {
                record(
                    "forward",
                    "burn-flash",
                    Err("dtype unsupported on this device".into()),
                );
                continue;
            }
            let fx = || {
                Tensor::<Fu<R, BT>, 2>::random([m, n], Distribution::Normal(0.0, 2.0), &device)
                    .cast(dtype)
            };
            let ux = || {
                Tensor::<Un<R, BT>, 2>::random([m, n], Distribution::Normal(0.0, 2.0), &device)
                    .cast(dtype)
            };
            if profile {
                let y = burn_flash::softmax(ux(), 1);
                let dy = ux().into_primitive().tensor();
                let dx = Un::<R, BT>::flash_softmax_backward(
                    y.into_primitive().tensor(),
                    dy,
                    1,
                    SoftmaxVariant::Softmax,
                    SoftmaxOptions::default(),
                );
                drop(dx);
                sync();
                println!("profiled {label} M={m} N={n}");
                continue;
            }

            // -- device-to-device copy of one tensor (read + write) --
            let copy = attempt(|| {
                let x = ux().into_primitive().tensor();
                let out = x.client.empty(m * n * elem);
                median_us(
                    || {
                        burn_flash::kernels::copy::launch_copy(
                            &x.client,
                            &x.handle,
                            &out,
                            m * n,
                            x.dtype.into(),
                        )
                    },
                    sync,
                    samples,
                )
            });
            record("copy", "copy", copy.clone());

            // -- forward --
            record(
                "forward",
                "burn-flash",
                attempt(|| {
                    let x = fx();
                    median_us(|| burn_flash::softmax(x.clone(), 1), sync, samples)
                }),
            );
            // The same kernel without Burn's Fusion wrapper: the difference is Fusion's
            // per-op host cost.
            record(
                "forward",
                "burn-flash (CubeBackend)",
                attempt(|| {
                    let x = ux();
                    median_us(|| burn_flash::softmax(x.clone(), 1), sync, samples)
                }),
            );
            record(
                "forward",
                "burn (fused)",
                attempt(|| {
                    let x = fx();
                    median_us(|| activation::softmax(x.clone(), 1), sync, samples)
                }),
            );
            record(
                "forward",
                "naive 5-op",
                attempt(|| {
                    let x = ux();
                    median_us(
                        || {
                            let max = x.clone().max_dim(1);
                            let e = (x.clone() - max).exp();
                            let s = e.clone().sum_dim(1);
                            e / s
                        },
                        sync,
                        samples,
                    )
                }),
            );

            // -- backward: dx = y ⊙ (dy − Σ dy ⊙ y) --
            record(
                "backward",
                "burn-flash",
                attempt(|| {
                    let y = burn_flash::softmax(fx(), 1).into_primitive().tensor();
                    let dy = fx().into_primitive().tensor();
                    median_us(
                        || {
                            Fu::<R, BT>::flash_softmax_backward(
                                y.clone(),
                                dy.clone(),
                                1,
                                SoftmaxVariant::Softmax,
                                SoftmaxOptions::default(),
                            )
                        },
                        sync,
                        samples,
                    )
                }),
            );
            record(
                "backward",
                "burn (fused)",
                attempt(|| {
                    let y = activation::softmax(fx(), 1);
                    let dy = fx();
                    median_us(
                        || y.clone() * (dy.clone() - (dy.clone() * y.clone()).sum_dim(1)),
                        sync,
                        samples,
                    )
                }),
            );
            record(
                "backward",
                "naive",
                attempt(|| {
                    let y = activation::softmax(ux(), 1);
                    let dy = ux();
                    median_us(
                        || y.clone() * (dy.clone() - (dy.clone() * y.clone()).sum_dim(1)),
                        sync,
                        samples,
                    )
                }),
            );

            let copy_gbps = copy.as_ref().ok().map(|us| bytes_fwd / us / 1e3);
            for row in rows.drain(..) {
                let bytes = if row.direction == "backward" {
                    bytes_bwd
                } else {
                    bytes_fwd
                };
                let (us, gbps, pct, note) = match &row.result {
                    Ok(us) => {
                        let gbps = bytes / us / 1e3;
                        let pct = copy_gbps
                            .map(|c| format!("{:.1}", 100.0 * gbps / c))
                            .unwrap_or_default();
                        (format!("{us:.2}"), format!("{gbps:.1}"), pct, String::new())
                    }
                    Err(e) => (
                        String::new(),
                        String::new(),
                        String::new(),
                        format!("failed: {e}"),
                    ),
                };
                println!(
                    "{backend:6} {:5} M={m} N={:7} {:9} {:14} {:>10} us {:>8} GB/s {:>6} % {}",
                    row.dtype, row.n, row.direction, row.implementation, us, gbps, pct, note
                );
                csv.push(vec![
                    backend.into(),
                    row.dtype.into(),
                    m.to_string(),
                    row.n.to_string(),
                    row.direction.into(),
                    row.implementation.into(),
                    us,
                    gbps,
                    pct,
                    note,
                ]);
            }
        }
    }
    if !quick && !profile {
        strided_section::<R, BT>(&device, backend, samples, &mut csv);
    }
    println!("wrote {}", csv_path.display());
    plot_csv(&csv_path, &csv_path.with_extension("png"));
}

/// A non-contiguous softmax dim: `x = a.swap_dims(0, 1)` with `a` contiguous `[n, rows]`, so
/// the softmax dim has stride `rows`. The strided kernel reads it in place (two reads, one
/// write); the alternative copies to a dim-last layout first (read + write, then the row
/// kernel's read + write). 2^26 f32 elements, rows from 2^12 to 2^20. GB/s counts the
/// softmax's own 2·rows·n elements for every row, so the figures compare directly.
fn strided_section<R: CubeRuntime, BT: BoolElement>(
    device: &R::Device,
    backend: &str,
    samples: usize,
    csv: &mut Csv,
) {
    type Un<R, BT> = CubeBackend<R, f32, i32, BT>;
    type Fu<R, BT> = Fusion<CubeBackend<R, f32, i32, BT>>;
    let sync = || Fu::<R, BT>::sync(device).expect("sync");
    let total = 1usize << 26;
    for rows in [1usize << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20] {
        let n = total / rows;
        let x = Tensor::<Un<R, BT>, 2>::random([n, rows], Distribution::Normal(0.0, 2.0), device)
            .swap_dims(0, 1);
        let strided = SoftmaxOptions {
            tier: Some(burn_flash::SoftmaxTier::Strided),
            plane_ops: None,
        };
        let cases: [(&str, Result<f64, String>); 3] = [
            (
                "strided kernel (in place)",
                attempt(|| {
                    median_us(
                        || burn_flash::softmax_with(x.clone(), 1, SoftmaxVariant::Softmax, strided),
                        sync,
                        samples,
                    )
                }),
            ),
            (
                "contiguous first",
                attempt(|| {
                    median_us(
                        || {
                            let prim = x.clone().into_primitive().tensor();
                            let c = burn_cubecl::kernel::into_contiguous(prim);
                            let c = Tensor::<Un<R, BT>, 2>::from_primitive(
                                burn::tensor::TensorPrimitive::Float(c),
                            );
                            burn_flash::softmax(c, 1)
                        },
                        sync,
                        samples,
                    )
                }),
            ),
            (
                "burn-flash (heuristic)",
                attempt(|| median_us(|| burn_flash::softmax(x.clone(), 1), sync, samples)),
            ),
        ];
        for (name, result) in cases {
            let bytes = (2 * total * 4) as f64;
            let (us, gbps, note) = match result {
                Ok(us) => (
                    format!("{us:.2}"),
                    format!("{:.1}", bytes / us / 1e3),
                    String::new(),
                ),
                Err(e) => (String::new(), String::new(), format!("failed: {e}")),
            };
            println!(
                "{backend:6} f32   rows={rows:8} N={n:7} strided   {name:26} {us:>10} us {gbps:>8} GB/s {note}"
            );
            csv.push(vec![
                backend.into(),
                "f32".into(),
                rows.to_string(),
                n.to_string(),
                "strided".into(),
                name.into(),
                us,
                gbps,
                String::new(),
                note,
            ]);
        }
    }
}

/// GB/s against N, one line per implementation, one panel per dtype and direction.
fn plot_csv(csv: &std::path::Path, png: &std::path::Path) {
    let text = std::fs::read_to_string(csv).expect("read csv");
    let mut panels: Vec<Panel> = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let (dtype, n, direction, implementation, gbps) = (f[1], f[3], f[4], f[5], f[7]);
        let (Ok(n), Ok(gbps)) = (n.parse::<f64>(), gbps.parse::<f64>()) else {
            continue;
        };
        if direction == "strided" {
            continue;
        }
        let title = if direction == "copy" {
            None
        } else {
            Some(format!("{dtype} {direction}"))
        };
        let titles: Vec<String> = match title {
            Some(t) => vec![t],
            // The copy line goes on every panel of its dtype.
            None => ["forward", "backward"]
                .iter()
                .map(|d| format!("{dtype} {d}"))
                .collect(),
        };
        for title in titles {
            let panel = match panels.iter_mut().position(|p| p.title == title) {
                Some(i) => &mut panels[i],
                None => {
                    panels.push(Panel {
                        title: title.clone(),
                        y_label: "GB/s".into(),
                        series: vec![],
                    });
                    panels.last_mut().unwrap()
                }
            };
            match panel.series.iter_mut().find(|s| s.label == implementation) {
                Some(s) => s.points.push((n, gbps)),
                None => panel.series.push(Series {
                    label: implementation.into(),
                    points: vec![(n, gbps)],
                }),
            }
        }
    }
    plot(png, "N (row length)", &panels);
    println!("wrote {}", png.display());
}

fn main() {
    // `--plot CSV`: redraw the PNG of an earlier run's CSV (e.g. one from the GPU machine).
    if let Some(csv) = arg("--plot") {
        let csv = std::path::PathBuf::from(csv);
        plot_csv(&csv, &csv.with_extension("png"));
        return;
    }
    // With both runtimes built in, both run in this process: CUDA's files keep the plain
    // names, wgpu's get a `-wgpu` suffix.
    #[cfg(feature = "cuda")]
    {
        bench::<cubecl::cuda::CudaRuntime, u8>(Default::default(), "cuda", "");
    }
    #[cfg(feature = "wgpu")]
    {
        let suffix = if cfg!(feature = "cuda") { "-wgpu" } else { "" };
        bench::<burn::backend::wgpu::WgpuRuntime, u32>(Default::default(), "wgpu", suffix);
    }
}
