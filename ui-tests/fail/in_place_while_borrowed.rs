// An in-place op needs `&mut`: it cannot run while a borrowed view of the elements is alive.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        let mut t = s.ones(&[3])?;
        let view = t.as_slice::<f32>()?;
        t.add_scalar_(1.0)?;
        println!("{}", view[0]);
        Ok(())
    })
}
