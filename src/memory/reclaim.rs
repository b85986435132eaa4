//! Idle memory across trees: every tree's pool registers here, so that a request the device's
//! allocator refuses makes the other trees on the device return their idle blocks before it fails.
//! Trees on one device never starve each other through their caches.
//!
//! A pool sits behind a lock of its own ([`PoolLock`]). Its tree takes the lock for every block
//! (uncontended: one compare-exchange to take it, one store to drop it); another thread takes it only
//! to empty the cache while one of its requests is being refused. No thread holds two pool locks at
//! once, so releases cannot deadlock.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use crate::device::Device;
use crate::memory::pool::{Pool, Taken};
use crate::memory::raw::{self, DeviceMemory};

/// The pool of one tree on one device, registered for releases by other trees.
pub(crate) struct SharedPool {
    device: Device,
    pool: PoolLock,
}

/// A spin lock around a pool. A `Mutex` costs the tree's fast path a poison check on every take and
/// give; this lock is a compare-exchange and a store. It is contended only while another thread
/// empties the pool for a refused request, which it does with the lock held for a few frees, so
/// a waiter spins briefly, then yields.
struct PoolLock {
    locked: AtomicBool,
    pool: UnsafeCell<Pool<DeviceMemory>>,
}

// SAFETY: the pool is reached only through a `PoolGuard`, and `locked` admits one guard at a time;
// the pool itself may move between threads (`Pool` is `Send`).
unsafe impl Sync for PoolLock {}

/// Exclusive access to a pool while it lives.
pub(crate) struct PoolGuard<'a>(&'a PoolLock);

impl PoolLock {
    #[inline]
    fn lock(&self) -> PoolGuard<'_> {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        PoolGuard(self)
    }
}

impl Deref for PoolGuard<'_> {
    type Target = Pool<DeviceMemory>;
    #[inline]
    fn deref(&self) -> &Pool<DeviceMemory> {
        // SAFETY: this guard holds the lock, so no other reference to the pool exists.
        unsafe { &*self.0.pool.get() }
    }
}

impl DerefMut for PoolGuard<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut Pool<DeviceMemory> {
        // SAFETY: as in `deref`, and the guard is borrowed mutably.
        unsafe { &mut *self.0.pool.get() }
    }
}

impl Drop for PoolGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.locked.store(false, Ordering::Release);
    }
}

/// Every pool of the process, as weak references (a tree's pool dies with its root).
static POOLS: Mutex<Vec<Weak<SharedPool>>> = Mutex::new(Vec::new());

/// The registry's lock; a panic while it was held does not poison it (the list stays valid).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A refused request: idle bytes that were released (in this pool and others) before giving up.
pub(crate) struct Refused {
    pub(crate) released: usize,
}

impl SharedPool {
    /// A new pool of `device` memory for a tree, registered, with the device's default cache limit.
    pub(crate) fn register(device: Device) -> Arc<SharedPool> {
        let shared = Arc::new(SharedPool {
            device,
            pool: PoolLock {
                locked: AtomicBool::new(false),
                pool: UnsafeCell::new(Pool::new(DeviceMemory(device), default_cache_limit(device))),
            },
        });
        let mut pools = lock(&POOLS);
        pools.retain(|p| p.strong_count() > 0);
        pools.push(Arc::downgrade(&shared));
        shared
    }

    pub(crate) fn device(&self) -> Device {
        self.device
    }

    /// The pool, for its own tree.
    #[inline]
    pub(crate) fn lock(&self) -> PoolGuard<'_> {
        self.pool.lock()
    }

    /// A block of at least `bytes` (> 0) bytes, under the whole refusal policy: the cache, the
    /// device's allocator, the allocator again after this pool's idle blocks went back, and once more
    /// after every other tree's on the device did.
    #[inline]
    pub(crate) fn take(&self, bytes: usize) -> Result<Taken, Refused> {
        let mut pool = self.lock();
        let own = match pool.take(bytes) {
            Ok(taken) => return Ok(taken),
            Err(released) => released,
        };
        drop(pool); // never hold two pool locks
        let released = release_idle(self.device, Some(self));
        let mut pool = self.lock();
        let mut total = own + released;
        if released > 0 {
            pool.note_retry(released);
            match pool.take_new(bytes) {
                Ok(taken) => return Ok(taken),
                Err(more) => total += more,
            }
        }
        pool.note_failure();
        Err(Refused { released: total })
    }
}

/// Returns the idle blocks of every pool on `device` but `except` to the device's allocator; returns
/// the bytes released.
fn release_idle(device: Device, except: Option<&SharedPool>) -> usize {
    let others: Vec<Arc<SharedPool>> = lock(&POOLS)
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|p| p.device == device && !except.is_some_and(|e| ptr::eq(e, &**p)))
        .collect();
    others.iter().map(|p| p.lock().empty()).sum()
}

/// Raw memory for what no pool holds (workspace arenas, system-scope tensors), under the same
/// refusal policy: when the allocator refuses, every tree on the device returns its idle blocks and
/// the allocator is asked again.
pub(crate) fn alloc(device: Device, bytes: usize) -> Result<NonNull<u8>, Refused> {
    if let Some(ptr) = raw::alloc(device, bytes) {
        return Ok(ptr);
    }
    let released = release_idle(device, None);
    match released {
        0 => None,
        _ => raw::alloc(device, bytes),
    }
    .ok_or(Refused { released })
}

/// The cache limit a new pool of `device` starts with: for host memory an eighth of the machine's
/// physical memory (1 GiB where that is unknown), so that a cache alone never drives the process
/// into the kernel's OOM killer; none for a GPU, whose allocator refuses rather than kills, and
/// whose refusals the pools answer by releasing their caches.
pub(crate) fn default_cache_limit(device: Device) -> Option<usize> {
    static HOST: OnceLock<usize> = OnceLock::new();
    match device {
        Device::Cpu => Some(*HOST.get_or_init(|| physical_memory().map_or(1 << 30, |m| m / 8))),
        Device::Cuda(_) => None,
    }
}

/// The machine's physical memory in bytes, where the platform tells (Linux's `/proc/meminfo`).
pub(crate) fn physical_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_cache_is_bounded_by_default_and_a_gpu_cache_is_not() {
        let host = default_cache_limit(Device::Cpu).expect("host pools have a limit");
        assert!(host >= 1 << 20, "a limit that still caches: {host}");
        assert_eq!(default_cache_limit(Device::Cuda(0)), None);
    }

    #[test]
    fn one_trees_refusal_releases_another_trees_idle_blocks() {
        // Two pools of one device: the first caches a block; a release for the second takes it.
        let a = SharedPool::register(Device::Cpu);
        let b = SharedPool::register(Device::Cpu);
        let (ptr, capacity, _) = a.take(1 << 20).ok().expect("1 MiB of host memory");
        // SAFETY: the block came from `a` with this capacity and is not used again.
        unsafe { a.lock().give(ptr, 1 << 20, capacity) };
        let segment = a.lock().stats().reserved_bytes;
        assert_eq!(a.lock().cached_bytes(), segment, "a whole idle segment");
        assert!(release_idle(Device::Cpu, Some(&b)) >= segment);
        assert_eq!(a.lock().stats().reserved_bytes, 0);
    }
}
