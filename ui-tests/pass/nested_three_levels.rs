// Three levels: epoch -> batch -> micro-batch, each returning to its parent.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |run| {
        let total = run.named_scope("epoch", |epoch| {
            let acc = epoch.named_scope("batch", |batch| {
                let part = batch.scope(|micro| {
                    let x = micro.ones(&[4])?;
                    micro.ret(x.sum_all()?)
                })?;
                batch.ret(part.mul_scalar(2.0)?)
            })?;
            epoch.ret(acc)
        })?;
        assert_eq!(total.to_scalar::<f32>()?, 8.0);
        Ok(())
    })
}
