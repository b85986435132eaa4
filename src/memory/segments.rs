//! Large blocks: best fit in segments, split on the way out and coalesced on the way back.
//!
//! A request above [`SMALL_MAX`](crate::memory::classes::SMALL_MAX) is rounded up to [`GRANULE`] and
//! served from the smallest idle block that holds it (best fit); what the request leaves of that block
//! stays idle as a block of its own. A segment is one allocation from the device's allocator (its size
//! is the pool's choice, a multiple of [`SEGMENT_ROUND`]); its blocks tile it. A freed block merges with its idle neighbours in the
//! segment, so a segment whose blocks are all free is one idle block again, and only such whole
//! segments go back to the device's allocator (a segment cannot be returned in part).
//!
//! The records live in vectors that keep their capacity (a slab of blocks, two sorted indexes), so a
//! steady-state loop takes and returns blocks without touching the system allocator. The indexes are
//! searched by bisection and shifted on insertion; a pool holds tens of large blocks, so both are a
//! few cache lines of work.

use std::num::NonZeroUsize;
use std::ptr::NonNull;

/// Large blocks are whole multiples of this many bytes (and so are their addresses within a segment).
pub(crate) const GRANULE: usize = 512;
/// Segments are whole multiples of this many bytes: the driver's allocation granularity on a GPU.
pub(crate) const SEGMENT_ROUND: usize = 2 << 20;

/// A block of a segment, live or idle.
#[derive(Clone, Copy)]
struct Block {
    addr: usize,
    size: usize,
    /// The segment's first byte; blocks are derived from it, so they carry its provenance.
    segment: NonNull<u8>,
    segment_size: usize,
    free: bool,
}

impl Block {
    fn is_whole_segment(&self) -> bool {
        self.addr == self.segment.addr().get() && self.size == self.segment_size
    }

    fn ptr(&self) -> NonNull<u8> {
        let addr = NonZeroUsize::new(self.addr).expect("blocks lie in allocated memory");
        self.segment.with_addr(addr)
    }
}

/// The segments of one pool.
#[derive(Default)]
pub(crate) struct Segments {
    /// Block records; `vacant` lists the reusable slots.
    slab: Vec<Block>,
    vacant: Vec<u32>,
    /// Every block (live or idle) by address: `(addr, slot)`, sorted.
    by_addr: Vec<(usize, u32)>,
    /// Idle blocks by size: `(size, addr, slot)`, sorted, so the first at or above a size is the
    /// best fit (the lowest address among equals).
    idle: Vec<(usize, usize, u32)>,
    idle_bytes: usize,
    reserved_bytes: usize,
    segments: usize,
}

// SAFETY: the pointers are addresses of memory the segments own (or device addresses); nothing in
// them is tied to a thread.
unsafe impl Send for Segments {}

impl Segments {
    /// The block size for a request of `bytes`.
    pub(crate) fn round(bytes: usize) -> Option<usize> {
        bytes.checked_next_multiple_of(GRANULE)
    }

    /// The best-fitting idle block for `size` (a [`round`](Self::round)ed request): the block, split
    /// when it holds at least [`GRANULE`] bytes more than asked, and its capacity.
    pub(crate) fn take(&mut self, size: usize) -> Option<(NonNull<u8>, usize)> {
        let at = self.idle.partition_point(|&(s, _, _)| s < size);
        let &(_, _, slot) = self.idle.get(at)?;
        self.idle.remove(at);
        let block = &mut self.slab[slot as usize];
        block.free = false;
        let rest = block.size - size;
        if rest >= GRANULE {
            block.size = size;
            let rest_block = Block {
                addr: block.addr + size,
                size: rest,
                free: true,
                ..*block
            };
            let rest_slot = self.insert(rest_block);
            self.index_idle(rest_block, rest_slot);
        }
        let block = self.slab[slot as usize];
        self.idle_bytes -= block.size;
        Some((block.ptr(), block.size))
    }

    /// Adds a segment of `size` bytes at `ptr`, fresh from the device's allocator, as one idle block.
    pub(crate) fn add(&mut self, ptr: NonNull<u8>, size: usize) {
        let block = Block {
            addr: ptr.addr().get(),
            size,
            segment: ptr,
            segment_size: size,
            free: true,
        };
        let slot = self.insert(block);
        self.index_idle(block, slot);
        self.idle_bytes += size;
        self.reserved_bytes += size;
        self.segments += 1;
    }

    /// Takes back a block handed out by [`take`](Self::take), merging it with idle neighbours.
    pub(crate) fn give(&mut self, ptr: NonNull<u8>, capacity: usize) {
        let at = self.position(ptr.addr().get());
        let slot = self.by_addr[at].1;
        let mut block = self.slab[slot as usize];
        debug_assert!(
            !block.free && block.size == capacity,
            "a live block comes back once"
        );
        self.idle_bytes += block.size;
        block.free = true;
        // The next block by address, if idle and in the same segment, joins this one.
        if let Some(&(next_addr, next_slot)) = self.by_addr.get(at + 1) {
            let next = self.slab[next_slot as usize];
            if next.free && next.segment == block.segment {
                debug_assert_eq!(next_addr, block.addr + block.size, "blocks tile a segment");
                self.unindex_idle(next);
                self.remove(at + 1);
                block.size += next.size;
            }
        }
        // So does this block join the previous one.
        if at > 0 {
            let prev_slot = self.by_addr[at - 1].1;
            let mut prev = self.slab[prev_slot as usize];
            if prev.free && prev.segment == block.segment {
                self.unindex_idle(prev);
                self.remove(at);
                prev.size += block.size;
                self.slab[prev_slot as usize] = prev;
                self.index_idle(prev, prev_slot);
                return;
            }
        }
        self.slab[slot as usize] = block;
        self.index_idle(block, slot);
    }

    /// Removes the largest segment whose blocks are all idle, for the caller to return to the device's
    /// allocator: its address and size.
    pub(crate) fn pop_idle_segment(&mut self) -> Option<(NonNull<u8>, usize)> {
        let i = self
            .idle
            .iter()
            .rposition(|&(_, _, slot)| self.slab[slot as usize].is_whole_segment())?;
        let (_, addr, _) = self.idle.remove(i);
        let block = self.slab[self.by_addr[self.position(addr)].1 as usize];
        self.remove(self.position(addr));
        self.idle_bytes -= block.size;
        self.forget_segment(block.size);
        Some((block.segment, block.size))
    }

    /// Gives up a live block that is a whole segment, so that its memory can outlive the pool (it is
    /// then the caller's to return to the device's allocator); `false`, changing nothing, for a block
    /// that shares its segment.
    pub(crate) fn hand_over(&mut self, ptr: NonNull<u8>, capacity: usize) -> bool {
        let at = self.position(ptr.addr().get());
        let block = self.slab[self.by_addr[at].1 as usize];
        debug_assert!(!block.free && block.size == capacity);
        if !block.is_whole_segment() {
            return false;
        }
        self.remove(at);
        self.forget_segment(block.size);
        true
    }

    /// Bytes of idle blocks.
    pub(crate) fn idle_bytes(&self) -> usize {
        self.idle_bytes
    }

    /// Bytes of idle whole segments (what [`pop_idle_segment`](Self::pop_idle_segment) can return).
    pub(crate) fn idle_segment_bytes(&self) -> usize {
        self.idle
            .iter()
            .map(|&(_, _, slot)| self.slab[slot as usize])
            .filter(Block::is_whole_segment)
            .map(|b| b.size)
            .sum()
    }

    /// Bytes of all segments.
    #[cfg(test)]
    pub(crate) fn reserved_bytes(&self) -> usize {
        self.reserved_bytes
    }

    /// Segments held.
    pub(crate) fn segments(&self) -> usize {
        self.segments
    }

    /// Idle blocks.
    #[cfg(test)]
    pub(crate) fn idle_blocks(&self) -> usize {
        self.idle.len()
    }

    fn forget_segment(&mut self, size: usize) {
        self.reserved_bytes -= size;
        self.segments -= 1;
    }

    /// The index in `by_addr` of the block at `addr`.
    fn position(&self, addr: usize) -> usize {
        let at = self.by_addr.partition_point(|&(a, _)| a < addr);
        debug_assert!(
            self.by_addr.get(at).is_some_and(|&(a, _)| a == addr),
            "a block of this pool"
        );
        at
    }

    /// Records a block in the slab and the address index; returns its slot.
    fn insert(&mut self, block: Block) -> u32 {
        let slot = match self.vacant.pop() {
            Some(slot) => {
                self.slab[slot as usize] = block;
                slot
            }
            None => {
                self.slab.push(block);
                u32::try_from(self.slab.len() - 1).expect("fewer than 2^32 blocks")
            }
        };
        let at = self.by_addr.partition_point(|&(a, _)| a < block.addr);
        self.by_addr.insert(at, (block.addr, slot));
        slot
    }

    /// Drops the block at `by_addr[at]` from the address index and frees its slot.
    fn remove(&mut self, at: usize) {
        let (_, slot) = self.by_addr.remove(at);
        self.vacant.push(slot);
    }

    fn index_idle(&mut self, block: Block, slot: u32) {
        let key = (block.size, block.addr, slot);
        let at = self.idle.partition_point(|&k| k < key);
        self.idle.insert(at, key);
    }

    fn unindex_idle(&mut self, block: Block) {
        let at = self
            .idle
            .partition_point(|&(s, a, _)| (s, a) < (block.size, block.addr));
        debug_assert_eq!(self.idle[at].1, block.addr, "an idle block is indexed");
        self.idle.remove(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(addr: usize) -> NonNull<u8> {
        NonNull::new(std::ptr::without_provenance_mut(addr)).unwrap()
    }

    #[test]
    fn blocks_split_and_merge_back_into_their_segment() {
        let mut s = Segments::default();
        s.add(at(1 << 30), SEGMENT_ROUND);
        let (a, ca) = s.take(GRANULE * 4).unwrap();
        let (b, cb) = s.take(GRANULE * 8).unwrap();
        assert_eq!(
            (a, ca),
            (at(1 << 30), GRANULE * 4),
            "the front of the segment"
        );
        assert_eq!(
            b,
            at((1 << 30) + GRANULE * 4),
            "right after the first block"
        );
        assert_eq!(s.idle_bytes(), SEGMENT_ROUND - ca - cb);
        assert_eq!(s.idle_blocks(), 1);
        assert_eq!(s.pop_idle_segment(), None, "the segment is in use");
        s.give(a, ca);
        assert_eq!(s.idle_blocks(), 2, "a's neighbour b is live: no merge");
        s.give(b, cb);
        assert_eq!(s.idle_blocks(), 1, "all three merged");
        assert_eq!(s.idle_segment_bytes(), SEGMENT_ROUND);
        assert_eq!(s.pop_idle_segment(), Some((at(1 << 30), SEGMENT_ROUND)));
        assert_eq!(
            (s.reserved_bytes(), s.segments(), s.idle_bytes()),
            (0, 0, 0)
        );
    }

    #[test]
    fn the_smallest_block_that_fits_is_taken() {
        let mut s = Segments::default();
        s.add(at(1 << 30), 4 * SEGMENT_ROUND);
        s.add(at(1 << 31), SEGMENT_ROUND);
        let (p, c) = s.take(SEGMENT_ROUND / 2).unwrap();
        assert_eq!(
            (p, c),
            (at(1 << 31), SEGMENT_ROUND / 2),
            "the small segment fits best"
        );
        assert!(s.take(8 * SEGMENT_ROUND).is_none(), "nothing holds 16 MiB");
        s.give(p, c);
        assert_eq!(s.pop_idle_segment(), Some((at(1 << 30), 4 * SEGMENT_ROUND)));
    }

    #[test]
    fn blocks_of_neighbouring_segments_never_merge() {
        let mut s = Segments::default();
        s.add(at(1 << 30), SEGMENT_ROUND);
        s.add(at((1 << 30) + SEGMENT_ROUND), SEGMENT_ROUND);
        let (a, ca) = s.take(SEGMENT_ROUND).unwrap();
        let (b, cb) = s.take(SEGMENT_ROUND).unwrap();
        s.give(a, ca);
        s.give(b, cb);
        assert_eq!(s.idle_blocks(), 2);
        assert!(s.take(2 * SEGMENT_ROUND).is_none());
    }

    #[test]
    fn a_whole_segment_block_can_be_handed_over() {
        let mut s = Segments::default();
        s.add(at(1 << 30), SEGMENT_ROUND);
        let (a, ca) = s.take(SEGMENT_ROUND - 100 * GRANULE).unwrap();
        assert!(!s.hand_over(a, ca), "the segment's tail is another block");
        s.give(a, ca);
        let (a, ca) = s.take(SEGMENT_ROUND).unwrap();
        assert!(s.hand_over(a, ca));
        assert_eq!(
            (s.reserved_bytes(), s.segments(), s.idle_blocks()),
            (0, 0, 0)
        );
    }
}
