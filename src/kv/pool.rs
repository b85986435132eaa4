//! The pool of KV blocks: one slab tensor in the model's scope, cut into blocks by a page table.

use std::fmt;
use std::sync::Arc;

use super::cache::KvCache;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::pages::Pages;
use crate::memory::stats::Bytes;
use crate::ops::paged::PageGeometry;
use crate::scope::node::Note;
use crate::scope::{Scope, root};
use crate::tensor::Tensor;

/// What one token's cache holds for a model: keys and values of `heads` heads of `head_width` for
/// each of `layers` layers, as `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Attention layers.
    pub layers: usize,
    /// Heads per layer.
    pub heads: usize,
    /// The width of one head's key (and value).
    pub head_width: usize,
    /// The dtype of the cached keys and values: the model's ([`CausalLm::kv_shape`] says so), or
    /// `f16` or `bf16` under an `f32` model, to halve the cache and the bytes attention reads
    /// (llama.cpp keeps `f16` by default); [`KvStep`] rounds to it and widens back.
    ///
    /// [`CausalLm::kv_shape`]: super::CausalLm::kv_shape
    /// [`KvStep`]: super::KvStep
    pub dtype: DType,
}

impl KvShape {
    /// Bytes one cached token takes: `layers × 2 × heads × head_width` elements.
    pub fn token_bytes(&self) -> usize {
        self.layers * 2 * self.heads * self.head_width * self.dtype.size()
    }
}

/// A pool of KV blocks of `block_tokens` tokens each, allocated once in a scope (the model's, so it
/// lives as long as the model) and shared by every request's [`KvCache`]. A block is held by the
/// caches that use it and goes back to the pool when the last one lets go.
///
/// The pool is `Sync` when its slab is detached ([`KvPool::detached`]), so threads serving requests
/// against one shared model take blocks from one pool.
pub struct KvPool<'m> {
    slab: Tensor<'m>,
    pages: Arc<Pages>,
    geometry: PageGeometry,
    shape: KvShape,
    /// What the model scope's dump shows of the pool.
    figures: Arc<Figures>,
}

/// The pool's figures, shared with its scope's dump.
struct Figures {
    pages: Arc<Pages>,
    block_tokens: usize,
}

impl Figures {
    fn stats(&self) -> KvPoolStats {
        let c = self.pages.counts();
        KvPoolStats {
            blocks: c.total,
            blocks_free: c.free,
            blocks_promised: c.reserved,
            blocks_shared: c.shared,
            block_tokens: self.block_tokens,
            block_bytes: self.pages.page_bytes(),
            tokens_cached: c.filled,
        }
    }
}

impl Note for Figures {
    fn line(&self) -> String {
        self.stats().to_string()
    }
}

/// What a [`KvPool`]'s blocks are doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPoolStats {
    /// Blocks in the pool.
    pub blocks: usize,
    /// Blocks no cache holds.
    pub blocks_free: usize,
    /// Free blocks promised to caches (taken as they grow).
    pub blocks_promised: usize,
    /// Blocks more than one cache holds (a prompt shared by its samples).
    pub blocks_shared: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Token slots written in held blocks (a shared block counts once).
    pub tokens_cached: usize,
}

impl KvPoolStats {
    /// Blocks some cache holds.
    pub fn blocks_used(&self) -> usize {
        self.blocks - self.blocks_free
    }

    /// Bytes of held blocks.
    pub fn bytes_held(&self) -> usize {
        self.blocks_used() * self.block_bytes
    }

    /// The fraction of held KV bytes that hold no token: `(held − cached) / held`, 0 when nothing is
    /// held. Only each cache's last block is partly empty, so it stays below `block_tokens / tokens
    /// per cache`.
    pub fn waste(&self) -> f64 {
        let slots = self.blocks_used() * self.block_tokens;
        if slots == 0 {
            0.0
        } else {
            (slots - self.tokens_cached.min(slots)) as f64 / slots as f64
        }
    }
}

impl fmt::Display for KvPoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KV pool: {} blocks of {} tokens ({} each): {} used ({} shared), {} free ({} promised); \
             {} tokens cached in {} held, waste {:.1}%",
            self.blocks,
            self.block_tokens,
            Bytes(self.block_bytes),
            self.blocks_used(),
            self.blocks_shared,
            self.blocks_free,
            self.blocks_promised,
            self.tokens_cached,
            Bytes(self.bytes_held()),
            100.0 * self.waste()
        )
    }
}

fn geometry_of(shape: KvShape, block_tokens: usize, blocks: usize) -> Result<PageGeometry> {
    let geometry = PageGeometry {
        layers: shape.layers,
        heads: shape.heads,
        tokens: block_tokens,
        width: shape.head_width,
    };
    let bytes = geometry.page_elements() * shape.dtype.size();
    let problem = if !shape.dtype.is_float() {
        Some(format!("keys and values are floats, not {}", shape.dtype))
    } else if geometry.page_elements() == 0 || blocks == 0 {
        Some("every size must be at least 1".to_string())
    } else if !bytes.is_multiple_of(64) {
        Some(format!(
            "a block of {block_tokens} tokens is {bytes} bytes; kernels need a multiple of 64 \
             (use a block of {} tokens)",
            block_tokens * 64 / gcd(bytes, 64)
        ))
    } else {
        None
    };
    match problem {
        Some(reason) => Err(Error::InvalidShape {
            op: "KvPool::new",
            shape: vec![
                blocks,
                shape.layers,
                shape.heads,
                block_tokens,
                shape.head_width,
            ],
            reason,
        }),
        None => Ok(geometry),
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl<'m> KvPool<'m> {
    /// The block size [`serve`](crate::serve) uses unless told otherwise (vLLM's default; see
    /// BENCHMARKS.md for the measured choice).
    pub const BLOCK_TOKENS: usize = 16;

    /// A pool of `blocks` blocks of `block_tokens` tokens for caches of `shape`, allocated in `scope`
    /// (on its device) as one tensor named `"kv pool"`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a zero size, an integer dtype, or a block whose bytes are not a
    /// multiple of 64 (the message names a block size that is); allocation errors.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        shape: KvShape,
        block_tokens: usize,
        blocks: usize,
    ) -> Result<KvPool<'m>> {
        let geometry = geometry_of(shape, block_tokens, blocks)?;
        // Zeroed once: a fork copies whole pages, slots a sequence has not written yet included, and
        // on a GPU those would otherwise be copies of unspecified memory.
        let slab = scope
            .full_dtype(&[blocks, geometry.page_elements()], 0.0, shape.dtype)?
            .named("kv pool");
        let pool = KvPool::from_slab(slab, geometry, shape, blocks)?;
        scope.add_note(Arc::downgrade(&pool.figures) as std::sync::Weak<dyn Note>);
        Ok(pool)
    }

    /// The pool that holds `tokens` tokens in blocks of `block_tokens`.
    ///
    /// # Errors
    /// As for [`new`](Self::new).
    #[track_caller]
    pub fn for_tokens(
        scope: &Scope<'m>,
        shape: KvShape,
        block_tokens: usize,
        tokens: usize,
    ) -> Result<KvPool<'m>> {
        KvPool::new(
            scope,
            shape,
            block_tokens,
            tokens.div_ceil(block_tokens.max(1)),
        )
    }

    fn from_slab(
        slab: Tensor<'m>,
        geometry: PageGeometry,
        shape: KvShape,
        blocks: usize,
    ) -> Result<KvPool<'m>> {
        let bytes = geometry.page_elements() * shape.dtype.size();
        let pages =
            Pages::new(slab.storage(), bytes, blocks).ok_or_else(|| Error::InvalidShape {
                op: "KvPool::new",
                shape: slab.shape().to_vec(),
                reason: "the slab does not hold its blocks".into(),
            })?;
        Ok(KvPool {
            slab,
            figures: Arc::new(Figures {
                pages: Arc::clone(&pages),
                block_tokens: geometry.tokens,
            }),
            pages,
            geometry,
            shape,
        })
    }

    /// The block size, in tokens.
    pub fn block_tokens(&self) -> usize {
        self.geometry.tokens
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        self.stats().blocks
    }

    /// What each token's cache holds.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// The device the blocks live on.
    pub fn device(&self) -> Device {
        self.slab.device()
    }

    /// The blocks' figures now.
    pub fn stats(&self) -> KvPoolStats {
        self.figures.stats()
    }

    /// An empty cache for a request running in `request` (its brand, and the scope whose dump shows
    /// it), with the blocks of `max_tokens` tokens promised to it: it takes them as it grows (a block is only held once a token lands in it), and
    /// no other cache can take them meanwhile. A cache may grow past `max_tokens` while unpromised
    /// blocks are free.
    ///
    /// # Errors
    /// [`Error::KvCapacity`] when fewer unpromised blocks are free.
    pub fn cache<'r>(&self, request: &Scope<'r>, max_tokens: usize) -> Result<KvCache<'r>> {
        let needed = max_tokens.div_ceil(self.geometry.tokens);
        let table = self
            .pages
            .table(needed)
            .ok_or_else(|| self.capacity_error(max_tokens, needed))?;
        Ok(KvCache::new(
            request,
            table,
            0,
            self.geometry.tokens,
            self.pages.page_bytes(),
        ))
    }

    pub(crate) fn capacity_error(&self, tokens: usize, needed: usize) -> Error {
        let c = self.pages.counts();
        Error::KvCapacity {
            tokens,
            needed,
            available: c.free - c.reserved,
            total: c.total,
        }
    }

    pub(crate) fn slab(&self) -> &Tensor<'m> {
        &self.slab
    }

    pub(crate) fn pages(&self) -> &Arc<Pages> {
        &self.pages
    }

    pub(crate) fn geometry(&self) -> PageGeometry {
        self.geometry
    }
}

impl KvPool<'static> {
    /// A pool whose slab belongs to no scope (`move_out`), so that threads can share it (`KvPool<'static>`
    /// is `Sync`) beside a detached model.
    ///
    /// # Errors
    /// As for [`new`](Self::new); [`Error::DeviceUnavailable`] for a device this build cannot use.
    #[track_caller]
    pub fn detached(
        device: Device,
        shape: KvShape,
        block_tokens: usize,
        blocks: usize,
    ) -> Result<KvPool<'static>> {
        let geometry = geometry_of(shape, block_tokens, blocks)?;
        // Zeroed once, as in `new`.
        let slab = root(device, |s| -> Result<Tensor<'static>> {
            s.full_dtype(&[blocks, geometry.page_elements()], 0.0, shape.dtype)?
                .named("kv pool")
                .move_out()
        })?;
        KvPool::from_slab(slab, geometry, shape, blocks)
    }
}

impl fmt::Debug for KvPool<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvPool")
            .field("shape", &self.shape)
            .field("stats", &self.stats())
            .finish()
    }
}
