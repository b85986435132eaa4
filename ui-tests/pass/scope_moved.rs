// `scope_moved` returns the closure's tensors to the parent in one step (MXNet's `using`).
use ndscope::{root, Device, Result, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        let t = s.scope_moved::<Tensor, _>(|c| c.ones(&[2])?.mul_scalar(3.0))?;
        let mut kept = vec![t];
        let (a, b) = s.scope_moved::<(Tensor, Option<Tensor>), _>(|c| Ok((c.ones(&[1])?, None)))?;
        kept.push(a);
        assert!(b.is_none());
        Ok(())
    })
}
