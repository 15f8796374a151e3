//! The device properties and compilation options of a CUDA architecture, built by the rules
//! of `cubecl-cuda-0.10.0/src/runtime.rs` (`CudaServer::init`) from what a device would report.

use cubecl::cuda::CudaCompiler;
use cubecl::ir::features::{AtomicUsage, Plane, Tma, TypeUsage};
use cubecl::ir::{
    BarrierLevel, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType, SemanticType, StorageType, Type, VectorSize,
};
use cubecl::profile::TimingMethod;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, DialectWmmaCompiler, register_mma_features,
    register_scaled_mma_features, register_supported_types, register_wmma_features,
};
use cubecl_cpp::{cuda::CudaDialect, cuda::arch::CudaArchitecture};

/// cubecl-cuda's `wmma` compiler (its default, without the `ptx-wmma` feature).
type Wmma = cubecl_cpp::cuda::mma::CudaWmmaCompiler;

// `CudaCompiler` is `CppCompiler<CudaDialect<Wmma>>`: the type above is the one the runtime uses.
const _: fn(CudaCompiler) -> cubecl_cpp::shared::CppCompiler<CudaDialect<Wmma>> = |c| c;

/// A CUDA architecture and what a device of it reports, as the check assumes it (the GPU
/// named is the one whose limits are taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch {
    /// Compute capability, `10 · major + minor` (80, 86, 89, 90).
    pub cc: u32,
    /// `--gpu-architecture`, as `cubecl-cuda` writes it (`sm_{cc}a` from 90).
    pub nvrtc: &'static str,
    /// The GPU whose limits are assumed.
    pub gpu: &'static str,
    /// Opt-in shared memory per block, bytes (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`).
    pub max_shared: usize,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Total memory, bytes.
    pub memory: u64,
}

/// The architectures the kernels target: `mma.sync` from sm_80, Hopper's `wgmma` and TMA on
/// sm_90a.
pub const ARCHS: [Arch; 4] = [
    Arch {
        cc: 80,
        nvrtc: "sm_80",
        gpu: "A100",
        max_shared: 166_912,
        sms: 108,
        memory: 80 << 30,
    },
    Arch {
        cc: 86,
        nvrtc: "sm_86",
        gpu: "RTX 3090",
        max_shared: 101_376,
        sms: 82,
        memory: 24 << 30,
    },
    Arch {
        cc: 89,
        nvrtc: "sm_89",
        gpu: "RTX 4090",
        max_shared: 101_376,
        sms: 128,
        memory: 24 << 30,
    },
    Arch {
        cc: 90,
        nvrtc: "sm_90a",
        gpu: "H200",
        max_shared: 232_448,
        sms: 132,
        memory: 141 << 30,
    },
];

impl Arch {
    /// The architecture of compute capability `cc`, if it is a target.
    pub fn of(cc: u32) -> Option<Self> {
        ARCHS.into_iter().find(|a| a.cc == cc)
    }
}

impl core::fmt::Display for Arch {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.nvrtc)
    }
}

/// The compilation options `CudaServer::init` gives its context on `arch` (the CUDA version
/// is the one cubecl-cuda was built against, which decides `fast_tanh`).
pub fn compilation_options(arch: Arch) -> CompilationOptions {
    let cc = arch.cc;
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: cc >= 70,
            fast_tanh: cc >= 75 && cudarc::driver::sys::CUDA_VERSION >= 12080,
            clusters: cc >= 90,
            elect_sync: cc >= 90,
        },
    }
}

/// The device properties `CudaServer::init` registers for a device of `arch`.
pub fn properties(arch: Arch) -> DeviceProperties {
    let cc = arch.cc;
    let cuda_arch = CudaArchitecture { version: cc };
    let wmma = Wmma::supported_wmma_combinations(&cuda_arch);
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: cubecl::cuda::CUDA_MAX_BINDINGS,
        max_shared_memory_size: arch.max_shared,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(arch.sms),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: (!wmma.is_empty()).then_some(8),
        num_cpu_cores: None,
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties {
        max_page_size: arch.memory / 4,
        alignment: 512,
    };
    let mut p = DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    register_supported_types(&mut p);
    p.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    let atomic = |kind, vector| {
        Type::new(StorageType::Atomic(ElemType::Float(kind))).with_vector_size(vector)
    };
    p.register_atomic_type_usage(
        atomic(FloatKind::F64, 1),
        AtomicUsage::Add | AtomicUsage::LoadStore,
    );
    for vector in [1, 2] {
        p.register_atomic_type_usage(
            atomic(FloatKind::F16, vector),
            AtomicUsage::Add | AtomicUsage::LoadStore,
        );
    }
    p.register_semantic_type(SemanticType::Pipeline);
    p.register_type_usage(OpaqueType::Barrier(BarrierLevel::Unit), TypeUsage::Buffer);
    p.register_type_usage(OpaqueType::Barrier(BarrierLevel::Cube), TypeUsage::Buffer);
    p.features.plane.insert(Plane::Sync);
    for kind in [FloatKind::F16, FloatKind::BF16] {
        p.features
            .matmul
            .ldmatrix
            .insert(ElemType::Float(kind).into());
    }
    p.features.copy_async = true;
    if cc >= 89 {
        for kind in [FloatKind::E4M3, FloatKind::E5M2] {
            p.register_type_usage(
                ElemType::Float(kind),
                TypeUsage::Conversion | TypeUsage::Buffer,
            );
        }
    }
    if cc >= 90 {
        p.features.tma.insert(Tma::Base);
        p.register_semantic_type(SemanticType::TensorMap);
        p.features.cube_cluster = true;
        for kind in [FloatKind::F16, FloatKind::BF16] {
            p.features
                .matmul
                .stmatrix
                .insert(ElemType::Float(kind).into());
        }
        for vector in [2, 4] {
            p.register_atomic_type_usage(
                atomic(FloatKind::F32, vector),
                AtomicUsage::LoadStore | AtomicUsage::Add,
            );
        }
    }
    p.features.memory_reinterpret = true;
    p.features.alignment = true;
    p.features.plane.insert(Plane::Ops);
    p.features.plane.insert(Plane::NonUniformControlFlow);
    register_wmma_features(wmma, &mut p);
    register_mma_features(Wmma::supported_mma_combinations(&cuda_arch), &mut p);
    register_scaled_mma_features(Wmma::supported_scaled_mma_combinations(&cuda_arch), &mut p);
    p
}
