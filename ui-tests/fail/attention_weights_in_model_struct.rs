// A model that keeps the last batch's attention weights "for plotting later": the weights belong to
// the batch scope, which closes after the step, so a model-lifetime field cannot hold them. Copy
// them to a host `Vec<f32>`, or `ret` them into a scope that outlives the loop.
use ndscope::nn::{AttentionOptions, Init, Mode, MultiHeadAttention};
use ndscope::{root, Device, Result, Tape, Tensor};

struct Model<'m> {
    attn: MultiHeadAttention<'m>,
    last_weights: Option<Tensor<'m>>,
}

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let opts = AttentionOptions { causal: true, dropout: 0.0 };
        let attn = MultiHeadAttention::new(m, 8, 2, opts, Init::XavierUniform)?;
        let mut model = Model { attn, last_weights: None };
        m.scope(|batch| -> Result<()> {
            let tape = Tape::new(batch);
            let x = tape.constant(&batch.randn(&[1, 4, 8])?);
            let attended = model.attn.attend(&x, Mode::Train)?;
            model.last_weights = Some(attended.weights.into_value());
            Ok(())
        })
    })
}
