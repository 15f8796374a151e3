//! NVRTC on the CPU: the library cubecl-cuda loads (through cudarc's dynamic loading, found on
//! `LD_LIBRARY_PATH`), the CUDA headers it bundles, and one compile with ptxas's resource
//! report.

use std::ffi::{CStr, CString, c_char, c_int, c_uint};
use std::path::Path;
use std::time::Instant;

use cudarc::nvrtc::{result, sys};

/// What ptxas reports for an entry function (`--ptxas-options=-v`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
    /// Bytes of stack frame.
    pub stack: u32,
    /// Bytes of static shared memory.
    pub static_smem: u32,
    /// Named barriers.
    pub barriers: u32,
}

/// A compile's outcome: the resources of the entry function and the wall time, or the log.
pub type Compiled = Result<(Resources, f64), String>;

/// NVRTC's version, `(major, minor)`; an error names what is missing where the library is not
/// found.
pub fn version() -> Result<(i32, i32), String> {
    // SAFETY: `is_culib_present` only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "libnvrtc was not found on LD_LIBRARY_PATH (`cargo xtask cuda-check` installs it \
             from NVIDIA's `nvidia-cuda-nvrtc` wheel)"
                .into(),
        );
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// Extracts the CUDA headers NVRTC bundles (13.x: `nvrtcInstallBundledHeaders`) into `dir`
/// (`dir` then holds what a toolkit's `include/` holds, CCCL under `cccl/`); nothing is done
/// when that version is already there.
pub fn install_headers(dir: &Path) -> Result<(), String> {
    type Install = unsafe extern "C" fn(*const c_char, c_uint, *mut *const c_char) -> c_int;
    let path = CString::new(dir.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: the symbol has the C signature of `nvrtc.h` (CUDA 13.x); `path` outlives the
    // call and the log pointer is only read when set.
    unsafe {
        let lib = sys::culib();
        let install = lib
            .get::<Install>(b"nvrtcInstallBundledHeaders\0")
            .map_err(|_| {
                "this NVRTC bundles no headers (nvrtcInstallBundledHeaders is CUDA 13.x's)"
                    .to_string()
            })?;
        let mut log: *const c_char = std::ptr::null();
        let status = install(path.as_ptr(), 0, &mut log);
        if status != 0 {
            let why = if log.is_null() {
                String::new()
            } else {
                CStr::from_ptr(log).to_string_lossy().into_owned()
            };
            return Err(format!("nvrtcInstallBundledHeaders: status {status} {why}"));
        }
    }
    Ok(())
}

/// Compiles `source` with `options` (the runtime's, plus `--ptxas-options=-v`) and reads the
/// resources of `entry` from the log.
pub fn compile(source: &str, entry: &str, options: &[String]) -> Compiled {
    let src = CString::new(source).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let program = result::create_program(&src, None).map_err(|e| format!("{e:?}"))?;
    // SAFETY: `program` was created above and is destroyed once, below.
    let (ok, log) = unsafe {
        let ok = result::compile_program(program, options).is_ok();
        let log = result::get_program_log(program).map_err(|e| format!("{e:?}"))?;
        let _ = result::destroy_program(program);
        (ok, log)
    };
    let ms = start.elapsed().as_secs_f64() * 1e3;
    // SAFETY: the log is a NUL-terminated C string.
    let log = unsafe { CStr::from_ptr(log.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    if !ok {
        return Err(log);
    }
    let resources = parse(&log, entry)
        .ok_or_else(|| format!("ptxas reported nothing for entry `{entry}`; its log:\n{log}"))?;
    Ok((resources, ms))
}

/// The number before `unit` in `text` (`"8 registers"` → 8 for `"registers"`).
fn before(text: &str, unit: &str) -> Option<u32> {
    let at = text.find(unit)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

/// The resources ptxas printed for `entry` (`-v`): its "Function properties" line (stack,
/// spills) and its "Used N registers" line (barriers, static shared memory).
pub fn parse(log: &str, entry: &str) -> Option<Resources> {
    let mut lines = log.lines().skip_while(|l| {
        !(l.contains("Compiling entry function") && l.contains(&format!("'{entry}'")))
    });
    lines.next()?;
    let mut r = Resources::default();
    let mut seen = false;
    for line in lines {
        if line.contains("Compiling entry function") {
            break;
        }
        if line.contains("bytes stack frame") {
            r.stack = before(line, "bytes stack frame")?;
            r.spill_stores = before(line, "bytes spill stores")?;
            r.spill_loads = before(line, "bytes spill loads")?;
        } else if line.contains("Used") && line.contains("registers") {
            r.registers = before(line, "registers")?;
            r.barriers = before(line, "barriers").unwrap_or(0);
            r.static_smem = before(line, "bytes smem").unwrap_or(0);
            seen = true;
        }
    }
    seen.then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    // A log of NVRTC 13.5 for sm_90a with a device function before the entry's block.
    const LOG: &str = "ptxas info    : 3275 bytes gmem
ptxas info    : Compiling entry function 'other' for 'sm_90a'
ptxas info    : Function properties for other
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers
ptxas info    : Compiling entry function 'flash' for 'sm_90a'
ptxas info    : Function properties for flash
ptxas         .     48 bytes stack frame, 44 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 16400 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 4.490 ms
";

    #[test]
    fn reads_the_entrys_block() {
        let r = parse(LOG, "flash").expect("entry found");
        assert_eq!(
            r,
            Resources {
                registers: 168,
                spill_stores: 44,
                spill_loads: 40,
                stack: 48,
                static_smem: 16400,
                barriers: 1,
            }
        );
        assert_eq!(parse(LOG, "other").map(|r| r.registers), Some(12));
        assert_eq!(parse(LOG, "fla"), None, "an entry is matched whole");
        assert_eq!(parse(LOG, "missing"), None);
    }
}
