// A trainer that keeps the last batch's logits next to the model: the logits belong to the batch
// scope, which closes after the step, so the model-lifetime field cannot hold them. Keep a number
// (`to_scalar`) or `ret` a copy into the model scope on purpose.
use ndscope::nn::{self, Activation, Init, Mode, Module, Sequential};
use ndscope::{root, Device, Result, Tape, Tensor};

struct Trainer<'m> {
    model: Sequential<'m>,
    last_logits: Option<Tensor<'m>>,
}

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let model = nn::mlp(m, &[4, 2], Activation::Relu, Init::KaimingUniform)?;
        let mut trainer = Trainer { model, last_logits: None };
        m.scope(|batch| -> Result<()> {
            let tape = Tape::new(batch);
            let x = tape.constant(&batch.randn(&[3, 4])?);
            let logits = trainer.model.forward(&x, Mode::Train)?;
            trainer.last_logits = Some(logits.into_value());
            Ok(())
        })
    })
}
