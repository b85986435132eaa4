// One request's forward pass reading another request's KV cache: `decode` takes caches of the very
// scope its step was opened in, so request B cannot pass request A's cache, even while A is open.
use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::new(m, Gpt2Config::new(64, 32, 16, 1, 2))?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 8)?;
        m.scope(|a| -> Result<()> {
            let mut cache_a = pool.cache(a, 32)?;
            a.scope(|b| -> Result<()> {
                b.scope(|step| -> Result<()> {
                    gpt2.decode(step, &pool, &mut [&mut cache_a], &[&[1, 2, 3]])?;
                    Ok(())
                })
            })
        })
    })
}
