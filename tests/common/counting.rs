//! A global allocator that counts the allocations shaped like tensor storage: the pool takes host
//! block memory with `alloc_zeroed` at 64-byte alignment (blocks from 1 MiB are mapped, and counted
//! by the scope's `system_allocations`). A test binary installs it with
//! `#[global_allocator] static GLOBAL: Counting = Counting;` and reads [`STORAGE`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The allocator.
pub struct Counting;

/// Storage-shaped allocations so far, process-wide.
pub static STORAGE: AtomicU64 = AtomicU64::new(0);

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
