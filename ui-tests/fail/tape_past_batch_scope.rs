// Keeping the tape after the batch: it holds the batch's saved activations, which are freed when the
// batch scope closes. Run backward inside the batch scope.
use ndscope::{root, Device, Result, Tape};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let w = m.randn(&[4])?;
        let tape = m.scope(|batch| {
            let tape = Tape::new(batch);
            let _loss = tape.param(&w).square()?.sum_all()?;
            Ok::<_, ndscope::Error>(tape)
        })?;
        drop(tape);
        Ok(())
    })
}
