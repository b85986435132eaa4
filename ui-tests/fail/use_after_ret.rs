// `ret` moves the tensor: the child's handle is gone.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let _kept = model.scope(|batch| -> Result<_> {
            let t = batch.ones(&[2])?;
            let kept = batch.ret(t)?;
            let _ = t.sum_all()?;
            Ok(kept)
        });
        Ok(())
    })
}
