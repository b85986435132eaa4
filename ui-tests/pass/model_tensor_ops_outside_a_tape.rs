// What still compiles now that ops on a tape place their results in the tape's scope: tensor ops
// outside a tape keep the innermost-owner rule, so a model tensor computed from model tensors inside
// a batch closure is typed (and owned) by the model scope and may be kept there.
use ndscope::{root, Device, Result, Tape, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let w = model.ones(&[4])?;
        let mut kept: Vec<Tensor<'_>> = Vec::new();
        model.scope(|batch| -> Result<()> {
            let tape = Tape::new(batch);
            let y = tape.param(&w).mul(&tape.constant(&batch.ones(&[4])?))?; // the batch's
            assert_eq!(y.value().to_vec::<f32>()?, vec![1.0; 4]);
            kept.push(w.add(&w)?); // the model's, made while the batch is open: counted there
            Ok(())
        })?;
        assert_eq!(kept[0].to_vec::<f32>()?, vec![2.0; 4]);
        assert_eq!(model.stats().outer_allocations, 1);
        Ok(())
    })
}
