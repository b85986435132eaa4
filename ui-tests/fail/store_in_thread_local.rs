// A thread-local cache outlives every scope of the thread.
use std::cell::RefCell;

use ndscope::{root, Device, Result, Tensor};

thread_local! {
    static LAST: RefCell<Option<Tensor<'static>>> = const { RefCell::new(None) };
}

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        let t = s.zeros(&[2])?;
        LAST.with(|l| *l.borrow_mut() = Some(t));
        Ok(())
    })
}
