// A model parameter used beside batch tensors: the result is a batch tensor.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let weight = model.ones(&[2, 2])?;
        for _ in 0..3 {
            model.scope(|batch| -> Result<()> {
                let x = batch.ones(&[1, 2])?;
                let y = x.matmul(&weight)?.relu()?;
                assert_eq!(y.to_vec::<f32>()?, vec![2.0, 2.0]);
                Ok(())
            })?;
        }
        Ok(())
    })
}
