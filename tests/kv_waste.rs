//! KV waste over a mixed-length workload: the paged pool wastes at most 4 % of the bytes it holds
//! (only each sequence's last block is partly empty), against the two designs before it, computed on
//! the same requests: reserving the model's maximum length per request, and growing a buffer by
//! copying it into one twice as large.

use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request};
use ndscope::{Device, Error, root};

mod common;
use common::Lcg;

/// Held and cached token slots summed over every request at every step it was decoded, for a cache
/// that holds `capacity(tokens)` slots when it caches `tokens`.
fn held_and_cached(lives: &[(usize, usize)], capacity: impl Fn(usize) -> usize) -> (usize, usize) {
    let (mut held, mut cached) = (0, 0);
    for &(prompt, generated) in lives {
        // Step k (the prompt's is 0) leaves `prompt + k` tokens cached; the last token chosen is
        // never cached.
        for tokens in prompt..prompt + generated {
            held += capacity(tokens);
            cached += tokens;
        }
    }
    (held, cached)
}

#[test]
fn paged_kv_wastes_under_four_percent_of_what_it_holds() {
    // GPT-2's 1,024 positions at a tiny width: the waste depends on lengths, not on the width.
    let config = Gpt2Config::new(64, 1024, 16, 1, 2);
    root(Device::Cpu, |m| {
        m.set_seed(5);
        let model = Gpt2::new(m, config)?;
        let block = KvPool::BLOCK_TOKENS;
        let pool = KvPool::for_tokens(m, model.kv_shape(), block, 16 * 1024)?;
        let mut engine = Engine::new(&model, &pool, EngineConfig { max_batch: 16 });
        let mut rng = Lcg(9);
        for i in 0..64 {
            let prompt = (0..16 + rng.below(497))
                .map(|j| ((i + j) % 64) as i64)
                .collect();
            let new = 16 + rng.below(241);
            engine.submit(Request {
                prompt,
                options: GenerateOptions::greedy(new),
                arrival: i / 4,
            })?;
        }
        let (mut held, mut cached, mut peak_blocks, mut peak_batch) = (0usize, 0usize, 0, 0);
        let done = engine.run(m, |step| {
            held += step.pool.blocks_used() * step.pool.block_tokens;
            cached += step.pool.tokens_cached;
            peak_blocks = peak_blocks.max(step.pool.blocks_used());
            peak_batch = peak_batch.max(step.batch);
        })?;
        let paged = (held - cached) as f64 / held as f64;
        let lives: Vec<(usize, usize)> = done
            .iter()
            .map(|c| (c.prompt_tokens, c.generation.tokens.len()))
            .collect();
        // The pool's own figures agree with the requests' lengths.
        let (h, c) = held_and_cached(&lives, |t| t.div_ceil(block) * block);
        assert_eq!((h, c), (held, cached));
        let waste = |(h, c): (usize, usize)| (h - c) as f64 / h as f64;
        let max_length = waste(held_and_cached(&lives, |_| 1024));
        let doubling = waste(held_and_cached(&lives, |t| t.next_power_of_two().max(16)));
        println!(
            "KV waste over {} requests: paged (blocks of {block}) {:.2}%, max-length preallocation \
             {:.1}%, grow by doubling {:.1}%; peak {} tokens held in blocks, where {} requests at \
             once reserve {} tokens at the maximum length",
            lives.len(),
            100.0 * paged,
            100.0 * max_length,
            100.0 * doubling,
            peak_blocks * block,
            peak_batch,
            peak_batch * 1024
        );
        assert!(paged <= 0.04, "paged waste {paged}");
        assert!(max_length > 0.5 && doubling > 4.0 * paged);
        Ok::<_, Error>(())
    })
    .unwrap();
}
