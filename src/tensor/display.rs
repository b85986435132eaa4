//! A readable `Display`: the header line, then nested rows; long dimensions show their first and last
//! three entries around an ellipsis.

use std::fmt;

use crate::tensor::Tensor;

/// Dimensions longer than this are elided.
const EDGE: usize = 3;

impl fmt::Display for Tensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor[{}; {:?}]", self.dtype(), self.shape())?;
        if let Some(name) = self.name() {
            write!(f, " \"{name}\"")?;
        }
        writeln!(f)?;
        let values = self.to_vec_f64();
        let float = self.dtype().is_float();
        let cell = |v: f64| {
            if float {
                format!("{v:.4}")
            } else {
                format!("{v}")
            }
        };
        let strides = crate::layout::contiguous_strides(self.shape());
        fn rec(
            f: &mut fmt::Formatter<'_>,
            shape: &[usize],
            strides: &[usize],
            base: usize,
            values: &[f64],
            cell: &dyn Fn(f64) -> String,
            indent: usize,
        ) -> fmt::Result {
            let Some((&n, rest)) = shape.split_first() else {
                return f.write_str(&cell(values[base]));
            };
            let picks: Vec<Option<usize>> = if n > 2 * EDGE {
                (0..EDGE)
                    .map(Some)
                    .chain([None])
                    .chain((n - EDGE..n).map(Some))
                    .collect()
            } else {
                (0..n).map(Some).collect()
            };
            f.write_str("[")?;
            for (k, pick) in picks.iter().enumerate() {
                if k > 0 {
                    if rest.is_empty() {
                        f.write_str(", ")?;
                    } else {
                        write!(f, ",\n{:indent$}", "", indent = indent + 1)?;
                    }
                }
                match pick {
                    Some(i) => rec(
                        f,
                        rest,
                        &strides[1..],
                        base + i * strides[0],
                        values,
                        cell,
                        indent + 1,
                    )?,
                    None => f.write_str("...")?,
                }
            }
            f.write_str("]")
        }
        if values.is_empty() {
            return f.write_str("[]");
        }
        rec(f, self.shape(), &strides, 0, &values, &cell, 0)
    }
}
