// Returning the gradients from the batch scope: they are batch tensors, freed when it closes. Apply
// them inside the batch (an optimizer step), or accumulate them in place into model-scope buffers.
use ndscope::{root, Device, Result, Tape};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let w = m.randn(&[4])?;
        let grads = m.scope(|batch| {
            let tape = Tape::new(batch);
            let loss = tape.param(&w).square()?.sum_all()?;
            tape.backward(&loss)
        })?;
        println!("{grads:?}");
        Ok(())
    })
}
