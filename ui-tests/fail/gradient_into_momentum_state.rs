// A hand-written momentum optimizer that stores this batch's gradient as its velocity: the gradient
// lives in the batch scope, the velocity as long as the model. Update the velocity in place
// (`velocity.mul_scalar_(mu)?; velocity.add_(grad)?`) instead.
use ndscope::{root, Device, Result, Tape, Tensor};

struct Momentum<'m> {
    velocity: Tensor<'m>,
}

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let w = m.randn(&[4])?;
        let mut opt = Momentum { velocity: m.zeros(&[4])? };
        m.scope(|batch| -> Result<()> {
            let tape = Tape::new(batch);
            let loss = tape.param(&w).square()?.sum_all()?;
            let grads = tape.backward(&loss)?;
            opt.velocity = grads.get(&w).unwrap().clone();
            Ok(())
        })
    })
}
