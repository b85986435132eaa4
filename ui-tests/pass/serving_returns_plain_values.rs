// What a request may hand back: generated token ids, `f32` log-probabilities and scores, its
// cache's figures; and a finished cache moved to the parent scope on purpose with `ret`, where the
// parent's own steps keep decoding with it.
use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::serve::{generate, GenerateOptions};
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::new(m, Gpt2Config::new(64, 32, 16, 1, 2))?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 8)?;
        let out = generate(&gpt2, m, &pool, &[1, 2, 3], &GenerateOptions::greedy(4))?;
        let tokens: Vec<i64> = out.tokens;
        let scores: Vec<f32> = out.logprobs;
        let best: f32 = m.scope(|request| -> Result<f32> {
            let mut cache = pool.cache(request, 16)?;
            request.scope(|step| -> Result<f32> {
                let logits = gpt2.decode(step, &pool, &mut [&mut cache], &[&[1, 2, 3]])?;
                logits.max(&[-1], false)?.to_vec::<f32>().map(|v| v[0])
            })
        })?;
        m.scope(|session| -> Result<()> {
            let kept = session.scope(|request| {
                let mut cache = pool.cache(request, 16)?;
                request.scope(|step| {
                    gpt2.decode(step, &pool, &mut [&mut cache], &[&[4, 5]]).map(drop)
                })?;
                request.ret(cache)
            })?;
            let mut kept = kept;
            session.scope(|step| gpt2.decode(step, &pool, &mut [&mut kept], &[&[6]]).map(drop))?;
            assert_eq!(kept.len(), 3);
            Ok(())
        })?;
        println!("{tokens:?} {scores:?} {best}");
        Ok(())
    })
}
