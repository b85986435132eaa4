// The server's shape: an engine loop in the model's scope steps an `EngineCore` and sends each
// event's plain values — token ids, their text, `f32` log-probabilities, why a request ended — to a
// handler thread through a channel; the handler's requests come back through another.
use std::sync::mpsc;

use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::serve::{CoreConfig, EngineCore, Event, Finish, GenerateOptions};
use ndscope::{root, Device, Result};

enum ToHandler {
    Token { token: i64, text: String, logprob: f32 },
    Done(Finish),
}

fn main() -> Result<()> {
    let (submit, requests) = mpsc::channel::<Vec<i64>>();
    let (to_handler, updates) = mpsc::channel::<ToHandler>();
    let handler = std::thread::spawn(move || {
        submit.send(vec![1, 2, 3]).unwrap();
        drop(submit);
        let mut tokens = Vec::new();
        for update in updates {
            match update {
                ToHandler::Token { token, text, logprob } => tokens.push((token, text, logprob)),
                ToHandler::Done(finish) => return (tokens, finish),
            }
        }
        unreachable!("the engine ends every request");
    });
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::new(m, Gpt2Config::new(64, 32, 16, 1, 2))?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 8)?;
        m.named_scope("engine", |engine| -> Result<()> {
            let mut core = EngineCore::new(&gpt2, &pool, engine, CoreConfig::default());
            for prompt in requests {
                core.submit(&prompt, &GenerateOptions::greedy(4))?;
            }
            while !core.is_idle() {
                for event in core.step()? {
                    let update = match event {
                        Event::Token { token, logprob, .. } => {
                            ToHandler::Token { token, text: format!("<{token}>"), logprob }
                        }
                        Event::Finished { generation, .. } => ToHandler::Done(generation.finish),
                        Event::Failed { error, .. } => return Err(error),
                    };
                    to_handler.send(update).unwrap();
                }
            }
            Ok(())
        })
    })?;
    let (tokens, finish) = handler.join().unwrap();
    assert_eq!((tokens.len(), finish), (4, Finish::Length));
    Ok(())
}
