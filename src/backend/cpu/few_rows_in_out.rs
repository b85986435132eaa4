//! `f32` products of a few rows by a weight stored `[in, out]` — decoding's `x W` with `W` read
//! along its outputs (GPT-2's `Conv1D` layout, [`WeightLayout::InOut`](crate::nn::WeightLayout)) —
//! streaming the weight once for every row, on every core.
//!
//! [`few_rows`](super::few_rows) streams a weight used transposed, where every output is a dot
//! product along a contiguous weight row. Here weight row `r` is contiguous along the outputs, so a
//! task holds a strip of outputs for each token (in registers on AVX-512, in an L1 array on AVX2:
//! [`strips_avx2`]) and walks the weight rows in order,
//! adding `x[t][r] · W[r][strip]` to them: nothing is reduced across lanes, and each weight byte is
//! loaded once however many tokens there are (up to [`MAX_ROWS`]). Before this path such products
//! went to `gemm`'s matrix-vector kernel, on one core: 45 % of GPT-2 small's batch-1 decoding.
//!
//! Tasks take strips of output columns, each reading a run of every weight row, the runs a whole
//! weight row apart. Short runs starve the memory: strips of 512 KiB of weight (64 columns, 256
//! bytes a row, of a 2,048 × 8,192 weight) read 19-25 GiB/s where 512 columns read 28-44 on the
//! same 2-core machine in the same minutes, so strips are [`STRIP_COLUMNS`] wide and their number a
//! multiple of the threads ([`strip_width`]). The hardware prefetcher does not follow the runs
//! across pages, so the kernels prefetch [`PREFETCH_ROWS`] rows ahead.
//!
//! Every output is one chain of fused multiply-adds over `r = 0..k` in order, whatever the other
//! rows and columns are and whichever kernel runs: a request decodes to the same bits alone or
//! batched, and the AVX-512, AVX2 and portable kernels agree to the bit (unit-tested). Dispatched at
//! run time like [`few_rows`](super::few_rows) (the portable kernel's `mul_add` is a library call on
//! x86 CPUs without FMA, which are also without AVX2: slow there, but exact).

use super::few_rows::{Columns, Isa, MAX_ROWS, by_weight_rows};

/// Tokens per pass over a strip: their accumulators stay in registers.
const TOKENS_PER_PASS: usize = 8;
/// How many weight rows ahead the kernels prefetch their strip's lines.
const PREFETCH_ROWS: usize = 8;
/// The widest strip of output columns one task takes (2 KiB of each weight row).
const STRIP_COLUMNS: usize = 512;
/// Products whose weight is smaller than this run on the calling thread.
const PARALLEL_BYTES: usize = 256 << 10;
/// Columns per vector on the widest path; strips are cut at multiples of it.
const LANES: usize = 16;

/// `out = x w` for `x` `m × k` (row `t` at `x[t * ldx..]`, contiguous along `k`), `w` `k × n` (row
/// `r` at `w[r * ldw..]`, contiguous along `n`) and `out` contiguous `m × n`, with `1 <= m <=
/// MAX_ROWS` and `k >= 1`.
///
/// # Panics
/// When an operand's slice is too short for its shape (a caller bug: `matmul` passes checked
/// layouts), or `m` is outside `1..=MAX_ROWS`.
pub(super) fn product(
    x: &[f32],
    ldx: usize,
    w: &[f32],
    ldw: usize,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    assert!(
        (1..=MAX_ROWS).contains(&m)
            && k >= 1
            && ldx >= k
            && ldw >= n
            && x.len() >= (m - 1) * ldx + k
            && w.len() >= (k - 1) * ldw + n
            && out.len() == m * n,
        "few-rows product: operands do not fit their shape"
    );
    if n == 0 {
        return;
    }
    let isa = Isa::detect();
    let width = strip_width(n, rayon::current_num_threads());
    let parallel = n * k * 4 >= PARALLEL_BYTES;
    by_weight_rows((m, n), width, parallel, out, |mut columns| {
        let first = columns.first();
        strip_product(isa, x, ldx, m, k, &w[first..], ldw, &mut columns);
    });
}

/// The columns of each task's strip for `n` outputs on `threads` threads: at most
/// [`STRIP_COLUMNS`], as many strips as a multiple of the threads needs for that (so every thread
/// gets the same number), the columns shared out evenly in whole vectors.
fn strip_width(n: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    let strips = threads * n.div_ceil(threads * STRIP_COLUMNS);
    n.div_ceil(strips).next_multiple_of(LANES)
}

/// `columns` (token `t`'s outputs at row `t`) `= x_t w` for the `m` tokens of `x` (stride `ldx`)
/// and the strip of `w` (stride `ldw`) that starts at the first of `columns`.
#[allow(clippy::too_many_arguments)]
fn strip_product(
    isa: Isa,
    x: &[f32],
    ldx: usize,
    m: usize,
    k: usize,
    w: &[f32],
    ldw: usize,
    columns: &mut Columns<'_>,
) {
    let width = columns.len();
    assert!(
        w.len() >= (k - 1) * ldw + width && x.len() >= (m - 1) * ldx + k,
        "few-rows product: a strip outside its operands"
    );
    for t0 in (0..m).step_by(TOKENS_PER_PASS) {
        let tokens = TOKENS_PER_PASS.min(m - t0);
        let xs: [&[f32]; TOKENS_PER_PASS] =
            std::array::from_fn(|t| &x[(t0 + t.min(tokens - 1)) * ldx..][..k]);
        let strip = Strip {
            w,
            ldw,
            k,
            width,
            t0,
        };
        // One instantiation per token count: the accumulators (tokens × vectors) are a fixed array
        // the compiler keeps in registers, at most 16 of AVX-512's 32 (AVX2's live in L1).
        macro_rules! by_tokens {
            ($kernel:ident, $($t:literal => $v:literal),*) => {
                match tokens {
                    $($t => $kernel::<$t, $v>(&xs, &strip, columns),)*
                    _ => unreachable!("1 to {TOKENS_PER_PASS} tokens per pass"),
                }
            };
        }
        match isa {
            // SAFETY: `Isa::detect` returned `Avx512` only where the CPU has AVX-512F; the
            // assertion above keeps every row of the strip inside `w` and every token `k` long,
            // which is all the kernel reads.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe {
                by_tokens!(strips_avx512, 1 => 8, 2 => 8, 3 => 4, 4 => 4, 5 => 2, 6 => 2, 7 => 2, 8 => 2)
            },
            // SAFETY: `Avx2` only where the CPU has AVX2 and FMA; slices as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe {
                match tokens {
                    1 => strips_avx2::<1>(&xs, &strip, columns),
                    2 => strips_avx2::<2>(&xs, &strip, columns),
                    3 => strips_avx2::<3>(&xs, &strip, columns),
                    4 => strips_avx2::<4>(&xs, &strip, columns),
                    5 => strips_avx2::<5>(&xs, &strip, columns),
                    6 => strips_avx2::<6>(&xs, &strip, columns),
                    7 => strips_avx2::<7>(&xs, &strip, columns),
                    8 => strips_avx2::<8>(&xs, &strip, columns),
                    _ => unreachable!("1 to {TOKENS_PER_PASS} tokens per pass"),
                }
            },
            Isa::Portable => {
                by_tokens!(strips_portable, 1 => 2, 2 => 2, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1)
            }
        }
    }
}

/// The part of the weight one task multiplies: `width` columns of `k` rows `ldw` apart, for the
/// tokens from `t0` (the pass's first) on.
struct Strip<'a> {
    w: &'a [f32],
    ldw: usize,
    k: usize,
    width: usize,
    t0: usize,
}

/// The portable kernel: blocks of `V` vectors of [`LANES`] columns, each output a `mul_add` chain
/// over the rows.
fn strips_portable<const T: usize, const V: usize>(
    xs: &[&[f32]; TOKENS_PER_PASS],
    strip: &Strip<'_>,
    columns: &mut Columns<'_>,
) {
    let Strip {
        w, ldw, k, width, ..
    } = *strip;
    let block = V * LANES;
    for c0 in (0..width).step_by(block) {
        let cols = block.min(width - c0);
        let mut acc = [[[0.0f32; LANES]; V]; T];
        for r in 0..k {
            let row = &w[r * ldw + c0..][..cols];
            for (acc, x) in acc.iter_mut().zip(xs) {
                let x = x[r];
                for (acc, row) in acc.iter_mut().zip(row.chunks(LANES)) {
                    for (acc, &w) in acc.iter_mut().zip(row) {
                        *acc = x.mul_add(w, *acc);
                    }
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            for (v, acc) in acc.iter().enumerate() {
                let lanes = cols.saturating_sub(v * LANES).min(LANES);
                if lanes > 0 {
                    columns.set_run(strip.t0 + t, c0 + v * LANES, &acc[..lanes]);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn strips_avx512<const T: usize, const V: usize>(
    xs: &[&[f32]; TOKENS_PER_PASS],
    strip: &Strip<'_>,
    columns: &mut Columns<'_>,
) {
    use std::arch::x86_64::{
        __m512, _MM_HINT_T0, _mm_prefetch, _mm512_fmadd_ps, _mm512_maskz_loadu_ps, _mm512_set1_ps,
        _mm512_setzero_ps, _mm512_storeu_ps,
    };
    let Strip {
        w, ldw, k, width, ..
    } = *strip;
    let block = V * LANES;
    for c0 in (0..width).step_by(block) {
        let cols = block.min(width - c0);
        // Lane masks: whole vectors, then the strip's last partial one, then none.
        let masks: [u16; V] = std::array::from_fn(|v| {
            let lanes = cols.saturating_sub(v * LANES).min(LANES);
            ((1u32 << lanes) - 1) as u16
        });
        let mut acc: [[__m512; V]; T] = [[_mm512_setzero_ps(); V]; T];
        let base = w[c0..].as_ptr();
        for r in 0..k {
            let row = base.wrapping_add(r * ldw);
            for v in 0..V {
                // A prefetch past the weight's end is harmless (it never faults), so the address
                // is formed with `wrapping_add` and needs no bounds.
                _mm_prefetch::<_MM_HINT_T0>(
                    row.wrapping_add(PREFETCH_ROWS * ldw + v * LANES).cast(),
                );
            }
            // SAFETY: `strip_product` checked `(k - 1) * ldw + width <= w.len()`; the mask keeps
            // vector `v`'s lanes below `cols`, so every lane read is `r * ldw + c0 + j` with `j <
            // cols <= width - c0`: inside `w`. Masked-off lanes touch no memory.
            let wv: [__m512; V] = std::array::from_fn(|v| unsafe {
                _mm512_maskz_loadu_ps(masks[v], row.add(v * LANES))
            });
            for (acc, x) in acc.iter_mut().zip(xs) {
                // SAFETY: every token slice is `k` long and `r < k`.
                let x = _mm512_set1_ps(unsafe { *x.get_unchecked(r) });
                for (acc, w) in acc.iter_mut().zip(&wv) {
                    *acc = _mm512_fmadd_ps(x, *w, *acc);
                }
            }
        }
        let mut sums = [0.0f32; LANES];
        for (t, acc) in acc.iter().enumerate() {
            for (v, acc) in acc.iter().enumerate() {
                let lanes = cols.saturating_sub(v * LANES).min(LANES);
                if lanes == 0 {
                    break;
                }
                // SAFETY: `sums` holds 16 floats, one unaligned 64-byte store.
                unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), *acc) };
                columns.set_run(strip.t0 + t, c0 + v * LANES, &sums[..lanes]);
            }
        }
    }
}

/// Weight rows the AVX2 kernel adds into its accumulators per step.
#[cfg(target_arch = "x86_64")]
const AVX2_ROWS: usize = 4;

/// The AVX2 kernel: rows outer, the strip's whole width inner. AVX2's 16 registers hold too few
/// accumulators for a useful strip, and the register-blocked walk of [`strips_avx512`] read 128
/// bytes (one token) to 32 bytes (five or more) of each weight row at a time, rows a whole weight
/// row apart: 12.5 GiB/s for one token and 4.8 for eight on a 2-core Zen 3, where a transposed
/// weight streams at 19.4. So the accumulators of the whole strip (at most [`STRIP_COLUMNS`] per
/// token, 2 KiB, in L1) live in memory, and each step reads [`AVX2_ROWS`] weight rows' runs of the
/// strip's full width, contiguous runs of up to 2 KiB the prefetchers follow, once for all tokens
/// (the second token on finds them in L1). Each output is still one FMA chain over `r` in order
/// from 0, so the bits are the other kernels'.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn strips_avx2<const T: usize>(
    xs: &[&[f32]; TOKENS_PER_PASS],
    strip: &Strip<'_>,
    columns: &mut Columns<'_>,
) {
    use std::arch::x86_64::{
        __m256, _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    const HALF: usize = LANES / 2;
    let Strip {
        w, ldw, k, width, ..
    } = *strip;
    assert!(
        width <= STRIP_COLUMNS,
        "few-rows product: a strip wider than the AVX2 kernel's accumulators"
    );
    let (whole, tail) = (width / HALF, width % HALF);
    let vectors = width.div_ceil(HALF);
    // The last vector's lanes (a lane is loaded where its sign bit is set).
    let on = |l: usize| if l < tail { -1 } else { 0 };
    let mask = _mm256_setr_epi32(on(0), on(1), on(2), on(3), on(4), on(5), on(6), on(7));
    let mut acc = [[_mm256_setzero_ps(); STRIP_COLUMNS / HALF]; T];
    let base = w.as_ptr();
    let mut r = 0;
    while r < k {
        let rows = if k - r >= AVX2_ROWS { AVX2_ROWS } else { 1 };
        for (t, (acc, x)) in acc.iter_mut().zip(xs).enumerate() {
            // SAFETY: `strip_product` checked that rows `r..r + rows <= k` of the strip (`width`
            // columns from `base`, `ldw` apart) lie inside `w`, and every token slice is `k` long;
            // the mask keeps the last vector's loads below `width`. The CPU has AVX2 and FMA
            // (this function's features, which its caller checked).
            unsafe {
                if rows == AVX2_ROWS {
                    let x: [__m256; AVX2_ROWS] =
                        std::array::from_fn(|i| _mm256_set1_ps(*x.get_unchecked(r + i)));
                    add_rows(&mut acc[..vectors], base, ldw, r, &x, mask, whole, t == 0);
                } else {
                    let x = [_mm256_set1_ps(*x.get_unchecked(r))];
                    add_rows(&mut acc[..vectors], base, ldw, r, &x, mask, whole, t == 0);
                }
            }
        }
        r += rows;
    }
    let mut sums = [0.0f32; HALF];
    for (t, acc) in acc.iter().enumerate() {
        for (v, acc) in acc[..vectors].iter().enumerate() {
            let lanes = (width - v * HALF).min(HALF);
            // SAFETY: `sums` holds 8 floats, one unaligned 32-byte store.
            unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), *acc) };
            columns.set_run(strip.t0 + t, v * HALF, &sums[..lanes]);
        }
    }
}

/// `acc[v] = fma(x[R - 1], w[r + R - 1][v], … fma(x[0], w[r][v], acc[v]))` for the strip's vectors
/// `v` (the `whole` first of `acc` full, the one after them, if `acc` has it, under `mask`), where
/// `w[r]` is the run of `base + r · ldw`. With `prefetch`, asks for the same runs
/// [`PREFETCH_ROWS`] rows further on, a line per two vectors and row.
///
/// # Safety
/// The CPU must have AVX2 and FMA; rows `r..r + R` hold `whole` vectors (and the masked lanes of one
/// more where `acc` is longer) readable from `base + row · ldw`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn add_rows<const R: usize>(
    acc: &mut [std::arch::x86_64::__m256],
    base: *const f32,
    ldw: usize,
    r: usize,
    x: &[std::arch::x86_64::__m256; R],
    mask: std::arch::x86_64::__m256i,
    whole: usize,
    prefetch: bool,
) {
    use std::arch::x86_64::{
        _MM_HINT_T0, _mm_prefetch, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_maskload_ps,
    };
    const HALF: usize = LANES / 2;
    let rows: [*const f32; R] = std::array::from_fn(|i| base.wrapping_add((r + i) * ldw));
    let (full, last) = acc.split_at_mut(whole);
    for (v, acc) in full.iter_mut().enumerate() {
        if prefetch && v % 2 == 0 {
            for row in rows {
                // A prefetch past the weight's end never faults, so the address needs no bounds.
                _mm_prefetch::<_MM_HINT_T0>(
                    row.wrapping_add(PREFETCH_ROWS * ldw + v * HALF).cast(),
                );
            }
        }
        let mut a = *acc;
        for (row, x) in rows.iter().zip(x) {
            // SAFETY: the caller's contract: vector `v < whole` of each row is readable.
            a = _mm256_fmadd_ps(*x, unsafe { _mm256_loadu_ps(row.add(v * HALF)) }, a);
        }
        *acc = a;
    }
    if let Some(acc) = last.first_mut() {
        let mut a = *acc;
        for (row, x) in rows.iter().zip(x) {
            // SAFETY: the caller's contract: the masked lanes of vector `whole` are readable;
            // masked-off lanes touch no memory.
            a = _mm256_fmadd_ps(
                *x,
                unsafe { _mm256_maskload_ps(row.add(whole * HALF), mask) },
                a,
            );
        }
        *acc = a;
    }
}

#[cfg(test)]
mod tests {
    use super::super::few_rows::tests::{isas, reference};
    use super::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::Rng::new(seed);
        (0..len)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            .collect()
    }

    /// Every path this CPU has, on odd shapes (strips of every width below a vector and across
    /// blocks, token counts across a pass), strided operands; all paths agree to the bit.
    #[test]
    fn every_path_matches_the_f64_product_and_the_others_to_the_bit() {
        let isas = isas();
        for (m, k, n) in [
            (1, 1, 1),
            (1, 17, 5),
            (2, 3, 129),
            (3, 31, 9),
            (4, 8, 71),
            (8, 64, 33),
            (9, 100, 13),
            (16, 15, 150),
            (5, 257, 17),
        ] {
            let (ldx, ldw) = (k + 3, n + 5);
            let x = values(m * ldx, 1);
            let w = values(k * ldw, 2);
            let want = reference(&x, ldx, &w, (ldw, 1), (m, k, n));
            let mut first: Option<Vec<u32>> = None;
            for &isa in &isas {
                let mut out = vec![f32::NAN; m * n];
                strip_product(
                    isa,
                    &x,
                    ldx,
                    m,
                    k,
                    &w,
                    ldw,
                    &mut Columns::new(&mut out, m, n),
                );
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    let got = f64::from(got);
                    assert!(
                        (got - want).abs() <= 1e-6 * (1.0 + want.abs()) * k as f64,
                        "{isa:?} {m}x{k}x{n} [{i}]: {got} vs {want}"
                    );
                }
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                match &first {
                    None => first = Some(bits),
                    Some(first) => assert_eq!(&bits, first, "{isa:?} {m}x{k}x{n}: other bits"),
                }
            }
        }
    }

    /// Strips are whole vectors, at most `STRIP_COLUMNS` wide, and there are enough of them for
    /// every thread (but where rounding to whole vectors leaves one short).
    #[test]
    fn strips_are_at_most_2_kib_a_row_and_enough_for_the_threads() {
        for threads in [1, 2, 3, 8] {
            for n in [1, 16, 333, 768, 2304, 3072, 8192, 50257] {
                let width = strip_width(n, threads);
                let strips = n.div_ceil(width);
                assert!(
                    width.is_multiple_of(LANES)
                        && width <= STRIP_COLUMNS
                        && strips + 1 >= threads.min(n.div_ceil(LANES)),
                    "{n} outputs on {threads} threads: {strips} strips of {width}"
                );
            }
        }
        // GPT-2 small's products on two threads: two or six strips, none narrower than 384.
        assert_eq!(strip_width(768, 2), 384);
        assert_eq!(strip_width(2304, 2), 384);
        assert_eq!(strip_width(3072, 2), 512);
    }

    /// Through `product`: large enough to run on rayon's tasks (strips of several widths), and a
    /// row's outputs do not depend on the other rows.
    #[test]
    fn a_parallel_product_matches_and_a_row_gets_the_same_bits_alone_or_batched() {
        let (k, n) = (700, 333);
        let x = values(16 * k, 3);
        let w = values(k * n, 4);
        let mut batched = vec![0.0; 16 * n];
        product(&x, k, &w, n, (16, k, n), &mut batched);
        let want = reference(&x, k, &w, (n, 1), (16, k, n));
        for (g, w) in batched.iter().zip(&want) {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{g} vs {w}"
            );
        }
        let mut alone = vec![0.0; n];
        product(&x[3 * k..], k, &w, n, (1, k, n), &mut alone);
        assert_eq!(
            alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            batched[3 * n..4 * n]
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
    }
}
