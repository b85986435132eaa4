// `ret` moves a tensor, or a tuple / Vec / Option of tensors, to the parent scope.
use ndscope::{root, Device, Result, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let mut kept: Vec<Tensor> = Vec::new();
        let (a, b) = model.scope(|batch| {
            let a = batch.ones(&[2])?;
            let b = batch.zeros(&[3])?;
            batch.ret((a, b))
        })?;
        kept.push(a);
        kept.push(b);
        let many = model.scope(|batch| {
            let v = vec![batch.ones(&[1])?, batch.ones(&[1])?];
            batch.ret((v, Some(batch.zeros(&[1])?)))
        })?;
        kept.extend(many.0);
        assert_eq!(kept.len(), 4);
        Ok(())
    })
}
