// Collecting per-batch activations in a Vec that outlives the batch scope.
use ndscope::{root, Device, Result, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let mut history: Vec<Tensor> = Vec::new();
        for _ in 0..3 {
            model.scope(|batch| -> Result<()> {
                let activation = batch.ones(&[8])?;
                history.push(activation);
                Ok(())
            })?;
        }
        let _ = model;
        Ok(())
    })
}
