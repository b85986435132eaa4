// Recomputed segments: a layer wrapped in `Recomputed`, and a custom `Segment` that owns what
// it uses (a clone of a layer, a counted cell) — the tape keeps a segment until the backward pass.
use std::cell::Cell;
use std::rc::Rc;

use ndscope::nn::{Recomputed, Init, Linear, Mode, Module};
use ndscope::{Device, Result, Segment, Tape, Var, root};

struct Counted<'m> {
    layer: Linear<'m>,
    runs: Rc<Cell<u32>>,
}

impl<'m> Segment<'m> for Counted<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.runs.set(self.runs.get() + 1);
        self.layer.forward(x, Mode::Train)?.tanh()
    }
}

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let first = Recomputed::new(Linear::new(model, 4, 4, Init::KaimingUniform)?);
        let second = Linear::new(model, 4, 4, Init::KaimingUniform)?;
        let runs = Rc::new(Cell::new(0));
        model.scope(|batch| -> Result<()> {
            let tape = Tape::new(batch);
            let x = tape.constant(&batch.ones(&[2, 4])?);
            let h = first.forward(&x, Mode::Train)?;
            let y = h.recompute(Counted { layer: second.clone(), runs: Rc::clone(&runs) })?;
            let grads = tape.backward(&y.sum_all()?)?;
            assert!(grads.get(&second.weight).is_some());
            assert!(grads.get(&first.inner().weight).is_some());
            Ok(())
        })?;
        assert_eq!(runs.get(), 2); // the forward pass, and the recomputation
        Ok(())
    })
}
