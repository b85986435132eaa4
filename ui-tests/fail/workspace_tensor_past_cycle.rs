// A workspace arena is reset when its cycle ends; a tensor kept past the cycle would read memory
// that the next cycle overwrites (DL4J's "array leaked from workspace").
use ndscope::{root, Device, Result, Tensor, Workspace};

fn main() -> Result<()> {
    let mut ws = Workspace::new("batch");
    root(Device::Cpu, |model| {
        let mut previous: Option<Tensor> = None;
        for _ in 0..2 {
            model.workspace(&mut ws, |w| -> Result<()> {
                let activation = w.ones(&[16])?;
                previous = Some(activation);
                Ok(())
            })?;
        }
        let _ = previous;
        Ok(())
    })
}
