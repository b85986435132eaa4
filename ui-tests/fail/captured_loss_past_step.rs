// A captured step's loss lives in a slot of the step's planned workspace, which the next replay
// overwrites: keeping the loss tensor past the step must not compile. Its value comes back from
// `run` as an `f32` (ui-tests/pass/captured_loss_read_as_f32.rs).
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Optimizer, Sgd, SgdConfig};
use ndscope::{root, Device, Input, Result, StepGraph, Tape, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[4, 2], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Sgd::new(m, &model, SgdConfig::new(0.1))?;
        let mut kept: Vec<Tensor> = Vec::new();
        let mut step = StepGraph::new("step", |b, inputs| {
            let tape = Tape::new(b);
            let loss = model
                .forward(&tape.constant(&inputs[0]), Mode::Train)?
                .cross_entropy(&inputs[1])?;
            let grads = tape.backward(&loss)?;
            opt.step(&mut model, &grads)?;
            kept.push(loss.value().clone());
            Ok(loss.value().clone())
        });
        let (x, y) = ([1.0f32; 8], [0i64, 1]);
        step.run(m, &[Input::new(&x, &[2, 4]), Input::new(&y, &[2])])?;
        Ok(())
    })
}
