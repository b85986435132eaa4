// A server whose shared state (what every HTTP handler holds, so `'static`) keeps the caches of the
// engine's requests: a cache is branded with the engine's scope, which closes when the engine's loop
// ends, so state that outlives it cannot hold one. Hand handlers plain values (`serve::Event`).
use std::sync::{Arc, Mutex};

use ndscope::kv::{CausalLm, KvCache, KvPool};
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::{root, Device, Result};

struct ServerState {
    caches: Mutex<Vec<KvCache<'static>>>,
}

fn main() -> Result<()> {
    let state = Arc::new(ServerState { caches: Mutex::new(Vec::new()) });
    let handlers = state.clone();
    std::thread::spawn(move || handlers.caches.lock().unwrap().len());
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::new(m, Gpt2Config::new(64, 32, 16, 1, 2))?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 8)?;
        m.named_scope("engine", |engine| -> Result<()> {
            let cache = pool.cache(engine, 32)?;
            state.caches.lock().unwrap().push(cache);
            Ok(())
        })
    })
}
