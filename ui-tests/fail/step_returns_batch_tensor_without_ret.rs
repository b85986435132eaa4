// A training-step closure that returns the batch's loss tensor as it is: the tensor belongs to the
// batch scope. Return a number (`loss.value().to_scalar::<f32>()`), or move it with `batch.ret(..)`.
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::{root, Device, Result, Tape};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let model = nn::mlp(m, &[4, 2], Activation::Relu, Init::KaimingUniform)?;
        let mut losses = Vec::new();
        for _ in 0..3 {
            let loss = m.scope(|batch| {
                let tape = Tape::new(batch);
                let x = tape.constant(&batch.randn(&[3, 4])?);
                let labels = batch.from_slice(&[0i64, 1, 1], &[3])?;
                let loss = model.forward(&x, Mode::Train)?.cross_entropy(&labels)?;
                Ok::<_, ndscope::Error>(loss.into_value())
            })?;
            losses.push(loss);
        }
        Ok(())
    })
}
