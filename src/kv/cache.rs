//! One request's KV cache: a table of blocks from a pool, branded with the request's scope.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::pool::KvPool;
use crate::error::{Error, Result};
use crate::memory::pages::PageTable;
use crate::ops::paged::unshare_page;
use crate::scope::node::Note;
use crate::scope::{Movable, Scope};

/// The keys and values a request has cached: a table of blocks taken from a [`KvPool`] as tokens
/// arrive, and the number of tokens they hold. Branded with the request's scope `'r` (invariant): it
/// cannot be returned from the request's closure, stored in the model or a longer-lived collection,
/// or passed to a forward pass of another request's scope; [`Child::ret`](crate::Child::ret) moves a
/// finished cache to the parent scope on purpose. Dropping it gives its blocks back.
pub struct KvCache<'r> {
    pub(super) table: PageTable,
    pub(super) tokens: usize,
    block_tokens: usize,
    block_bytes: usize,
    /// What the scope's dump shows of this cache.
    figures: Arc<Figures>,
    _brand: PhantomData<fn(&'r ()) -> &'r ()>,
}

/// A cache's figures, shared with its scope's dump.
#[derive(Debug, Default)]
struct Figures {
    tokens: AtomicUsize,
    blocks: AtomicUsize,
    promised: AtomicUsize,
    block_bytes: usize,
}

impl Note for Figures {
    fn line(&self) -> String {
        let usage = KvUsage {
            tokens: self.tokens.load(Ordering::Relaxed),
            blocks: self.blocks.load(Ordering::Relaxed),
            bytes: self.blocks.load(Ordering::Relaxed) * self.block_bytes,
            blocks_promised: self.promised.load(Ordering::Relaxed),
        };
        format!("kv cache: {usage}")
    }
}

/// One cache's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvUsage {
    /// Tokens cached.
    pub tokens: usize,
    /// Blocks held (shared ones included).
    pub blocks: usize,
    /// Bytes of the blocks held.
    pub bytes: usize,
    /// Blocks promised to the cache and not taken yet.
    pub blocks_promised: usize,
}

impl fmt::Display for KvUsage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tokens in {} block{} ({}), {} more promised",
            self.tokens,
            self.blocks,
            if self.blocks == 1 { "" } else { "s" },
            crate::memory::stats::Bytes(self.bytes),
            self.blocks_promised
        )
    }
}

impl<'r> KvCache<'r> {
    pub(super) fn new(
        scope: &Scope<'r>,
        table: PageTable,
        tokens: usize,
        block_tokens: usize,
        block_bytes: usize,
    ) -> KvCache<'r> {
        let figures = Arc::new(Figures {
            block_bytes,
            ..Figures::default()
        });
        scope.add_note(Arc::downgrade(&figures) as std::sync::Weak<dyn Note>);
        let cache = KvCache {
            table,
            tokens,
            block_tokens,
            block_bytes,
            figures,
            _brand: PhantomData,
        };
        cache.update_figures();
        cache
    }

    fn update_figures(&self) {
        let f = &self.figures;
        f.tokens.store(self.tokens, Ordering::Relaxed);
        f.blocks.store(self.table.len(), Ordering::Relaxed);
        f.promised.store(self.table.reserved(), Ordering::Relaxed);
    }

    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Blocks held, tokens and bytes.
    pub fn usage(&self) -> KvUsage {
        KvUsage {
            tokens: self.tokens,
            blocks: self.table.len(),
            bytes: self.table.len() * self.block_bytes,
            blocks_promised: self.table.reserved(),
        }
    }

    /// The pool's block numbers this cache reads, in order.
    pub fn blocks(&self) -> &[u32] {
        self.table.indices()
    }

    /// A second cache of the same tokens, for a request in `scope` (this cache's or another, such as
    /// a child's), that shares this one's full blocks, with the blocks for `max_tokens` tokens in all
    /// promised to it: the samples of one prompt share the prompt's
    /// blocks. Full blocks are never written again, so they stay shared until the last holder lets
    /// go; a partly filled last block is copied into a block of the fork's own at once, since both
    /// caches write into it next (copy-on-write with the write known to come).
    ///
    /// # Errors
    /// [`Error::KvCapacity`] when the pool cannot promise the blocks the fork may need: those past the
    /// shared ones, plus the copy of a partly filled last block.
    pub fn fork<'c>(
        &self,
        scope: &Scope<'c>,
        pool: &KvPool<'_>,
        max_tokens: usize,
    ) -> Result<KvCache<'c>> {
        self.check_pool(pool)?;
        let mut table = self.table.share();
        let full = self.tokens / self.block_tokens;
        let partial = usize::from(!self.tokens.is_multiple_of(self.block_tokens));
        let needed = max_tokens
            .max(self.tokens)
            .div_ceil(self.block_tokens)
            .saturating_sub(full);
        if !table.reserve(needed) {
            return Err(pool.capacity_error(max_tokens, needed));
        }
        if partial == 1 && !unshare_page(pool.slab(), &mut table, full)? {
            return Err(pool.capacity_error(max_tokens, 1));
        }
        Ok(KvCache::new(
            scope,
            table,
            self.tokens,
            self.block_tokens,
            self.block_bytes,
        ))
    }

    /// Forgets every token from position `tokens` on, giving back the blocks past the last one
    /// still used: the cache then holds the sequence's first `tokens` tokens, and decoding goes on
    /// from there (a conversation whose re-rendered text differs from what the model generated
    /// keeps the longest common prefix; a rejected draft is rolled back). The blocks' bytes are not
    /// touched: past `tokens` they are never read, and the next tokens overwrite them — in a block
    /// of this cache's own, since one shared with a fork is copied before it is written.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `tokens` is more than the cache holds.
    pub fn truncate(&mut self, tokens: usize) -> Result<()> {
        if tokens > self.tokens {
            return Err(Error::InvalidArgument {
                op: "KvCache::truncate",
                reason: format!(
                    "the cache holds {} tokens and cannot be cut to {tokens}; keep at most {}",
                    self.tokens, self.tokens
                ),
            });
        }
        let keep = tokens.div_ceil(self.block_tokens);
        self.table.truncate(keep);
        if !tokens.is_multiple_of(self.block_tokens) {
            self.table.unfill(keep - 1, tokens % self.block_tokens);
        }
        self.tokens = tokens;
        self.update_figures();
        Ok(())
    }

    /// Gives back the blocks promised and not taken (a request that finished early).
    pub fn release_promised(&mut self) {
        self.table.release_reservation();
        self.update_figures();
    }

    pub(super) fn check_pool(&self, pool: &KvPool<'_>) -> Result<()> {
        if self.table.same_pages(pool.pages()) {
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                op: "KvCache",
                reason: "this cache's blocks come from another KV pool; decode with the pool \
                         that made the cache"
                    .into(),
            })
        }
    }

    /// Makes the blocks for `new` more tokens present and private: takes blocks as needed and copies
    /// a block shared with another cache before it is written.
    pub(super) fn make_room(&mut self, pool: &KvPool<'_>, new: usize) -> Result<()> {
        let end = self.tokens + new;
        let needed = end.div_ceil(self.block_tokens);
        while self.table.len() < needed {
            if !self.table.push() {
                return Err(pool.capacity_error(end, needed - self.table.len()));
            }
        }
        for i in self.tokens / self.block_tokens..needed {
            if self.table.is_shared(i) && !unshare_page(pool.slab(), &mut self.table, i)? {
                return Err(pool.capacity_error(end, 1));
            }
        }
        self.update_figures();
        Ok(())
    }

    /// Counts `new` written tokens as cached.
    pub(super) fn commit(&mut self, new: usize) {
        let end = self.tokens + new;
        for i in self.tokens / self.block_tokens..end.div_ceil(self.block_tokens) {
            let slots = (end - i * self.block_tokens).min(self.block_tokens);
            self.table.fill(i, slots);
        }
        self.tokens = end;
        self.update_figures();
    }
}

impl fmt::Debug for KvCache<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvCache")
            .field("tokens", &self.tokens)
            .field("blocks", &self.table.indices())
            .finish()
    }
}

/// A cache moves between scopes without copying: its blocks belong to the pool, not to a scope, so
/// moving only re-brands it and shows it in the target's dump (`Child::ret` hands a finished cache to
/// the parent scope).
impl<'a> Movable<'a> for KvCache<'a> {
    type Moved<'b> = KvCache<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<KvCache<'b>> {
        target.add_note(Arc::downgrade(&self.figures) as std::sync::Weak<dyn Note>);
        Ok(KvCache {
            table: self.table,
            tokens: self.tokens,
            block_tokens: self.block_tokens,
            block_bytes: self.block_bytes,
            figures: self.figures,
            _brand: PhantomData,
        })
    }
}
