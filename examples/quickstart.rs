//! burn-flash quick start: fused softmax (forward and backward) on the best device available —
//! CUDA when built with `--features cuda` and an NVIDIA GPU is present, else wgpu on a Vulkan
//! GPU, else Mesa's lavapipe on the CPU. Prints which one it used.
//!
//! `cargo run --release --example quickstart` (or `cargo xtask demo`, which also installs a
//! Vulkan driver if none is there).

use burn::backend::Autodiff;
use burn::tensor::{Distribution, ElementConversion, Tensor, activation};
use burn_flash::FlashBackend;

fn demo<B: FlashBackend>(device: &B::Device) {
    let x = Tensor::<B, 3>::random([8, 128, 1000], Distribution::Normal(0.0, 3.0), device);

    // Same signature as `burn::tensor::activation::softmax`: swap one import.
    let ours = burn_flash::softmax(x.clone(), 2);
    let burns = activation::softmax(x.clone(), 2);
    let diff = (ours.clone() - burns)
        .abs()
        .max()
        .into_scalar()
        .elem::<f32>();
    let row_sum = ours.sum_dim(2).mean().into_scalar().elem::<f32>();
    println!(
        "softmax      [8, 128, 1000]: max |burn-flash − burn| = {diff:.2e}, mean row sum = {row_sum:.6}"
    );

    let log = burn_flash::log_softmax(x.clone(), 1);
    let log_ref = activation::log_softmax(x.clone(), 1);
    let diff = (log - log_ref).abs().max().into_scalar().elem::<f32>();
    println!("log_softmax  over dim 1:     max |burn-flash − burn| = {diff:.2e}");

    // A fully masked row gives zeros, not NaN.
    let masked = Tensor::<B, 2>::full([2, 4], f32::NEG_INFINITY, device);
    let y = burn_flash::softmax(masked, 1);
    println!(
        "softmax of an all −inf row:  {:?}",
        y.into_data().to_vec::<f32>().unwrap()
    );
}

fn gradients<B: FlashBackend>(device: &B::Device) {
    type A<B> = Autodiff<B>;
    let x =
        Tensor::<A<B>, 2>::random([64, 512], Distribution::Normal(0.0, 2.0), device).require_grad();
    let w = Tensor::<A<B>, 2>::random([64, 512], Distribution::Default, device);
    let grads = (burn_flash::softmax(x.clone(), 1) * w.clone())
        .sum()
        .backward();
    let ours = x.grad(&grads).unwrap();
    let x2 = x.detach().require_grad();
    let grads = (activation::softmax(x2.clone(), 1) * w).sum().backward();
    let burns = x2.grad(&grads).unwrap();
    let diff = (ours - burns).abs().max().into_scalar().elem::<f32>();
    println!(
        "gradient     [64, 512]:      max |burn-flash − burn| = {diff:.2e} (fused backward kernel)"
    );
}

fn run<B: FlashBackend>(device: B::Device) {
    demo::<B>(&device);
    gradients::<B>(&device);
    B::sync(&device).expect("device sync");
}

#[cfg(feature = "cuda")]
fn try_cuda() -> bool {
    use burn::backend::{Cuda, cuda::CudaDevice};
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        println!("no NVIDIA device node: skipping CUDA");
        return false;
    }
    let probe = std::panic::catch_unwind(|| {
        let device = CudaDevice::default();
        Tensor::<Cuda, 1>::ones([4], &device)
            .sum()
            .into_scalar()
            .elem::<f32>()
    });
    match probe {
        Ok(_) => {
            println!("device: CUDA (NVIDIA GPU 0)");
            run::<Cuda>(CudaDevice::default());
            true
        }
        Err(_) => {
            println!("CUDA did not start: falling back to wgpu");
            false
        }
    }
}

#[cfg(feature = "wgpu")]
fn run_wgpu() {
    use burn::backend::{Wgpu, wgpu::WgpuDevice};
    use cubecl::wgpu::{AutoGraphicsApi, init_setup};
    let device = WgpuDevice::DefaultDevice;
    let setup = init_setup::<AutoGraphicsApi>(&device, Default::default());
    let info = setup.adapter.get_info();
    let kind = format!("{:?}", info.device_type);
    let what = if kind == "Cpu" {
        "Mesa lavapipe on the CPU"
    } else {
        "a GPU"
    };
    println!(
        "device: wgpu on {} ({kind}, {:?}) — {what}",
        info.name, info.backend
    );
    run::<Wgpu>(device);
}

fn main() {
    #[cfg(feature = "cuda")]
    if try_cuda() {
        return;
    }
    #[cfg(feature = "wgpu")]
    {
        run_wgpu();
        return;
    }
    #[allow(unreachable_code)]
    {
        println!("built without `wgpu` or `cuda`: nothing to run on");
    }
}
