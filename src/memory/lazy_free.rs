//! Host mappings given back to the kernel lazily (Linux's `MADV_FREE`) and kept for the next request
//! they can serve.
//!
//! A pool keeps at most its cache limit of idle bytes (an eighth of the machine's memory); what it
//! trims past that goes back to the system. Unmapped, a block's pages are gone: the next request of
//! its size maps fresh ones, and the kernel faults in and zeroes every page again. The gradients of a
//! 1B-parameter model in `f32` (4.9 GB) are freed at the end of every training pass and taken again
//! in the next: a third of the pass went to those faults. Here a mapping past the limit is marked
//! free instead: its pages stay mapped until the kernel wants memory, which it takes from such pages
//! before it swaps or kills anything, so this store never makes a program run out of memory. A
//! request served from it before the kernel took its pages costs no faults; pages the kernel took
//! fault in as zero pages, as a fresh mapping's would. Either way every byte is initialised.
//!
//! The store is process-wide (pools of every tree feed it), bounded by a quarter of the machine's
//! memory, oldest mapping unmapped first. Only Linux has these semantics (`MADV_FREE` elsewhere may
//! discard pages without saying so, or not exist); on other systems nothing is kept.

use std::ptr::NonNull;

/// Smaller mappings are unmapped at once: faulting a few mebibytes in again costs little beside the
/// work done in them, and the store stays a few large mappings (the blocks whose faults showed were
/// hundreds of megabytes: gradients, embedding gradients, logits).
#[cfg(target_os = "linux")]
const KEEP_MIN: usize = 4 << 20;

/// The mappings kept, oldest first, and the most bytes they may hold.
#[cfg(target_os = "linux")]
struct Store {
    /// (address, requested length) of each kept mapping.
    mappings: Vec<(usize, usize)>,
    bytes: usize,
    bound: usize,
}

#[cfg(target_os = "linux")]
impl Store {
    const fn new(bound: usize) -> Store {
        Store {
            mappings: Vec::new(),
            bytes: 0,
            bound,
        }
    }

    /// A kept mapping of at least `bytes`, the smallest there is, cut to `bytes` (its pages past
    /// them unmapped). One more than twice as long is left for a request of its own size: cutting
    /// it for a small one would map the large one afresh next time.
    fn reuse(&mut self, bytes: usize) -> Option<NonNull<u8>> {
        let (index, &(addr, len)) = self
            .mappings
            .iter()
            .enumerate()
            .filter(|&(_, &(_, len))| len >= bytes && len / 2 <= bytes)
            .min_by_key(|&(_, &(_, len))| len)?;
        self.mappings.remove(index);
        self.bytes -= len;
        let page = page_size();
        let (used, whole) = (bytes.div_ceil(page) * page, len.div_ceil(page) * page);
        if whole > used {
            // SAFETY: the pages past `used` belong to this kept mapping, which nothing uses.
            unsafe { unmap(addr + used, whole - used) };
        }
        NonNull::new(addr as *mut u8)
    }

    /// Marks the `bytes` mapped at `ptr` free and keeps them, unmapping the oldest kept mappings if
    /// the store would pass its bound; `false`, changing nothing, when `bytes` is under
    /// [`KEEP_MIN`] or alone passes the bound, or when the kernel refuses the advice (the caller
    /// then unmaps them).
    ///
    /// # Safety
    /// `ptr` is the start of an anonymous private mapping of `bytes` that nothing uses from now on.
    unsafe fn keep(&mut self, ptr: NonNull<u8>, bytes: usize) -> bool {
        if !(KEEP_MIN..=self.bound).contains(&bytes) {
            return false;
        }
        // SAFETY: the range is one whole mapping of the caller's, unused from now: its contents may
        // be discarded.
        if unsafe { libc::madvise(ptr.as_ptr().cast(), bytes, libc::MADV_FREE) } != 0 {
            return false;
        }
        while self.bytes + bytes > self.bound && !self.mappings.is_empty() {
            let (addr, len) = self.mappings.remove(0);
            self.bytes -= len;
            // SAFETY: a kept mapping, which nothing uses; it has left the books.
            unsafe { unmap(addr, len) };
        }
        self.mappings.push((ptr.addr().get(), bytes));
        self.bytes += bytes;
        true
    }

    /// Unmaps every kept mapping; returns their bytes.
    fn release(&mut self) -> usize {
        for (addr, len) in self.mappings.drain(..) {
            // SAFETY: a kept mapping, which nothing uses; it has left the books.
            unsafe { unmap(addr, len) };
        }
        std::mem::take(&mut self.bytes)
    }
}

#[cfg(target_os = "linux")]
fn page_size() -> usize {
    // SAFETY: `sysconf` reads a constant of the system.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

/// Unmaps `bytes` at `addr`.
///
/// # Safety
/// The range is pages of one of the store's mappings that nothing uses.
#[cfg(target_os = "linux")]
unsafe fn unmap(addr: usize, bytes: usize) {
    // SAFETY: forwarded from the caller; `munmap` cannot fail on pages of a mapping.
    unsafe { libc::munmap(addr as *mut libc::c_void, bytes) };
}

/// The process's store, bounded by a quarter of the machine's memory. Nothing that can panic runs
/// while its books disagree with the mappings, so a poisoned lock still holds true books.
#[cfg(target_os = "linux")]
fn store() -> std::sync::MutexGuard<'static, Store> {
    use std::sync::{Mutex, OnceLock, PoisonError};
    static STORE: OnceLock<Mutex<Store>> = OnceLock::new();
    STORE
        .get_or_init(|| {
            let bound = crate::memory::reclaim::physical_memory().map_or(1 << 30, |m| m / 4);
            Mutex::new(Store::new(bound))
        })
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// A lazily freed mapping of at least `bytes` (and at most twice that), cut to `bytes`, if one is
/// kept: its contents are whatever its last user left, or zeros where the kernel took its pages.
pub(crate) fn reuse(bytes: usize) -> Option<NonNull<u8>> {
    #[cfg(target_os = "linux")]
    return store().reuse(bytes);
    #[cfg(not(target_os = "linux"))]
    {
        let _ = bytes;
        None
    }
}

/// Keeps the mapping of `bytes` at `ptr`, marked free for the kernel; `false` when it is not kept
/// (the caller unmaps it).
///
/// # Safety
/// `ptr` is the start of an anonymous private mapping of `bytes` (from `mmap`) that nothing uses
/// from now on.
pub(crate) unsafe fn keep(ptr: NonNull<u8>, bytes: usize) -> bool {
    #[cfg(target_os = "linux")]
    // SAFETY: forwarded from the caller.
    return unsafe { store().keep(ptr, bytes) };
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, bytes);
        false
    }
}

/// Unmaps every kept mapping (when the kernel refused a new one); returns their bytes.
pub(crate) fn release() -> usize {
    #[cfg(target_os = "linux")]
    return store().release();
    #[cfg(not(target_os = "linux"))]
    0
}

/// Bytes of host memory the process's pools gave back to the kernel lazily (Linux's `MADV_FREE`) and
/// keep for later requests of their size: mapped and counted in the process's resident size until
/// the kernel takes their pages, which it does, before swapping or killing anything, when it needs
/// memory. A pool gives such memory back past its cache limit
/// ([`Scope::set_cache_limit`](crate::Scope::set_cache_limit)), and when its tree ends. At most a
/// quarter of the machine's memory; always 0 on systems other than Linux.
///
/// ```
/// use ndscope::{Device, lazily_freed_host_bytes, release_lazily_freed_host_memory, root};
/// root(Device::Cpu, |s| {
///     s.set_cache_limit(Device::Cpu, Some(0));
///     drop(s.zeros(&[8 << 20])?); // a 32 MiB segment, over the limit once the tensor drops
///     Ok::<_, ndscope::Error>(())
/// })?;
/// if cfg!(target_os = "linux") {
///     assert!(lazily_freed_host_bytes() >= 32 << 20);
/// }
/// release_lazily_freed_host_memory(); // unmapped: the resident size falls now
/// assert_eq!(lazily_freed_host_bytes(), 0);
/// # Ok::<(), ndscope::Error>(())
/// ```
pub fn lazily_freed_host_bytes() -> usize {
    #[cfg(target_os = "linux")]
    return store().bytes;
    #[cfg(not(target_os = "linux"))]
    0
}

/// Unmaps the host memory counted by [`lazily_freed_host_bytes`] now, rather than when the kernel
/// wants it: for a program about to measure its resident size, or to hand memory to others at once.
/// Returns the bytes unmapped. Later requests then map fresh zero pages.
pub fn release_lazily_freed_host_memory() -> usize {
    release()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// A fresh anonymous mapping of `bytes`, filled with `fill`.
    fn mapping(bytes: usize, fill: u8) -> NonNull<u8> {
        let ptr = crate::memory::raw::map(bytes).expect("a mapping");
        // SAFETY: the mapping is `bytes` long and ours alone.
        unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), bytes) }.fill(fill);
        ptr
    }

    #[test]
    fn a_kept_mapping_serves_the_next_request_it_fits_with_its_bytes_initialised() {
        let mut store = Store::new(64 << 20);
        let (small, large) = ((5 << 20) + 100, (11 << 20) + 4096 * 3);
        let (a, b) = (mapping(small, 1), mapping(large, 2));
        // SAFETY: both are whole mappings of ours, unused from here but through the store.
        assert!(unsafe { store.keep(a, small) && store.keep(b, large) });
        assert_eq!(store.bytes, small + large);
        // The smallest that fits serves, cut to size.
        let request = (6 << 20) + 1;
        let got = store.reuse(request).expect("the larger mapping fits");
        assert_eq!(got, b);
        assert_eq!(store.bytes, small);
        // SAFETY: `reuse` handed out `request` bytes of `b`, ours alone.
        let block = unsafe { std::slice::from_raw_parts_mut(got.as_ptr(), request) };
        // The last contents, or zeros where the kernel took a page: initialised either way.
        assert!(block.iter().all(|&x| x == 2 || x == 0));
        block.fill(3);
        assert!(store.reuse(small + 1).is_none(), "nothing left that fits");
        // SAFETY: the cut mapping is `request` bytes long, unused from here.
        assert!(unsafe { store.keep(got, request) });
        assert_eq!(store.release(), small + request);
        assert!(store.reuse(1).is_none(), "released mappings are gone");
    }

    #[test]
    fn the_bound_unmaps_the_oldest_and_small_or_oversized_mappings_are_not_kept() {
        let mut store = Store::new(16 << 20);
        let (a, b, c) = (
            mapping(8 << 20, 0),
            mapping(6 << 20, 0),
            mapping(4 << 20, 0),
        );
        // SAFETY: whole mappings of ours, unused from here but through the store.
        unsafe {
            assert!(store.keep(a, 8 << 20) && store.keep(b, 6 << 20));
            // 8 + 6 + 4 MiB pass 16: the oldest (`a`) goes.
            assert!(store.keep(c, 4 << 20));
        }
        assert_eq!(store.bytes, 10 << 20);
        assert_eq!(store.reuse(6 << 20), Some(b));
        let (big, small) = (mapping(17 << 20, 0), mapping(KEEP_MIN - 4096, 0));
        // SAFETY: whole mappings of ours; refused, so still ours to unmap.
        unsafe {
            assert!(!store.keep(big, 17 << 20), "past the bound");
            assert!(
                !store.keep(small, KEEP_MIN - 4096),
                "under the smallest kept"
            );
        }
        // SAFETY: `big`, `small` and `b` are whole mappings nothing uses.
        unsafe {
            unmap(big.addr().get(), 17 << 20);
            unmap(small.addr().get(), KEEP_MIN - 4096);
            unmap(b.addr().get(), 6 << 20);
        }
        assert_eq!(store.release(), 4 << 20);
    }
}
