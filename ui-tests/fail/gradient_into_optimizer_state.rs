// Optimizer state lives as long as the model; replacing it with a batch-scope gradient would leak
// the gradient out of the batch. Update the state in place (`axpy_`, `copy_from_`) instead.
use ndscope::{root, Device, Result, Tensor};

struct Momentum<'m> {
    velocity: Vec<Tensor<'m>>,
}

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let mut opt = Momentum { velocity: vec![model.zeros(&[4])?] };
        model.scope(|batch| -> Result<()> {
            let grad = batch.ones(&[4])?;
            opt.velocity[0] = grad;
            Ok(())
        })?;
        Ok(())
    })
}
