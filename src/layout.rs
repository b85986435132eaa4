//! Shapes, strides and offsets: how a tensor's elements sit in its storage block.
//!
//! A [`Layout`] maps a multi-index `i` to the element `offset + Σ i[k] * strides[k]` of the block
//! (strides and offset count elements, not bytes). Views (transpose, narrow, broadcast, ...) only
//! build a new layout over the same block. A stride of `0` repeats an element along a dimension, which
//! is how broadcasting works without copying. Strides are never negative.

use smallvec::SmallVec;

use crate::error::{Error, Result};

/// Dimensions of a tensor; up to six are stored inline.
pub type Shape = SmallVec<[usize; 6]>;

/// The element layout of a tensor inside its storage block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Shape,
    offset: usize,
}

/// Number of elements of `shape`, or an error when it overflows `usize` (with the byte count).
///
/// The limit applies to the product of the non-zero dimensions too: a shape like `[0, 2, usize::MAX]`
/// holds no element, but its strides would overflow, so it is refused like any oversized shape.
pub(crate) fn checked_numel(shape: &[usize], element_bytes: usize) -> Result<usize> {
    let overflow = || Error::SizeOverflow {
        shape: shape.to_vec(),
        element_bytes,
    };
    let nonzero = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    // Allocations are limited to isize::MAX bytes.
    match nonzero.checked_mul(element_bytes.max(1)) {
        Some(b) if b <= isize::MAX as usize => Ok(if shape.contains(&0) { 0 } else { nonzero }),
        _ => Err(overflow()),
    }
}

/// Row-major strides for `shape`.
#[inline]
pub(crate) fn contiguous_strides(shape: &[usize]) -> Shape {
    let mut strides = Shape::new();
    let mut acc = 1usize;
    for &d in shape.iter().rev() {
        strides.push(acc);
        acc = acc.saturating_mul(d);
    }
    strides.reverse();
    strides
}

/// The shape two shapes broadcast to under NumPy rules (align trailing dimensions; a dimension of 1
/// stretches).
pub(crate) fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Shape> {
    let rank = a.len().max(b.len());
    let mut out: Shape = SmallVec::from_elem(0, rank);
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: a.to_vec(),
                    rhs: b.to_vec(),
                    hint: "trailing dimensions must be equal or 1 to broadcast",
                });
            }
        };
    }
    Ok(out)
}

/// Resolves an axis that may count from the end (`-1` is the last axis).
pub(crate) fn resolve_axis(op: &'static str, axis: isize, rank: usize) -> Result<usize> {
    let resolved = if axis < 0 { axis + rank as isize } else { axis };
    if resolved < 0 || resolved as usize >= rank {
        return Err(Error::AxisOutOfRange { op, axis, rank });
    }
    Ok(resolved as usize)
}

impl Layout {
    /// A row-major layout for `shape` starting at element 0.
    #[inline]
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            strides: contiguous_strides(shape),
            shape: SmallVec::from_slice(shape),
            offset: 0,
        }
    }

    /// A layout from its parts; the caller keeps every element it names inside the block it reads.
    pub(crate) fn from_parts(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        debug_assert_eq!(shape.len(), strides.len());
        Layout {
            shape: SmallVec::from_slice(shape),
            strides: SmallVec::from_slice(strides),
            offset,
        }
    }

    /// Size of each dimension.
    #[inline]
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Step between neighbours along each dimension, in elements (0 repeats an element).
    #[inline]
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the block, in elements.
    #[inline]
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    #[inline]
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (cannot overflow: every layout is checked when its block is allocated).
    #[inline]
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are row-major and gap-free, so `block[offset..offset + numel]` holds them in
    /// order. Dimensions of size 1 may have any stride.
    #[inline]
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
        true
    }

    /// Whether this layout reads every element of a block of `block_numel` elements, in order: the
    /// block's own tensor, or a reshape of it.
    pub(crate) fn is_whole(&self, block_numel: usize) -> bool {
        self.is_contiguous() && self.offset == 0 && self.numel() == block_numel
    }

    /// One past the largest element index this layout reaches (0 when empty).
    pub(crate) fn extent(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// The same elements with a new shape; only for contiguous layouts (else `None`).
    pub(crate) fn reshaped(&self, shape: &[usize]) -> Option<Layout> {
        self.is_contiguous().then(|| Layout {
            shape: SmallVec::from_slice(shape),
            strides: contiguous_strides(shape),
            offset: self.offset,
        })
    }

    pub(crate) fn permuted(&self, op: &'static str, perm: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        let mut seen: SmallVec<[bool; 6]> = SmallVec::from_elem(false, rank);
        if perm.len() != rank {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.to_vec(),
                reason: format!("the permutation {perm:?} must name each of the {rank} axes once"),
            });
        }
        for &p in perm {
            if p >= rank || std::mem::replace(&mut seen[p], true) {
                return Err(Error::InvalidShape {
                    op,
                    shape: self.shape.to_vec(),
                    reason: format!(
                        "the permutation {perm:?} must name each of the {rank} axes once"
                    ),
                });
            }
        }
        Ok(Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    pub(crate) fn narrowed(&self, axis: usize, start: usize, len: usize) -> Result<Layout> {
        let size = self.shape[axis];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::InvalidShape {
                op: "narrow",
                shape: self.shape.to_vec(),
                reason: format!(
                    "the range {start}..{} exceeds axis {axis} of size {size}",
                    start.saturating_add(len)
                ),
            });
        }
        let mut out = self.clone();
        out.shape[axis] = len;
        if len > 0 {
            out.offset += start * self.strides[axis];
        }
        Ok(out)
    }

    pub(crate) fn broadcast_to(&self, shape: &[usize]) -> Result<Layout> {
        let mismatch = || Error::ShapeMismatch {
            op: "broadcast_to",
            lhs: self.shape.to_vec(),
            rhs: shape.to_vec(),
            hint: "each dimension must equal the target's or be 1, and the target may only add leading dimensions",
        };
        if shape.len() < self.rank() {
            return Err(mismatch());
        }
        checked_numel(shape, 1)?;
        let lead = shape.len() - self.rank();
        let mut strides: Shape = SmallVec::from_elem(0, shape.len());
        for (i, &d) in shape.iter().enumerate().skip(lead) {
            let (own, stride) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = match own {
                o if o == d => stride,
                1 => 0,
                _ => return Err(mismatch()),
            };
        }
        Ok(Layout {
            shape: SmallVec::from_slice(shape),
            strides,
            offset: self.offset,
        })
    }

    pub(crate) fn squeezed(&self, axis: usize) -> Result<Layout> {
        if self.shape[axis] != 1 {
            return Err(Error::InvalidShape {
                op: "squeeze",
                shape: self.shape.to_vec(),
                reason: format!(
                    "axis {axis} has size {}, only an axis of size 1 can be removed",
                    self.shape[axis]
                ),
            });
        }
        let mut out = self.clone();
        out.shape.remove(axis);
        out.strides.remove(axis);
        Ok(out)
    }

    pub(crate) fn unsqueezed(&self, axis: usize) -> Layout {
        let mut out = self.clone();
        let stride = if axis < self.rank() {
            self.strides[axis] * self.shape[axis]
        } else {
            1
        };
        out.shape.insert(axis, 1);
        out.strides.insert(axis, stride);
        out
    }
}

/// Walks the elements of `shape` in row-major order, one innermost row at a time, for `N` operands
/// that read (or write) the same multi-index through their own strides.
///
/// Dimensions that every operand can step through as one (`stride[i] == stride[i+1] * shape[i+1]`) are
/// merged first, so a contiguous tensor is a single row and a `[n, m] + [m]` broadcast is `n` rows of
/// `m`. Kernels get long, simple inner loops that the compiler vectorises.
pub(crate) struct RowWalk<const N: usize> {
    dims: Shape,
    strides: [Shape; N],
    offsets: [usize; N],
}

impl<const N: usize> RowWalk<N> {
    pub(crate) fn new(shape: &[usize], strides: [&[usize]; N], offsets: [usize; N]) -> Self {
        let mut dims: Shape = SmallVec::new();
        let mut merged: [Shape; N] = std::array::from_fn(|_| SmallVec::new());
        for (i, &d) in shape.iter().enumerate() {
            if d == 1 && !dims.is_empty() {
                continue; // a unit dimension adds nothing to the walk
            }
            let mergeable = !dims.is_empty()
                && (0..N).all(|k| merged[k].last().copied() == Some(strides[k][i] * d));
            if mergeable {
                *dims.last_mut().expect("non-empty") *= d;
                for k in 0..N {
                    *merged[k].last_mut().expect("non-empty") = strides[k][i];
                }
            } else {
                dims.push(d);
                for k in 0..N {
                    merged[k].push(strides[k][i]);
                }
            }
        }
        if dims.is_empty() {
            dims.push(1);
            for m in merged.iter_mut() {
                m.push(0);
            }
        }
        RowWalk {
            dims,
            strides: merged,
            offsets,
        }
    }

    /// Length of each row.
    pub(crate) fn row_len(&self) -> usize {
        *self.dims.last().expect("at least one dimension")
    }

    /// Stride of each operand along a row.
    pub(crate) fn row_strides(&self) -> [usize; N] {
        std::array::from_fn(|k| *self.strides[k].last().expect("at least one dimension"))
    }

    /// Number of rows.
    pub(crate) fn rows(&self) -> usize {
        self.dims[..self.dims.len() - 1].iter().product()
    }

    /// Calls `f(row, starts)` for rows `first..first + count`, where `starts[k]` is operand `k`'s
    /// offset of the row's first element.
    pub(crate) fn for_rows(
        &self,
        first: usize,
        count: usize,
        mut f: impl FnMut(usize, [usize; N]),
    ) {
        if count == 0 || self.row_len() == 0 {
            return;
        }
        let outer = &self.dims[..self.dims.len() - 1];
        let mut index: Shape = SmallVec::from_elem(0, outer.len());
        let mut rem = first;
        for (slot, &d) in index.iter_mut().zip(outer).rev() {
            *slot = rem % d;
            rem /= d;
        }
        let mut starts: [usize; N] = std::array::from_fn(|k| {
            self.offsets[k]
                + index
                    .iter()
                    .zip(&self.strides[k])
                    .map(|(&i, &s)| i * s)
                    .sum::<usize>()
        });
        for row in first..first + count {
            f(row, starts);
            // Advance the multi-index like an odometer, updating each operand's start incrementally.
            for axis in (0..outer.len()).rev() {
                index[axis] += 1;
                for (start, strides) in starts.iter_mut().zip(&self.strides) {
                    *start += strides[axis];
                }
                if index[axis] < outer[axis] {
                    break;
                }
                for (start, strides) in starts.iter_mut().zip(&self.strides) {
                    *start -= strides[axis] * outer[axis];
                }
                index[axis] = 0;
            }
        }
    }
}

impl<const N: usize> RowWalk<N> {
    /// Calls `f(pos, starts, len)` for the elements `first..first + count` of the walk (in row-major
    /// order), one row piece at a time: `pos` is the piece's first element index, `starts[k]` operand
    /// `k`'s offset of that element, `len` the piece's length.
    pub(crate) fn for_segments(
        &self,
        first: usize,
        count: usize,
        mut f: impl FnMut(usize, [usize; N], usize),
    ) {
        let row_len = self.row_len();
        if count == 0 || row_len == 0 {
            return;
        }
        let end = first + count;
        let (first_row, last_row) = (first / row_len, (end - 1) / row_len);
        let strides = self.row_strides();
        self.for_rows(first_row, last_row - first_row + 1, |row, starts| {
            let row_start = row * row_len;
            let lo = first.max(row_start) - row_start;
            let hi = end.min(row_start + row_len) - row_start;
            let shifted = std::array::from_fn(|k| starts[k] + lo * strides[k]);
            f(row_start + lo, shifted, hi - lo);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_detection_ignores_unit_dims() {
        let l = Layout::contiguous(&[2, 1, 3]);
        assert!(l.is_contiguous());
        let t = l.permuted("t", &[2, 1, 0]).unwrap();
        assert!(!t.is_contiguous());
        assert!(
            Layout::contiguous(&[3, 1])
                .permuted("t", &[1, 0])
                .unwrap()
                .is_contiguous()
        );
    }

    #[test]
    fn row_walk_merges_contiguous_dims() {
        let w = RowWalk::new(&[2, 3, 4], [&[12, 4, 1]], [0]);
        assert_eq!((w.rows(), w.row_len()), (1, 24));
        let b = RowWalk::new(&[5, 4], [&[4, 1], &[0, 1]], [0, 0]);
        assert_eq!((b.rows(), b.row_len()), (5, 4));
    }

    #[test]
    fn row_walk_visits_every_offset_once() {
        // A transposed 3x4 view: rows walk the columns of the original.
        let l = Layout::contiguous(&[3, 4]).permuted("t", &[1, 0]).unwrap();
        let w = RowWalk::new(l.shape(), [l.strides()], [0]);
        let mut seen = Vec::new();
        w.for_rows(0, w.rows(), |_, [s]| {
            for j in 0..w.row_len() {
                seen.push(s + j * w.row_strides()[0]);
            }
        });
        assert_eq!(seen, vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
        let mut tail = Vec::new();
        w.for_rows(2, 2, |r, [s]| tail.push((r, s)));
        assert_eq!(tail, vec![(2, 2), (3, 3)]);
    }

    #[test]
    fn segments_split_rows_at_any_element() {
        let w = RowWalk::new(&[3, 4], [&[1, 3]], [0]); // a transposed [4, 3] block
        let mut got = Vec::new();
        w.for_segments(2, 7, |pos, [s], len| got.push((pos, s, len)));
        assert_eq!(got, vec![(2, 6, 2), (4, 1, 4), (8, 2, 1)]);
    }

    #[test]
    fn checked_numel_rejects_overflow() {
        assert!(checked_numel(&[usize::MAX, 2], 4).is_err());
        assert!(checked_numel(&[1 << 62], 4).is_err());
        assert_eq!(checked_numel(&[3, 0, 5], 4).unwrap(), 0);
    }
}
