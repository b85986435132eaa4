//! Training data on the host: the bundled digits set, a reader for MNIST IDX files, a seeded
//! train/test split, shuffled batches that can be prepared on a background thread, and text
//! tokenized with a Hugging Face `tokenizer.json` ([`Tokenizer`]).
//!
//! Data sets are plain host memory (`Vec<f32>` features, `Vec<i64>` labels); a training loop copies
//! each [`Batch`] into its batch scope (with [`Scope::from_slice`](crate::Scope::from_slice), or
//! [`Tensor::copy_from_slice_`](crate::Tensor::copy_from_slice_) into a reused tensor).
//!
//! ```
//! use ndscope::data::{Dataset, Loader};
//!
//! let digits = Dataset::digits()?;
//! let (train, test) = digits.split(0.2, 7)?;
//! assert_eq!(train.len() + test.len(), 1797);
//! let loader = Loader::new(&train, 64)?.shuffle(7);
//! let mut rows = 0;
//! loader.for_each_batch(0, true, |batch| {
//!     rows += batch.rows();
//!     Ok(())
//! })?;
//! assert_eq!(rows, train.len());
//! # Ok::<(), ndscope::Error>(())
//! ```

mod chat;
mod csv;
mod gguf_vocab;
mod idx;
mod loader;
mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use loader::{Batch, Loader};
pub use tokenizer::Tokenizer;

use crate::error::{Error, Result};
use crate::rng::Rng;

/// Labelled examples: `len()` rows of `dim()` `f32` features and an `i64` class label each.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    features: Vec<f32>,
    labels: Vec<i64>,
    dim: usize,
    classes: usize,
}

impl Dataset {
    /// A data set from row-major `features` (`labels.len()` rows of `dim` values) and labels in
    /// `0..classes`.
    ///
    /// # Errors
    /// [`Error::DataLength`] when the feature count is not `labels.len() * dim`;
    /// [`Error::IndexOutOfRange`] for a label outside `0..classes`; [`Error::InvalidShape`] for
    /// `dim == 0`.
    pub fn new(
        features: Vec<f32>,
        labels: Vec<i64>,
        dim: usize,
        classes: usize,
    ) -> Result<Dataset> {
        if dim == 0 {
            return Err(Error::InvalidShape {
                op: "Dataset::new",
                shape: vec![labels.len(), dim],
                reason: "each example needs at least one feature".into(),
            });
        }
        let expected = labels.len().checked_mul(dim).ok_or(Error::SizeOverflow {
            shape: vec![labels.len(), dim],
            element_bytes: 4,
        })?;
        if features.len() != expected {
            return Err(Error::DataLength {
                op: "Dataset::new",
                expected,
                got: features.len(),
            });
        }
        if let Some(&bad) = labels
            .iter()
            .find(|&&l| l < 0 || l as u64 >= classes as u64)
        {
            return Err(Error::IndexOutOfRange {
                op: "Dataset::new",
                index: bad,
                size: classes,
            });
        }
        Ok(Dataset {
            features,
            labels,
            dim,
            classes,
        })
    }

    /// The 1,797 8x8 handwritten digits bundled with ndscope (E. Alpaydin, C. Kaynak, 1998; UCI
    /// Machine Learning Repository; CC BY 4.0), pixels scaled from `0..=16` to `0..=1`.
    ///
    /// # Errors
    /// Only if the bundled file were damaged ([`Error::Format`]).
    pub fn digits() -> Result<Dataset> {
        const DIGITS: &[u8] = include_bytes!("../../data/digits.csv.gz");
        let text = csv::gunzip(DIGITS)?;
        csv::parse_labelled(&text, 64, 10, 16.0)
    }

    /// Parses comma-separated rows of `dim` features followed by a label in `0..classes`, dividing
    /// every feature by `scale`.
    ///
    /// # Errors
    /// [`Error::Format`] naming the line of a row with the wrong field count, a field that is not a
    /// number, or a label out of range.
    pub fn from_csv(text: &str, dim: usize, classes: usize, scale: f32) -> Result<Dataset> {
        csv::parse_labelled(text, dim, classes, scale)
    }

    /// Parses gzip-compressed CSV bytes as [`from_csv`](Self::from_csv) does.
    ///
    /// # Errors
    /// [`Error::Format`] for bytes that are not gzip or not valid UTF-8 text, and as for `from_csv`.
    pub fn from_csv_gz(bytes: &[u8], dim: usize, classes: usize, scale: f32) -> Result<Dataset> {
        csv::parse_labelled(&csv::gunzip(bytes)?, dim, classes, scale)
    }

    /// A data set from the bytes of an IDX image file (`[n, rows, cols]` unsigned bytes) and an IDX
    /// label file (`[n]` digits), pixels scaled to `0..=1`.
    ///
    /// # Errors
    /// [`Error::Format`] for a corrupt or truncated file, counts that differ, or a label above 9.
    pub fn from_idx(images: &[u8], labels: &[u8]) -> Result<Dataset> {
        let unnamed = std::path::Path::new("(bytes)");
        idx::images_and_labels(images, unnamed, labels, unnamed)
    }

    /// The MNIST training and test sets from the IDX files in `dir` (`train-images-idx3-ubyte`,
    /// `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, optionally
    /// gzip-compressed with a `.gz` suffix), pixels scaled to `0..=1`.
    ///
    /// # Errors
    /// [`Error::Io`] for a missing file, [`Error::Format`] for a corrupt or truncated one.
    pub fn mnist(dir: impl AsRef<std::path::Path>) -> Result<(Dataset, Dataset)> {
        idx::read_mnist(dir.as_ref())
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Features per example.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// All features, row-major.
    pub fn features(&self) -> &[f32] {
        &self.features
    }

    /// All labels.
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// Features of example `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.features[i * self.dim..(i + 1) * self.dim]
    }

    /// The examples at `indices`, in that order.
    fn subset(&self, indices: &[usize]) -> Dataset {
        let mut features = Vec::with_capacity(indices.len() * self.dim);
        for &i in indices {
            features.extend_from_slice(self.row(i));
        }
        Dataset {
            features,
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
            dim: self.dim,
            classes: self.classes,
        }
    }

    /// Splits into (train, test) with `test_fraction` of the examples, drawn by a seeded shuffle:
    /// the same seed gives the same split.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `0 < test_fraction < 1` and both parts get an example.
    pub fn split(&self, test_fraction: f64, seed: u64) -> Result<(Dataset, Dataset)> {
        let n = self.len();
        let test = (n as f64 * test_fraction).round() as usize;
        if !(test_fraction > 0.0 && test_fraction < 1.0) || test == 0 || test >= n {
            return Err(Error::InvalidShape {
                op: "Dataset::split",
                shape: vec![n],
                reason: format!(
                    "a test fraction of {test_fraction} of {n} examples leaves one part empty; use a fraction in (0, 1)"
                ),
            });
        }
        let order = shuffled(n, seed);
        Ok((self.subset(&order[test..]), self.subset(&order[..test])))
    }
}

/// `0..n` in a seeded random order (Fisher-Yates).
pub(crate) fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = Rng::new(seed);
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}
