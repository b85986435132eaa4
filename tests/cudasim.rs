//! The CUDA simulator's own checks (`cudasim/`): kernels that are wrong on purpose, each of which a GPU
//! would run and corrupt silently (or hang on), must end in a clear error that names the kernel, the
//! thread and what went wrong — and correct kernels that use barriers, shuffles and atomics must give
//! the values a GPU gives.
//!
//! Runs under the simulator (`cudasim/run cargo test --features cuda --test cudasim`, as CI does). On
//! a real GPU these kernels are not launched (they would corrupt its memory); without any CUDA
//! driver the tests say so and return, unless `NDSCOPE_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule, CudaStream, LaunchConfig, PushKernelArg};

const KERNELS: &str = r#"
extern "C" __global__ void fill(float* out, long long n, float v) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = v;
}
// Writes one element past the end of `out` (the bound is `<=`).
extern "C" __global__ void fill_past_the_end(float* out, long long n, float v) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = v;
}
extern "C" __global__ void copy(float* out, const float* in, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i];
}
// A block sum in shared memory; `sync` = 0 leaves out the barrier between the stores and the tree.
extern "C" __global__ void block_sum(float* out, const float* in, int sync) {
    __shared__ float buf[64];
    buf[threadIdx.x] = in[threadIdx.x];
    if (sync) __syncthreads();
    for (unsigned w = 32; w > 0; w /= 2) {
        if (threadIdx.x < w) buf[threadIdx.x] += buf[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = buf[0];
}
// Half the block returns before a barrier the other half waits at.
extern "C" __global__ void partial_barrier(float* out) {
    if (threadIdx.x >= 16) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
// A warp sum by butterfly shuffles over the full warp.
extern "C" __global__ void warp_sum(float* out, const float* in) {
    float x = in[threadIdx.x];
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    out[threadIdx.x] = x;
}
// Lanes 16-31 have left, but the shuffle's mask still names them.
extern "C" __global__ void shuffle_inactive(float* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_sync(0xffffffffu, (float)threadIdx.x, 20);
}
// Reads through a misaligned pointer.
extern "C" __global__ void misaligned(float* out, const char* in) {
    out[0] = *(const float*)(in + 2);
}
extern "C" __global__ void histogram(unsigned int* counts, const int* values, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counts[values[i]], 1u);
}
"#;

/// The simulator's context, stream and module of [`KERNELS`]; `None` (with the reason printed) where
/// the simulator is not what answers.
fn simulator() -> Option<(Arc<CudaStream>, Arc<CudaModule>)> {
    let required = std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1");
    // SAFETY: a load attempt of the driver library only.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        assert!(
            !required,
            "NDSCOPE_REQUIRE_GPU=1, but no CUDA driver (or simulator) loads"
        );
        eprintln!("skipping: no CUDA driver; run under cudasim/run");
        return None;
    }
    let ctx = CudaContext::new(0).expect("a context on device 0");
    let name = ctx.name().expect("the device's name");
    if !name.contains("simulator") {
        eprintln!("skipping: {name} is a real GPU, and these kernels are broken on purpose");
        return None;
    }
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("the test kernels compile");
    let module = ctx.load_module(ptx).expect("the test kernels load");
    Some((ctx.default_stream(), module))
}

fn grid(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The error text of a launch that must fail.
fn failure(
    r: Result<
        Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
        cudarc::driver::DriverError,
    >,
) -> String {
    match r {
        Ok(_) => panic!("the launch should have failed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn correct_kernels_give_what_a_gpu_gives() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    // A grid of several blocks, and a copy through a second buffer.
    let mut a = stream.alloc_zeros::<f32>(1000).unwrap();
    let mut b = stream.alloc_zeros::<f32>(1000).unwrap();
    let fill = module.load_function("fill").unwrap();
    let n = 1000i64;
    let mut l = stream.launch_builder(&fill);
    l.arg(&mut a).arg(&n).arg(&2.5f32);
    // SAFETY: `fill` takes (float*, long long, float) and writes its first `n` elements.
    unsafe { l.launch(grid(4, 256)) }.unwrap();
    let copy = module.load_function("copy").unwrap();
    let mut l = stream.launch_builder(&copy);
    l.arg(&mut b).arg(&a).arg(&n);
    // SAFETY: both buffers hold `n` floats.
    unsafe { l.launch(grid(4, 256)) }.unwrap();
    assert_eq!(stream.clone_dtoh(&b).unwrap(), vec![2.5f32; 1000]);

    // Barriers: a block's tree sum.
    let input: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let x = stream.clone_htod(&input).unwrap();
    let mut out = stream.alloc_zeros::<f32>(1).unwrap();
    let sum = module.load_function("block_sum").unwrap();
    let mut l = stream.launch_builder(&sum);
    l.arg(&mut out).arg(&x).arg(&1i32);
    // SAFETY: 64 threads read 64 inputs and thread 0 writes one output.
    unsafe { l.launch(grid(1, 64)) }.unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![2016.0]);

    // Shuffles: every lane gets the warp's sum.
    let input: Vec<f32> = (0..32).map(|i| i as f32).collect();
    let x = stream.clone_htod(&input).unwrap();
    let mut out = stream.alloc_zeros::<f32>(32).unwrap();
    let warp = module.load_function("warp_sum").unwrap();
    let mut l = stream.launch_builder(&warp);
    l.arg(&mut out).arg(&x);
    // SAFETY: one warp reads and writes 32 floats.
    unsafe { l.launch(grid(1, 32)) }.unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![496.0; 32]);

    // Atomics: a histogram of 3000 values over 3 blocks.
    let values: Vec<i32> = (0..3000).map(|i| i * 7 % 10).collect();
    let v = stream.clone_htod(&values).unwrap();
    let mut counts = stream.alloc_zeros::<u32>(10).unwrap();
    let hist = module.load_function("histogram").unwrap();
    let n = 3000i64;
    let mut l = stream.launch_builder(&hist);
    l.arg(&mut counts).arg(&v).arg(&n);
    // SAFETY: the values index the 10 counts.
    unsafe { l.launch(grid(3, 1024)) }.unwrap();
    assert_eq!(stream.clone_dtoh(&counts).unwrap(), vec![300u32; 10]);
}

#[test]
fn a_write_past_the_end_names_the_kernel_the_thread_and_the_allocation() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    let mut a = stream.alloc_zeros::<f32>(100).unwrap();
    let f = module.load_function("fill_past_the_end").unwrap();
    let n = 100i64;
    let mut l = stream.launch_builder(&f);
    l.arg(&mut a).arg(&n).arg(&1.0f32);
    // SAFETY: not safe on a GPU (it writes one float past the buffer); the simulator stops it.
    let text = failure(unsafe { l.launch(grid(1, 128)) });
    for part in [
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "kernel `fill_past_the_end`",
        "block (0,0,0), thread (100,0,0)",
        "writes 4 bytes",
        "0 bytes past the end of the 400-byte allocation",
    ] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
}

#[test]
fn reading_memory_never_written_is_an_error() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    // SAFETY: the memory is never read on the host; the kernel below reads it, which is the error.
    let x = unsafe { stream.alloc::<f32>(64) }.unwrap();
    let mut out = stream.alloc_zeros::<f32>(64).unwrap();
    let copy = module.load_function("copy").unwrap();
    let n = 64i64;
    let mut l = stream.launch_builder(&copy);
    l.arg(&mut out).arg(&x).arg(&n);
    // SAFETY: both buffers hold 64 floats; the input was never written.
    let text = failure(unsafe { l.launch(grid(1, 64)) });
    assert!(
        text.contains("kernel `copy`") && text.contains("was never written"),
        "{text}"
    );
}

#[test]
fn a_missing_barrier_changes_the_result() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    let input: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let x = stream.clone_htod(&input).unwrap();
    let sum = module.load_function("block_sum").unwrap();
    // Two blocks in a row: the second sees the first block's shared memory if it reads too early.
    let mut out = stream.alloc_zeros::<f32>(1).unwrap();
    let mut l = stream.launch_builder(&sum);
    l.arg(&mut out).arg(&x).arg(&0i32);
    // SAFETY: as in the correct case; only the barrier is missing.
    unsafe { l.launch(grid(1, 64)) }.unwrap();
    let racy = stream.clone_dtoh(&out).unwrap()[0];
    assert_ne!(
        racy, 2016.0,
        "without the barrier, thread 0 combines values not yet stored"
    );
}

/// Launches `kernel(float* out)`, wrong on purpose, on one warp with 32 floats of output, and returns
/// the error the simulator stops it with.
fn one_warp_failure(stream: &Arc<CudaStream>, module: &Arc<CudaModule>, kernel: &str) -> String {
    let mut out = stream.alloc_zeros::<f32>(32).unwrap();
    let f = module.load_function(kernel).unwrap();
    let mut l = stream.launch_builder(&f);
    l.arg(&mut out);
    // SAFETY: not safe on a GPU (the kernels passed here misuse barriers or shuffles); the simulator
    // stops them before anything but `out` is written.
    failure(unsafe { l.launch(grid(1, 32)) })
}

#[test]
fn a_barrier_part_of_the_block_never_reaches_is_an_error() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    // A barrier in divergent code: a GPU hangs or goes on with half the block.
    let text = one_warp_failure(&stream, &module, "partial_barrier");
    assert!(
        text.contains("kernel `partial_barrier`")
            && text.contains("__syncthreads")
            && text.contains("reached by 16 of the")
            && text.contains("32 threads"),
        "{text}"
    );
}

#[test]
fn a_shuffle_naming_an_exited_lane_is_an_error() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    // A GPU returns an undefined value.
    let text = one_warp_failure(&stream, &module, "shuffle_inactive");
    assert!(
        text.contains("kernel `shuffle_inactive`")
            && text.contains("names lane 16, which has exited"),
        "{text}"
    );
}

#[test]
fn misaligned_and_host_accesses_are_errors() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    let bytes = stream.clone_htod(&[0u8; 16]).unwrap();
    let mut out = stream.alloc_zeros::<f32>(1).unwrap();
    let f = module.load_function("misaligned").unwrap();
    let mut l = stream.launch_builder(&f);
    l.arg(&mut out).arg(&bytes);
    // SAFETY: not safe on a GPU (a misaligned load); the simulator stops it.
    let text = failure(unsafe { l.launch(grid(1, 1)) });
    assert!(
        text.contains("CUDA_ERROR_MISALIGNED_ADDRESS") && text.contains("not aligned to 4 bytes"),
        "{text}"
    );

    // A host pointer where a device pointer belongs.
    let host = vec![1.0f32; 64];
    let host_address = host.as_ptr() as u64;
    let copy = module.load_function("copy").unwrap();
    let n = 64i64;
    let mut l = stream.launch_builder(&copy);
    l.arg(&mut out).arg(&host_address).arg(&n);
    // SAFETY: not safe on a GPU (a host address); the simulator stops it before any write.
    let text = failure(unsafe { l.launch(grid(1, 1)) });
    assert!(
        text.contains("which is host memory, not device memory"),
        "{text}"
    );
}

#[test]
fn launches_beyond_the_limits_are_refused() {
    let Some((stream, module)) = simulator() else {
        return;
    };
    let mut a = stream.alloc_zeros::<f32>(4096).unwrap();
    let f = module.load_function("fill").unwrap();
    let n = 4096i64;
    for (config, expected) in [
        (grid(1, 2048), "exceeds the limits"),
        (grid(0, 32), "an empty grid or block"),
        (
            LaunchConfig {
                grid_dim: (1, 70000, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            },
            "grid (1,70000,1)",
        ),
        (
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 64 << 10,
            },
            "dynamic shared memory",
        ),
    ] {
        let mut l = stream.launch_builder(&f);
        l.arg(&mut a).arg(&n).arg(&0.0f32);
        // SAFETY: the launch is refused before any thread runs.
        let text = failure(unsafe { l.launch(config) });
        assert!(
            text.contains("kernel `fill`") && text.contains(expected),
            "{expected:?}: {text}"
        );
    }
}
