//! Block-quantized number formats: the tensor types of GGUF files (llama.cpp's `ggml` types), as
//! bytes this module turns into `f32` values ([`dequantize`]) and, for the formats with a simple
//! round-to-nearest quantizer, back ([`quantize`]).
//!
//! A quantized row is a run of *blocks*: each block codes [`QuantType::block_size`] consecutive
//! values in [`QuantType::block_bytes`] bytes — small integers and one or two scales (an `f16`
//! scale `d`, for some formats an `f16` minimum `m`; the "K" formats code 256 values in 8 or 16
//! sub-blocks whose own scales are quantized against `d`). A value is `d · q` or `d · q + m` (`q`
//! the block's integer for it). Blocks have no strides inside them, so a quantized tensor is a
//! sequence of whole rows; a view into one is taken after [`dequantize`].
//!
//! Every format reproduces gguf-py's reference (the `gguf` package's `quants.py`, which is
//! bit-exact with ggml's C reference for the quantizers it has): the same `f32` operations in the
//! same order, so results agree bit for bit (`tests/quant.rs` holds this against files gguf-py
//! wrote). Of the K formats Q4_K, Q5_K and Q6_K have quantizers (those of the Q4_K_M and Q5_K_M
//! files people download): gguf-py has none, so they follow ggml's C reference
//! (`quantize_row_q4_K_ref` and `quantize_row_q5_K_ref`, whose `make_qkx2_quants` searches each
//! sub-block's scale and minimum; `quantize_row_q6_K_ref`, whose `make_qx_quants` searches each 16
//! values' signed scale), held to it bit for bit in `tests/quant.rs`; files in Q2_K and Q3_K come
//! from llama.cpp's `llama-quantize`.
//!
//! ```
//! use ndscope::quant::{self, QuantType};
//!
//! let values: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 8.0).collect();
//! let bytes = quant::quantize(QuantType::Q8_0, &values)?;
//! assert_eq!(bytes.len(), 2 * 34); // two blocks of 32 values: an f16 scale and 32 i8s each
//! let mut back = vec![0.0f32; 64];
//! quant::dequantize(QuantType::Q8_0, &bytes, &mut back)?;
//! for (v, b) in values.iter().zip(&back) {
//!     assert!((v - b).abs() <= 4.0 / 127.0 / 2.0 + 1e-3, "{v} -> {b}");
//! }
//! # Ok::<(), ndscope::Error>(())
//! ```

mod blocks;
mod k_quantize;
mod kquants;
pub(crate) mod strips;

use std::fmt;

pub(crate) use kquants::{scale_min_k4, scales_mins_k4};

use crate::error::{Error, Result};

/// A tensor type of GGUF files: plain floats or a block-quantized format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
#[non_exhaustive]
pub enum QuantType {
    /// 32-bit float (one value per "block").
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32 values: `f16` scale `d`, 4-bit `q`; value `d · (q − 8)`. 4.5 bits per value.
    Q4_0,
    /// 32 values: `f16` scale `d` and minimum `m`, 4-bit `q`; value `d · q + m`. 5 bits.
    Q4_1,
    /// 32 values: `f16` scale, 5-bit `q` (high bits packed apart); `d · (q − 16)`. 5.5 bits.
    Q5_0,
    /// 32 values: `f16` scale and minimum, 5-bit `q`; `d · q + m`. 6 bits.
    Q5_1,
    /// 32 values: `f16` scale, `i8` `q`; `d · q`. 8.5 bits.
    Q8_0,
    /// 256 values in 16 sub-blocks with 4-bit scales and minimums, 2-bit `q`. 2.625 bits.
    Q2_K,
    /// 256 values in 16 sub-blocks with 6-bit scales, 3-bit `q`. 3.4375 bits.
    Q3_K,
    /// 256 values in 8 sub-blocks with 6-bit scales and minimums, 4-bit `q`. 4.5 bits.
    Q4_K,
    /// 256 values in 8 sub-blocks with 6-bit scales and minimums, 5-bit `q`. 5.5 bits.
    Q5_K,
    /// 256 values in 16 sub-blocks with `i8` scales, 6-bit `q`. 6.5625 bits.
    Q6_K,
}

/// Every type, in ggml's numbering order.
const ALL: [QuantType; 13] = [
    QuantType::F32,
    QuantType::F16,
    QuantType::BF16,
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q2_K,
    QuantType::Q3_K,
    QuantType::Q4_K,
    QuantType::Q5_K,
    QuantType::Q6_K,
];

/// Values per block of the K formats (ggml's `QK_K`).
pub(crate) const QK_K: usize = 256;

impl QuantType {
    /// Every type this module reads.
    pub fn all() -> &'static [QuantType] {
        &ALL
    }

    /// The type of ggml's number `id` (`ggml_type`, as GGUF stores it), if this module reads it.
    pub fn from_ggml(id: u32) -> Option<QuantType> {
        ALL.into_iter().find(|t| t.ggml() == id)
    }

    /// ggml's number for the type (`GGML_TYPE_Q4_0` = 2, …).
    pub fn ggml(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q8_0 => 8,
            QuantType::Q2_K => 10,
            QuantType::Q3_K => 11,
            QuantType::Q4_K => 12,
            QuantType::Q5_K => 13,
            QuantType::Q6_K => 14,
            QuantType::BF16 => 30,
        }
    }

    /// The type's name as ggml and llama.cpp write it (`"Q4_K"`, `"F16"`).
    pub fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "F32",
            QuantType::F16 => "F16",
            QuantType::BF16 => "BF16",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q2_K => "Q2_K",
            QuantType::Q3_K => "Q3_K",
            QuantType::Q4_K => "Q4_K",
            QuantType::Q5_K => "Q5_K",
            QuantType::Q6_K => "Q6_K",
        }
    }

    /// Values coded by one block (1 for the float types).
    pub fn block_size(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0 => 32,
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K => QK_K,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q4_0 => 2 + 16,
            QuantType::Q4_1 => 2 + 2 + 16,
            QuantType::Q5_0 => 2 + 4 + 16,
            QuantType::Q5_1 => 2 + 2 + 4 + 16,
            QuantType::Q8_0 => 2 + 32,
            QuantType::Q2_K => 2 + 2 + QK_K / 16 + QK_K / 4,
            QuantType::Q3_K => 2 + QK_K / 4 + QK_K / 8 + 12,
            QuantType::Q4_K => 2 + 2 + QK_K / 2 + 12,
            QuantType::Q5_K => 2 + 2 + QK_K / 2 + QK_K / 8 + 12,
            QuantType::Q6_K => 2 + QK_K / 2 + QK_K / 4 + QK_K / 16,
        }
    }

    /// Whether the type is a block-quantized format (not a plain float).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Whether a block stores a minimum beside its scale: its values are `d · q + m` (Q4_1, Q5_1)
    /// or `d · sc · q − dmin · m` per sub-block (Q2_K, Q4_K, Q5_K), with unsigned levels, where the
    /// other formats' are `d · (q − offset)`.
    pub const fn has_minimum(self) -> bool {
        matches!(
            self,
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q2_K | QuantType::Q4_K | QuantType::Q5_K
        )
    }

    /// Whether a block stores a fifth bit per value beside its 4-bit levels (Q5_0, Q5_1, Q5_K).
    pub const fn has_fifth_bit(self) -> bool {
        matches!(self, QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q5_K)
    }

    /// Bytes of `values` values of this type, `None` unless `values` is a whole number of blocks
    /// (or the size overflows).
    pub fn bytes_for(self, values: usize) -> Option<usize> {
        if !values.is_multiple_of(self.block_size()) {
            return None;
        }
        (values / self.block_size()).checked_mul(self.block_bytes())
    }

    /// Whether [`quantize`] writes this type.
    pub fn can_quantize(self) -> bool {
        !matches!(self, QuantType::Q2_K | QuantType::Q3_K)
    }
}

impl fmt::Display for QuantType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn shape_error(op: &'static str, ty: QuantType, values: usize, bytes: usize) -> Error {
    Error::InvalidArgument {
        op,
        reason: format!(
            "{values} {ty} values take {} bytes ({} per block of {}), found {bytes}{}",
            ty.bytes_for(values)
                .map_or_else(|| "no whole number of".into(), |b| b.to_string()),
            ty.block_bytes(),
            ty.block_size(),
            if values.is_multiple_of(ty.block_size()) {
                String::new()
            } else {
                format!(
                    "; {ty} codes values in blocks of {}: the row length must be a multiple",
                    ty.block_size()
                )
            }
        ),
    }
}

/// The error for a type [`quantize`] does not write.
pub(crate) fn no_quantizer(op: &'static str, ty: QuantType) -> Error {
    Error::InvalidArgument {
        op,
        reason: format!(
            "ndscope has no quantizer for {ty}; make such files with llama.cpp's \
             `llama-quantize`, or quantize to Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K"
        ),
    }
}

/// Decodes `bytes` (whole blocks of `ty`) into `out`, one value per element.
///
/// # Errors
/// [`Error::InvalidArgument`] unless `bytes` holds exactly `out.len()` values of `ty`.
pub fn dequantize(ty: QuantType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    if ty.bytes_for(out.len()) != Some(bytes.len()) {
        return Err(shape_error("quant::dequantize", ty, out.len(), bytes.len()));
    }
    let blocks = bytes.chunks_exact(ty.block_bytes());
    let outs = out.chunks_exact_mut(ty.block_size());
    for (block, out) in blocks.zip(outs) {
        match ty {
            QuantType::F32 => out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
            QuantType::F16 => out[0] = blocks::f16_at(block, 0),
            QuantType::BF16 => {
                out[0] = f32::from_bits(u32::from(u16::from_le_bytes([block[0], block[1]])) << 16)
            }
            QuantType::Q4_0 => blocks::dequantize_q4_0(block, out),
            QuantType::Q4_1 => blocks::dequantize_q4_1(block, out),
            QuantType::Q5_0 => blocks::dequantize_q5_0(block, out),
            QuantType::Q5_1 => blocks::dequantize_q5_1(block, out),
            QuantType::Q8_0 => blocks::dequantize_q8_0(block, out),
            QuantType::Q2_K => kquants::dequantize_q2_k(block, out),
            QuantType::Q3_K => kquants::dequantize_q3_k(block, out),
            QuantType::Q4_K => kquants::dequantize_q4_k(block, out),
            QuantType::Q5_K => kquants::dequantize_q5_k(block, out),
            QuantType::Q6_K => kquants::dequantize_q6_k(block, out),
        }
    }
    Ok(())
}

/// Encodes `values` as `ty`: round to nearest against each block's scale, as gguf-py and ggml's
/// reference quantizers do (bit for bit; the K formats' scales and minimums by ggml's searches).
///
/// # Errors
/// [`Error::InvalidArgument`] for a type without a quantizer here (Q2_K and Q3_K: see
/// [`QuantType::can_quantize`]) or a length that is not a whole number of blocks.
pub fn quantize(ty: QuantType, values: &[f32]) -> Result<Vec<u8>> {
    if !ty.can_quantize() {
        return Err(no_quantizer("quant::quantize", ty));
    }
    let Some(len) = ty.bytes_for(values.len()) else {
        return Err(shape_error("quant::quantize", ty, values.len(), 0));
    };
    let mut out = vec![0u8; len];
    let blocks = values.chunks_exact(ty.block_size());
    for (x, block) in blocks.zip(out.chunks_exact_mut(ty.block_bytes())) {
        match ty {
            QuantType::F32 => block.copy_from_slice(&x[0].to_le_bytes()),
            QuantType::F16 => block.copy_from_slice(&half::f16::from_f32(x[0]).to_le_bytes()),
            QuantType::BF16 => block.copy_from_slice(&blocks::bf16_bits(x[0]).to_le_bytes()),
            QuantType::Q4_0 => blocks::quantize_q4_0(x, block),
            QuantType::Q4_1 => blocks::quantize_q4_1(x, block),
            QuantType::Q5_0 => blocks::quantize_q5_0(x, block),
            QuantType::Q5_1 => blocks::quantize_q5_1(x, block),
            QuantType::Q8_0 => blocks::quantize_q8_0(x, block),
            QuantType::Q4_K => k_quantize::quantize_q4_k(x, block),
            QuantType::Q5_K => k_quantize::quantize_q5_k(x, block),
            QuantType::Q6_K => k_quantize::quantize_q6_k(x, block),
            _ => unreachable!("checked by can_quantize"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_give_the_published_bits_per_value() {
        let bits = |t: QuantType| t.block_bytes() as f64 * 8.0 / t.block_size() as f64;
        assert_eq!(bits(QuantType::Q8_0), 8.5);
        assert_eq!(bits(QuantType::Q4_0), 4.5);
        assert_eq!(bits(QuantType::Q4_K), 4.5);
        assert_eq!(bits(QuantType::Q5_K), 5.5);
        assert_eq!(bits(QuantType::Q6_K), 6.5625);
        assert_eq!(bits(QuantType::Q2_K), 2.625);
        assert_eq!(bits(QuantType::Q3_K), 3.4375);
        for t in QuantType::all() {
            assert_eq!(QuantType::from_ggml(t.ggml()), Some(*t));
        }
        assert_eq!(QuantType::from_ggml(4), None); // Q4_2, removed from ggml
    }

    #[test]
    fn lengths_that_are_not_whole_blocks_are_refused_with_the_block_size() {
        let err = quantize(QuantType::Q4_0, &[0.0; 40])
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple") && err.contains("32"), "{err}");
        let mut out = [0.0f32; 32];
        let err = dequantize(QuantType::Q8_0, &[0u8; 33], &mut out)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("take 34 bytes") && err.contains("found 33"),
            "{err}"
        );
        let err = quantize(QuantType::Q3_K, &[0.0; 256])
            .unwrap_err()
            .to_string();
        assert!(err.contains("llama-quantize"), "{err}");
    }

    #[test]
    fn an_all_zero_block_quantizes_to_zeros_and_back() {
        for t in QuantType::all().iter().filter(|t| t.can_quantize()) {
            let n = t.block_size() * 2;
            let bytes = quantize(*t, &vec![0.0; n]).unwrap();
            let mut back = vec![1.0f32; n];
            dequantize(*t, &bytes, &mut back).unwrap();
            assert!(back.iter().all(|&v| v == 0.0), "{t}: {back:?}");
        }
    }
}
