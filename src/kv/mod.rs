//! Paged KV caches: the keys and values a causal model keeps per request while it generates.
//!
//! A [`KvPool`] is a slab of fixed-size blocks in the model's scope, shared by every request; a
//! [`KvCache`] is one request's table of blocks, branded with the request's scope so that the
//! compiler refuses a program that keeps it past the request, stores it in the model, or hands it
//! to another request's forward pass. A cache grows a block at a time (only its last block is ever
//! partly empty), shares a prompt's blocks with its forks copy-on-write, and gives every block back
//! when it is dropped — when its scope closes, on an error, or while a panic unwinds.
//!
//! A model that decodes against these caches implements [`CausalLm`]; `ndscope::serve` generates
//! text and serves many requests with any such model.
//!
//! ```
//! use ndscope::kv::{KvPool, KvShape};
//! use ndscope::{DType, Device, root};
//!
//! root(Device::Cpu, |model| {
//!     let shape = KvShape { layers: 2, heads: 4, head_width: 16, dtype: DType::F32 };
//!     let pool = KvPool::new(model, shape, 16, 64)?; // 64 blocks of 16 tokens
//!     let tokens = model.scope(|request| {
//!         let cache = pool.cache(request, 100)?; // promises the blocks of 100 tokens
//!         assert_eq!(pool.stats().blocks_promised, 7);
//!         Ok::<_, ndscope::Error>(cache.len())
//!     })?;
//!     assert_eq!(tokens, 0);
//!     assert_eq!(pool.stats().blocks_free, 64); // the request's scope closed: all back
//!     Ok::<_, ndscope::Error>(())
//! })?;
//! # Ok::<(), ndscope::Error>(())
//! ```

mod cache;
mod pool;
mod step;

pub use cache::{KvCache, KvUsage};
pub use pool::{KvPool, KvPoolStats, KvShape};
pub use step::{CausalLm, KvStep};
