// A recomputed segment keeps one of its intermediates in a list the model owns. The segment's
// tensors live in the segment's own scope (freed when it returns, made again in the backward pass),
// whose lifetime `'s` is shorter than the model's `'m`: the list cannot hold them.
use std::cell::RefCell;
use std::rc::Rc;

use ndscope::{Device, Result, Segment, Tape, Tensor, Var, root};

struct Leaky<'m> {
    w: Tensor<'m>,
    kept: Rc<RefCell<Vec<Tensor<'m>>>>,
}

impl<'m> Segment<'m> for Leaky<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let h = x.mul(&x.tape().param(&self.w))?; // an intermediate of the segment
        let activation = h.value().tanh()?;
        self.kept.borrow_mut().push(activation);
        h.tanh()
    }
}

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let w = model.ones(&[4])?;
        let kept = Rc::new(RefCell::new(Vec::new()));
        model.scope(|batch| {
            let tape = Tape::new(batch);
            let x = tape.constant(&batch.ones(&[4])?);
            let y = x.recompute(Leaky { w: w.clone(), kept: Rc::clone(&kept) })?;
            tape.backward(&y.sum_all()?).map(|_| ())
        })
    })
}
