//! The door's first kernel: `out[i] = 2·a[i] + s` through Hopper's asynchronous machinery. Each
//! block's thread 0 (chosen with `elect.sync`) issues one TMA bulk copy (`cp.async.bulk`) of its
//! chunk of `a` into shared memory, completed on an `mbarrier` with a transaction count; every
//! thread waits on the barrier's phase, then computes from shared memory. `flags[0]` is set to
//! 1 when the sm_90a features were compiled in (`__CUDA_ARCH_FEAT_SM90_ALL`), `flags[1]` counts
//! the lanes `elect.sync` chose (one per warp). [`launch_wgmma`]: one `wgmma` product with both
//! operands read from shared memory through descriptors.

use super::CudaCompiled;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::task::HandWritten;

/// Threads per block (and `f32` elements per block).
pub const BLOCK: u32 = 256;

const ENTRY: &str = "burn_flash_hopper_door";

/// Dynamic shared memory: the barrier at 0, the chunk at 128.
const SHARED_BYTES: usize = 128 + BLOCK as usize * 4;

const SOURCE: &str = r#"
struct DoorParams { float s; unsigned int n; };

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

extern "C" __global__ void __launch_bounds__(256, 1)
burn_flash_hopper_door(const float* __restrict__ a, float* __restrict__ out,
                       unsigned int* __restrict__ flags, const __grid_constant__ DoorParams p)
{
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);
    float* chunk = reinterpret_cast<float*>(smem + 128);
    const unsigned int first = blockIdx.x * 256u;
    const unsigned int count = p.n - first < 256u ? p.n - first : 256u;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    unsigned int elected = 0;
    if (threadIdx.x < 32) {
        asm volatile("{\n\t.reg .pred e;\n\telect.sync _|e, 0xffffffff;\n\tselp.u32 %0, 1, 0, e;\n}"
                     : "=r"(elected));
    }
    if (elected) {
        const unsigned int bytes = count * 4u;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(chunk)), "l"(a + first), "r"(bytes), "r"(smem_addr(bar))
                     : "memory");
        atomicAdd(&flags[1], 1u);
    }
    unsigned int ready = 0;
    while (!ready) {
        asm volatile("{\n\t.reg .pred r;\n\tmbarrier.try_wait.parity.shared::cta.b64 r, [%1], 0;\n\tselp.u32 %0, 1, 0, r;\n}"
                     : "=r"(ready) : "r"(smem_addr(bar)) : "memory");
    }
    if (threadIdx.x < count) {
        out[first + threadIdx.x] = 2.0f * chunk[threadIdx.x] + p.s;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        flags[0] = 1u;
    }
#else
    if (threadIdx.x < count) {
        out[first + threadIdx.x] = 2.0f * a[first + threadIdx.x] + p.s;
    }
#endif
}
"#;

/// Why the door kernel was not launched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DoorError {
    /// The device is not a Hopper GPU.
    NotHopper,
    /// `n` is not a multiple of 4 (bulk copies move 16-byte multiples).
    Length(usize),
    /// `a` does not start on 16 bytes (bulk copies read 16-byte aligned chunks).
    Misaligned,
    /// A buffer holds fewer bytes than the launch touches.
    Buffer {
        /// Which buffer.
        arg: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes it has.
        got: u64,
    },
}

impl core::fmt::Display for DoorError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotHopper => f.write_str("the door kernel needs a Hopper GPU (sm_90)"),
            Self::Length(n) => write!(f, "n = {n} is not a multiple of 4"),
            Self::Misaligned => f.write_str("`a` does not start on a 16-byte boundary"),
            Self::Buffer { arg, needed, got } => {
                write!(f, "`{arg}` holds {got} bytes, the launch touches {needed}")
            }
        }
    }
}

/// `out[i] = 2·a[i] + s` for `i < n` (f32 buffers of at least `n` elements, `n` a multiple of
/// 4), and `flags` (two `u32`, zeroed by the caller): `[sm90a compiled in, lanes elected]`.
/// Checks the device and the buffers before anything is launched.
pub fn launch<R: CudaCompiled>(
    client: &ComputeClient<R>,
    a: &Handle,
    out: &Handle,
    flags: &Handle,
    n: usize,
    s: f32,
) -> Result<(), DoorError> {
    if !super::sm90(client) {
        return Err(DoorError::NotHopper);
    }
    if !n.is_multiple_of(4) {
        return Err(DoorError::Length(n));
    }
    check_sizes(&[
        ("a", a, n as u64 * 4),
        ("out", out, n as u64 * 4),
        ("flags", flags, 8),
    ])?;
    if !a.offset_start.unwrap_or(0).is_multiple_of(16) {
        return Err(DoorError::Misaligned);
    }
    if n == 0 {
        return Ok(());
    }
    let kernel = HandWritten::new(
        client,
        SOURCE,
        ENTRY,
        CubeDim::new_1d(BLOCK),
        SHARED_BYTES,
        0,
    );
    let params = vec![(n as u64) << 32 | u64::from(s.to_bits())];
    let blocks = n.div_ceil(BLOCK as usize) as u32;
    // SAFETY: block `b` reads `a[256·b ..]` and writes `out[256·b ..]` below `n`, and two words
    // of `flags`; every buffer was checked to hold that.
    unsafe {
        kernel.launch(
            CubeCount::Static(blocks, 1, 1),
            vec![
                a.clone().binding(),
                out.clone().binding(),
                flags.clone().binding(),
            ],
            params,
        );
    }
    Ok(())
}

/// The first `wgmma` through the door: one warpgroup computes `out = A·B` for `A` 64 × 16 and
/// `B` 16 × 64 (f16, given as `Bᵀ` 64 × 16 row-major), f32 out 64 × 64 row-major, with
/// `wgmma.mma_async.m64n64k16` reading both operands from shared memory through descriptors
/// (no swizzle: 8 × 8 core matrices, 128 bytes between core matrices along K, 256 along M/N).
const WGMMA_SOURCE: &str = r#"
__device__ __forceinline__ unsigned int wg_smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// A shared-memory matrix descriptor without swizzle: `addr` the tile's start, `lbo` bytes
// between core matrices along K, `sbo` bytes between core matrices along M (or N).
__device__ __forceinline__ unsigned long long wg_desc(unsigned int addr, unsigned int lbo,
                                                      unsigned int sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4)
         | ((unsigned long long)(lbo >> 4) << 16)
         | ((unsigned long long)(sbo >> 4) << 32);
}

// Core matrices (8 rows x 16 bytes, 128 contiguous bytes) of a 64 x 16 K-major tile: core
// (row / 8, k / 8) at ((row / 8) * 2 + k / 8) * 128 bytes, so LBO = 128 and SBO = 256.
__device__ __forceinline__ unsigned int wg_core_offset(unsigned int row, unsigned int k) {
    return ((row >> 3) * 2u + (k >> 3)) * 128u + (row & 7u) * 16u + (k & 7u) * 2u;
}

extern "C" __global__ void __launch_bounds__(128, 1)
burn_flash_hopper_wgmma(const unsigned short* __restrict__ a, const unsigned short* __restrict__ bt,
                        float* __restrict__ out)
{
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* sa = smem;
    unsigned char* sb = smem + 2048;
    for (unsigned int i = threadIdx.x; i < 64u * 16u; i += 128u) {
        const unsigned int row = i / 16u, k = i % 16u;
        *reinterpret_cast<unsigned short*>(sa + wg_core_offset(row, k)) = a[i];
        *reinterpret_cast<unsigned short*>(sb + wg_core_offset(row, k)) = bt[i];
    }
    __syncthreads();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    const unsigned long long da = wg_desc(wg_smem_addr(sa), 128u, 256u);
    const unsigned long long db = wg_desc(wg_smem_addr(sb), 128u, 256u);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    // The accumulator layout: warp w holds rows 16w .. 16w + 15; lane l rows 16w + l / 4 and
    // + 8; register 4j + e of column block j at column 8j + 2 (l % 4) + (e % 2), row + 8 (e / 2).
    const unsigned int warp = threadIdx.x / 32u, lane = threadIdx.x % 32u;
    const unsigned int row = 16u * warp + lane / 4u;
    for (unsigned int j = 0; j < 8u; ++j) {
        const unsigned int col = 8u * j + 2u * (lane % 4u);
        out[row * 64u + col] = d[4 * j + 0];
        out[row * 64u + col + 1u] = d[4 * j + 1];
        out[(row + 8u) * 64u + col] = d[4 * j + 2];
        out[(row + 8u) * 64u + col + 1u] = d[4 * j + 3];
    }
#endif
}
"#;

/// `out = A·B` on one `wgmma` (the kernel of `WGMMA_SOURCE`): `a`, `bt` 64 × 16 f16 row-major
/// (`bt` is `Bᵀ`), `out` 64 × 64 f32 row-major. Checks the device and the buffers first.
pub fn launch_wgmma<R: CudaCompiled>(
    client: &ComputeClient<R>,
    a: &Handle,
    bt: &Handle,
    out: &Handle,
) -> Result<(), DoorError> {
    if !super::sm90(client) {
        return Err(DoorError::NotHopper);
    }
    check_sizes(&[
        ("a", a, 64 * 16 * 2),
        ("bt", bt, 64 * 16 * 2),
        ("out", out, 64 * 64 * 4),
    ])?;
    let mut source = WGMMA_SOURCE;
    if crate::mutation::wgmma_strides() {
        let swapped = WGMMA_SOURCE.replace("128u, 256u);", "256u, 128u);");
        source = Box::leak(swapped.into_boxed_str());
    }
    let kernel = HandWritten::new(
        client,
        source,
        "burn_flash_hopper_wgmma",
        CubeDim::new_1d(128),
        4096,
        0,
    );
    // SAFETY: one block reads 64 × 16 elements of `a` and `bt` and writes 64 × 64 of `out`,
    // which the checks above found there.
    unsafe {
        kernel.launch(
            CubeCount::Static(1, 1, 1),
            vec![
                a.clone().binding(),
                bt.clone().binding(),
                out.clone().binding(),
            ],
            vec![0],
        );
    }
    Ok(())
}

/// Each `(name, buffer, bytes)`: the buffer holds at least `bytes`.
fn check_sizes(buffers: &[(&'static str, &Handle, u64)]) -> Result<(), DoorError> {
    for &(arg, handle, needed) in buffers {
        if handle.size_in_used() < needed {
            return Err(DoorError::Buffer {
                arg,
                needed,
                got: handle.size_in_used(),
            });
        }
    }
    Ok(())
}
