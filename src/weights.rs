//! Weight sources: tensors read by name from safetensors checkpoints — one file, or a sharded
//! checkpoint through its `model.safetensors.index.json` — memory-mapped, so a tensor's bytes are
//! copied once, from the page cache into its scope (or uploaded once to its GPU).
//!
//! A [`Weights`] narrows names with [`prefix`](Weights::prefix) and maps a layer's own names to a
//! checkpoint's with [`renamed`](Weights::renamed), so a layer loads itself from any library's
//! checkpoint; each lookup declares the shape and dtype it wants (float tensors are cast on load)
//! and, for a matrix another library stores transposed, says so
//! ([`tensor_transposed`](Weights::tensor_transposed)). A missing or misshapen tensor is a typed
//! error naming it, what was expected and found, and the nearest names the checkpoint holds.
//!
//! ```
//! use ndscope::nn::{self, Activation, Init};
//! use ndscope::weights::Weights;
//! use ndscope::{DType, Device, checkpoint, root};
//!
//! let path = std::env::temp_dir().join(format!("ndscope-weights-doc-{}.safetensors", std::process::id()));
//! root(Device::Cpu, |s| {
//!     checkpoint::save(&nn::mlp(s, &[4, 3, 2], Activation::Relu, Init::KaimingUniform)?, &path)?;
//!     let weights = Weights::open(&path)?;
//!     let first = weights.prefix("0");
//!     let w = first.tensor(s, "weight", &[3, 4], DType::F32)?;
//!     let wt = first.tensor_transposed(s, "weight", &[4, 3], DType::F64)?; // cast on load
//!     assert_eq!(w.to_vec::<f32>()?[1] as f64, wt.to_vec::<f64>()?[3]);
//!     let err = first.tensor(s, "weights", &[3, 4], DType::F32).unwrap_err();
//!     assert!(err.to_string().contains("nearest: \"0.weight\""), "{err}");
//!     Ok::<_, ndscope::Error>(())
//! })?;
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), ndscope::Error>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;

use crate::dtype::{DType, Element, with_dtype};
use crate::error::{Error, Result};
use crate::gguf::{self, Gguf};
use crate::memory::mapped::MappedFile;
use crate::quant::{self, QuantType};
use crate::scope::Scope;
use crate::tensor::{QuantTensor, Tensor};

/// A checkpoint's tensors by name, over one or more memory-mapped safetensors files.
#[derive(Clone)]
pub struct Weights {
    source: Rc<Source>,
    /// Name transformations from a lookup's name to the checkpoint's, applied last to first.
    steps: Vec<Step>,
    /// Where tensors loaded through this view say they were created (a model loader's caller);
    /// `None`: the line that asked for them.
    site: Option<&'static Location<'static>>,
    /// How a stored tensor (by full name and stored shape) is rearranged into the one asked for:
    /// another format's layout of the same parameter (GGUF's Q and K rows, its `[out, in]` GPT-2
    /// matrices).
    adapt: Option<Rc<AdaptFn>>,
}

/// Picks the rearrangement of a stored tensor from its full name and stored shape.
pub(crate) type AdaptFn = dyn Fn(&str, &[usize]) -> Option<Adapt>;

/// A rearrangement applied to a stored tensor's values as it is loaded.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Adapt {
    /// Row `i` of the loaded matrix is stored row `rows[i]`.
    Rows(Vec<usize>),
    /// The loaded matrix is the stored one's transpose.
    Transpose,
}

impl Adapt {
    /// The shape a tensor stored as `stored` is loaded with.
    fn shape(&self, stored: &[usize]) -> Vec<usize> {
        match self {
            Adapt::Rows(_) => stored.to_vec(),
            Adapt::Transpose => stored.iter().rev().copied().collect(),
        }
    }

    /// `values`, stored with `stored` shape, rearranged.
    fn apply<T: Copy>(&self, values: Vec<T>, stored: &[usize]) -> Vec<T> {
        let rows = stored.first().copied().unwrap_or(1).max(1);
        let width = values.len() / rows;
        match self {
            Adapt::Rows(order) => order
                .iter()
                .flat_map(|&r| values[r * width..(r + 1) * width].iter().copied())
                .collect(),
            Adapt::Transpose => (0..width)
                .flat_map(|c| (0..rows).map(move |r| (r, c)))
                .map(|(r, c)| values[r * width + c])
                .collect(),
        }
    }
}

#[derive(Clone)]
enum Step {
    Prefix(String),
    Rename(Rc<dyn Fn(&str) -> String>),
}

/// The opened files and where each tensor is.
struct Source {
    files: Vec<(PathBuf, MappedFile)>,
    tensors: BTreeMap<String, Entry>,
    /// The metadata of a GGUF file (`None` for safetensors).
    gguf: Option<BTreeMap<String, gguf::Value>>,
}

impl Source {
    fn new() -> Source {
        Source {
            files: Vec::new(),
            tensors: BTreeMap::new(),
            gguf: None,
        }
    }

    /// Adds the tensors of one file, safetensors or GGUF (told apart by GGUF's magic).
    fn add(&mut self, path: PathBuf, map: MappedFile) -> Result<()> {
        if map.bytes().starts_with(gguf::MAGIC) {
            return self.add_gguf(path, map);
        }
        let (header, metadata) =
            SafeTensors::read_metadata(map.bytes()).map_err(|e| format_error(&path, e))?;
        let data_start = 8 + header;
        for (name, info) in metadata.tensors() {
            let entry = Entry {
                file: self.files.len(),
                stored: Stored::Safetensors(info.dtype),
                shape: info.shape.clone(),
                bytes: (
                    data_start + info.data_offsets.0,
                    data_start + info.data_offsets.1,
                ),
            };
            if self.tensors.insert(name.clone(), entry).is_some() {
                return Err(format_error(
                    &path,
                    format!("the tensor \"{name}\" is held by two shards"),
                ));
            }
        }
        self.files.push((path, map));
        Ok(())
    }

    /// Adds the tensors of one GGUF file, under the file's own names (`blk.0.attn_q.weight`).
    fn add_gguf(&mut self, path: PathBuf, map: MappedFile) -> Result<()> {
        let file = Gguf::parse(map.bytes()).map_err(|e| match e {
            Error::Format { format, reason } => Error::Format {
                format,
                reason: format!("{}: {reason}", path.display()),
            },
            other => other,
        })?;
        if self.gguf.is_some() || !self.files.is_empty() {
            return Err(Error::io(
                &path,
                "a GGUF file holds a whole model: it cannot be one shard among others",
            ));
        }
        for t in file.tensors {
            self.tensors.insert(
                t.name,
                Entry {
                    file: self.files.len(),
                    stored: Stored::Ggml(t.ty),
                    shape: t.shape,
                    bytes: (t.bytes.start, t.bytes.end),
                },
            );
        }
        self.gguf = Some(file.metadata);
        self.files.push((path, map));
        Ok(())
    }
}

/// One tensor of a file: its file, stored type and shape, and its bytes' range in the file.
struct Entry {
    file: usize,
    stored: Stored,
    shape: Vec<usize>,
    bytes: (usize, usize),
}

/// How a tensor's bytes code its values.
#[derive(Clone, Copy)]
enum Stored {
    Safetensors(Dtype),
    Ggml(QuantType),
}

impl fmt::Debug for Weights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Weights")
            .field(
                "files",
                &self.source.files.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("tensors", &self.source.tensors.len())
            .field("prefix", &self.full_name(""))
            .finish()
    }
}

fn format_error(path: &Path, e: impl fmt::Display) -> Error {
    Error::Format {
        format: "safetensors",
        reason: format!("{}: {e}", path.display()),
    }
}

/// The dtype ndscope uses for a safetensors dtype, if it has one.
pub(crate) fn dtype_of(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F32 => Some(DType::F32),
        Dtype::F64 => Some(DType::F64),
        Dtype::I64 => Some(DType::I64),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

/// The safetensors dtype of an ndscope dtype.
pub(crate) fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

impl Weights {
    /// Opens a checkpoint: a `.safetensors` file, a GGUF file (llama.cpp's format: its tensors under
    /// their GGUF names, block-quantized ones decoded to floats on load, its metadata in
    /// [`gguf_metadata`](Self::gguf_metadata)), a sharded checkpoint's index
    /// (`*.safetensors.index.json`, whose `weight_map` names each tensor's file), or a directory
    /// holding `model.safetensors` or `model.safetensors.index.json` (a Hugging Face model
    /// directory). Files are memory-mapped; only their headers are read here.
    ///
    /// **A mapped file must not change while the `Weights` lives.** Its tensors are read from the
    /// file's pages when they are loaded, so a file rewritten in place meanwhile gives other bytes,
    /// and one truncated by another process makes the read fault (SIGBUS) — the contract of every
    /// memory-mapped loader (candle makes its loader `unsafe` for it). Replacing the file is safe:
    /// ndscope's own saves ([`checkpoint::save`](crate::checkpoint::save), `save_pretrained`) write a
    /// new file and rename it over the old one, and this map keeps reading the old file. For a file
    /// that another program may rewrite in place, use [`read`](Self::read), which copies it.
    ///
    /// # Errors
    /// [`Error::Io`] for a path that cannot be read (or a directory with neither file);
    /// [`Error::Format`] for a file that is not safetensors (truncated, say), an index that is not
    /// valid JSON with a `weight_map`, or a tensor that two shards both hold.
    pub fn open(path: impl AsRef<Path>) -> Result<Weights> {
        Weights::open_as(path.as_ref(), true)
    }

    /// As [`open`](Self::open), but each file is read into memory whole instead of mapped: later
    /// changes to the files cannot reach it, at the price of holding every file's bytes (and reading
    /// them all) up front.
    ///
    /// # Errors
    /// As for [`open`](Self::open).
    pub fn read(path: impl AsRef<Path>) -> Result<Weights> {
        Weights::open_as(path.as_ref(), false)
    }

    fn open_as(path: &Path, mapped: bool) -> Result<Weights> {
        if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            let single = path.join("model.safetensors");
            return if single.is_file() {
                Weights::open_as(&single, mapped)
            } else if index.is_file() {
                Weights::open_as(&index, mapped)
            } else {
                Err(Error::io(
                    path,
                    "the directory holds neither model.safetensors nor model.safetensors.index.json",
                ))
            };
        }
        let files = if path.to_string_lossy().ends_with(".json") {
            shards(path)?
        } else {
            vec![path.to_path_buf()]
        };
        let mut source = Source::new();
        for file in files {
            let map = if mapped {
                MappedFile::open(&file)
            } else {
                std::fs::read(&file).map(MappedFile::Read)
            }
            .map_err(|e| Error::io(&file, e))?;
            source.add(file, map)?;
        }
        Ok(Weights {
            source: Rc::new(source),
            steps: Vec::new(),
            site: None,
            adapt: None,
        })
    }

    /// A checkpoint from the bytes of one safetensors or GGUF file (already in memory).
    ///
    /// # Errors
    /// [`Error::Format`] for bytes that are neither.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Weights> {
        let mut source = Source::new();
        source.add(PathBuf::from("<bytes>"), MappedFile::Read(bytes))?;
        Ok(Weights {
            source: Rc::new(source),
            steps: Vec::new(),
            site: None,
            adapt: None,
        })
    }

    /// The same checkpoint with names looked up under `prefix`: `weights.prefix("transformer.h.0")`
    /// finds `"attn.c_attn.weight"` as `"transformer.h.0.attn.c_attn.weight"`. An empty prefix
    /// changes nothing.
    pub fn prefix(&self, prefix: &str) -> Weights {
        let mut w = self.clone();
        if !prefix.is_empty() {
            w.steps.push(Step::Prefix(prefix.to_string()));
        }
        w
    }

    /// The same checkpoint with every name looked up through `rename` first (a layer's own name to
    /// the checkpoint's), then through this view's prefixes and renames.
    pub fn renamed(&self, rename: impl Fn(&str) -> String + 'static) -> Weights {
        let mut w = self.clone();
        w.steps.push(Step::Rename(Rc::new(rename)));
        w
    }

    /// The same checkpoint, its tensors recorded in dumps as created at `site`: a model's loader
    /// passes its caller's location (`Location::caller()` under `#[track_caller]`), so that
    /// `dump()` points at the user's `from_pretrained` line rather than at the layer code inside
    /// the library that asked for each tensor.
    pub fn loaded_from(&self, site: &'static Location<'static>) -> Weights {
        let mut w = self.clone();
        w.site = Some(site);
        w
    }

    /// The same checkpoint with each stored tensor rearranged as `adapt` says (by its full name
    /// and stored shape) when it is loaded.
    pub(crate) fn adapted(
        &self,
        adapt: impl Fn(&str, &[usize]) -> Option<Adapt> + 'static,
    ) -> Weights {
        let mut w = self.clone();
        w.adapt = Some(Rc::new(adapt));
        w
    }

    /// The rearrangement of `full`'s stored tensor, if any.
    fn adaptation(&self, full: &str, entry: &Entry) -> Option<Adapt> {
        self.adapt.as_ref().and_then(|f| f(full, &entry.shape))
    }

    /// The checkpoint's name for `name` looked up through this view.
    pub fn full_name(&self, name: &str) -> String {
        let mut name = name.to_string();
        for step in self.steps.iter().rev() {
            name = match step {
                Step::Prefix(p) if name.is_empty() => p.clone(),
                Step::Prefix(p) => format!("{p}.{name}"),
                Step::Rename(f) => f(&name),
            };
        }
        name
    }

    /// The files the checkpoint was read from.
    pub(crate) fn files(&self) -> impl Iterator<Item = &Path> {
        self.source.files.iter().map(|(p, _)| p.as_path())
    }

    /// The metadata of a GGUF checkpoint (its architecture, hyperparameters and tokenizer), `None`
    /// for safetensors.
    pub fn gguf_metadata(&self) -> Option<&BTreeMap<String, gguf::Value>> {
        self.source.gguf.as_ref()
    }

    /// How `name` is stored when it is block-quantized (a GGUF tensor in Q4_K, say); `None` for a
    /// tensor of plain floats or integers. Quantized tensors are decoded on load.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when the checkpoint lacks it.
    pub fn quantized(&self, name: &str) -> Result<Option<QuantType>> {
        Ok(self.entry(name)?.1.quantized())
    }

    /// Whether the checkpoint holds `name` (looked up through this view).
    pub fn contains(&self, name: &str) -> bool {
        self.source.tensors.contains_key(&self.full_name(name))
    }

    /// Every name the checkpoint holds, sorted (whatever this view's prefix).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.source.tensors.keys().map(String::as_str)
    }

    /// Number of tensors in the checkpoint.
    pub fn len(&self) -> usize {
        self.source.tensors.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.source.tensors.is_empty()
    }

    /// The stored dtype and shape of `name`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when the checkpoint lacks it; [`Error::Format`] for a dtype ndscope
    /// does not read.
    pub fn info(&self, name: &str) -> Result<(DType, &[usize])> {
        let (full, entry) = self.entry(name)?;
        Ok((stored_dtype(&full, entry)?, &entry.shape))
    }

    /// The tensor `name`, which must be stored with `shape`, as a tensor of `dtype` in `scope`
    /// (a float stored in another float dtype is converted, rounding to nearest).
    ///
    /// # Errors
    /// [`Error::MissingTensor`] naming the nearest names; [`Error::TensorMismatch`] for another
    /// shape (with a hint when the stored one is the transpose) or an integer/float mismatch;
    /// allocation errors.
    #[track_caller]
    pub fn tensor<'s>(
        &self,
        scope: &Scope<'s>,
        name: &str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor<'s>> {
        self.load(scope, name, shape, dtype, false)
    }

    /// As [`tensor`](Self::tensor): a layer's parameter. Every tensor loaded through a view is
    /// named in dumps by its checkpoint name (`"h.0.attn.c_attn.weight"`, as PyTorch's
    /// `named_parameters` would list it).
    ///
    /// # Errors
    /// As for [`tensor`](Self::tensor).
    #[track_caller]
    pub fn parameter<'s>(
        &self,
        scope: &Scope<'s>,
        name: &'static str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor<'s>> {
        self.tensor(scope, name, shape, dtype)
    }

    /// The matrix `name`, stored as the transpose of `shape` (`[in, out]` for a `[out, in]`
    /// weight: Hugging Face's `Conv1D`, JAX's `Dense`), as a contiguous tensor of `shape` and
    /// `dtype` in `scope`. The transpose costs a copy; a layer that can use the stored layout
    /// directly (see [`WeightLayout`](crate::nn::WeightLayout)) avoids it.
    ///
    /// # Errors
    /// As for [`tensor`](Self::tensor); [`Error::InvalidShape`] unless `shape` is 2-D.
    #[track_caller]
    pub fn tensor_transposed<'s>(
        &self,
        scope: &Scope<'s>,
        name: &str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor<'s>> {
        let &[rows, cols] = shape else {
            return Err(Error::InvalidShape {
                op: "Weights::tensor_transposed",
                shape: shape.to_vec(),
                reason: "only a matrix can be stored transposed".into(),
            });
        };
        let t = self
            .load(scope, name, &[cols, rows], dtype, true)?
            .t()?
            .contiguous()?;
        Ok(self.mark(t, &self.full_name(name)))
    }

    /// `t` named `full` in dumps, and created at this view's site when it has one.
    fn mark<'s>(&self, t: Tensor<'s>, full: &str) -> Tensor<'s> {
        let t = t.named_path(full);
        match self.site {
            Some(site) => t.created_at(site),
            None => t,
        }
    }

    /// Overwrites `param` with the tensor `name`, which must have `param`'s shape (a float is
    /// converted to `param`'s dtype): one copy from the file into the parameter's memory.
    ///
    /// # Errors
    /// As for [`tensor`](Self::tensor).
    pub fn load_into(&self, param: &mut Tensor<'_>, name: &str) -> Result<()> {
        let (full, entry) = self.entry(name)?;
        let adapt = self.adaptation(&full, entry);
        let stored = self.check(
            &full,
            entry,
            adapt.as_ref(),
            param.shape(),
            param.dtype(),
            false,
        )?;
        let bytes = self.bytes(entry);
        if adapt.is_none() && entry.quantized().is_none() && stored == param.dtype() {
            param.copy_from_le_bytes_(bytes)?;
        } else {
            with_dtype!(param.dtype(), T => param.copy_from_slice_(
                &self.values::<T>(&full, entry, adapt.as_ref(), stored)?))?;
        }
        self.release(entry);
        Ok(())
    }

    #[track_caller]
    fn load<'s>(
        &self,
        scope: &Scope<'s>,
        name: &str,
        shape: &[usize],
        dtype: DType,
        transposed: bool,
    ) -> Result<Tensor<'s>> {
        let (full, entry) = self.entry(name)?;
        let adapt = self.adaptation(&full, entry);
        let stored = self.check(&full, entry, adapt.as_ref(), shape, dtype, transposed)?;
        let bytes = self.bytes(entry);
        let t = if adapt.is_none() && entry.quantized().is_none() && stored == dtype {
            scope.tensor_of_le_bytes(bytes, shape, dtype)?
        } else {
            with_dtype!(dtype, T => scope.from_slice(
                &self.values::<T>(&full, entry, adapt.as_ref(), stored)?, shape)?)
        };
        self.release(entry);
        Ok(self.mark(t, &full))
    }

    /// The block-quantized matrix `name`, which must be stored with `shape` in a block format
    /// (a GGUF tensor in Q4_K, say), as its blocks in `scope`: no decoding, a quarter to an eighth
    /// of the bytes of `f32`. Products read it with
    /// [`Tensor::matmul_quantized_t`](crate::Tensor::matmul_quantized_t). The rows are the
    /// file's (`[out, in]` in GGUF), also where a view would transpose the decoded values.
    ///
    /// # Errors
    /// [`Error::MissingTensor`]; [`Error::TensorMismatch`] for another shape, or a tensor stored
    /// as plain floats (load those with [`tensor`](Self::tensor)); allocation errors.
    #[track_caller]
    pub fn quantized_tensor<'s>(
        &self,
        scope: &Scope<'s>,
        name: &str,
        shape: &[usize],
    ) -> Result<QuantTensor<'s>> {
        let (full, entry) = self.entry(name)?;
        let adapt = self.adaptation(&full, entry);
        let found = || {
            let ty = match entry.stored {
                Stored::Ggml(ty) => ty.to_string(),
                Stored::Safetensors(dtype) => format!("{dtype:?}"),
            };
            format!("{ty} {:?}", entry.shape)
        };
        let mismatch = |hint: &str| Error::TensorMismatch {
            name: full.clone(),
            expected: format!("a block-quantized matrix {shape:?}"),
            found: found(),
            hint: hint.to_string(),
        };
        let Some(ty) = entry.quantized() else {
            return Err(mismatch(
                "it is stored as plain values: load it with `Weights::tensor`",
            ));
        };
        if entry.shape != shape {
            return Err(mismatch(
                "was the file made from a model of another configuration?",
            ));
        }
        let bytes = self.bytes(entry);
        let t = match adapt {
            // A transposing view maps the file's `[out, in]` to a dense `[in, out]` layout (GPT-2's
            // Conv1D); blocks run along the file's rows, and a quantized matrix is always the
            // `W` of `x Wᵀ`, so they are kept as stored.
            None | Some(Adapt::Transpose) => QuantTensor::from_blocks(scope, bytes, ty, shape)?,
            // Whole stored rows move, so the rows of bytes rearrange as the rows of values would.
            Some(rows @ Adapt::Rows(_)) => {
                QuantTensor::from_blocks(scope, &rows.apply(bytes.to_vec(), shape), ty, shape)?
            }
        };
        self.release(entry);
        Ok(t.named(&full))
    }

    /// The values of `name` as `f64`s (a model's own small tables, such as GGUF's RoPE divisors).
    ///
    /// # Errors
    /// As for [`tensor`](Self::tensor).
    pub(crate) fn values_f64(&self, name: &str) -> Result<Vec<f64>> {
        let (full, entry) = self.entry(name)?;
        let adapt = self.adaptation(&full, entry);
        let stored = stored_dtype(&full, entry)?;
        self.values::<f64>(&full, entry, adapt.as_ref(), stored)
    }

    /// `entry`'s values decoded (from `stored`, or its block format), converted to `T` and
    /// rearranged by `adapt`.
    fn values<T: Element>(
        &self,
        full: &str,
        entry: &Entry,
        adapt: Option<&Adapt>,
        stored: DType,
    ) -> Result<Vec<T>> {
        let bytes = self.bytes(entry);
        let values = match entry.quantized() {
            Some(ty) => dequantized::<T>(ty, bytes, full)?,
            None => convert::<T>(stored, bytes),
        };
        Ok(match adapt {
            Some(adapt) => adapt.apply(values, &entry.shape),
            None => values,
        })
    }

    /// The checkpoint's entry for `name`, with its full name.
    fn entry(&self, name: &str) -> Result<(String, &Entry)> {
        let full = self.full_name(name);
        match self.source.tensors.get(&full) {
            Some(entry) => Ok((full, entry)),
            None => Err(Error::MissingTensor {
                nearest: nearest(&full, self.names()),
                held: self.len(),
                name: full,
            }),
        }
    }

    /// Checks `entry` against the wanted shape and dtype; the stored dtype.
    fn check(
        &self,
        full: &str,
        entry: &Entry,
        adapt: Option<&Adapt>,
        shape: &[usize],
        dtype: DType,
        transposed: bool,
    ) -> Result<DType> {
        let stored = stored_dtype(full, entry)?;
        let loaded = adapt.map_or_else(|| entry.shape.clone(), |a| a.shape(&entry.shape));
        let mismatch = |hint: String| Error::TensorMismatch {
            name: full.to_string(),
            expected: format!("{dtype} {shape:?}"),
            found: format!("{stored} {loaded:?}"),
            hint,
        };
        if loaded != shape {
            let mut reversed = shape.to_vec();
            reversed.reverse();
            let hint = if shape.len() == 2 && loaded == reversed {
                if transposed {
                    "it is stored as the shape asked for, not transposed: load it with \
                     `Weights::tensor`"
                } else {
                    "it holds the transpose: the checkpoint stores this matrix in the other layout \
                     ([in, out] for Hugging Face's Conv1D, [out, in] for PyTorch's nn.Linear); \
                     declare that layout (`WeightLayout`) or load it with \
                     `Weights::tensor_transposed`"
                }
                .to_string()
            } else {
                "was the checkpoint saved from a model of another configuration?".to_string()
            };
            return Err(mismatch(hint));
        }
        if stored != dtype && !(stored.is_float() && dtype.is_float()) {
            return Err(mismatch(
                "floats convert to floats on load, integers must match exactly".into(),
            ));
        }
        Ok(stored)
    }

    /// `entry`'s bytes. Not prefetched: the parallel copy faults the pages in faster than one
    /// `MADV_POPULATE_READ` (measured on GPT-2 small: 0.17 s against 0.21 s).
    fn bytes(&self, entry: &Entry) -> &[u8] {
        &self.source.files[entry.file].1.bytes()[entry.bytes.0..entry.bytes.1]
    }

    /// Drops `entry`'s bytes from the process's resident memory once they have been copied.
    fn release(&self, entry: &Entry) {
        self.source.files[entry.file]
            .1
            .release(entry.bytes.0..entry.bytes.1);
    }
}

/// The dtype `entry`'s values have as stored, or decode to without loss: `F32` for a
/// block-quantized tensor.
fn stored_dtype(full: &str, entry: &Entry) -> Result<DType> {
    match entry.stored {
        Stored::Ggml(QuantType::F16) => Ok(DType::F16),
        Stored::Ggml(QuantType::BF16) => Ok(DType::BF16),
        Stored::Ggml(_) => Ok(DType::F32),
        Stored::Safetensors(dtype) => dtype_of(dtype).ok_or_else(|| Error::Format {
            format: "safetensors",
            reason: format!(
                "tensor \"{full}\" has dtype {dtype:?}; ndscope reads F32, F64, I64, BF16 and F16"
            ),
        }),
    }
}

impl Entry {
    /// The block format of a quantized tensor (whose bytes are not plain little-endian floats).
    fn quantized(&self) -> Option<QuantType> {
        match self.stored {
            Stored::Ggml(ty) if ty.is_quantized() => Some(ty),
            _ => None,
        }
    }
}

/// The values of `bytes`, whole blocks of `ty`, decoded and converted to `T`.
fn dequantized<T: Element>(ty: QuantType, bytes: &[u8], full: &str) -> Result<Vec<T>> {
    let values = bytes.len() / ty.block_bytes() * ty.block_size();
    let mut out = vec![0.0f32; values];
    quant::dequantize(ty, bytes, &mut out).map_err(|e| Error::Format {
        format: "GGUF",
        reason: format!("tensor \"{full}\": {e}"),
    })?;
    Ok(out.into_iter().map(|v| T::from_f64(f64::from(v))).collect())
}

/// The elements of `bytes` (little-endian `stored` values) converted to `T`.
fn convert<T: Element>(stored: DType, bytes: &[u8]) -> Vec<T> {
    with_dtype!(stored, S => bytes
        .chunks_exact(std::mem::size_of::<S>())
        .map(|b| T::from_f64(S::get_le(b).to_f64()))
        .collect())
}

/// Element types as little-endian bytes (the safetensors encoding).
pub(crate) trait LittleEndian: Sized {
    /// Appends the value's bytes.
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

little_endian!(f32, f64, i64, crate::dtype::bf16, crate::dtype::f16);

/// The shard files a `*.safetensors.index.json` names, in the order they first appear.
fn shards(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let bad = |reason: String| Error::Format {
        format: "safetensors index",
        reason: format!("{}: {reason}", index.display()),
    };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("it has no \"weight_map\" object of tensor names to files".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("the file of \"{name}\" is not a string")))?;
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    Ok(files)
}

/// Up to five of `names` nearest to `name` by edit distance, nearest first.
fn nearest<'a>(name: &str, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut scored: Vec<(usize, &str)> = names.map(|n| (edit_distance(name, n), n)).collect();
    scored.sort();
    scored
        .into_iter()
        .take(5)
        .map(|(_, n)| n.to_string())
        .collect()
}

/// Levenshtein distance between two strings, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("weight", "weight"), 0);
        assert_eq!(edit_distance("weight", "weights"), 1);
        assert_eq!(edit_distance("c_attn", "c_proj"), 4);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("abc", ""), 3);
    }

    #[test]
    fn nearest_names_come_closest_first() {
        let names = [
            "h.0.attn.c_attn.weight",
            "h.0.attn.c_proj.weight",
            "wte.weight",
        ];
        let found = nearest("h.0.attn.c_atn.weight", names.into_iter());
        assert_eq!(found[0], "h.0.attn.c_attn.weight");
        assert_eq!(found.len(), 3);
    }

    #[test]
    fn names_compose_prefixes_and_renames_from_the_inside_out() {
        let w = Weights {
            source: Rc::new(Source::new()),
            steps: Vec::new(),
            site: None,
            adapt: None,
        };
        let block = w
            .prefix("transformer")
            .prefix("h.1")
            .renamed(|n| n.replace("ln1", "ln_1"));
        assert_eq!(block.full_name("ln1.weight"), "transformer.h.1.ln_1.weight");
        assert_eq!(w.prefix("").full_name("wte.weight"), "wte.weight");
        assert_eq!(block.full_name(""), "transformer.h.1");
    }
}
