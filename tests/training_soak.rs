//! A long training run on the bundled digits must show flat memory: the model scope's live bytes
//! constant, the tree's peak reached in the first epochs and never raised, no step allocating in the
//! model scope, and — counted by a global allocator — no system allocation for tensor storage after
//! warm-up, in pool mode and in workspace mode.
//!
//! One test per binary: the allocator's counters are process-wide.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use ndscope::data::{Batch, Dataset, Loader};
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{Device, Error, Result, Scope, Tape, Workspace, root};

/// Counts every allocation, and separately the ones shaped like tensor storage: the pool takes block
/// memory with `alloc_zeroed` at 64-byte alignment (src/memory/pool.rs), which nothing else in the
/// process (std, rayon, gemm's packing buffers) asks for.
struct Counting;

static ALL: AtomicU64 = AtomicU64::new(0);
static STORAGE: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALL.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALL.fetch_add(1, Ordering::Relaxed);
        if layout.align() == 64 {
            STORAGE.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALL.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const EPOCHS: u64 = 12;
const WARMUP_EPOCHS: u64 = 2;

/// One step in the batch scope `b`; checks that the model scope allocated nothing during it.
fn step<'m: 'b, 'b>(
    m: &Scope<'m>,
    b: &'b Scope<'b>,
    model: &mut nn::Sequential<'m>,
    opt: &mut Adam<'m>,
    batch: &Batch,
) -> Result<f32> {
    let model_allocs = m.stats().allocations;
    let x = b.from_slice(batch.features(), &batch.feature_shape())?;
    let y = b.from_slice(batch.labels(), &[batch.rows()])?;
    let tape = Tape::new(b);
    let loss = model
        .forward(&tape.constant(&x), Mode::Train)?
        .cross_entropy(&y)?;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    // The batch scope's events join the model's counters only when it closes: an increase now would
    // be an allocation made in the model scope itself.
    assert_eq!(
        m.stats().allocations,
        model_allocs,
        "a training step allocated in the model scope"
    );
    loss.value().to_scalar::<f32>()
}

/// Numbers taken at the end of an epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Snapshot {
    model_live_bytes: usize,
    model_live_tensors: usize,
    peak_bytes: usize,
    system_allocations: u64,
    storage_allocations: u64,
}

fn soak(workspace: bool) -> Result<(Vec<Snapshot>, f64, Vec<u64>)> {
    let (train, test) = Dataset::digits()?.split(0.2, 5)?;
    let loader = Loader::new(&train, 64)?.shuffle(5);
    let mut ws = Workspace::new("batch");
    root(Device::Cpu, |s| {
        s.set_seed(5);
        s.named_scope("model", |m| {
            let mut model = nn::mlp(m, &[64, 64, 10], Activation::Relu, Init::KaimingUniform)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(3e-3, 1e-4))?;
            let mut snapshots = Vec::new();
            let mut process_allocs_per_epoch = Vec::new();
            for epoch in 0..EPOCHS {
                let all_before = ALL.load(Ordering::Relaxed);
                // Batches are prepared on this thread: the background loader's thread start allocates.
                loader.for_each_batch(epoch, false, |batch| {
                    if workspace {
                        m.workspace(&mut ws, |b| step(m, b, &mut model, &mut opt, batch))?;
                    } else {
                        m.named_scope("batch", |b| step(m, b, &mut model, &mut opt, batch))?;
                    }
                    Ok(())
                })?;
                process_allocs_per_epoch.push(ALL.load(Ordering::Relaxed) - all_before);
                let st = m.stats();
                snapshots.push(Snapshot {
                    model_live_bytes: st.live_bytes,
                    model_live_tensors: st.live_tensors,
                    peak_bytes: st.peak_bytes,
                    system_allocations: st.system_allocations,
                    storage_allocations: STORAGE.load(Ordering::Relaxed),
                });
            }
            let accuracy = m.named_scope("eval", |e| {
                let x = e.from_slice(test.features(), &[test.len(), test.dim()])?;
                let tape = Tape::no_grad(e);
                let predicted = model
                    .forward(&tape.constant(&x), Mode::Eval)?
                    .value()
                    .argmax(-1, false)?
                    .to_vec::<i64>()?;
                let correct = predicted
                    .iter()
                    .zip(test.labels())
                    .filter(|(p, l)| p == l)
                    .count();
                Ok::<_, Error>(correct as f64 / test.len() as f64)
            })?;
            Ok((snapshots, accuracy, process_allocs_per_epoch))
        })
    })
}

fn assert_flat(mode: &str, snapshots: &[Snapshot], accuracy: f64, process: &[u64]) {
    let warm = snapshots[WARMUP_EPOCHS as usize - 1];
    let last = *snapshots.last().unwrap();
    assert!(
        accuracy > 0.9,
        "{mode}: the run did not learn (accuracy {accuracy})"
    );
    for (epoch, s) in snapshots.iter().enumerate() {
        assert_eq!(
            s.model_live_bytes, snapshots[0].model_live_bytes,
            "{mode}: model live bytes changed in epoch {epoch}"
        );
        assert_eq!(
            s.model_live_tensors, snapshots[0].model_live_tensors,
            "{mode}: model tensors changed in epoch {epoch}"
        );
    }
    assert_eq!(
        last.peak_bytes, warm.peak_bytes,
        "{mode}: peak bytes grew after warm-up: {snapshots:#?}"
    );
    assert_eq!(
        last.system_allocations, warm.system_allocations,
        "{mode}: the pool went to the system after warm-up: {snapshots:#?}"
    );
    assert_eq!(
        last.storage_allocations, warm.storage_allocations,
        "{mode}: the global allocator saw tensor-storage allocations after warm-up: {snapshots:#?}"
    );
    // Other process allocations (the tape's records, gemm's packing buffers) do not grow with the run.
    let steady = &process[WARMUP_EPOCHS as usize..];
    let (lo, hi) = (*steady.iter().min().unwrap(), *steady.iter().max().unwrap());
    assert!(
        hi <= lo + lo / 4 + 64,
        "{mode}: process allocations per epoch drift: {process:?}"
    );
}

#[test]
fn a_long_run_keeps_memory_flat_in_pool_and_workspace_mode() {
    let (snapshots, accuracy, process) = soak(false).unwrap();
    assert_flat("pool", &snapshots, accuracy, &process);
    let (snapshots, accuracy, process) = soak(true).unwrap();
    assert_flat("workspace", &snapshots, accuracy, &process);
}
