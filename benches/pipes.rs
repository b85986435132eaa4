//! Which instructions the quantized and `bf16` kernels' inner loops compete for, on the CPU at hand:
//! eight independent 512-bit `vpdpbusd` a loop (the int8 dot products of `quant_strips`) alone,
//! then with four other instructions beside them. Where the loop takes as long as the eight alone,
//! the four ran on other execution pipes; where it takes 12/8 as long, they queued for the same
//! ones. Also the eight with their token bytes broadcast from memory (`{1to16}` operands, as the
//! strip kernels take them) and beside broadcast and 64-byte loads, `vpdpbusd`'s latency (one
//! chain) and `vdpbf16ps`' throughput (the `bf16` products' micro-kernel). Run with `cargo bench
//! --bench pipes`; x86-64 with AVX-512 VNNI and BF16 only.
//!
//! The figures are ratios to the first loop, so they do not depend on the clock; `ns` is per loop.

#[cfg(target_arch = "x86_64")]
mod loops {
    use std::arch::asm;

    /// Eight independent `vpdpbusd` into zmm0..zmm7.
    macro_rules! eight_dots {
        () => {
            concat!(
                "vpdpbusd zmm0, zmm8, zmm9\n",
                "vpdpbusd zmm1, zmm8, zmm9\n",
                "vpdpbusd zmm2, zmm8, zmm9\n",
                "vpdpbusd zmm3, zmm8, zmm9\n",
                "vpdpbusd zmm4, zmm8, zmm9\n",
                "vpdpbusd zmm5, zmm8, zmm9\n",
                "vpdpbusd zmm6, zmm8, zmm9\n",
                "vpdpbusd zmm7, zmm8, zmm9\n",
            )
        };
    }

    /// What the loops with memory operands read (through `rsi`): 64 bytes, in L1 after the first
    /// iteration.
    static BYTES: [u8; 64] = [1; 64];

    /// A loop of `iters` iterations of `$body` (zmm0..zmm13 clobbered; `rsi` points to `BYTES`).
    macro_rules! timed_loop {
        ($name:ident, $($body:expr),+) => {
            /// # Safety
            /// The CPU must have AVX-512 F, VNNI and BF16.
            pub unsafe fn $name(iters: u64) {
                // SAFETY: the caller's contract (the CPU runs these instructions); the loop
                // touches only the registers it declares clobbered and its counter, and reads
                // only the 64 bytes of `BYTES`.
                unsafe {
                    asm!(
                        "2:",
                        $($body,)+
                        "dec {i}",
                        "jnz 2b",
                        i = inout(reg) iters => _,
                        in("rsi") BYTES.as_ptr(),
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                        out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                        out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                        out("zmm12") _, out("zmm13") _,
                        options(nostack, readonly),
                    );
                }
            }
        };
    }

    timed_loop!(dots, eight_dots!());
    timed_loop!(
        dots_fma,
        eight_dots!(),
        "vfmadd231ps zmm10, zmm8, zmm9\nvfmadd231ps zmm11, zmm8, zmm9\n",
        "vfmadd231ps zmm12, zmm8, zmm9\nvfmadd231ps zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        dots_mul,
        eight_dots!(),
        "vmulps zmm10, zmm8, zmm9\nvmulps zmm11, zmm8, zmm9\n",
        "vmulps zmm12, zmm8, zmm9\nvmulps zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        dots_mullo,
        eight_dots!(),
        "vpmulld zmm10, zmm8, zmm9\nvpmulld zmm11, zmm8, zmm9\n",
        "vpmulld zmm12, zmm8, zmm9\nvpmulld zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        dots_convert,
        eight_dots!(),
        "vcvtdq2ps zmm10, zmm9\nvcvtdq2ps zmm11, zmm9\n",
        "vcvtdq2ps zmm12, zmm9\nvcvtdq2ps zmm13, zmm9\n"
    );
    timed_loop!(
        dots_add,
        eight_dots!(),
        "vaddps zmm10, zmm8, zmm9\nvaddps zmm11, zmm8, zmm9\n",
        "vaddps zmm12, zmm8, zmm9\nvaddps zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        dots_unpack,
        eight_dots!(),
        "vpandd zmm10, zmm8, zmm9\nvpsrlw zmm11, zmm8, 4\n",
        "vpandd zmm12, zmm8, zmm9\nvpsrlw zmm13, zmm8, 4\n"
    );
    timed_loop!(
        dots_broadcast,
        "vpdpbusd zmm0, zmm8, dword ptr [rsi]{{1to16}}\n",
        "vpdpbusd zmm1, zmm8, dword ptr [rsi + 4]{{1to16}}\n",
        "vpdpbusd zmm2, zmm8, dword ptr [rsi + 8]{{1to16}}\n",
        "vpdpbusd zmm3, zmm8, dword ptr [rsi + 12]{{1to16}}\n",
        "vpdpbusd zmm4, zmm8, dword ptr [rsi + 16]{{1to16}}\n",
        "vpdpbusd zmm5, zmm8, dword ptr [rsi + 20]{{1to16}}\n",
        "vpdpbusd zmm6, zmm8, dword ptr [rsi + 24]{{1to16}}\n",
        "vpdpbusd zmm7, zmm8, dword ptr [rsi + 28]{{1to16}}\n"
    );
    timed_loop!(
        dots_loads,
        eight_dots!(),
        "vpbroadcastd zmm10, dword ptr [rsi]\nvpbroadcastd zmm11, dword ptr [rsi + 4]\n",
        "vpbroadcastd zmm12, dword ptr [rsi + 8]\nvpbroadcastd zmm13, dword ptr [rsi + 12]\n",
        "vmovdqu64 zmm10, [rsi]\nvmovdqu64 zmm11, [rsi]\n"
    );
    timed_loop!(
        one_chain,
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n",
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n",
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n",
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n"
    );
    timed_loop!(
        bf16_dots,
        "vdpbf16ps zmm0, zmm8, zmm9\nvdpbf16ps zmm1, zmm8, zmm9\n",
        "vdpbf16ps zmm2, zmm8, zmm9\nvdpbf16ps zmm3, zmm8, zmm9\n",
        "vdpbf16ps zmm4, zmm8, zmm9\nvdpbf16ps zmm5, zmm8, zmm9\n",
        "vdpbf16ps zmm6, zmm8, zmm9\nvdpbf16ps zmm7, zmm8, zmm9\n"
    );
}

/// A timed loop: its iteration count in, run on a CPU with AVX-512 F, VNNI and BF16.
#[cfg(target_arch = "x86_64")]
type Loop = unsafe fn(u64);

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    let has = |f: &str| match f {
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
        _ => is_x86_feature_detected!("avx512bf16"),
    };
    if !["avx512f", "avx512vnni", "avx512bf16"]
        .iter()
        .all(|f| has(f))
    {
        println!("pipes: not run: this CPU lacks AVX-512 F, VNNI or BF16");
        return;
    }
    const ITERS: u64 = 100_000_000;
    // The best of five runs of each loop, in ns per iteration.
    let time = |run: Loop| {
        (0..5)
            .map(|_| {
                let start = Instant::now();
                // SAFETY: the CPU has AVX-512 F, VNNI and BF16 (checked above).
                unsafe { run(ITERS) };
                start.elapsed().as_secs_f64() * 1e9 / ITERS as f64
            })
            .fold(f64::INFINITY, f64::min)
    };
    let base = time(loops::dots);
    println!("pipes/8 vpdpbusd: {base:.3} ns a loop (1.00)");
    let mixes: [(&str, Loop); 10] = [
        ("8 vpdpbusd + 4 vfmadd231ps", loops::dots_fma),
        ("8 vpdpbusd + 4 vmulps", loops::dots_mul),
        ("8 vpdpbusd + 4 vpmulld", loops::dots_mullo),
        ("8 vpdpbusd + 4 vcvtdq2ps", loops::dots_convert),
        ("8 vpdpbusd + 4 vaddps", loops::dots_add),
        ("8 vpdpbusd + 2 vpandd + 2 vpsrlw", loops::dots_unpack),
        (
            "8 vpdpbusd, each a {1to16} broadcast from memory",
            loops::dots_broadcast,
        ),
        (
            "8 vpdpbusd + 4 vpbroadcastd and 2 64-byte loads from memory",
            loops::dots_loads,
        ),
        ("8 vpdpbusd in one chain (latency)", loops::one_chain),
        ("8 vdpbf16ps", loops::bf16_dots),
    ];
    for (name, run) in mixes {
        let t = time(run);
        println!("pipes/{name}: {t:.3} ns a loop ({:.2})", t / base);
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("pipes: not run: x86-64 only");
}
