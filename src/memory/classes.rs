//! Small blocks: free lists by size class, the allocator's fast path.
//!
//! A request of at most [`SMALL_MAX`] bytes is rounded up to its class (64 bytes and up, four classes
//! per power of two, so a block wastes at most a quarter of its size) and each small block is its own
//! allocation from the device's allocator. A freed block goes on its class's list and the next request
//! of that class pops it: a push and a pop, no search. Larger requests go to the segments
//! ([`crate::memory::segments`]), where blocks of any size split and coalesce.

use std::ptr::NonNull;

/// The largest request served from the size classes (64 KiB); larger ones are carved from segments.
/// Small enough that a cache holding one idle block of every class is a megabyte, large enough that
/// the vectors, biases and small batches of a training step stay on the fast path.
pub(crate) const SMALL_MAX: usize = 64 << 10;

/// Sub-classes per power of two.
const STEPS: usize = 4;
/// Smallest class, as a power of two (64 bytes).
const MIN_SHIFT: u32 = 6;
/// Classes from 64 bytes to [`SMALL_MAX`].
const CLASSES: usize = 1 + (SMALL_MAX.trailing_zeros() - MIN_SHIFT) as usize * STEPS;

/// Size class of a request of `bytes` (0 < bytes <= `SMALL_MAX`): its index and capacity in bytes.
pub(crate) fn size_class(bytes: usize) -> (usize, usize) {
    debug_assert!(bytes > 0 && bytes <= SMALL_MAX);
    if bytes <= 1 << MIN_SHIFT {
        return (0, 1 << MIN_SHIFT);
    }
    // The power of two at or below `bytes - 1`: classes of this octave are (2^p, 2^(p+1)].
    let p = usize::BITS - 1 - (bytes - 1).leading_zeros();
    let base = 1usize << p;
    let step = base / STEPS;
    let sub = (bytes - base).div_ceil(step); // 1..=STEPS
    let index = 1 + (p - MIN_SHIFT) as usize * STEPS + (sub - 1);
    (index, base + sub * step)
}

/// The capacity of class `class`.
fn class_capacity(class: usize) -> usize {
    if class == 0 {
        return 1 << MIN_SHIFT;
    }
    let p = MIN_SHIFT as usize + (class - 1) / STEPS;
    let base = 1usize << p;
    base + ((class - 1) % STEPS + 1) * (base / STEPS)
}

/// Idle small blocks, one free list per class.
pub(crate) struct Classes {
    free: [Vec<NonNull<u8>>; CLASSES],
    cached_bytes: usize,
}

// SAFETY: the pointers are addresses of idle blocks the lists own (or device addresses); nothing in
// them is tied to a thread.
unsafe impl Send for Classes {}

impl Classes {
    pub(crate) fn new() -> Classes {
        Classes {
            free: std::array::from_fn(|_| Vec::new()),
            cached_bytes: 0,
        }
    }

    /// An idle block of `class`, if one is cached.
    #[inline]
    pub(crate) fn pop(&mut self, class: usize) -> Option<NonNull<u8>> {
        let ptr = self.free[class].pop()?;
        self.cached_bytes -= class_capacity(class);
        Some(ptr)
    }

    /// Caches an idle block of capacity `capacity` (a class capacity).
    #[inline]
    pub(crate) fn push(&mut self, ptr: NonNull<u8>, capacity: usize) {
        let (class, cap) = size_class(capacity);
        debug_assert_eq!(cap, capacity, "only class capacities are cached");
        self.free[class].push(ptr);
        self.cached_bytes += capacity;
    }

    /// Removes the largest idle block, with its capacity.
    pub(crate) fn pop_largest(&mut self) -> Option<(NonNull<u8>, usize)> {
        let class = self.free.iter().rposition(|list| !list.is_empty())?;
        self.pop(class).map(|ptr| (ptr, class_capacity(class)))
    }

    /// Bytes of idle blocks.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cached_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_requests_with_bounded_waste() {
        let mut last = (0, 0);
        for bytes in 1..=SMALL_MAX {
            let (class, cap) = size_class(bytes);
            assert!(cap >= bytes, "{bytes} -> {cap}");
            assert!(
                bytes <= 64 || cap * 4 <= bytes * 5 + 64 * 4,
                "waste too big: {bytes} -> {cap}"
            );
            assert!(class >= last.0 && cap >= last.1);
            assert_eq!(class_capacity(class), cap);
            assert_eq!(size_class(cap), (class, cap), "a capacity is its own class");
            last = (class, cap);
        }
        assert_eq!(
            last,
            (CLASSES - 1, SMALL_MAX),
            "the last class is SMALL_MAX"
        );
    }

    #[test]
    fn blocks_come_back_largest_first() {
        let mut classes = Classes::new();
        let fake = |addr: usize| NonNull::new(std::ptr::without_provenance_mut(addr)).unwrap();
        for (addr, cap) in [(64, 64), (4096, 4096), (1 << 20, SMALL_MAX)] {
            classes.push(fake(addr), cap);
        }
        assert_eq!(classes.cached_bytes(), 64 + 4096 + SMALL_MAX);
        assert_eq!(classes.pop_largest(), Some((fake(1 << 20), SMALL_MAX)));
        assert_eq!(classes.pop(size_class(4000).0), Some(fake(4096)));
        assert_eq!(classes.cached_bytes(), 64);
        assert_eq!(classes.pop_largest(), Some((fake(64), 64)));
        assert_eq!((classes.cached_bytes(), classes.pop_largest()), (0, None));
    }
}
