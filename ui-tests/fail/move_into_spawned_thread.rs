// A spawned thread may run after the scope closed; scoped tensors stay on their thread.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        let t = s.ones(&[3])?;
        std::thread::spawn(move || {
            let _ = t.sum_all();
        });
        Ok(())
    })
}
