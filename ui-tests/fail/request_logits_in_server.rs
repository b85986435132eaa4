// A server that keeps the last step's logits beside the model: they belong to the step's scope.
// Keep what the step chose (token ids, `f32` scores) instead.
use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::{root, Device, Result, Tensor};

struct Server<'m> {
    model: Gpt2<'m>,
    last_logits: Option<Tensor<'m>>,
}

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let model = Gpt2::new(m, Gpt2Config::new(64, 32, 16, 1, 2))?;
        let pool = KvPool::new(m, model.kv_shape(), 16, 8)?;
        let mut server = Server { model, last_logits: None };
        m.scope(|request| -> Result<()> {
            let mut cache = pool.cache(request, 32)?;
            request.scope(|step| -> Result<()> {
                let logits = server.model.decode(step, &pool, &mut [&mut cache], &[&[1, 2]])?;
                server.last_logits = Some(logits);
                Ok(())
            })
        })
    })
}
