// Storing a batch's statistics into batch norm's running buffers by assignment: the batch mean
// belongs to the batch scope, which closes after the step, so the model-lifetime buffer cannot hold
// it. Update the buffer in place (`mul_scalar_`, `axpy_`), as `BatchNorm2d::forward` does.
use ndscope::nn::BatchNorm2d;
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let bn = BatchNorm2d::new(m, 3)?;
        m.scope(|batch| -> Result<()> {
            let x = batch.randn(&[8, 3, 4, 4])?;
            let batch_mean = x.mean(&[0, 2, 3], false)?;
            *bn.running_mean.borrow_mut() = batch_mean;
            Ok(())
        })
    })
}
