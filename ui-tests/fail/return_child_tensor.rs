// A batch tensor returned from its scope's closure would outlive the batch scope.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let leaked = model.scope(|batch| batch.zeros(&[4]));
        let _ = leaked;
        Ok(())
    })
}
