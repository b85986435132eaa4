//! A step's tensors belong to the step: results of ops on a tape go to the tape's scope whatever
//! their operands' owners, allocations in a scope while a child is open are counted and shown, and
//! a strict scope refuses them with an error that says what to do.

use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::{Device, Error, Result, Tape, Tensor, Workspace, root};

#[test]
fn a_step_whose_inputs_live_in_the_model_scope_computes_in_the_step_scope() -> Result<()> {
    root(Device::Cpu, |model| {
        let mlp = nn::mlp(model, &[8, 16, 4], Activation::Relu, Init::KaimingUniform)?;
        // The mistake of the issue: the data read into the model scope, before the step.
        let x = model.randn(&[32, 8])?;
        let labels = model.from_slice(&[1i64; 32], &[32])?;
        let before = model.stats();
        model.set_strict(true); // nothing of the step may be made in the model scope
        model.named_scope("batch", |batch| -> Result<()> {
            let tape = Tape::new(batch);
            let loss = mlp
                .forward(&tape.constant(&x), Mode::Train)?
                .cross_entropy(&labels)?;
            let grads = tape.backward(&loss)?;
            assert_eq!(grads.len(), 4);
            let during = model.stats();
            assert_eq!(
                during.allocations, before.allocations,
                "model scope untouched"
            );
            assert_eq!(during.live_bytes, before.live_bytes);
            assert!(batch.stats().allocations > 10, "{}", batch.stats());
            assert!(batch.stats().peak_bytes > 0);
            // An inference tape places its results in its scope too.
            let eval = Tape::no_grad(batch);
            let y = mlp.forward(&eval.constant(&x), Mode::Eval)?;
            assert_eq!(y.shape(), &[32, 4]);
            assert_eq!(model.stats().allocations, before.allocations);
            Ok(())
        })?;
        assert_eq!(model.stats().outer_allocations, 0);
        Ok(())
    })
}

#[test]
fn tensor_ops_outside_a_tape_still_go_to_their_operands_owner() -> Result<()> {
    root(Device::Cpu, |model| {
        let w = model.ones(&[4])?;
        let mut kept: Vec<Tensor<'_>> = Vec::new();
        model.scope(|batch| -> Result<()> {
            let _tape = Tape::new(batch);
            // Typed `Tensor<'model>`, so it must live in the model scope to be kept there.
            kept.push(w.add(&w)?);
            Ok(())
        })?;
        assert_eq!(kept[0].to_vec::<f32>()?, vec![2.0; 4]);
        // Counted (not refused: the model scope is not strict) and shown in the dump.
        let stats = model.stats();
        assert_eq!(stats.outer_allocations, 1);
        let dump = model.dump();
        assert!(
            dump.contains("1 allocations here while child \"scope@tests/step_scope.rs:"),
            "{dump}"
        );
        assert!(
            dump.contains("the first: f32 [4] created at tests/step_scope.rs:"),
            "{dump}"
        );
        assert!(
            stats
                .to_string()
                .contains("1 allocs while a child was open"),
            "{stats}"
        );
        Ok(())
    })
}

#[test]
fn a_strict_scope_refuses_a_step_tensor_and_says_what_to_do() -> Result<()> {
    root(Device::Cpu, |model| {
        model.set_strict(true);
        assert!(model.is_strict());
        let w = model.ones(&[3])?; // no child open: fine
        let err = model
            .named_scope("batch", |batch| -> Result<()> {
                let _ok = batch.ones(&[3])?.mul(&w)?;
                let _input = model.from_slice(&[1.0f32, 2.0, 3.0], &[3])?; // refused
                Ok(())
            })
            .unwrap_err();
        let Error::OuterAllocation {
            scope,
            child,
            shape,
            at,
            ..
        } = &err
        else {
            panic!("expected OuterAllocation, got {err}");
        };
        assert_eq!((scope.as_str(), child.as_str()), ("root", "batch"));
        assert_eq!(shape, &[3]);
        assert!(at.starts_with("tests/step_scope.rs:"), "{at}");
        let text = err.to_string();
        assert!(
            text.contains("create the step's inputs in the step's scope"),
            "{text}"
        );
        assert!(model.dump().contains("[strict]"));
        assert_eq!(model.stats().outer_allocations, 0, "refused, not counted");
        // Moves in are accepted: a workspace copies its results into the parent.
        let mut ws = Workspace::new("batch");
        let kept = model.workspace(&mut ws, |b| b.ret(b.full(&[3], 4.0)?))?;
        assert_eq!(kept.to_vec::<f32>()?, vec![4.0; 3]);
        model.set_strict(false);
        Ok(())
    })
}
