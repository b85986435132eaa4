//! Pages: one storage block cut into equal pages that tables hold, share and give back.
//!
//! A KV cache grows a page at a time from a slab that its model's scope owns (vLLM's paged KV cache:
//! Kwon et al., SOSP 2023). The slab's bytes are touched through this module only, and it is what
//! makes views of single pages sound while many holders, on many threads, read and write the same
//! block:
//!
//! * A [`PageTable`] is a holder's ordered list of pages. Every page has a count of the tables
//!   holding it; [`PageTable::share`] adds a holder to each page of a table (the samples of one
//!   prompt share the prompt's pages).
//! * A page is written only through [`PageTable::write`], which borrows the table mutably and
//!   refuses a page that another table holds; a shared page is first replaced by a private copy
//!   ([`PageTable::unshare`]). So a page being written has exactly one holder, borrowed mutably,
//!   and no view of it exists anywhere else; pages read concurrently are never written.
//! * Views cover one page each, never the whole slab: a reader of page 3 and the writer of page 4
//!   hold disjoint byte ranges.
//! * Dropping a table returns its pages (a page goes back to the free list when its last holder
//!   lets go), including during a panic's unwinding.
//!
//! Tables also carry a reservation: pages promised to a holder that it has not taken yet, so a
//! request admitted with its worst case reserved never finds the pool empty halfway, while a page
//! is only *held* (and counted as used) once a token lands in it.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Buf, BufMut};
use crate::memory::block::BlockRef;

/// The bookkeeping of one slab's pages, shared by every table cut from it.
pub(crate) struct Pages {
    /// The slab's header address: a view is only made for the block the pages were cut from. An
    /// address could in principle be reused by a later block, but it is never the only guard:
    /// the block passed in is always the slab of the pool that holds this `Pages` (a `KvPool`
    /// keeps its slab alive as long as itself), and every table is first checked to come from
    /// that pool by the identity of this `Arc`, which cannot be reused while the table holds it
    /// (`KvCache::check_pool`, run by `KvStep` for every cache).
    block: usize,
    page_bytes: usize,
    count: usize,
    state: Mutex<State>,
}

struct State {
    /// Pages no table holds, taken from the end.
    free: Vec<u32>,
    /// How many tables hold each page.
    holders: Vec<u32>,
    /// Pages promised to tables and not taken yet (at most `free.len()`).
    reserved: usize,
    /// Token slots written in each held page, and their sum.
    filled: Vec<u32>,
    filled_total: usize,
}

/// What the pages are doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageCounts {
    /// Pages in the slab.
    pub(crate) total: usize,
    /// Pages no table holds.
    pub(crate) free: usize,
    /// Free pages promised to tables.
    pub(crate) reserved: usize,
    /// Pages more than one table holds.
    pub(crate) shared: usize,
    /// Token slots written in the held pages.
    pub(crate) filled: usize,
}

impl Pages {
    /// `count` pages of `page_bytes` each over `block`, all free; `None` if the block is smaller
    /// than that or a page is not a multiple of 64 bytes (kernels need aligned pages).
    pub(crate) fn new(block: &BlockRef, page_bytes: usize, count: usize) -> Option<Arc<Pages>> {
        let fits = page_bytes
            .checked_mul(count)
            .is_some_and(|b| b <= block.header().bytes.get());
        if !fits || page_bytes == 0 || !page_bytes.is_multiple_of(64) || count > u32::MAX as usize {
            return None;
        }
        Some(Arc::new(Pages {
            block: block.as_ptr() as usize,
            page_bytes,
            count,
            state: Mutex::new(State {
                // Reversed, so the first pages taken are the slab's first.
                free: (0..count as u32).rev().collect(),
                holders: vec![0; count],
                reserved: 0,
                filled: vec![0; count],
                filled_total: 0,
            }),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock is held leaves the counts consistent (every update is one step),
        // so a poisoned lock is taken as it is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes per page.
    pub(crate) fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// The counts now.
    pub(crate) fn counts(&self) -> PageCounts {
        let s = self.lock();
        PageCounts {
            total: self.count,
            free: s.free.len(),
            reserved: s.reserved,
            shared: s.holders.iter().filter(|&&h| h > 1).count(),
            filled: s.filled_total,
        }
    }

    /// An empty table with `reserve` pages promised to it; `None` when fewer free pages are
    /// unpromised.
    pub(crate) fn table(self: &Arc<Pages>, reserve: usize) -> Option<PageTable> {
        let mut s = self.lock();
        if s.free.len() - s.reserved < reserve {
            return None;
        }
        s.reserved += reserve;
        Some(PageTable {
            pages: Arc::clone(self),
            held: Vec::new(),
            reserved: reserve,
        })
    }

    /// Takes a free page for a table that has `reserved` pages promised (using one of them if any).
    fn take(&self, reserved: &mut usize) -> Option<u32> {
        let mut s = self.lock();
        if *reserved == 0 && s.free.len() == s.reserved {
            return None;
        }
        let page = s.free.pop()?;
        if *reserved > 0 {
            *reserved -= 1;
            s.reserved -= 1;
        }
        s.holders[page as usize] = 1;
        Some(page)
    }

    /// Lets go of `page` for one holder.
    fn release(s: &mut State, page: u32) {
        let h = &mut s.holders[page as usize];
        *h -= 1;
        if *h == 0 {
            s.free.push(page);
            s.filled_total -= std::mem::take(&mut s.filled[page as usize]) as usize;
        }
    }

    fn holders(&self, page: u32) -> u32 {
        self.lock().holders[page as usize]
    }

    /// The byte range of `page` in `block`, if `block` is the slab these pages were cut from.
    fn range(&self, block: &BlockRef, page: u32) -> Option<(std::ptr::NonNull<u8>, usize)> {
        if block.as_ptr() as usize != self.block {
            return None;
        }
        let h = block.header();
        // In bounds: `new` checked that `count` pages fit in the block's bytes.
        let ptr = h
            .ptr
            .get()
            .as_ptr()
            .wrapping_add(page as usize * self.page_bytes);
        Some((std::ptr::NonNull::new(ptr)?, self.page_bytes))
    }
}

/// One holder's pages, in order, and the pages still promised to it.
pub(crate) struct PageTable {
    pages: Arc<Pages>,
    held: Vec<u32>,
    reserved: usize,
}

impl PageTable {
    /// The pages held.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// The page indices held, in order (for the GPU's tables and for dumps).
    pub(crate) fn indices(&self) -> &[u32] {
        &self.held
    }

    /// Pages promised and not taken.
    pub(crate) fn reserved(&self) -> usize {
        self.reserved
    }

    /// Whether both tables take pages from the same slab.
    pub(crate) fn same_pages(&self, pages: &Arc<Pages>) -> bool {
        Arc::ptr_eq(&self.pages, pages)
    }

    /// Appends a fresh page (one promised to this table if any are left); `false` when none is free.
    pub(crate) fn push(&mut self) -> bool {
        match self.pages.take(&mut self.reserved) {
            Some(page) => {
                self.held.push(page);
                true
            }
            None => false,
        }
    }

    /// Promises `more` pages to this table; `false` (and nothing promised) when fewer free pages
    /// are unpromised.
    pub(crate) fn reserve(&mut self, more: usize) -> bool {
        let mut s = self.pages.lock();
        if s.free.len() - s.reserved < more {
            return false;
        }
        s.reserved += more;
        self.reserved += more;
        true
    }

    /// Gives back the promises not taken yet.
    pub(crate) fn release_reservation(&mut self) {
        let mut s = self.pages.lock();
        s.reserved -= self.reserved;
        self.reserved = 0;
    }

    /// A second holder of the same pages, with nothing promised to it.
    pub(crate) fn share(&self) -> PageTable {
        let mut s = self.pages.lock();
        for &p in &self.held {
            s.holders[p as usize] += 1;
        }
        PageTable {
            pages: Arc::clone(&self.pages),
            held: self.held.clone(),
            reserved: 0,
        }
    }

    /// Whether page `i` of the table has other holders.
    pub(crate) fn is_shared(&self, i: usize) -> bool {
        self.pages.holders(self.held[i]) > 1
    }

    /// Views of the held pages `from..` of `block` for kernels to read; `None` if `block` is not the
    /// slab these pages were cut from.
    pub(crate) fn read<'a>(&'a self, block: &'a BlockRef, from: usize) -> Option<Vec<Buf<'a>>> {
        let device = block.header().device.get();
        self.held[from..]
            .iter()
            .map(|&p| {
                let (ptr, bytes) = self.pages.range(block, p)?;
                // SAFETY: the range is one page inside the slab (`Pages::new` checked the size),
                // aligned to 64 (pages are multiples of 64 bytes from a 64-aligned block), and valid
                // while `block` is borrowed. This table holds the page, so nothing writes it while
                // `self` is borrowed: a write needs the page's only holder borrowed mutably. On a
                // GPU "while borrowed" is in stream order: every kernel and copy of a device runs on
                // its one stream (backend/cuda), so work enqueued through this view runs before any
                // later write to the page, and before the slab's block is reused after it is freed.
                Some(unsafe { Buf::new(ptr, bytes, device) })
            })
            .collect()
    }

    /// Views of the held pages `from..` of `block` for kernels to write; `None` if `block` is not
    /// the slab, or if another table holds one of them (make them private with
    /// [`unshare`](Self::unshare) first).
    pub(crate) fn write<'a>(
        &'a mut self,
        block: &'a BlockRef,
        from: usize,
    ) -> Option<Vec<BufMut<'a>>> {
        let device = block.header().device.get();
        let s = self.pages.lock();
        let mut views = Vec::with_capacity(self.held.len() - from);
        for &p in &self.held[from..] {
            if s.holders[p as usize] != 1 {
                return None;
            }
            let (ptr, bytes) = self.pages.range(block, p)?;
            // SAFETY: as in `read`; and this table is the page's only holder, borrowed mutably for
            // `'a`, so no other view of the page exists while the returned one lives. The count
            // cannot grow meanwhile: only `share` adds holders, and it needs this table.
            views.push(unsafe { BufMut::new(ptr, bytes, device) });
        }
        Some(views)
    }

    /// Makes page `i` private: if other tables hold it, a fresh page takes its place after `copy`
    /// filled it from the shared one (`copy(from, to)`). `Ok(false)` when no page is free for the
    /// copy; `None` if `block` is not the slab.
    pub(crate) fn unshare<E>(
        &mut self,
        block: &BlockRef,
        i: usize,
        copy: impl FnOnce(Buf<'_>, BufMut<'_>) -> Result<(), E>,
    ) -> Option<Result<bool, E>> {
        let old = self.held[i];
        if self.pages.holders(old) == 1 {
            return Some(Ok(true));
        }
        let Some(fresh) = self.pages.take(&mut self.reserved) else {
            return Some(Ok(false));
        };
        let device = block.header().device.get();
        let copied = match (self.pages.range(block, old), self.pages.range(block, fresh)) {
            (Some((from, bytes)), Some((to, _))) => {
                // SAFETY: two distinct pages of the slab (`fresh` was free, `old` is held). `old` is
                // only read: this table still holds it during the copy, so it is not freed or
                // written (it has other holders, which do not write shared pages). `fresh` has this
                // table as its only holder and is not in `held` yet, so no other view of it exists.
                let (src, dst) = unsafe {
                    (
                        Buf::new(from, bytes, device),
                        BufMut::new(to, bytes, device),
                    )
                };
                Some(copy(src, dst))
            }
            _ => None,
        };
        let mut s = self.pages.lock();
        match copied {
            Some(Ok(())) => {
                let copied = s.filled[old as usize];
                s.filled[fresh as usize] = copied;
                s.filled_total += copied as usize;
                Pages::release(&mut s, old);
                self.held[i] = fresh;
                Some(Ok(true))
            }
            other => {
                Pages::release(&mut s, fresh);
                other.map(|r| r.map(|()| false))
            }
        }
    }

    /// Gives back every page from `keep` on (a page other tables hold stays theirs).
    pub(crate) fn truncate(&mut self, keep: usize) {
        if keep >= self.held.len() {
            return;
        }
        let mut s = self.pages.lock();
        for p in self.held.drain(keep..) {
            Pages::release(&mut s, p);
        }
    }

    /// Records that only the first `slots` token slots of page `i` hold tokens now, when this table
    /// alone holds it (a page other tables hold keeps their tokens).
    pub(crate) fn unfill(&mut self, i: usize, slots: usize) {
        let mut s = self.pages.lock();
        let page = self.held[i] as usize;
        if s.holders[page] == 1 {
            let f = &mut s.filled[page];
            let shrunk = f.saturating_sub(slots as u32);
            *f -= shrunk;
            s.filled_total -= shrunk as usize;
        }
    }

    /// Records that the first `slots` token slots of page `i` hold tokens (for the waste figures).
    pub(crate) fn fill(&mut self, i: usize, slots: usize) {
        let mut s = self.pages.lock();
        let f = &mut s.filled[self.held[i] as usize];
        let grown = (slots as u32).saturating_sub(*f);
        *f += grown;
        s.filled_total += grown as usize;
    }
}

impl Drop for PageTable {
    fn drop(&mut self) {
        let mut s = self.pages.lock();
        for &p in &self.held {
            Pages::release(&mut s, p);
        }
        s.reserved -= self.reserved;
    }
}

impl std::fmt::Debug for PageTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageTable")
            .field("held", &self.held)
            .field("reserved", &self.reserved)
            .finish()
    }
}
