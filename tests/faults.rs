//! Fault injection over a whole training step: for every allocation point k of the step, a run in
//! which allocation k is refused as over budget, and one in which it panics. After each, the scope
//! tree must be consistent (no batch bytes left behind, the model scope exactly as before, nothing to
//! reclaim), the parameters and optimizer untouched, and the next step must succeed.

use std::panic::{AssertUnwindSafe, catch_unwind};

use ndscope::nn::{self, Activation, Init, Mode, Module, Parameters, Sequential};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{Device, Error, Fault, Result, Scope, Tape, Workspace, root};

fn step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut Sequential<'m>,
    opt: &mut Adam<'m>,
) -> Result<f32> {
    let tape = Tape::new(b);
    let x = tape.constant(&b.randn(&[6, 8])?);
    let y = b.from_slice(&[0i64, 1, 2, 3, 0, 1], &[6])?;
    let logits = model.forward(&x, Mode::Train)?.tanh()?.mul_scalar(3.0)?;
    let loss = logits.cross_entropy(&y)?;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    loss.value().to_scalar::<f32>()
}

/// Runs one step in a batch scope of `m` (a workspace cycle when `ws` is given).
fn run_step<'m>(
    m: &Scope<'m>,
    model: &mut Sequential<'m>,
    opt: &mut Adam<'m>,
    ws: Option<&mut Workspace>,
) -> Result<f32> {
    match ws {
        Some(ws) => m.workspace(ws, |b| step(b, model, opt)),
        None => m.named_scope("batch", |b| step(b, model, opt)),
    }
}

fn parameters(model: &Sequential<'_>) -> Vec<Vec<f32>> {
    let mut values = Vec::new();
    model.visit("", &mut |_, t| values.push(t.to_vec::<f32>().unwrap()));
    values
}

const INJECTED: &str = "injected fault";

fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .unwrap_or("");
            if !message.starts_with(INJECTED) {
                default(info);
            }
        }));
    });
}

/// Injects every fault kind at every allocation point of a step; returns how many were injected.
fn every_fault_point(workspace: bool) -> usize {
    quiet_injected_panics();
    let mut ws = Workspace::new("batch");
    root(Device::Cpu, |s| {
        s.named_scope("model", |m| {
            let mut model = nn::mlp(m, &[8, 16, 4], Activation::Relu, Init::KaimingUniform)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-3))?;
            // A first step warms the caches and counts the step's allocations.
            let before = m.stats().allocations;
            run_step(m, &mut model, &mut opt, workspace.then_some(&mut ws))?;
            let points = m.stats().allocations - before;
            assert!(
                points >= 20,
                "a step should allocate at many points, got {points}"
            );
            let mut injected = 0;
            for fault in [Fault::OutOfBudget, Fault::Panic] {
                for k in 1..=points {
                    let (params, steps, model_stats) = (parameters(&model), opt.steps(), m.stats());
                    m.inject_fault(k, fault);
                    let outcome = catch_unwind(AssertUnwindSafe(|| {
                        run_step(m, &mut model, &mut opt, workspace.then_some(&mut ws))
                    }));
                    match (fault, outcome) {
                        (Fault::OutOfBudget, Ok(Err(Error::OutOfMemory { .. }))) => {}
                        (Fault::Panic, Err(payload)) => {
                            let message = payload
                                .downcast_ref::<String>()
                                .cloned()
                                .unwrap_or_default();
                            assert!(message.starts_with(INJECTED), "another panic: {message}");
                        }
                        (_, other) => panic!(
                            "fault {fault:?} at allocation {k}: the step ended with {other:?}"
                        ),
                    }
                    injected += 1;
                    assert!(!m.clear_fault(), "the fault at allocation {k} did not fire");
                    let after = m.stats();
                    assert_eq!(
                        after.live_bytes, model_stats.live_bytes,
                        "{fault:?} at {k}: model bytes changed"
                    );
                    assert_eq!(
                        after.live_tensors, model_stats.live_tensors,
                        "{fault:?} at {k}: model tensors changed"
                    );
                    assert_eq!(
                        after.subtree_bytes, after.live_bytes,
                        "{fault:?} at {k}: a batch scope kept bytes"
                    );
                    assert_eq!(
                        after.reclaimed_tensors, 0,
                        "{fault:?} at {k}: a handle was lost and reclaimed"
                    );
                    // The optimizer writes only after every allocation of the step: a failed step
                    // leaves the model as it was.
                    assert_eq!(
                        parameters(&model),
                        params,
                        "{fault:?} at {k}: a failed step changed parameters"
                    );
                    assert_eq!(opt.steps(), steps);
                    let loss = run_step(m, &mut model, &mut opt, workspace.then_some(&mut ws))?;
                    assert!(loss.is_finite(), "{fault:?} at {k}: the next step failed");
                    assert_ne!(parameters(&model), params);
                }
            }
            assert_eq!(m.stats().ooms, points, "every refusal is counted");
            eprintln!(
                "{} mode: {points} allocation points, {injected} faults injected",
                if workspace { "workspace" } else { "pool" }
            );
            Ok::<_, Error>(injected)
        })
    })
    .unwrap()
}

#[test]
fn every_allocation_point_of_a_pool_step_can_fail() {
    let injected = every_fault_point(false);
    assert!(injected >= 40);
}

#[test]
fn every_allocation_point_of_a_workspace_step_can_fail() {
    let injected = every_fault_point(true);
    assert!(injected >= 40);
}

#[test]
fn a_fault_fires_once_and_can_be_disarmed() {
    root(Device::Cpu, |s| {
        s.inject_fault(3, Fault::OutOfBudget);
        assert!(s.clear_fault());
        assert!(!s.clear_fault());
        for _ in 0..5 {
            s.zeros(&[2])?;
        }
        s.inject_fault(0, Fault::Panic);
        assert!(!s.clear_fault(), "nth = 0 disarms");
        s.inject_fault(1, Fault::OutOfBudget);
        let err = s.zeros(&[4]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfMemory {
                    requested: 16,
                    budget: Some(_),
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("budget"), "{err}");
        assert!(s.zeros(&[4]).is_ok());
        Ok::<_, Error>(())
    })
    .unwrap();
}
