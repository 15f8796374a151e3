//! CUDA without a GPU: [`TargetRuntime`] is a cubecl runtime whose compiler is cubecl-cuda's
//! (`CudaCompiler`) and whose device is a stated architecture ([`Arch`]) instead of a GPU.
//! Every launch function of this crate runs on it unchanged — validation, plan, kernel choice,
//! comptime configuration, vector widths, the hand-written Hopper sources — and each launch
//! is compiled to CUDA C++ exactly as `cubecl-cuda`'s context compiles it before NVRTC, then
//! recorded ([`take_launches`]) instead of run. `cargo xtask cuda-check` feeds the recorded
//! sources to NVRTC for each architecture (`crates/cuda-check`).
//!
//! What is real and what is assumed (read from `cubecl-cuda-0.10.0/src/runtime.rs` and
//! `compute/context.rs`):
//! - the device properties and compilation options are built per compute capability by the
//!   same rules as `CudaServer::init` ([`properties`]), including the `wmma`/`mma`
//!   combinations cubecl's CUDA `wmma` compiler registers for that architecture;
//! - what `CudaServer::init` reads from a device is assumed per architecture ([`Arch`]): the
//!   opt-in shared memory per block, the SM count, the total memory; warp size 32, 1024
//!   threads per block, grid limits (2³¹ − 1, 65535, 65535);
//! - allocations are pitched on 512 bytes, as on a GPU ([`PitchedMemoryLayoutPolicy`]), so
//!   strides and the plans' alignment tests see what they see there;
//! - memory holds nothing: reads return zeros, and nothing runs.

mod properties;

pub use properties::{ARCHS, Arch, compilation_options, properties};

use std::sync::{Arc, Mutex};

use cubecl::bytes::Bytes;
use cubecl::cuda::CudaCompiler;
use cubecl::device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::future::DynFut;
use cubecl::ir::TargetProperties;
use cubecl::prelude::*;
use cubecl::profile::ProfileDuration;
use cubecl::server::{
    Binding, ComputeServer, CopyDescriptor, ExecutionMode, KernelArguments, ProfileError,
    ProfilingToken, ServerCommunication, ServerError, ServerUtilities,
};
use cubecl::stream_id::StreamId;
use cubecl::zspace::{Shape, Strides, striding::has_pitched_row_major_strides};
use cubecl::{CubeTask, MemoryUsage};
use cubecl_runtime::allocator::PitchedMemoryLayoutPolicy;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryAllocationMode};
use cubecl_runtime::storage::{ComputeStorage, ManagedResource, StorageHandle, StorageId};
use cubecl_runtime::timestamp_profiler::TimestampProfiler;

/// A launch as the target device received it, compiled to CUDA C++.
#[derive(Debug, Clone)]
pub struct TargetLaunch {
    /// The architecture it was compiled for.
    pub arch: Arch,
    /// The kernel's `extern "C" __global__` entry point.
    pub entry: String,
    /// The kernel's type name (`#[cube]` kernels) or entry point (hand-written ones).
    pub name: &'static str,
    /// The kernel's identity (name, comptime arguments, cube dim, mode) as cubecl's caches key it.
    pub id: String,
    /// The source NVRTC gets, as `cubecl-cuda` passes it.
    pub source: String,
    /// Threads per cube.
    pub cube_dim: CubeDim,
    /// Dynamic shared memory of the launch, bytes (what the context passes to `cuLaunchKernel`).
    pub shared_bytes: usize,
    /// Cubes launched.
    pub cubes: (u32, u32, u32),
    /// What the context would refuse before NVRTC: cube dim, units or shared memory over the
    /// device's limits, or a compilation error of cubecl's CUDA compiler; or what the launch
    /// would get wrong: arguments bound against an entry point that takes another number of
    /// parameters ([`arguments`]).
    pub refused: Option<String>,
}

/// The kernel parameters `cubecl-cuda` passes for `args` (its server's launch and
/// `CudaContext::execute_task`): each TMA map by value, then a pointer to each map's buffer,
/// then one per buffer, then the scalars and metadata — with grid constants always a struct by
/// value (and a pointer to the dynamic metadata where there is some), else a pointer where there
/// are any.
pub fn arguments(args: &KernelArguments, grid_constants: bool) -> usize {
    let info = &args.info;
    let info_params = if grid_constants {
        1 + usize::from(info.dynamic_metadata_offset < info.data.len())
    } else {
        usize::from(!info.data.is_empty())
    };
    2 * args.tensor_maps.len() + args.buffers.len() + info_params
}

/// The lines of a CUDA `source` the preprocessor keeps, comments left out, each with whether
/// that is certain: `#if NAME` / `#else` / `#endif` are followed where `NAME` is a
/// `#define NAME <integer>` seen before (as the variants' defines are); the lines under any
/// other condition are kept on both branches and marked uncertain.
fn preprocessed(source: &str) -> Vec<(&str, bool)> {
    let mut values = std::collections::HashMap::new();
    // Per open `#if`: whether its lines are kept, and whether that is known.
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let mut lines = Vec::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let active = stack.iter().all(|&(kept, _)| kept);
        let certain = stack.iter().all(|&(_, known)| known);
        let directive = code.trim_start().strip_prefix('#').map(str::trim_start);
        match directive.map(|d| d.split_once(char::is_whitespace).unwrap_or((d, ""))) {
            Some(("if", cond)) => {
                let value = cond
                    .trim()
                    .parse::<i64>()
                    .ok()
                    .or_else(|| values.get(cond.trim()).copied());
                stack.push(value.map_or((true, false), |v| (v != 0, true)));
            }
            Some(("ifdef" | "ifndef", _)) => stack.push((true, false)),
            Some(("elif", _)) => {
                if let Some(top) = stack.last_mut() {
                    *top = (true, false);
                }
            }
            Some(("else", _)) => {
                if let Some(top) = stack.last_mut() {
                    top.0 = !top.0 || !top.1;
                }
            }
            Some(("endif", _)) => {
                stack.pop();
            }
            Some(("define", rest)) if active => {
                let mut words = rest.split_whitespace();
                if let (Some(name), Some(value)) = (words.next(), words.next()) {
                    match value.parse::<i64>() {
                        Ok(v) if certain => {
                            values.insert(name, v);
                        }
                        _ => {
                            values.remove(name);
                        }
                    }
                }
            }
            Some(_) => {}
            None if active => lines.push((code, certain)),
            None => {}
        }
    }
    lines
}

/// The number of parameters of `entry`'s definition in a CUDA `source` (`None` where it is not
/// found, or its parameter list lies under a condition `preprocessed` cannot follow): the
/// top-level commas of its parameter list, comments and the lines the preprocessor drops left
/// out.
pub fn entry_parameters(source: &str, entry: &str) -> Option<usize> {
    let lines = preprocessed(source);
    let code: String = lines.iter().map(|(l, _)| *l).collect::<Vec<_>>().join("\n");
    let at = code
        .match_indices(entry)
        .map(|(i, _)| i + entry.len())
        .find(|&i| code[i..].trim_start().starts_with('('))?;
    let open = at + code[at..].find('(')?;
    let (mut depth, mut commas, mut empty) = (0usize, 0usize, true);
    let mut close = None;
    for (i, ch) in code[open..].char_indices() {
        match ch {
            '(' | '<' | '[' | '{' => depth += 1,
            ')' | '>' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            ',' if depth == 1 => commas += 1,
            c if depth >= 1 && !c.is_whitespace() => empty = false,
            _ => {}
        }
    }
    let close = close?;
    // The line numbers of the list's first and last characters: all of them certain.
    let (first, last) = (
        code[..open].matches('\n').count(),
        code[..close].matches('\n').count(),
    );
    lines[first..=last]
        .iter()
        .all(|&(_, certain)| certain)
        .then_some(if empty { 0 } else { commas + 1 })
}

static LAUNCHES: Mutex<Vec<TargetLaunch>> = Mutex::new(Vec::new());

/// Every launch recorded since the last call, in launch order (all architectures).
pub fn take_launches() -> Vec<TargetLaunch> {
    std::mem::take(&mut *LAUNCHES.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The device of [`TargetRuntime`]: one architecture.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub struct TargetDevice {
    /// Its architecture.
    pub arch: Arch,
}

impl Default for TargetDevice {
    fn default() -> Self {
        Self { arch: ARCHS[0] }
    }
}

impl Device for TargetDevice {
    fn from_id(id: DeviceId) -> Self {
        let arch = ARCHS
            .into_iter()
            .find(|a| u16::try_from(a.cc).is_ok_and(|cc| cc == id.index_id))
            .unwrap_or_else(|| panic!("no target architecture has compute capability {id:?}"));
        Self { arch }
    }

    fn to_id(&self) -> DeviceId {
        DeviceId {
            type_id: 0,
            index_id: self.arch.cc as u16,
        }
    }
}

/// A cubecl runtime that compiles with cubecl-cuda's compiler for a stated architecture and
/// records the launches instead of running them (module docs).
#[derive(Debug, Clone)]
pub struct TargetRuntime;

impl TargetRuntime {
    /// The client of `arch`'s target device.
    pub fn client_of(arch: Arch) -> ComputeClient<Self> {
        ComputeClient::load(&TargetDevice { arch })
    }
}

impl Runtime for TargetRuntime {
    type Compiler = CudaCompiler;
    type Server = TargetServer;
    type Device = TargetDevice;

    fn client(device: &Self::Device) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    fn name(_client: &ComputeClient<Self>) -> &'static str {
        "cuda"
    }

    fn require_array_lengths() -> bool {
        true
    }

    fn max_cube_count() -> (u32, u32, u32) {
        cubecl::cuda::CudaRuntime::max_cube_count()
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        has_pitched_row_major_strides(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        cubecl::cuda::CudaRuntime::target_properties()
    }

    fn enumerate_devices(_: u16, _: &()) -> Vec<DeviceId> {
        ARCHS
            .into_iter()
            .map(|arch| TargetDevice { arch }.to_id())
            .collect()
    }
}

/// The storage of a [`TargetServer`]: the server never allocates (it has no memory to give).
#[derive(Debug)]
pub struct NoStorage;

impl ComputeStorage for NoStorage {
    type Resource = ();

    fn alignment(&self) -> usize {
        512
    }

    fn get(&mut self, _: &StorageHandle) {}

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, cubecl::server::IoError> {
        Err(cubecl::server::IoError::BufferTooBig {
            size,
            backtrace: Default::default(),
        })
    }

    fn dealloc(&mut self, _: StorageId) {}

    fn flush(&mut self) {}
}

/// The server of a [`TargetDevice`]: compiles what it is given to launch, keeps nothing.
#[derive(Debug)]
pub struct TargetServer {
    arch: Arch,
    options: cubecl_cpp::shared::CompilationOptions,
    utilities: Arc<ServerUtilities<Self>>,
    timestamps: TimestampProfiler,
}

impl DeviceService for TargetServer {
    fn init(id: DeviceId) -> Self {
        let arch = TargetDevice::from_id(id).arch;
        let props = properties(arch);
        let policy = PitchedMemoryLayoutPolicy::new(props.memory.alignment as usize);
        let utilities = ServerUtilities::new(props, Arc::new(ServerLogger::default()), (), policy);
        Self {
            arch,
            options: compilation_options(arch),
            utilities: Arc::new(utilities),
            timestamps: TimestampProfiler::default(),
        }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

impl ServerCommunication for TargetServer {
    const SERVER_COMM_ENABLED: bool = false;
}

impl TargetServer {
    /// What `cubecl-cuda`'s `CudaContext::compile_kernel` does before NVRTC: the cube dim and
    /// units against the device, the task compiled with the context's options, the shared
    /// memory against the device.
    fn compile(&self, kernel: &dyn CubeTask<CudaCompiler>, mode: ExecutionMode) -> TargetLaunch {
        let mut id = kernel.id();
        id.mode(mode);
        let props = &self.utilities.properties;
        let mut launch = TargetLaunch {
            arch: self.arch,
            entry: String::new(),
            name: kernel.name(),
            id: format!("{id}"),
            source: String::new(),
            cube_dim: id.cube_dim,
            shared_bytes: 0,
            cubes: (0, 0, 0),
            refused: None,
        };
        let checked = cubecl_runtime::validation::validate_cube_dim(props, &id)
            .and_then(|()| cubecl_runtime::validation::validate_units(props, &id));
        if let Err(e) = checked {
            launch.refused = Some(format!("{e:?}"));
            return launch;
        }
        match kernel.compile(
            &mut Default::default(),
            &self.options,
            mode,
            kernel.address_type(),
        ) {
            Ok(compiled) => {
                launch.entry = compiled.entrypoint_name;
                launch.source = compiled.source;
                launch.cube_dim = compiled.cube_dim;
                launch.shared_bytes = compiled.repr.map_or(0, |r| r.shared_memory_size());
                let max = props.hardware.max_shared_memory_size;
                if launch.shared_bytes > max {
                    launch.refused = Some(format!(
                        "{} B of shared memory; the device has {max}",
                        launch.shared_bytes
                    ));
                }
            }
            Err(e) => launch.refused = Some(format!("{e:?}")),
        }
        launch
    }
}

impl ComputeServer for TargetServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Info = ();
    type MemoryLayoutPolicy = PitchedMemoryLayoutPolicy;
    type Storage = NoStorage;

    fn initialize_memory(&mut self, _: ManagedMemoryHandle, _: u64, _: StreamId) {}

    fn logger(&self) -> Arc<ServerLogger> {
        self.utilities.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        _: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        let bytes = descriptors
            .into_iter()
            .map(|d| Bytes::from_bytes_vec(vec![0; d.handle.size_in_used() as usize]))
            .collect();
        Box::pin(async move { Ok(bytes) })
    }

    fn write(&mut self, _: Vec<(CopyDescriptor, Bytes)>, _: StreamId) {}

    fn sync(&mut self, _: StreamId) -> DynFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }

    fn get_resource(
        &mut self,
        _: Binding,
        _: StreamId,
    ) -> Result<ManagedResource<()>, ServerError> {
        Err(ServerError::Generic {
            reason: "a CUDA target device holds no memory".into(),
            backtrace: Default::default(),
        })
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        args: KernelArguments,
        mode: ExecutionMode,
        _: StreamId,
    ) {
        let mut launch = self.compile(kernel.as_ref(), mode);
        if launch.refused.is_none() {
            let bound = arguments(&args, self.options.supports_features.grid_constants);
            match entry_parameters(&launch.source, &launch.entry) {
                Some(taken) if taken != bound => {
                    launch.refused = Some(format!(
                        "the launch binds {bound} parameters; `{}` takes {taken}",
                        launch.entry
                    ));
                }
                Some(_) => {}
                None => {
                    launch.refused = Some(format!(
                        "the parameters of `{}` not found in its source (or under a condition the check cannot follow)",
                        launch.entry
                    ));
                }
            }
        }
        launch.cubes = match count {
            CubeCount::Static(x, y, z) => (x, y, z),
            CubeCount::Dynamic(_) => (0, 0, 0),
        };
        LAUNCHES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(launch);
    }

    fn flush(&mut self, _: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn memory_usage(&mut self, _: StreamId) -> Result<MemoryUsage, ServerError> {
        Ok(MemoryUsage {
            number_allocs: 0,
            bytes_in_use: 0,
            bytes_padding: 0,
            bytes_reserved: 0,
        })
    }

    fn memory_cleanup(&mut self, _: StreamId) {}

    fn start_profile(&mut self, _: StreamId) -> Result<ProfilingToken, ServerError> {
        Ok(self.timestamps.start())
    }

    fn end_profile(
        &mut self,
        _: StreamId,
        token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        self.timestamps.stop(token)
    }

    fn allocation_mode(&mut self, _: MemoryAllocationMode, _: StreamId) {}
}

#[cfg(test)]
mod tests {
    use super::entry_parameters;

    /// Parameters are counted on the lines the preprocessor keeps under the variant's integer
    /// defines; a list under a condition the check cannot follow is not counted.
    #[test]
    fn entry_parameters_follow_the_defines() {
        let body = "extern \"C\" __global__ void k(const Map a, // one, (two)\n#if EXTRA\n const Map b,\n#endif\n float* c, const __grid_constant__ P p) {}\n";
        let with = |define: &str| format!("{define}#define N 3\n{body}");
        assert_eq!(entry_parameters(&with("#define EXTRA 1\n"), "k"), Some(4));
        assert_eq!(entry_parameters(&with("#define EXTRA 0\n"), "k"), Some(3));
        assert_eq!(entry_parameters(&with("#define EXTRA (1)\n"), "k"), None);
        assert_eq!(entry_parameters(&with(""), "other"), None);
        let empty = "#if A && B\n#define X 1\n#endif\nextern \"C\" __global__ void k() {}\n";
        assert_eq!(entry_parameters(empty, "k"), Some(0));
    }
}
