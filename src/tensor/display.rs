//! A readable `Display`: the header line, then nested rows; long dimensions show their first and last
//! three entries around an ellipsis. Only the printed elements are read, so printing a huge tensor
//! costs no more than printing a small one.

use std::fmt;

use crate::device::Device;
use crate::dtype::{Element, with_dtype};
use crate::layout::contiguous_strides;
use crate::tensor::Tensor;

/// Dimensions longer than twice this are elided.
const EDGE: usize = 3;

impl fmt::Display for Tensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor[{}; {:?}]", self.dtype(), self.shape())?;
        if self.device() != Device::Cpu {
            write!(f, " on {}", self.device())?;
        }
        if let Some(name) = self.name() {
            write!(f, " \"{name}\"")?;
        }
        writeln!(f)?;
        if self.numel() == 0 {
            return f.write_str("[]");
        }
        if self.device() != Device::Cpu {
            // Printed from a row-major host copy (formatting has no way to report a failed copy but
            // fmt::Error).
            return with_dtype!(self.dtype(), T => {
                let data = self.to_vec::<T>().map_err(|_| fmt::Error)?;
                let strides = contiguous_strides(self.shape());
                Printer { data: &data, shape: self.shape(), strides: &strides }.write(f, 0, 0, 0)
            });
        }
        with_dtype!(self.dtype(), T => {
            let data = self.src().buf.host::<T>();
            let printer = Printer { data, shape: self.shape(), strides: self.strides() };
            printer.write(f, 0, self.layout().offset(), 0)
        })
    }
}

struct Printer<'a, T> {
    data: &'a [T],
    shape: &'a [usize],
    strides: &'a [usize],
}

impl<T: Element> Printer<'_, T> {
    fn write(
        &self,
        f: &mut fmt::Formatter<'_>,
        axis: usize,
        offset: usize,
        indent: usize,
    ) -> fmt::Result {
        if axis == self.shape.len() {
            let v = self.data[offset].to_f64();
            return if T::DTYPE.is_float() {
                write!(f, "{v:.4}")
            } else {
                write!(f, "{v}")
            };
        }
        let n = self.shape[axis];
        let innermost = axis + 1 == self.shape.len();
        f.write_str("[")?;
        let mut first = true;
        for i in 0..n {
            let elided = n > 2 * EDGE && (EDGE..n - EDGE).contains(&i);
            if elided && i != EDGE {
                continue;
            }
            if !first {
                if innermost {
                    f.write_str(", ")?;
                } else {
                    write!(f, ",\n{:indent$}", "", indent = indent + 1)?;
                }
            }
            first = false;
            if elided {
                f.write_str("...")?;
            } else {
                self.write(f, axis + 1, offset + i * self.strides[axis], indent + 1)?;
            }
        }
        f.write_str("]")
    }
}
