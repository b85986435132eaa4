//! Paged attention and page writes on the GPU (`kernels/paged.cu`): the launches and the geometry
//! they take. The tables the kernels read (rows' pages, slot addresses) come built and uploaded by the
//! op (`ops::paged`).

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use crate::backend::cuda::kernels::{elementwise_launch, float_family, float_kernel};
use crate::backend::cuda::ops::first;
use crate::backend::cuda::{Gpu, cuda_error};
use crate::backend::op::{Math, PagedAttention};
use crate::backend::{Dst, PageGeometry, PageRows, PagedSeqs, Src};
use crate::dtype::{DType, Element, with_float_dtype};
use crate::error::{Error, Result};

/// Warps per block, one query row and head each (`PAGED_WARPS`).
const WARPS: usize = 4;
/// The widest head the kernel keeps in registers (`PAGED_MAX_WIDTH`).
const MAX_WIDTH: usize = 256;
/// The largest grid dimension `y` (one block row per head).
const MAX_GRID_Y: usize = 65_535;

/// The kernels' `struct PagedGeo`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PagedGeo {
    rows: i64,
    heads: i64,
    tokens: i64,
    width: i64,
    layer: i64,
    q_row: i64,
    q_head: i64,
    q_heads: i64,
    /// The sliding window (0: none).
    window: i64,
}

// SAFETY: `PagedGeo` is `repr(C)` plain data, nine eight-byte integers in the field order of the
// kernels' `struct PagedGeo`, so it can be passed by value as a kernel argument.
unsafe impl DeviceRepr for PagedGeo {}

/// The kernels' geometry for `rows` rows of `q_heads` query heads (a multiple of the pages'
/// `g.heads`) whose row and head strides are `strides`.
fn geometry(
    rows: usize,
    g: PageGeometry,
    layer: usize,
    strides: [usize; 2],
    q_heads: usize,
    window: Option<usize>,
) -> Result<PagedGeo> {
    if g.width > MAX_WIDTH || q_heads > MAX_GRID_Y {
        return Err(Error::InvalidShape {
            op: "paged attention",
            shape: vec![rows, g.heads, g.width],
            reason: format!(
                "GPU paged attention takes head widths up to {MAX_WIDTH} and up to {MAX_GRID_Y} \
                 heads"
            ),
        });
    }
    Ok(PagedGeo {
        rows: rows as i64,
        heads: g.heads as i64,
        tokens: g.tokens as i64,
        width: g.width as i64,
        layer: layer as i64,
        q_row: strides[0] as i64,
        q_head: strides[1] as i64,
        q_heads: q_heads as i64,
        window: window.map_or(0, |w| w as i64),
    })
}

fn missing_table() -> Error {
    Error::Cuda {
        op: "paged attention",
        reason: "ndscope bug: no device table for a GPU call".into(),
    }
}

impl Gpu {
    pub(super) fn paged_attention_kernel(
        &self,
        dtype: DType,
        math: &PagedAttention,
        g: PageGeometry,
        q: Src,
        seqs: PagedSeqs,
        out: Dst,
    ) -> Result<()> {
        let rows = q.layout.shape()[0];
        if rows == 0 || g.width == 0 {
            return Ok(());
        }
        let (s, q_heads) = (q.layout.strides(), q.layout.shape()[1]);
        let geo = geometry(rows, g, math.layer, [s[0], s[1]], q_heads, math.window)?;
        let table = seqs.table.ok_or_else(missing_table)?;
        let f = self.function(float_kernel(
            "paged attention",
            float_family!("paged_attention"),
            dtype,
        )?)?;
        let (o, qa, t) = (
            first(out.buf.address(), out.layout, dtype),
            first(q.buf.address(), q.layout, dtype),
            first(table.buf.address(), table.layout, DType::I64),
        );
        let launch = LaunchConfig {
            grid_dim: (rows.div_ceil(WARPS) as u32, q_heads as u32, 1),
            block_dim: ((32 * WARPS) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        with_float_dtype!(dtype, T => {
            let scale = <T as Math>::Compute::from_f64(math.scale);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&geo).arg(&o).arg(&qa).arg(&t).arg(&scale);
            // SAFETY: the arguments match `paged_attention_<dtype>` (PagedGeo, T*, const T*, const
            // i64*, C). The queries' strides and rows are those of `q`'s layout; `out` is a fresh
            // contiguous [rows, q_heads, width] block (query head h reads key head h / (q_heads /
            // heads)); the table holds each row's first page and
            // visible tokens, then the addresses of pages of the slab that the sequences' page
            // tables hold (each `layers × 2 × heads × tokens × width` elements), and a row sees no
            // more tokens than its pages hold (checked by the op).
            unsafe { b.launch(launch) }.map_err(|e| cuda_error("paged attention kernel", e))?;
        }, else unreachable!("float_kernel refused integers"));
        Ok(())
    }

    pub(super) fn write_pages_kernel(
        &self,
        dtype: DType,
        g: PageGeometry,
        layer: usize,
        kv: Src,
        rows: PageRows,
    ) -> Result<()> {
        let n = rows.slots.len();
        if n == 0 || g.width == 0 {
            return Ok(());
        }
        let geo = geometry(n, g, layer, [0, 0], g.heads, None)?;
        let table = rows.table.ok_or_else(missing_table)?;
        let f = self.function(float_kernel(
            "paged write",
            float_family!("paged_write"),
            dtype,
        )?)?;
        let s = kv.layout.strides();
        let (s0, s1, s2) = (s[0] as i64, s[1] as i64, s[2] as i64);
        let (src, t) = (
            first(kv.buf.address(), kv.layout, dtype),
            first(table.buf.address(), table.layout, DType::I64),
        );
        let mut b = self.stream.launch_builder(&f);
        b.arg(&geo).arg(&src).arg(&s0).arg(&s1).arg(&s2).arg(&t);
        // SAFETY: the arguments match `paged_write_<dtype>` (PagedGeo, const T*, i64 x3, const
        // i64*). `kv`'s strides cover [rows, 2, heads, width] inside its block; the table holds, per
        // row, the address of its key slot in one of `rows.pages`, pages held by one page table alone
        // and borrowed mutably for this call, so every element written lies in a page nothing else
        // reads or writes meanwhile.
        unsafe { b.launch(elementwise_launch(n * 2 * g.heads * g.width)) }
            .map_err(|e| cuda_error("paged write kernel", e))?;
        Ok(())
    }
}
