//! Fuzzing on stable: random and mutated inputs for the file loaders (safetensors, GGUF, IDX, CSV, gzip) and
//! random shapes for the shape logic. Every input must give `Ok` or a typed `Err` — never a panic, an
//! abort or an attempt to allocate what the input merely claims. `PROPTEST_CASES=100000 cargo test
//! --release --test fuzz` runs a longer campaign.

mod common;

use common::idx;

use ndscope::data::Dataset;
use ndscope::nn::{self, Activation, Init};
use ndscope::{Device, Error, Tensor, checkpoint, root};
use proptest::prelude::*;

/// A valid file and ways to damage it: truncation, byte overwrites, insertions.
fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let len = valid.len();
    (
        0..=len,
        prop::collection::vec((0..len.max(1), any::<u8>()), 0..8),
        prop::collection::vec((0..=len, any::<u8>()), 0..3),
    )
        .prop_map(move |(cut, writes, inserts)| {
            let mut bytes = valid.clone();
            for (at, b) in writes {
                if at < bytes.len() {
                    bytes[at] = b;
                }
            }
            for (at, b) in inserts {
                bytes.insert(at.min(bytes.len()), b);
            }
            // Cut `len - cut` bytes off the end: a truncated file.
            let keep = bytes.len() - (len - cut);
            bytes.truncate(keep);
            bytes
        })
}

fn valid_checkpoint() -> Vec<u8> {
    root(Device::Cpu, |s| {
        checkpoint::to_bytes(&nn::mlp(
            s,
            &[3, 4, 2],
            Activation::Relu,
            Init::KaimingUniform,
        )?)
    })
    .unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// A typed error is fine; what matters is that the call returned.
fn returned<T>(r: Result<T, Error>) {
    if let Err(e) = r {
        assert!(!e.to_string().is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn checkpoints_survive_damage(bytes in mutated(valid_checkpoint())) {
        root(Device::Cpu, |s| {
            let mut model = nn::mlp(s, &[3, 4, 2], Activation::Relu, Init::KaimingUniform)?;
            returned(checkpoint::load_bytes(&mut model, &bytes));
            returned(checkpoint::read_bytes(s, &bytes));
            Ok::<_, Error>(())
        }).unwrap();
    }

    #[test]
    fn random_bytes_are_not_checkpoints(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        root(Device::Cpu, |s| {
            returned(checkpoint::read_bytes(s, &bytes));
            Ok::<_, Error>(())
        }).unwrap();
    }

    #[test]
    fn idx_files_survive_damage(
        images in mutated(idx(&[3, 2, 2], &[7; 12])),
        labels in mutated(idx(&[3], &[1, 2, 3])),
    ) {
        returned(Dataset::from_idx(&images, &labels));
    }

    #[test]
    fn idx_headers_that_claim_huge_sizes_are_refused(dims in prop::collection::vec(any::<u32>(), 0..5), rank in any::<u8>()) {
        let mut bytes = idx(&dims, &[1, 2, 3]);
        bytes[3] = rank;
        returned(Dataset::from_idx(&bytes, &idx(&[1], &[1])));
    }

    #[test]
    fn csv_text_survives_damage(bytes in mutated(b"0,1,2,1\n3,4,5,0\n6,7,8,2\n".to_vec())) {
        let text = String::from_utf8_lossy(&bytes);
        returned(Dataset::from_csv(&text, 3, 3, 16.0));
        returned(Dataset::from_csv_gz(&bytes, 3, 3, 16.0));
    }

    #[test]
    fn gzip_streams_survive_damage(bytes in mutated(gzip(b"0,1,2,1\n3,4,5,0\n"))) {
        returned(Dataset::from_csv_gz(&bytes, 3, 3, 16.0));
    }

    #[test]
    fn shape_logic_never_panics(
        a in prop::collection::vec(prop_oneof![0usize..4, Just(usize::MAX), Just(1 << 40)], 0..4),
        b in prop::collection::vec(prop_oneof![0usize..4, Just(usize::MAX)], 0..4),
        axis in -5isize..5,
        start in 0usize..5,
        len in 0usize..5,
    ) {
        root(Device::Cpu, |s| {
            let (x, y) = (s.zeros(&a), s.ones(&b));
            let (Ok(x), Ok(y)) = (x, y) else {
                return Ok(()); // huge shapes were refused with an error, which is the point
            };
            returned(x.add(&y));
            returned(x.matmul(&y));
            returned(x.reshape(&b));
            returned(x.broadcast_to(&b));
            returned(x.sum(&[axis], true));
            returned(x.max(&[axis], false));
            returned(x.softmax(axis));
            returned(x.argmax(axis, true));
            returned(x.narrow(axis, start, len));
            returned(x.transpose(axis, 0));
            returned(x.squeeze(axis));
            returned(x.unsqueeze(axis));
            returned(Tensor::concat(&[&x, &y], axis));
            returned(Tensor::stack(&[&x, &y], axis));
            returned(x.permute(&b));
            Ok::<_, Error>(())
        }).unwrap();
    }
}

/// A GGUF file made by llama.cpp (the tiny GPT-2 in Q4_0: metadata with its 1,000-token vocabulary,
/// 28 tensor descriptions, Q4_0 and F32 data), split where its tensor data starts.
fn gguf_parts() -> (Vec<u8>, Vec<u8>) {
    let bytes = std::fs::read("data/gguf/gpt2-tiny-Q4_0.gguf").unwrap();
    let parsed = ndscope::gguf::Gguf::parse(&bytes).unwrap();
    let data = parsed.tensors.iter().map(|t| t.bytes.start).min().unwrap();
    (bytes[..data].to_vec(), bytes[data..].to_vec())
}

proptest! {
    // PROPTEST_CASES (256 unless set; 64 under valgrind) cases.
    #![proptest_config(ProptestConfig::default())]

    /// Damage to a GGUF file's header (where every count, length, type and offset lies) gives a
    /// typed error or a file whose every tensor loads — never a panic or a huge allocation.
    #[test]
    fn gguf_files_survive_damage(header in mutated(gguf_parts().0)) {
        let mut bytes = header;
        bytes.extend_from_slice(&gguf_parts().1);
        returned(ndscope::gguf::Gguf::parse(&bytes).map(|_| ()));
        if let Ok(weights) = ndscope::weights::Weights::from_bytes(bytes) {
            root(Device::Cpu, |s| {
                let names: Vec<String> = weights.names().map(String::from).collect();
                for name in names {
                    let shape = weights.info(&name)?.1.to_vec();
                    returned(weights.tensor(s, &name, &shape, ndscope::DType::F32));
                }
                Ok::<_, Error>(())
            }).unwrap();
        }
    }
}
