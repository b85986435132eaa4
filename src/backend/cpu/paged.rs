//! Host attention over a paged KV cache, and the writes that fill the pages ([`PagedAttention`]
//! states the math; [`PageGeometry`] the page layout).
//!
//! One task per sequence, head and query walks the pages of its sequence in order. A page holds a
//! head's keys (and values) as `tokens × width` consecutive elements, so each page is one short
//! matrix–vector product against a running maximum: the same online softmax as fused attention, with
//! the page as the key tile. Decoding reads every cached byte once; that read is the whole cost.

use std::borrow::Cow;

use rayon::prelude::*;

use super::rows::{self, Real};
use crate::backend::op::{Math, PagedAttention};
use crate::backend::{Buf, Dst, PageGeometry, PageRows, PagedSeqs, Src};
use crate::dtype::{DType, Element, bf16, f16};

/// Multiply-adds below which one thread does the whole call.
const PARALLEL_WORK: usize = 1 << 17;

pub(super) fn attention(
    dtype: DType,
    math: &PagedAttention,
    geometry: PageGeometry,
    q: Src,
    seqs: PagedSeqs,
    out: Dst,
) {
    match dtype {
        DType::F32 => attention_as::<f32>(math, geometry, q, seqs, out),
        DType::F64 => attention_as::<f64>(math, geometry, q, seqs, out),
        DType::BF16 => attention_as::<bf16>(math, geometry, q, seqs, out),
        DType::F16 => attention_as::<f16>(math, geometry, q, seqs, out),
        DType::I64 => unreachable!("paged attention refuses integer dtypes before computing"),
    }
}

/// A page (or the queries) as the kernel reads it: in the compute type already, or stored elements
/// to widen row by row.
#[derive(Clone, Copy)]
enum Page<'a, T: Math> {
    Compute(&'a [T::Compute]),
    Stored(&'a [T]),
}

impl<'a, T: Math> Page<'a, T> {
    fn of(page: Buf<'a>) -> Page<'a, T> {
        if T::DTYPE.is_half() {
            Page::Stored(page.host::<T>())
        } else {
            // Not 16-bit: the element type is its own compute type.
            Page::Compute(page.host::<T::Compute>())
        }
    }

    /// `len` elements from `at`, in the compute type.
    fn row(self, at: usize, len: usize) -> Cow<'a, [T::Compute]> {
        match self {
            Page::Compute(x) => Cow::Borrowed(&x[at..at + len]),
            Page::Stored(x) => Cow::Owned(x[at..at + len].iter().map(|v| v.load()).collect()),
        }
    }
}

fn attention_as<T: Math>(
    math: &PagedAttention,
    geometry: PageGeometry,
    q: Src,
    seqs: PagedSeqs,
    out: Dst,
) where
    T::Compute: Real,
{
    let shape = q.layout.shape();
    let (rows, heads, width) = (shape[0], shape[1], shape[2]);
    let (qs, qst, qoff) = (q.buf.host::<T>(), q.layout.strides(), q.layout.offset());
    let pages: Vec<Page<'_, T>> = seqs.pages.iter().map(|&p| Page::of(p)).collect();
    let scale = T::Compute::from_f64(math.scale);
    // The sequence of each packed query row.
    let seq_of: Vec<usize> = (0..seqs.lengths.len())
        .flat_map(|s| std::iter::repeat_n(s, seqs.queries[s + 1] - seqs.queries[s]))
        .collect();
    let task = |t: usize| -> Vec<T::Compute> {
        let (r, h) = (t / heads, t % heads);
        let s = seq_of[r];
        let query = Page::<T>::Stored(qs).row(qoff + r * qst[0] + h * qst[1], width);
        let count = seqs.queries[s + 1] - seqs.queries[s];
        let visible = math.visible(r - seqs.queries[s], count, seqs.lengths[s]);
        let skip = math.first(r - seqs.queries[s], count, seqs.lengths[s]);
        let table = &pages[seqs.first[s]..seqs.first[s + 1]];
        // Grouped-query attention: query head h reads the pages' key and value head h / group.
        let group = heads / geometry.heads;
        attend::<T>(
            math.layer,
            geometry,
            &query,
            scale,
            table,
            skip..visible,
            h / group,
        )
    };
    let work = seq_of.iter().map(|&s| seqs.lengths[s]).sum::<usize>() * heads * width;
    let results: Vec<Vec<T::Compute>> = if work < PARALLEL_WORK {
        (0..rows * heads).map(task).collect()
    } else {
        (0..rows * heads).into_par_iter().map(task).collect()
    };
    let o = out.contiguous_host::<T>();
    for (o, c) in o.iter_mut().zip(results.iter().flatten()) {
        *o = T::store(*c);
    }
}

/// One query's output over the tokens `seen` of `table` for head `h`.
fn attend<T: Math>(
    layer: usize,
    g: PageGeometry,
    query: &[T::Compute],
    scale: T::Compute,
    table: &[Page<'_, T>],
    seen: std::ops::Range<usize>,
    h: usize,
) -> Vec<T::Compute>
where
    T::Compute: Real,
{
    let zero = T::Compute::zero();
    let mut acc = vec![zero; g.width];
    let (mut max, mut sum) = (T::Compute::lowest(), zero);
    let mut scores = vec![zero; g.tokens];
    for (p, page) in table.iter().enumerate() {
        let from = p * g.tokens;
        if from >= seen.end {
            break;
        }
        if from + g.tokens <= seen.start {
            continue; // before the sliding window
        }
        // The page's slots `skip..count` are in the window.
        let skip = seen.start.saturating_sub(from);
        let count = g.tokens.min(seen.end - from);
        let keys = page.row(g.row(layer, 0, h, skip), (count - skip) * g.width);
        let values = page.row(g.row(layer, 1, h, skip), (count - skip) * g.width);
        let scores = &mut scores[..count - skip];
        for (j, score) in scores.iter_mut().enumerate() {
            *score = scale * rows::dot(query, &keys[j * g.width..][..g.width]);
        }
        let page_max = rows::max(scores);
        if page_max > max {
            let rescale = (max - page_max).exp();
            sum *= rescale;
            acc.iter_mut().for_each(|a| *a *= rescale);
            max = page_max;
        }
        sum += rows::exp_in_place(scores, max);
        for (j, &w) in scores.iter().enumerate() {
            let v = &values[j * g.width..][..g.width];
            acc.iter_mut().zip(v).for_each(|(a, &v)| *a += w * v);
        }
    }
    if sum > zero {
        let inv = sum.recip();
        acc.iter_mut().for_each(|a| *a *= inv);
    }
    acc
}

/// Copies each row of `kv` (`[rows, 2, heads, width]`) into its slot of `layer`: bytes, whatever the
/// dtype (the cache holds the model's dtype).
pub(super) fn write(dtype: DType, g: PageGeometry, layer: usize, kv: Src, rows: PageRows) {
    let e = dtype.size();
    let (src, st, off) = (kv.buf.bytes(), kv.layout.strides(), kv.layout.offset());
    let row_bytes = g.width * e;
    for (r, &(page, slot)) in rows.slots.iter().enumerate() {
        let dst = rows.pages[page].reborrow().bytes();
        for which in 0..2 {
            for h in 0..g.heads {
                let from = (off + r * st[0] + which * st[1] + h * st[2]) * e;
                let to = g.row(layer, which, h, slot) * e;
                dst[to..to + row_bytes].copy_from_slice(&src[from..from + row_bytes]);
            }
        }
    }
}
