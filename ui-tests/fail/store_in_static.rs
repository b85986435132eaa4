// A global cache of tensors would keep a scope's memory after the scope closed.
use std::sync::Mutex;

use ndscope::{root, Device, Result, Tensor};

static CACHE: Mutex<Vec<Tensor<'static>>> = Mutex::new(Vec::new());

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        let t = s.zeros(&[2])?;
        CACHE.lock().unwrap().push(t);
        Ok(())
    })
}
