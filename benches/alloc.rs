//! Create-and-drop of temporaries: ndscope's pool and workspace modes (bump and planned) against
//! plain `Vec<f32>`.
//!
//! Every variant writes the same values into its memory (`vec![1.0; n]` against `ones(&[n])`), so the
//! difference is what allocation costs. Run with `cargo bench --bench alloc -- --noplot`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ndscope::{Device, Result, Workspace, root};

const SIZES: [(&str, usize); 2] = [("1KiB", 256), ("4MiB", 1 << 20)];

fn alloc(c: &mut Criterion) {
    let mut group = c.benchmark_group("create_and_drop");
    for (label, n) in SIZES {
        group.throughput(Throughput::Bytes((n * 4) as u64));
        group.bench_function(BenchmarkId::new("vec", label), |b| {
            b.iter(|| black_box(vec![1.0f32; black_box(n)]));
        });
        root(Device::Cpu, |s| -> Result<()> {
            group.bench_function(BenchmarkId::new("scope_pool", label), |b| {
                b.iter(|| black_box(s.ones(&[black_box(n)]).unwrap()));
            });
            group.bench_function(BenchmarkId::new("child_scope_pool", label), |b| {
                // Opening and closing a scope per temporary, as a batch loop does.
                b.iter(|| {
                    s.scope(|c| black_box(c.ones(&[black_box(n)]).map(drop)))
                        .unwrap()
                });
            });
            for (mode, mut ws) in [
                ("workspace_cycle", Workspace::new("bench")),
                ("planned_cycle", Workspace::planned("bench")),
            ] {
                group.bench_function(BenchmarkId::new(mode, label), |b| {
                    b.iter(|| {
                        s.workspace(&mut ws, |w| black_box(w.ones(&[black_box(n)]).map(drop)))
                            .unwrap()
                    });
                });
            }
            Ok(())
        })
        .unwrap();
    }
    group.finish();

    // A batch of ten temporaries per cycle, the shape of a forward pass.
    let mut group = c.benchmark_group("ten_temporaries");
    let n = 256;
    group.bench_function("vec", |b| {
        b.iter(|| {
            let v: [Vec<f32>; 10] = std::array::from_fn(|_| vec![1.0f32; black_box(n)]);
            black_box(v)
        })
    });
    root(Device::Cpu, |s| -> Result<()> {
        group.bench_function("child_scope_pool", |b| {
            b.iter(|| {
                s.scope(|c| -> Result<()> {
                    let kept: [_; 10] = std::array::from_fn(|_| c.ones(&[black_box(n)]));
                    for t in kept {
                        black_box(t?);
                    }
                    Ok(())
                })
                .unwrap()
            })
        });
        // Bump against planned: the cost of an allocation that bumps a pointer against one that
        // checks the recorded sequence and looks its offset up.
        for (mode, mut ws) in [
            ("workspace_cycle", Workspace::new("bench")),
            ("planned_cycle", Workspace::planned("bench")),
        ] {
            group.bench_function(mode, |b| {
                b.iter(|| {
                    s.workspace(&mut ws, |w| -> Result<()> {
                        let kept: [_; 10] = std::array::from_fn(|_| w.ones(&[black_box(n)]));
                        for t in kept {
                            black_box(t?);
                        }
                        Ok(())
                    })
                    .unwrap()
                })
            });
        }
        Ok(())
    })
    .unwrap();
    group.finish();
}

criterion_group!(benches, alloc);
criterion_main!(benches);
