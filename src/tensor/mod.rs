//! `Tensor<'s>`: a counted handle to a storage block owned by a live scope, plus a layout and dtype.

mod create;
mod display;

use std::marker::PhantomData;
use std::panic::Location;

use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::layout::{Layout, RowWalk};
use crate::memory::block::{BlockRef, Home, Region, ShapeSummary, new_system_block};
use crate::memory::{pool, raw};
use crate::scope::Scope;
use crate::scope::node::ScopeNode;

/// An n-dimensional array whose memory is owned by a scope that lives at least as long as `'s`.
///
/// * `clone()` is a cheap alias of the same block; the block goes back to its scope's cache when the
///   last alias drops.
/// * `'s` is covariant: a tensor of a longer-lived scope (a model parameter) can be used where a
///   tensor of a shorter-lived one (a batch) is expected, and an op's result is typed with the
///   shortest lifetime among its operands.
/// * An op's result is owned by the innermost live scope among the operands' owners, never by a
///   longer-lived one.
/// * A tensor is neither `Send` nor `Sync`, except a detached `Tensor<'static>` (see
///   [`detach`](Tensor::detach)), which any thread may use.
pub struct Tensor<'s> {
    block: BlockRef,
    layout: Layout,
    dtype: DType,
    _scope: PhantomData<&'s ()>,
}

// SAFETY: a `Tensor<'static>` can only come from `detach` (every scope's lifetime is higher-ranked,
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
}

impl<'n> Owner<'n> {
    /// The owner that closes first among `tensors`' owners (the system scope never closes), borrowed
    /// for as long as the operands are.
    pub(crate) fn innermost(tensors: &'n [&'n Tensor<'_>]) -> Owner<'n> {
        let mut best = Owner::System;
        let mut best_order = 0;
        for t in tensors {
            let owner = t.block.header().owner.get();
            // SAFETY: a live handle's owner is open (see `BlockRef::header`). A scope closes only when
            // its closure returns, and every open scope encloses the current call, so the node stays
            // open at least while the operands are borrowed, which `'n` covers.
            if let Some(node) = unsafe { owner.as_ref() }
                && node.order > best_order
            {
                best_order = node.order;
                best = Owner::Node(node);
            }
        }
        best
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
            Owner::Node(node) => node.alloc(device, dtype, shape, at),
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
                let capacity = bytes.next_multiple_of(pool::ALIGN);
                let ptr = raw::alloc(device, capacity).ok_or_else(|| Error::OutOfMemory {
                    scope: "system".into(),
                    requested: bytes,
                    live: crate::scope::system_stats().live_bytes,
                    budget: None,
                    dump: String::new(),
                })?;
                let region = Region {
                    ptr,
                    bytes,
                    capacity,
                    home: Home::Heap,
                    device,
                };
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

    /// The device address of the first viewed element, for the CUDA backend's kernels.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_ptr(&self) -> u64 {
        let h = self.block.header();
        debug_assert!(h.device.get().is_cuda());
        h.ptr.get().as_ptr() as u64 + (self.layout.offset() * self.dtype.size()) as u64
    }

    /// The device address of the block's first byte (views add their offset themselves).
    #[cfg(feature = "cuda")]
    pub(crate) fn device_block_ptr(&self) -> u64 {
        self.block.header().ptr.get().as_ptr() as u64
    }

    /// Whether this handle is the only one to its block (an in-place op may then write it).
    #[cfg(feature = "cuda")]
    pub(crate) fn is_unique(&self) -> bool {
        self.block.header().is_unique()
    }

    /// Whether the elements are row-major without gaps (see [`Layout::is_contiguous`]).
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// The name shown by `dump()`, if one was given.
    pub fn name(&self) -> Option<&'static str> {
        self.block.header().name.get()
    }

    /// Names the tensor's block for [`Scope::dump`]. A detached block shared with other handles keeps
    /// its name (other threads may be reading it).
    pub fn named(self, name: &'static str) -> Tensor<'s> {
        let h = self.block.header();
        if !h.is_system() || h.is_unique() {
            h.name.set(Some(name));
        }
        self
    }

    /// Whether two tensors share a storage block (views and clones do).
    pub fn shares_storage(&self, other: &Tensor<'_>) -> bool {
        self.block.as_ptr() == other.block.as_ptr()
    }

    /// Whether the block is owned by the system scope (the tensor was detached).
    pub fn is_detached(&self) -> bool {
        self.block.header().is_system()
    }

    /// The whole block as a slice of `T` (the caller checked the dtype and that the tensor is on the
    /// host).
    pub(crate) fn block_data<T: Element>(&self) -> &[T] {
        debug_assert_eq!(T::DTYPE, self.dtype);
        let h = self.block.header();
        // A GPU address read on the host would be undefined behaviour; every op sends GPU tensors to
        // the CUDA backend or refuses them first, so this only fires on a bug in ndscope.
        assert!(
            h.device.get() == Device::Cpu,
            "ndscope bug: host access to {} memory",
            h.device.get()
        );
        let len = h.bytes.get() / std::mem::size_of::<T>();
        // SAFETY: the block holds `bytes` initialised bytes (zeroed when first taken from the system,
        // written since), aligned to 64, valid while this handle lives. No `&mut` to it can exist at the
        // same time: mutable access needs a unique handle (`block_data_mut`).
        unsafe { std::slice::from_raw_parts(h.ptr.get().as_ptr().cast::<T>(), len) }
    }

    /// Identifies the elements this handle views: its block and where in the block they start. Two
    /// handles with the same key and shape read the same elements (autograd keys parameters by it).
    pub(crate) fn storage_key(&self) -> (usize, usize) {
        (self.block.as_ptr() as usize, self.layout.offset())
    }

    /// The elements of a contiguous tensor, in order (the caller checked `is_contiguous`).
    #[inline]
    pub(crate) fn contiguous_data<T: Element>(&self) -> &[T] {
        debug_assert!(self.is_contiguous());
        let offset = self.layout.offset();
        &self.block_data::<T>()[offset..offset + self.numel()]
    }

    /// The whole block as a mutable slice; `None` unless this handle is the block's only one.
    pub(crate) fn block_data_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        debug_assert_eq!(T::DTYPE, self.dtype);
        let h = self.block.header();
        assert!(
            h.device.get() == Device::Cpu,
            "ndscope bug: host access to {} memory",
            h.device.get()
        );
        if !h.is_unique() {
            return None;
        }
        let len = h.bytes.get() / std::mem::size_of::<T>();
        // SAFETY: as in `block_data`, and this is the only handle, borrowed mutably, so no other slice
        // of the block exists.
        Some(unsafe { std::slice::from_raw_parts_mut(h.ptr.get().as_ptr().cast::<T>(), len) })
    }

    /// The mutable elements of a fresh contiguous output (a unique handle by construction).
    pub(crate) fn fresh_mut<T: Element>(&mut self) -> &mut [T] {
        let (offset, n) = (self.layout.offset(), self.numel());
        let data = self
            .block_data_mut::<T>()
            .expect("a fresh output has a single handle");
        &mut data[offset..offset + n]
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
        crate::ops::host_only("as_slice", &[self])?;
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op: "as_slice",
                shape: self.shape().to_vec(),
                strides: self.strides().to_vec(),
            });
        }
        let offset = self.layout.offset();
        Ok(&self.block_data::<T>()[offset..offset + self.numel()])
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
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return crate::cuda::transfer::download::<T>(self);
        }
        let mut out = Vec::with_capacity(self.numel());
        self.for_each_element::<T>(|v| out.push(v));
        Ok(out)
    }

    /// Calls `f` on every element in row-major order (the caller checked the dtype).
    pub(crate) fn for_each_element<T: Element>(&self, mut f: impl FnMut(T)) {
        let src = self.block_data::<T>();
        let walk = RowWalk::new(self.shape(), [self.strides()], [self.layout.offset()]);
        let [stride] = walk.row_strides();
        let len = walk.row_len();
        walk.for_rows(0, walk.rows(), |_, [start]| {
            (0..len).for_each(|j| f(src[start + j * stride]));
        });
    }

    /// The elements converted to `f64`, whatever the dtype (handy for checks and printing).
    pub fn to_vec_f64(&self) -> Vec<f64> {
        with_dtype!(self.dtype, T => {
            self.to_vec::<T>().expect("dtype matches").into_iter().map(Element::to_f64).collect()
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
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return Ok(self.to_vec::<T>()?[0]);
        }
        Ok(self.block_data::<T>()[self.layout.offset()])
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
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            crate::cuda::ops::copy_into(self, &mut out)?;
            return Ok(out);
        }
        with_dtype!(self.dtype, T => {
            crate::ops::copy::copy_strided::<T>(self, out.fresh_mut::<T>())
        });
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
        // SAFETY: a live handle's owner is open.
        let Some(owner) = (unsafe { h.owner.get().as_ref() }) else {
            return Ok(self.rebrand()); // the system scope outlives every scope
        };
        let same_tree = std::ptr::eq(owner.tree(), target.tree());
        let movable = same_tree && h.home.get() != Home::Arena;
        if target.order <= owner.order {
            // `target` lives at least as long as the owner.
            if movable {
                target.adopt_block(h)?;
                return Ok(self.rebrand());
            }
            // A copy is the same tensor to the user: it keeps the original's name and creation site.
            let copy: Tensor<'b> = self.copy_to_owner(Owner::Node(target))?;
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

    /// Detaches the tensor from its scope tree: the result is owned by the never-closing system scope,
    /// freed when its last handle drops, and may be sent to other threads (DL4J's `detach`, TorchSharp's
    /// `DetachFromDisposeScope`). A pool block with no other handle moves without copying; anything
    /// else is copied.
    ///
    /// # Errors
    /// When the system allocator refuses a needed copy.
    #[track_caller]
    pub fn detach(self) -> Result<Tensor<'static>> {
        let h = self.block.header();
        // SAFETY: a live handle's owner is open.
        let Some(owner) = (unsafe { h.owner.get().as_ref() }) else {
            return Ok(self.rebrand());
        };
        if h.is_unique() && h.home.get() == Home::Heap {
            let (name, at, dtype, bytes) = (
                h.name.get(),
                h.created_at.get(),
                h.dtype.get(),
                h.bytes.get(),
            );
            let shape = h.shape.get();
            let (ptr, capacity) = owner.surrender(h);
            let region = Region {
                ptr,
                bytes,
                capacity,
                home: Home::Heap,
                device: h.device.get(),
            };
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
        let name = h.name.get();
        let out = self.copy_to_owner(Owner::System)?;
        Ok(match name {
            Some(n) => out.named(n),
            None => out,
        })
    }

    /// Alias of [`detach`](Self::detach) (MXNet and DL4J say "move out").
    #[track_caller]
    pub fn move_out(self) -> Result<Tensor<'static>> {
        self.detach()
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
    /// device.
    #[cfg(feature = "cuda")]
    fn copy_across_devices(&self, out: &mut Tensor<'_>) -> Result<()> {
        with_dtype!(self.dtype, T => match (self.device(), out.device()) {
            (Device::Cpu, Device::Cuda(_)) => {
                let host = self.contiguous()?;
                crate::cuda::transfer::upload::<T>(host.contiguous_data::<T>(), out)
            }
            (Device::Cuda(_), Device::Cpu) => {
                crate::cuda::transfer::download_into::<T>(self, out.fresh_mut::<T>())
            }
            _ => {
                let staged = crate::cuda::transfer::download::<T>(self)?;
                crate::cuda::transfer::upload::<T>(&staged, out)
            }
        })
    }

    /// Without the CUDA backend only the host exists, and `check_available` refused every other
    /// device before this is reached.
    #[cfg(not(feature = "cuda"))]
    fn copy_across_devices(&self, out: &mut Tensor<'_>) -> Result<()> {
        Err(Error::DeviceUnavailable {
            device: out.device().to_string(),
            reason: "this build of ndscope has no CUDA backend".into(),
        })
    }

    /// Replaces `self` by a private contiguous copy unless it already is the only handle to a
    /// contiguous block: the copy-on-write step before an in-place op.
    pub(crate) fn make_unique_contiguous(&mut self) -> Result<()> {
        if !self.block.header().is_unique() || !self.is_contiguous() {
            let copy = self.copy_to_owner(Owner::innermost(&[self]))?;
            *self = copy;
        }
        Ok(())
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
