// A detached tensor belongs to no scope tree: it may outlive the root and cross threads.
use ndscope::{root, Device, Result, Tensor};

fn main() -> Result<()> {
    let detached: Tensor<'static> = root(Device::Cpu, |s| s.full(&[3], 2.0)?.move_out())?;
    let sum = std::thread::spawn(move || detached.sum_all()?.to_scalar::<f32>()).join().unwrap()?;
    assert_eq!(sum, 6.0);
    Ok(())
}
