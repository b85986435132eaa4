//! Planned workspaces: a training step's cycle is recorded once, solved into fixed offsets, and
//! replayed; the plan is close to the lower bound (the largest total live at once) where the bump
//! arena needs much more; a cycle that diverges is still correct and is planned anew; the numbers a
//! replayed cycle computes are the numbers an unplanned one computes; and a `StepGraph` runs its
//! step in such a workspace (on the host, always eagerly; tests/cuda.rs captures it on a GPU).

use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{Device, Error, Input, Result, Scope, StepGraph, Tape, Workspace, root};

mod common;
use common::gpt::Gpt;

const FEATURES: usize = 64;
const CLASSES: usize = 10;
const BATCH: usize = 32;

/// A deterministic batch: features in [-1, 1), labels from a fixed rule.
fn batch(step: u64) -> (Vec<f32>, Vec<i64>) {
    let x = (0..BATCH * FEATURES)
        .map(|i| ((i as u64 * 37 + step * 11) % 97) as f32 / 48.5 - 1.0)
        .collect();
    let y = (0..BATCH)
        .map(|r| ((r as u64 * 3 + step) % CLASSES as u64) as i64)
        .collect();
    (x, y)
}

fn mlp_step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut nn::Sequential<'m>,
    opt: &mut Adam<'m>,
    step: u64,
) -> Result<f32> {
    let (x, y) = batch(step);
    let x = b.from_slice(&x, &[BATCH, FEATURES])?;
    let y = b.from_slice(&y, &[BATCH])?;
    let tape = Tape::new(b);
    let loss = model
        .forward(&tape.constant(&x), Mode::Train)?
        .cross_entropy(&y)?;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    loss.value().to_scalar::<f32>()
}

/// The MLP and its AdamW optimizer, in the model scope `m`.
fn mlp_and_adamw<'m>(m: &Scope<'m>) -> Result<(nn::Sequential<'m>, Adam<'m>)> {
    let model = nn::mlp(
        m,
        &[FEATURES, 128, CLASSES],
        Activation::Relu,
        Init::KaimingUniform,
    )?;
    let opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-4))?;
    Ok((model, opt))
}

/// Trains the MLP for `steps` steps in `ws` (or in plain scopes for `None`); returns the losses.
fn train_mlp(ws: Option<&mut Workspace>, steps: u64) -> Result<Vec<f32>> {
    root(Device::Cpu, |s| {
        s.set_seed(11);
        s.named_scope("model", |m| {
            let (mut model, mut opt) = mlp_and_adamw(m)?;
            let mut losses = Vec::new();
            let mut ws = ws;
            for i in 0..steps {
                let loss = match ws.as_deref_mut() {
                    Some(ws) => m.workspace(ws, |b| mlp_step(b, &mut model, &mut opt, i))?,
                    None => m.named_scope("batch", |b| mlp_step(b, &mut model, &mut opt, i))?,
                };
                losses.push(loss);
            }
            Ok(losses)
        })
    })
}

#[test]
fn an_mlp_step_replays_its_plan_near_the_lower_bound() -> Result<()> {
    let mut ws = Workspace::planned("batch");
    let planned = train_mlp(Some(&mut ws), 6)?;
    let eager = train_mlp(None, 6)?;
    assert_eq!(
        planned, eager,
        "a replayed cycle computes what a plain scope computes"
    );

    let plan = ws.plan().expect("planned after the first cycle");
    println!("MLP step: {plan:?}");
    assert_eq!(ws.plans_solved(), 1);
    assert_eq!(ws.replayed_cycles(), 5);
    assert!(ws.last_cycle_replayed());
    assert_eq!(ws.last_cycle_spills(), 0);
    assert_eq!(
        ws.spills(),
        plan.slots().len() as u64,
        "only the first cycle spilled"
    );
    assert_eq!(ws.capacity(), plan.peak());
    assert!(
        plan.ratio_to_lower_bound() <= 1.05,
        "peak {} against lower bound {}",
        plan.peak(),
        plan.lower_bound()
    );
    assert!(plan.peak() < plan.bump_size());

    let mut bump = Workspace::new("batch");
    train_mlp(Some(&mut bump), 3)?;
    // The bump workspace learns its size from a first cycle that spilled everything, so it holds at
    // least what a bump arena needs for the cycle.
    assert!(bump.capacity() >= plan.bump_size());
    assert!(ws.capacity() * 2 < bump.capacity());
    Ok(())
}

fn gpt_step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut Gpt<'m>,
    opt: &mut Adam<'m>,
    step: u64,
) -> Result<f32> {
    let tape = Tape::new(b);
    let loss = model.loss(&tape, b, step)?;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    loss.value().to_scalar::<f32>()
}

#[test]
fn a_transformer_step_replays_its_plan_near_the_lower_bound() -> Result<()> {
    let mut ws = Workspace::planned("batch");
    root(Device::Cpu, |s| {
        s.set_seed(3);
        s.named_scope("model", |m| {
            let mut model = Gpt::new(m)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-2))?;
            for i in 0..4 {
                m.workspace(&mut ws, |b| gpt_step(b, &mut model, &mut opt, i))?;
            }
            Ok::<_, Error>(())
        })
    })?;
    let plan = ws.plan().expect("planned");
    println!("GPT step: {plan:?}");
    assert_eq!((ws.plans_solved(), ws.replayed_cycles()), (1, 3));
    assert!(
        plan.ratio_to_lower_bound() <= 1.05,
        "peak {} against lower bound {}",
        plan.peak(),
        plan.lower_bound()
    );
    assert!(plan.peak() * 2 < plan.bump_size());
    Ok(())
}

/// A cycle that allocates `first`, then `second` while `first` is alive, and frees `first` early
/// when `early` is set; returns what `first` and `second` hold at the end.
fn two_buffers(w: &Scope<'_>, early: bool) -> Result<(Vec<f32>, Vec<f32>)> {
    let a = w.full(&[256], 1.0)?;
    let first = a.add_scalar(1.0)?; // 2.0
    if early {
        drop(a);
    }
    let second = first.mul_scalar(3.0)?; // 6.0: in the recorded cycle, it may take a's bytes
    Ok((first.to_vec()?, second.to_vec()?))
}

#[test]
fn a_cycle_that_frees_later_than_recorded_diverges_and_keeps_its_values() -> Result<()> {
    let mut ws = Workspace::planned("cycle");
    root(Device::Cpu, |s| {
        // Recorded: `a` is freed before `second` is allocated, so the plan lets them share bytes.
        s.workspace(&mut ws, |w| two_buffers(w, true))?;
        let plan = ws.plan().expect("planned").clone();
        assert_eq!(plan.slots()[2].offset, plan.slots()[0].offset);
        // Here `a` is still alive when `second` is allocated: the cycle must leave the plan.
        let (first, second) = s.workspace(&mut ws, |w| two_buffers(w, false))?;
        assert_eq!((first, second), (vec![2.0; 256], vec![6.0; 256]));
        assert!(!ws.last_cycle_replayed());
        assert_eq!(ws.plans_solved(), 2, "the diverging cycle was planned anew");
        let replanned = ws.plan().expect("planned");
        assert_ne!(replanned.slots()[2].offset, replanned.slots()[0].offset);
        // The new plan replays.
        let values = s.workspace(&mut ws, |w| two_buffers(w, false))?;
        assert_eq!(values, (vec![2.0; 256], vec![6.0; 256]));
        assert!(ws.last_cycle_replayed());
        Ok::<_, Error>(())
    })
}

#[test]
fn a_cycle_of_another_shape_is_planned_anew_and_both_plans_replay() -> Result<()> {
    let mut ws = Workspace::planned("cycle");
    root(Device::Cpu, |s| {
        let sum = |n: usize, ws: &mut Workspace| {
            s.workspace(ws, |w| {
                let x = w.arange(0.0f32, n as f32, 1.0)?;
                x.mul(&x)?.sum_all()?.to_scalar::<f32>()
            })
        };
        assert_eq!(sum(100, &mut ws)?, 328_350.0);
        assert_eq!(sum(100, &mut ws)?, 328_350.0);
        assert!(ws.last_cycle_replayed());
        assert_eq!(sum(10, &mut ws)?, 285.0);
        assert!(!ws.last_cycle_replayed());
        assert_eq!(sum(10, &mut ws)?, 285.0);
        assert!(ws.last_cycle_replayed());
        assert_eq!(ws.plans_solved(), 2);
        // Both plans are kept: alternating shapes (a last, smaller batch per epoch) replay without
        // planning again.
        for _ in 0..3 {
            assert_eq!(sum(100, &mut ws)?, 328_350.0);
            assert!(ws.last_cycle_replayed());
            assert_eq!(sum(10, &mut ws)?, 285.0);
            assert!(ws.last_cycle_replayed());
        }
        assert_eq!(ws.plans_solved(), 2);
        Ok::<_, Error>(())
    })
}

#[test]
fn results_moved_out_of_a_planned_cycle_survive_it() -> Result<()> {
    let mut ws = Workspace::planned("cycle");
    root(Device::Cpu, |s| {
        for step in 0..4 {
            let kept = s.workspace(&mut ws, |w| {
                let x = w.full(&[1000], step as f64)?;
                let y = x.add_scalar(1.0)?;
                w.ret(y)
            })?;
            // Overwrite the arena with another cycle before reading `kept`.
            s.workspace(&mut ws, |w| w.full(&[1000], -1.0).map(drop))?;
            assert_eq!(kept.to_vec::<f32>()?, vec![step as f32 + 1.0; 1000]);
        }
        Ok::<_, Error>(())
    })
}

#[test]
fn a_panicking_planned_cycle_returns_every_byte() -> Result<()> {
    let mut ws = Workspace::planned("cycle");
    root(Device::Cpu, |s| {
        s.workspace(&mut ws, |w| w.ones(&[512]).map(drop))?;
        let before = s.stats();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            s.workspace(&mut ws, |w| {
                let _x = w.ones(&[512]).unwrap();
                let _y = w.ones(&[512]).unwrap(); // diverges: the recorded cycle had one allocation
                panic!("a step failed");
            })
        }));
        assert!(caught.is_err());
        let after = s.stats();
        assert_eq!(after.subtree_bytes, before.subtree_bytes);
        assert_eq!(after.live_tensors, before.live_tensors);
        // The workspace still works: the panicking cycle was planned and the next one replays it.
        s.workspace(&mut ws, |w| {
            let _x = w.ones(&[512])?;
            w.ones(&[512]).map(drop)
        })?;
        assert!(ws.last_cycle_replayed());
        Ok::<_, Error>(())
    })
}

#[test]
fn the_dump_and_the_timeline_show_the_plan() -> Result<()> {
    let mut ws = Workspace::planned("batch");
    root(Device::Cpu, |s| {
        let cycle = |ws: &mut Workspace| {
            s.workspace(ws, |w| {
                let x = w.ones(&[256])?;
                let y = x.add_scalar(1.0)?;
                drop(x);
                let _z = y.mul_scalar(2.0)?;
                Ok::<_, Error>(s.dump())
            })
        };
        let first = cycle(&mut ws)?;
        assert!(
            first.contains("[workspace \"batch\" arena 0 B, recording its first cycle]"),
            "{first}"
        );
        s.record_timeline();
        let second = cycle(&mut ws)?;
        let timeline = s.take_timeline();
        assert!(
            second.contains(
                "planned: 3 slots, peak 2.0 KiB (1.00x lower bound 2.0 KiB; bump 3.0 KiB), this cycle replays it"
            ),
            "{second}"
        );
        let slots: Vec<Option<u32>> = timeline
            .events()
            .iter()
            .filter(|e| e.scope == "batch")
            .map(|e| e.slot)
            .collect();
        // alloc 0, alloc 1, free 0, alloc 2, then the close frees 2 and 1.
        assert_eq!(
            slots,
            [Some(0), Some(1), Some(0), Some(2), Some(2), Some(1)]
        );
        assert!(timeline.to_json().contains("\"slot\": 2"));
        Ok::<_, Error>(())
    })
}

/// The MLP step of `train_mlp` through a [`StepGraph`] on the host: every call runs eagerly in the
/// graph's planned workspace.
fn train_mlp_graph(steps: u64) -> Result<(Vec<f32>, [u64; 3], u64)> {
    root(Device::Cpu, |s| {
        s.set_seed(11);
        s.named_scope("model", |m| {
            let (mut model, mut opt) = mlp_and_adamw(m)?;
            let mut step = StepGraph::new("batch", |b, inputs| {
                let tape = Tape::new(b);
                let loss = model
                    .forward(&tape.constant(&inputs[0]), Mode::Train)?
                    .cross_entropy(&inputs[1])?;
                let grads = tape.backward(&loss)?;
                opt.step(&mut model, &grads)?;
                Ok(loss.value().clone())
            });
            let mut losses = Vec::new();
            for i in 0..steps {
                let (x, y) = batch(i);
                let inputs = [Input::new(&x, &[BATCH, FEATURES]), Input::new(&y, &[BATCH])];
                losses.push(step.run(m, &inputs)?);
            }
            Ok((
                losses,
                [step.eager_steps(), step.captures(), step.replays()],
                step.workspace().replayed_cycles(),
            ))
        })
    })
}

#[test]
fn a_step_graph_on_the_host_runs_every_step_eagerly_in_its_plan() -> Result<()> {
    let (losses, counts, replayed) = train_mlp_graph(6)?;
    assert_eq!(
        losses,
        train_mlp(None, 6)?,
        "the same numbers as plain scopes"
    );
    assert_eq!(counts, [6, 0, 0]);
    assert_eq!(
        replayed, 5,
        "planned by the first step, replayed by the others"
    );
    Ok(())
}

#[test]
fn a_step_graph_wants_its_loss_as_one_float() -> Result<()> {
    root(Device::Cpu, |m| {
        let mut step = StepGraph::new("step", |b, inputs| {
            b.ones(&[2]).map(|t| t.add(&inputs[0]))?
        });
        let x = [1.0f32, 2.0];
        let err = step.run(m, &[Input::new(&x, &[2])]).unwrap_err();
        assert!(
            err.to_string().contains(
                "the step must return its loss as one float element, got a f32 tensor of 2 elements"
            ),
            "{err}"
        );
        let mut step = StepGraph::new("step", |_, inputs| inputs[0].sum_all());
        let y = [1i64, 2];
        let err = step.run(m, &[Input::new(&y, &[2])]).unwrap_err();
        assert!(matches!(err, Error::InvalidShape { .. }), "{err}");
        // A float scalar of another dtype is read as f32.
        let mut step = StepGraph::new("step", |_, inputs| inputs[0].sum_all());
        let z = [1.5f64, 2.0];
        assert_eq!(step.run(m, &[Input::new(&z, &[2])])?, 3.5);
        Ok::<_, Error>(())
    })
}
