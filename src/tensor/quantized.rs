//! Block-quantized matrices held in a scope: GGUF's formats as storage, for weights read 2 to 8
//! times fewer bytes at a time than `f32`.

use std::fmt;
use std::panic::Location;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::quant::strips::STRIP_ROWS;
use crate::quant::{self, QuantType};
use crate::scope::{Movable, Scope};
use crate::tensor::Tensor;

/// A matrix `[rows, cols]` of block-quantized values ([`QuantType`]: Q8_0, Q4_0, Q4_K, …) owned by
/// a scope like any tensor, each row whole blocks of its format. Blocks have no strides inside
/// them, so a quantized matrix has no views: it is multiplied whole
/// ([`Tensor::matmul_quantized_t`](crate::Tensor::matmul_quantized_t), a `Linear`'s `x Wᵀ`) or
/// decoded ([`dequantize`](Self::dequantize)).
///
/// ```
/// use ndscope::quant::QuantType;
/// use ndscope::{DType, Device, QuantTensor, root};
///
/// root(Device::Cpu, |s| {
///     let w = s.from_slice(&(0..4 * 64).map(|i| (i % 13) as f32 / 13.0).collect::<Vec<_>>(), &[4, 64])?;
///     let q = QuantTensor::quantize(&w, QuantType::Q8_0)?;
///     assert_eq!((q.shape(), q.nbytes()), ([4, 64], 4 * 2 * 34)); // 8.5 bits per value
///     let back = q.dequantize(DType::F32)?.to_vec::<f32>()?;
///     let w = w.to_vec::<f32>()?;
///     assert!(w.iter().zip(&back).all(|(a, b)| (a - b).abs() <= 1.0 / 127.0));
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Clone)]
pub struct QuantTensor<'s> {
    /// The blocks' bytes, held as a 1-D tensor of 16-bit words (every format's block is an even
    /// number of bytes) so that the scope owns, counts, dumps and moves them as any tensor; never
    /// read as `f16` values.
    blocks: Tensor<'s>,
    ty: QuantType,
    shape: [usize; 2],
    /// Whether the blocks are in strips of 16 interleaved rows (`quant::strips`) rather than row
    /// after row: the order the device's product kernel reads, chosen by its backend when the
    /// blocks are stored.
    in_strips: bool,
}

impl fmt::Debug for QuantTensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuantTensor")
            .field("ty", &self.ty)
            .field("shape", &self.shape)
            .field("bytes", &self.nbytes())
            .finish()
    }
}

fn check_shape(op: &'static str, ty: QuantType, shape: &[usize]) -> Result<usize> {
    let &[rows, cols] = shape else {
        return Err(Error::InvalidShape {
            op,
            shape: shape.to_vec(),
            reason: "a quantized tensor is a matrix [rows, cols]".into(),
        });
    };
    if !ty.is_quantized() {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("{ty} is a float type, not a block format; keep it as a Tensor"),
        });
    }
    if cols == 0 || rows == 0 || !cols.is_multiple_of(ty.block_size()) {
        return Err(Error::InvalidShape {
            op,
            shape: shape.to_vec(),
            reason: format!(
                "{ty} codes rows in blocks of {} values: the row length must be a positive \
                 multiple of it",
                ty.block_size()
            ),
        });
    }
    ty.bytes_for(cols)
        .and_then(|b| b.checked_mul(rows))
        .ok_or_else(|| Error::InvalidShape {
            op,
            shape: shape.to_vec(),
            reason: "too many bytes".into(),
        })
}

/// Bytes of a matrix of `shape` of `ty` in strips (Q4_K's are larger than in rows).
fn strips_len(op: &'static str, ty: QuantType, shape: [usize; 2]) -> Result<usize> {
    quant::strips::strips_len(ty, shape[0], shape[1]).ok_or_else(|| Error::InvalidShape {
        op,
        shape: shape.to_vec(),
        reason: "too many bytes".into(),
    })
}

impl<'s> QuantTensor<'s> {
    /// `values` (a float matrix `[rows, cols]`) quantized to `ty` in its scope, as
    /// [`quant::quantize`] rounds (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `values` is a matrix whose rows are whole blocks;
    /// [`Error::InvalidArgument`] for a type without a quantizer; [`Error::UnsupportedDType`] for
    /// integers; allocation errors.
    #[track_caller]
    pub fn quantize(values: &Tensor<'s>, ty: QuantType) -> Result<QuantTensor<'s>> {
        const OP: &str = "QuantTensor::quantize";
        if ty.is_quantized() && !ty.can_quantize() {
            return Err(quant::no_quantizer(OP, ty));
        }
        let len = check_shape(OP, ty, values.shape())?;
        if !values.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: values.dtype(),
                expected: "a float dtype",
            });
        }
        let host: Vec<f32> = values.to_vec_f64()?.into_iter().map(|v| v as f32).collect();
        let shape = [values.shape()[0], values.shape()[1]];
        let in_strips = values.backend()?.quant_strips(ty);
        let bytes = quant::quantize(ty, &host)?;
        let len = if in_strips {
            strips_len(OP, ty, shape)?
        } else {
            len
        };
        let mut blocks = Tensor::output_of(&[values], DType::F16, &[len / 2], Location::caller())?;
        if in_strips {
            let out = blocks.host_bytes_mut("QuantTensor::quantize")?;
            quant::strips::to_strips_into(ty, &bytes, shape[0], shape[1], out);
        } else {
            blocks.upload_bytes(&bytes)?;
        }
        Ok(QuantTensor {
            blocks,
            ty,
            shape,
            in_strips,
        })
    }

    /// The matrix of `shape` whose stored blocks of `ty` are `bytes` (rows one after another), in
    /// `scope`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] or [`Error::InvalidArgument`] for a shape that is not whole blocks
    /// of a block format; [`Error::DataLength`] when `bytes` is not its size; allocation errors.
    #[track_caller]
    pub fn from_blocks(
        scope: &Scope<'s>,
        bytes: &[u8],
        ty: QuantType,
        shape: &[usize],
    ) -> Result<QuantTensor<'s>> {
        const OP: &str = "QuantTensor::from_blocks";
        let len = check_shape(OP, ty, shape)?;
        if bytes.len() != len {
            return Err(Error::DataLength {
                op: OP,
                expected: len,
                got: bytes.len(),
            });
        }
        let shape = [shape[0], shape[1]];
        let in_strips = crate::backend::of(scope.device())?.quant_strips(ty);
        let blocks = if in_strips {
            // Arranged straight into the scope's memory: no second copy of the matrix.
            let mut blocks = scope.empty(&[strips_len(OP, ty, shape)? / 2], DType::F16)?;
            let out = blocks.host_bytes_mut(OP)?;
            quant::strips::to_strips_into(ty, bytes, shape[0], shape[1], out);
            blocks
        } else {
            scope.tensor_of_le_bytes(bytes, &[len / 2], DType::F16)?
        };
        Ok(QuantTensor {
            blocks,
            ty,
            shape,
            in_strips,
        })
    }

    /// The block format.
    pub fn ty(&self) -> QuantType {
        self.ty
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        self.shape
    }

    /// Bytes of storage: the file's blocks, rearranged on a CPU with AVX-512 VNNI into strips of
    /// 16 rows (the order its kernel reads), which for Q4_K takes 148 bytes per row and 256 values
    /// against the file's 144.
    pub fn nbytes(&self) -> usize {
        self.blocks.numel() * 2
    }

    /// The values decoded to a `[rows, cols]` tensor of `dtype` in the same scope.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] for an integer dtype; allocation errors.
    #[track_caller]
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor<'s>> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "QuantTensor::dequantize",
                dtype,
                expected: "a float dtype",
            });
        }
        let mut bytes = vec![0u8; self.nbytes()];
        self.blocks
            .download_into("QuantTensor::dequantize", &mut bytes)?;
        if self.in_strips {
            bytes = quant::strips::from_strips(self.ty, &bytes, self.shape[0], self.shape[1]);
        }
        let mut values = vec![0.0f32; self.shape[0] * self.shape[1]];
        quant::dequantize(self.ty, &bytes, &mut values)?;
        self.decoded(&values, &self.shape, dtype, Location::caller())
    }

    /// Rows `ids` (`i64`, any shape) decoded to `dtype`: `[ids.numel(), cols]`, an embedding
    /// lookup that reads only the rows it returns.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] for integer ids that are not `i64` or an integer `dtype`;
    /// [`Error::IndexOutOfRange`] for an id outside `0..rows`; allocation errors.
    #[track_caller]
    pub fn index_select(&self, ids: &Tensor<'s>, dtype: DType) -> Result<Tensor<'s>> {
        const OP: &str = "QuantTensor::index_select";
        if ids.dtype() != DType::I64 {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: ids.dtype(),
                expected: "i64 ids",
            });
        }
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype,
                expected: "a float dtype for the decoded rows",
            });
        }
        let [rows, cols] = self.shape;
        let row_bytes = self
            .ty
            .bytes_for(cols)
            .expect("checked when the blocks were made");
        let ids = ids.to_vec::<i64>()?;
        let mut values = vec![0.0f32; ids.len() * cols];
        let mut bytes = vec![0u8; row_bytes];
        // In strips, the rows of whole strips come out of their strip; the rest are in row order
        // after the strips.
        let (strip_rows, strip_bytes) = if self.in_strips {
            let bytes = quant::strips::strips_len(self.ty, STRIP_ROWS, cols)
                .expect("checked when the blocks were made");
            (rows / STRIP_ROWS * STRIP_ROWS, bytes)
        } else {
            (0, 0)
        };
        let mut strip = vec![0u8; strip_bytes];
        for (&id, out) in ids.iter().zip(values.chunks_exact_mut(cols)) {
            let row =
                usize::try_from(id)
                    .ok()
                    .filter(|&r| r < rows)
                    .ok_or(Error::IndexOutOfRange {
                        op: OP,
                        index: id,
                        size: rows,
                    })?;
            // Rows and strips are an even number of bytes: word offsets.
            if row < strip_rows {
                // The row's strip, read whole, then the row taken out of it.
                self.blocks
                    .narrow(0, row / STRIP_ROWS * strip_bytes / 2, strip_bytes / 2)?
                    .download_into(OP, &mut strip)?;
                let r = row % STRIP_ROWS;
                quant::strips::strip_row(self.ty, &strip, cols, r, &mut bytes);
            } else {
                let at = strip_rows / STRIP_ROWS * strip_bytes + (row - strip_rows) * row_bytes;
                self.blocks
                    .narrow(0, at / 2, row_bytes / 2)?
                    .download_into(OP, &mut bytes)?;
            }
            quant::dequantize(self.ty, &bytes, out)?;
        }
        self.decoded(&values, &[ids.len(), cols], dtype, Location::caller())
    }

    /// Decoded `values` as a tensor of `shape` and `dtype` beside the blocks, made `at`.
    fn decoded(
        &self,
        values: &[f32],
        shape: &[usize],
        dtype: DType,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let le: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut t = Tensor::output_of(&[&self.blocks], DType::F32, shape, at)?;
        t.upload_bytes(&le)?;
        if dtype == DType::F32 {
            Ok(t)
        } else {
            t.to_dtype(dtype)
        }
    }

    /// An empty tensor (`[0]`) of `dtype` beside the blocks: what a quantized `Linear`, or a
    /// model's quantized token table, holds in its dense `weight` field.
    #[track_caller]
    pub(crate) fn empty_like(&self, dtype: DType) -> Result<Tensor<'s>> {
        Tensor::output_of(&[&self.blocks], dtype, &[0], Location::caller())
    }

    /// The stored blocks, as the tensor holding them (for the product op).
    pub(crate) fn blocks(&self) -> &Tensor<'s> {
        &self.blocks
    }

    /// Whether [`blocks`](Self::blocks) are in strips (`quant::strips`) rather than in row order.
    pub(crate) fn in_strips(&self) -> bool {
        self.in_strips
    }

    /// The same matrix named `name` in dumps.
    pub fn named(self, name: &str) -> QuantTensor<'s> {
        QuantTensor {
            blocks: self
                .blocks
                .named_path(&format!("{name} ({} blocks)", self.ty)),
            ..self
        }
    }
}

impl<'a> Movable<'a> for QuantTensor<'a> {
    type Moved<'b> = QuantTensor<'b>;

    fn move_into<'b>(self, target: &Scope<'b>) -> Result<QuantTensor<'b>> {
        Ok(QuantTensor {
            blocks: self.blocks.move_into(target)?,
            ty: self.ty,
            shape: self.shape,
            in_strips: self.in_strips,
        })
    }
}

impl<'a> crate::scope::MoveOut<'a> for QuantTensor<'a> {
    fn move_out(self) -> Result<QuantTensor<'static>> {
        Ok(QuantTensor {
            blocks: self.blocks.move_out()?,
            ty: self.ty,
            shape: self.shape,
            in_strips: self.in_strips,
        })
    }
}
