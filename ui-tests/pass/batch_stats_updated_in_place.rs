// The legal way to move batch norm's running statistics towards a batch's: an in-place update of the
// model-scope buffer, which reads the batch tensor and keeps nothing of it.
use ndscope::nn::BatchNorm2d;
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let bn = BatchNorm2d::new(m, 3)?;
        m.scope(|batch| -> Result<()> {
            let x = batch.randn(&[8, 3, 4, 4])?;
            let batch_mean = x.mean(&[0, 2, 3], false)?;
            let mut running = bn.running_mean.borrow_mut();
            running.mul_scalar_(0.9)?;
            running.axpy_(0.1, &batch_mean)?;
            Ok(())
        })?;
        assert_eq!(bn.running_mean.borrow().shape(), &[3]);
        Ok(())
    })
}
