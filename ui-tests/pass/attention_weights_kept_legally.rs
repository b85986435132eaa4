// The legal ways to keep a batch's attention weights: as host numbers, or moved with `ret` into a
// scope that outlives the training loop.
use ndscope::nn::{AttentionOptions, Init, Mode, MultiHeadAttention};
use ndscope::{root, Device, Result, Tape, Tensor};

fn main() -> Result<()> {
    root(Device::Cpu, |m| {
        let opts = AttentionOptions { causal: true, dropout: 0.0 };
        let attn = MultiHeadAttention::new(m, 8, 2, opts, Init::XavierUniform)?;
        let mut for_plotting: Vec<Vec<f32>> = Vec::new();
        let kept: Vec<Tensor<'_>> = m.scope(|run| {
            let mut kept = Vec::new();
            for _ in 0..3 {
                let weights = run.scope(|batch| {
                    let tape = Tape::new(batch);
                    let x = tape.constant(&batch.randn(&[1, 4, 8])?);
                    let attended = attn.attend(&x, Mode::Train)?;
                    for_plotting.push(attended.weights.value().to_vec::<f32>()?);
                    batch.ret(attended.weights.into_value())
                })?;
                kept.push(weights);
            }
            run.ret(kept)
        })?;
        assert_eq!(kept.len(), 3);
        assert_eq!(for_plotting.len(), 3);
        Ok(())
    })
}
