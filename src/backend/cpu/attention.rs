//! Host fused attention ([`Attention`] states the math).
//!
//! The forward pass runs one task per batch, head and tile of [`QUERY_TILE`] queries: it walks the
//! keys the tile can see in tiles of [`KEY_TILE`], multiplies the query tile by the key tile (`gemm`,
//! reading the operands through their strides), turns each row of scores into weights against a
//! running maximum (rescaling what the row had accumulated when the maximum grows), and adds the
//! weighted value tile. A tile's scores are the only `[queries, keys]` memory, and it stays in cache.
//!
//! The backward pass runs one task per batch and head: for each key tile it recomputes the weights
//! of every query tile that sees it from the saved `lse`, and accumulates the key and value tiles'
//! gradients locally and the queries' gradient in the head's buffer, so no two tasks write the same
//! element and the result does not depend on the schedule.
//!
//! Both passes run in a version compiled for the CPU's vector unit (AVX-512F or AVX2, detected at
//! run time), so that the row passes between the products (maxima, exponentials, rescaling, `ds`)
//! use its registers: compiled for the baseline's four lanes they took 39 % of the forward pass.
//!
//! Everything is computed in the compute type: 16-bit operands are widened to `f32` once (exact), and
//! results are rounded once when stored. The `bf16` passes on a CPU with AMX tiles
//! ([`Bf16Dot::tiles`]) or whose `bf16` products run on `vdpbf16ps` ([`Bf16Dot::vectors`]) run on
//! `bf16` blocks instead: the forward in [`super::attention_tiles`], the backward in
//! [`super::attention_tiles_backward`].

use std::borrow::Cow;

use rayon::prelude::*;

use super::bf16_blocks::Vectors;
use super::bf16_gemm::Bf16Dot;
use super::bf16_tiles::Amx;
use super::matmul::{Strided, gemm_tile};
use super::rows::{self, Real};
use super::{attention_tiles, attention_tiles_backward};
use crate::backend::op::{Attention, Math};
use crate::backend::{AttentionInputs, Dst, Src};
use crate::dtype::{DType, Element, Float, bf16, f16};
use crate::layout::{Layout, RowWalk};

/// Queries per forward task and per backward tile.
pub(super) const QUERY_TILE: usize = 64;
/// Keys per tile: a forward tile's scores (`QUERY_TILE × KEY_TILE` floats, 64 KiB) stay in L2. Each
/// row of a tile pays a fixed cost (two lane reductions, a rescaling of its outputs) that 128 keys
/// did not cover: `attention/f32` of `benches/versus_pytorch.py` on the Xeon with AMX went from
/// 1.31x PyTorch's time at 128 keys to 1.23x at 256.
pub(super) const KEY_TILE: usize = 256;
/// Products smaller than this many multiply-adds run on the calling thread.
const PARALLEL_WORK: usize = 1 << 18;
/// One head of an operand in the compute type: row `i` is `data[start + i * row..][..width]`.
#[derive(Clone, Copy)]
struct Head<'a, C> {
    data: &'a [C],
    start: usize,
    row: usize,
    width: usize,
}

impl<'a, C> Head<'a, C> {
    /// Rows `from..` as a matrix block (rows `row` apart, unit column stride).
    fn rows_from(&self, from: usize) -> Strided<'a, C> {
        Strided {
            data: &self.data[self.start + from * self.row..],
            rows: self.row,
            cols: 1,
        }
    }

    /// Rows `from..` transposed: element `(c, r)` is row `from + r`'s element `c`.
    fn rows_from_transposed(&self, from: usize) -> Strided<'a, C> {
        let s = self.rows_from(from);
        Strided {
            rows: 1,
            cols: s.rows,
            ..s
        }
    }

    fn row(&self, i: usize) -> &'a [C] {
        &self.data[self.start + i * self.row..][..self.width]
    }
}

/// A `[batch, heads, len, width]` operand in the compute type: borrowed when it already is, widened
/// (and packed) from 16 bits otherwise.
struct Heads<'a, C: Clone> {
    data: Cow<'a, [C]>,
    layout: Layout,
}

impl<'a, C: Element> Heads<'a, C> {
    fn of<T: Math<Compute = C>>(x: Src<'a>) -> Heads<'a, C> {
        if !T::DTYPE.is_half() {
            // The compute type is the element type: read the block as it is.
            return Heads {
                data: Cow::Borrowed(x.buf.host::<C>()),
                layout: x.layout.clone(),
            };
        }
        let (layout, data) = (x.layout, x.buf.host::<T>());
        let mut wide = Vec::with_capacity(layout.numel());
        let walk = RowWalk::new(layout.shape(), [layout.strides()], [layout.offset()]);
        let len = walk.row_len();
        walk.for_rows(0, walk.rows(), |_, [start]| {
            wide.extend(data[start..start + len].iter().map(|x| x.load()));
        });
        Heads {
            data: Cow::Owned(wide),
            layout: Layout::contiguous(layout.shape()),
        }
    }

    fn dims(&self) -> [usize; 4] {
        let s = self.layout.shape();
        [s[0], s[1], s[2], s[3]]
    }

    fn head(&self, b: usize, h: usize) -> Head<'_, C> {
        let st = self.layout.strides();
        Head {
            data: &self.data,
            start: self.layout.offset() + b * st[0] + h * st[1],
            row: st[2],
            width: self.layout.shape()[3],
        }
    }
}

/// Stores rows `from..` of head `(b, h)` of a `[batch, heads, len, width]` output (width stride 1).
pub(super) fn store_rows<T: Math>(
    out: &mut [T],
    layout: &Layout,
    (b, h): (usize, usize),
    from: usize,
    rows: &[T::Compute],
) {
    let (st, width) = (layout.strides(), layout.shape()[3]);
    if width == 0 {
        return;
    }
    let base = layout.offset() + b * st[0] + h * st[1];
    for (r, row) in rows.chunks(width).enumerate() {
        let at = base + (from + r) * st[2];
        out[at..at + width]
            .iter_mut()
            .zip(row)
            .for_each(|(o, &c)| *o = T::store(c));
    }
}

/// How many keys batch `b` holds.
pub(super) fn keys_of(key_lengths: Option<&[i64]>, b: usize, keys: usize) -> usize {
    key_lengths.map_or(keys, |k| k[b].clamp(0, keys as i64) as usize)
}

/// `f(task)` for every task, in parallel when the work is large enough; results in task order.
pub(super) fn run_tasks<R: Send>(
    tasks: usize,
    work: usize,
    f: impl Fn(usize) -> R + Sync + Send,
) -> Vec<R> {
    if work < PARALLEL_WORK {
        (0..tasks).map(f).collect()
    } else {
        (0..tasks).into_par_iter().map(f).collect()
    }
}

/// The unit a `bf16` attention's products run on, where one computes these inputs: AMX tiles first,
/// else AVX-512 BF16 vectors. `None`: the operands are widened to `f32` ([`forward_as`]).
enum Bf16Blocks {
    Tiles(Amx),
    Vectors(Vectors),
}

impl Bf16Blocks {
    fn for_inputs(inputs: &AttentionInputs) -> Option<Bf16Blocks> {
        let dot = Bf16Dot::detect().filter(|_| attention_tiles::computes(inputs))?;
        match (dot.tiles(), dot.vectors()) {
            (Some(amx), _) => Some(Bf16Blocks::Tiles(amx)),
            (None, vectors) => vectors.map(Bf16Blocks::Vectors),
        }
    }
}

/// The backward pass's walk over one head: every (query tile, key tile) pair in which some query
/// sees some key, key tiles outer, as `((i0, rows), (j0, cols))`. Keys no query sees (past the
/// batch's `keys`, after the last query's causal bound, before the first query's window) are in
/// no pair: their gradients stay 0.
pub(super) fn seen_tiles(
    math: &Attention,
    queries: usize,
    keys: usize,
) -> impl Iterator<Item = ((usize, usize), (usize, usize))> + '_ {
    let key_rows = if queries == 0 {
        0
    } else {
        math.visible(queries - 1, keys)
    };
    let key_start = math.first(0) / KEY_TILE * KEY_TILE;
    (key_start..key_rows)
        .step_by(KEY_TILE)
        .flat_map(move |j0| {
            let cols = KEY_TILE.min(key_rows - j0);
            (0..queries)
                .step_by(QUERY_TILE)
                .map(move |i0| ((i0, QUERY_TILE.min(queries - i0)), (j0, cols)))
        })
        .filter(move |&((i0, rows), (j0, cols))| {
            math.visible(i0 + rows - 1, keys) > j0 && math.first(i0) < j0 + cols
        })
}

/// Forward pass: `out` and `lse` of every query.
pub(super) fn forward(dtype: DType, math: &Attention, inputs: AttentionInputs, out: Dst, lse: Dst) {
    match dtype {
        DType::F32 => forward_as::<f32>(math, inputs, out, lse),
        DType::F64 => forward_as::<f64>(math, inputs, out, lse),
        DType::BF16 => match Bf16Blocks::for_inputs(&inputs) {
            Some(Bf16Blocks::Tiles(amx)) => attention_tiles::forward(amx, math, inputs, out, lse),
            Some(Bf16Blocks::Vectors(vectors)) => {
                attention_tiles::forward(vectors, math, inputs, out, lse)
            }
            None => forward_as::<bf16>(math, inputs, out, lse),
        },
        DType::F16 => forward_as::<f16>(math, inputs, out, lse),
        DType::I64 => unreachable!("attention refuses integer dtypes before computing"),
    }
}

fn forward_as<T: Math>(math: &Attention, inputs: AttentionInputs, out: Dst, lse: Dst)
where
    T::Compute: Real,
{
    let (q, k, v) = (
        Heads::<T::Compute>::of::<T>(inputs.q),
        Heads::of::<T>(inputs.k),
        Heads::of::<T>(inputs.v),
    );
    let key_lengths = inputs.key_lengths.map(|l| l.contiguous_host::<i64>());
    let ([batch, heads, queries, width], keys) = (q.dims(), k.dims()[2]);
    let tiles = queries.div_ceil(QUERY_TILE);
    let work = batch * heads * queries * keys * width;
    let unit = Unit::widest();
    let results = run_tasks(batch * heads * tiles, work, |task| {
        let (bh, tile) = (task / tiles, task % tiles);
        let (b, h) = (bh / heads, bh % heads);
        let from = tile * QUERY_TILE;
        let rows = QUERY_TILE.min(queries - from);
        let keys = keys_of(key_lengths, b, keys);
        forward_tile(
            unit,
            math,
            // Grouped-query attention: query head h reads key and value head h / group.
            [
                q.head(b, h),
                k.head(b, h / math.group),
                v.head(b, h / math.group),
            ],
            keys,
            from,
            rows,
        )
    });
    let (out_layout, out) = (out.layout, out.buf.host::<T>());
    let lse = lse.contiguous_host::<T::Compute>();
    for (task, (o, l)) in results.into_iter().enumerate() {
        let (bh, tile) = (task / tiles, task % tiles);
        let from = tile * QUERY_TILE;
        store_rows::<T>(out, out_layout, (bh / heads, bh % heads), from, &o);
        lse[bh * queries + from..][..l.len()].copy_from_slice(&l);
    }
}

/// The version of the forward tile and the backward head that runs: the baseline's, or one compiled
/// for a vector unit. A vector unit is named only where [`Unit::available`] found it on this CPU.
#[derive(Clone, Copy, Debug)]
enum Unit {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Unit {
    /// The versions this CPU runs, the baseline first and the widest last.
    fn available() -> Vec<Unit> {
        #[allow(unused_mut)]
        let mut units = vec![Unit::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                units.push(Unit::Avx2);
            }
            if std::is_x86_feature_detected!("avx512f") {
                units.push(Unit::Avx512);
            }
        }
        units
    }

    fn widest() -> Unit {
        *Unit::available()
            .last()
            .expect("the baseline is always available")
    }
}

/// `rows` queries from `from` of one head: their outputs (`rows × value width`) and `lse`.
fn forward_tile<C: Real>(
    unit: Unit,
    math: &Attention,
    heads: [Head<'_, C>; 3],
    keys: usize,
    from: usize,
    rows: usize,
) -> (Vec<C>, Vec<C>) {
    match unit {
        Unit::Baseline => forward_tile_with(math, heads, keys, from, rows),
        // SAFETY: `Unit::Avx2` is made only on a CPU with AVX2, the version's one feature.
        #[cfg(target_arch = "x86_64")]
        Unit::Avx2 => unsafe { forward_tile_avx2(math, heads, keys, from, rows) },
        // SAFETY: `Unit::Avx512` is made only on a CPU with AVX-512F, the version's one feature.
        #[cfg(target_arch = "x86_64")]
        Unit::Avx512 => unsafe { forward_tile_avx512(math, heads, keys, from, rows) },
    }
}

/// [`forward_tile_with`] and [`backward_head_with`] compiled for a vector unit, so that their row
/// passes (maxima, exponentials, rescaling, `ds`) run in its registers rather than the baseline's
/// four lanes. The row passes use no fused multiply-add, so every version computes the same bits.
macro_rules! compiled_for {
    ($features:literal, $forward:ident, $backward:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $forward<C: Real>(
            math: &Attention,
            heads: [Head<'_, C>; 3],
            keys: usize,
            from: usize,
            rows: usize,
        ) -> (Vec<C>, Vec<C>) {
            forward_tile_with(math, heads, keys, from, rows)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $backward<C: Real>(
            math: &Attention,
            qkv: [Head<'_, C>; 3],
            out_dout: [Head<'_, C>; 2],
            lse: &[C],
            keys: (usize, usize),
        ) -> [Vec<C>; 3] {
            backward_head_with(math, qkv, out_dout, lse, keys)
        }
    };
}

compiled_for!("avx512f", forward_tile_avx512, backward_head_avx512);
compiled_for!("avx2", forward_tile_avx2, backward_head_avx2);

#[inline(always)]
fn forward_tile_with<C: Real>(
    math: &Attention,
    [q, k, v]: [Head<'_, C>; 3],
    keys: usize,
    from: usize,
    rows: usize,
) -> (Vec<C>, Vec<C>) {
    let dv = v.width;
    let mut out = vec![C::zero(); rows * dv];
    let mut max = vec![C::lowest(); rows];
    let mut sum = vec![C::zero(); rows];
    let mut scores = vec![C::zero(); rows * KEY_TILE];
    let scale = C::from_f64(math.scale);
    // Later queries see at least as many keys, and start no earlier: the tile's last row bounds
    // the walk, its first row's window start begins it.
    let seen_by_tile = math.visible(from + rows - 1, keys);
    let start = math.first(from) / KEY_TILE * KEY_TILE;
    for j0 in (start..seen_by_tile).step_by(KEY_TILE) {
        let cols = KEY_TILE.min(seen_by_tile - j0);
        gemm_tile(
            (rows, cols, q.width),
            &mut scores,
            KEY_TILE,
            false,
            q.rows_from(from),
            k.rows_from_transposed(j0),
            scale,
        );
        for r in 0..rows {
            let row = &mut scores[r * KEY_TILE..r * KEY_TILE + cols];
            let seen = math.visible(from + r, keys).saturating_sub(j0).min(cols);
            let skip = math.first(from + r).saturating_sub(j0).min(seen);
            if seen == skip {
                row.fill(C::zero());
                continue;
            }
            let tile_max = rows::max(&row[skip..seen]);
            let new_max = if tile_max > max[r] { tile_max } else { max[r] };
            let rescale = Float::exp(max[r] - new_max);
            let tile_sum = rows::exp_in_place(&mut row[skip..seen], new_max);
            row[..skip].fill(C::zero());
            row[seen..].fill(C::zero());
            sum[r] = sum[r] * rescale + tile_sum;
            max[r] = new_max;
            if rescale != C::one() {
                out[r * dv..(r + 1) * dv]
                    .iter_mut()
                    .for_each(|o| *o *= rescale);
            }
        }
        gemm_tile(
            (rows, dv, cols),
            &mut out,
            dv,
            true,
            Strided {
                data: &scores,
                rows: KEY_TILE,
                cols: 1,
            },
            v.rows_from(j0),
            C::one(),
        );
    }
    let lse = (0..rows)
        .map(|r| {
            let row = &mut out[r * dv..(r + 1) * dv];
            if sum[r] == C::zero() {
                // No key visible: the output is 0 and the row's log-sum is -inf.
                row.fill(C::zero());
                return C::lowest();
            }
            let inv = Float::recip(sum[r]);
            row.iter_mut().for_each(|o| *o *= inv);
            max[r] + Float::ln(sum[r])
        })
        .collect();
    (out, lse)
}

/// Backward pass: the gradients of queries, keys and values from `[out, dout, lse]`.
pub(super) fn backward(
    dtype: DType,
    math: &Attention,
    inputs: AttentionInputs,
    saved: [Src; 3],
    grads: [Dst; 3],
) {
    match dtype {
        DType::F32 => backward_as::<f32>(math, inputs, saved, grads),
        DType::F64 => backward_as::<f64>(math, inputs, saved, grads),
        DType::BF16 => match Bf16Blocks::for_inputs(&inputs) {
            Some(Bf16Blocks::Tiles(amx)) => {
                attention_tiles_backward::backward(amx, math, inputs, saved, grads)
            }
            Some(Bf16Blocks::Vectors(vectors)) => {
                attention_tiles_backward::backward(vectors, math, inputs, saved, grads)
            }
            None => backward_as::<bf16>(math, inputs, saved, grads),
        },
        DType::F16 => backward_as::<f16>(math, inputs, saved, grads),
        DType::I64 => unreachable!("attention refuses integer dtypes before computing"),
    }
}

fn backward_as<T: Math>(
    math: &Attention,
    inputs: AttentionInputs,
    [out, dout, lse]: [Src; 3],
    grads: [Dst; 3],
) where
    T::Compute: Real,
{
    let (q, k, v) = (
        Heads::<T::Compute>::of::<T>(inputs.q),
        Heads::of::<T>(inputs.k),
        Heads::of::<T>(inputs.v),
    );
    let (out, dout) = (Heads::of::<T>(out), Heads::of::<T>(dout));
    let lse = lse.contiguous_host::<T::Compute>();
    let key_lengths = inputs.key_lengths.map(|l| l.contiguous_host::<i64>());
    let ([batch, heads, queries, width], keys) = (q.dims(), k.dims()[2]);
    let work = batch * heads * queries * keys * width;
    let unit = Unit::widest();
    let results = run_tasks(batch * heads, work, |bh| {
        let (b, h) = (bh / heads, bh % heads);
        backward_head(
            unit,
            math,
            [
                q.head(b, h),
                k.head(b, h / math.group),
                v.head(b, h / math.group),
            ],
            [out.head(b, h), dout.head(b, h)],
            &lse[bh * queries..(bh + 1) * queries],
            (keys_of(key_lengths, b, keys), keys),
        )
    });
    store_gradients::<T>(grads, heads, results);
}

/// Stores every head's gradients `[dq, dk, dv]` (rows of the queries', keys' and values' widths, in
/// the order batch, head) into `grads`.
pub(super) fn store_gradients<T: Math>(
    grads: [Dst; 3],
    heads: usize,
    results: Vec<[Vec<T::Compute>; 3]>,
) {
    let [dq, dk, dv] = grads;
    let (dq_layout, dq) = (dq.layout, dq.buf.host::<T>());
    let (dk_layout, dk) = (dk.layout, dk.buf.host::<T>());
    let (dv_layout, dv) = (dv.layout, dv.buf.host::<T>());
    for (bh, [gq, gk, gv]) in results.into_iter().enumerate() {
        let at = (bh / heads, bh % heads);
        store_rows::<T>(dq, dq_layout, at, 0, &gq);
        store_rows::<T>(dk, dk_layout, at, 0, &gk);
        store_rows::<T>(dv, dv_layout, at, 0, &gv);
    }
}

/// One head's gradients `[dq, dk, dv]` (rows of the queries', keys' and values' widths).
fn backward_head<C: Real>(
    unit: Unit,
    math: &Attention,
    qkv: [Head<'_, C>; 3],
    out_dout: [Head<'_, C>; 2],
    lse: &[C],
    keys: (usize, usize),
) -> [Vec<C>; 3] {
    match unit {
        Unit::Baseline => backward_head_with(math, qkv, out_dout, lse, keys),
        // SAFETY: `Unit::Avx2` is made only on a CPU with AVX2, the version's one feature.
        #[cfg(target_arch = "x86_64")]
        Unit::Avx2 => unsafe { backward_head_avx2(math, qkv, out_dout, lse, keys) },
        // SAFETY: `Unit::Avx512` is made only on a CPU with AVX-512F, the version's one feature.
        #[cfg(target_arch = "x86_64")]
        Unit::Avx512 => unsafe { backward_head_avx512(math, qkv, out_dout, lse, keys) },
    }
}

#[inline(always)]
fn backward_head_with<C: Real>(
    math: &Attention,
    [q, k, v]: [Head<'_, C>; 3],
    [out, dout]: [Head<'_, C>; 2],
    lse: &[C],
    (keys, all_keys): (usize, usize),
) -> [Vec<C>; 3] {
    let queries = lse.len();
    let (d, dv) = (q.width, v.width);
    let mut dq = vec![C::zero(); queries * d];
    let mut dk = vec![C::zero(); all_keys * d];
    let mut dvv = vec![C::zero(); all_keys * dv];
    // D_i = dout_i · out_i: the row's weighted mean of dout · v.
    let delta: Vec<C> = (0..queries)
        .map(|i| rows::dot(dout.row(i), out.row(i)))
        .collect();
    let scale = C::from_f64(math.scale);
    let mut p = vec![C::zero(); QUERY_TILE * KEY_TILE];
    let mut ds = vec![C::zero(); QUERY_TILE * KEY_TILE];
    for ((i0, rows), (j0, cols)) in seen_tiles(math, queries, keys) {
        gemm_tile(
            (rows, cols, d),
            &mut p,
            KEY_TILE,
            false,
            q.rows_from(i0),
            k.rows_from_transposed(j0),
            scale,
        );
        for r in 0..rows {
            let row = &mut p[r * KEY_TILE..r * KEY_TILE + cols];
            let l = lse[i0 + r];
            let seen = if l == C::lowest() {
                0
            } else {
                math.visible(i0 + r, keys).saturating_sub(j0).min(cols)
            };
            let skip = math.first(i0 + r).saturating_sub(j0).min(seen);
            row[skip..seen]
                .iter_mut()
                .for_each(|s| *s = Float::exp(*s - l));
            row[..skip].fill(C::zero());
            row[seen..].fill(C::zero());
        }
        fn tile<C>(data: &[C], transposed: bool) -> Strided<'_, C> {
            Strided {
                data,
                rows: if transposed { 1 } else { KEY_TILE },
                cols: if transposed { KEY_TILE } else { 1 },
            }
        }
        // dv_j += p_ijᵀ dout_i
        gemm_tile(
            (cols, dv, rows),
            &mut dvv[j0 * dv..],
            dv,
            true,
            tile(&p, true),
            dout.rows_from(i0),
            C::one(),
        );
        // dp_ij = dout_i v_jᵀ, then ds_ij = p_ij (dp_ij - D_i) scale
        gemm_tile(
            (rows, cols, dv),
            &mut ds,
            KEY_TILE,
            false,
            dout.rows_from(i0),
            v.rows_from_transposed(j0),
            C::one(),
        );
        for r in 0..rows {
            let (pr, dr) = (
                &p[r * KEY_TILE..r * KEY_TILE + cols],
                &mut ds[r * KEY_TILE..r * KEY_TILE + cols],
            );
            let di = delta[i0 + r];
            dr.iter_mut()
                .zip(pr)
                .for_each(|(g, &p)| *g = p * (*g - di) * scale);
        }
        // dk_j += ds_ijᵀ q_i, dq_i += ds_ij k_j
        gemm_tile(
            (cols, d, rows),
            &mut dk[j0 * d..],
            d,
            true,
            tile(&ds, true),
            q.rows_from(i0),
            C::one(),
        );
        gemm_tile(
            (rows, d, cols),
            &mut dq[i0 * d..],
            d,
            true,
            tile(&ds, false),
            k.rows_from(j0),
            C::one(),
        );
    }
    [dq, dk, dvv]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The versions this CPU runs; the ones it cannot are reported as not run.
    fn units() -> Vec<Unit> {
        let units = Unit::available();
        for name in ["Avx2", "Avx512"] {
            if !units.iter().any(|u| format!("{u:?}") == name) {
                println!(
                    "fused attention: the {name} version not run (this CPU lacks the feature)"
                );
            }
        }
        units
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::Rng::new(seed);
        (0..n)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 6.0 - 3.0)
            .collect()
    }

    /// Every version computes the baseline's bits, forward and backward: odd widths (lane tails),
    /// a query tile and a key tile cut short, keys past the batch's length, a causal mask with a
    /// sliding window (rows that skip whole key tiles), and rows that see no key at all.
    #[test]
    fn every_vector_unit_computes_the_baseline_bits() {
        let (queries, all_keys, keys, d, dv) = (150, 2 * KEY_TILE + 44, 2 * KEY_TILE + 30, 37, 21);
        let (q, k, v, dout) = (
            values(queries * d, 1),
            values(all_keys * d, 2),
            values(all_keys * dv, 3),
            values(queries * dv, 4),
        );
        fn head(data: &[f32], width: usize) -> Head<'_, f32> {
            Head {
                data,
                start: 0,
                row: width,
                width,
            }
        }
        let heads = [head(&q[..], d), head(&k[..], d), head(&v[..], dv)];
        let masks = [
            (None, None),
            (Some((keys - queries) as i64), Some(KEY_TILE + 7)),
            (Some(-20), None), // the first 20 queries see nothing
        ];
        for (causal, window) in masks {
            let math = Attention {
                scale: 0.3,
                causal,
                group: 1,
                window,
            };
            let tiles: Vec<(usize, usize)> = (0..queries)
                .step_by(QUERY_TILE)
                .map(|from| (from, QUERY_TILE.min(queries - from)))
                .collect();
            let forward = |unit| {
                let (mut out, mut lse) = (vec![], vec![]);
                for &tile in &tiles {
                    let (o, l) = forward_tile(unit, &math, heads, keys, tile.0, tile.1);
                    out.extend(o);
                    lse.extend(l);
                }
                (out, lse)
            };
            let (out, lse) = forward(Unit::Baseline);
            assert_eq!(
                lse.contains(&f32::NEG_INFINITY),
                causal.is_some_and(|c| c < 0)
            );
            let out_dout = [head(&out[..], dv), head(&dout[..], dv)];
            let grads = backward_head(
                Unit::Baseline,
                &math,
                heads,
                out_dout,
                &lse,
                (keys, all_keys),
            );
            for unit in units() {
                let same = |name: &str, got: &[f32], want: &[f32]| {
                    assert_eq!(got.len(), want.len(), "{unit:?} {name}: length");
                    let differs = got
                        .iter()
                        .zip(want)
                        .position(|(g, w)| g.to_bits() != w.to_bits());
                    if let Some(i) = differs {
                        panic!(
                            "{unit:?} {name}, mask {causal:?} {window:?}: element {i} is {} where \
                             the baseline computes {}",
                            got[i], want[i]
                        );
                    }
                };
                let (o, l) = forward(unit);
                same("outputs", &o, &out);
                same("lse", &l, &lse);
                let g = backward_head(unit, &math, heads, out_dout, &lse, (keys, all_keys));
                for (name, (g, want)) in ["dq", "dk", "dv"].iter().zip(g.iter().zip(&grads)) {
                    same(name, g, want);
                }
            }
        }
    }
}
