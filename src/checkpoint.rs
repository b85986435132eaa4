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

use safetensors::tensor::{Dtype, View};

use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::scope::Scope;
use crate::tensor::Tensor;
use crate::weights::{LittleEndian, Weights, safetensors_dtype};

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
    safetensors::serialize(entries.iter().map(|(n, e)| (n.as_str(), e)), None).map_err(|e| {
        Error::Format {
            format: "safetensors",
            reason: e.to_string(),
        }
    })
}

/// Writes the parameters of `params` to `path` in the safetensors format, through
/// [`write_atomically`]: a crash, a full disk or an error during the save leaves the previous file at
/// `path` as it was, and a [`Weights`] that maps it keeps reading it.
///
/// # Errors
/// [`Error::Io`] when the file cannot be written (the previous one is then untouched).
pub fn save<'m>(params: &(impl Parameters<'m> + ?Sized), path: impl AsRef<Path>) -> Result<()> {
    write_atomically(path, &to_bytes(params)?)
}

/// Replaces the file at `path` with `bytes` so that at every moment, even across a crash or a power
/// loss, `path` holds either the whole previous file or the whole new one.
///
/// The bytes go to a temporary file beside `path` (`.NAME.ndscope-tmp-PID-N`, in the same directory
/// so that the rename stays within one file system), which is flushed to the disk (`fsync`) and then
/// renamed over `path`; last the directory is flushed, so that the rename itself survives a power
/// loss. A failure removes the temporary file; a process killed mid-write leaves it behind, and
/// nothing else. A process that maps the old file (a [`Weights`]) keeps its pages: the old file lives
/// on, unnamed, until its last map is gone, where writing in place would have cut the pages from
/// under it. If `path` is a symbolic link, the file it points to is replaced. The new file gets the
/// default permissions of a new file, not the old file's.
///
/// ```
/// let dir = std::env::temp_dir().join(format!("ndscope-doc-atomic-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("notes.txt");
/// ndscope::checkpoint::write_atomically(&path, b"first")?;
/// ndscope::checkpoint::write_atomically(&path, b"second")?;
/// assert_eq!(std::fs::read(&path)?, b"second");
/// assert_eq!(std::fs::read_dir(&dir)?.count(), 1, "no temporary file is left");
/// std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`Error::Io`] naming `path` when the directory cannot be written, the disk is full, `path` is a
/// directory, or the rename is refused; `path` is then untouched.
pub fn write_atomically(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);

    let asked = path.as_ref();
    let fail = |what: &str, e: std::io::Error| Error::io(asked, format!("{what}: {e}"));
    // A link is followed, so that the file it names is replaced rather than the link.
    let path = if asked.is_symlink() {
        std::fs::canonicalize(asked).map_err(|e| fail("cannot follow the symbolic link", e))?
    } else {
        asked.to_path_buf()
    };
    if path.is_dir() {
        return Err(Error::io(asked, "is a directory; name a file to write"));
    }
    let name = path
        .file_name()
        .ok_or_else(|| Error::io(asked, "names no file; name a file to write"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let temp = dir.join(format!(
        ".{}.ndscope-tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| fail("cannot create a file in its directory", e))?;
        file.write_all(bytes)
            .map_err(|e| fail("writing failed (is the disk full?)", e))?;
        file.sync_all()
            .map_err(|e| fail("flushing to the disk failed", e))?;
        std::fs::rename(&temp, &path).map_err(|e| fail("cannot replace the file", e))
    })();
    if written.is_err() {
        // Best effort: the error that matters is the one above.
        let _ = std::fs::remove_file(&temp);
        return written;
    }
    // The rename is durable once the directory is flushed. A directory that cannot be opened or
    // flushed (some network and FUSE file systems) does not undo a completed replace.
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Overwrites every parameter of `params` with the tensor of the same name in `bytes`. Nothing is
/// written unless every parameter is found with its shape and dtype.
///
/// # Errors
/// [`Error::Format`] for bytes that are not safetensors; [`Error::MissingTensor`] for a parameter the
/// checkpoint lacks (with the nearest names it holds); [`Error::TensorMismatch`] for one saved with
/// another shape or dtype.
pub fn load_bytes<'m>(params: &mut (impl Parameters<'m> + ?Sized), bytes: &[u8]) -> Result<()> {
    load_from(params, &Weights::from_bytes(bytes.to_vec())?, false)
}

/// As [`load_bytes`], converting each saved float tensor to its parameter's float dtype (a `bf16`
/// checkpoint into an `f32` model, or back); integer tensors must match exactly.
///
/// # Errors
/// As for [`load_bytes`].
pub fn load_bytes_cast<'m>(
    params: &mut (impl Parameters<'m> + ?Sized),
    bytes: &[u8],
) -> Result<()> {
    load_from(params, &Weights::from_bytes(bytes.to_vec())?, true)
}

/// Loads `path` into `params`, as [`load_bytes`] does. The file is memory-mapped: each parameter's
/// bytes are copied once, from the page cache into the parameter.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; as for [`load_bytes`].
pub fn load<'m>(params: &mut (impl Parameters<'m> + ?Sized), path: impl AsRef<Path>) -> Result<()> {
    load_from(params, &Weights::open(path)?, false)
}

/// Loads `path` into `params`, as [`load_bytes_cast`] does.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; as for [`load_bytes_cast`].
pub fn load_cast<'m>(
    params: &mut (impl Parameters<'m> + ?Sized),
    path: impl AsRef<Path>,
) -> Result<()> {
    load_from(params, &Weights::open(path)?, true)
}

/// Loads every parameter of `params` from `weights` by its name; with `cast`, float tensors convert
/// to the parameters' dtypes, otherwise dtypes must match. Checks everything before writing anything.
pub fn load_from<'m>(
    params: &mut (impl Parameters<'m> + ?Sized),
    weights: &Weights,
    cast: bool,
) -> Result<()> {
    let mut wanted: Vec<(String, Vec<usize>, DType)> = Vec::new();
    params.visit("", &mut |name, t| {
        wanted.push((name.to_string(), t.shape().to_vec(), t.dtype()));
    });
    for (name, shape, dtype) in &wanted {
        let (saved, saved_shape) = weights.info(name)?;
        if saved_shape != shape.as_slice() || (saved != *dtype && !cast) {
            return Err(Error::TensorMismatch {
                name: weights.full_name(name),
                expected: format!("{dtype} {shape:?}"),
                found: format!("{saved} {saved_shape:?}"),
                hint: if saved_shape != shape.as_slice() {
                    "the parameter's shape must be the saved one; was it saved from another \
                     architecture?"
                } else {
                    "load it with `load_cast` to convert the saved floats"
                }
                .into(),
            });
        }
    }
    let mut names = wanted.iter().map(|(name, _, _)| name);
    params.visit_mut(&mut |p| {
        let name = names
            .next()
            .expect("visit_mut visits the parameters visit named");
        weights.load_into(p, name)
    })
}

/// Every tensor of a safetensors file's bytes, created in `scope`, sorted by name.
///
/// # Errors
/// [`Error::Format`] for bytes that are not safetensors or hold a dtype other than F32, F64, I64,
/// BF16 and F16.
pub fn read_bytes<'s>(scope: &Scope<'s>, bytes: &[u8]) -> Result<Vec<(String, Tensor<'s>)>> {
    let weights = Weights::from_bytes(bytes.to_vec())?;
    let mut out = Vec::new();
    for name in weights.names() {
        let (dtype, shape) = weights.info(name)?;
        out.push((name.to_string(), weights.tensor(scope, name, shape, dtype)?));
    }
    Ok(out)
}
