//! [`HandWritten`]: a CUDA C++ source of ours as a cubecl kernel (the module docs of
//! [`crate::hopper`] give the contract).

use cubecl::cuda::CudaCompiler;

use super::CudaCompiled;
use cubecl::prelude::*;
use cubecl::server::{KernelArguments, MetadataBindingInfo, TensorMapBinding, TensorMapMeta};
use cubecl::zspace::metadata::Metadata;
use cubecl::zspace::{Shape, Strides};
use cubecl::{CompilationError, Compiler, CubeTask};

use crate::tensor::TensorRef;

/// The `#[cube]` shell whose compiled form gives a hand-written kernel its `repr`: it allocates
/// `words` 32-bit words of shared memory (touched, so that the optimiser keeps them), which is
/// what cubecl-cuda reads from the `repr` (the dynamic shared memory of the launch). Compiled,
/// never launched.
#[cube(launch_unchecked)]
fn shared_memory_shell(out: &mut Array<u32>, #[comptime] words: usize) {
    let mut smem = SharedMemory::<u32>::new(words);
    smem[UNIT_POS as usize] = UNIT_POS;
    sync_cube();
    out[UNIT_POS as usize] = smem[(UNIT_POS as usize + 1) % words];
}

/// A hand-written kernel: `source` (CUDA C++, inline PTX allowed) with the entry point `entry`
/// (`extern "C" __global__`), launched with `cube_dim` threads per block and `shared_bytes` of
/// dynamic shared memory (a multiple of 4). A variant's `#define`s go in `defines`, compiled
/// in front of `source`.
pub struct HandWritten<R: CudaCompiled> {
    /// The CUDA C++ source.
    pub source: &'static str,
    /// Text compiled in front of `source` (a variant's `#define`s); part of the `KernelId`.
    pub defines: String,
    /// Its `extern "C" __global__` function.
    pub entry: &'static str,
    /// Threads per block.
    pub cube_dim: CubeDim,
    /// Dynamic shared memory, bytes.
    pub shared_bytes: usize,
    /// Whatever else selects the compiled code (template constants written into `source` are
    /// covered by its hash); part of the `KernelId`.
    pub variant: u64,
    /// [`super::source_hash`] of `source`, computed once here rather than in every `id()`.
    source_hash: u64,
    client: ComputeClient<R>,
}

impl<R: CudaCompiled> HandWritten<R> {
    /// The kernel `entry` of `source` for `client`'s device.
    pub fn new(
        client: &ComputeClient<R>,
        source: &'static str,
        entry: &'static str,
        cube_dim: CubeDim,
        shared_bytes: usize,
        variant: u64,
    ) -> Self {
        let hash = super::source_hash(source);
        Self::new_hashed(client, source, hash, entry, cube_dim, shared_bytes, variant)
    }

    /// [`Self::new`] for a source whose [`super::source_hash`] is known (a `const` computed at
    /// compile time), so that a launch does not hash the source again.
    pub fn new_hashed(
        client: &ComputeClient<R>,
        source: &'static str,
        source_hash: u64,
        entry: &'static str,
        cube_dim: CubeDim,
        shared_bytes: usize,
        variant: u64,
    ) -> Self {
        Self {
            source,
            defines: String::new(),
            entry,
            cube_dim,
            shared_bytes,
            variant,
            source_hash,
            client: client.clone(),
        }
    }

    /// The same kernel compiled with `defines` in front of its source.
    pub fn with_defines(mut self, defines: &super::Defines) -> Self {
        self.source_hash ^= defines.key().rotate_left(1);
        self.defines = defines.text().to_owned();
        self
    }

    /// Launches the kernel on `count` blocks with `buffers` (in the order of the kernel's
    /// pointer parameters) and `params` (the bytes of its by-value parameter struct, as
    /// little-endian `u64` words).
    ///
    /// # Safety
    /// The kernel reads and writes only inside `buffers` for these `params` and `count`.
    pub unsafe fn launch(
        self,
        count: CubeCount,
        buffers: Vec<cubecl::server::Binding>,
        params: Vec<u64>,
    ) {
        // SAFETY: the caller's.
        unsafe { self.launch_with_maps(count, Vec::new(), buffers, params) }
    }

    /// [`Self::launch`] with TMA tensor maps: the kernel takes the maps first (each a
    /// `const __grid_constant__` 128-byte `CUtensorMap`, encoded by cubecl-cuda at launch from
    /// the map's shape, strides, box and swizzle), then a pointer to each map's buffer, then
    /// `buffers`, then the parameter struct.
    ///
    /// # Safety
    /// The kernel reads and writes only inside the maps' boxes and `buffers` for these `params`
    /// and `count`.
    pub unsafe fn launch_with_maps(
        self,
        count: CubeCount,
        maps: Vec<cubecl::server::TensorMapBinding>,
        buffers: Vec<cubecl::server::Binding>,
        params: Vec<u64>,
    ) {
        let client = self.client.clone();
        let words = params.len();
        let args = KernelArguments::new()
            .with_tensor_maps(maps)
            .with_buffers(buffers)
            .with_info(MetadataBindingInfo::new(params, words));
        // SAFETY: the caller's.
        unsafe { client.launch_unchecked(Box::new(self), count, args) }
    }
}

impl<R: CudaCompiled> KernelMetadata for HandWritten<R> {
    fn name(&self) -> &'static str {
        self.entry
    }

    fn id(&self) -> KernelId {
        KernelId::new::<Self>()
            .cube_dim(self.cube_dim)
            .address_type(AddressType::U32)
            .info((
                self.entry,
                self.source_hash,
                self.shared_bytes,
                self.variant,
            ))
    }

    fn address_type(&self) -> StorageType {
        AddressType::U32.unsigned_type()
    }
}

impl<R: CudaCompiled> CubeTask<CudaCompiler> for HandWritten<R> {
    fn compile(
        &self,
        compiler: &mut CudaCompiler,
        options: &<CudaCompiler as Compiler>::CompilationOptions,
        mode: ExecutionMode,
        address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        let settings = KernelSettings::default()
            .cube_dim(self.cube_dim)
            .address_type(AddressType::U32);
        let shell = shared_memory_shell::SharedMemoryShell::<R>::new(
            settings,
            self.client.clone(),
            ArrayCompilationArg { inplace: None },
            self.shared_bytes.div_ceil(4).max(1),
        );
        let mut kernel = KernelTask::<CudaCompiler, _>::new(shell).compile(
            compiler,
            options,
            mode,
            address_type,
        )?;
        kernel.source = format!("{}{}", self.defines, self.source);
        kernel.entrypoint_name = self.entry.to_string();
        kernel.debug_name = Some(self.entry);
        kernel.cube_dim = self.cube_dim;
        Ok(kernel)
    }
}

/// The TMA map of a `[B, H, S, D]` tensor of `dtype`: boxes of `rows` rows × 64 columns,
/// 128-byte swizzled (the layout `desc_sw128` of `sm90.cuh` describes), zeros past the ends.
pub fn tensor_map(t: &TensorRef<'_>, dtype: StorageType, rows: usize) -> TensorMapBinding {
    TensorMapBinding::new(
        t.handle.clone().binding(),
        TensorMapMeta {
            format: TensorMapFormat::Tiled(TiledArgs::new(Shape::from(vec![1usize, 1, rows, 64]))),
            metadata: Metadata::new(
                Shape::from(t.shape.to_vec()),
                Strides::from(t.strides.to_vec()),
            ),
            elem_stride: Strides::from(vec![1usize; 4]),
            interleave: TensorMapInterleave::None,
            swizzle: TensorMapSwizzle::B128,
            prefetch: TensorMapPrefetch::None,
            oob_fill: OobFill::Zero,
            storage_ty: dtype,
        },
    )
}
