//! A transformer trained for many steps must keep memory flat, as the MLP does (tests/training_soak.rs):
//! the model scope's live bytes constant, no step allocating in the model scope, the tree's peak
//! reached during warm-up, and no system allocation for tensor storage after it — in pool mode and in
//! workspace mode. The model is examples/gpt.rs's, smaller.
//!
//! One test per binary: the allocator's counters are process-wide.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use ndscope::nn::{
    AttentionOptions, Embedding, Init, LayerNorm, Linear, Mode, Module, PositionalEmbedding,
    TransformerBlock,
};
use ndscope::optim::{Adam, AdamConfig, Optimizer, Schedule, WarmupCosine};
use ndscope::{Device, Result, Scope, Tape, Workspace, root};

/// Counts allocations shaped like tensor storage: the pool takes host block memory with
/// `alloc_zeroed` at 64-byte alignment (blocks from 1 MiB are mapped, and counted by the scope's
/// `system_allocations`).
struct Counting;

static STORAGE: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; the counter is an atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() == 64 {
            STORAGE.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

ndscope::model! {
    struct Gpt<'m> {
        tokens: Embedding<'m>,
        positions: PositionalEmbedding<'m>,
        blocks: Vec<TransformerBlock<'m>>,
        ln: LayerNorm<'m>,
        head: Linear<'m>,
    }
}

const ROUNDS: usize = 8;
const STEPS_PER_ROUND: u64 = 15;
const WARMUP_ROUNDS: usize = 2;
const VOCAB: usize = 12;
const LEN: usize = 8;
const BATCH: usize = 16;

/// A batch of sequences `a, a+1, a+2, ...` (mod the vocabulary): the next token is predictable.
fn batch_ids(step: u64) -> Vec<i64> {
    (0..BATCH * (LEN + 1))
        .map(|i| {
            let (row, col) = (i / (LEN + 1), i % (LEN + 1));
            ((row as u64 * 5 + step + col as u64) % VOCAB as u64) as i64
        })
        .collect()
}

fn step<'m: 'b, 'b>(
    m: &Scope<'m>,
    b: &'b Scope<'b>,
    model: &mut Gpt<'m>,
    opt: &mut Adam<'m>,
    step: u64,
) -> Result<f32> {
    let model_allocs = m.stats().allocations;
    let ids = b.from_slice(&batch_ids(step), &[BATCH, LEN + 1])?;
    let tape = Tape::new(b);
    let mut x = model
        .positions
        .forward(&model.tokens.forward(&tape, &ids.narrow(1, 0, LEN)?)?)?;
    for block in &model.blocks {
        x = block.forward(&x, Mode::Train)?;
    }
    let logits = model
        .head
        .forward(&model.ln.forward(&x, Mode::Train)?, Mode::Train)?;
    let next = ids.narrow(1, 1, LEN)?.contiguous()?.reshape(&[BATCH * LEN])?;
    let loss = logits
        .reshape(&[BATCH * LEN, VOCAB])?
        .cross_entropy(&next)?;
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

fn soak(workspace: bool) -> Result<(Vec<Snapshot>, Vec<f32>)> {
    let mut ws = Workspace::new("batch");
    root(Device::Cpu, |s| {
        s.set_seed(3);
        s.named_scope("model", |m| {
            let init = Init::Normal(0.02);
            let opts = AttentionOptions {
                causal: true,
                dropout: 0.1,
            };
            let mut model = Gpt {
                tokens: Embedding::new(m, VOCAB, 32, init)?,
                positions: PositionalEmbedding::new(m, LEN, 32, init)?,
                blocks: vec![
                    TransformerBlock::new(m, 32, 4, opts, init)?,
                    TransformerBlock::new(m, 32, 4, opts, init)?,
                ],
                ln: LayerNorm::new(m, 32)?,
                head: Linear::new(m, 32, VOCAB, init)?,
            };
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(3e-3, 1e-2))?;
            let total = ROUNDS as u64 * STEPS_PER_ROUND;
            let schedule = WarmupCosine::new(3e-3, 10, total)?;
            let (mut snapshots, mut losses) = (Vec::new(), Vec::new());
            for i in 0..total {
                opt.set_learning_rate(schedule.lr(i));
                let loss = if workspace {
                    m.workspace(&mut ws, |b| step(m, b, &mut model, &mut opt, i))?
                } else {
                    m.named_scope("batch", |b| step(m, b, &mut model, &mut opt, i))?
                };
                losses.push(loss);
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
    let (first, last) = (losses[..10].iter().sum::<f32>(), losses[losses.len() - 10..].iter().sum::<f32>());
    assert!(
        last < 0.5 * first,
        "{mode}: the model did not learn the sequences (loss {first} -> {last} over 10 steps)"
    );
}

#[test]
fn a_transformer_keeps_memory_flat_in_pool_and_workspace_mode() {
    let (snapshots, losses) = soak(false).unwrap();
    assert_flat("pool", &snapshots, &losses);
    let (snapshots, losses) = soak(true).unwrap();
    assert_flat("workspace", &snapshots, &losses);
}
