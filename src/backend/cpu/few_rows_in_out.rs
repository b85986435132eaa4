//! `f32` products of a few rows by a weight stored `[in, out]` — decoding's `x W` with `W` read
//! along its outputs (GPT-2's `Conv1D` layout, [`WeightLayout::InOut`](crate::nn::WeightLayout)) —
//! streaming the weight once for every row, on every core.
//!
//! [`few_rows`](super::few_rows) streams a weight used transposed, where every output is a dot
//! product along a contiguous weight row. Here weight row `r` is contiguous along the outputs, so
//! the weight is cut into [`BLOCKS`] *blocks* of whole rows and its outputs into *chunks* of at
//! most [`CHUNK_COLUMNS`] columns. A task multiplies one block's rows of one chunk into partial sums
//! of its own (every token's outputs of the chunk), walking [`ROWS`] rows at a time along the
//! chunk and adding `x[t][r] · W[r][j]` into every token's sums — each weight vector loaded once
//! however many tokens there are (up to [`MAX_ROWS`]). The task that finishes a chunk's last block
//! adds the chunk's partial sums in block order and writes them out.
//!
//! Why rows: this module first gave each task a strip of at most 512 output columns, walked down
//! all `k` rows with its sums in registers. A strip reads a short run of every weight row, the runs
//! a whole weight row apart, and on the 2-core Zen 4 machine those streamed at 20-22 GiB/s whatever
//! the strip's width or prefetch distance; [`ROWS`] runs of a chunk's full width are sequential
//! streams the hardware prefetcher follows: 27-30 GiB/s for one token, 22 for eight, where the
//! strips made 15 (`cargo bench --bench quant -- streamed/f32_in_out`, BENCHMARKS.md, issue 37).
//! The price is the sums' cache traffic (`m` vectors loaded and stored per [`ROWS`] weight
//! vectors) and the partial sums (`m · n` floats per block): small for a few tokens.
//!
//! Every output is computed the same way whatever the other rows and columns are and whichever
//! kernel runs: per block, one chain of fused multiply-adds over its rows in order from zero; then
//! the blocks' sums added in order. The blocks depend on the weight's shape only ([`block_rows`];
//! one block below [`PARALLEL_BYTES`]), and the chunks, which change no sum, on `n` and the
//! threads; so a request decodes to the same bits alone or batched on any number of threads, and
//! the AVX-512, AVX2 and portable kernels agree to the bit (unit-tested). Dispatched at run time
//! like [`few_rows`](super::few_rows) (the portable kernel's `mul_add` is a library call on x86
//! CPUs without FMA, which are also without AVX2: slow there, but exact).

use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use super::few_rows::{Columns, Isa, MAX_ROWS, for_each_task};

/// Weight rows a kernel step adds into the partial sums: eight sequential streams, and the sums
/// loaded and stored once per eight rows (four rows made eight tokens' walk 22 % slower on Zen 4:
/// 17.5-18.7 GiB/s against 21.9-22.3; one token's the same).
const ROWS: usize = 8;
/// The blocks of rows a weight is cut into (fewer where it has fewer than `BLOCKS · ROWS` rows):
/// the tasks of narrow weights (GPT-2 small's 768 to 3,072 outputs are one chunk each), few enough
/// that the partial sums cost little.
const BLOCKS: usize = 8;
/// The widest chunk of output columns one task takes: 16 KiB of each weight row (2,048 and 1,024
/// columns streamed the same within the noise).
const CHUNK_COLUMNS: usize = 4096;
/// Products whose weight is smaller than this run on the calling thread, in one block.
const PARALLEL_BYTES: usize = 256 << 10;
/// Columns per vector on the widest path.
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
    let rows = if n * k * 4 >= PARALLEL_BYTES {
        block_rows(k)
    } else {
        k
    };
    product_on(Isa::detect(), rows, x, ldx, w, ldw, (m, k, n), out);
}

/// [`product`] with the kernel `isa` (one the CPU has) and blocks of `rows` rows: one block (where
/// `rows` is at least `k`) sums straight into `out` on the calling thread; several run as tasks on
/// rayon's threads. Small weights take one block, which allocates nothing: a chain over every row
/// is as exact, and the bits still depend on the weight's shape only.
#[allow(clippy::too_many_arguments)]
fn product_on(
    isa: Isa,
    rows: usize,
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
    // With several tokens, the kernels ask for the weight the same columns of rows whole steps
    // further on, as `few_rows` does ([`super::few_rows_ahead`]); one token's walk is left to the
    // hardware prefetcher.
    let ahead = super::few_rows_ahead(m, ROWS, ldw, size_of::<f32>());
    let block = Block {
        x,
        ldx,
        m,
        w,
        ldw,
        ahead,
    };
    if rows >= k {
        out.fill(0.0);
        block.sum_rows(isa, 0..k, 0..n, out);
        return;
    }
    let blocks = k.div_ceil(rows);
    let columns =
        Columns::new(out, m, n).split(chunk_columns(n, blocks, rayon::current_num_threads()));
    let ranges: Vec<Range<usize>> = columns
        .iter()
        .map(|c| c.first()..c.first() + c.len())
        .collect();
    let chunks: Vec<Mutex<Chunk<'_>>> = columns
        .into_iter()
        .map(|columns| {
            Mutex::new(Chunk {
                out: Some(columns),
                sums: (0..blocks).map(|_| None).collect(),
            })
        })
        .collect();
    // Chunk by chunk, so that the first chunks' sums are added while later ones are multiplied.
    let tasks: Vec<(usize, usize)> = (0..chunks.len())
        .flat_map(|c| (0..blocks).map(move |b| (c, b)))
        .collect();
    for_each_task(tasks, true, |(c, b)| {
        let (chunk, cols) = (&chunks[c], ranges[c].clone());
        let mut sums = vec![0.0f32; m * cols.len()];
        block.sum_rows(
            isa,
            b * rows..k.min((b + 1) * rows),
            cols.clone(),
            &mut sums,
        );
        let last = {
            let mut chunk = chunk.lock().unwrap_or_else(PoisonError::into_inner);
            chunk.sums[b] = Some(sums);
            if chunk.sums.iter().all(Option::is_some) {
                Some((chunk.out.take(), std::mem::take(&mut chunk.sums)))
            } else {
                None
            }
        };
        // The task that brings a chunk's last block adds all its blocks, in block order.
        if let Some((Some(mut out), sums)) = last {
            let mut sums = sums.into_iter().flatten();
            let mut total = sums.next().expect("every chunk has a block");
            for partial in sums {
                for (t, p) in total.iter_mut().zip(&partial) {
                    *t += p;
                }
            }
            for (t, run) in total.chunks_exact(cols.len()).enumerate() {
                out.set_run(t, 0, run);
            }
        }
    });
}

/// One chunk of output columns: where its sums go, and each block's partial sums (`m × width`) as
/// they come in.
struct Chunk<'a> {
    out: Option<Columns<'a>>,
    sums: Vec<Option<Vec<f32>>>,
}

/// The rows of each of the [`BLOCKS`] blocks of a weight of `k` rows, a multiple of [`ROWS`]: a
/// function of `k` only, so the order of every output's sum is too.
fn block_rows(k: usize) -> usize {
    k.div_ceil(BLOCKS).next_multiple_of(ROWS)
}

/// The columns of each chunk of `n` outputs, for `blocks` blocks on `threads` threads: at most
/// [`CHUNK_COLUMNS`], and chunks enough for two tasks a thread (which shares no bits: a chunk's
/// outputs are the same sums however the columns are cut).
fn chunk_columns(n: usize, blocks: usize, threads: usize) -> usize {
    let chunks = n
        .div_ceil(CHUNK_COLUMNS)
        .max((2 * threads).div_ceil(blocks))
        .min(n.div_ceil(LANES));
    n.div_ceil(chunks).next_multiple_of(LANES)
}

/// One product's operands, as [`product_on`] checked them, and how far ahead (in floats, 0: not
/// at all) the vector kernels ask for the weight.
struct Block<'a> {
    x: &'a [f32],
    ldx: usize,
    m: usize,
    w: &'a [f32],
    ldw: usize,
    ahead: usize,
}

impl Block<'_> {
    /// `sums` (`m × n`, token `t`'s at row `t`) `= Σ_{r ∈ rows} x[t][r] · w[r][..]`, each output one
    /// chain of fused multiply-adds from zero over `rows` in order.
    fn sum_rows(&self, isa: Isa, rows: Range<usize>, cols: Range<usize>, sums: &mut [f32]) {
        let m = self.m;
        let n = cols.len();
        assert!(
            rows.start < rows.end
                && n >= 1
                && sums.len() == m * n
                && self.w.len() >= (rows.end - 1) * self.ldw + cols.end
                && self.x.len() >= (m - 1) * self.ldx + rows.end,
            "few-rows product: a block outside its operands"
        );
        let w = &self.w[cols.start..];
        let mut r = rows.start;
        while r < rows.end {
            let step = if rows.end - r >= ROWS { ROWS } else { 1 };
            if step == ROWS {
                self.add::<ROWS>(isa, w, r, sums);
            } else {
                self.add::<1>(isa, w, r, sums);
            }
            r += step;
        }
    }

    /// Adds rows `r..r + R` of `w` (`sum_rows` checked them) into `sums` with `isa`'s kernel.
    fn add<const R: usize>(&self, isa: Isa, w: &[f32], r: usize, sums: &mut [f32]) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::detect` returned `Avx512` only where the CPU has AVX-512F; `sum_rows`
            // asserted that rows `r..r + R` of `w` (`n` floats each), every token's `x[r..r + R]`
            // and `sums` are in bounds.
            Isa::Avx512 => unsafe { self.add_avx512::<R>(w, r, sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` only where the CPU has AVX2 and FMA; the bounds as above.
            Isa::Avx2 => unsafe { self.add_avx2::<R>(w, r, sums) },
            Isa::Portable => self.add_columns::<R>(w, r, 0, sums),
        }
    }

    /// Token `t`'s multipliers of rows `r..r + R`.
    fn xs<const R: usize>(&self, t: usize, r: usize) -> [f32; R] {
        std::array::from_fn(|i| self.x[t * self.ldx + r + i])
    }

    /// `sums[t][j] = fma(x[t][r + R - 1], w[r + R - 1][j], … fma(x[t][r], w[r][j], sums[t][j]))`
    /// for the columns `j` from `from` on (`sums` is `m × n`; row `r` of `w` at `w[r * ldw..]`): the
    /// portable kernel, and every kernel's columns past its last whole vector.
    fn add_columns<const R: usize>(&self, w: &[f32], r: usize, from: usize, sums: &mut [f32]) {
        let n = sums.len() / self.m;
        let rows: [&[f32]; R] = std::array::from_fn(|i| &w[(r + i) * self.ldw..][..n]);
        for (t, sums) in sums.chunks_exact_mut(n).enumerate() {
            let x = self.xs::<R>(t, r);
            for (j, s) in sums.iter_mut().enumerate().skip(from) {
                let mut a = *s;
                for (row, x) in rows.iter().zip(x) {
                    a = x.mul_add(row[j], a);
                }
                *s = a;
            }
        }
    }

    /// Every token's multipliers of rows `r..r + R` (zeros past the `m` tokens).
    fn token_xs<const R: usize>(&self, r: usize) -> [[f32; R]; MAX_ROWS] {
        let mut xs = [[0.0; R]; MAX_ROWS];
        for (t, xs) in xs.iter_mut().enumerate().take(self.m) {
            *xs = self.xs::<R>(t, r);
        }
        xs
    }

    /// [`Block::add_columns`] for every column, on AVX-512: for each vector of 16 columns (the last
    /// one masked), the `R` weight vectors loaded once, then multiplied into every token's sums.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; rows `r..r + R` of `w` must hold `n = sums.len() / m` floats
    /// each, and `x[t][r..r + R]` must be in bounds for every token.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn add_avx512<const R: usize>(&self, w: &[f32], r: usize, sums: &mut [f32]) {
        use std::arch::x86_64::{
            __m512, _MM_HINT_T1, _mm_prefetch, _mm512_fmadd_ps, _mm512_mask_storeu_ps,
            _mm512_maskz_loadu_ps, _mm512_set1_ps,
        };
        let m = self.m;
        let n = sums.len() / m;
        let rows: [*const f32; R] = std::array::from_fn(|i| w[(r + i) * self.ldw..].as_ptr());
        let xs = self.token_xs::<R>(r);
        let out = sums.as_mut_ptr();
        for j in (0..n).step_by(LANES) {
            let mask = ((1u32 << (n - j).min(LANES)) - 1) as u16;
            if self.ahead > 0 {
                // A hint, which never faults: the address needs no bounds (`wrapping_add`).
                for row in rows {
                    _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(j + self.ahead).cast());
                }
            }
            // SAFETY: the caller's bounds: each row holds `n` floats from its pointer and the mask
            // keeps the lanes below `n - j`; masked-off lanes touch no memory.
            let wv: [__m512; R] =
                std::array::from_fn(|i| unsafe { _mm512_maskz_loadu_ps(mask, rows[i].add(j)) });
            for (t, x) in xs.iter().enumerate().take(m) {
                // SAFETY: `sums` is `m × n` and `t < m`; the mask keeps the lanes below `n`.
                unsafe {
                    let at = out.add(t * n + j);
                    let mut a = _mm512_maskz_loadu_ps(mask, at);
                    for (w, &x) in wv.iter().zip(x) {
                        a = _mm512_fmadd_ps(_mm512_set1_ps(x), *w, a);
                    }
                    _mm512_mask_storeu_ps(at, mask, a);
                }
            }
        }
    }

    /// [`Block::add_avx512`] on AVX2, 8 columns a vector; the columns past the last whole vector go
    /// the portable way (the same chain of fused multiply-adds, so the same bits; and no masked
    /// stores, which valgrind, running this kernel, need not model).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; the bounds as for [`Block::add_avx512`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_avx2<const R: usize>(&self, w: &[f32], r: usize, sums: &mut [f32]) {
        use std::arch::x86_64::{
            __m256, _MM_HINT_T1, _mm_prefetch, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps,
            _mm256_storeu_ps,
        };
        const HALF: usize = LANES / 2;
        let m = self.m;
        let n = sums.len() / m;
        let rows: [*const f32; R] = std::array::from_fn(|i| w[(r + i) * self.ldw..].as_ptr());
        let xs = self.token_xs::<R>(r);
        let whole = n / HALF * HALF;
        let out = sums.as_mut_ptr();
        for j in (0..whole).step_by(HALF) {
            if self.ahead > 0 && j % LANES == 0 {
                // As in `add_avx512`, once a 64-byte line (every other vector).
                for row in rows {
                    _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(j + self.ahead).cast());
                }
            }
            // SAFETY: the caller's bounds: each row holds `n >= j + 8` floats from its pointer.
            let wv: [__m256; R] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(rows[i].add(j)) });
            for (t, x) in xs.iter().enumerate().take(m) {
                // SAFETY: `sums` is `m × n`, `t < m` and `j + 8 <= n`.
                unsafe {
                    let at = out.add(t * n + j);
                    let mut a = _mm256_loadu_ps(at);
                    for (w, &x) in wv.iter().zip(x) {
                        a = _mm256_fmadd_ps(_mm256_set1_ps(x), *w, a);
                    }
                    _mm256_storeu_ps(at, a);
                }
            }
        }
        if whole < n {
            self.add_columns::<R>(w, r, whole, sums);
        }
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

    /// Every path this CPU has, on odd shapes (columns of every count below a vector and across
    /// vectors, token counts up to `MAX_ROWS`), strided operands, in one block and in the blocks
    /// of a large weight (the last one ragged, on rayon's threads); all paths agree to the bit.
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
            (16, 130, 40),
        ] {
            let (ldx, ldw) = (k + 3, n + 5);
            let x = values(m * ldx, 1);
            let w = values(k * ldw, 2);
            let want = reference(&x, ldx, &w, (ldw, 1), (m, k, n));
            let mut first = std::collections::HashMap::new();
            for (&isa, rows) in isas.iter().flat_map(|i| [(i, k), (i, block_rows(k))]) {
                let mut out = vec![f32::NAN; m * n];
                product_on(isa, rows, &x, ldx, &w, ldw, (m, k, n), &mut out);
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    let got = f64::from(got);
                    assert!(
                        (got - want).abs() <= 1e-6 * (1.0 + want.abs()) * k as f64,
                        "{isa:?} {m}x{k}x{n} [{i}]: {got} vs {want}"
                    );
                }
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                match first.get(&rows) {
                    None => drop(first.insert(rows, bits)),
                    Some(first) => assert_eq!(&bits, first, "{isa:?} {m}x{k}x{n}: other bits"),
                }
            }
        }
    }

    /// Blocks are whole groups of `ROWS` cutting the rows into at most `BLOCKS`; chunks are whole
    /// vectors, at most `CHUNK_COLUMNS` wide, and there are about two tasks a thread where the
    /// columns allow (three quarters of that at worst, rounding to whole vectors).
    #[test]
    fn blocks_and_chunks_cover_the_weight_in_enough_tasks() {
        for k in [1, 3, 4, 17, 768, 3072, 4096] {
            let rows = block_rows(k);
            let blocks = k.div_ceil(rows);
            assert!(
                rows.is_multiple_of(ROWS) && blocks <= BLOCKS && (blocks == BLOCKS || rows == ROWS),
                "{k} rows: {blocks} blocks of {rows}"
            );
            for n in [1, 16, 333, 768, 2304, 3072, 8192, 50257] {
                for threads in [1, 2, 16] {
                    let width = chunk_columns(n, blocks, threads);
                    let chunks = n.div_ceil(width);
                    assert!(
                        width.is_multiple_of(LANES)
                            && width <= CHUNK_COLUMNS
                            && 4 * chunks * blocks
                                >= 3 * (2 * threads).min(blocks * n.div_ceil(LANES)),
                        "{k} x {n} on {threads} threads: {chunks} chunks of {width} columns"
                    );
                }
            }
        }
        // GPT-2 small's products on two threads: eight blocks of one chunk.
        assert_eq!(block_rows(768), 96);
        assert_eq!(block_rows(3072), 384);
        assert_eq!(chunk_columns(3072, 8, 2), 3072);
    }

    /// Through `product`: large enough to run on rayon's tasks (eight blocks, the last one shorter),
    /// and a row's outputs depend neither on the other rows nor on the threads (16 threads cut the
    /// columns into four chunks, one or two threads into one).
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
        rayon::ThreadPoolBuilder::new()
            .num_threads(16)
            .build()
            .unwrap()
            .install(|| product(&x[3 * k..], k, &w, n, (1, k, n), &mut alone));
        assert_eq!(
            alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            batched[3 * n..4 * n]
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
    }
}
