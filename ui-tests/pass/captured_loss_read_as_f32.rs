// A captured step hands its loss back as an `f32`, which may be kept anywhere; the model the step
// borrows is usable again once the step graph is dropped.
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Optimizer, Sgd, SgdConfig};
use ndscope::{root, Device, Input, Result, StepGraph, Tape};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[4, 2], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Sgd::new(m, &model, SgdConfig::new(0.1))?;
        let mut losses: Vec<f32> = Vec::new();
        let mut step = StepGraph::new("step", |b, inputs| {
            let tape = Tape::new(b);
            let loss = model
                .forward(&tape.constant(&inputs[0]), Mode::Train)?
                .cross_entropy(&inputs[1])?;
            let grads = tape.backward(&loss)?;
            opt.step(&mut model, &grads)?;
            Ok(loss.value().clone())
        });
        let (x, y) = ([1.0f32; 8], [0i64, 1]);
        for _ in 0..3 {
            losses.push(step.run(m, &[Input::new(&x, &[2, 4]), Input::new(&y, &[2])])?);
        }
        drop(step);
        let tape = Tape::no_grad(m);
        let _ = model.forward(&tape.constant(&m.from_slice(&x, &[2, 4])?), Mode::Eval)?;
        assert_eq!(losses.len(), 3);
        Ok(())
    })
}
