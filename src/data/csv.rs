//! Labelled comma-separated rows, optionally gzip-compressed.

use std::io::Read;

use super::Dataset;
use crate::error::{Error, Result};

fn csv_error(line: usize, reason: impl std::fmt::Display) -> Error {
    Error::Format {
        format: "CSV",
        reason: format!("line {line}: {reason}"),
    }
}

fn gzip_error(e: std::io::Error) -> Error {
    Error::Format {
        format: "gzip",
        reason: e.to_string(),
    }
}

/// Decompresses gzip bytes.
pub(super) fn gunzip_bytes(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .map_err(gzip_error)?;
    Ok(out)
}

/// Decompresses gzip bytes into text.
pub(super) fn gunzip(bytes: &[u8]) -> Result<String> {
    String::from_utf8(gunzip_bytes(bytes)?).map_err(|e| Error::Format {
        format: "gzip",
        reason: format!("the decompressed data is not UTF-8 text: {e}"),
    })
}

/// Rows of `dim` numbers and a label; features are divided by `scale`.
pub(super) fn parse_labelled(
    text: &str,
    dim: usize,
    classes: usize,
    scale: f32,
) -> Result<Dataset> {
    let mut features = Vec::new();
    let mut labels = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = 0;
        for (k, field) in line.split(',').enumerate() {
            fields += 1;
            if k < dim {
                let v: f32 = field.trim().parse().map_err(|_| {
                    csv_error(
                        line_no,
                        format!("field {} is {field:?}, not a number", k + 1),
                    )
                })?;
                if !v.is_finite() {
                    return Err(csv_error(line_no, format!("field {} is not finite", k + 1)));
                }
                features.push(v / scale);
            } else if k == dim {
                let label: i64 = field.trim().parse().map_err(|_| {
                    csv_error(line_no, format!("the label is {field:?}, not an integer"))
                })?;
                if label < 0 || label as u64 >= classes as u64 {
                    return Err(csv_error(
                        line_no,
                        format!("label {label} is outside 0..{classes}"),
                    ));
                }
                labels.push(label);
            }
        }
        if fields != dim + 1 {
            return Err(csv_error(
                line_no,
                format!("{fields} fields, expected {dim} features and a label"),
            ));
        }
    }
    if labels.is_empty() {
        return Err(csv_error(0, "no rows"));
    }
    Dataset::new(features, labels, dim, classes)
}
