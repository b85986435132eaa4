// The scope itself cannot leave its closure: it is closed when the closure returns.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let batch = model.scope(|batch| batch);
        let _ = batch.zeros(&[1]);
        Ok(())
    })
}
