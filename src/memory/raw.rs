//! Raw memory of a device: the one place that decides which allocator serves a memory space. Host
//! memory comes from the system allocator, zeroed; GPU memory from the CUDA backend's stream-ordered
//! allocator.

use std::alloc::{self, Layout as AllocLayout};
use std::ptr::NonNull;

use crate::backend::cuda;
use crate::device::Device;
use crate::memory::lazy_free;

/// Whether `device` is being captured into a CUDA graph: memory taken from or given back to a pool
/// now would be baked into the graph's replays, so the scopes refuse the first and keep the second.
pub(crate) fn capturing(device: Device) -> bool {
    crate::backend::capturing(device)
}

/// Every block is aligned for the widest SIMD loads (and a cache line).
pub(crate) const ALIGN: usize = 64;

/// An allocator of raw memory for a [`Pool`](crate::memory::pool::Pool): the device's own
/// ([`DeviceMemory`]) or, in tests, a fake with a fixed capacity that can refuse on demand.
pub(crate) trait RawMemory {
    /// `bytes` (> 0) bytes; `None` when the allocator refuses.
    fn alloc(&mut self, bytes: usize) -> Option<NonNull<u8>>;

    /// Returns memory taken with [`alloc`](Self::alloc).
    ///
    /// # Safety
    /// `ptr` came from `self.alloc(bytes)` with this `bytes`, and nothing uses it afterwards (for a
    /// GPU: no work queued later on the device's stream reads it).
    unsafe fn free(&mut self, ptr: NonNull<u8>, bytes: usize);

    /// Says that `bytes` at `ptr` (inside memory from [`alloc`](Self::alloc)) were lent to one block
    /// (`lent`), or came back. Only a memory checker listens (the CUDA simulator, which then bounds
    /// each tensor's accesses by its own block and treats a lent block as never written); for every
    /// real allocator it does nothing.
    fn note_block(&mut self, _ptr: NonNull<u8>, _bytes: usize, _lent: bool) {}
}

/// A device's own allocator ([`alloc`] and [`free`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceMemory(pub(crate) Device);

impl RawMemory for DeviceMemory {
    fn alloc(&mut self, bytes: usize) -> Option<NonNull<u8>> {
        alloc(self.0, bytes)
    }

    unsafe fn free(&mut self, ptr: NonNull<u8>, bytes: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { free(self.0, ptr, bytes) }
    }

    fn note_block(&mut self, ptr: NonNull<u8>, bytes: usize, lent: bool) {
        if let Device::Cuda(ordinal) = self.0 {
            cuda::note_block(ordinal, ptr, bytes, lent);
        }
    }
}

/// Takes `bytes` (> 0) bytes of `device` memory; `None` when the allocator refuses. For a GPU the
/// pointer is a device address, never dereferenced on the host.
pub(crate) fn alloc(device: Device, bytes: usize) -> Option<NonNull<u8>> {
    match device {
        Device::Cpu => system_alloc(bytes),
        Device::Cuda(ordinal) => cuda::alloc(ordinal, bytes),
    }
}

/// Returns memory taken with [`alloc`].
///
/// # Safety
/// `ptr` came from `alloc(device, bytes)` with these arguments, and nothing uses it afterwards
/// (for a GPU: no work queued later on the device's stream reads it).
pub(crate) unsafe fn free(device: Device, ptr: NonNull<u8>, bytes: usize) {
    match device {
        // SAFETY: forwarded from the caller: `ptr` came from `system_alloc(bytes)`.
        Device::Cpu => unsafe { system_free(ptr, bytes) },
        // SAFETY: forwarded from the caller: `ptr` came from the device allocator with `bytes`.
        Device::Cuda(ordinal) => unsafe { cuda::free(ordinal, ptr, bytes) },
    }
}

/// Host allocations of at least this many bytes are mapped from the kernel directly: they come as
/// zero pages mapped on first touch, so a large block costs nothing until it is written, and it goes
/// back to the kernel whole when freed: lazily, kept for a later request while the kernel does not
/// need its pages ([`lazy_free`]).
const MAP_MIN: usize = 1 << 20;

/// Takes `capacity` initialised bytes from the system: zeroed when they are new, or a lazily freed
/// mapping's last contents (zeros where the kernel took its pages). Every byte of every block is
/// initialised, so kernels may view any block as a slice of plain numbers.
fn system_alloc(capacity: usize) -> Option<NonNull<u8>> {
    if capacity >= MAP_MIN {
        return lazy_free::reuse(capacity)
            .or_else(|| map(capacity))
            .or_else(|| (lazy_free::release() > 0).then(|| map(capacity)).flatten());
    }
    let layout = AllocLayout::from_size_align(capacity, ALIGN).ok()?;
    // SAFETY: `capacity > 0` for every caller (empty tensors never allocate), so the layout is valid
    // for `alloc_zeroed`.
    NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
}

/// Returns a block taken with [`system_alloc`].
///
/// # Safety
/// `ptr` came from `system_alloc(capacity)` with this `capacity`, and is not used afterwards.
unsafe fn system_free(ptr: NonNull<u8>, capacity: usize) {
    if capacity >= MAP_MIN {
        // SAFETY: forwarded from the caller: `ptr` came from `map(capacity)` (or a kept mapping cut to
        // `capacity`) and is not used afterwards; kept, or else unmapped.
        if !unsafe { lazy_free::keep(ptr, capacity) } {
            // SAFETY: as above, and not kept.
            unsafe { unmap(ptr, capacity) };
        }
        return;
    }
    // SAFETY: the caller guarantees `ptr` was allocated with exactly this layout.
    unsafe {
        alloc::dealloc(
            ptr.as_ptr(),
            AllocLayout::from_size_align_unchecked(capacity, ALIGN),
        )
    }
}

/// `bytes` of fresh zero pages (page-aligned, so aligned to [`ALIGN`]); `None` when the kernel
/// refuses (an address-space limit, or no memory to commit). On huge pages where
/// [`HUGE_PAGES_VARIABLE`] asks for them.
#[cfg(unix)]
pub(super) fn map(bytes: usize) -> Option<NonNull<u8>> {
    map_advised(bytes, huge_pages_asked())
}

/// [`map`], asking for transparent huge pages if `huge` (Linux only; advice a kernel may ignore).
#[cfg(unix)]
fn map_advised(bytes: usize, huge: bool) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no existing
    // memory; the result is checked before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    if huge && bytes >= HUGE_PAGE {
        // SAFETY: `ptr` starts the mapping of `bytes` just made, which nothing else uses yet; the
        // advice only changes which pages the kernel backs it with when it is first touched (a
        // kernel without transparent huge pages refuses it, and nothing changes).
        #[cfg(target_os = "linux")]
        unsafe {
            libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE)
        };
    }
    NonNull::new(ptr.cast())
}

/// The size of an x86-64 (and the usual aarch64) transparent huge page: smaller mappings cannot
/// hold one.
#[cfg(unix)]
const HUGE_PAGE: usize = 2 << 20;

/// The environment variable that asks for transparent huge pages under the host's large blocks
/// (`1`): a product that reads a weight in strips, a row's run at a time, touches a page per row
/// with 4 KiB pages and misses the TLB on most of them. Opt-in, as PyTorch's `THP_MEM_ALLOC_ENABLE`
/// is: on the 2-vCPU virtual machines measured, the first touch of huge pages was slow (loading
/// GPT-2 small took 1.1-1.5 s with 4 KiB pages and 2.9-5.5 s with huge pages), while decoding
/// from the loaded weights ran up to a fifth faster (BENCHMARKS.md, issue 35). Linux only: read
/// elsewhere, but no mapping is advised.
#[cfg(unix)]
const HUGE_PAGES_VARIABLE: &str = "NDSCOPE_HUGE_PAGES";

/// Whether [`HUGE_PAGES_VARIABLE`] is `1` (or `on`, `yes`, `true`; read once).
#[cfg(unix)]
fn huge_pages_asked() -> bool {
    static ASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| asks_for_huge_pages(std::env::var(HUGE_PAGES_VARIABLE).ok().as_deref()))
}

/// Whether a value of [`HUGE_PAGES_VARIABLE`] asks for huge pages.
#[cfg(unix)]
fn asks_for_huge_pages(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim(), "1" | "on" | "yes" | "true"))
}

/// Unmaps pages mapped by [`map`].
///
/// # Safety
/// `ptr` came from `map(bytes)` with this `bytes`, and is not used afterwards.
#[cfg(unix)]
unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: forwarded from the caller: the range is exactly one mapping of ours, unused from now.
    // It cannot fail for a range that `mmap` returned.
    unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
}

/// Zeroed memory from the global allocator, where the platform has no `mmap`.
#[cfg(not(unix))]
fn map(bytes: usize) -> Option<NonNull<u8>> {
    let layout = AllocLayout::from_size_align(bytes, ALIGN).ok()?;
    // SAFETY: `bytes >= MAP_MIN > 0`, so the layout is valid for `alloc_zeroed`.
    NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
}

/// Returns memory taken with [`map`].
///
/// # Safety
/// `ptr` came from `map(bytes)` with this `bytes`, and is not used afterwards.
#[cfg(not(unix))]
unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: the caller guarantees `ptr` was allocated with exactly this layout.
    unsafe {
        alloc::dealloc(
            ptr.as_ptr(),
            AllocLayout::from_size_align_unchecked(bytes, ALIGN),
        )
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The `VmFlags` line of the mapping that holds `ptr`, from `/proc/self/smaps`.
    fn vm_flags(ptr: NonNull<u8>) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let at = ptr.as_ptr() as usize;
        let holds = |line: &str| {
            let range = line.split_whitespace().next().unwrap_or("");
            let Some((start, end)) = range.split_once('-') else {
                return false;
            };
            match (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                (Ok(start), Ok(end)) => (start..end).contains(&at),
                _ => false,
            }
        };
        let mut lines = smaps.lines().skip_while(|l| !holds(l));
        assert!(lines.next().is_some(), "no mapping holds {ptr:?}");
        let flags = lines
            .find(|l| l.starts_with("VmFlags:"))
            .expect("a VmFlags line");
        flags.to_string()
    }

    #[test]
    fn huge_pages_are_asked_for_only_when_wanted_and_large_enough() {
        let has_hg = |flags: &str| flags.split_whitespace().any(|f| f == "hg");
        let bytes = 2 * HUGE_PAGE;
        for huge in [false, true] {
            let ptr = map_advised(bytes, huge).expect("a 4 MiB mapping");
            let flags = vm_flags(ptr);
            // SAFETY: `ptr` came from `map_advised(bytes, ..)`, which `map`'s unmapping accepts,
            // and nothing uses it afterwards.
            unsafe { unmap(ptr, bytes) };
            assert_eq!(has_hg(&flags), huge, "huge {huge}: {flags}");
        }
        // Too small to hold a huge page: no advice.
        let ptr = map_advised(HUGE_PAGE / 2, true).expect("a 1 MiB mapping");
        let flags = vm_flags(ptr);
        // SAFETY: as above.
        unsafe { unmap(ptr, HUGE_PAGE / 2) };
        assert!(!has_hg(&flags), "{flags}");
    }

    #[test]
    fn the_variable_asks_for_huge_pages_only_when_set_to_yes() {
        for yes in ["1", "on", "yes", "true", " 1 "] {
            assert!(asks_for_huge_pages(Some(yes)), "{yes:?}");
        }
        for no in [None, Some(""), Some("0"), Some("off"), Some("no")] {
            assert!(!asks_for_huge_pages(no), "{no:?}");
        }
    }
}
