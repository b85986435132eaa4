//! Which instructions the quantized and `bf16` kernels' inner loops compete for, on the CPU at hand.
//!
//! With AVX-512 VNNI and BF16: eight independent 512-bit `vpdpbusd` a loop (the int8 dot products
//! of `quant_strips`) alone, then with four other instructions beside them. Where the loop takes as
//! long as the eight alone, the four ran on other execution pipes; where it takes 12/8 as long,
//! they queued for the same ones. Also the eight with their token bytes broadcast from memory
//! (`{1to16}` operands, as the strip kernels take them) and beside broadcast and 64-byte loads,
//! `vpdpbusd`'s latency (one chain) and `vdpbf16ps`' throughput (the `bf16` products' micro-kernel).
//!
//! With AVX2 (every x86-64 CPU the AVX2 strip kernels run on, `quant_strips_avx2`): eight
//! independent 256-bit `vpmaddubsw` (a product of 32 unsigned by signed bytes, summed in pairs to
//! 16 bits) alone, then with what those kernels do beside them: the `vpaddw` that adds each one's
//! pair sums, a token's 4 bytes broadcast from memory for each, the `vpmaddwd` widenings, the
//! scaling's conversions and FMAs.
//!
//! Run with `cargo bench --bench pipes`; x86-64 only. The figures are ratios to each part's first
//! loop, so they do not depend on the clock; `ns` is per loop.

/// `pub unsafe fn $name(iters: u64)`: a loop of `iters` iterations of `$body`, `rsi` pointing to
/// the calling module's `BYTES` (what the loops with memory operands read, in L1 after the first
/// iteration). `avx512` loops clobber zmm0..zmm13, `avx2` loops ymm0..ymm15.
#[cfg(target_arch = "x86_64")]
macro_rules! timed_loop {
    (avx512 $name:ident, $($body:expr),+) => {
        timed_loop!(
            @ $name,
            "AVX-512 F, VNNI and BF16",
            [
                "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9",
                "zmm10", "zmm11", "zmm12", "zmm13"
            ],
            $($body),+
        );
    };
    (avx2 $name:ident, $($body:expr),+) => {
        timed_loop!(
            @ $name,
            "AVX2 and FMA",
            [
                "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9",
                "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15"
            ],
            $($body),+
        );
    };
    (@ $name:ident, $needs:literal, [$($reg:tt),+], $($body:expr),+) => {
        #[doc = concat!("# Safety\nThe CPU must have ", $needs, ".")]
        pub unsafe fn $name(iters: u64) {
            // SAFETY: the caller's contract (the CPU runs these instructions); the loop touches
            // only the registers it declares clobbered and its counter, and reads only `BYTES`.
            unsafe {
                std::arch::asm!(
                    "2:",
                    $($body,)+
                    "dec {i}",
                    "jnz 2b",
                    i = inout(reg) iters => _,
                    in("rsi") BYTES.as_ptr(),
                    $(out($reg) _,)+
                    options(nostack, readonly),
                );
            }
        }
    };
}

/// Eight independent `$op`s of registers `$r`: into 0..8, from 8 and 9.
#[cfg(target_arch = "x86_64")]
macro_rules! eight {
    ($op:literal, $r:literal) => {
        concat!(
            $op, " ", $r, "0, ", $r, "8, ", $r, "9\n", $op, " ", $r, "1, ", $r, "8, ", $r, "9\n",
            $op, " ", $r, "2, ", $r, "8, ", $r, "9\n", $op, " ", $r, "3, ", $r, "8, ", $r, "9\n",
            $op, " ", $r, "4, ", $r, "8, ", $r, "9\n", $op, " ", $r, "5, ", $r, "8, ", $r, "9\n",
            $op, " ", $r, "6, ", $r, "8, ", $r, "9\n", $op, " ", $r, "7, ", $r, "8, ", $r, "9\n",
        )
    };
}

#[cfg(target_arch = "x86_64")]
mod loops {
    /// What the loops with memory operands read (through `rsi`): 64 bytes, in L1 after the first
    /// iteration.
    static BYTES: [u8; 64] = [1; 64];

    timed_loop!(avx512 dots, eight!("vpdpbusd", "zmm"));
    timed_loop!(
        avx512 dots_fma,
        eight!("vpdpbusd", "zmm"),
        "vfmadd231ps zmm10, zmm8, zmm9\nvfmadd231ps zmm11, zmm8, zmm9\n",
        "vfmadd231ps zmm12, zmm8, zmm9\nvfmadd231ps zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        avx512 dots_mul,
        eight!("vpdpbusd", "zmm"),
        "vmulps zmm10, zmm8, zmm9\nvmulps zmm11, zmm8, zmm9\n",
        "vmulps zmm12, zmm8, zmm9\nvmulps zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        avx512 dots_mullo,
        eight!("vpdpbusd", "zmm"),
        "vpmulld zmm10, zmm8, zmm9\nvpmulld zmm11, zmm8, zmm9\n",
        "vpmulld zmm12, zmm8, zmm9\nvpmulld zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        avx512 dots_convert,
        eight!("vpdpbusd", "zmm"),
        "vcvtdq2ps zmm10, zmm9\nvcvtdq2ps zmm11, zmm9\n",
        "vcvtdq2ps zmm12, zmm9\nvcvtdq2ps zmm13, zmm9\n"
    );
    timed_loop!(
        avx512 dots_add,
        eight!("vpdpbusd", "zmm"),
        "vaddps zmm10, zmm8, zmm9\nvaddps zmm11, zmm8, zmm9\n",
        "vaddps zmm12, zmm8, zmm9\nvaddps zmm13, zmm8, zmm9\n"
    );
    timed_loop!(
        avx512 dots_unpack,
        eight!("vpdpbusd", "zmm"),
        "vpandd zmm10, zmm8, zmm9\nvpsrlw zmm11, zmm8, 4\n",
        "vpandd zmm12, zmm8, zmm9\nvpsrlw zmm13, zmm8, 4\n"
    );
    timed_loop!(
        avx512 dots_broadcast,
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
        avx512 dots_loads,
        eight!("vpdpbusd", "zmm"),
        "vpbroadcastd zmm10, dword ptr [rsi]\nvpbroadcastd zmm11, dword ptr [rsi + 4]\n",
        "vpbroadcastd zmm12, dword ptr [rsi + 8]\nvpbroadcastd zmm13, dword ptr [rsi + 12]\n",
        "vmovdqu64 zmm10, [rsi]\nvmovdqu64 zmm11, [rsi]\n"
    );
    timed_loop!(
        avx512 one_chain,
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n",
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n",
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n",
        "vpdpbusd zmm0, zmm8, zmm9\nvpdpbusd zmm0, zmm8, zmm9\n"
    );
    timed_loop!(
        avx512 bf16_dots,
        "vdpbf16ps zmm0, zmm8, zmm9\nvdpbf16ps zmm1, zmm8, zmm9\n",
        "vdpbf16ps zmm2, zmm8, zmm9\nvdpbf16ps zmm3, zmm8, zmm9\n",
        "vdpbf16ps zmm4, zmm8, zmm9\nvdpbf16ps zmm5, zmm8, zmm9\n",
        "vdpbf16ps zmm6, zmm8, zmm9\nvdpbf16ps zmm7, zmm8, zmm9\n"
    );
}

/// The AVX2 loops: `vpmaddubsw` and what the AVX2 strip kernels put beside it.
#[cfg(target_arch = "x86_64")]
mod avx2_loops {
    /// What the loops with memory operands read (through `rsi`): 32 bytes, in L1 after the first
    /// iteration.
    static BYTES: [u8; 32] = [1; 32];

    timed_loop!(avx2 products, eight!("vpmaddubsw", "ymm"));
    // Each product's pair sums added into one of four 16-bit sums, as a block's are before
    // they are widened: two additions a loop on each sum, so the four chains do not bound it.
    timed_loop!(
        avx2 products_adds,
        eight!("vpmaddubsw", "ymm"),
        "vpaddw ymm10, ymm10, ymm0\nvpaddw ymm11, ymm11, ymm1\n",
        "vpaddw ymm12, ymm12, ymm2\nvpaddw ymm13, ymm13, ymm3\n",
        "vpaddw ymm10, ymm10, ymm4\nvpaddw ymm11, ymm11, ymm5\n",
        "vpaddw ymm12, ymm12, ymm6\nvpaddw ymm13, ymm13, ymm7\n"
    );
    // A token's 4 bytes broadcast from memory for each product (AVX2 has no broadcast operand).
    timed_loop!(
        avx2 products_broadcasts,
        "vpbroadcastd ymm0, dword ptr [rsi]\nvpmaddubsw ymm0, ymm8, ymm0\n",
        "vpbroadcastd ymm1, dword ptr [rsi + 4]\nvpmaddubsw ymm1, ymm8, ymm1\n",
        "vpbroadcastd ymm2, dword ptr [rsi + 8]\nvpmaddubsw ymm2, ymm8, ymm2\n",
        "vpbroadcastd ymm3, dword ptr [rsi + 12]\nvpmaddubsw ymm3, ymm8, ymm3\n",
        "vpbroadcastd ymm4, dword ptr [rsi + 16]\nvpmaddubsw ymm4, ymm8, ymm4\n",
        "vpbroadcastd ymm5, dword ptr [rsi + 20]\nvpmaddubsw ymm5, ymm8, ymm5\n",
        "vpbroadcastd ymm6, dword ptr [rsi + 24]\nvpmaddubsw ymm6, ymm8, ymm6\n",
        "vpbroadcastd ymm7, dword ptr [rsi + 28]\nvpmaddubsw ymm7, ymm8, ymm7\n"
    );
    timed_loop!(
        avx2 products_widen,
        eight!("vpmaddubsw", "ymm"),
        "vpmaddwd ymm10, ymm8, ymm9\nvpmaddwd ymm11, ymm8, ymm9\n"
    );
    timed_loop!(
        avx2 products_scale,
        eight!("vpmaddubsw", "ymm"),
        "vcvtdq2ps ymm10, ymm9\nvcvtdq2ps ymm11, ymm9\n",
        "vfmadd231ps ymm12, ymm8, ymm9\nvfmadd231ps ymm13, ymm8, ymm9\n"
    );
    // All of it: the broadcasts, the products, their additions, and per four products one
    // widening and the scaling's conversion and FMA: about what the kernels spend on one token,
    // 32 values and 8 rows.
    timed_loop!(
        avx2 products_all,
        "vpbroadcastd ymm0, dword ptr [rsi]\nvpmaddubsw ymm0, ymm8, ymm0\n",
        "vpbroadcastd ymm1, dword ptr [rsi + 4]\nvpmaddubsw ymm1, ymm8, ymm1\n",
        "vpbroadcastd ymm2, dword ptr [rsi + 8]\nvpmaddubsw ymm2, ymm8, ymm2\n",
        "vpbroadcastd ymm3, dword ptr [rsi + 12]\nvpmaddubsw ymm3, ymm8, ymm3\n",
        "vpbroadcastd ymm4, dword ptr [rsi + 16]\nvpmaddubsw ymm4, ymm8, ymm4\n",
        "vpbroadcastd ymm5, dword ptr [rsi + 20]\nvpmaddubsw ymm5, ymm8, ymm5\n",
        "vpbroadcastd ymm6, dword ptr [rsi + 24]\nvpmaddubsw ymm6, ymm8, ymm6\n",
        "vpbroadcastd ymm7, dword ptr [rsi + 28]\nvpmaddubsw ymm7, ymm8, ymm7\n",
        "vpaddw ymm10, ymm10, ymm0\nvpaddw ymm11, ymm11, ymm1\n",
        "vpaddw ymm10, ymm10, ymm2\nvpaddw ymm11, ymm11, ymm3\n",
        "vpaddw ymm12, ymm12, ymm4\nvpaddw ymm13, ymm13, ymm5\n",
        "vpaddw ymm12, ymm12, ymm6\nvpaddw ymm13, ymm13, ymm7\n",
        "vpmaddwd ymm0, ymm10, ymm9\nvpmaddwd ymm1, ymm12, ymm9\n",
        "vcvtdq2ps ymm0, ymm0\nvcvtdq2ps ymm1, ymm1\n",
        "vfmadd231ps ymm14, ymm0, ymm9\nvfmadd231ps ymm15, ymm1, ymm9\n"
    );
}

/// A timed loop: its iteration count in, run on a CPU with the features of its part.
#[cfg(target_arch = "x86_64")]
type Loop = unsafe fn(u64);

/// Iterations of each timed loop.
#[cfg(target_arch = "x86_64")]
const ITERS: u64 = 100_000_000;

/// The best of five runs of `run`, in ns per iteration.
///
/// # Safety
/// The CPU must have the features `run` needs.
#[cfg(target_arch = "x86_64")]
unsafe fn time(run: Loop) -> f64 {
    (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            // SAFETY: the caller's contract.
            unsafe { run(ITERS) };
            start.elapsed().as_secs_f64() * 1e9 / ITERS as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// Times `base` and then each of `mixes`, printing the mixes' times as ratios to `base`'s.
///
/// # Safety
/// The CPU must have the features every loop needs.
#[cfg(target_arch = "x86_64")]
unsafe fn part(base: (&str, Loop), mixes: &[(&str, Loop)]) {
    // SAFETY: the caller's contract.
    let first = unsafe { time(base.1) };
    println!("pipes/{}: {first:.3} ns a loop (1.00)", base.0);
    for &(name, run) in mixes {
        // SAFETY: the caller's contract.
        let t = unsafe { time(run) };
        println!("pipes/{name}: {t:.3} ns a loop ({:.2})", t / first);
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        let mixes: [(&str, Loop); 5] = [
            ("8 vpmaddubsw + 8 vpaddw", avx2_loops::products_adds),
            (
                "8 vpmaddubsw, each after a vpbroadcastd from memory",
                avx2_loops::products_broadcasts,
            ),
            ("8 vpmaddubsw + 2 vpmaddwd", avx2_loops::products_widen),
            (
                "8 vpmaddubsw + 2 vcvtdq2ps + 2 vfmadd231ps",
                avx2_loops::products_scale,
            ),
            (
                "8 vpbroadcastd, vpmaddubsw and vpaddw + 2 vpmaddwd, vcvtdq2ps and vfmadd231ps",
                avx2_loops::products_all,
            ),
        ];
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { part(("8 vpmaddubsw", avx2_loops::products), &mixes) };
    } else {
        println!("pipes: the AVX2 loops not run: this CPU lacks AVX2 or FMA");
    }
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512bf16");
    if !avx512 {
        println!("pipes: the AVX-512 loops not run: this CPU lacks AVX-512 F, VNNI or BF16");
        return;
    }
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
    // SAFETY: the CPU has AVX-512 F, VNNI and BF16 (checked above).
    unsafe { part(("8 vpdpbusd", loops::dots), &mixes) };
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("pipes: not run: x86-64 only");
}
