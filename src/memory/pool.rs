//! The caching pool: size-class free lists of one device's memory, shared by every scope of one tree
//! (a tree has one pool per device it has used).
//!
//! A freed block goes back on the free list of its size class and the next request of that class
//! takes it without calling the device's allocator. For a GPU that is what makes a steady training
//! step free of `cuMemAlloc`/`cuMemFree`: every kernel runs on the device's one stream, so a block
//! freed by a scope can be handed to the next op at once; the stream orders the new writes after the
//! old reads. Classes are 64 bytes and up, four per power of two,
//! so a block wastes at most a quarter of its size. `empty_cache` hands every cached block back to the
//! device's allocator.

use std::ptr::NonNull;

use crate::device::Device;
use crate::memory::raw;

/// Sub-classes per power of two.
const STEPS: usize = 4;
/// Smallest class, as a power of two (64 bytes).
const MIN_SHIFT: u32 = 6;

/// Size class of a request of `bytes` (> 0): its index and capacity in bytes.
pub(crate) fn size_class(bytes: usize) -> (usize, usize) {
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

/// Where a block's bytes came from.
pub(crate) enum Source {
    /// Taken from the pool's cache.
    Reused,
    /// Taken from the device's allocator (the system allocator for host memory).
    System,
}

pub(crate) struct Pool {
    device: Device,
    /// One free list per class, indexed by class; every class a request can map to has one.
    free: Vec<Vec<NonNull<u8>>>,
    cached_bytes: usize,
}

/// Number of classes: octaves 2^6..2^63, enough for any request up to `isize::MAX` bytes (the
/// largest allocation Rust allows).
const CLASSES: usize = 1 + (usize::BITS - 1 - MIN_SHIFT) as usize * STEPS;

impl Pool {
    /// An empty pool of `device` memory.
    pub(crate) fn new(device: Device) -> Pool {
        Pool {
            device,
            free: (0..CLASSES).map(|_| Vec::new()).collect(),
            cached_bytes: 0,
        }
    }
}

impl Pool {
    pub(crate) fn device(&self) -> Device {
        self.device
    }

    /// A block of at least `bytes` (> 0) bytes, with its capacity; `None` when the system refuses.
    pub(crate) fn take(&mut self, bytes: usize) -> Option<(NonNull<u8>, usize, Source)> {
        let (class, capacity) = size_class(bytes);
        if let Some(ptr) = self.free[class].pop() {
            self.cached_bytes -= capacity;
            return Some((ptr, capacity, Source::Reused));
        }
        raw::alloc(self.device, capacity).map(|ptr| (ptr, capacity, Source::System))
    }

    /// Caches a block for reuse.
    ///
    /// # Safety
    /// `ptr` came from this pool's device allocator with `capacity` (a class capacity) and nothing
    /// uses it any more (for a GPU: nothing queued after this point on the device's stream).
    pub(crate) unsafe fn give(&mut self, ptr: NonNull<u8>, capacity: usize) {
        let (class, cap) = size_class(capacity);
        debug_assert_eq!(cap, capacity, "only class capacities are cached");
        self.free[class].push(ptr);
        self.cached_bytes += capacity;
    }

    pub(crate) fn cached_bytes(&self) -> usize {
        self.cached_bytes
    }

    /// Hands cached blocks back to the system, largest classes first, until at most `max_cached`
    /// bytes stay cached; returns the bytes released.
    pub(crate) fn trim(&mut self, max_cached: usize) -> usize {
        let before = self.cached_bytes;
        for (class, list) in self.free.iter_mut().enumerate().rev() {
            if self.cached_bytes <= max_cached {
                break;
            }
            let capacity = class_capacity(class);
            while self.cached_bytes > max_cached
                && let Some(ptr) = list.pop()
            {
                // SAFETY: cached blocks came from `raw::alloc(device)` with their class capacity and
                // are referenced by nothing but this list.
                unsafe { raw::free(self.device, ptr, capacity) };
                self.cached_bytes -= capacity;
            }
        }
        before - self.cached_bytes
    }

    /// Hands every cached block back to the system; returns the bytes released.
    pub(crate) fn empty(&mut self) -> usize {
        let released = self.cached_bytes;
        for (class, list) in self
            .free
            .iter_mut()
            .enumerate()
            .filter(|(_, list)| !list.is_empty())
        {
            let capacity = class_capacity(class);
            for ptr in list.drain(..) {
                // SAFETY: cached blocks came from `raw::alloc(device)` with their class capacity and
                // are referenced by nothing but this list.
                unsafe { raw::free(self.device, ptr, capacity) };
            }
        }
        self.cached_bytes = 0;
        released
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.empty();
    }
}

fn class_capacity(class: usize) -> usize {
    if class == 0 {
        return 1 << MIN_SHIFT;
    }
    let p = MIN_SHIFT as usize + (class - 1) / STEPS;
    let base = 1usize << p;
    base + ((class - 1) % STEPS + 1) * (base / STEPS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_requests_with_bounded_waste() {
        let mut last = (0, 0);
        for bytes in 1..20_000usize {
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
    }

    #[test]
    fn trim_releases_largest_blocks_first() {
        let mut pool = Pool::new(Device::Cpu);
        let blocks: Vec<_> = [100usize, 1000, 10_000]
            .iter()
            .map(|&b| pool.take(b).unwrap())
            .collect();
        for &(p, cap, _) in &blocks {
            // SAFETY: each block came from this pool with its capacity and is not used again.
            unsafe { pool.give(p, cap) };
        }
        let (small, mid, large) = (blocks[0].1, blocks[1].1, blocks[2].1);
        assert_eq!(pool.trim(small + mid), large);
        assert_eq!(pool.cached_bytes(), small + mid);
        assert_eq!(pool.trim(small + mid), 0, "already within the limit");
        assert_eq!(pool.trim(0), small + mid);
    }

    #[test]
    fn the_largest_allowed_request_has_a_class() {
        let (class, cap) = size_class(isize::MAX as usize);
        assert!(class < CLASSES && cap > isize::MAX as usize);
        assert_eq!(class_capacity(CLASSES - 1), cap);
    }

    #[test]
    fn freed_blocks_are_reused() {
        let mut pool = Pool::new(Device::Cpu);
        let (p, cap, src) = pool.take(1000).unwrap();
        assert!(matches!(src, Source::System));
        // SAFETY: `p` came from this pool with capacity `cap` and is not used again.
        unsafe { pool.give(p, cap) };
        assert_eq!(pool.cached_bytes(), cap);
        let (q, _, src) = pool.take(1001).unwrap();
        assert!(matches!(src, Source::Reused));
        assert_eq!(p, q);
        // SAFETY: as above, for `q`.
        unsafe { pool.give(q, cap) };
        assert_eq!(pool.empty(), cap);
        assert_eq!(pool.cached_bytes(), 0);
    }
}
