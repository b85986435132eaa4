//! A counting global allocator proves that a steady-state loop of scoped temporaries makes no system
//! allocation after warm-up: blocks, headers and scopes are all recycled.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ndscope::{Device, Result, Scope, Tensor, Workspace, root};

struct Counting;

thread_local! {
    // Counted per thread, so tests running in parallel do not disturb each other.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the counter is a const-initialised thread local, which
// never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
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

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

/// A step of scoped temporaries through every kind of op except matmul: creation, broadcasting
/// elementwise ops, reductions, softmax, indexing, joining and views.
fn step<'b>(b: &Scope<'b>, w: &Tensor<'b>) -> Result<f32> {
    let x = b.randn(&[16, 32])?;
    let h = x.mul(w)?.add_scalar(0.5)?.relu()?; // w is [32]: broadcast over rows
    let logits = h.sum(&[1], true)?.add(&h.narrow(1, 0, 10)?)?;
    let p = logits.log_softmax(-1)?;
    let labels = b.from_slice(&[1i64; 16], &[16, 1])?;
    let picked = p.gather(1, &labels)?;
    let rows = p.index_select(0, &b.arange(0i64, 16, 2)?)?;
    let both = Tensor::concat(&[&picked, &picked.neg()?], 1)?;
    let m = both
        .narrow(1, 0, 1)?
        .mean_all()?
        .add(&rows.max(&[0, 1], false)?)?;
    m.neg()?.to_scalar::<f32>()
}

/// A forward pass with matrix products.
fn mlp_step<'b>(b: &Scope<'b>, w1: &Tensor<'b>, w2: &Tensor<'b>) -> Result<f32> {
    let x = b.randn(&[16, 32])?;
    let logits = x.matmul(w1)?.relu()?.matmul(w2)?;
    logits.log_softmax(-1)?.mean_all()?.to_scalar::<f32>()
}

#[test]
fn steady_state_pool_loop_makes_no_system_allocation() {
    root(Device::Cpu, |model| -> Result<()> {
        let w = model.randn(&[32])?;
        for _ in 0..3 {
            model.named_scope("batch", |b| step(b, &w))?; // warm-up: fills the cache
        }
        let (before, stats_before) = (allocs(), model.stats());
        for _ in 0..200 {
            let loss = model.named_scope("batch", |b| step(b, &w))?;
            assert!(loss.is_finite());
        }
        assert_eq!(
            allocs() - before,
            0,
            "system allocations in 200 steady-state steps"
        );
        let stats = model.stats();
        assert_eq!(stats.system_allocations, stats_before.system_allocations);
        assert!(stats.reuses >= stats_before.reuses + 200 * 15);
        Ok(())
    })
    .unwrap();
}

#[test]
fn steady_state_workspace_loop_makes_no_system_allocation() {
    let mut ws = Workspace::new("batch");
    root(Device::Cpu, |model| -> Result<()> {
        let w = model.randn(&[32])?;
        for _ in 0..2 {
            model.workspace(&mut ws, |b| step(b, &w))?; // the first cycle learns the arena size
        }
        let before = allocs();
        for _ in 0..200 {
            model.workspace(&mut ws, |b| step(b, &w))?;
        }
        assert_eq!(
            allocs() - before,
            0,
            "system allocations in 200 workspace cycles"
        );
        assert_eq!(ws.last_cycle_spills(), 0);
        assert_eq!(ws.grows(), 1);
        Ok(())
    })
    .unwrap();
}

/// The `gemm` crate (0.19) allocates its packing buffers on every call and takes no caller buffer, so
/// a loop with matrix products is not allocation-free. Tensor storage still is: the scope counters
/// stay flat, and what the process allocates is bounded by gemm's own two buffers per product.
#[test]
fn matmul_loop_allocates_no_tensor_storage() {
    root(Device::Cpu, |model| -> Result<()> {
        let (w1, w2) = (model.randn(&[32, 64])?, model.randn(&[64, 10])?);
        for _ in 0..3 {
            model.scope(|b| mlp_step(b, &w1, &w2))?;
        }
        let (before, stats_before) = (allocs(), model.stats());
        for _ in 0..100 {
            model.scope(|b| mlp_step(b, &w1, &w2))?;
        }
        assert_eq!(
            model.stats().system_allocations,
            stats_before.system_allocations
        );
        let per_step = (allocs() - before) as f64 / 100.0;
        assert!(
            per_step <= 4.0,
            "{per_step} allocations per step: more than gemm's packing buffers"
        );
        Ok(())
    })
    .unwrap();
}
