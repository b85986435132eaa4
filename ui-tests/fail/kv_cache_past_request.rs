// Keeping a request's KV cache after the request: the closure's result cannot name the request's
// scope. A finished cache that must live on is moved to the parent on purpose with `ret`.
use ndscope::kv::{KvPool, KvShape};
use ndscope::{root, DType, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let shape = KvShape { layers: 1, heads: 2, head_width: 8, dtype: DType::F32 };
        let pool = KvPool::new(m, shape, 16, 8)?;
        let cache = m.scope(|request| pool.cache(request, 32))?;
        println!("{} tokens", cache.len());
        Ok(())
    })
}
