//! Creation ops: every new tensor names its scope explicitly (`s.zeros(..)`, `s.from_slice(..)`).

use std::panic::Location;

use crate::backend::bytes_of;
use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::checked_numel;
use crate::rng::Distribution;
use crate::scope::Scope;
use crate::tensor::{Owner, Tensor};

impl<'s> Scope<'s> {
    /// A new tensor of this scope on its device, whose elements `write` produces on the host (then
    /// copied to a GPU in one transfer).
    fn written<T: Element>(
        &self,
        shape: &[usize],
        at: &'static Location<'static>,
        write: impl FnOnce(&mut [T]),
    ) -> Result<Tensor<'s>> {
        let device = self.node.device;
        let mut t = Tensor::uninit_in(Owner::Node(&self.node), device, T::DTYPE, shape, at)?;
        if device == Device::Cpu {
            write(t.dst().contiguous_host::<T>());
        } else {
            let mut staged = vec![T::zero(); t.numel()];
            write(&mut staged);
            t.copy_from_slice_(&staged)?;
            if T::DTYPE == DType::I64
                && let Some((lo, hi)) = range_of_i64(bytes_of(&staged))
            {
                // Indices seen here need not be read back to be checked (`ops::index`).
                t.note_index_range(lo, hi);
            }
        }
        Ok(t)
    }

    fn filled(
        &self,
        dtype: DType,
        shape: &[usize],
        value: f64,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let mut t = Tensor::uninit_in(Owner::Node(&self.node), self.node.device, dtype, shape, at)?;
        t.fill_(value)?;
        Ok(t)
    }

    /// An `f32` tensor of zeros.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let z = s.zeros(&[2, 3])?;
    /// assert_eq!(z.to_vec::<f32>()?, vec![0.0; 6]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// When the scope is capped or over budget, or the shape's size overflows.
    #[track_caller]
    pub fn zeros(&self, shape: &[usize]) -> Result<Tensor<'s>> {
        self.filled(DType::F32, shape, 0.0, Location::caller())
    }

    /// An `f32` tensor of ones.
    #[track_caller]
    pub fn ones(&self, shape: &[usize]) -> Result<Tensor<'s>> {
        self.filled(DType::F32, shape, 1.0, Location::caller())
    }

    /// An `f32` tensor filled with `value` (taken as `f64`, like every scalar argument, and rounded
    /// to `f32`).
    #[track_caller]
    pub fn full(&self, shape: &[usize], value: f64) -> Result<Tensor<'s>> {
        self.filled(DType::F32, shape, value, Location::caller())
    }

    /// Zeros of `like`'s shape and dtype, in this scope on this scope's device.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1i64, 2, 3], &[3])?;
    /// let z = s.zeros_like(&x)?;
    /// assert_eq!((z.shape(), z.dtype()), (x.shape(), x.dtype()));
    /// assert_eq!(s.full_like(&x, 7.0)?.to_vec::<i64>()?, vec![7, 7, 7]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn zeros_like(&self, like: &Tensor<'_>) -> Result<Tensor<'s>> {
        self.filled(like.dtype(), like.shape(), 0.0, Location::caller())
    }

    /// Ones of `like`'s shape and dtype, in this scope on this scope's device.
    #[track_caller]
    pub fn ones_like(&self, like: &Tensor<'_>) -> Result<Tensor<'s>> {
        self.filled(like.dtype(), like.shape(), 1.0, Location::caller())
    }

    /// `value` (converted to the dtype) in `like`'s shape and dtype, in this scope on this scope's
    /// device.
    #[track_caller]
    pub fn full_like(&self, like: &Tensor<'_>, value: f64) -> Result<Tensor<'s>> {
        self.filled(like.dtype(), like.shape(), value, Location::caller())
    }

    /// A tensor of any dtype filled with `value` (converted to the dtype).
    #[track_caller]
    pub fn full_dtype(&self, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor<'s>> {
        self.filled(dtype, shape, value, Location::caller())
    }

    /// A tensor of `dtype` whose elements are left as the memory holds them. On the host that is
    /// zeros, or what an earlier tensor of this tree left in the block (never uninitialised memory);
    /// on a GPU, a block fresh from the driver holds unspecified values, as `torch.empty`'s do (the
    /// CUDA simulator, `cudasim/run`, reports reading them). For outputs that are about to be
    /// overwritten, and for measuring the allocator, it costs no pass over the memory.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let mut out = s.empty(&[2, 3], ndscope::DType::F32)?;
    /// out.fill_(1.5)?;
    /// assert_eq!(out.to_vec::<f32>()?, vec![1.5; 6]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// When the scope is capped or over budget, the device's allocator refuses, or the shape's size
    /// overflows.
    #[track_caller]
    pub fn empty(&self, shape: &[usize], dtype: DType) -> Result<Tensor<'s>> {
        Tensor::uninit_in(
            Owner::Node(&self.node),
            self.node.device,
            dtype,
            shape,
            Location::caller(),
        )
    }

    /// A tensor of `data`'s element type holding a copy of `data` in row-major order.
    ///
    /// # Errors
    /// [`Error::DataLength`] when `data.len()` is not the shape's element count.
    #[track_caller]
    pub fn from_slice<T: Element>(&self, data: &[T], shape: &[usize]) -> Result<Tensor<'s>> {
        let n = checked_numel(shape, T::DTYPE.size())?;
        if n != data.len() {
            return Err(Error::DataLength {
                op: "from_slice",
                expected: n,
                got: data.len(),
            });
        }
        self.written::<T>(shape, Location::caller(), |out| out.copy_from_slice(data))
    }

    /// A tensor of `dtype` holding `bytes`, its elements little-endian in row-major order (the
    /// safetensors encoding): one copy into the scope's memory, or one upload to its GPU.
    #[track_caller]
    pub(crate) fn tensor_of_le_bytes(
        &self,
        bytes: &[u8],
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor<'s>> {
        let n = checked_numel(shape, dtype.size())?;
        if n * dtype.size() != bytes.len() {
            return Err(Error::DataLength {
                op: "tensor_of_le_bytes",
                expected: n * dtype.size(),
                got: bytes.len(),
            });
        }
        let at = Location::caller();
        let mut t = Tensor::uninit_in(Owner::Node(&self.node), self.node.device, dtype, shape, at)?;
        t.upload_bytes(bytes)?;
        Ok(t)
    }

    /// A 1-D tensor `start, start + step, ...` up to `end` (exclusive), of `T`'s dtype.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `step` is zero or not finite or the range is not finite.
    #[track_caller]
    pub fn arange<T: Element>(&self, start: T, end: T, step: T) -> Result<Tensor<'s>> {
        let (a, b, d) = (start.to_f64(), end.to_f64(), step.to_f64());
        if d == 0.0 || !(a.is_finite() && b.is_finite() && d.is_finite()) {
            return Err(Error::InvalidArgument {
                op: "arange",
                reason: format!(
                    "start {a}, end {b} and step {d} must be finite with a non-zero step"
                ),
            });
        }
        let n = ((b - a) / d).ceil().max(0.0);
        if n > (isize::MAX as usize / T::DTYPE.size()) as f64 {
            return Err(Error::SizeOverflow {
                shape: vec![usize::MAX],
                element_bytes: T::DTYPE.size(),
            });
        }
        let n = n as usize;
        self.written::<T>(&[n], Location::caller(), |out| {
            for (i, v) in out.iter_mut().enumerate() {
                *v = T::from_f64(a + i as f64 * d);
            }
        })
    }

    /// An `f32` tensor drawn on the scope's device from the tree's counter-based generator.
    fn sampled(
        &self,
        shape: &[usize],
        dist: Distribution,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let device = self.node.device;
        // The generator's position is a host counter: a replay would draw the same numbers again.
        crate::backend::refuse_inside_capture(device, "rand", "drawing random numbers")?;
        let mut t = Tensor::uninit_in(Owner::Node(&self.node), device, DType::F32, shape, at)?;
        let (seed, offset) = self.reserve_random(t.numel());
        t.backend()?
            .random(DType::F32, dist, seed, offset, t.dst())?;
        Ok(t)
    }

    /// An `f32` tensor of uniform samples in `[0, 1)` from the tree's seeded generator (Philox
    /// 4x32-10): drawn on the scope's device, the same numbers on every device for the same seed.
    #[track_caller]
    pub fn rand(&self, shape: &[usize]) -> Result<Tensor<'s>> {
        self.sampled(shape, Distribution::Uniform, Location::caller())
    }

    /// An `f32` tensor of standard normal samples from the tree's seeded generator (Philox 4x32-10
    /// and Box-Muller): drawn on the scope's device, the same numbers on every device for the same
    /// seed (to the last bit but for rare roundings of the GPU's `log` and `cos`).
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// s.set_seed(42);
    /// let a = s.randn(&[4])?.to_vec::<f32>()?;
    /// s.set_seed(42);
    /// assert_eq!(a, s.randn(&[4])?.to_vec::<f32>()?);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn randn(&self, shape: &[usize]) -> Result<Tensor<'s>> {
        self.sampled(shape, Distribution::Normal, Location::caller())
    }
}

/// The least and greatest of `i64` elements given as their bytes; `None` for none.
fn range_of_i64(bytes: &[u8]) -> Option<(i64, i64)> {
    bytes
        .chunks_exact(8)
        .map(|b| i64::from_ne_bytes(b.try_into().expect("eight bytes")))
        .fold(None, |range, v| {
            Some(range.map_or((v, v), |(lo, hi): (i64, i64)| (lo.min(v), hi.max(v))))
        })
}
