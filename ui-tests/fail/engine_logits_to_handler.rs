// An engine thread that sends a step's logits to an HTTP handler's thread through a channel: the
// handler lives past the step's scope (a thread needs `'static` values), so the logits cannot go.
// Send what the step chose instead: token ids and `f32` log-probabilities (`serve::Event`).
use std::sync::mpsc;

use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::{root, Device, Result, Tensor};

fn main() -> Result<()> {
    let (to_handler, handler) = mpsc::channel::<Tensor<'static>>();
    std::thread::spawn(move || handler.recv().map(|logits| logits.shape().to_vec()));
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::new(m, Gpt2Config::new(64, 32, 16, 1, 2))?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 8)?;
        m.named_scope("engine", |engine| -> Result<()> {
            let mut cache = pool.cache(engine, 32)?;
            engine.scope(|step| -> Result<()> {
                let logits = gpt2.decode(step, &pool, &mut [&mut cache], &[&[1, 2]])?;
                to_handler.send(logits).unwrap();
                Ok(())
            })
        })
    })
}
