//! Memory: the caching pools (size classes for small blocks, segments for large ones, releases across
//! trees), workspace arenas, block headers, statistics, and the raw allocators of each device.
//! Together with `scope::node` and the CUDA backend's `memory`, the only place that handles raw
//! memory.

pub(crate) mod arena;
pub(crate) mod block;
pub(crate) mod classes;
pub(crate) mod lazy_free;
pub(crate) mod mapped;
pub(crate) mod pages;
pub(crate) mod plan;
pub(crate) mod pool;
pub(crate) mod raw;
pub(crate) mod reclaim;
pub(crate) mod segments;
pub(crate) mod stats;
