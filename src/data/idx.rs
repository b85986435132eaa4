//! MNIST's IDX files: a big-endian header (`0, 0, type, rank`, then `rank` u32 sizes) and the data.

use std::path::Path;

use super::Dataset;
use super::csv::gunzip_bytes;
use crate::error::{Error, Result};

fn idx_error(file: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Format {
        format: "IDX",
        reason: format!("{}: {reason}", file.display()),
    }
}

/// An IDX array of unsigned bytes: its dimensions and data.
pub(super) struct IdxBytes {
    pub(super) dims: Vec<usize>,
    pub(super) data: Vec<u8>,
}

/// Parses an IDX file of unsigned bytes (type 0x08) of the expected rank.
pub(super) fn parse(bytes: &[u8], rank: usize, file: &Path) -> Result<IdxBytes> {
    if bytes.len() < 4 {
        return Err(idx_error(file, "shorter than the 4-byte magic number"));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(idx_error(
            file,
            "the magic number does not start with two zero bytes",
        ));
    }
    if bytes[2] != 0x08 {
        return Err(idx_error(
            file,
            format!(
                "element type 0x{:02x}; only unsigned bytes (0x08) are supported",
                bytes[2]
            ),
        ));
    }
    if bytes[3] as usize != rank {
        return Err(idx_error(
            file,
            format!("rank {}, expected {rank}", bytes[3]),
        ));
    }
    let header = 4 + 4 * rank;
    if bytes.len() < header {
        return Err(idx_error(file, "truncated inside the header"));
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let count = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| idx_error(file, format!("dimensions {dims:?} overflow")))?;
    let data = &bytes[header..];
    if data.len() != count {
        return Err(idx_error(
            file,
            format!(
                "dimensions {dims:?} need {count} bytes of data, the file has {}",
                data.len()
            ),
        ));
    }
    Ok(IdxBytes {
        dims,
        data: data.to_vec(),
    })
}

/// Reads `dir/name`, or `dir/name.gz` decompressed.
fn read(dir: &Path, name: &str) -> Result<(Vec<u8>, std::path::PathBuf)> {
    let plain = dir.join(name);
    match std::fs::read(&plain) {
        Ok(bytes) => Ok((bytes, plain)),
        Err(plain_err) => {
            let gz = dir.join(format!("{name}.gz"));
            match std::fs::read(&gz) {
                Ok(bytes) => Ok((gunzip_bytes(&bytes)?, gz)),
                Err(_) => Err(Error::Io {
                    path: plain.display().to_string(),
                    reason: format!("{plain_err} (nor is there a {name}.gz)"),
                }),
            }
        }
    }
}

/// Images and labels from a pair of IDX files, as a data set of `rows * cols` features in `0..=1`.
pub(super) fn images_and_labels(
    images: &[u8],
    images_file: &Path,
    labels: &[u8],
    labels_file: &Path,
) -> Result<Dataset> {
    let images = parse(images, 3, images_file)?;
    let labels = parse(labels, 1, labels_file)?;
    if images.dims[0] != labels.dims[0] {
        return Err(idx_error(
            labels_file,
            format!("{} labels for {} images", labels.dims[0], images.dims[0]),
        ));
    }
    let dim = images.dims[1] * images.dims[2];
    let features = images.data.iter().map(|&p| f32::from(p) / 255.0).collect();
    let labels: Vec<i64> = labels.data.iter().map(|&l| i64::from(l)).collect();
    if let Some(bad) = labels.iter().find(|&&l| l > 9) {
        return Err(idx_error(
            labels_file,
            format!("label {bad} is not a digit"),
        ));
    }
    Dataset::new(features, labels, dim, 10)
}

pub(super) fn read_mnist(dir: &Path) -> Result<(Dataset, Dataset)> {
    let load = |images: &str, labels: &str| -> Result<Dataset> {
        let (image_bytes, image_file) = read(dir, images)?;
        let (label_bytes, label_file) = read(dir, labels)?;
        images_and_labels(&image_bytes, &image_file, &label_bytes, &label_file)
    };
    Ok((
        load("train-images-idx3-ubyte", "train-labels-idx1-ubyte")?,
        load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?,
    ))
}
