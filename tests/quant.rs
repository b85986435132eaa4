//! ndscope's block formats against gguf-py's reference quantizers and dequantizers, bit for bit
//! (`tests/fixtures/quants.safetensors`, written by `tests/fixtures/make_quants.py`), the Q4_K, Q5_K
//! and Q6_K quantizers against ggml's C reference (`tests/fixtures/k_quants.safetensors`,
//! `make_k_quants.py`), and
//! the formats' own error bounds.

use ndscope::quant::{self, QuantType};
use safetensors::SafeTensors;

fn fixture() -> Vec<u8> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/quants.safetensors"
    );
    std::fs::read(path).expect("tests/fixtures/quants.safetensors")
}

fn tensor<'a>(file: &'a SafeTensors<'a>, name: &str) -> &'a [u8] {
    file.tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .data()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn ty(name: &str) -> QuantType {
    *QuantType::all()
        .iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("{name}"))
}

/// Asserts two f32 sequences have the same bits, naming the first difference.
fn assert_bits(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{what}: value {i}: ndscope {a:e}, gguf-py {b:e}"
        );
    }
}

#[test]
fn quantizers_write_the_bytes_gguf_py_writes() {
    let bytes = fixture();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    for name in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16"] {
        let t = ty(name);
        let input = floats(tensor(&file, &format!("{name}.input")));
        let expected = tensor(&file, &format!("{name}.quantized"));
        let ours = quant::quantize(t, &input).unwrap();
        assert_eq!(ours.len(), expected.len(), "{name}: byte count");
        if let Some(i) = ours.iter().zip(expected).position(|(a, b)| a != b) {
            let block = i / t.block_bytes();
            panic!(
                "{name}: byte {i} (block {block}, byte {} in it) is {:#04x}, gguf-py wrote {:#04x}; \
                 the block's input: {:?}",
                i % t.block_bytes(),
                ours[i],
                expected[i],
                &input[block * t.block_size()..(block + 1) * t.block_size()]
            );
        }
    }
}

#[test]
fn the_k_quantizers_write_the_bytes_ggml_writes() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/k_quants.safetensors"
    );
    let bytes = std::fs::read(path).expect("tests/fixtures/k_quants.safetensors");
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let input = floats(tensor(&file, "input"));
    for t in [QuantType::Q4_K, QuantType::Q5_K, QuantType::Q6_K] {
        let expected = tensor(&file, &format!("{}.quantized", t.name()));
        let ours = quant::quantize(t, &input).unwrap();
        assert_eq!(ours.len(), expected.len(), "{t}: byte count");
        let size = t.block_bytes();
        for (b, (o, e)) in ours.chunks(size).zip(expected.chunks(size)).enumerate() {
            assert!(
                o == e,
                "{t} block {b}: ours {o:?}, ggml's {e:?}; input {:?}",
                &input[b * 256..(b + 1) * 256]
            );
        }
    }
}

#[test]
fn dequantizers_give_the_values_gguf_py_gives() {
    let bytes = fixture();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    for t in QuantType::all().iter().filter(|t| **t != QuantType::F32) {
        let name = t.name();
        // The formats gguf-py quantizes decode its bytes; the others random blocks.
        let blocks = match file.tensor(&format!("{name}.quantized")) {
            Ok(quantized) => quantized.data(),
            Err(_) => tensor(&file, &format!("{name}.blocks")),
        };
        let expected = floats(tensor(&file, &format!("{name}.dequantized")));
        let mut ours = vec![0.0f32; expected.len()];
        quant::dequantize(*t, blocks, &mut ours).unwrap();
        assert_bits(name, &ours, &expected);
    }
}

/// A xorshift generator from `seed`: uniform draws in (0, 1), never 0 (a logarithm may take them).
fn uniform(seed: u64) -> impl FnMut() -> f64 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

#[test]
fn round_trips_stay_within_a_step_of_each_block() {
    let mut draw = uniform(0x2545_f491_4f6c_dd1d);
    let mut next = || draw() * 2.0 - 1.0;
    let x: Vec<f32> = (0..32 * 64)
        .map(|i| (next() * (1 + i % 7) as f64) as f32)
        .collect();
    // Steps: Q8_0 amax/127; Q4_0 and Q5_0 code the signed extreme as -8 (-16) steps of amax/8
    // (amax/16), so the far side, clipped at +7 (+15), may be a whole step off; the _1 formats
    // split [min, max] into 15 (31) steps.
    for t in [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
    ] {
        let mut back = vec![0.0f32; x.len()];
        quant::dequantize(t, &quant::quantize(t, &x).unwrap(), &mut back).unwrap();
        for (xb, bb) in x.chunks(32).zip(back.chunks(32)) {
            let lo = xb.iter().fold(f32::MAX, |m, v| m.min(*v)) as f64;
            let hi = xb.iter().fold(f32::MIN, |m, v| m.max(*v)) as f64;
            let amax = lo.abs().max(hi.abs());
            let step_error = match t {
                QuantType::Q8_0 => amax / 127.0 / 2.0,
                QuantType::Q4_0 => amax / 8.0,
                QuantType::Q5_0 => amax / 16.0,
                QuantType::Q4_1 => (hi - lo) / 15.0 / 2.0,
                _ => (hi - lo) / 31.0 / 2.0,
            };
            // f16 rounding of the scale (and minimum) moves a value by up to 2^-11 of the extreme.
            let bound = step_error * (1.0 + 1e-3) + amax * 2f64.powi(-10);
            for (a, b) in xb.iter().zip(bb) {
                let err = (*a as f64 - *b as f64).abs();
                assert!(
                    err <= bound,
                    "{t}: {a} came back as {b} (error {err:e}, bound {bound:e})"
                );
            }
        }
    }
}

#[test]
fn k_formats_keep_a_gaussian_within_their_bits() {
    // Normal draws (Box-Muller) in blocks whose scales differ by up to 100x: the relative RMS error
    // of a round trip falls with each bit (Q4_K's 4-bit levels, Q5_K's 5, Q6_K's 6), and stays
    // within a few per cent of the values' RMS.
    let mut uniform = uniform(0x9e37_79b9_7f4a_7c15);
    let x: Vec<f32> = (0..256 * 32)
        .map(|i| {
            let (u, v) = (uniform(), uniform());
            let normal = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
            (normal * 10f64.powi(i / 256 % 3)) as f32
        })
        .collect();
    let relative_rms = |t: QuantType| {
        let mut back = vec![0.0f32; x.len()];
        quant::dequantize(t, &quant::quantize(t, &x).unwrap(), &mut back).unwrap();
        let (mut err, mut sum) = (0.0f64, 0.0f64);
        for (xb, bb) in x.chunks(256).zip(back.chunks(256)) {
            let block_err: f64 = xb
                .iter()
                .zip(bb)
                .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
                .sum();
            let block_sum: f64 = xb.iter().map(|a| (*a as f64).powi(2)).sum();
            err += block_err / block_sum;
            sum += 1.0;
        }
        (err / sum).sqrt()
    };
    let errors = [QuantType::Q4_K, QuantType::Q5_K, QuantType::Q6_K].map(relative_rms);
    println!(
        "relative RMS error: Q4_K {:.4}, Q5_K {:.4}, Q6_K {:.4}",
        errors[0], errors[1], errors[2]
    );
    assert!(
        errors[0] < 0.12 && errors[1] < 0.06 && errors[2] < 0.03,
        "{errors:?}"
    );
    assert!(
        errors[1] < 0.6 * errors[0] && errors[2] < 0.6 * errors[1],
        "{errors:?}"
    );
}
