//! Indexing with index tensors: `index_select` and `gather` (PyTorch semantics). Indices are `i64`;
//! negative or too-large indices are errors, checked before any element is read (inside a captured
//! CUDA graph, where the host cannot read them, a gather gives NaN, or 0 for integers, instead).

use std::panic::Location;

use smallvec::SmallVec;

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Layout, Shape, resolve_axis};
use crate::ops::{same_device, same_dtype};
use crate::tensor::{Owner, Tensor};

/// What an op's kernel does through its indices.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    /// Reads (a gather): its kernel guards against an index out of range by itself.
    Read,
    /// Writes (a scatter): every index must be checked on the host before the kernel runs.
    Write,
}

/// Checks that `index` holds `i64` values in `0..size` (host indices are read in place).
pub(super) fn check_indices(
    op: &'static str,
    index: &Tensor<'_>,
    size: usize,
    access: Access,
) -> Result<()> {
    if index.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: index.dtype(),
            expected: "i64 indices",
        });
    }
    if access == Access::Read && crate::backend::capturing(index.device()) {
        // Inside a captured CUDA graph the host cannot read the indices; the gather kernel reads
        // nothing for an index out of range (it gives NaN, or 0 for integers).
        return Ok(());
    }
    if access == Access::Read
        && index.device() != Device::Cpu
        && let Some((lo, hi)) = index.known_index_range()
        && lo >= 0
        && (hi as u64) < size as u64
    {
        // The indices came from host data seen in range (`from_slice`, `arange`), not written since:
        // no read back, which on a GPU would wait for every queued kernel (two rotary calls a layer
        // made decoding wait for the GPU twice a layer). Only for reads, whose kernels guard
        // against an index out of range anyway (NaN, or 0); a scatter's indices are read exactly.
        return Ok(());
    }
    let mut bad = None;
    // Indices in device memory are read on the host: one copy of (small) index data, so that a bad
    // index is an error here instead of an out-of-bounds read in a kernel.
    index.for_each_element::<i64>(op, |i| {
        if bad.is_none() && (i < 0 || i as u64 >= size as u64) {
            bad = Some(i);
        }
    })?;
    match bad {
        Some(index) => Err(Error::IndexOutOfRange { op, index, size }),
        None => Ok(()),
    }
}

/// Checks that `indices` is 1-D (one index per selected slice).
fn check_1d(op: &'static str, indices: &Tensor<'_>) -> Result<()> {
    if indices.rank() != 1 {
        return Err(Error::InvalidShape {
            op,
            shape: indices.shape().to_vec(),
            reason: "indices must be 1-D".into(),
        });
    }
    Ok(())
}

/// Checks that `index` has `target`'s rank and is no larger than `target` on any axis but `axis`
/// (the one it indexes); `hint` is the error's rule, naming what happens along `axis`.
fn check_index_fits(
    op: &'static str,
    target: &Tensor<'_>,
    index: &Tensor<'_>,
    axis: usize,
    hint: &'static str,
) -> Result<()> {
    let fits = index.rank() == target.rank()
        && index
            .shape()
            .iter()
            .zip(target.shape())
            .enumerate()
            .all(|(d, (&i, &t))| d == axis || i <= t);
    if !fits {
        return Err(Error::ShapeMismatch {
            op,
            lhs: target.shape().to_vec(),
            rhs: index.shape().to_vec(),
            hint,
        });
    }
    Ok(())
}

impl<'s> Tensor<'s> {
    /// The slices `indices[i]` along `axis`, in order: the result has `indices.numel()` entries along
    /// `axis`. `indices` is a 1-D `i64` tensor.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])?;
    /// let rows = x.index_select(0, &s.from_slice(&[2i64, 0], &[2])?)?;
    /// assert_eq!(rows.to_vec::<f32>()?, vec![5.0, 6.0, 1.0, 2.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`], [`Error::AxisOutOfRange`]; [`Error::InvalidShape`] when `indices`
    /// is not 1-D; [`Error::UnsupportedDType`] when it is not `i64`.
    #[track_caller]
    pub fn index_select(&self, axis: isize, indices: &Tensor<'s>) -> Result<Tensor<'s>> {
        const OP: &str = "index_select";
        same_device(OP, self, indices)?;
        let axis = resolve_axis(OP, axis, self.rank())?;
        check_1d(OP, indices)?;
        check_indices(OP, indices, self.shape()[axis], Access::Read)?;
        let mut shape: Shape = self.shape().into();
        shape[axis] = indices.numel();
        // A gather whose index is `indices` along `axis`, broadcast over every other axis.
        let index_layout = along_axis(indices, axis, &shape);
        self.gather_with(axis, indices, &index_layout)
    }

    /// Picks along `axis` with an index tensor of the same rank: `out[i][j] = self[index[i][j]][j]`
    /// for `axis = 0` (and likewise for other axes). The result has `index`'s shape; every other
    /// dimension of `index` must not exceed `self`'s.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let logits = s.from_slice(&[0.1f32, 0.9, 0.7, 0.3], &[2, 2])?;
    /// let labels = s.from_slice(&[1i64, 0], &[2, 1])?;
    /// assert_eq!(logits.gather(1, &labels)?.to_vec::<f32>()?, vec![0.9, 0.7]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`], [`Error::AxisOutOfRange`], [`Error::ShapeMismatch`] when the ranks
    /// differ or `index` is larger than `self` along another axis.
    #[track_caller]
    pub fn gather(&self, axis: isize, index: &Tensor<'s>) -> Result<Tensor<'s>> {
        const OP: &str = "gather";
        same_device(OP, self, index)?;
        let axis = resolve_axis(OP, axis, self.rank())?;
        check_index_fits(
            OP,
            self,
            index,
            axis,
            "the index must have the same rank, and no larger size on any axis but the gathered one",
        )?;
        check_indices(OP, index, self.shape()[axis], Access::Read)?;
        self.gather_with(axis, index, index.layout())
    }

    /// `out[p] = self[p with coordinate axis replaced by index[p]]` for every position `p` of
    /// `index_layout`'s shape (the checked indices read through `index_layout`).
    #[track_caller]
    fn gather_with(
        &self,
        axis: usize,
        index: &Tensor<'s>,
        index_layout: &Layout,
    ) -> Result<Tensor<'s>> {
        let mut out = Tensor::output_of(
            &[self, index],
            self.dtype(),
            index_layout.shape(),
            Location::caller(),
        )?;
        self.backend()?.gather(
            self.dtype(),
            self.src(),
            axis,
            index.src_as(index_layout),
            out.dst(),
        )?;
        Ok(out)
    }
}

/// The layout that reads the 1-D `indices` along `axis` of `shape` and repeats them over every other
/// axis (strides 0).
fn along_axis(indices: &Tensor<'_>, axis: usize, shape: &[usize]) -> Layout {
    let mut strides: Shape = SmallVec::from_elem(0, shape.len());
    strides[axis] = indices.strides()[0];
    Layout::from_parts(shape, &strides, indices.layout().offset())
}

/// A copy of `base` with `src` added at the positions an index names: element `p` of `src` goes to
/// `base`'s position `p` with its `axis` coordinate replaced by the index read through `index_layout`
/// (which has `src`'s shape).
#[track_caller]
fn scatter_add_into<'s>(
    op: &'static str,
    base: &Tensor<'s>,
    axis: usize,
    index: &Tensor<'s>,
    index_layout: &Layout,
    src: &Tensor<'s>,
) -> Result<Tensor<'s>> {
    let out = base.copy_to_owner(Owner::innermost(&[base, index, src]))?;
    scatter_add_onto(op, out, axis, index, index_layout, src)
}

/// `scatter_add_into`, written into `base`'s own block when no other handle shares it and it is
/// contiguous.
#[track_caller]
fn scatter_add_reusing<'s>(
    op: &'static str,
    base: Tensor<'s>,
    axis: usize,
    index: &Tensor<'s>,
    index_layout: &Layout,
    src: &Tensor<'s>,
) -> Result<Tensor<'s>> {
    if base.is_unique_contiguous() {
        scatter_add_onto(op, base, axis, index, index_layout, src)
    } else {
        scatter_add_into(op, &base, axis, index, index_layout, src)
    }
}

/// `scatter_add_into` writing into `out` itself, a contiguous block no other handle sees.
fn scatter_add_onto<'s>(
    op: &'static str,
    mut out: Tensor<'s>,
    axis: usize,
    index: &Tensor<'s>,
    index_layout: &Layout,
    src: &Tensor<'s>,
) -> Result<Tensor<'s>> {
    let dtype = out.dtype();
    out.backend()?.scatter_add(
        op,
        dtype,
        out.dst(),
        axis,
        index.src_as(index_layout),
        src.src(),
    )?;
    Ok(out)
}

impl<'s> Tensor<'s> {
    /// The inverse of [`gather`](Self::gather): a copy of `self` with `src[p]` added at position `p`
    /// with its `axis` coordinate replaced by `index[p]`. `index` and `src` have the same shape;
    /// repeated indices accumulate.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let grads = s.zeros(&[2, 3])?;
    /// let picked = s.from_slice(&[1i64, 1], &[2, 1])?;
    /// let ones = s.ones(&[2, 1])?;
    /// assert_eq!(grads.scatter_add(1, &picked, &ones)?.to_vec::<f32>()?, vec![0.0, 1.0, 0.0, 0.0, 1.0, 0.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for `gather`; [`Error::ShapeMismatch`] when `src` and `index` differ in shape;
    /// [`Error::DTypeMismatch`] when `src` and `self` differ in dtype.
    #[track_caller]
    pub fn scatter_add(
        &self,
        axis: isize,
        index: &Tensor<'s>,
        src: &Tensor<'s>,
    ) -> Result<Tensor<'s>> {
        let axis = self.check_scatter_add(axis, index, src)?;
        scatter_add_into("scatter_add", self, axis, index, index.layout(), src)
    }

    /// [`scatter_add`](Self::scatter_add) written into `self`'s own block when no other handle
    /// shares it and it is contiguous (a gradient's fresh zeros): no copy of the base.
    #[track_caller]
    pub(crate) fn into_scatter_add(
        self,
        axis: isize,
        index: &Tensor<'s>,
        src: &Tensor<'s>,
    ) -> Result<Tensor<'s>> {
        let axis = self.check_scatter_add(axis, index, src)?;
        scatter_add_reusing("scatter_add", self, axis, index, index.layout(), src)
    }

    /// The checks of `scatter_add`; the resolved axis.
    fn check_scatter_add(
        &self,
        axis: isize,
        index: &Tensor<'s>,
        src: &Tensor<'s>,
    ) -> Result<usize> {
        const OP: &str = "scatter_add";
        same_dtype(OP, self, src)?;
        same_device(OP, self, index)?;
        same_device(OP, self, src)?;
        let axis_u = resolve_axis(OP, axis, self.rank())?;
        if index.shape() != src.shape() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: index.shape().to_vec(),
                rhs: src.shape().to_vec(),
                hint: "the index and the source must have the same shape",
            });
        }
        check_index_fits(
            OP,
            self,
            index,
            axis_u,
            "the index must have the same rank, and no larger size on any axis but the scattered one",
        )?;
        check_indices(OP, index, self.shape()[axis_u], Access::Write)?;
        Ok(axis_u)
    }

    /// The inverse of [`index_select`](Self::index_select): a copy of `self` with slice `k` of `src`
    /// along `axis` added to slice `indices[k]`. Repeated indices accumulate.
    ///
    /// # Errors
    /// As for `index_select`; [`Error::ShapeMismatch`] when `src` does not have `self`'s shape with
    /// `indices.numel()` entries along `axis`.
    #[track_caller]
    pub fn index_add(
        &self,
        axis: isize,
        indices: &Tensor<'s>,
        src: &Tensor<'s>,
    ) -> Result<Tensor<'s>> {
        let (axis, index_layout) = self.check_index_add(axis, indices, src)?;
        scatter_add_into("index_add", self, axis, indices, &index_layout, src)
    }

    /// [`index_add`](Self::index_add) written into `self`'s own block when no other handle shares
    /// it and it is contiguous (a gradient's fresh zeros): no copy of the base.
    #[track_caller]
    pub(crate) fn into_index_add(
        self,
        axis: isize,
        indices: &Tensor<'s>,
        src: &Tensor<'s>,
    ) -> Result<Tensor<'s>> {
        let (axis, index_layout) = self.check_index_add(axis, indices, src)?;
        scatter_add_reusing("index_add", self, axis, indices, &index_layout, src)
    }

    /// The checks of `index_add`; the resolved axis and the index's layout over `src`.
    fn check_index_add(
        &self,
        axis: isize,
        indices: &Tensor<'s>,
        src: &Tensor<'s>,
    ) -> Result<(usize, Layout)> {
        const OP: &str = "index_add";
        same_dtype(OP, self, src)?;
        same_device(OP, self, indices)?;
        same_device(OP, self, src)?;
        let axis_u = resolve_axis(OP, axis, self.rank())?;
        check_1d(OP, indices)?;
        let mut expected: Shape = self.shape().into();
        expected[axis_u] = indices.numel();
        if src.shape() != expected.as_slice() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: expected.to_vec(),
                rhs: src.shape().to_vec(),
                hint: "the source must have the target's shape with one entry per index along the axis",
            });
        }
        check_indices(OP, indices, self.shape()[axis_u], Access::Write)?;
        Ok((axis_u, along_axis(indices, axis_u, src.shape())))
    }
}
