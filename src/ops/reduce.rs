//! Reductions over axes: sum, mean, max, min, argmax.
//!
//! Reducing trailing axes of a contiguous tensor (the common case: per-row sums, softmax
//! denominators) reduces contiguous rows, in parallel for large inputs. Any other case walks the input
//! once, accumulating into the output through strides that are 0 along the reduced axes.

use std::panic::Location;

use rayon::prelude::*;
use smallvec::SmallVec;

use crate::device::Device;
use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::layout::{RowWalk, Shape, contiguous_strides, resolve_axis};
use crate::ops::PARALLEL_MIN;
use crate::tensor::Tensor;

// Sum, max or min, under the names the GPU kernels take too.
use crate::ops::op_code::Reduction as Reduce;

impl Reduce {
    fn identity<T: Element>(self) -> T {
        match self {
            Reduce::Sum => T::zero(),
            Reduce::Max => T::lowest(),
            Reduce::Min => T::highest(),
        }
    }

    #[inline(always)]
    fn combine<T: Element>(self, a: T, b: T) -> T {
        match self {
            Reduce::Sum => a.add(b),
            Reduce::Max => a.max_nan(b),
            Reduce::Min => a.min_nan(b),
        }
    }

    /// Reduces a contiguous slice; sums use eight accumulators so the loop vectorises.
    #[inline(always)]
    fn slice<T: Element>(self, xs: &[T]) -> T {
        match self {
            Reduce::Sum => {
                let mut acc = [T::zero(); 8];
                let chunks = xs.chunks_exact(8);
                let tail = chunks.remainder();
                for c in chunks {
                    for k in 0..8 {
                        acc[k] = acc[k].add(c[k]);
                    }
                }
                let mut s = acc.iter().fold(T::zero(), |a, &b| a.add(b));
                for &x in tail {
                    s = s.add(x);
                }
                s
            }
            _ => xs.iter().fold(self.identity(), |a, &b| self.combine(a, b)),
        }
    }
}

/// Resolves, sorts and deduplicates reduction axes.
fn reduced_axes(op: &'static str, axes: &[isize], rank: usize) -> Result<SmallVec<[usize; 6]>> {
    let mut out: SmallVec<[usize; 6]> = SmallVec::new();
    for &a in axes {
        let a = resolve_axis(op, a, rank)?;
        if out.contains(&a) {
            return Err(Error::InvalidShape {
                op,
                shape: vec![],
                reason: format!("axis {a} is named twice in {axes:?}"),
            });
        }
        out.push(a);
    }
    out.sort_unstable();
    Ok(out)
}

impl<'s> Tensor<'s> {
    /// Every axis, for reductions to a single value.
    fn all_axes(&self) -> SmallVec<[isize; 6]> {
        (0..self.rank() as isize).collect()
    }

    #[track_caller]
    fn reduce(
        &self,
        op: &'static str,
        kind: Reduce,
        axes: &[isize],
        keepdim: bool,
    ) -> Result<Tensor<'s>> {
        let axes = reduced_axes(op, axes, self.rank())?;
        if kind != Reduce::Sum && axes.iter().any(|&a| self.shape()[a] == 0) {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape().to_vec(),
                reason: "cannot take the max or min over an empty axis".into(),
            });
        }
        let kept: Shape = self
            .shape()
            .iter()
            .enumerate()
            .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
            .collect();
        let out = match self.device() {
            Device::Cpu => {
                let mut out = Tensor::output_of(&[self], self.dtype(), &kept, Location::caller())?;
                with_dtype!(self.dtype(), T => self.reduce_into::<T>(kind, &axes, &kept, out.fresh_mut::<T>()));
                out
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                crate::cuda::ops::reduce(self, kind, &axes, &kept, Location::caller())?
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => unreachable!("no GPU tensor exists without the CUDA backend"),
        };
        if keepdim {
            return Ok(out);
        }
        let squeezed: Shape = self
            .shape()
            .iter()
            .enumerate()
            .filter(|(i, _)| !axes.contains(i))
            .map(|(_, &d)| d)
            .collect();
        out.reshape(&squeezed)
    }

    fn reduce_into<T: Element>(&self, kind: Reduce, axes: &[usize], kept: &[usize], out: &mut [T]) {
        let data = self.block_data::<T>();
        let rank = self.rank();
        let trailing = axes
            .iter()
            .enumerate()
            .all(|(k, &a)| a == rank - axes.len() + k);
        if trailing && self.is_contiguous() {
            let inner: usize = axes.iter().map(|&a| self.shape()[a]).product();
            let base = self.layout().offset();
            let row = |i: usize| kind.slice(&data[base + i * inner..base + (i + 1) * inner]);
            if self.numel() >= PARALLEL_MIN {
                out.par_iter_mut()
                    .enumerate()
                    .for_each(|(i, o)| *o = row(i));
            } else {
                out.iter_mut().enumerate().for_each(|(i, o)| *o = row(i));
            }
            return;
        }
        out.fill(kind.identity());
        let mut out_strides = contiguous_strides(kept);
        for &a in axes {
            out_strides[a] = 0;
        }
        let walk = RowWalk::new(
            self.shape(),
            [self.strides(), &out_strides],
            [self.layout().offset(), 0],
        );
        let [si, so] = walk.row_strides();
        let len = walk.row_len();
        walk.for_rows(0, walk.rows(), |_, [i, o]| {
            if so == 0 && si == 1 {
                out[o] = kind.combine(out[o], kind.slice(&data[i..i + len]));
            } else {
                for j in 0..len {
                    out[o + j * so] = kind.combine(out[o + j * so], data[i + j * si]);
                }
            }
        });
    }

    /// Sum over `axes` (negative axes count from the end); `keepdim` keeps them as size 1.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(x.sum(&[1], false)?.to_vec::<f32>()?, vec![6.0, 15.0]);
    /// assert_eq!(x.sum(&[0], true)?.shape(), &[1, 3]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::AxisOutOfRange`] for an axis outside the rank, [`Error::InvalidShape`] for a repeated
    /// axis.
    #[track_caller]
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        self.reduce("sum", Reduce::Sum, axes, keepdim)
    }

    /// Mean over `axes` (floats).
    #[track_caller]
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "mean",
                dtype: self.dtype(),
                expected: "a float dtype (f32 or f64)",
            });
        }
        let mut out = self.reduce("mean", Reduce::Sum, axes, keepdim)?;
        let count = self.numel().checked_div(out.numel()).unwrap_or(0);
        out.mul_scalar_(1.0 / count as f64)?;
        Ok(out)
    }

    /// Maximum over `axes` (NaN if any element is NaN).
    #[track_caller]
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        self.reduce("max", Reduce::Max, axes, keepdim)
    }

    /// Minimum over `axes` (NaN if any element is NaN).
    #[track_caller]
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        self.reduce("min", Reduce::Min, axes, keepdim)
    }

    /// Sum of all elements, as a tensor of shape `[]`.
    #[track_caller]
    pub fn sum_all(&self) -> Result<Tensor<'s>> {
        self.reduce("sum_all", Reduce::Sum, &self.all_axes(), false)
    }

    /// Mean of all elements, as a tensor of shape `[]` (floats).
    #[track_caller]
    pub fn mean_all(&self) -> Result<Tensor<'s>> {
        self.mean(&self.all_axes(), false)
    }

    /// Index of the largest element along `axis` as `i64` (the first one on ties; the first NaN if
    /// any).
    ///
    /// # Errors
    /// [`Error::AxisOutOfRange`]; [`Error::InvalidShape`] when the axis is empty.
    #[track_caller]
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Result<Tensor<'s>> {
        let axis = resolve_axis("argmax", axis, self.rank())?;
        let size = self.shape()[axis];
        if size == 0 {
            return Err(Error::InvalidShape {
                op: "argmax",
                shape: self.shape().to_vec(),
                reason: format!("axis {axis} is empty"),
            });
        }
        let mut kept: Shape = SmallVec::from_slice(self.shape());
        kept[axis] = 1;
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            let out = crate::cuda::ops::argmax(self, axis, &kept, Location::caller())?;
            return if keepdim {
                Ok(out)
            } else {
                out.squeeze(axis as isize)
            };
        }
        let mut out = Tensor::output_of(&[self], DType::I64, &kept, Location::caller())?;
        let step = self.strides()[axis];
        let walk = RowWalk::new(&kept, [self.strides()], [self.layout().offset()]);
        let [si] = walk.row_strides();
        with_dtype!(self.dtype(), T => {
            let data = self.block_data::<T>();
            crate::ops::fill_segments(&walk, out.fresh_mut::<i64>(), |o, [start]| {
                for (j, slot) in o.iter_mut().enumerate() {
                    let base = start + j * si;
                    let (mut best, mut best_k) = (data[base], 0usize);
                    for k in 0..size {
                        let v = data[base + k * step];
                        if v.partial_cmp(&v).is_none() {
                            best_k = k; // NaN wins, as in PyTorch
                            break;
                        }
                        if v > best {
                            best = v;
                            best_k = k;
                        }
                    }
                    *slot = best_k as i64;
                }
            });
        });
        if keepdim {
            Ok(out)
        } else {
            out.squeeze(axis as isize)
        }
    }
}
