// The classic manager leak of run-time frameworks: a gradient computed in the batch scope, stored in
// the model, which lives in the parent scope.
use ndscope::{root, Device, Result, Tensor};

struct Model<'m> {
    weight: Tensor<'m>,
    last_grad: Option<Tensor<'m>>,
}

fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        let mut model = Model { weight: s.ones(&[4])?, last_grad: None };
        s.scope(|batch| -> Result<()> {
            let grad = batch.full(&[4], 0.1)?;
            model.last_grad = Some(grad);
            Ok(())
        })?;
        let _ = &model.weight;
        Ok(())
    })
}
