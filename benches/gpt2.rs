//! GPT-2 small (124M parameters, Hugging Face's shape) on the CPU: loading its checkpoint, and the
//! forward and forward+backward passes (f32 and bf16 autocast) at 128 and 1,024 tokens (batch 1).
//! The checkpoint holds random weights of that shape, written once by this bench to
//! `target/gpt2-small-random/`
//! (transformers reads the same directory in `benches/gpt2_reference.py`, for its side of the
//! comparison). Run with
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo bench --bench gpt2 -- --noplot
//! ```

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ndscope::models::Gpt2;
use ndscope::{DType, Device, Result, root};

const DIR: &str = common::GPT2_SMALL;

fn gpt2(c: &mut Criterion) {
    common::warn_if_cpu_busy("gpt2 bench");
    common::ensure_gpt2_small().unwrap();
    let mut group = c.benchmark_group("gpt2_small");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(20));
    // The file stays in the page cache between samples, as it does for from_pretrained's timing.
    group.bench_function("load_f32", |bench| {
        bench.iter(|| {
            root(Device::Cpu, |s| {
                Gpt2::from_pretrained(s, DIR, DType::F32).map(|m| black_box(m.config().n_layer))
            })
            .unwrap()
        })
    });
    root(Device::Cpu, |m| -> Result<()> {
        let model = Gpt2::from_pretrained(m, DIR, DType::F32)?;
        for len in [128usize, 1024] {
            let ids: Vec<i64> = (0..len as i64).map(|i| (i * 7919) % 50257).collect();
            // f32, and bf16 autocast: products and attention in bf16 (f32 accumulation), norms and
            // the loss in f32.
            for (suffix, autocast) in [("", None), ("_bf16_autocast", Some(DType::BF16))] {
                group.bench_function(BenchmarkId::new(format!("forward{suffix}"), len), |bench| {
                    bench.iter(|| {
                        black_box(common::gpt2_pass(m, &model, &ids, autocast, false).unwrap())
                    })
                });
                let name = format!("forward_backward{suffix}");
                group.bench_function(BenchmarkId::new(name, len), |bench| {
                    bench.iter(|| {
                        black_box(common::gpt2_pass(m, &model, &ids, autocast, true).unwrap())
                    })
                });
            }
        }
        Ok(())
    })
    .unwrap();
    group.finish();
}

criterion_group!(benches, gpt2);
criterion_main!(benches);
