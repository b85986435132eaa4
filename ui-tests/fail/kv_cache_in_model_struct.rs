// A server that keeps each request's KV cache in a list beside the model: the cache is branded with
// the request's scope, which closes when the request returns, so a model-lifetime list cannot hold
// it. Return the generated tokens (plain values), or `ret` the cache to the parent scope on purpose.
use ndscope::kv::{KvCache, KvPool, KvShape};
use ndscope::{root, DType, Device, Result};

struct Server<'m> {
    pool: KvPool<'m>,
    caches: Vec<KvCache<'m>>,
}

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let shape = KvShape { layers: 1, heads: 2, head_width: 8, dtype: DType::F32 };
        let mut server = Server { pool: KvPool::new(m, shape, 16, 8)?, caches: Vec::new() };
        m.scope(|request| -> Result<()> {
            let cache = server.pool.cache(request, 32)?;
            server.caches.push(cache);
            Ok(())
        })
    })
}
