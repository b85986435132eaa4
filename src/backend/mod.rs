//! Backends: the kernels of one kind of device, over buffers, layouts and dtypes.
//!
//! A backend never sees a `Tensor` or a scope. Ops (`crate::ops`) check shapes, dtypes and devices,
//! allocate the output in the innermost operand owner, and then make one call to the [`Backend`] of
//! the operands' device with views of the blocks ([`Src`], [`Dst`]). A backend writes only into the
//! buffers it is given and allocates no tensor memory of its own; where a kernel can only read a
//! packed layout it says so ([`Backend::reads_any_layout`], [`Backend::matmul_reads`]) and the op
//! packs the operand first.
//!
//! What each op computes is stated once, in [`op`]: the host backend runs that math, the CUDA
//! backend names the same op to its kernels. Without the `cuda` feature the CUDA module is replaced
//! by `no_cuda.rs`, which answers `DeviceUnavailable` from one place, so nothing above this module
//! depends on the feature.

pub(crate) mod cpu;
#[cfg_attr(not(feature = "cuda"), path = "no_cuda.rs")]
pub(crate) mod cuda;
pub(crate) mod op;

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use smallvec::SmallVec;

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::Result;
use crate::layout::Layout;
use crate::rng::Distribution;
use op::{Attention, Binary, FusedUpdate, PagedAttention, Reduce, Unary, Window2d};

/// The bytes of one storage block, readable by kernels of its device for `'a`.
#[derive(Clone, Copy)]
pub(crate) struct Buf<'a> {
    ptr: NonNull<u8>,
    bytes: usize,
    device: Device,
    _life: PhantomData<&'a [u8]>,
}

/// The bytes of one storage block, writable by kernels of its device for `'a` (no other view of
/// the block exists meanwhile).
pub(crate) struct BufMut<'a> {
    ptr: NonNull<u8>,
    bytes: usize,
    device: Device,
    _life: PhantomData<&'a mut [u8]>,
}

/// Types every bit pattern of which is a valid value: the element types, and bytes.
pub(crate) trait Plain: Copy {}
impl<T: Element> Plain for T {}
impl Plain for u8 {}
impl Plain for u32 {}

/// Panics on a host view of device memory: reading a GPU address on the host would be undefined
/// behaviour, and every op sends GPU blocks to the CUDA backend, so this only fires on a bug.
fn assert_host(device: Device) {
    assert!(
        device == Device::Cpu,
        "ndscope bug: host access to {device} memory"
    );
}

impl<'a> Buf<'a> {
    /// # Safety
    /// `ptr` points to `bytes` initialised bytes of `device` memory, aligned to 64, that stay valid
    /// and unwritten while `'a` lasts.
    #[inline]
    pub(crate) unsafe fn new(ptr: NonNull<u8>, bytes: usize, device: Device) -> Buf<'a> {
        Buf {
            ptr,
            bytes,
            device,
            _life: PhantomData,
        }
    }

    /// The whole block as elements of `T` (a host block; the caller checked the dtype).
    #[inline]
    pub(crate) fn host<T: Plain>(self) -> &'a [T] {
        assert_host(self.device);
        // SAFETY: by the constructor's contract the bytes are initialised, aligned to 64 (enough for
        // every element type), valid and unwritten for 'a; every bit pattern is a valid `T`.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>(), self.bytes / size_of::<T>())
        }
    }

    /// The number of bytes.
    pub(crate) fn len(&self) -> usize {
        self.bytes
    }

    /// The whole host block as bytes.
    pub(crate) fn bytes(self) -> &'a [u8] {
        self.host::<u8>()
    }

    /// The device address of the block's first byte.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels take addresses
    pub(crate) fn address(self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl<'a> BufMut<'a> {
    /// # Safety
    /// As for [`Buf::new`], and no other view of these bytes exists while `'a` lasts.
    #[inline]
    pub(crate) unsafe fn new(ptr: NonNull<u8>, bytes: usize, device: Device) -> BufMut<'a> {
        BufMut {
            ptr,
            bytes,
            device,
            _life: PhantomData,
        }
    }

    /// The whole block as mutable elements of `T` (a host block; the caller checked the dtype).
    #[inline]
    pub(crate) fn host<T: Plain>(self) -> &'a mut [T] {
        assert_host(self.device);
        // SAFETY: as in `Buf::host`, and the constructor's contract makes this the only view.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().cast::<T>(),
                self.bytes / size_of::<T>(),
            )
        }
    }

    /// The whole host block as mutable bytes.
    pub(crate) fn bytes(self) -> &'a mut [u8] {
        self.host::<u8>()
    }

    /// The host block as two arrays: `first` elements of `A`, then, from the next multiple of 64
    /// bytes ([`split_bytes`]), as many `B` as fit (a kernel's scratch of two element types).
    ///
    /// # Panics
    /// When the block is shorter than the `first` elements of `A`.
    pub(crate) fn host_split<A: Plain, B: Plain>(self, first: usize) -> (&'a mut [A], &'a mut [B]) {
        assert_host(self.device);
        let start = split_bytes::<A>(first);
        assert!(
            start <= self.bytes,
            "ndscope bug: a scratch block shorter than its first part"
        );
        let rest = (self.bytes - start) / size_of::<B>();
        // SAFETY: by the constructor's contract the block's bytes are initialised, aligned to 64
        // and this is their only view for 'a. The two parts are disjoint (`first` elements of `A`
        // end at or before `start`, and `rest` elements of `B` from `start` end inside the block);
        // `start` is a multiple of 64, so both parts are aligned for every `Plain` type, and every
        // bit pattern is a valid `A` and `B`.
        unsafe {
            let base = self.ptr.as_ptr();
            (
                std::slice::from_raw_parts_mut(base.cast::<A>(), first),
                std::slice::from_raw_parts_mut(base.add(start).cast::<B>(), rest),
            )
        }
    }

    /// The same bytes for a shorter borrow, leaving this view usable afterwards.
    #[inline]
    pub(crate) fn reborrow(&mut self) -> BufMut<'_> {
        BufMut {
            ptr: self.ptr,
            bytes: self.bytes,
            device: self.device,
            _life: PhantomData,
        }
    }

    /// The device address of the block's first byte.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels take addresses
    pub(crate) fn address(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

/// Where [`BufMut::host_split`]'s second part starts after `first` elements of `A`: their bytes
/// rounded up to 64.
pub(crate) fn split_bytes<A>(first: usize) -> usize {
    (first * size_of::<A>()).next_multiple_of(64)
}

/// An operand: a block and the layout through which a kernel reads it.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    pub(crate) buf: Buf<'a>,
    pub(crate) layout: &'a Layout,
}

/// An output: a block and the layout of the elements a kernel writes (a fresh contiguous tensor, or
/// a view of one whose elements do not overlap).
pub(crate) struct Dst<'a> {
    pub(crate) buf: BufMut<'a>,
    pub(crate) layout: &'a Layout,
}

impl<'a> Src<'a> {
    /// The viewed elements of a contiguous host operand, in order.
    #[inline]
    pub(crate) fn contiguous_host<T: Element>(self) -> &'a [T] {
        debug_assert!(self.layout.is_contiguous());
        let at = self.layout.offset();
        &self.buf.host::<T>()[at..at + self.layout.numel()]
    }
}

impl<'a> Dst<'a> {
    /// The viewed elements of a contiguous host output, in order.
    #[inline]
    pub(crate) fn contiguous_host<T: Element>(self) -> &'a mut [T] {
        debug_assert!(self.layout.is_contiguous());
        let (at, n) = (self.layout.offset(), self.layout.numel());
        &mut self.buf.host::<T>()[at..at + n]
    }
}

/// The operands of fused attention ([`op::Attention`]): queries, keys and values as `[batch, heads,
/// len, width]` views whose width has stride 1, and how many keys each batch holds (contiguous `i64`
/// `[batch]`, clamped to `[0, keys]`; `None`: all of them).
#[derive(Clone, Copy)]
pub(crate) struct AttentionInputs<'a> {
    pub(crate) q: Src<'a>,
    pub(crate) k: Src<'a>,
    pub(crate) v: Src<'a>,
    pub(crate) key_lengths: Option<Src<'a>>,
}

/// Where a page keeps its tokens' keys and values: a page is `[layers, 2, heads, tokens, width]`
/// elements (index 0 of the second axis holds keys, 1 values), so one head's keys of one layer are
/// `tokens × width` consecutive elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageGeometry {
    pub(crate) layers: usize,
    pub(crate) heads: usize,
    pub(crate) tokens: usize,
    pub(crate) width: usize,
}

impl PageGeometry {
    /// Elements per page.
    pub(crate) fn page_elements(&self) -> usize {
        self.layers * 2 * self.heads * self.tokens * self.width
    }

    /// The element where the row of token `slot`, head `head`, keys (`kv = 0`) or values (`kv = 1`)
    /// of `layer` starts in a page.
    pub(crate) fn row(&self, layer: usize, kv: usize, head: usize, slot: usize) -> usize {
        (((layer * 2 + kv) * self.heads + head) * self.tokens + slot) * self.width
    }
}

/// The cached sequences of one paged-attention call: sequence `s` holds `lengths[s]` tokens in
/// `pages[first[s]..first[s + 1]]`, in order, and its queries are rows `queries[s]..queries[s + 1]`
/// of the packed queries (its last positions, in order).
///
/// For a GPU, `table` is the same as one `i64` device array the kernel reads: for each query row,
/// its sequence's first page in the table and the tokens the row sees, then every page's address.
#[derive(Clone, Copy)]
pub(crate) struct PagedSeqs<'a> {
    pub(crate) pages: &'a [Buf<'a>],
    pub(crate) first: &'a [usize],
    pub(crate) lengths: &'a [usize],
    pub(crate) queries: &'a [usize],
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels read the table
    pub(crate) table: Option<Src<'a>>,
}

/// Where the rows of one paged write go: row `r` to slot `slots[r].1` of `pages[slots[r].0]`.
///
/// For a GPU, `table` is the same as an `i64` device array: the address of each row's key slot
/// (head 0 of the written layer) in its page.
pub(crate) struct PageRows<'a, 'b> {
    pub(crate) pages: &'b mut [BufMut<'a>],
    pub(crate) slots: &'b [(usize, usize)],
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels read the table
    pub(crate) table: Option<Src<'b>>,
}

/// Elements as the bytes a device copy moves.
#[inline]
pub(crate) fn bytes_of<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: element types are plain numbers with no padding; the byte view covers exactly the
    // slice and borrows it.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), size_of_val(data)) }
}

/// Elements as the bytes a device copy fills.
#[inline]
pub(crate) fn bytes_of_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; every byte pattern written is a valid element.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), size_of_val(data)) }
}

/// The kernels of one kind of device. Every method checks nothing that the op already checked:
/// shapes agree, dtypes are ones the op accepts, indices are in range, outputs are fresh.
pub(crate) trait Backend: Sync {
    /// `out = op(x)` elementwise; `out` has `x`'s shape.
    fn unary(&self, dtype: DType, op: Unary, params: [f64; 2], x: Src, out: Dst) -> Result<()>;

    /// `x = op(x)` in place (`x` is contiguous).
    fn unary_in_place(&self, dtype: DType, op: Unary, params: [f64; 2], x: Dst) -> Result<()>;

    /// `out = op(a, b)` elementwise; `a` and `b` are laid out with `out`'s shape (broadcast).
    fn binary(
        &self,
        dtype: DType,
        op: Binary,
        params: [f64; 2],
        a: Src,
        b: Src,
        out: Dst,
    ) -> Result<()>;

    /// `x = op(x, b)` in place (`x` contiguous, `b` laid out with its shape).
    fn binary_in_place(
        &self,
        dtype: DType,
        op: Binary,
        params: [f64; 2],
        x: Dst,
        b: Src,
    ) -> Result<()>;

    /// `out = cond != 0 ? on_true : on_false`; all four hold `dtype` and are laid out with `out`'s
    /// shape.
    fn where_cond(
        &self,
        dtype: DType,
        cond: Src,
        on_true: Src,
        on_false: Src,
        out: Dst,
    ) -> Result<()>;

    /// Copies `x` (of dtype `from`) into `out` (of dtype `to`) element by element in row-major
    /// order, converting; `out` may be a view whose elements do not overlap.
    fn copy(&self, from: DType, to: DType, x: Src, out: Dst) -> Result<()>;

    /// Whether [`reduce`](Self::reduce), [`argmax`](Self::argmax) and [`download`](Self::download)
    /// read any layout; when not, they take a contiguous input (for reductions with the reduced axes
    /// last), and the op packs it so.
    fn reads_any_layout(&self) -> bool;

    /// Reduces `x` over the sorted `axes` into the contiguous `out` (the reduced axes as size 1).
    fn reduce(&self, dtype: DType, op: Reduce, x: Src, axes: &[usize], out: Dst) -> Result<()>;

    /// Index of the first largest element (the first NaN) along the non-empty `axis`, into the
    /// contiguous `i64` output (`axis` as size 1).
    fn argmax(&self, dtype: DType, x: Src, axis: usize, out: Dst) -> Result<()>;

    /// Running sums of the rows of the contiguous `x` along its last axis (from the end when
    /// `reverse`), added in order, into the contiguous `out`.
    fn cumsum(&self, dtype: DType, x: Src, reverse: bool, out: Dst) -> Result<()>;

    /// Rotary position embedding of float `x` `[tokens, heads, dim]` (contiguous, `dim` even) into
    /// `out` (the same shape, fresh): each row's planes `(i, i + dim/2)` rotated by the angle whose
    /// cosine and sine `cos` and `sin` (`[positions, dim/2]`, contiguous, in the compute type: `f64`
    /// for `f64`, else `f32`) hold at row `positions[token]` (`i64 [tokens]`, in range on the host;
    /// a GPU kernel writes NaN for one out of range, which only a captured step can pass). By the
    /// opposite angle when `inverse` (the derivative).
    #[allow(clippy::too_many_arguments)] // the op's operands, each a buffer
    fn rotary(
        &self,
        dtype: DType,
        x: Src,
        cos: Src,
        sin: Src,
        positions: Src,
        inverse: bool,
        out: Dst,
    ) -> Result<()>;

    /// Softmax (or log-softmax) of the rows of the contiguous `x` along its last axis.
    fn softmax(&self, dtype: DType, x: Src, log: bool, out: Dst) -> Result<()>;

    /// RMS normalisation of each row of the contiguous `x` along its last axis into the contiguous
    /// `out`: `inv = 1 / sqrt(Σ x² / len + eps)` in the compute type (`f64` for `f64`, else `f32`),
    /// `n = x · inv` rounded to `dtype`, then `n · weight` rounded again where the contiguous
    /// `weight` (`[len]`, `dtype`) is given (transformers' `LlamaRMSNorm` for 16-bit rows).
    fn rms_norm(&self, dtype: DType, x: Src, weight: Option<Src>, eps: f64, out: Dst)
    -> Result<()>;

    /// `ln Σ_j e^(x_j)` of each row of the contiguous `x` along its last axis, into the contiguous
    /// `out` of the compute type (`f64` for `f64`, else `f32`): `-inf` for a row of `-inf`, NaN for
    /// a row holding NaN.
    fn logsumexp(&self, dtype: DType, x: Src, out: Dst) -> Result<()>;

    /// The derivative of cross-entropy with respect to contiguous `logits` `[rows, classes]`:
    /// `out[r, j] = (e^(logits[r, j] - lse[r]) - (1 - ε)·[j = labels[r]] - ε / classes) · weight[r]`,
    /// from each row's `lse` (contiguous, compute type), `i64` labels `[rows]` and the contiguous
    /// compute-type `weight` `[rows]` (d loss / d row's term), with label smoothing `ε`.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_grad(
        &self,
        dtype: DType,
        logits: Src,
        lse: Src,
        labels: Src,
        weight: Src,
        smoothing: f64,
        out: Dst,
    ) -> Result<()>;

    /// Fused attention: `out` (`[batch, heads, queries, value width]`, width stride 1) and the
    /// contiguous `lse` (`[batch, heads, queries]`, in the compute type: `f64` for `f64`, else `f32`).
    fn attention(
        &self,
        dtype: DType,
        math: &Attention,
        inputs: AttentionInputs,
        out: Dst,
        lse: Dst,
    ) -> Result<()>;

    /// The gradients of fused attention with respect to queries, keys and values (`grads`, laid out
    /// as the inputs' shapes with width stride 1) from the forward pass's `out` and `lse` and the
    /// output's gradient `dout` (`out`'s shape, width stride 1). `scratch` is a contiguous buffer of
    /// `lse`'s shape and dtype that the kernels may use (the GPU keeps each `D_i` there).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dtype: DType,
        math: &Attention,
        inputs: AttentionInputs,
        out: Src,
        dout: Src,
        lse: Src,
        scratch: Dst,
        grads: [Dst; 3],
    ) -> Result<()>;

    /// Attention of the packed queries `q` (`[rows, heads, width]`, width stride 1; each sequence's
    /// rows together) over the keys and values cached in pages ([`op::PagedAttention`] states the
    /// math) into the contiguous `out` (`q`'s shape and dtype).
    fn paged_attention(
        &self,
        dtype: DType,
        math: &PagedAttention,
        geometry: PageGeometry,
        q: Src,
        seqs: PagedSeqs,
        out: Dst,
    ) -> Result<()>;

    /// Writes row `r` of `kv` (`[rows, 2, heads, width]`: keys then values, width stride 1) into
    /// its slot of `layer` in its page.
    fn write_pages(
        &self,
        dtype: DType,
        geometry: PageGeometry,
        layer: usize,
        kv: Src,
        rows: PageRows,
    ) -> Result<()>;

    /// `out[p] = src[p with coordinate axis replaced by index[p]]`; `index` (`i64`) has the output's
    /// shape (a broadcast layout for `index_select`).
    fn gather(&self, dtype: DType, src: Src, axis: usize, index: Src, out: Dst) -> Result<()>;

    /// `target[p with coordinate axis replaced by index[p]] += src[p]` for every position `p` of
    /// `src`'s shape, which `index` has (broadcast for `index_add`); repeated indices accumulate.
    #[allow(clippy::too_many_arguments)]
    fn scatter_add(
        &self,
        op: &'static str,
        dtype: DType,
        target: Dst,
        axis: usize,
        index: Src,
        src: Src,
    ) -> Result<()>;

    /// Whether [`matmul`](Self::matmul) reads an operand laid out as `layout` (rank ≥ 2) in a product
    /// over the broadcast `batch` dimensions; when not, the op passes a contiguous copy broadcast to
    /// the full batch.
    fn matmul_reads(&self, layout: &Layout, batch: &[usize]) -> bool;

    /// Bytes of memory [`matmul`](Self::matmul) needs beside its operands for `a b` (`(m, k, n)`,
    /// the operands laid out as they will be passed): on the host, the packed operands of a bf16
    /// product and the transposed chunks of an `f32` product by a transposed weight; none for
    /// every other product. The op allocates them as a temporary of the
    /// scope, so that the packing reuses pool memory from step to step (counted in the scope's
    /// stats) instead of taking fresh pages from the kernel on every call.
    fn matmul_scratch_bytes(
        &self,
        dtype: DType,
        a: &Layout,
        b: &Layout,
        mkn: (usize, usize, usize),
    ) -> usize {
        let _ = (dtype, a, b, mkn);
        0
    }

    /// `out[b] = a[b] @ b[b]` for every index `b` of `batch` (operands of rank ≥ 2 whose batch
    /// dimensions broadcast to it), `m×k @ k×n`, into the contiguous `out` (float dtypes; 16-bit
    /// products accumulate in `f32`). With `tf32`, an `f32` product may read its operands as TF32
    /// (10-bit significands) on tensor cores; a backend without them computes in full `f32`.
    /// `scratch` is a block of at least [`matmul_scratch_bytes`](Self::matmul_scratch_bytes),
    /// when that is not 0 (its contents do not matter).
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        dtype: DType,
        a: Src,
        b: Src,
        batch: &[usize],
        mkn: (usize, usize, usize),
        out: Dst,
        tf32: bool,
        scratch: Option<Dst>,
    ) -> Result<()>;

    /// Whether [`matmul_rounding`](Self::matmul_rounding) computes products in `dtype` here.
    fn matmul_rounds(&self, dtype: DType) -> bool {
        let _ = dtype;
        false
    }

    /// [`matmul`](Self::matmul) in `dtype` of `a` (in `dtype`) by an `f32` `b` whose elements are
    /// rounded to `dtype` as the product reads them: the result of the product with `b`'s rounded
    /// copy, without writing the copy (autocast's products of `f32` weights). The op calls it only
    /// where [`matmul_rounds`](Self::matmul_rounds) says so; `scratch` is as for `matmul`, sized
    /// by [`matmul_scratch_bytes`](Self::matmul_scratch_bytes) for `dtype`.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) on a backend or dtype without it.
    #[allow(clippy::too_many_arguments)]
    fn matmul_rounding(
        &self,
        dtype: DType,
        a: Src,
        b: Src,
        batch: &[usize],
        mkn: (usize, usize, usize),
        out: Dst,
        scratch: Option<Dst>,
    ) -> Result<()> {
        let _ = (a, b, batch, mkn, out, scratch);
        Err(crate::Error::UnsupportedDType {
            op: "matmul_rounding",
            dtype,
            expected: "a dtype for which the backend's matmul_rounds is true",
        })
    }

    /// Whether this backend's quantized products read matrices of `ty` in strips of 16 interleaved
    /// rows (`quant::strips`) rather than in row order: a quantized matrix is stored in the order
    /// its device's kernel reads.
    fn quant_strips(&self, ty: crate::quant::QuantType) -> bool {
        let _ = ty;
        false
    }

    /// Bytes of device memory [`quant_matmul`](Self::quant_matmul) needs beside its operands for
    /// `m` rows of `k` values (a GPU's rounded activations; none on the host, which rounds them in
    /// its own buffers).
    fn quant_scratch_bytes(&self, m: usize, k: usize) -> usize {
        let _ = (m, k);
        0
    }

    /// `out = x Ŵᵀ` for the contiguous `f32` rows `x` (`m × k`), the `n` contiguous stored rows
    /// `w` of the block format `ty` (`k` values each; in strips if `in_strips`, see
    /// [`quant_strips`](Self::quant_strips)) and the contiguous `f32` `out` (`m × n`), with `x`
    /// rounded to 8 bits per block of 32 first (see `cpu::quant_product`). `scratch` is a fresh
    /// block of at least [`quant_scratch_bytes`](Self::quant_scratch_bytes), when that is not 0.
    #[allow(clippy::too_many_arguments)]
    fn quant_matmul(
        &self,
        ty: crate::quant::QuantType,
        in_strips: bool,
        x: Src,
        w: Src,
        mkn: (usize, usize, usize),
        out: Dst,
        scratch: Option<Dst>,
    ) -> Result<()>;

    /// One fused optimizer step over contiguous targets (the parameter first) of `grad`'s shape;
    /// `powers` is the contiguous `f64` `[b1^t, b2^t]` an Adam update reads (`None` for SGD).
    fn fused_update(
        &self,
        dtype: DType,
        update: FusedUpdate,
        targets: SmallVec<[Dst; 3]>,
        grad: Src,
        powers: Option<Src>,
    ) -> Result<()>;

    /// Sliding windows of the planes of the contiguous `x` (`[planes, rows, cols]`) as columns: the
    /// contiguous `out` is `[planes, kernel rows, kernel cols, output rows, output cols]`, each element
    /// the input element its window tap reads (`Window2d::source`), or `pad` in the padding.
    fn unfold2d(&self, dtype: DType, window: &Window2d, pad: f64, x: Src, out: Dst) -> Result<()>;

    /// The adjoint of [`unfold2d`](Self::unfold2d): every element of the contiguous `out`
    /// (`[planes, rows, cols]`) is the sum of the columns of the contiguous `cols` that read it, added
    /// in kernel-offset order (so every device rounds the same way); padding taps are dropped.
    fn fold2d(&self, dtype: DType, window: &Window2d, cols: Src, out: Dst) -> Result<()>;

    /// Fills the contiguous float `out` with element `i` = `dist.sample(seed, offset + i)`, rounded
    /// to `dtype` (`crate::rng` states the function).
    fn random(
        &self,
        dtype: DType,
        dist: Distribution,
        seed: u64,
        offset: u64,
        out: Dst,
    ) -> Result<()>;

    /// Copies host bytes (elements of `dtype` in row-major order) into the contiguous `out`.
    fn upload(&self, dtype: DType, data: &[u8], out: Dst) -> Result<()>;

    /// Copies the elements of `x`, in row-major order, to host bytes; returns once they arrived.
    fn download(&self, dtype: DType, x: Src, out: &mut [u8]) -> Result<()>;

    /// Waits until every queued kernel has run.
    fn synchronize(&self) -> Result<()>;

    /// Whether the device's stream is being captured into a CUDA graph now (kernels are recorded,
    /// not run, so nothing may wait for them).
    fn capturing(&self) -> bool {
        false
    }
}

/// Captures in progress on any GPU; lets [`capturing`] answer for every other case without a lookup.
static ACTIVE_CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// Whether `device`'s stream is being captured into a CUDA graph now.
#[inline]
pub(crate) fn capturing(device: Device) -> bool {
    ACTIVE_CAPTURES.load(Ordering::Acquire) > 0
        && device != Device::Cpu
        && of(device).is_ok_and(|b| b.capturing())
}

thread_local! {
    /// Whether this thread opened the capture in progress (one thread captures a GPU at a time).
    static CAPTURER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A step captured on a GPU's stream (uninhabited without the `cuda` feature).
pub(crate) use cuda::Graph;

/// A process's NCCL communicator on one GPU, and the unique id rank 0 makes for it (uninhabited and
/// refused without the `cuda` feature).
pub(crate) use cuda::{Nccl, nccl_unique_id};

/// How an NCCL all-reduce combines the ranks' values (a mean is a sum its caller divides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NcclReduce {
    Sum,
    Max,
    Min,
}

/// Starts capturing the stream of `device` (a GPU) on this thread: from now until
/// [`end_capture`], its kernels and copies are recorded, not run.
pub(crate) fn begin_capture(device: Device) -> Result<()> {
    let ordinal = gpu_ordinal(device)?;
    cuda::begin_capture(ordinal)?;
    CAPTURER.with(|c| c.set(true));
    ACTIVE_CAPTURES.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// Ends the capture that [`begin_capture`] started and instantiates the graph.
pub(crate) fn end_capture(device: Device) -> Result<Graph> {
    let ordinal = gpu_ordinal(device)?;
    ACTIVE_CAPTURES.fetch_sub(1, Ordering::AcqRel);
    CAPTURER.with(|c| c.set(false));
    cuda::end_capture(ordinal)
}

/// Whether `device` is being captured by another thread than this one (whose kernels would land in
/// that thread's graph, since a GPU has one stream).
#[inline]
pub(crate) fn captured_elsewhere(device: Device) -> bool {
    capturing(device) && !CAPTURER.with(std::cell::Cell::get)
}

/// Copies `data` to the GPU memory at `ptr` (a device address) on `device`'s stream.
///
/// # Safety
/// `ptr` starts `data.len()` bytes of live memory of `device` that nothing else writes until the
/// stream has run the copy.
pub(crate) unsafe fn copy_to_device(device: Device, ptr: NonNull<u8>, data: &[u8]) -> Result<()> {
    let ordinal = gpu_ordinal(device)?;
    // SAFETY: forwarded from the caller.
    unsafe { cuda::copy_to_device(ordinal, ptr, data) }
}

/// Copies the GPU memory at `ptr` on `device` into `out`, after everything queued on the stream.
///
/// # Safety
/// `ptr` starts `out.len()` bytes of live memory of `device`.
pub(crate) unsafe fn copy_from_device(
    device: Device,
    ptr: NonNull<u8>,
    out: &mut [u8],
) -> Result<()> {
    let ordinal = gpu_ordinal(device)?;
    // SAFETY: forwarded from the caller.
    unsafe { cuda::copy_from_device(ordinal, ptr, out) }
}

/// `Err(InsideCapture)` for `op` doing `what` on `device` while it is being captured.
pub(crate) fn refuse_inside_capture(
    device: Device,
    op: &'static str,
    what: &'static str,
) -> Result<()> {
    if capturing(device) {
        return Err(crate::error::Error::InsideCapture {
            op,
            device: device.to_string(),
            what,
        });
    }
    Ok(())
}

/// The backend of `device`.
///
/// # Errors
/// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) when this build or machine cannot
/// use the device.
#[inline]
pub(crate) fn of(device: Device) -> Result<&'static dyn Backend> {
    match device {
        Device::Cpu => Ok(&cpu::Cpu),
        Device::Cuda(ordinal) => cuda::backend(ordinal),
    }
}

impl Device {
    /// Checks that this build of ndscope, on this machine, can use the device: for a GPU, that the
    /// `cuda` feature is on, the driver loads, the ordinal exists, and its context and kernels are
    /// ready (the first call per GPU compiles the kernels; later calls are a lookup).
    ///
    /// ```
    /// use ndscope::Device;
    /// assert!(Device::Cpu.check_available().is_ok());
    /// match Device::Cuda(0).check_available() {
    ///     Ok(()) => println!("a GPU is ready"),
    ///     Err(e) => println!("{e}"), // says why: no `cuda` feature, no driver, no such GPU, ...
    /// }
    /// ```
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) with the reason and what to do
    /// about it.
    pub fn check_available(self) -> Result<()> {
        of(self).map(|_| ())
    }

    /// Waits until every op queued on the device has finished (a GPU runs ops asynchronously; the
    /// host never waits for the CPU). Reading results (`to_vec`, `to_device`) waits by itself; this
    /// is for timing.
    ///
    /// # Errors
    /// As for [`check_available`](Self::check_available); CUDA errors a kernel reported.
    pub fn synchronize(self) -> Result<()> {
        of(self)?.synchronize()
    }
}

/// A GPU's allocator traffic since the process started, and how often the host waited for it,
/// from [`gpu_memory`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuMemory {
    /// The GPU's memory.
    pub total_bytes: usize,
    /// Its memory no one holds now (this process's trees, the driver's pools, other processes).
    pub free_bytes: usize,
    /// Calls to the driver's allocator (`cuMemAllocAsync`/`cuMemAlloc`) by any scope tree.
    pub allocator_calls: u64,
    /// Calls to the driver's free.
    pub free_calls: u64,
    /// Bytes held from the driver now: live tensors, cached blocks and workspace arenas.
    pub reserved_bytes: usize,
    /// The most bytes held from the driver at once.
    pub peak_reserved_bytes: usize,
    /// Times the host waited for the GPU to run everything queued: each read of GPU memory on the
    /// host (`to_vec`, `to_scalar`, an index check that must read its indices back), each
    /// [`Device::synchronize`], and the rare waits of the library itself (a refused allocation
    /// retried after the driver's pool is trimmed, a collective's communicator closing). While the
    /// host waits, nothing new is queued, so the GPU then idles until the host catches up: a
    /// decoding step waits once (for its logits).
    pub host_waits: u64,
}

/// The GPU ordinal of `device`, for GPU-only questions.
fn gpu_ordinal(device: Device) -> Result<usize> {
    match device {
        Device::Cuda(ordinal) => Ok(ordinal),
        Device::Cpu => Err(crate::Error::DeviceUnavailable {
            device: device.to_string(),
            reason: "it is not a GPU; GPU memory statistics and kernels need Device::Cuda(n)"
                .into(),
        }),
    }
}

/// Allocator traffic of a GPU over the whole process (every scope tree that used it), for
/// measuring: a steady training loop keeps `allocator_calls` still. Opens the GPU if needed.
///
/// ```
/// use ndscope::{Device, gpu_memory};
/// match gpu_memory(Device::Cuda(0)) {
///     Ok(m) => println!("{} allocator calls, {} B reserved", m.allocator_calls, m.reserved_bytes),
///     Err(e) => println!("{e}"), // no usable GPU here
/// }
/// assert!(gpu_memory(Device::Cpu).is_err());
/// ```
///
/// # Errors
/// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) when the device cannot be used or
/// is not a GPU.
pub fn gpu_memory(device: Device) -> Result<GpuMemory> {
    cuda::memory_stats(gpu_ordinal(device)?)
}

/// Resets the peak of [`gpu_memory`] to the bytes reserved now.
///
/// # Errors
/// As for [`gpu_memory`].
pub fn reset_gpu_memory_peak(device: Device) -> Result<()> {
    cuda::reset_memory_peak(gpu_ordinal(device)?)
}
