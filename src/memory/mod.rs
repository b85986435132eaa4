//! Host memory: the caching pool, workspace arenas, block headers and statistics. Together with
//! `scope::node`, the only place that handles raw memory.

pub(crate) mod arena;
pub(crate) mod block;
pub(crate) mod pool;
pub(crate) mod stats;
