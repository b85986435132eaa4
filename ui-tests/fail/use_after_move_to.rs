// `move_to` consumes the handle it moves.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        s.scope(|c| -> Result<()> {
            let t = s.ones(&[2])?;
            let moved = t.move_to(c)?;
            let _ = (moved, t.numel());
            Ok(())
        })
    })
}
