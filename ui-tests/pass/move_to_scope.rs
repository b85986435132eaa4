// `move_to` attaches a tensor to any live scope, re-branded with that scope's lifetime.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        let t = s.scope(|c| -> Result<_> {
            let t = c.ones(&[2])?;
            t.move_to(s)
        })?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.0, 1.0]);
        Ok(())
    })
}
