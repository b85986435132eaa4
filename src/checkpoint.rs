//! Checkpoints in the [safetensors](https://huggingface.co/docs/safetensors) format, which PyTorch,
//! JAX and candle read: parameters are saved under the names [`Parameters::visit`] gives them
//! (`0.weight`, `0.bias`, `2.weight`, ...), little-endian, row-major.
//!
//! ```
//! use ndscope::nn::{self, Activation, Init};
//! use ndscope::{Device, checkpoint, root};
//!
//! root(Device::Cpu, |s| {
//!     let trained = nn::mlp(s, &[4, 3, 2], Activation::Relu, Init::KaimingUniform)?;
//!     let bytes = checkpoint::to_bytes(&trained)?;
//!     let mut fresh = nn::mlp(s, &[4, 3, 2], Activation::Relu, Init::Constant(0.0))?;
//!     checkpoint::load_bytes(&mut fresh, &bytes)?;
//!     assert_eq!(fresh.layers().len(), 3);
//!     Ok::<_, ndscope::Error>(())
//! })?;
//! # Ok::<(), ndscope::Error>(())
//! ```

use std::borrow::Cow;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView, View};

use crate::dtype::{DType, Element, bf16, f16, with_dtype};
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::scope::Scope;
use crate::tensor::Tensor;

/// A parameter's bytes, as safetensors serialises them.
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Entry {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn format_error(e: impl std::fmt::Display) -> Error {
    Error::Format {
        format: "safetensors",
        reason: e.to_string(),
    }
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

fn our_dtype(name: &str, dtype: Dtype) -> Result<DType> {
    match dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::F64 => Ok(DType::F64),
        Dtype::I64 => Ok(DType::I64),
        Dtype::BF16 => Ok(DType::BF16),
        Dtype::F16 => Ok(DType::F16),
        other => Err(Error::Format {
            format: "safetensors",
            reason: format!(
                "tensor \"{name}\" has dtype {other:?}; ndscope reads F32, F64, I64, BF16 and F16"
            ),
        }),
    }
}

/// Little-endian bytes of a tensor's elements, converted to `dtype` (rounded to nearest).
fn bytes_of(t: &Tensor<'_>, dtype: DType) -> Result<Vec<u8>> {
    with_dtype!(t.dtype(), S => with_dtype!(dtype, D => {
        let values = t.to_vec::<S>()?;
        let mut bytes = Vec::with_capacity(values.len() * std::mem::size_of::<D>());
        if S::DTYPE == D::DTYPE {
            values.iter().for_each(|v| v.put_le(&mut bytes));
        } else {
            values.iter().for_each(|v| D::from_f64(v.to_f64()).put_le(&mut bytes));
        }
        Ok(bytes)
    }))
}

/// The parameters of `params` in the safetensors format.
///
/// # Errors
/// [`Error::Format`] when two parameters share a name.
pub fn to_bytes<'m>(params: &(impl Parameters<'m> + ?Sized)) -> Result<Vec<u8>> {
    serialize(params, None)
}

/// The parameters of `params` in the safetensors format, with every float parameter converted to
/// `dtype` (rounded to nearest): an `f32` model saved as `bf16` or `f16` takes half the bytes.
/// Integer tensors keep their dtype. Load it back into the `f32` model with [`load_bytes_cast`].
///
/// ```
/// use ndscope::nn::{self, Activation, Init, Parameters};
/// use ndscope::{DType, Device, checkpoint, root};
///
/// root(Device::Cpu, |s| {
///     let model = nn::mlp(s, &[64, 32, 10], Activation::Relu, Init::KaimingUniform)?;
///     let half = checkpoint::to_bytes_in(&model, DType::BF16)?;
///     assert!(half.len() < checkpoint::to_bytes(&model)?.len() * 6 / 10);
///     let mut restored = nn::mlp(s, &[64, 32, 10], Activation::Relu, Init::Constant(0.0))?;
///     checkpoint::load_bytes_cast(&mut restored, &half)?; // bf16 values into f32 parameters
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
///
/// # Errors
/// As for [`to_bytes`]; [`Error::UnsupportedDType`] for an integer `dtype`.
pub fn to_bytes_in<'m>(params: &(impl Parameters<'m> + ?Sized), dtype: DType) -> Result<Vec<u8>> {
    if !dtype.is_float() {
        return Err(Error::UnsupportedDType {
            op: "checkpoint::to_bytes_in",
            dtype,
            expected: "a float dtype to convert the float parameters to",
        });
    }
    serialize(params, Some(dtype))
}

/// The safetensors bytes of `params`, float parameters converted to `float_dtype` if given.
fn serialize<'m>(
    params: &(impl Parameters<'m> + ?Sized),
    float_dtype: Option<DType>,
) -> Result<Vec<u8>> {
    let mut entries: Vec<(String, Entry)> = Vec::new();
    let mut failure = None;
    params.visit("", &mut |name, t| {
        let dtype = match float_dtype {
            Some(d) if t.dtype().is_float() => d,
            _ => t.dtype(),
        };
        match bytes_of(t, dtype) {
            Ok(bytes) => entries.push((
                name.to_string(),
                Entry {
                    dtype: safetensors_dtype(dtype),
                    shape: t.shape().to_vec(),
                    bytes,
                },
            )),
            Err(e) => failure = failure.take().or(Some(e)),
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    let mut names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(pair) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Format {
            format: "safetensors",
            reason: format!(
                "two parameters are named \"{}\"; give them distinct prefixes",
                pair[0]
            ),
        });
    }
    safetensors::serialize(entries.iter().map(|(n, e)| (n.as_str(), e)), None).map_err(format_error)
}

/// Writes the parameters of `params` to `path` in the safetensors format.
///
/// # Errors
/// [`Error::Io`] when the file cannot be written.
pub fn save<'m>(params: &(impl Parameters<'m> + ?Sized), path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    std::fs::write(path, to_bytes(params)?).map_err(|e| io_error(path, e))
}

/// Overwrites every parameter of `params` with the tensor of the same name in `bytes`. Nothing is
/// written unless every parameter is found with its shape and dtype.
///
/// # Errors
/// [`Error::Format`] for bytes that are not safetensors; [`Error::MissingTensor`] for a parameter the
/// checkpoint lacks; [`Error::ShapeMismatch`] / [`Error::DTypeMismatch`] for one saved with another
/// shape or dtype.
pub fn load_bytes<'m>(params: &mut (impl Parameters<'m> + ?Sized), bytes: &[u8]) -> Result<()> {
    load_into(params, bytes, false)
}

/// As [`load_bytes`], converting each saved float tensor to its parameter's float dtype (a `bf16`
/// checkpoint into an `f32` model, or back); integer tensors must match exactly.
///
/// # Errors
/// As for [`load_bytes`]; [`Error::DTypeMismatch`] between a float and an integer dtype.
pub fn load_bytes_cast<'m>(
    params: &mut (impl Parameters<'m> + ?Sized),
    bytes: &[u8],
) -> Result<()> {
    load_into(params, bytes, true)
}

/// Loads `bytes` into `params`; with `cast`, float tensors convert to the parameters' dtypes.
fn load_into<'m>(
    params: &mut (impl Parameters<'m> + ?Sized),
    bytes: &[u8],
    cast: bool,
) -> Result<()> {
    const OP: &str = "checkpoint::load";
    let file = SafeTensors::deserialize(bytes).map_err(format_error)?;
    let mut wanted: Vec<(String, Vec<usize>, DType)> = Vec::new();
    params.visit("", &mut |name, t| {
        wanted.push((name.to_string(), t.shape().to_vec(), t.dtype()));
    });
    // Check everything before writing anything.
    let mut views: Vec<TensorView<'_>> = Vec::with_capacity(wanted.len());
    for (name, shape, dtype) in &wanted {
        let view = file.tensor(name).map_err(|_| Error::MissingTensor {
            name: name.clone(),
            available: {
                let mut names: Vec<String> = file.names().iter().map(|n| n.to_string()).collect();
                names.sort();
                names
            },
        })?;
        let saved = our_dtype(name, view.dtype())?;
        let convertible = cast && saved.is_float() && dtype.is_float();
        if saved != *dtype && !convertible {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: *dtype,
                rhs: saved,
            });
        }
        if view.shape() != shape.as_slice() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: shape.clone(),
                rhs: view.shape().to_vec(),
                hint: "the checkpoint's tensor (right) must have the parameter's shape (left); was it saved from another architecture?",
            });
        }
        views.push(view);
    }
    let mut next = views.iter();
    params.visit_mut(&mut |p| {
        let view = next
            .next()
            .expect("visit_mut visits the parameters visit named");
        let saved = our_dtype("", view.dtype())?;
        with_dtype!(saved, S => with_dtype!(p.dtype(), T => {
            let values = decode::<S>(view.data());
            if S::DTYPE == T::DTYPE {
                p.copy_from_slice_(&values)
            } else {
                p.copy_from_slice_(&values.iter().map(|v| T::from_f64(v.to_f64())).collect::<Vec<T>>())
            }
        }))
    })
}

/// Loads `path` into `params`, as [`load_bytes`] does.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; as for [`load_bytes`].
pub fn load<'m>(params: &mut (impl Parameters<'m> + ?Sized), path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
    load_bytes(params, &bytes)
}

/// Loads `path` into `params`, as [`load_bytes_cast`] does.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; as for [`load_bytes_cast`].
pub fn load_cast<'m>(
    params: &mut (impl Parameters<'m> + ?Sized),
    path: impl AsRef<Path>,
) -> Result<()> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
    load_bytes_cast(params, &bytes)
}

/// Every tensor of a safetensors file's bytes, created in `scope`, sorted by name.
///
/// # Errors
/// [`Error::Format`] for bytes that are not safetensors or hold a dtype other than F32, F64, I64,
/// BF16 and F16.
pub fn read_bytes<'s>(scope: &Scope<'s>, bytes: &[u8]) -> Result<Vec<(String, Tensor<'s>)>> {
    let file = SafeTensors::deserialize(bytes).map_err(format_error)?;
    let mut out = Vec::new();
    for (name, view) in file.iter() {
        let dtype = our_dtype(name, view.dtype())?;
        let t = with_dtype!(dtype, T => scope.from_slice(&decode::<T>(view.data()), view.shape())?);
        out.push((name.to_string(), t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Decodes little-endian elements (the length was validated by safetensors against the shape).
fn decode<T: Element + LittleEndian>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(T::get_le)
        .collect()
}

/// Element types as little-endian bytes.
trait LittleEndian: Sized {
    fn put_le(self, out: &mut Vec<u8>);
    /// Reads one value from exactly `size_of::<Self>()` bytes.
    fn get_le(bytes: &[u8]) -> Self;
}

macro_rules! little_endian {
    ($($t:ty),*) => {$(
        impl LittleEndian for $t {
            fn put_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("chunks_exact yields whole elements"))
            }
        }
    )*};
}

little_endian!(f32, f64, i64, bf16, f16);
