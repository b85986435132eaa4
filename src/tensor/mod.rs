//! `Tensor<'s>`: a counted handle to a storage block owned by a live scope, plus a layout and dtype.

mod collective;
mod create;
mod display;
mod quantized;

pub use quantized::QuantTensor;

pub(crate) use collective::{GpuCommunicator, GpuReduce};

use std::marker::PhantomData;
use std::panic::Location;
use std::ptr::NonNull;

use crate::backend::{self, Backend, Dst, Src, bytes_of, bytes_of_mut};
use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::layout::{Layout, RowWalk};
use crate::memory::block::{BlockRef, Home, Region, ShapeSummary, new_system_block};
use crate::memory::raw;
use crate::memory::reclaim::{self, Refused};
use crate::scope::node::{Placement, ScopeNode, refused};
use crate::scope::{Movable, Scope};

/// An n-dimensional array whose memory is owned by a scope that lives at least as long as `'s`.
///
/// * `clone()` is a cheap alias of the same block; the block goes back to its scope's cache when the
///   last alias drops.
/// * `'s` is covariant: a tensor of a longer-lived scope (a model parameter) can be used where a
///   tensor of a shorter-lived one (a batch) is expected, and an op's result is typed with the
///   shortest lifetime among its operands.
/// * An op's result is owned by the innermost live scope among the operands' owners, never by a
///   longer-lived one.
/// * A tensor is neither `Send` nor `Sync`, except a moved-out `Tensor<'static>` (see
///   [`move_out`](Tensor::move_out)), which any thread may use.
pub struct Tensor<'s> {
    block: BlockRef,
    layout: Layout,
    dtype: DType,
    _scope: PhantomData<&'s ()>,
}

// SAFETY: a `Tensor<'static>` can only come from `move_out` (every scope's lifetime is higher-ranked,
// hence never 'static), and op results of 'static operands are system-owned too: its block has a boxed
// header with an atomic count whose other fields are written only through a unique handle, and boxed
// memory freed by the last handle on whichever thread drops it.
unsafe impl Send for Tensor<'static> {}
// SAFETY: as above; `&Tensor` gives read-only access, and writes need `&mut` plus a unique block.
unsafe impl Sync for Tensor<'static> {}

/// Who owns a block: the never-closing system scope, or a scope of a tree.
#[derive(Clone, Copy)]
pub(crate) enum Owner<'n> {
    System,
    Node(&'n ScopeNode),
    /// A scope receiving the copy of a tensor moved to it (not a new value made there).
    Moving(&'n ScopeNode),
}

impl<'n> Owner<'n> {
    /// Where an op's result goes: the owner that closes first among `tensors`' owners (the system
    /// scope never closes), or the scope a running differentiable op places its results in
    /// ([`Placement`]) when that closes sooner still.
    pub(crate) fn innermost(tensors: &'n [&'n Tensor<'_>]) -> Owner<'n> {
        let (mut best, mut best_order) = match Placement::current() {
            Some(node) => (Owner::Node(node), node.order),
            None => (Owner::System, 0),
        };
        for t in tensors {
            if let Some(node) = ScopeNode::owning(t.block.header())
                && node.order > best_order
            {
                best_order = node.order;
                best = Owner::Node(node);
            }
        }
        best
    }

    /// The scope that owns `t`'s block itself (no placement): where a copy that replaces `t`'s
    /// block must go.
    fn of(t: &'n Tensor<'_>) -> Owner<'n> {
        ScopeNode::owning(t.block.header()).map_or(Owner::System, Owner::Node)
    }

    /// Allocates a contiguous block of `device` memory for `shape` in this owner.
    #[inline]
    pub(crate) fn alloc(
        self,
        device: Device,
        dtype: DType,
        shape: &[usize],
        at: &'static Location<'static>,
    ) -> Result<BlockRef> {
        match self {
            Owner::Node(node) => node.alloc(device, dtype, shape, at, false),
            Owner::Moving(node) => node.alloc(device, dtype, shape, at, true),
            Owner::System => {
                let bytes = crate::layout::checked_numel(shape, dtype.size())? * dtype.size();
                if bytes == 0 {
                    return Ok(new_system_block(
                        Region::empty(device),
                        dtype,
                        ShapeSummary::of(shape),
                        at,
                    ));
                }
                let capacity = bytes.next_multiple_of(raw::ALIGN);
                let ptr = reclaim::alloc(device, capacity).map_err(|Refused { released }| {
                    let live = crate::scope::system_stats().live_bytes;
                    refused("system", device, bytes, released, None, live)
                })?;
                let region = Region::heap(ptr, bytes, capacity, device);
                Ok(new_system_block(region, dtype, ShapeSummary::of(shape), at))
            }
        }
    }
}

impl<'s> Tensor<'s> {
    #[inline]
    pub(crate) fn from_parts(block: BlockRef, layout: Layout, dtype: DType) -> Tensor<'s> {
        Tensor {
            block,
            layout,
            dtype,
            _scope: PhantomData,
        }
    }

    /// A new contiguous tensor of `device` memory in `owner`; its contents are stale bytes that the
    /// caller overwrites.
    #[inline]
    pub(crate) fn uninit_in(
        owner: Owner<'_>,
        device: Device,
        dtype: DType,
        shape: &[usize],
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let block = owner.alloc(device, dtype, shape, at)?;
        Ok(Tensor::from_parts(block, Layout::contiguous(shape), dtype))
    }

    /// A new contiguous tensor owned by the innermost owner among `operands`, on their device (the
    /// caller checked that they share one).
    pub(crate) fn output_of(
        operands: &[&Tensor<'s>],
        dtype: DType,
        shape: &[usize],
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let device = operands.first().map_or(Device::Cpu, |t| t.device());
        Tensor::uninit_in(Owner::innermost(operands), device, dtype, shape, at)
    }

    /// The tensor's storage block: what a page table (`memory::pages`) cuts its views from.
    pub(crate) fn storage(&self) -> &BlockRef {
        &self.block
    }

    /// Records that every element of this fresh `i64` tensor's block lies in `lo..=hi`, as its
    /// creator saw on the host; the next write to the block forgets it.
    pub(crate) fn note_index_range(&mut self, lo: i64, hi: i64) {
        self.block.note_index_range(lo, hi);
    }

    /// The range of the block's `i64` elements known without reading them, if any (every element of
    /// any view of the block lies in it).
    pub(crate) fn known_index_range(&self) -> Option<(i64, i64)> {
        self.block.index_range()
    }

    /// A view of the same block with another layout.
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor<'s> {
        debug_assert!(
            layout.extent() * self.dtype.size() <= self.block.header().bytes.get(),
            "a view must stay inside its block"
        );
        Tensor::from_parts(self.block.clone(), layout, self.dtype)
    }

    fn rebrand<'b>(self) -> Tensor<'b> {
        Tensor {
            block: self.block,
            layout: self.layout,
            dtype: self.dtype,
            _scope: PhantomData,
        }
    }

    /// Size of each dimension.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        self.layout.strides()
    }

    /// Shape, strides and offset of the elements in the storage block.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where the elements live.
    #[inline]
    pub fn device(&self) -> Device {
        self.block.header().device.get()
    }

    /// Whether the elements are row-major without gaps (see [`Layout::is_contiguous`]).
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// The name shown by `dump()`, if one was given.
    pub fn name(&self) -> Option<&'static str> {
        self.block.header().name.get()
    }

    /// Names the tensor's block for [`Scope::dump`]. A moved-out block shared with other handles keeps
    /// its name (other threads may be reading it).
    pub fn named(self, name: &'static str) -> Tensor<'s> {
        let h = self.block.header();
        if !h.is_system() || h.is_unique() {
            h.name.set(Some(name));
        }
        self
    }

    /// Names the block by a path built at run time (a checkpoint's tensor name, a parameter's path
    /// in its model). Each distinct name is stored once for the process ([`interned`]): paths come
    /// from a model's structure, so they are bounded; per-step names must stay `&'static str`
    /// ([`named`](Self::named)).
    pub(crate) fn named_path(self, name: &str) -> Tensor<'s> {
        self.named(interned(name))
    }

    /// Records `site` as where the block was created, as `dump()` shows it: a loader's caller
    /// rather than the library line that allocated the block. Like [`named`](Self::named), it
    /// leaves a shared moved-out block alone.
    pub(crate) fn created_at(self, site: &'static Location<'static>) -> Tensor<'s> {
        let h = self.block.header();
        if !h.is_system() || h.is_unique() {
            h.created_at.set(site);
        }
        self
    }

    /// Whether two tensors share a storage block (views and clones do).
    pub fn shares_storage(&self, other: &Tensor<'_>) -> bool {
        self.block.as_ptr() == other.block.as_ptr()
    }

    /// Whether the block is owned by the never-closing system scope (the tensor was moved out with
    /// [`move_out`](Self::move_out), or computed from such tensors only).
    pub fn is_moved_out(&self) -> bool {
        self.block.header().is_system()
    }

    /// Identifies the handle's storage block (autograd keys parameters by it: every view of one
    /// parameter shares it).
    pub(crate) fn block_id(&self) -> usize {
        self.block.as_ptr() as usize
    }

    /// Bytes of the storage block (the tensor it was created as).
    pub(crate) fn block_bytes(&self) -> usize {
        self.block.header().bytes.get()
    }

    /// Whether the scope that owns the tensor lets `f32` products read their operands as TF32
    /// ([`Scope::allow_tf32`](crate::Scope::allow_tf32)).
    pub(crate) fn allows_tf32(&self) -> bool {
        ScopeNode::owning(self.block.header()).is_some_and(|n| n.tf32())
    }

    /// The backend of the tensor's device.
    #[inline]
    pub(crate) fn backend(&self) -> Result<&'static dyn Backend> {
        let device = self.device();
        if backend::captured_elsewhere(device) {
            return Err(Error::InsideCapture {
                op: "an op",
                device: device.to_string(),
                what: "running a kernel from another thread",
            });
        }
        backend::of(device)
    }

    /// The tensor as a kernel operand.
    #[inline]
    pub(crate) fn src(&self) -> Src<'_> {
        self.src_as(&self.layout)
    }

    /// The tensor's block read through another layout (a broadcast of its own).
    #[inline]
    pub(crate) fn src_as<'a>(&'a self, layout: &'a Layout) -> Src<'a> {
        Src {
            buf: self.block.buf(),
            layout,
        }
    }

    /// The tensor as a kernel output: a fresh output, or a tensor made unique by the copy-on-write
    /// step of an in-place op.
    #[inline]
    pub(crate) fn dst(&mut self) -> Dst<'_> {
        Dst {
            buf: self.block.buf_mut().expect("an output has a single handle"),
            layout: &self.layout,
        }
    }

    /// The tensor's block written through `layout`, a view of part of a fresh output.
    #[inline]
    pub(crate) fn dst_as<'a>(&'a mut self, layout: &'a Layout) -> Dst<'a> {
        Dst {
            buf: self.block.buf_mut().expect("an output has a single handle"),
            layout,
        }
    }

    /// Where the first element is, when the tensor is contiguous and lives in a workspace arena: a
    /// planned slot keeps that address in every cycle that replays its plan.
    pub(crate) fn arena_address(&self) -> Option<NonNull<u8>> {
        let h = self.block.header();
        if h.home.get() != Home::Arena || !self.layout.is_contiguous() {
            return None;
        }
        let offset = self.layout.offset() * self.dtype.size();
        NonNull::new(h.ptr.get().as_ptr().wrapping_add(offset))
    }

    /// `Err(InsideCapture)` naming `op` and `what` it would do, when the tensor's GPU is being
    /// captured into a CUDA graph.
    pub(crate) fn refuse_inside_capture(&self, op: &'static str, what: &'static str) -> Result<()> {
        backend::refuse_inside_capture(self.device(), op, what)
    }

    /// Writes `data` (row-major, the tensor's dtype) into the contiguous, unique tensor.
    pub(crate) fn upload<T: Element>(&mut self, data: &[T]) -> Result<()> {
        self.upload_bytes(bytes_of(data))
    }

    /// As [`upload`](Self::upload), from the elements' little-endian bytes (which need no alignment).
    pub(crate) fn upload_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        const {
            assert!(
                cfg!(target_endian = "little"),
                "ndscope stores elements little-endian, as its checkpoints do"
            )
        };
        self.refuse_inside_capture("upload", "copying host data to the GPU")?;
        let backend = self.backend()?;
        backend.upload(self.dtype, bytes, self.dst())
    }

    /// The elements as a slice, for a contiguous tensor of element type `T`; borrowing the tensor
    /// while the slice lives (so no in-place op can change it meanwhile).
    ///
    /// # Errors
    /// [`Error::ElementType`] when `T` is not the tensor's dtype, [`Error::NotContiguous`] for a
    /// strided view (call [`contiguous`](Self::contiguous) first), [`Error::NotOnHost`] for a tensor
    /// in GPU memory (use [`to_vec`](Self::to_vec), which copies).
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_dtype::<T>("as_slice")?;
        if self.device() != Device::Cpu {
            return Err(Error::NotOnHost {
                op: "as_slice",
                device: self.device().to_string(),
            });
        }
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op: "as_slice",
                shape: self.shape().to_vec(),
                strides: self.strides().to_vec(),
            });
        }
        Ok(self.src().contiguous_host::<T>())
    }

    /// The elements' bytes, for a transport that sends them (a collective's send side): the tensor
    /// must be in host memory and contiguous.
    ///
    /// # Errors
    /// [`Error::NotOnHost`], [`Error::NotContiguous`].
    pub(crate) fn host_bytes(&self, op: &'static str) -> Result<&[u8]> {
        if self.device() != Device::Cpu {
            return Err(Error::NotOnHost {
                op,
                device: self.device().to_string(),
            });
        }
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op,
                shape: self.shape().to_vec(),
                strides: self.strides().to_vec(),
            });
        }
        let (at, n) = (
            self.layout.offset() * self.dtype.size(),
            self.numel() * self.dtype.size(),
        );
        Ok(&self.src().buf.bytes()[at..at + n])
    }

    /// The elements' bytes, writable, for a transport that receives into them (a fresh output made
    /// with [`output_of`](Self::output_of) on the host, or any host tensor after the copy-on-write
    /// step).
    ///
    /// # Errors
    /// [`Error::NotOnHost`]; allocation errors of the copy-on-write step.
    pub(crate) fn host_bytes_mut(&mut self, op: &'static str) -> Result<&mut [u8]> {
        if self.device() != Device::Cpu {
            return Err(Error::NotOnHost {
                op,
                device: self.device().to_string(),
            });
        }
        self.make_unique_contiguous()?;
        let n = self.numel() * self.dtype.size();
        let at = self.layout.offset() * self.dtype.size();
        Ok(&mut self.dst().buf.bytes()[at..at + n])
    }

    /// The GPU ordinal and the device address of the first element of a contiguous GPU tensor, for
    /// a transport that reads it (NCCL's send side).
    ///
    /// # Errors
    /// [`Error::UnsupportedOnDevice`] for a host tensor, [`Error::NotContiguous`], and
    /// [`Error::InsideCapture`] while the GPU is captured.
    fn device_address(&self, op: &'static str) -> Result<(usize, u64)> {
        let Device::Cuda(ordinal) = self.device() else {
            return Err(Error::UnsupportedOnDevice {
                op,
                device: self.device().to_string(),
            });
        };
        self.refuse_inside_capture(op, "a collective between processes")?;
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op,
                shape: self.shape().to_vec(),
                strides: self.strides().to_vec(),
            });
        }
        let offset = (self.layout.offset() * self.dtype.size()) as u64;
        Ok((ordinal, self.src().buf.address() + offset))
    }

    /// As [`device_address`](Self::device_address), for a transport that writes the tensor (after
    /// the copy-on-write step).
    ///
    /// # Errors
    /// As for [`device_address`](Self::device_address); allocation errors of the copy.
    fn device_address_mut(&mut self, op: &'static str) -> Result<(usize, u64)> {
        if self.device() != Device::Cpu {
            self.make_unique_contiguous()?;
        }
        self.device_address(op)
    }

    pub(crate) fn check_dtype<T: Element>(&self, op: &'static str) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::ElementType {
                op,
                dtype: self.dtype,
                requested: T::DTYPE,
            });
        }
        Ok(())
    }

    /// The elements in row-major order (copied from GPU memory for a tensor on a GPU).
    ///
    /// # Errors
    /// [`Error::ElementType`] when `T` is not the tensor's dtype; for a GPU tensor, CUDA errors.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>("to_vec")?;
        if self.device() == Device::Cpu && self.is_contiguous() {
            // Copied straight from the block: no zeroed buffer first (a decoding step's logits,
            // 1.6 MB for eight rows of GPT-2, were zeroed and then overwritten).
            let (from, n) = (self.layout.offset(), self.numel());
            return Ok(self.src().buf.host::<T>()[from..from + n].to_vec());
        }
        let mut out = vec![T::zero(); self.numel()];
        self.download_into("to_vec", bytes_of_mut(&mut out))?;
        Ok(out)
    }

    /// Copies the elements in row-major order into host bytes (`numel * dtype.size()` of them), for
    /// `op`.
    fn download_into(&self, op: &'static str, out: &mut [u8]) -> Result<()> {
        self.refuse_inside_capture(op, "reading a GPU tensor on the host")?;
        let backend = self.backend()?;
        if backend.reads_any_layout() {
            backend.download(self.dtype, self.src(), out)
        } else {
            let packed = self.contiguous()?;
            backend.download(self.dtype, packed.src(), out)
        }
    }

    /// Calls `f` on every element in row-major order (the caller checked the dtype); the elements of
    /// a GPU tensor are copied to the host first.
    pub(crate) fn for_each_element<T: Element>(
        &self,
        op: &'static str,
        mut f: impl FnMut(T),
    ) -> Result<()> {
        if self.device() != Device::Cpu {
            let mut all = vec![T::zero(); self.numel()];
            self.download_into(op, bytes_of_mut(&mut all))?;
            all.into_iter().for_each(f);
            return Ok(());
        }
        let src = self.src().buf.host::<T>();
        let walk = RowWalk::new(self.shape(), [self.strides()], [self.layout.offset()]);
        let [stride] = walk.row_strides();
        let len = walk.row_len();
        walk.for_rows(0, walk.rows(), |_, [start]| {
            (0..len).for_each(|j| f(src[start + j * stride]));
        });
        Ok(())
    }

    /// The elements converted to `f64`, whatever the dtype (handy for checks and printing).
    ///
    /// # Errors
    /// As for [`to_vec`](Self::to_vec) (CUDA errors for a GPU tensor).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        with_dtype!(self.dtype, T => {
            Ok(self.to_vec::<T>()?.into_iter().map(Element::to_f64).collect())
        })
    }

    /// The single element of a tensor with one element (any shape).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the tensor does not hold exactly one element;
    /// [`Error::ElementType`] when `T` is not its dtype.
    pub fn to_scalar<T: Element>(&self) -> Result<T> {
        self.check_dtype::<T>("to_scalar")?;
        if self.numel() != 1 {
            return Err(Error::InvalidShape {
                op: "to_scalar",
                shape: self.shape().to_vec(),
                reason: format!("it holds {} elements, not exactly one", self.numel()),
            });
        }
        let mut value = [T::zero()];
        self.download_into("to_scalar", bytes_of_mut(&mut value))?;
        Ok(value[0])
    }

    /// Copies the elements, in row-major order, into a new contiguous block of `owner` on the same
    /// device.
    #[track_caller]
    pub(crate) fn copy_to_owner<'b>(&self, owner: Owner<'_>) -> Result<Tensor<'b>> {
        let mut out = Tensor::uninit_in(
            owner,
            self.device(),
            self.dtype,
            self.shape(),
            Location::caller(),
        )?;
        self.backend()?
            .copy(self.dtype, self.dtype, self.src(), out.dst())?;
        Ok(out)
    }

    /// The same elements laid out contiguously: an alias when already contiguous, else a copy owned
    /// by the same scope.
    #[track_caller]
    pub fn contiguous(&self) -> Result<Tensor<'s>> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.copy_to_owner(Owner::innermost(&[self]))
    }

    /// A private copy of the elements, contiguous, owned by the same scope: unlike `clone()` (an
    /// alias of the same block, as TorchSharp's handles are), changes to one never show in the other
    /// (PyTorch's `clone()`).
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 2.0], &[2])?;
    /// let copy = x.deep_copy()?;
    /// assert!(!copy.shares_storage(&x) && x.clone().shares_storage(&x));
    /// assert_eq!(copy.to_vec::<f32>()?, x.to_vec::<f32>()?);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// When the scope is capped or over budget.
    #[track_caller]
    pub fn deep_copy(&self) -> Result<Tensor<'s>> {
        self.copy_to_owner(Owner::innermost(&[self]))
    }

    /// Moves the tensor to `target`, re-branding it with `target`'s lifetime (DJL's `attach`). Pool
    /// blocks change owner without copying when `target` outlives their owner (or when this is the
    /// block's only handle); arena blocks, blocks of another tree and blocks of another device are
    /// copied. A block already owned by a longer-lived scope stays where it is.
    ///
    /// # Errors
    /// When `target` is capped or over budget, or a copy cannot be allocated.
    pub fn move_to<'b>(self, target: &Scope<'b>) -> Result<Tensor<'b>> {
        self.relocate(&target.node)
    }

    pub(crate) fn relocate<'b>(self, target: &ScopeNode) -> Result<Tensor<'b>> {
        let h = self.block.header();
        let Some(owner) = ScopeNode::owning(h) else {
            return Ok(self.rebrand()); // the system scope outlives every scope
        };
        let same_tree = std::ptr::eq(owner.tree(), target.tree());
        // An arena block moves only within its cycle (a scope opened inside a workspace cycle
        // returning to it): the arena outlives the cycle's scopes, and is reset after them.
        let movable = same_tree && (h.home.get() != Home::Arena || owner.in_cycle_with(target));
        if target.order <= owner.order {
            // `target` lives at least as long as the owner.
            if movable {
                target.adopt_block(h)?;
                return Ok(self.rebrand());
            }
            // A copy is the same tensor to the user: it keeps the original's name and creation site.
            let copy: Tensor<'b> = self.copy_to_owner(Owner::Moving(target))?;
            let made = copy.block.header();
            made.name.set(h.name.get());
            made.created_at.set(h.created_at.get());
            return Ok(copy);
        }
        // `target` closes before the owner, so the owner already outlives the new brand; hand the block
        // over only when no other handle could still need the owner's lifetime.
        if movable && h.is_unique() {
            target.adopt_block(h)?;
        }
        Ok(self.rebrand())
    }

    /// Moves the tensor out of its scope tree: the result is owned by the never-closing system scope,
    /// freed when its last handle drops, and may be sent to other threads (DL4J's `detach`, MXNet's
    /// "move out", TorchSharp's `DetachFromDisposeScope`). A pool block with no other handle moves
    /// without copying; anything else is copied.
    ///
    /// This is not autograd's stop-gradient: that is [`Var::detach`](crate::Var::detach).
    ///
    /// # Errors
    /// When the system allocator refuses a needed copy.
    #[track_caller]
    pub fn move_out(self) -> Result<Tensor<'static>> {
        let h = self.block.header();
        let Some(owner) = ScopeNode::owning(h) else {
            return Ok(self.rebrand());
        };
        if h.is_unique() && h.home.get() == Home::Heap {
            let (name, at, dtype, bytes, device) = (
                h.name.get(),
                h.created_at.get(),
                h.dtype.get(),
                h.bytes.get(),
                h.device.get(),
            );
            let shape = h.shape.get();
            // A block carved from a segment it shares cannot leave the pool: it is copied below.
            if let Some((ptr, capacity)) = owner.surrender(h) {
                let region = Region::heap(ptr, bytes, capacity, device);
                let block = new_system_block(region, dtype, shape, at);
                block.header().name.set(name);
                let Tensor {
                    block: old,
                    layout,
                    dtype,
                    ..
                } = self;
                // The old header was recycled by `surrender`; its reference must not be released again.
                std::mem::forget(old);
                return Ok(Tensor::from_parts(block, layout, dtype));
            }
        }
        let name = h.name.get();
        let out = self.copy_to_owner(Owner::System)?;
        Ok(match name {
            Some(n) => out.named(n),
            None => out,
        })
    }

    /// A contiguous copy on `device`, owned by the same scope (an alias when the tensor is already
    /// there). Copies between the host and a GPU go through the GPU's stream; the result is ready
    /// for the next op on either side.
    ///
    /// ```
    /// # use ndscope::{Device, root};
    /// root(Device::Cpu, |s| {
    ///     let x = s.from_slice(&[1.0f32, 2.0], &[2])?;
    ///     assert!(x.to_device(Device::Cpu)?.shares_storage(&x));
    ///     // Without a GPU (or a build without the `cuda` feature) the copy is refused with the reason.
    ///     if let Err(e) = x.to_device(Device::Cuda(0)) {
    ///         assert!(matches!(e, ndscope::Error::DeviceUnavailable { .. }));
    ///     }
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] for a device this build or machine cannot use; allocation errors
    /// (the copy is charged to the tensor's scope); CUDA errors.
    #[track_caller]
    pub fn to_device(&self, device: Device) -> Result<Tensor<'s>> {
        if device == self.device() {
            return Ok(self.clone());
        }
        device.check_available()?;
        let at = Location::caller();
        let mut out = Tensor::uninit_in(
            Owner::innermost(&[self]),
            device,
            self.dtype,
            self.shape(),
            at,
        )?;
        self.copy_across_devices(&mut out)?;
        Ok(out)
    }

    /// Copies `self` into `out`, a fresh contiguous tensor of the same shape and dtype on another
    /// device: straight into host memory, straight from contiguous host memory, or staged through the
    /// host between two GPUs.
    fn copy_across_devices(&self, out: &mut Tensor<'_>) -> Result<()> {
        if out.device() == Device::Cpu {
            let bytes = out.numel() * self.dtype.size();
            let dst = out.dst();
            return self.download_into("to_device", &mut dst.buf.bytes()[..bytes]);
        }
        with_dtype!(self.dtype, T => {
            if self.device() == Device::Cpu {
                let host = self.contiguous()?;
                return out.upload(host.src().contiguous_host::<T>());
            }
            let staged = self.to_vec::<T>()?;
            out.upload(&staged)
        })
    }

    /// Whether this is the only handle to its block and views it contiguously: an op may write it
    /// in place without anyone seeing.
    pub(crate) fn is_unique_contiguous(&self) -> bool {
        self.block.header().is_unique() && self.is_contiguous()
    }

    /// Replaces `self` by a private contiguous copy unless it already is the only handle to a
    /// contiguous block: the copy-on-write step before an in-place op.
    pub(crate) fn make_unique_contiguous(&mut self) -> Result<()> {
        if !self.is_unique_contiguous() {
            let copy = self.copy_to_owner(Owner::of(self))?;
            *self = copy;
        }
        Ok(())
    }
}

impl<'a> Movable<'a> for Tensor<'a> {
    type Moved<'b> = Tensor<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Tensor<'b>> {
        self.relocate(&target.node)
    }
}

impl Clone for Tensor<'_> {
    fn clone(&self) -> Self {
        Tensor::from_parts(self.block.clone(), self.layout.clone(), self.dtype)
    }
}

impl std::fmt::Debug for Tensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl<'s> crate::scope::MoveOut<'s> for Tensor<'s> {
    fn move_out(self) -> Result<Tensor<'static>> {
        Tensor::move_out(self)
    }
}

/// `name` as a `&'static str`, stored once per distinct name for the life of the process (block
/// headers hold names as `&'static str`, so that naming costs no allocation per block).
pub(crate) fn interned(name: &str) -> &'static str {
    static NAMES: std::sync::Mutex<std::collections::BTreeSet<&'static str>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut names = NAMES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&known) = names.get(name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.insert(leaked);
    leaked
}
