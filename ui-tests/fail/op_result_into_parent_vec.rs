// The result of an op that mixes a model tensor and a batch tensor is a batch tensor: it cannot be
// stored in the model scope's collections.
use ndscope::{root, Device, Result, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let weight = model.ones(&[4])?;
        let mut outputs: Vec<Tensor> = Vec::new();
        model.scope(|batch| -> Result<()> {
            let x = batch.ones(&[4])?;
            outputs.push(weight.mul(&x)?);
            Ok(())
        })?;
        let _ = outputs;
        Ok(())
    })
}
