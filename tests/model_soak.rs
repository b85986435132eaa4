//! The transformer of examples/gpt.rs and the CNN of examples/cnn.rs (smaller) trained for many
//! steps must keep memory flat, as the MLP does (tests/training_soak.rs): the model scope's live
//! bytes constant, no step allocating in the model scope (batch-norm statistics are updated in
//! place), the tree's peak reached during warm-up, and no system allocation for tensor storage after
//! it — in pool mode and in workspace mode.
//!
//! One test per binary: the allocator's counters are process-wide.

use std::sync::atomic::Ordering;

use ndscope::nn::{BatchNorm2d, Conv2d, Init, Linear, Mode, Module, Pool2d};
use ndscope::optim::{Adam, AdamConfig, Optimizer, Schedule, WarmupCosine};
use ndscope::{Conv2dOptions, Device, Result, Scope, Tape, Workspace, root};

mod common;
use common::counting::{Counting, STORAGE};
use common::gpt::Gpt;

#[global_allocator]
static GLOBAL: Counting = Counting;

const ROUNDS: usize = 6;
const STEPS_PER_ROUND: u64 = 8;
const WARMUP_ROUNDS: usize = 2;
/// Images per CNN batch.
const BATCH: usize = 8;

/// One step in the batch scope `b`; checks that the model scope allocated nothing during it.
fn gpt_step<'m: 'b, 'b>(
    m: &Scope<'m>,
    b: &'b Scope<'b>,
    model: &mut Gpt<'m>,
    opt: &mut Adam<'m>,
    step: u64,
) -> Result<f32> {
    let model_allocs = m.stats().allocations;
    let tape = Tape::new(b);
    let loss = model.loss(&tape, b, step)?;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    assert_eq!(
        m.stats().allocations,
        model_allocs,
        "a training step allocated in the model scope"
    );
    loss.value().to_scalar::<f32>()
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Snapshot {
    model_live_bytes: usize,
    peak_bytes: usize,
    system_allocations: u64,
    storage_allocations: u64,
}

/// Runs `total` steps of `step` (on the model scope and step index), with a snapshot every
/// `STEPS_PER_ROUND` steps; returns the snapshots and the losses.
fn rounds(
    m: &Scope<'_>,
    mut step: impl FnMut(u64) -> Result<f32>,
) -> Result<(Vec<Snapshot>, Vec<f32>)> {
    let (mut snapshots, mut losses) = (Vec::new(), Vec::new());
    for i in 0..ROUNDS as u64 * STEPS_PER_ROUND {
        losses.push(step(i)?);
        if (i + 1) % STEPS_PER_ROUND == 0 {
            let st = m.stats();
            snapshots.push(Snapshot {
                model_live_bytes: st.live_bytes,
                peak_bytes: st.peak_bytes,
                system_allocations: st.system_allocations,
                storage_allocations: STORAGE.load(Ordering::Relaxed),
            });
        }
    }
    Ok((snapshots, losses))
}

fn soak_gpt(workspace: bool) -> Result<(Vec<Snapshot>, Vec<f32>)> {
    let mut ws = Workspace::new("batch");
    root(Device::Cpu, |s| {
        s.set_seed(3);
        s.named_scope("model", |m| {
            let mut model = Gpt::new(m)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-2))?;
            let schedule = WarmupCosine::new(1e-2, 5, ROUNDS as u64 * STEPS_PER_ROUND)?;
            rounds(m, |i| {
                opt.set_learning_rate(schedule.lr(i));
                if workspace {
                    m.workspace(&mut ws, |b| gpt_step(m, b, &mut model, &mut opt, i))
                } else {
                    m.named_scope("batch", |b| gpt_step(m, b, &mut model, &mut opt, i))
                }
            })
        })
    })
}

ndscope::model! {
    struct Cnn<'m> {
        conv1: Conv2d<'m>,
        bn1: BatchNorm2d<'m>,
        conv2: Conv2d<'m>,
        bn2: BatchNorm2d<'m>,
        pool: Pool2d,
        head: Linear<'m>,
    }
}

/// A batch of 8x8 images whose class is the quadrant holding a bright pixel.
fn images(step: u64) -> (Vec<f32>, Vec<i64>) {
    let mut x = vec![0.0f32; BATCH * 64];
    let mut labels = Vec::new();
    for n in 0..BATCH {
        let k = (n as u64 * 7 + step * 3) % 64;
        x[n * 64 + k as usize] = 1.0;
        labels.push(((k / 8 >= 4) as i64) * 2 + (k % 8 >= 4) as i64);
    }
    (x, labels)
}

fn cnn_step<'m: 'b, 'b>(
    m: &Scope<'m>,
    b: &'b Scope<'b>,
    model: &mut Cnn<'m>,
    opt: &mut Adam<'m>,
    step: u64,
) -> Result<f32> {
    let model_allocs = m.stats().allocations;
    let (x, labels) = images(step);
    let x = b.from_slice(&x, &[BATCH, 1, 8, 8])?;
    let labels = b.from_slice(&labels, &[BATCH])?;
    let tape = Tape::new(b);
    let h = model.conv1.forward(&tape.constant(&x), Mode::Train)?;
    let h = model.bn1.forward(&h, Mode::Train)?.relu()?;
    let h = model
        .bn2
        .forward(&model.conv2.forward(&h, Mode::Train)?, Mode::Train)?
        .relu()?;
    let h = <Pool2d as Module<'m>>::forward(&model.pool, &h, Mode::Train)?;
    let logits = model
        .head
        .forward(&h.reshape(&[BATCH, 8 * 16])?, Mode::Train)?;
    let loss = logits.cross_entropy(&labels)?;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    assert_eq!(
        m.stats().allocations,
        model_allocs,
        "a training step allocated in the model scope"
    );
    loss.value().to_scalar::<f32>()
}

fn soak_cnn(workspace: bool) -> Result<(Vec<Snapshot>, Vec<f32>)> {
    let mut ws = Workspace::new("batch");
    root(Device::Cpu, |s| {
        s.set_seed(4);
        s.named_scope("model", |m| {
            let same = Conv2dOptions {
                padding: [1, 1],
                ..Conv2dOptions::default()
            };
            let mut model = Cnn {
                conv1: Conv2d::new(m, 1, 4, [3, 3], same, Init::KaimingUniform)?,
                bn1: BatchNorm2d::new(m, 4)?,
                conv2: Conv2d::new(m, 4, 8, [3, 3], same, Init::KaimingUniform)?,
                bn2: BatchNorm2d::new(m, 8)?,
                pool: Pool2d::max([2, 2]),
                head: Linear::new(m, 8 * 16, 4, Init::KaimingUniform)?,
            };
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-4))?;
            rounds(m, |i| {
                if workspace {
                    m.workspace(&mut ws, |b| cnn_step(m, b, &mut model, &mut opt, i))
                } else {
                    m.named_scope("batch", |b| cnn_step(m, b, &mut model, &mut opt, i))
                }
            })
        })
    })
}

fn assert_flat(mode: &str, snapshots: &[Snapshot], losses: &[f32]) {
    let warm = snapshots[WARMUP_ROUNDS - 1];
    for (round, s) in snapshots.iter().enumerate() {
        assert_eq!(
            s.model_live_bytes, snapshots[0].model_live_bytes,
            "{mode}: model live bytes changed in round {round}"
        );
        if round >= WARMUP_ROUNDS {
            assert_eq!(
                *s, warm,
                "{mode}: peak or system allocations moved after warm-up: {snapshots:#?}"
            );
        }
    }
    // A sanity check that the steps trained something; the test is about memory.
    let first = losses[..5].iter().sum::<f32>();
    let last = losses[losses.len() - 5..].iter().sum::<f32>();
    assert!(
        last < 0.9 * first,
        "{mode}: the model did not learn (loss {first} -> {last} over 5 steps)"
    );
}

#[test]
fn a_transformer_and_a_cnn_keep_memory_flat_in_pool_and_workspace_mode() {
    for workspace in [false, true] {
        let mode = if workspace { "workspace" } else { "pool" };
        let (snapshots, losses) = soak_gpt(workspace).unwrap();
        assert_flat(&format!("transformer, {mode}"), &snapshots, &losses);
        let (snapshots, losses) = soak_cnn(workspace).unwrap();
        assert_flat(&format!("cnn, {mode}"), &snapshots, &losses);
    }
}
