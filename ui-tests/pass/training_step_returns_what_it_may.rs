// The legal ways to get results out of a training step: a plain number, or a tensor moved with `ret`.
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{root, Device, Result, Tape, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[4, 2], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adam(1e-3))?;
        let mut kept: Vec<Tensor> = Vec::new();
        for _ in 0..3 {
            let (loss, logits) = m.scope(|batch| -> Result<(f32, Tensor)> {
                let tape = Tape::new(batch);
                let x = tape.constant(&batch.randn(&[3, 4])?);
                let labels = batch.from_slice(&[0i64, 1, 1], &[3])?;
                let logits = model.forward(&x, Mode::Train)?;
                let loss = logits.cross_entropy(&labels)?;
                let grads = tape.backward(&loss)?;
                opt.step(&mut model, &grads)?;
                Ok((loss.value().to_scalar::<f32>()?, batch.ret(logits.into_value())?))
            })?;
            assert!(loss.is_finite());
            kept.push(logits);
        }
        assert_eq!(kept.len(), 3);
        Ok(())
    })
}
