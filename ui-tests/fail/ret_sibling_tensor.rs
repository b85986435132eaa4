// `ret` only accepts the child's own tensors: a tensor of a sibling scope (open at the same time,
// closing at another time) cannot be returned through another child.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        model.scope(|a| -> Result<()> {
            model.scope(|b| -> Result<()> {
                let from_b = b.ones(&[2])?;
                let _into_model = a.ret(from_b)?;
                Ok(())
            })
        })
    })
}
