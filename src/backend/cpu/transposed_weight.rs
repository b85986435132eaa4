//! `f32` products `x Wᵀ` by a `[n, k]` weight read transposed (a `Linear`'s, every Llama
//! projection, GPT-2's tied head), for more rows than the streamed products take: the weight's rows
//! transposed a chunk at a time, then multiplied by `gemm`.
//!
//! Both operands of `x Wᵀ` are contiguous along `k`. `gemm` packs the weight into panels of 64 rows
//! that are contiguous along `n`, and from an operand contiguous along `k` it does so one element at
//! a time with strided loads (`pack_generic`'s inner loop in `gemm-common`): on a Zen 4 that packing
//! was a quarter of the Llama-1B-shaped `f32` forward of 512 tokens, and the products ran at 150
//! GFLOP/s where the same weight stored `[k, n]` ran at 195-207 (BENCHMARKS.md, issue 33). So
//! [`product`] transposes [`CHUNK`] elements of the weight at a time into scratch — 16 × 16 blocks
//! in AVX-512 registers, one task per 16 weight rows on rayon's threads — and `gemm` multiplies each
//! chunk into its columns of the output, packing it with plain copies.
//!
//! The bits are those of one `gemm` call over the whole weight: `gemm` blocks the depth by `k` and
//! the caches alone (`kernel_params`), so each output element is summed over `k` in the same order
//! whatever the chunk's width. CPUs without AVX-512 keep the single call (`gemm`'s own path): the
//! transpose is written for AVX-512 and measured there only.

use gemm::Parallelism;

use super::avx512f;
use rayon::prelude::*;

/// Weight elements transposed at a time (8 MiB of `f32`): a chunk of the weight's rows is `CHUNK /
/// k` rows, 1,024 at Llama-1B's `k` of 2,048 and 256 at its MLP's 8,192 (chunks of 256 to 2,048
/// rows multiplied 512 tokens at 172-190 GFLOP/s on a Zen 4, the whole transposed weight at
/// 179-207).
const CHUNK: usize = 1 << 21;

/// The fewest weight rows a chunk may have: below it (`k` over 32,768) `gemm`'s calls get too
/// narrow, and the product takes the single call.
const MIN_CHUNK_ROWS: usize = 64;

/// The fewest rows of `x`: fewer are the streamed products' (`few_rows`, at most 16), and products
/// of a few more read the weight once either way.
const MIN_ROWS: usize = 32;

/// The least depth: at GPT-2's 768 (rows 3 KiB apart) `gemm`'s own packing ran as fast as the
/// chunks (Zen 4, 128 and 512 rows: 131-143 against 137-143 GFLOP/s, 171-189 against 177-182);
/// from 1,024 (rows 4 KiB apart and more, whose strided loads fall into few cache sets) it ran
/// 1.1-1.8x slower (`[8192, k]` weights, k of 1,024 to 3,072).
const MIN_DEPTH: usize = 1024;

/// Whether `x Wᵀ` (`(m, k, n)`, the weight's rows `b_cs` apart and contiguous along `k`: `b_rs`
/// is 1) runs here on this CPU, and if so how many elements of scratch it transposes into.
pub(super) fn scratch_len(
    b_rs: isize,
    b_cs: isize,
    (m, k, n): (usize, usize, usize),
) -> Option<usize> {
    let rows = chunk_rows(k)?;
    let wide = m >= MIN_ROWS && n >= MIN_CHUNK_ROWS && k >= MIN_DEPTH;
    let transposed = b_rs == 1 && usize::try_from(b_cs).is_ok_and(|s| s >= k);
    (wide && transposed && avx512f()).then(|| rows.min(n) * k)
}

/// The weight rows of a chunk at depth `k`, a multiple of 16; `None` when fewer than
/// [`MIN_CHUNK_ROWS`].
fn chunk_rows(k: usize) -> Option<usize> {
    let rows = CHUNK / k.max(1) / 16 * 16;
    (rows >= MIN_CHUNK_ROWS).then_some(rows)
}

/// `out = a wᵀ` for one product of a batch: `a` is `m × k` with strides `(a_rs, a_cs)`, the weight's
/// `n` rows of `k` start `ldw` apart in `w`, `out` is `m × n` contiguous. `scratch` holds at least
/// [`scratch_len`]'s elements (the call asks it first and runs only where it said `Some`).
///
/// # Safety
/// `a`'s elements `r * a_rs + c * a_cs` (`r < m`, `c < k`) must lie in `a`; `w` must hold the
/// weight's rows; the CPU must have AVX-512 F.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn product(
    a: &[f32],
    (a_rs, a_cs): (isize, isize),
    w: &[f32],
    ldw: usize,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    scratch: &mut [f32],
    parallelism: Parallelism,
) {
    let rows = chunk_rows(k).expect("scratch_len said the product runs here");
    assert!(out.len() == m * n && w.len() >= (n - 1) * ldw + k);
    for j0 in (0..n).step_by(rows) {
        let width = rows.min(n - j0);
        let chunk = &mut scratch[..width * k];
        transpose(&w[j0 * ldw..], ldw, (width, k), chunk);
        // SAFETY: the caller's contract for `a`; `chunk` is `k × width` row-major (`rhs_rs`
        // `width`, `rhs_cs` 1); `out`'s columns `j0..j0 + width` of its `m` rows of `n` lie in
        // `out` (asserted above), and nothing else writes them. With `read_dst` false the old
        // contents are not read.
        unsafe {
            gemm::gemm(
                m,
                width,
                k,
                out.as_mut_ptr().add(j0),
                1,
                n as isize,
                false,
                a.as_ptr(),
                a_cs,
                a_rs,
                chunk.as_ptr(),
                1,
                width as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
}

/// Input rows a task of [`transpose`] reads: as many streams along the weight's rows, each task's
/// writes a cache line of each output row.
const TASK_ROWS: usize = 16;

/// `to[c * rows + r] = from[r * stride + c]` (`r < rows`, `c < cols`): `rows` rows of `cols`
/// elements, `stride` apart in `from`, into `cols` rows of `rows` elements in `to`. Tasks of
/// [`TASK_ROWS`] input rows run on rayon's threads: each reads its rows front to back (streams the
/// hardware prefetcher follows), where tasks of output rows read a few lines of every input row.
pub(super) fn transpose(from: &[f32], stride: usize, (rows, cols): (usize, usize), to: &mut [f32]) {
    assert!(
        rows == 0
            || cols == 0
            || (from.len() >= (rows - 1) * stride + cols && to.len() >= rows * cols),
        "transpose: the operands do not hold their shapes"
    );
    if rows == 0 || cols == 0 {
        return;
    }
    let to = Columns(to.as_mut_ptr());
    let task = |t: usize| {
        let r0 = t * TASK_ROWS;
        // SAFETY: `to` holds `cols` rows of `rows` (asserted above); this task writes elements
        // `r0..r0 + TASK_ROWS` of them alone, and `to`'s borrow outlives the tasks.
        unsafe {
            transpose_rows(
                from,
                stride,
                (rows, cols),
                r0..rows.min(r0 + TASK_ROWS),
                &to,
            )
        };
    };
    let tasks = rows.div_ceil(TASK_ROWS);
    if rows * cols >= super::PARALLEL_MIN {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// The output of [`transpose`], which its tasks write in disjoint columns.
struct Columns(*mut f32);

// SAFETY: the tasks that share it write disjoint elements (`transpose`), and it lives only while
// the exclusive borrow it was made from does.
unsafe impl Sync for Columns {}

/// Input rows `rs` of [`transpose`] into their elements of every output row.
///
/// # Safety
/// `to` must point to `cols` rows of `rows` elements that no one else reads or writes at
/// elements `rs` while this runs; `from` must hold `rows` rows of `cols`, `stride` apart.
unsafe fn transpose_rows(
    from: &[f32],
    stride: usize,
    (rows, cols): (usize, usize),
    rs: std::ops::Range<usize>,
    to: &Columns,
) {
    let mut c0 = 0;
    #[cfg(target_arch = "x86_64")]
    if rs.len() == 16 && avx512f() {
        let full = cols / 16 * 16;
        for c in (0..full).step_by(16) {
            // SAFETY: input rows `rs` and columns `c..c + 16` lie in `from`; output rows
            // `c..c + 16`, elements `rs`, lie in `to` and are this task's (the caller's
            // contract); the CPU has AVX-512 F.
            unsafe {
                transpose16_avx512(
                    from.as_ptr().add(rs.start * stride + c),
                    stride,
                    to.0.add(c * rows + rs.start),
                    rows,
                )
            };
        }
        c0 = full;
    }
    for c in c0..cols {
        for r in rs.clone() {
            // SAFETY: as above: element `r` of output row `c` is this task's.
            unsafe { *to.0.add(c * rows + r) = from[r * stride + c] };
        }
    }
}

/// Transposes the 16 × 16 block at `from` (rows `stride` apart) into the block at `to` (rows
/// `to_stride` apart): four rounds of shuffles, pairs of 32-bit lanes, pairs of 64-bit lanes, then
/// 128-bit lanes twice, after which register `i` holds column `i`.
///
/// # Safety
/// The CPU must have AVX-512 F; 16 rows of 16 elements must be readable at `from` and writable at
/// `to`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_avx512(from: *const f32, stride: usize, to: *mut f32, to_stride: usize) {
    use std::arch::x86_64::{
        __m512, _mm512_castpd_ps, _mm512_castps_pd, _mm512_loadu_ps, _mm512_shuffle_f32x4,
        _mm512_storeu_ps, _mm512_unpackhi_pd, _mm512_unpackhi_ps, _mm512_unpacklo_pd,
        _mm512_unpacklo_ps,
    };
    // SAFETY: the caller's contract: rows `0..16` of 16 elements at `from`.
    let r: [__m512; 16] = std::array::from_fn(|i| unsafe { _mm512_loadu_ps(from.add(i * stride)) });
    let mut t = r;
    for p in 0..8 {
        t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    let mut u = t;
    for q in (0..16).step_by(4) {
        let pd = |x: __m512| _mm512_castps_pd(x);
        u[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[q]), pd(t[q + 2])));
        u[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[q]), pd(t[q + 2])));
        u[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[q + 1]), pd(t[q + 3])));
        u[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[q + 1]), pd(t[q + 3])));
    }
    let mut v = u;
    for i in 0..4 {
        v[i] = _mm512_shuffle_f32x4::<0x88>(u[i], u[4 + i]);
        v[4 + i] = _mm512_shuffle_f32x4::<0xdd>(u[i], u[4 + i]);
        v[8 + i] = _mm512_shuffle_f32x4::<0x88>(u[8 + i], u[12 + i]);
        v[12 + i] = _mm512_shuffle_f32x4::<0xdd>(u[8 + i], u[12 + i]);
    }
    for i in 0..8 {
        let (low, high) = (
            _mm512_shuffle_f32x4::<0x88>(v[i], v[8 + i]),
            _mm512_shuffle_f32x4::<0xdd>(v[i], v[8 + i]),
        );
        // SAFETY: the caller's contract: rows `0..16` of 16 elements at `to`.
        unsafe {
            _mm512_storeu_ps(to.add(i * to_stride), low);
            _mm512_storeu_ps(to.add((8 + i) * to_stride), high);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(from: &[f32], stride: usize, (rows, cols): (usize, usize)) -> Vec<f32> {
        let mut to = vec![0.0; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                to[c * rows + r] = from[r * stride + c];
            }
        }
        to
    }

    #[test]
    fn transposes_match_a_plain_loop_at_edges_and_strides() {
        for (rows, cols, pad) in [
            (1, 1, 0),
            (16, 16, 0),
            (17, 33, 3),
            (48, 16, 0),
            (64, 200, 5),
            (300, 129, 1),
            (15, 70, 0),
            (1024, 96, 0),
        ] {
            let stride = cols + pad;
            let from: Vec<f32> = (0..rows * stride).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut to = vec![f32::NAN; rows * cols];
            transpose(&from, stride, (rows, cols), &mut to);
            assert_eq!(
                to,
                plain(&from, stride, (rows, cols)),
                "{rows} x {cols}, stride {stride}"
            );
        }
    }

    #[test]
    fn chunked_products_give_the_bits_of_one_gemm_call() {
        if !avx512f() {
            eprintln!("skipped: this CPU has no AVX-512 F; the chunked product runs only with it");
            return;
        }
        // Depths with one and with several of `gemm`'s depth blocks; widths with a partial chunk.
        for (m, k, n) in [(32, 1024, 200), (40, 2048, 1100), (33, 9000, 300)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
                .collect();
            let len = scratch_len(1, k as isize, (m, k, n)).expect("runs here");
            let mut scratch = vec![0.0; len];
            let mut chunked = vec![0.0; m * n];
            // SAFETY: `a` is `m × k` row-major, `w` holds `n` rows of `k`; AVX-512 F checked above.
            unsafe {
                product(
                    &a,
                    (k as isize, 1),
                    &w,
                    k,
                    (m, k, n),
                    &mut chunked,
                    &mut scratch,
                    Parallelism::Rayon(0),
                )
            };
            let mut whole = vec![0.0; m * n];
            // SAFETY: the same operands, `w` read as `Wᵀ` (`rhs_rs` 1, `rhs_cs` `k`).
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    whole.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    w.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::Rayon(0),
                )
            };
            assert!(
                chunked
                    .iter()
                    .zip(&whole)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m} x {k} x {n}: the chunks differ from the single call"
            );
            // And against an f64 product, so that both are checked.
            for (i, row) in chunked.chunks(n).enumerate() {
                for (j, &y) in row.iter().enumerate() {
                    let exact: f64 = (0..k)
                        .map(|c| a[i * k + c] as f64 * w[j * k + c] as f64)
                        .sum();
                    let scale: f64 = (0..k)
                        .map(|c| (a[i * k + c] as f64 * w[j * k + c] as f64).abs())
                        .sum();
                    assert!(
                        (y as f64 - exact).abs() <= 1e-5 * scale + 1e-6,
                        "({i}, {j})"
                    );
                }
            }
        }
    }
}
