//! `cargo xtask test`'s runner: cargo builds every test target once (`cargo test --no-run`), then
//! the tests run as several processes at a time, one per group of a binary's tests.
//!
//! Why: on a CPU-only machine the wgpu suites spend their time compiling kernel variants
//! (cubecl's passes and naga, then Mesa's llvmpipe), on one device thread per process; the test
//! thread and the other device threads sleep meanwhile (s54, `top -H` of `attention_backward`
//! on lavapipe: one thread at 100 %, the rest under 7 %). `cargo test` runs its binaries one
//! after another, so a 2-core machine ran the suites on one core. Tests inside one process
//! stay one at a time ([`crate::TEST_THREADS`]): they share the process's device.
//!
//! A group is the tests of one binary that share the first two segments of their path
//! (`wgpu::f16`, `ndarray::f32`, `attention::plan`): the kernels one group compiles are mostly
//! its own (the element type is a kernel's compile-time argument), and processes share
//! compiled shaders through Mesa's shader cache on disk (`$XDG_CACHE_HOME/mesa_shader_cache`:
//! cubecl keeps no wgpu kernel on disk). Groups run longest first (wgpu groups weigh ten tests
//! each); each group's output is printed whole when it ends, so the log reads as `cargo
//! test`'s does, one group at a time.
//! The summary names the longest groups and the slowest tests: with one test thread a test's
//! time is the span between libtest's result lines, and on a cold CPU-only machine it is
//! mostly the kernels it compiles first (RESULTS §12.1).

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    path::PathBuf,
    process::{Command, ExitCode, Output, Stdio},
    sync::Mutex,
    time::Instant,
};

/// One test executable cargo built: where it is, the package folder it runs in (as `cargo test`
/// runs it), and a name for the log (`attention_backward`, `burn-flash-kernels (lib)`).
struct Binary {
    exe: PathBuf,
    dir: PathBuf,
    name: String,
}

/// One process to run: a binary with the exact names of a group of its tests (or the user's
/// arguments after `--`), or the doc tests through cargo.
struct Job {
    label: String,
    program: PathBuf,
    args: Vec<String>,
    dir: Option<PathBuf>,
    tests: usize,
    weight: usize,
}

/// The lanes: `XTASK_TEST_JOBS` where set, else the machine's cores, at most 4 (each wgpu
/// process also holds a device and its buffers).
fn lanes() -> usize {
    std::env::var("XTASK_TEST_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(4)
        })
}

/// Builds the test targets (`cargo test --no-run` with `cargo_args`) and returns the binaries
/// cargo reports, or `None` if the build failed.
fn build(cargo: &str, cargo_args: &[String], envs: &[(&str, &str)]) -> Option<Vec<Binary>> {
    let mut args = vec!["test".to_string(), "--no-run".into()];
    args.extend(cargo_args.iter().cloned());
    args.push("--message-format=json-render-diagnostics".into());
    eprintln!("xtask: {cargo} {}", args.join(" "));
    let mut child = Command::new(cargo)
        .args(&args)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    let mut binaries = Vec::new();
    let stdout = child.stdout.take()?;
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let (Some(exe), Some(manifest)) =
            (msg["executable"].as_str(), msg["manifest_path"].as_str())
        else {
            continue;
        };
        let target = msg["target"]["name"].as_str().unwrap_or("?");
        let kinds: Vec<&str> = msg["target"]["kind"]
            .as_array()
            .map(|k| k.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        let name = if kinds.contains(&"test") {
            target.to_string()
        } else {
            format!("{target} ({})", kinds.join(", "))
        };
        let dir = PathBuf::from(manifest)
            .parent()
            .map(PathBuf::from)
            .unwrap_or_default();
        binaries.push(Binary {
            exe: PathBuf::from(exe),
            dir,
            name,
        });
    }
    child.wait().ok()?.success().then_some(binaries)
}

/// The tests a binary holds (`--list --format terse`), or `None` if it could not list them.
fn list(binary: &Binary) -> Option<Vec<String>> {
    let out = Command::new(&binary.exe)
        .args(["--list", "--format", "terse"])
        .current_dir(&binary.dir)
        .output()
        .ok()?;
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_suffix(": test"))
            .map(String::from)
            .collect()
    })
}

/// The group a test belongs to: the first two segments of its path, or fewer if it has no more
/// (the last segment is the test's own name).
fn group_of(test: &str) -> String {
    let parts: Vec<&str> = test.split("::").collect();
    parts[..parts.len().saturating_sub(1).min(2)].join("::")
}

/// The jobs for the binaries: one per group of tests, or one per binary with the user's
/// arguments (which may filter, so nothing is listed), and the doc tests.
fn jobs(binaries: &[Binary], test_args: &[String], doc: Option<Job>) -> Result<Vec<Job>, String> {
    let mut jobs: Vec<Job> = doc.into_iter().collect();
    for binary in binaries {
        if !test_args.is_empty() {
            jobs.push(Job {
                label: binary.name.clone(),
                program: binary.exe.clone(),
                args: test_args.to_vec(),
                dir: Some(binary.dir.clone()),
                tests: 0,
                weight: 1,
            });
            continue;
        }
        let tests =
            list(binary).ok_or_else(|| format!("could not list {}'s tests", binary.name))?;
        let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for test in tests {
            groups.entry(group_of(&test)).or_default().push(test);
        }
        for (group, names) in groups {
            let weight = names.len() * if group.starts_with("wgpu") { 10 } else { 1 };
            let tests = names.len();
            let mut args = names;
            args.push("--exact".into());
            let label = if group.is_empty() {
                binary.name.clone()
            } else {
                format!("{} {group}", binary.name)
            };
            jobs.push(Job {
                label,
                program: binary.exe.clone(),
                args,
                dir: Some(binary.dir.clone()),
                tests,
                weight,
            });
        }
    }
    // Longest first, so that the last job to start is a short one.
    jobs.sort_by_key(|j| std::cmp::Reverse(j.weight));
    Ok(jobs)
}

/// Builds, then runs every group on the lanes; fails if the build or any group failed.
pub fn test(
    cargo: &str,
    cargo_args: &[String],
    test_args: &[String],
    envs: &[(&str, &str)],
) -> ExitCode {
    let start = Instant::now();
    let Some(binaries) = build(cargo, cargo_args, envs) else {
        eprintln!("xtask: the test build failed");
        return ExitCode::FAILURE;
    };
    // The doc tests, unless the arguments pick targets (cargo refuses `--doc` beside them).
    const TARGETS: [&str; 10] = [
        "--lib",
        "--bin",
        "--bins",
        "--test",
        "--tests",
        "--bench",
        "--benches",
        "--example",
        "--examples",
        "--all-targets",
    ];
    let picks = |a: &String| {
        TARGETS
            .iter()
            .any(|t| a == t || a.starts_with(&format!("{t}=")))
    };
    let doc = (!cargo_args.iter().any(picks)).then(|| {
        let mut args = vec!["test".to_string(), "--doc".into()];
        args.extend(cargo_args.iter().cloned());
        if !test_args.is_empty() {
            args.push("--".into());
            args.extend(test_args.iter().cloned());
        }
        Job {
            label: "doc tests".into(),
            program: cargo.into(),
            args,
            dir: None,
            tests: 0,
            weight: usize::MAX,
        }
    });
    let jobs = match jobs(&binaries, test_args, doc) {
        Ok(jobs) => jobs,
        Err(e) => {
            eprintln!("xtask: {e}");
            return ExitCode::FAILURE;
        }
    };
    let lanes = lanes().min(jobs.len()).max(1);
    let total = jobs.len();
    let listed: usize = jobs.iter().map(|j| j.tests).sum();
    eprintln!(
        "xtask: {} test binaries built in {:.0} s; {listed} tests in {total} groups, {lanes} at a \
         time",
        binaries.len(),
        start.elapsed().as_secs_f64()
    );
    let queue = Mutex::new(jobs.into_iter());
    // Each finished group: its seconds, label and whether it passed.
    let finished: Mutex<Vec<(f64, String, bool)>> = Mutex::new(Vec::new());
    // Each test that ended: its seconds and `binary path::to::test`.
    let timed: Mutex<Vec<(f64, String)>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..lanes {
            scope.spawn(|| {
                loop {
                    let Some(job) = queue.lock().unwrap().next() else {
                        break;
                    };
                    let began = Instant::now();
                    let mut cmd = Command::new(&job.program);
                    cmd.args(&job.args).envs(envs.iter().copied());
                    // As `cargo test` runs a test binary: in its package's folder, which
                    // `CARGO_MANIFEST_DIR` names (xtask's own would leak in otherwise).
                    if let Some(dir) = &job.dir {
                        cmd.current_dir(dir).env("CARGO_MANIFEST_DIR", dir);
                    }
                    let out = run_timed(cmd, began);
                    let secs = began.elapsed().as_secs_f64();
                    let ok = out.as_ref().is_ok_and(|(o, _)| o.status.success());
                    if let Ok((_, tests)) = &out {
                        let label = job.label.split(' ').next().unwrap_or_default();
                        timed
                            .lock()
                            .unwrap()
                            .extend(tests.iter().map(|(t, n)| (*t, format!("{label} {n}"))));
                    }
                    let tests = match job.tests {
                        0 => String::new(),
                        1 => " (1 test)".into(),
                        t => format!(" ({t} tests)"),
                    };
                    let n = {
                        let mut finished = finished.lock().unwrap();
                        finished.push((secs, job.label.clone(), ok));
                        finished.len()
                    };
                    // One lock for the whole block, so that groups never interleave.
                    let mut log = std::io::stdout().lock();
                    let _ = writeln!(
                        log,
                        "xtask: [{n}/{total}] {} {}{tests} in {secs:.0} s",
                        if ok { "ok" } else { "FAILED" },
                        job.label,
                    );
                    match &out {
                        Ok((o, _)) => {
                            let _ = log.write_all(&o.stdout);
                            let _ = log.write_all(&o.stderr);
                        }
                        Err(e) => {
                            let _ = writeln!(log, "xtask: could not start {:?}: {e}", job.program);
                        }
                    }
                    let _ = log.flush();
                }
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let mut finished = finished.into_inner().unwrap();
    let failed: Vec<String> = finished
        .iter()
        .filter(|(_, _, ok)| !ok)
        .map(|(_, label, _)| label.clone())
        .collect();
    // The longest groups, for whoever balances the suites next.
    finished.sort_by(|a, b| b.0.total_cmp(&a.0));
    let longest: Vec<String> = finished
        .iter()
        .take(5)
        .map(|(t, label, _)| format!("{label} {t:.0} s"))
        .collect();
    eprintln!("xtask: longest groups: {}", longest.join(", "));
    let mut timed = timed.into_inner().unwrap();
    timed.sort_by(|a, b| b.0.total_cmp(&a.0));
    let slowest: Vec<String> = timed
        .iter()
        .take(SLOWEST)
        .map(|(t, name)| format!("{name} {t:.0} s"))
        .collect();
    eprintln!("xtask: slowest tests: {}", slowest.join(", "));
    if failed.is_empty() {
        eprintln!("xtask: every test group passed ({total} groups, {secs:.0} s)");
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "xtask: {} of {total} groups FAILED ({secs:.0} s): {}",
            failed.len(),
            failed.join(", ")
        );
        ExitCode::FAILURE
    }
}

/// How many of the slowest tests the summary names.
const SLOWEST: usize = 15;

/// Runs a test process, timing each test by the moment libtest prints its result line
/// (`test NAME ... ok`): with one test thread a test runs from the previous line (or the
/// process's start) to its own. Returns the process's output and each test's seconds and name.
fn run_timed(mut cmd: Command, began: Instant) -> std::io::Result<(Output, Vec<(f64, String)>)> {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let mut stderr = child.stderr.take().expect("piped stderr");
    let errors = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut buf);
        buf
    });
    let mut stdout = Vec::new();
    let mut tests = Vec::new();
    let mut last = began.elapsed().as_secs_f64();
    let mut reader = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut line = Vec::new();
    while reader.read_until(b'\n', &mut line).unwrap_or(0) > 0 {
        if let Some((name, _)) = String::from_utf8_lossy(&line)
            .strip_prefix("test ")
            .and_then(|rest| rest.split_once(" ... "))
        {
            let now = began.elapsed().as_secs_f64();
            tests.push((now - last, name.to_string()));
            last = now;
        }
        stdout.append(&mut line);
    }
    drop(reader);
    let status = child.wait()?;
    let stderr = errors.join().unwrap_or_default();
    let output = Output {
        status,
        stdout,
        stderr,
    };
    Ok((output, tests))
}

#[cfg(test)]
mod tests {
    use super::group_of;

    #[test]
    fn groups_are_the_first_two_segments() {
        assert_eq!(group_of("wgpu::f16::causal"), "wgpu::f16");
        assert_eq!(group_of("ndarray::f32::masks::padding"), "ndarray::f32");
        assert_eq!(group_of("tests::parses"), "tests");
        assert_eq!(group_of("probe"), "");
    }
}
