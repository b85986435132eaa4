// Scopes nest strictly in time on one thread; a scope cannot be shared with another thread.
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        std::thread::scope(|threads| {
            threads.spawn(|| s.ones(&[1]).map(|_| ()));
        });
        Ok(())
    })
}
