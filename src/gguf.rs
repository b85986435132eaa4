//! GGUF, llama.cpp's single-file model format (versions 2 and 3): a header, typed metadata
//! (`general.architecture`, `llama.block_count`, the tokenizer's vocabulary, …), tensor
//! descriptions, then the tensors' data, each aligned (to 32 bytes unless `general.alignment`
//! says otherwise) and stored as a [`QuantType`].
//!
//! This module reads the header, metadata and tensor descriptions from a file's bytes and checks
//! them all against the file before anything is loaded: a bad magic, an unknown version, a count
//! or string longer than the file, an unknown value or tensor type, a tensor outside the file or
//! misaligned, a shape that is not whole blocks — each is an [`Error::Format`] that says which.
//! Tensors are then read through [`Weights`](crate::weights::Weights), which maps the file.
//!
//! Shapes are given here in row-major order, as PyTorch and ndscope write them (`[rows, cols]`),
//! the reverse of ggml's `ne` (innermost first); a quantized tensor's blocks run along its last
//! axis.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::quant::QuantType;

/// The magic bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";

/// Data alignment when the file does not set `general.alignment`.
const DEFAULT_ALIGNMENT: usize = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of values of one type.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an integer, for any integer type (and `bool`) that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I64(v) => Some(v),
            Value::Bool(v) => Some(v.into()),
            _ => None,
        }
    }

    /// The value as a float, for any number type.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(a) if a.len() > 8 => write!(f, "[{} values]", a.len()),
            Value::Array(a) => {
                f.write_str("[")?;
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("]")
            }
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            other => write!(f, "{}", other.as_i64().unwrap_or_default()),
        }
    }
}

/// One tensor's description: name, row-major shape, type, and where its bytes lie in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name (`"blk.0.attn_q.weight"`).
    pub name: String,
    /// Row-major shape (ggml's `ne` reversed).
    pub shape: Vec<usize>,
    /// How its values are stored.
    pub ty: QuantType,
    /// Its bytes' range in the file.
    pub bytes: Range<usize>,
}

/// A GGUF file's header, metadata and tensor descriptions.
#[derive(Debug, Clone)]
pub struct Gguf {
    /// The format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor descriptions in the file's order.
    pub tensors: Vec<TensorInfo>,
}

fn format_error(reason: impl fmt::Display) -> Error {
    Error::Format {
        format: "GGUF",
        reason: reason.to_string(),
    }
}

/// A cursor over the file's bytes that fails, rather than panics, past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(format_error(format!(
                "{} at byte {} needs {n} bytes, but the file ends at {}",
                what(),
                self.at,
                self.bytes.len()
            )));
        };
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items that each take at least `min_bytes`, checked against the bytes left (so
    /// a corrupt count cannot ask for a huge allocation).
    fn count(&mut self, min_bytes: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let at = self.at;
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(min_bytes as u64) > left {
            return Err(format_error(format!(
                "{} at byte {at} counts {n} items, more than the {left} bytes left in the file hold",
                what()
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.count(1, what)?;
        let at = self.at;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| format_error(format!("{} at byte {at} is not UTF-8", what())))
    }

    fn value(&mut self, ty: u32, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(format_error(format!(
                        "{} is a bool stored as {b}, not 0 or 1",
                        what()
                    )));
                }
            },
            8 => Value::String(self.string(what)?),
            9 => {
                let at = self.at;
                let inner = self.u32(what)?;
                if inner == 9 {
                    return Err(format_error(format!(
                        "{} at byte {at} is an array of arrays, which ndscope does not read",
                        what()
                    )));
                }
                let n = self.count(value_min_bytes(inner), what)?;
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(self.value(inner, what)?);
                }
                Value::Array(values)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            other => {
                return Err(format_error(format!(
                    "{} has value type {other}; GGUF defines types 0 to 12",
                    what()
                )));
            }
        })
    }
}

/// The fewest bytes a value of type `ty` takes (a string's length prefix: 8).
fn value_min_bytes(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        _ => 8,
    }
}

/// The name llama.cpp gives a ggml type number this module does not read, for messages.
fn ggml_type_name(id: u32) -> String {
    let name = match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        _ => return format!("type {id}"),
    };
    format!("{name} (type {id})")
}

impl Gguf {
    /// Reads the header, metadata and tensor descriptions of a GGUF file's `bytes`, checking every
    /// tensor's range against them.
    ///
    /// # Errors
    /// [`Error::Format`] naming what is wrong and where (see the module's documentation).
    pub fn parse(bytes: &[u8]) -> Result<Gguf> {
        let mut r = Reader { bytes, at: 0 };
        let magic = r.array::<4>(&|| "the magic".into())?;
        if &magic != MAGIC {
            return Err(format_error(format!(
                "it starts with {magic:02x?}, not the GGUF magic \"GGUF\""
            )));
        }
        let version = r.u32(&|| "the version".into())?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(format_error(
                    "GGUF version 1 (2023's first files) is not read; convert the model again \
                     with a current llama.cpp",
                ));
            }
            v if v.swap_bytes() <= 3 => {
                return Err(format_error(
                    "the file is big-endian; ndscope reads little-endian GGUF files",
                ));
            }
            v => {
                return Err(format_error(format!(
                    "version {v}; ndscope reads GGUF versions 2 and 3"
                )));
            }
        }
        // A tensor description takes at least 8 (name) + 4 + 4 + 8 bytes; a metadata entry 8 + 4 + 1.
        let n_tensors = r.count(24, &|| "the tensor count".into())?;
        let n_metadata = r.count(13, &|| "the metadata count".into())?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_metadata {
            let key = r.string(&|| format!("the key of metadata entry {i}"))?;
            let what = || format!("metadata \"{key}\"");
            let ty = r.u32(&what)?;
            let value = r.value(ty, &what)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(format_error(format!("metadata \"{key}\" appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => a as usize,
                _ => {
                    return Err(format_error(format!(
                        "general.alignment is {v}; it must be a power of two"
                    )));
                }
            },
        };
        let mut raw = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = r.string(&|| format!("the name of tensor {i}"))?;
            let what = || format!("tensor \"{name}\"");
            let n_dims = r.u32(&what)?;
            if n_dims > 4 {
                return Err(format_error(format!(
                    "tensor \"{name}\" has {n_dims} dimensions; ggml tensors have at most 4"
                )));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(r.u64(&what)?);
            }
            let ty = r.u32(&what)?;
            let offset = r.u64(&what)?;
            raw.push((name, ne, ty, offset));
        }
        let data_start = r.at.next_multiple_of(alignment);
        let mut tensors = Vec::with_capacity(raw.len());
        let mut names = std::collections::BTreeSet::new();
        for (name, ne, ty, offset) in raw {
            if !names.insert(name.clone()) {
                return Err(format_error(format!("two tensors are named \"{name}\"")));
            }
            let ty = QuantType::from_ggml(ty).ok_or_else(|| {
                format_error(format!(
                    "tensor \"{name}\" is stored as {}, which ndscope does not read; it reads {}",
                    ggml_type_name(ty),
                    QuantType::all()
                        .iter()
                        .map(|t| t.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            let shape: Vec<usize> = ne.iter().rev().map(|&d| d as usize).collect();
            let values = ne
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .and_then(|n| usize::try_from(n).ok());
            let row = ne.first().copied().unwrap_or(1);
            let len = values.and_then(|n| ty.bytes_for(n)).ok_or_else(|| {
                format_error(format!(
                    "tensor \"{name}\" of shape {shape:?} is not whole {ty} blocks (rows of {row} \
                     values, blocks of {})",
                    ty.block_size()
                ))
            })?;
            if row % ty.block_size() as u64 != 0 {
                return Err(format_error(format!(
                    "tensor \"{name}\" has rows of {row} values, not whole {ty} blocks of {}",
                    ty.block_size()
                )));
            }
            if offset % alignment as u64 != 0 {
                return Err(format_error(format!(
                    "tensor \"{name}\" starts at data offset {offset}, not a multiple of the \
                     alignment {alignment}"
                )));
            }
            let start = (data_start as u64).checked_add(offset);
            let end = start.and_then(|s| s.checked_add(len as u64));
            match (start, end) {
                (Some(start), Some(end)) if end <= bytes.len() as u64 => tensors.push(TensorInfo {
                    name,
                    shape,
                    ty,
                    bytes: start as usize..end as usize,
                }),
                _ => {
                    return Err(format_error(format!(
                        "tensor \"{name}\" ({len} bytes at data offset {offset}) runs past the \
                         file's end at byte {}",
                        bytes.len()
                    )));
                }
            }
        }
        Ok(Gguf {
            version,
            metadata,
            tensors,
        })
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF file: one string and one u32 entry, one 2×32 Q8_0 tensor.
    fn file() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        let string = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        string(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        string(&mut b, "llama");
        string(&mut b, "llama.block_count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&7u32.to_le_bytes());
        string(&mut b, "w");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&32u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.resize(b.len().next_multiple_of(32), 0);
        b.extend(std::iter::repeat_n(1u8, 68));
        b
    }

    #[test]
    fn a_minimal_file_reads_back_its_metadata_and_tensor() {
        let bytes = file();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(
            g.get("general.architecture").unwrap().as_str(),
            Some("llama")
        );
        assert_eq!(g.get("llama.block_count").unwrap().as_i64(), Some(7));
        let t = &g.tensors[0];
        assert_eq!(
            (t.name.as_str(), t.shape.as_slice(), t.ty),
            ("w", &[2, 32][..], QuantType::Q8_0)
        );
        assert_eq!(t.bytes.len(), 68);
        assert_eq!(t.bytes.end, bytes.len());
    }

    #[test]
    fn every_truncation_is_a_typed_error_not_a_panic() {
        let bytes = file();
        for len in 0..bytes.len() {
            let err = Gguf::parse(&bytes[..len]).unwrap_err();
            assert!(matches!(err, Error::Format { .. }), "{len}: {err}");
        }
    }

    #[test]
    fn bad_headers_say_what_is_wrong() {
        let mut bytes = file();
        bytes[0] = b'X';
        let err = Gguf::parse(&bytes).unwrap_err().to_string();
        assert!(err.contains("not the GGUF magic"), "{err}");
        let mut bytes = file();
        bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
        let err = Gguf::parse(&bytes).unwrap_err().to_string();
        assert!(err.contains("big-endian"), "{err}");
        // The tensor's type (ggml 16 = IQ2_XXS) sits 12 bytes before the data offset's end.
        let mut bytes = file();
        let at = bytes.iter().rposition(|&b| b == 8).unwrap();
        bytes[at] = 16;
        let err = Gguf::parse(&bytes).unwrap_err().to_string();
        assert!(err.contains("IQ2_XXS") && err.contains("\"w\""), "{err}");
    }
}
