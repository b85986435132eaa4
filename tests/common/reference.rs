//! What transformers computed from the bundled tiny models (`data/*/reference.safetensors`).

use std::collections::BTreeMap;

use ndscope::weights::Weights;
use ndscope::{Device, Error, root};

/// The model directory the reference was computed from.
pub const DIR: &str = "data/gpt2-tiny";

/// Every reference tensor of the tiny GPT-2, as f64 values with its shape.
pub fn reference() -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    reference_of(DIR)
}

/// Every tensor of `dir/reference.safetensors` (a bundled model's transformers reference), as
/// f64 values with its shape.
pub fn reference_of(dir: &str) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let weights = Weights::open(format!("{dir}/reference.safetensors")).unwrap();
    root(Device::Cpu, |s| {
        let mut out = BTreeMap::new();
        for name in weights.names() {
            let (dtype, shape) = weights.info(name)?;
            let t = weights.tensor(s, name, shape, dtype)?;
            out.insert(name.to_string(), (shape.to_vec(), t.to_vec_f64()?));
        }
        Ok::<_, Error>(out)
    })
    .unwrap()
}

/// The largest difference between `got` and `want`, relative to `want`'s largest magnitude.
pub fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    got.iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()))
        / scale
}
