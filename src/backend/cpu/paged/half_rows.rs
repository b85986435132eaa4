//! Keys and values kept in 16-bit pages (`f16`, `bf16`), scored and added where they lie: every
//! 16 elements are widened in a register (`vcvtph2ps` for `f16`, a shift for `bf16`) on their way
//! into the multiply-adds the `f32` kernels do, in the same order. So a 16-bit page gives the bits
//! its widened `f32` copy gives, and a decoding step reads the cache once, at half the bytes.
//!
//! Decoding reads them so (a task of a few query rows, on a CPU with AVX-512 F, or with AVX2 and
//! F16C); a prompt's tile of queries, or another CPU, widens each key tile into a buffer once
//! instead. For decoding the buffer cost more than the bytes it saved: eight sequences of 160
//! tokens at GPT-2 small's shape ran 10.9 GiB/s of `f16` pages against 26.8 GiB/s of `f32`
//! (`paged_decode` in `benches/attention.rs`, Zen 5, two threads): each run of a page's rows was
//! read in a burst the prefetches could not keep ahead of. The AVX2 kernels widen 8 elements a
//! register (`vcvtph2ps` is F16C's) and keep the `f32` kernels' 16 lanes in two registers; before
//! them an AVX2-only Zen 3 widened into the buffer, 6 % of eight requests' decoding of GPT-2 small
//! Q4_0 (`widen::f16_f16c`, `widened_tile`; with them the attention's share fell by a third).

use super::{AddWeighted, PageElement, fetch_for};
#[cfg(target_arch = "x86_64")]
use super::{Lanes16, scores_avx512};
#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::rows::LANES;
use crate::backend::cpu::widen::Widen;
use crate::backend::cpu::{avx2_f16c, avx512f};
use crate::dtype::{bf16, f16};

/// The most query rows of a task that read 16-bit pages where they lie (decoding); a prompt's
/// tile of queries widens each key tile once for all its rows instead.
const IN_PLACE_ROWS: usize = 4;

/// The 16-bit element types, by how they widen.
trait Half: Widen + crate::backend::op::Math<Compute = f32> {
    /// `f16` (converted) rather than `bf16` (shifted).
    const F16: bool;
}

impl Half for f16 {
    const F16: bool = true;
}

impl Half for bf16 {
    const F16: bool = false;
}

macro_rules! half_page_element {
    ($t:ty) => {
        impl PageElement for $t {
            fn in_place(rows: usize) -> bool {
                (avx512f() || avx2_f16c()) && rows <= IN_PLACE_ROWS
            }

            #[inline(always)]
            fn scores(
                query: &[f32],
                keys: &[&[$t]],
                values: Option<&[&[$t]]>,
                scale: f32,
                out: &mut [f32],
            ) {
                #[cfg(target_arch = "x86_64")]
                if avx512f() {
                    // SAFETY: the CPU has AVX-512 F, the only feature the kernel is compiled for.
                    unsafe { scores_avx512(query, keys, values, scale, out) };
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if avx2_f16c() {
                    // SAFETY: the CPU has AVX2 and F16C, the features the kernel is compiled for.
                    unsafe { scores_avx2(query, keys, values, scale, out) };
                    return;
                }
                widened_scores(query, keys, values, scale, out);
            }
        }

        impl AddWeighted<f32> for $t {
            #[inline(always)]
            fn add_weighted(out: &mut [f32], weights: &[f32], values: &[&[$t]]) {
                #[cfg(target_arch = "x86_64")]
                if avx512f() {
                    // SAFETY: the CPU has AVX-512 F, the only feature the kernel is compiled for.
                    unsafe { add_weighted_avx512(out, weights, values) };
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if avx2_f16c() {
                    // SAFETY: the CPU has AVX2 and F16C, the features the kernel is compiled for.
                    unsafe { add_weighted_avx2(out, weights, values) };
                    return;
                }
                widened_add_weighted(out, weights, values);
            }
        }
    };
}

half_page_element!(f16);
half_page_element!(bf16);

/// [`PageElement::scores`] on any CPU: each key widened, then the compute type's kernel.
fn widened_scores<H: Half>(
    query: &[f32],
    keys: &[&[H]],
    values: Option<&[&[H]]>,
    scale: f32,
    out: &mut [f32],
) {
    let mut key = vec![0.0f32; query.len()];
    for (j, (o, k)) in out.iter_mut().zip(keys).enumerate() {
        fetch_for(j, keys, values);
        H::widen(&k[..query.len()], &mut key);
        let mut score = [0.0f32];
        <f32 as super::Scores>::scores(query, &[&key], None, scale, &mut score);
        *o = score[0];
    }
}

/// [`AddWeighted::add_weighted`] on any CPU: the values widened, then the compute type's loop.
fn widened_add_weighted<H: Half>(out: &mut [f32], weights: &[f32], values: &[&[H]]) {
    let width = out.len();
    let mut wide = vec![0.0f32; values.len() * width];
    for (w, v) in wide.chunks_mut(width).zip(values) {
        H::widen(&v[..width], w);
    }
    let rows: Vec<&[f32]> = wide.chunks(width).collect();
    super::add_weighted(out, weights, &rows);
}

/// 16 elements from `at` widened to `f32`.
///
/// # Safety
/// The CPU must have AVX-512 F; `at..at + 16` must be readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn wide16<H: Half>(at: *const H) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::{
        _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_cvtph_ps,
        _mm512_slli_epi32,
    };
    // SAFETY: the caller's contract; `loadu` takes any alignment.
    let halves = unsafe { _mm256_loadu_si256(at.cast()) };
    if H::F16 {
        _mm512_cvtph_ps(halves)
    } else {
        // A bf16 is the high half of its f32.
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
    }
}

#[cfg(target_arch = "x86_64")]
impl<H: Half> Lanes16 for H {
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(at: *const H) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { wide16(at) }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tail16(row: &[H], _mask: u16) -> std::arch::x86_64::__m512 {
        let tail = &row[row.len() / 16 * 16..];
        let mut padded = [H::store(0.0); 16];
        padded[..tail.len()].copy_from_slice(tail);
        // SAFETY: the CPU has AVX-512 F; `padded` holds 16 elements.
        unsafe { wide16(padded.as_ptr()) }
    }
}

/// [`AddWeighted::add_weighted`]: the compute type's loop (64 elements of the output in four
/// registers, each value's product then sum, key after key) with each 16 value elements widened
/// as they are loaded; the last `width % 64` elements one at a time, as that loop does them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn add_weighted_avx512<H: Half>(out: &mut [f32], weights: &[f32], values: &[&[H]]) {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_set1_ps, _mm512_storeu_ps,
    };
    const BLOCK: usize = super::BLOCK;
    const { assert!(BLOCK == 64) };
    let width = out.len();
    let mut at = 0;
    for chunk in out.chunks_exact_mut(BLOCK) {
        // SAFETY: the chunk holds 64 elements; `loadu` takes any alignment.
        let mut acc: [_; 4] =
            std::array::from_fn(|l| unsafe { _mm512_loadu_ps(chunk.as_ptr().add(16 * l)) });
        for (&w, v) in weights.iter().zip(values) {
            let (w, v) = (_mm512_set1_ps(w), &v[at..at + BLOCK]);
            for (l, acc) in acc.iter_mut().enumerate() {
                // SAFETY: elements `16 · l..16 · (l + 1)` lie in the 64 of `v`.
                let v = unsafe { wide16(v.as_ptr().add(16 * l)) };
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(w, v));
            }
        }
        for (l, acc) in acc.iter().enumerate() {
            // SAFETY: the chunk holds 64 elements; `storeu` takes any alignment.
            unsafe { _mm512_storeu_ps(chunk.as_mut_ptr().add(16 * l), *acc) };
        }
        at += BLOCK;
    }
    for (e, o) in out[at..width].iter_mut().enumerate() {
        for (&w, v) in weights.iter().zip(values) {
            *o += w * v[at + e].load();
        }
    }
}

/// 8 elements from `at` widened to `f32`.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `at..at + 8` must be readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn wide8<H: Half>(at: *const H) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::{
        _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
        _mm256_slli_epi32,
    };
    // SAFETY: the caller's contract; `loadu` takes any alignment.
    let halves = unsafe { _mm_loadu_si128(at.cast()) };
    if H::F16 {
        _mm256_cvtph_ps(halves)
    } else {
        // A bf16 is the high half of its f32.
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
    }
}

/// [`PageElement::scores`] on AVX2: `rows::dot`'s arithmetic (16 lanes, here two registers, each a
/// product then a sum; the elements after the last full 16 summed one by one first, the lanes
/// then added to that in order), each 8 key elements widened as they are loaded, so the bits of the
/// widened copy's `dot_scores`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn scores_avx2<H: Half>(
    query: &[f32],
    keys: &[&[H]],
    values: Option<&[&[H]]>,
    scale: f32,
    out: &mut [f32],
) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    const { assert!(LANES == 16) };
    let width = query.len();
    let whole = width / LANES * LANES;
    for (j, (o, key)) in out.iter_mut().zip(keys).enumerate() {
        fetch_for(j, keys, values);
        let key = &key[..width];
        let mut dot = 0.0f32;
        for (x, y) in query[whole..].iter().zip(&key[whole..]) {
            dot += x * y.load();
        }
        let mut acc = [_mm256_setzero_ps(); 2];
        for c in (0..whole).step_by(LANES) {
            for (h, acc) in acc.iter_mut().enumerate() {
                // SAFETY: elements `c + 8 · h..c + 8 · (h + 1)` lie in the first `whole` of the
                // query and the key; `loadu` takes any alignment.
                let (x, y) = unsafe {
                    (
                        _mm256_loadu_ps(query.as_ptr().add(c + 8 * h)),
                        wide8(key.as_ptr().add(c + 8 * h)),
                    )
                };
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, y));
            }
        }
        let mut lanes = [0.0f32; LANES];
        // SAFETY: `lanes` holds 16 floats; `storeu` takes any alignment.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
        }
        for lane in lanes {
            dot += lane;
        }
        *o = scale * dot;
    }
}

/// [`AddWeighted::add_weighted`] on AVX2: the compute type's loop (64 elements of the output, here
/// in eight registers, each value's product then sum, key after key) with each 8 value elements
/// widened as they are loaded; the last `width % 64` elements one at a time, as that loop does them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn add_weighted_avx2<H: Half>(out: &mut [f32], weights: &[f32], values: &[&[H]]) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };
    const BLOCK: usize = super::BLOCK;
    const { assert!(BLOCK == 64) };
    let width = out.len();
    let mut at = 0;
    for chunk in out.chunks_exact_mut(BLOCK) {
        let mut acc = [_mm256_setzero_ps(); 8];
        for (l, acc) in acc.iter_mut().enumerate() {
            // SAFETY: the chunk holds 64 elements; `loadu` takes any alignment.
            *acc = unsafe { _mm256_loadu_ps(chunk.as_ptr().add(8 * l)) };
        }
        for (&w, v) in weights.iter().zip(values) {
            let (w, v) = (_mm256_set1_ps(w), &v[at..at + BLOCK]);
            for (l, acc) in acc.iter_mut().enumerate() {
                // SAFETY: elements `8 · l..8 · (l + 1)` lie in the 64 of `v`.
                let v = unsafe { wide8(v.as_ptr().add(8 * l)) };
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(w, v));
            }
        }
        for (l, acc) in acc.iter().enumerate() {
            // SAFETY: the chunk holds 64 elements; `storeu` takes any alignment.
            unsafe { _mm256_storeu_ps(chunk.as_mut_ptr().add(8 * l), *acc) };
        }
        at += BLOCK;
    }
    for (e, o) in out[at..width].iter_mut().enumerate() {
        for (&w, v) in weights.iter().zip(values) {
            *o += w * v[at + e].load();
        }
    }
}
