//! Recomputation, PyTorch's activation checkpointing (`Var::recompute`, `nn::Recomputed`): a
//! recomputed step computes
//! the plain step's loss and gradients bit for bit on the host — with dropout, autocast and nested
//! segments — in less memory, and a segment that panics gives every byte back.

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;

use ndscope::nn::{
    AttentionOptions, Embedding, Init, LayerNorm, Linear, Mode, Module, Parameters,
    PositionalEmbedding, Recomputed, TransformerBlock,
};
use ndscope::{DType, Device, Error, Result, Scope, Segment, Tape, Tensor, Var, root};

ndscope::model! {
    /// A small decoder whose blocks run plain or checkpointed.
    struct Decoder<'m> {
        tokens: Embedding<'m>,
        positions: PositionalEmbedding<'m>,
        blocks: Vec<TransformerBlock<'m>>,
        ln: LayerNorm<'m>,
        head: Linear<'m>,
    }
}

const VOCAB: usize = 11;
const WIDTH: usize = 16;
const LEN: usize = 12;

/// How the blocks run.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Blocks {
    Plain,
    /// Each block a segment.
    Recomputed,
    /// Pairs of blocks a segment, the first of each pair a segment inside it.
    Nested,
}

/// Two blocks, the first checkpointed inside the segment the pair makes.
struct Pair<'m> {
    first: Recomputed<TransformerBlock<'m>>,
    second: TransformerBlock<'m>,
}

impl<'m> Segment<'m> for Pair<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.second
            .forward(&self.first.forward(x, Mode::Train)?, Mode::Train)
    }
}

fn decoder<'m>(s: &Scope<'m>, dtype: DType, dropout: f64) -> Result<Decoder<'m>> {
    s.set_seed(7);
    let opts = AttentionOptions {
        causal: true,
        dropout,
    };
    let init = Init::Normal(0.2);
    let mut model = Decoder {
        tokens: Embedding::new(s, VOCAB, WIDTH, init)?,
        positions: PositionalEmbedding::new(s, LEN, WIDTH, init)?,
        blocks: (0..4)
            .map(|_| TransformerBlock::new(s, WIDTH, 2, opts, init))
            .collect::<Result<_>>()?,
        ln: LayerNorm::new(s, WIDTH)?,
        head: Linear::new(s, WIDTH, VOCAB, init)?,
    };
    model.visit_mut(&mut |p| {
        *p = p.to_dtype(dtype)?;
        Ok(())
    })?;
    Ok(model)
}

/// One training step's loss and gradients (in `visit` order, as f64), and the peak bytes of the
/// step's scope. The tree's generator is reseeded first, so dropout draws the same masks each time.
fn step<'m>(
    s: &Scope<'m>,
    model: &Decoder<'m>,
    blocks: Blocks,
    autocast: Option<DType>,
) -> Result<(f64, Vec<Vec<f64>>, usize)> {
    s.set_seed(99);
    s.named_scope("batch", |batch| {
        if let Some(dtype) = autocast {
            batch.autocast(dtype)?;
        }
        let (loss, grads) = loss_and_gradients(batch, model, blocks)?;
        Ok((loss, grads, batch.stats().peak_bytes))
    })
}

/// The next-token loss of a fixed batch, and every parameter's gradient (in `visit` order, as f64),
/// computed in `batch`.
fn loss_and_gradients<'m: 'b, 'b>(
    batch: &'b Scope<'b>,
    model: &Decoder<'m>,
    blocks: Blocks,
) -> Result<(f64, Vec<Vec<f64>>)> {
    let tape = Tape::new(batch);
    let ids: Vec<i64> = (0..2 * LEN as i64)
        .map(|i| (i * 7 + 3) % VOCAB as i64)
        .collect();
    let ids = batch.from_slice(&ids, &[2, LEN])?;
    let mut x = model
        .positions
        .forward(&model.tokens.forward(&tape, &ids)?)?;
    match blocks {
        Blocks::Plain => {
            for block in &model.blocks {
                x = block.forward(&x, Mode::Train)?;
            }
        }
        Blocks::Recomputed => {
            for block in &model.blocks {
                x = Recomputed::new(block.clone()).forward(&x, Mode::Train)?;
            }
        }
        Blocks::Nested => {
            for pair in model.blocks.chunks(2) {
                x = x.recompute(Pair {
                    first: Recomputed::new(pair[0].clone()),
                    second: pair[1].clone(),
                })?;
            }
        }
    }
    let logits = model
        .head
        .forward(&model.ln.forward(&x, Mode::Train)?, Mode::Train)?;
    let labels = ids.reshape(&[2 * LEN])?;
    let loss = logits.reshape(&[2 * LEN, VOCAB])?.cross_entropy(&labels)?;
    let grads = tape.backward(&loss)?;
    let mut found = Vec::new();
    model.visit("", &mut |name, p| {
        let g = grads
            .get(p)
            .unwrap_or_else(|| panic!("{name} got no gradient"));
        found.push(g.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap());
    });
    let loss = loss.value().to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((loss, found))
}

fn assert_same(
    what: &str,
    plain: &(f64, Vec<Vec<f64>>, usize),
    other: &(f64, Vec<Vec<f64>>, usize),
) {
    assert_eq!(plain.0.to_bits(), other.0.to_bits(), "{what}: loss");
    assert_eq!(plain.1.len(), other.1.len());
    for (k, (a, b)) in plain.1.iter().zip(&other.1).enumerate() {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{what}: gradient {k} differs");
    }
}

#[test]
fn checkpointed_blocks_give_the_plain_step_bit_for_bit_with_dropout_in_less_memory() -> Result<()> {
    root(Device::Cpu, |s| {
        let model = decoder(s, DType::F64, 0.2)?;
        let plain = step(s, &model, Blocks::Plain, None)?;
        let checkpointed = step(s, &model, Blocks::Recomputed, None)?;
        let nested = step(s, &model, Blocks::Nested, None)?;
        assert_same("checkpointed", &plain, &checkpointed);
        assert_same("nested", &plain, &nested);
        assert!(
            checkpointed.2 < plain.2,
            "peak with checkpointing {} should be below {} without",
            checkpointed.2,
            plain.2
        );
        // Dropout is on: a step with other draws differs (the equality above is not vacuous).
        s.set_seed(1);
        let block_sum = || {
            s.scope(|b| -> Result<f64> {
                let tape = Tape::new(b);
                let x = tape.constant(&pattern(b)?);
                let y = model.blocks[0].forward(&x, Mode::Train)?;
                y.value().sum_all()?.to_scalar::<f64>()
            })
        };
        let (other, again) = (block_sum()?, block_sum()?);
        assert_ne!(other.to_bits(), again.to_bits(), "dropout draws new masks");
        Ok(())
    })
}

/// An input of varied values, the same in every call.
fn pattern<'s>(b: &Scope<'s>) -> Result<Tensor<'s>> {
    let data: Vec<f64> = (0..LEN * WIDTH)
        .map(|i| ((i * 37) % 19) as f64 / 9.0 - 1.0)
        .collect();
    b.from_slice(&data, &[1, LEN, WIDTH])
}

#[test]
fn checkpointed_blocks_under_autocast_give_the_plain_step_bit_for_bit() -> Result<()> {
    root(Device::Cpu, |s| {
        let model = decoder(s, DType::F32, 0.1)?;
        for dtype in [DType::BF16, DType::F16] {
            let plain = step(s, &model, Blocks::Plain, Some(dtype))?;
            let checkpointed = step(s, &model, Blocks::Recomputed, Some(dtype))?;
            assert_same(&format!("autocast {dtype}"), &plain, &checkpointed);
        }
        Ok(())
    })
}

#[test]
fn a_checkpoint_on_an_inference_tape_is_the_plain_forward() -> Result<()> {
    root(Device::Cpu, |s| {
        let model = decoder(s, DType::F32, 0.0)?;
        let block = &model.blocks[0];
        s.scope(|b| {
            let tape = Tape::no_grad(b);
            let x = tape.constant(&b.randn(&[2, LEN, WIDTH])?);
            let plain = block
                .forward(&x, Mode::Eval)?
                .into_value()
                .to_vec::<f32>()?;
            let checkpointed = Recomputed::new(block.clone())
                .forward(&x, Mode::Eval)?
                .into_value()
                .to_vec::<f32>()?;
            assert_eq!(plain, checkpointed);
            assert!(b.stats().allocations > 0);
            Ok(())
        })
    })
}

/// A segment that computes `tanh(x * w)`, and panics (or fails) when run for the `fail_on`-th time.
/// The tape keeps a segment until the backward pass, so it owns what it uses (a counted cell here).
struct Flaky<'m> {
    w: Tensor<'m>,
    runs: Rc<Cell<usize>>,
    fail_on: usize,
    panics: bool,
}

impl<'m> Segment<'m> for Flaky<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.runs.set(self.runs.get() + 1);
        let y = x.mul(&x.tape().param(&self.w))?.tanh()?;
        if self.runs.get() == self.fail_on {
            if self.panics {
                panic!("the segment fails while it is recomputed");
            }
            // Watches a parameter the first pass did not: a segment that is not deterministic.
            return y.mul(&x.tape().param(&self.w))?.tanh();
        }
        Ok(y)
    }
}

/// A step through a `Flaky` segment that fails (panics, or watches another parameter) when the
/// backward pass recomputes it.
fn flaky_step<'m>(
    s: &Scope<'m>,
    w: &Tensor<'m>,
    runs: &Rc<Cell<usize>>,
    panics: bool,
) -> Result<()> {
    s.scope(|batch| {
        let tape = Tape::new(batch);
        let x = tape.constant(&batch.randn(w.shape())?);
        let segment = Flaky {
            w: w.clone(),
            runs: Rc::clone(runs),
            fail_on: 2,
            panics,
        };
        let loss = x.recompute(segment)?.sum_all()?;
        tape.backward(&loss).map(|_| ())
    })
}

#[test]
fn a_segment_that_panics_while_recomputed_returns_every_byte() {
    let runs = Rc::new(Cell::new(0));
    let out = root(Device::Cpu, |s| -> Result<()> {
        let w = s.randn(&[64, 64])?;
        let before = s.stats().subtree_bytes;
        let result = catch_unwind(AssertUnwindSafe(|| flaky_step(s, &w, &runs, true)));
        assert!(result.is_err(), "the recomputation panicked");
        assert_eq!(
            runs.get(),
            2,
            "the segment ran in the forward pass and again"
        );
        assert_eq!(
            s.stats().subtree_bytes,
            before,
            "every byte of the step came back"
        );
        Ok(())
    });
    out.unwrap();
}

#[test]
fn a_segment_that_watches_other_parameters_when_recomputed_is_an_error() -> Result<()> {
    let runs = Rc::new(Cell::new(0));
    root(Device::Cpu, |s| {
        let w = s.randn(&[4, 4])?;
        let err = flaky_step(s, &w, &runs, false).unwrap_err();
        let Error::Autograd { op, reason } = &err else {
            panic!("expected an autograd error, got {err}");
        };
        assert_eq!(*op, "recompute");
        assert!(reason.contains("must run the same ops"), "{reason}");
        Ok(())
    })
}

#[test]
fn segment_scopes_show_in_the_dump_while_they_run() -> Result<()> {
    /// Records the dump of the tree from inside the segment.
    struct Dumping {
        seen: Rc<RefCell<Vec<String>>>,
    }
    impl<'m> Segment<'m> for Dumping {
        fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
        where
            'm: 's,
        {
            self.seen.borrow_mut().push(x.tape().scope().dump());
            x.square()
        }
    }
    let seen = Rc::new(RefCell::new(Vec::new()));
    root(Device::Cpu, |s| {
        let w = s.ones(&[3])?;
        s.named_scope("batch", |batch| -> Result<()> {
            let tape = Tape::new(batch);
            let y = tape.param(&w).recompute(Dumping {
                seen: Rc::clone(&seen),
            })?;
            let grads = tape.backward(&y.sum_all()?)?;
            assert_eq!(grads.get(&w).unwrap().to_vec::<f32>()?, vec![2.0; 3]);
            Ok(())
        })
    })?;
    let seen = seen.borrow();
    assert_eq!(seen.len(), 2);
    // The first pass runs in "recompute" under the batch, the recomputation in its own scope.
    assert!(seen[0].contains("    scope \"recompute\""), "{}", seen[0]);
    assert!(
        seen[1].contains("    scope \"recompute (backward)\""),
        "{}",
        seen[1]
    );
    assert!(!seen[1].contains("scope \"checkpoint\""), "{}", seen[1]);
    Ok(())
}

#[test]
fn a_checkpointed_step_replays_its_planned_workspace_from_the_arena_alone() -> Result<()> {
    use ndscope::Workspace;
    root(Device::Cpu, |s| {
        let model = decoder(s, DType::F32, 0.1)?;
        let plain = step(s, &model, Blocks::Recomputed, None)?;
        let mut ws = Workspace::planned("batch");
        for cycle in 0..4 {
            s.set_seed(99);
            let (loss, grads) = s.workspace(&mut ws, |batch| {
                loss_and_gradients(batch, &model, Blocks::Recomputed)
            })?;
            assert_same(&format!("cycle {cycle}"), &plain, &(loss, grads, 0));
            if cycle > 0 {
                // The segments' scopes allocate in the cycle's arena, so the plan covers them.
                assert!(ws.last_cycle_replayed(), "cycle {cycle} replays the plan");
                assert_eq!(ws.last_cycle_spills(), 0, "cycle {cycle}");
            }
        }
        assert_eq!(ws.plans_solved(), 1);
        Ok(())
    })
}

#[test]
fn a_step_graph_runs_a_checkpointed_step_as_the_plain_one() -> Result<()> {
    use ndscope::nn::{self, Activation};
    use ndscope::optim::{Adam, AdamConfig, Optimizer};
    use ndscope::{Input, StepGraph};
    let run = |checkpoint: bool| -> Result<Vec<f32>> {
        root(Device::Cpu, |m| {
            m.set_seed(3);
            let mut model = nn::mlp(m, &[16, 32, 4], Activation::Relu, Init::KaimingUniform)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-2))?;
            let mut step = StepGraph::new("step", |b, inputs| {
                let tape = Tape::new(b);
                let x = tape.constant(&inputs[0]);
                let logits = if checkpoint {
                    Recomputed::new(model.clone()).forward(&x, Mode::Train)?
                } else {
                    model.forward(&x, Mode::Train)?
                };
                let loss = logits.cross_entropy(&inputs[1])?;
                let grads = tape.backward(&loss)?;
                opt.step(&mut model, &grads)?;
                Ok(loss.value().clone())
            });
            let x: Vec<f32> = (0..8 * 16)
                .map(|i| ((i * 13) % 7) as f32 / 3.0 - 1.0)
                .collect();
            let y: Vec<i64> = (0..8).map(|i| i % 4).collect();
            (0..5)
                .map(|_| step.run(m, &[Input::new(&x, &[8, 16]), Input::new(&y, &[8])]))
                .collect()
        })
    };
    let plain = run(false)?;
    assert_eq!(run(true)?, plain, "every loss, bit for bit");
    assert!(plain[4] < plain[0], "it trains: {plain:?}");
    Ok(())
}
