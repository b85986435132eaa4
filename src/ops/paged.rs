//! Attention over a KV cache kept in pages, and the writes that fill the pages. The pages are views
//! of one slab tensor cut by a page table (`memory::pages`); the math is stated in
//! `backend::op::PagedAttention`, the page layout in `backend::PageGeometry`.

use std::panic::Location;

use super::{same_device, same_dtype};
pub(crate) use crate::backend::PageGeometry;
pub(crate) use crate::backend::op::PagedAttention;
use crate::backend::{Buf, BufMut, Dst, PageRows, PagedSeqs, Src};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::memory::pages::PageTable;
use crate::ops::require_float;
use crate::tensor::Tensor;

/// The error for a page table used with a slab it was not cut from (a bug above this module: the
/// KV pool checks that a cache is its own before it gets here).
fn foreign_table(op: &'static str) -> Error {
    Error::InvalidArgument {
        op,
        reason: "the page table belongs to another KV pool; use a cache with the pool it was made \
                 from"
            .into(),
    }
}

/// Checks `x` (`[rows, ..., width]` of the slab's dtype on its device) against the slab.
fn check_operand(op: &'static str, slab: &Tensor<'_>, x: &Tensor<'_>, rank: usize) -> Result<()> {
    same_dtype(op, slab, x)?;
    same_device(op, slab, x)?;
    if x.rank() != rank {
        return Err(Error::InvalidShape {
            op,
            shape: x.shape().to_vec(),
            reason: format!("needs rank {rank}"),
        });
    }
    Ok(())
}

/// Attention of the packed queries `q` (`[rows, heads, width]`: sequence `s`'s `queries[s]` rows
/// together, in the order of `tables`) over `math.layer`'s keys and values cached in `slab`'s pages:
/// sequence `s` holds `lengths[s]` tokens in the pages of `tables[s]`, its queries being its last
/// positions. The output has `q`'s shape and dtype, contiguous, in `q`'s owner.
#[track_caller]
pub(crate) fn paged_attention<'s>(
    q: &Tensor<'s>,
    slab: &Tensor<'_>,
    geometry: PageGeometry,
    math: PagedAttention,
    tables: &[&PageTable],
    lengths: &[usize],
    queries: &[usize],
) -> Result<Tensor<'s>> {
    const OP: &str = "paged attention";
    let at = Location::caller();
    check_operand(OP, slab, q, 3)?;
    require_float(OP, q)?;
    let &[rows, heads, width] = q.shape() else {
        unreachable!("rank checked")
    };
    let n = tables.len();
    if !heads.is_multiple_of(geometry.heads)
        || width != geometry.width
        || lengths.len() != n
        || queries.len() != n
        || queries.iter().sum::<usize>() != rows
        || math.layer >= geometry.layers
    {
        return Err(Error::InvalidShape {
            op: OP,
            shape: q.shape().to_vec(),
            reason: format!(
                "needs queries [rows, heads, {}] (heads a multiple of the cache's {} key and value \
                 heads) with one table, length and query count per sequence ({n} tables, {} lengths, {} counts summing to the rows) and a layer below {} (got {})",
                geometry.width,
                geometry.heads,
                lengths.len(),
                queries.len(),
                geometry.layers,
                math.layer
            ),
        });
    }
    for ((t, &len), &count) in tables.iter().zip(lengths).zip(queries) {
        if len > t.len() * geometry.tokens || len < count {
            return Err(Error::InvalidShape {
                op: OP,
                shape: q.shape().to_vec(),
                reason: format!(
                    "a sequence of {len} tokens needs at least {count} tokens (its queries) and \
                     at most {} (its {} pages)",
                    t.len() * geometry.tokens,
                    t.len()
                ),
            });
        }
    }
    let q = if q.layout().strides()[2] != 1 && width > 1 {
        q.contiguous()?
    } else {
        q.clone()
    };
    let mut out = Tensor::output_of(&[&q], q.dtype(), q.shape(), at)?;
    let mut pages: Vec<Buf<'_>> = Vec::new();
    let (mut first, mut starts) = (Vec::with_capacity(n + 1), Vec::with_capacity(n + 1));
    let mut row = 0;
    for (t, &count) in tables.iter().zip(queries) {
        first.push(pages.len());
        starts.push(row);
        row += count;
        pages.extend(t.read(slab.storage(), 0).ok_or_else(|| foreign_table(OP))?);
    }
    first.push(pages.len());
    starts.push(row);
    // A GPU kernel reads the sequences from one table in device memory.
    let table = if q.device() == Device::Cpu {
        None
    } else {
        let mut values = Vec::with_capacity(2 * rows + pages.len());
        for (s, &len) in lengths.iter().enumerate() {
            let count = queries[s];
            for i in 0..count {
                values.push(first[s] as i64);
                values.push(math.visible(i, count, len) as i64);
            }
        }
        values.extend(pages.iter().map(|p| p.address() as i64));
        let mut t = Tensor::output_of(&[&q], DType::I64, &[values.len()], at)?;
        t.upload(&values)?;
        Some(t)
    };
    q.backend()?.paged_attention(
        q.dtype(),
        &math,
        geometry,
        q.src(),
        PagedSeqs {
            pages: &pages,
            first: &first,
            lengths,
            queries: &starts,
            table: table.as_ref().map(Tensor::src),
        },
        out.dst(),
    )?;
    Ok(out)
}

/// One sequence's share of a paged write: its table, and the positions its rows fill.
pub(crate) struct PagedWrite<'a> {
    pub(crate) table: &'a mut PageTable,
    pub(crate) from: usize,
    pub(crate) count: usize,
}

/// Writes the rows of `kv` (`[rows, 2, heads, width]`: each new token's keys and values, sequence by
/// sequence in `writes`' order) into `layer` of their positions' pages. Every page written must be
/// held by its table alone (`PageTable::unshare` first).
#[track_caller]
pub(crate) fn write_pages(
    slab: &Tensor<'_>,
    geometry: PageGeometry,
    layer: usize,
    kv: &Tensor<'_>,
    writes: &mut [PagedWrite<'_>],
) -> Result<()> {
    const OP: &str = "paged write";
    check_operand(OP, slab, kv, 4)?;
    let rows: usize = writes.iter().map(|w| w.count).sum();
    if kv.shape() != [rows, 2, geometry.heads, geometry.width] || layer >= geometry.layers {
        return Err(Error::InvalidShape {
            op: OP,
            shape: kv.shape().to_vec(),
            reason: format!(
                "needs keys and values [{rows}, 2, {}, {}] for layer < {}",
                geometry.heads, geometry.width, geometry.layers
            ),
        });
    }
    let kv = if kv.layout().strides()[3] != 1 && geometry.width > 1 {
        kv.contiguous()?
    } else {
        kv.clone()
    };
    let mut pages: Vec<BufMut<'_>> = Vec::new();
    let mut slots = Vec::with_capacity(rows);
    for w in writes.iter_mut() {
        let end = w.from + w.count;
        if end > w.table.len() * geometry.tokens {
            return Err(Error::InvalidShape {
                op: OP,
                shape: vec![w.from, w.count],
                reason: format!(
                    "positions {}..{end} do not fit the table's {} pages",
                    w.from,
                    w.table.len()
                ),
            });
        }
        if w.count == 0 {
            continue;
        }
        let first_page = w.from / geometry.tokens;
        let base = pages.len();
        pages.extend(w.table.write(slab.storage(), first_page).ok_or_else(|| {
            Error::InvalidShape {
                op: OP,
                shape: vec![w.from, w.count],
                reason: "a page to write is shared with another cache or belongs to another \
                         pool; the cache unshares its pages before writing"
                    .into(),
            }
        })?);
        for pos in w.from..end {
            slots.push((
                base + pos / geometry.tokens - first_page,
                pos % geometry.tokens,
            ));
        }
    }
    // A GPU kernel reads where each row goes from a table in device memory.
    let table = if kv.device() == Device::Cpu {
        None
    } else {
        let e = kv.dtype().size();
        let values: Vec<i64> = slots
            .iter()
            .map(|&(page, slot)| {
                (pages[page].address() as usize + geometry.row(layer, 0, 0, slot) * e) as i64
            })
            .collect();
        let mut t = Tensor::output_of(&[&kv], DType::I64, &[values.len()], Location::caller())?;
        t.upload(&values)?;
        Some(t)
    };
    kv.backend()?.write_pages(
        kv.dtype(),
        geometry,
        layer,
        kv.src(),
        PageRows {
            pages: &mut pages,
            slots: &slots,
            table: table.as_ref().map(Tensor::src),
        },
    )
}

/// Makes page `i` of `table` private, copying it into a fresh page of `slab` if other tables hold
/// it. `Ok(false)` when no page is free for the copy.
pub(crate) fn unshare_page(slab: &Tensor<'_>, table: &mut PageTable, i: usize) -> Result<bool> {
    const OP: &str = "copy-on-write of a KV page";
    let backend = slab.backend()?;
    let copied = table.unshare(slab.storage(), i, |from: Buf<'_>, to: BufMut<'_>| {
        // A page is a multiple of 64 bytes: copied as 8-byte integers, bit for bit, whatever floats
        // it holds.
        let layout = Layout::contiguous(&[from.len() / size_of::<i64>()]);
        backend.copy(
            DType::I64,
            DType::I64,
            Src {
                buf: from,
                layout: &layout,
            },
            Dst {
                buf: to,
                layout: &layout,
            },
        )
    });
    copied.ok_or_else(|| foreign_table(OP))?
}
