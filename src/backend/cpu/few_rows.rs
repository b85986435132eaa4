//! `f32` products of a few rows by a weight used transposed — decoding's `x Wᵀ` with one row per
//! sequence — streaming the weight once for every row, on every core.
//!
//! A `Linear` reads its weight `[n, k]` transposed, so each output column is the dot product of a
//! token's row with one contiguous weight row. For a handful of tokens the product is bounded by
//! reading the weight from memory, not by arithmetic; `gemm`'s matrix-vector path ran on one core
//! and reached 46 % of the machine's read bandwidth in batch-1 decoding. Here the weight rows are
//! split into tasks of about 96 KiB, which every thread pulls from one counter ([`by_weight_rows`]);
//! a task walks [`ROWS`] weight rows at a time along `k`, each 16 (AVX-512) or 8 (AVX2) floats
//! multiplied into the accumulators of every token, so each weight byte is loaded once however many
//! tokens there are (up to [`MAX_ROWS`]).
//!
//! Every row's sum is computed the same way whatever the other rows are (per tile of [`K_TILE`]
//! floats: lane partial sums in `k` order, the lanes added; then the tiles in order), so a sequence
//! decodes to the same bits alone or batched.
//!
//! Dispatched at run time: AVX-512F, else AVX2 with FMA, else a portable loop (CPUs without AVX2;
//! valgrind, whose CPU model lacks AVX-512, runs the AVX2 kernel).

use std::marker::PhantomData;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

/// The most left-operand rows (tokens) this path takes; above it `gemm`'s packed kernels win.
pub(super) const MAX_ROWS: usize = 16;
/// Tokens per pass over a group of weight rows: their accumulators stay in registers.
const TOKENS_PER_PASS: usize = 8;
/// Weight rows walked together: several independent accumulator chains per token.
const ROWS: usize = 4;
/// Floats of `k` per pass: the tokens' slices of one pass (8 × 2 KiB) and the weight rows' (4 × 2
/// KiB) stay in L1 while every token and row meets every other, however wide the rows (eight
/// tokens of an 8,192-wide row are 256 KiB). On the 2-core AMD machine the tiling measured neither
/// faster nor slower at 8 tokens of 2,048 (the tokens then fit L2); it bounds the working set.
const K_TILE: usize = 512;
/// Weight bytes per task (rounded to whole groups of [`ROWS`] rows): small, so that the threads
/// pulling tasks end close together, and long enough (a run of whole rows, one sequential stream) for
/// the prefetchers.
const TASK_BYTES: usize = 96 << 10;
/// Products whose weight is smaller than this run on the calling thread.
const PARALLEL_BYTES: usize = 256 << 10;

/// The vector instructions the kernel uses, found once per call (`std` caches the detection).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    pub(super) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}

/// `out = x wᵀ` for `x` `m × k` (row `t` at `x[t * ldx..]`, contiguous along `k`), `w` `n × k` (row
/// `j` at `w[j * ldw..]`, contiguous along `k`) and `out` contiguous `m × n`, with `1 <= m <=
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
            && ldw >= k
            && x.len() >= (m - 1) * ldx + k
            && (n == 0 || w.len() >= (n - 1) * ldw + k)
            && out.len() == m * n,
        "few-rows product: operands do not fit their shape"
    );
    if n == 0 {
        return;
    }
    // The tokens packed contiguously (`m · k` floats: small), so every pass reads them alike.
    let packed: Vec<f32> = (0..m)
        .flat_map(|t| x[t * ldx..t * ldx + k].iter().copied())
        .collect();
    let isa = Isa::detect();
    let rows_per_task = (TASK_BYTES / (4 * k)).max(1).next_multiple_of(ROWS);
    let parallel = n * k * 4 >= PARALLEL_BYTES;
    by_weight_rows((m, n), rows_per_task, parallel, out, |mut columns| {
        let (first, rows) = (columns.first(), columns.len());
        block_product(
            isa,
            &packed,
            k,
            m,
            &w[first * ldw..],
            ldw,
            rows,
            &mut columns,
        );
    });
}

/// Fills `out` (`m × n`, contiguous) by tasks of `rows_per_task` weight rows — on rayon's threads
/// when `parallel` —, each calling `block` with its [`Columns`]: the weight rows `first..first +
/// len`, whose sums it writes straight into their columns of `out`. Shared by the products that
/// stream a weight once for every token (`f32` here, the quantized formats in `quant_product`).
pub(super) fn by_weight_rows(
    (m, n): (usize, usize),
    rows_per_task: usize,
    parallel: bool,
    out: &mut [f32],
    block: impl Fn(Columns<'_>) + Sync,
) {
    let columns = Columns::new(out, m, n);
    if !parallel {
        block(columns);
        return;
    }
    for_each_task(columns.split(rows_per_task), true, block);
}

/// Runs `task` on every item of `tasks` — on rayon's threads when `parallel`, else in order on the
/// calling thread.
pub(super) fn for_each_task<T: Send>(tasks: Vec<T>, parallel: bool, task: impl Fn(T) + Sync) {
    if !parallel || tasks.len() < 2 {
        tasks.into_iter().for_each(task);
        return;
    }
    super::warm::hold();
    // Every thread pulls the next task from one counter until none is left, so the threads finish
    // within a task of each other however their speeds differ, and the caller waits at the end for
    // at most the helpers' last tasks (a helper no thread took runs on the caller and finds nothing
    // left). Rayon's splitting of the same tasks ended with one thread idle for 6-9 % of each
    // product (a 512 KiB task apart, then woken from sleep): BENCHMARKS.md, twentieth measurement.
    let tasks: Vec<Mutex<Option<T>>> = tasks.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let next = AtomicUsize::new(0);
    let pull = || {
        while let Some(slot) = tasks.get(next.fetch_add(1, Ordering::Relaxed)) {
            // Each index is handed out once, so the slot is full; the lock is released before
            // the task runs (a panicking task poisons nothing).
            let item = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(item) = item {
                task(item);
            }
        }
    };
    let pull = &pull;
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads().min(tasks.len()) {
            s.spawn(move |_| pull());
        }
        pull();
    });
}

/// The output columns `first..first + len` of an `m × n` row-major product, for the one task that
/// computes them. [`by_weight_rows`] cuts the output into disjoint column ranges, one `Columns`
/// each, so every task writes its sums straight into place: no buffer to zero and no transposition
/// after (together 4-5 % of a batched decoding step, measured on a quantized Llama).
pub(super) struct Columns<'a> {
    out: *mut f32,
    m: usize,
    n: usize,
    first: usize,
    len: usize,
    _out: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `Columns` writes only the elements of its own columns (`set_column` and `set_run`
// check the bounds); `split` hands each column range to one `Columns`, which is neither `Clone`
// nor `Sync`, and the output's exclusive borrow is held for `'a`, so moving one to another thread
// shares nothing.
unsafe impl Send for Columns<'_> {}

impl<'a> Columns<'a> {
    /// Every column of `out`, `m` rows of `n`.
    ///
    /// # Panics
    /// When `out` is not `m · n` long.
    pub(super) fn new(out: &'a mut [f32], m: usize, n: usize) -> Columns<'a> {
        assert_eq!(out.len(), m * n, "product output: not m x n");
        Columns {
            out: out.as_mut_ptr(),
            m,
            n,
            first: 0,
            len: n,
            _out: PhantomData,
        }
    }

    /// The columns cut into ranges of `width` (the last one shorter), in order.
    pub(super) fn split(self, width: usize) -> Vec<Columns<'a>> {
        assert!(width >= 1);
        (self.first..self.first + self.len)
            .step_by(width)
            .map(|first| Columns {
                first,
                len: width.min(self.first + self.len - first),
                ..self
            })
            .collect()
    }

    /// The first column: the index of the first weight row this task multiplies.
    pub(super) fn first(&self) -> usize {
        self.first
    }

    /// How many columns (weight rows) this task fills.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// `out[t0 + i][first + c] = sums[i]`: one weight row's sums for tokens `t0..t0 + sums.len()`.
    ///
    /// # Panics
    /// When column `c` or one of the tokens lies outside this range.
    pub(super) fn set_column(&mut self, c: usize, t0: usize, sums: &[f32]) {
        assert!(
            c < self.len && t0 + sums.len() <= self.m,
            "product output: a column outside the task's columns"
        );
        for (t, &s) in (t0..).zip(sums) {
            // SAFETY: `t < m` and `first + c < first + len <= n` (checked above): the element is
            // inside the `m × n` output, in this task's columns.
            unsafe { *self.out.add(t * self.n + self.first + c) = s };
        }
    }

    /// `out[t][first + c..first + c + run.len()] = run`: token `t`'s sums for consecutive weight
    /// rows.
    ///
    /// # Panics
    /// When the run or the token lies outside this range.
    pub(super) fn set_run(&mut self, t: usize, c: usize, run: &[f32]) {
        assert!(
            t < self.m && c + run.len() <= self.len,
            "product output: a run outside the task's columns"
        );
        // SAFETY: `t < m` and `first + c + run.len() <= first + len <= n` (checked above): the run
        // lies inside row `t` of the output, in this task's columns; `run` is a different slice
        // (the output is exclusively borrowed by this `Columns`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                run.as_ptr(),
                self.out.add(t * self.n + self.first + c),
                run.len(),
            )
        };
    }
}

/// Column `r` of `columns` (token `t`'s sum at row `t`) `= x_t · w_r` for the `rows` weight rows of
/// `w` (stride `ldw`) and the `m` packed tokens of `x` (`m · k` floats).
#[allow(clippy::too_many_arguments)]
fn block_product(
    isa: Isa,
    x: &[f32],
    k: usize,
    m: usize,
    w: &[f32],
    ldw: usize,
    rows: usize,
    columns: &mut Columns<'_>,
) {
    debug_assert!(columns.len() == rows && w.len() >= (rows - 1) * ldw + k);
    if m == 1 {
        // One token: each weight row whole before the next, so that the task reads one sequential
        // stream (four rows side by side were four streams, which the prefetchers kept fewer lines
        // of in flight). Each row's sum is the same chain of tiles as below.
        for r in 0..rows {
            let row = &w[r * ldw..][..k];
            let mut total = 0.0f32;
            for c0 in (0..k).step_by(K_TILE) {
                let c1 = k.min(c0 + K_TILE);
                total += dot(isa, &x[c0..c1], &row[c0..c1]);
            }
            columns.set_column(r, 0, &[total]);
        }
        return;
    }
    // What the kernels prefetch for several tokens: the groups this task (or the next one) walks
    // after this one.
    let ahead = super::few_rows_ahead(m, ROWS, ldw, size_of::<f32>());
    let mut sums = [[0.0f32; TOKENS_PER_PASS]; ROWS];
    let mut totals = [[0.0f32; MAX_ROWS]; ROWS];
    for r0 in (0..rows).step_by(ROWS) {
        let group = ROWS.min(rows - r0);
        totals.iter_mut().for_each(|t| t.fill(0.0));
        for c0 in (0..k).step_by(K_TILE) {
            let c1 = k.min(c0 + K_TILE);
            let weights: [&[f32]; ROWS] =
                std::array::from_fn(|r| &w[(r0 + r.min(group - 1)) * ldw..][c0..c1]);
            for t0 in (0..m).step_by(TOKENS_PER_PASS) {
                let tokens = TOKENS_PER_PASS.min(m - t0);
                let xs: [&[f32]; TOKENS_PER_PASS] =
                    std::array::from_fn(|t| &x[(t0 + t.min(tokens - 1)) * k..][c0..c1]);
                dots(isa, &xs, tokens, &weights, &mut sums, ahead);
                for (total, part) in totals.iter_mut().zip(&sums) {
                    for (total, part) in total[t0..t0 + tokens].iter_mut().zip(part) {
                        *total += part;
                    }
                }
            }
        }
        for (r, total) in totals.iter().enumerate().take(group) {
            columns.set_column(r0 + r, 0, &total[..m]);
        }
    }
}

/// `sums[r][t] = xs[t] · weights[r]` for `t < tokens` (every slice `k` long; the slots past
/// `tokens` repeat the last token and are not read by the caller). `ahead`: how many floats past
/// each weight slice's position the vector kernels prefetch (0: none).
fn dots(
    isa: Isa,
    xs: &[&[f32]; TOKENS_PER_PASS],
    tokens: usize,
    weights: &[&[f32]; ROWS],
    sums: &mut [[f32; TOKENS_PER_PASS]; ROWS],
    ahead: usize,
) {
    let k = weights[0].len();
    assert!(
        xs.iter().all(|x| x.len() == k) && weights.iter().all(|w| w.len() == k),
        "few-rows product: rows of unequal length"
    );
    // One instantiation per token count and rows per call: the accumulators (tokens × rows
    // vectors) are a fixed array the compiler keeps in registers — at most 16 of AVX-512's 32 and 8
    // of AVX2's 16, beside the loaded tokens.
    macro_rules! call {
        ($kernel:ident, $t:literal, $r:literal) => {
            for (w, s) in weights.chunks_exact($r).zip(sums.chunks_exact_mut($r)) {
                let (w, s) = (w.try_into().expect("R rows"), s.try_into().expect("R rows"));
                $kernel::<$t, $r>(xs, w, s, ahead);
            }
        };
    }
    macro_rules! by_tokens {
        ($kernel:ident, $($t:literal => $r:literal),*) => {
            match tokens {
                $($t => call!($kernel, $t, $r),)*
                _ => unreachable!("1 to {TOKENS_PER_PASS} tokens per pass"),
            }
        };
    }
    assert!((1..=TOKENS_PER_PASS).contains(&tokens));
    match isa {
        // SAFETY: `Isa::detect` returned `Avx512` only where the CPU has AVX-512F; the assertion
        // above gives every slice the same length `k`, which is all the kernel reads.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe {
            by_tokens!(dots_avx512, 1 => 4, 2 => 4, 3 => 4, 4 => 4, 5 => 2, 6 => 2, 7 => 2, 8 => 2)
        },
        // SAFETY: `Avx2` only where the CPU has AVX2 and FMA; slices as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            by_tokens!(dots_avx2, 1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1)
        },
        Isa::Portable => {
            by_tokens!(dots_portable, 1 => 4, 2 => 4, 3 => 4, 4 => 4, 5 => 4, 6 => 4, 7 => 4, 8 => 4)
        }
    }
}

/// `x · w` by the kernel of `isa`, with the bits [`dots`] gives the same row and token.
fn dot(isa: Isa, x: &[f32], w: &[f32]) -> f32 {
    assert_eq!(x.len(), w.len(), "few-rows product: rows of unequal length");
    let xs = [x; TOKENS_PER_PASS];
    let mut sums = [[0.0f32; TOKENS_PER_PASS]; 1];
    match isa {
        // SAFETY: `Isa::detect` returned `Avx512` only where the CPU has AVX-512F; both slices
        // have the same length (asserted), which is all the kernel reads.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { dots_avx512::<1, 1>(&xs, &[w], &mut sums, 0) },
        // SAFETY: `Avx2` only where the CPU has AVX2 and FMA; slices as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dots_avx2::<1, 1>(&xs, &[w], &mut sums, 0) },
        Isa::Portable => dots_portable::<1, 1>(&xs, &[w], &mut sums, 0),
    }
    sums[0][0]
}

/// Lanes of the portable kernel's partial sums (the compiler may vectorise them).
const PORTABLE_LANES: usize = 8;

fn dots_portable<const T: usize, const R: usize>(
    xs: &[&[f32]; TOKENS_PER_PASS],
    weights: &[&[f32]; R],
    sums: &mut [[f32; TOKENS_PER_PASS]; R],
    _ahead: usize,
) {
    let k = weights[0].len();
    let mut acc = [[[0.0f32; PORTABLE_LANES]; T]; R];
    let full = k / PORTABLE_LANES * PORTABLE_LANES;
    for c in (0..full).step_by(PORTABLE_LANES) {
        for (acc, w) in acc.iter_mut().zip(weights) {
            let w = &w[c..c + PORTABLE_LANES];
            for (acc, x) in acc.iter_mut().zip(xs) {
                let x = &x[c..c + PORTABLE_LANES];
                for l in 0..PORTABLE_LANES {
                    acc[l] = x[l].mul_add(w[l], acc[l]);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, lanes) in acc.iter().enumerate() {
            let mut s = pairwise(lanes);
            for c in full..k {
                s = xs[t][c].mul_add(weights[r][c], s);
            }
            sums[r][t] = s;
        }
    }
}

/// The lanes added pairwise (the order the AVX2 kernel's reduction uses).
fn pairwise(lanes: &[f32; PORTABLE_LANES]) -> f32 {
    let [a, b, c, d, e, f, g, h] = *lanes;
    let (a, b, c, d) = (a + e, b + f, c + g, d + h);
    let (a, b) = (a + c, b + d);
    a + b
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn dots_avx512<const T: usize, const R: usize>(
    xs: &[&[f32]; TOKENS_PER_PASS],
    weights: &[&[f32]; R],
    sums: &mut [[f32; TOKENS_PER_PASS]; R],
    ahead: usize,
) {
    use std::arch::x86_64::{
        __m512, _MM_HINT_T1, _mm_prefetch, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_maskz_loadu_ps,
        _mm512_reduce_add_ps, _mm512_setzero_ps,
    };
    const LANES: usize = 16;
    let k = weights[0].len();
    let mut acc: [[__m512; T]; R] = [[_mm512_setzero_ps(); T]; R];
    let full = k / LANES * LANES;
    let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
    let wp: [*const f32; R] = std::array::from_fn(|r| weights[r].as_ptr());
    for c in (0..full).step_by(LANES) {
        // SAFETY: `dots` checked every slice is `k` long and `c + 16 <= full <= k`: each 64-byte
        // load at `c` stays inside its slice; `loadu` needs no alignment. (Pointers rather than
        // slice indexing: no bounds check per load in the loop that bounds decoding.)
        let x: [__m512; T] = std::array::from_fn(|t| unsafe { _mm512_loadu_ps(xp[t].add(c)) });
        for (acc, w) in acc.iter_mut().zip(&wp) {
            // With several tokens, ask for the weight's line `ahead` floats on
            // ([`super::few_rows_ahead`]): the hardware prefetcher alone kept too few lines in
            // flight once the tokens' arithmetic slowed the walk. One token walks fast enough for
            // it, and there prefetches cost: on Zen 4 a row streamed at 23.5-26.4 GiB/s with them
            // and 27.1-32.0 without (BENCHMARKS.md, issue 37). A prefetch past the weight's end is
            // harmless (it never faults), so the address is formed with `wrapping_add` and needs
            // no bounds.
            if T > 1 && ahead > 0 {
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(c + ahead).cast());
            }
            // SAFETY: as above.
            let w = unsafe { _mm512_loadu_ps(w.add(c)) };
            for (acc, x) in acc.iter_mut().zip(&x) {
                *acc = _mm512_fmadd_ps(*x, w, *acc);
            }
        }
    }
    if full < k {
        // The last `k - full < 16` floats: masked loads read only those (masked-off lanes do not
        // touch memory and load zero).
        let mask = (1u16 << (k - full)) - 1;
        // SAFETY: the mask selects the elements `full..k`, inside every slice.
        let x: [__m512; T] =
            std::array::from_fn(|t| unsafe { _mm512_maskz_loadu_ps(mask, xs[t][full..].as_ptr()) });
        for (acc, w) in acc.iter_mut().zip(weights) {
            // SAFETY: as above.
            let w = unsafe { _mm512_maskz_loadu_ps(mask, w[full..].as_ptr()) };
            for (acc, x) in acc.iter_mut().zip(&x) {
                *acc = _mm512_fmadd_ps(*x, w, *acc);
            }
        }
    }
    for (sums, acc) in sums.iter_mut().zip(&acc) {
        for (s, acc) in sums.iter_mut().zip(acc) {
            *s = _mm512_reduce_add_ps(*acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dots_avx2<const T: usize, const R: usize>(
    xs: &[&[f32]; TOKENS_PER_PASS],
    weights: &[&[f32]; R],
    sums: &mut [[f32; TOKENS_PER_PASS]; R],
    ahead: usize,
) {
    use std::arch::x86_64::{
        __m256, _MM_HINT_T1, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehl_ps, _mm_prefetch,
        _mm_shuffle_ps, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm256_fmadd_ps,
        _mm256_loadu_ps, _mm256_setzero_ps,
    };
    const LANES: usize = 8;
    let k = weights[0].len();
    let mut acc: [[__m256; T]; R] = [[_mm256_setzero_ps(); T]; R];
    let full = k / LANES * LANES;
    let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
    let wp: [*const f32; R] = std::array::from_fn(|r| weights[r].as_ptr());
    for c in (0..full).step_by(LANES) {
        // SAFETY: `dots` checked every slice is `k` long and `c + 8 <= full <= k`: each 32-byte load
        // at `c` stays inside its slice; `loadu` needs no alignment.
        let x: [__m256; T] = std::array::from_fn(|t| unsafe { _mm256_loadu_ps(xp[t].add(c)) });
        for (acc, w) in acc.iter_mut().zip(&wp) {
            // As in `dots_avx512`: with several tokens, the line `ahead` floats on, once a line
            // (every other vector).
            if T > 1 && ahead > 0 && c % (2 * LANES) == 0 {
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(c + ahead).cast());
            }
            // SAFETY: as above.
            let w = unsafe { _mm256_loadu_ps(w.add(c)) };
            for (acc, x) in acc.iter_mut().zip(&x) {
                *acc = _mm256_fmadd_ps(*x, w, *acc);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, acc) in acc.iter().enumerate() {
            // Lanes added pairwise: (0..4) + (4..8), then halves, then the last pair.
            let v = _mm_add_ps(
                _mm256_castps256_ps128(*acc),
                _mm256_extractf128_ps::<1>(*acc),
            );
            let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            let v = _mm_add_ss(v, _mm_shuffle_ps::<0b01>(v, v));
            let mut s = _mm_cvtss_f32(v);
            for c in full..k {
                s = xs[t][c].mul_add(weights[r][c], s);
            }
            sums[r][t] = s;
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The f64 product `x w` (`m × n`), for comparison: token `t`'s element `c` at `x[t * ldx + c]`,
    /// the weight's element for `c` and output `j` at `w[c * along_k + j * along_n]`.
    pub(in crate::backend::cpu) fn reference(
        x: &[f32],
        ldx: usize,
        w: &[f32],
        (along_k, along_n): (usize, usize),
        (m, k, n): (usize, usize, usize),
    ) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for t in 0..m {
            for j in 0..n {
                out[t * n + j] = (0..k)
                    .map(|c| f64::from(x[t * ldx + c]) * f64::from(w[c * along_k + j * along_n]))
                    .sum();
            }
        }
        out
    }

    /// The paths this CPU has, the portable one first.
    pub(in crate::backend::cpu) fn isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
            } else {
                println!("few-row products: the AVX2 kernels not run (this CPU lacks AVX2 or FMA)");
            }
            if std::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            } else {
                println!("few-row products: the AVX-512 kernels not run (this CPU lacks AVX-512F)");
            }
        }
        isas
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 - 1001.0) / 997.0)
            .collect()
    }

    /// Every instruction set this CPU has, on odd shapes (tails of every length below a vector,
    /// weight-row groups cut short, token counts across a pass), strided operands, and products
    /// large enough to run in parallel.
    #[test]
    fn every_path_matches_the_f64_product() {
        for isa in isas() {
            for (m, k, n) in [
                (1, 1, 1),
                (1, 17, 5),
                (3, 31, 9),
                (8, 64, 7),
                (9, 100, 13),
                (16, 15, 6),
                (5, 257, 3),
                (1, 1100, 9),
                (2, 1100, 5),
            ] {
                let (ldx, ldw) = (k + 3, k + 1);
                let x = values(m * ldx, 1);
                let w = values(n * ldw, 2);
                let mut packed = Vec::new();
                for t in 0..m {
                    packed.extend_from_slice(&x[t * ldx..t * ldx + k]);
                }
                let mut dst = vec![f32::NAN; m * n];
                block_product(
                    isa,
                    &packed,
                    k,
                    m,
                    &w,
                    ldw,
                    n,
                    &mut Columns::new(&mut dst, m, n),
                );
                let want = reference(&x, ldx, &w, (1, ldw), (m, k, n));
                for t in 0..m {
                    for j in 0..n {
                        let (got, want) = (f64::from(dst[t * n + j]), want[t * n + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                            "{isa:?} {m}x{k}x{n} [{t},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
        // Through `product` (detected path), large enough for rayon.
        let (m, k, n) = (5, 1000, 300);
        let (x, w) = (values(m * k, 3), values(n * k, 4));
        let mut out = vec![0.0; m * n];
        product(&x, k, &w, k, (m, k, n), &mut out);
        let want = reference(&x, k, &w, (1, k), (m, k, n));
        for (g, w) in out.iter().zip(&want) {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{g} vs {w}"
            );
        }
    }

    /// The tasks' column ranges cover the output once, in order, and each writes only its own.
    #[test]
    fn columns_split_into_ranges_that_cover_the_output_once() {
        let (m, n) = (3, 10);
        let mut out = vec![f32::NAN; m * n];
        let tasks = Columns::new(&mut out, m, n).split(4);
        assert_eq!(
            tasks
                .iter()
                .map(|c| (c.first(), c.len()))
                .collect::<Vec<_>>(),
            [(0, 4), (4, 4), (8, 2)]
        );
        for mut task in tasks {
            for c in 0..task.len() {
                let j = (task.first() + c) as f32;
                task.set_column(c, 0, &[j, 100.0 + j, 200.0 + j]);
            }
        }
        // Row t, column j holds 100 t + j. (Built by plain loops: valgrind's memcheck on a Zen 3
        // flagged the `flat_map` collect's size hint as a jump on an uninitialised value.)
        let mut want = Vec::with_capacity(m * n);
        for t in 0..m {
            for j in 0..n {
                want.push(100.0 * t as f32 + j as f32);
            }
        }
        assert_eq!(out, want);
    }

    #[test]
    #[should_panic(expected = "outside the task's columns")]
    fn a_task_cannot_write_past_its_columns() {
        let mut out = vec![0.0; 2 * 8];
        let mut tasks = Columns::new(&mut out, 2, 8).split(4);
        tasks[0].set_run(1, 2, &[1.0, 2.0, 3.0]);
    }

    /// A row's sum does not depend on the other rows: decoding alone or batched gives the same bits.
    #[test]
    fn a_row_gets_the_same_bits_alone_or_with_others() {
        // Rows of three `K_TILE` tiles, the last one short.
        let (k, n) = (1100, 70);
        let x = values(16 * k, 5);
        let w = values(n * k, 6);
        let mut alone = vec![0.0; n];
        product(&x[3 * k..], k, &w, k, (1, k, n), &mut alone);
        for m in [4, 9, 16] {
            let mut batched = vec![0.0; m * n];
            product(&x, k, &w, k, (m, k, n), &mut batched);
            let row3: Vec<u32> = batched[3 * n..4 * n].iter().map(|v| v.to_bits()).collect();
            assert_eq!(
                row3,
                alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "m = {m}"
            );
        }
    }
}
