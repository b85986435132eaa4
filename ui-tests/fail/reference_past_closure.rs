// A reference to a batch tensor must not outlive the batch scope either.
use ndscope::{root, Device, Result, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let mut keep: Option<&Tensor> = None;
        model.scope(|batch| -> Result<()> {
            let t = batch.ones(&[2])?;
            keep = Some(&t);
            Ok(())
        })?;
        let _ = keep;
        Ok(())
    })
}
