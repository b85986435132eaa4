//! `model!`: a user's struct of layers becomes a model in one declaration.

/// Declares a struct of layers (one lifetime parameter, every field [`Parameters`](crate::nn::Parameters)
/// and [`Movable`](crate::Movable)) and implements both traits for it, so the struct works with
/// `tape.param`, the optimizers, checkpoints (parameters are named `field.inner.name`, `blocks.0.…`
/// for a `Vec`) and `ret`/`move_into` with no further code.
///
/// ```
/// use ndscope::nn::{AttentionOptions, Embedding, Init, LayerNorm, Linear, Mode, Module, Parameters,
///     PositionalEmbedding, TransformerBlock};
/// use ndscope::optim::{Adam, AdamConfig, Optimizer};
/// use ndscope::{Device, Tape, root};
///
/// ndscope::model! {
///     /// A tiny decoder.
///     pub struct Decoder<'m> {
///         tokens: Embedding<'m>,
///         positions: PositionalEmbedding<'m>,
///         blocks: Vec<TransformerBlock<'m>>,
///         ln: LayerNorm<'m>,
///         head: Linear<'m>,
///     }
/// }
///
/// root(Device::Cpu, |s| {
///     // Built in a child scope and returned to the root with `ret`: the whole model moves.
///     let mut model = s.scope(|build| {
///         let opts = AttentionOptions { causal: true, dropout: 0.0 };
///         let model = Decoder {
///             tokens: Embedding::new(build, 10, 16, Init::Normal(0.02))?,
///             positions: PositionalEmbedding::new(build, 8, 16, Init::Normal(0.02))?,
///             blocks: vec![TransformerBlock::new(build, 16, 2, opts, Init::Normal(0.02))?],
///             ln: LayerNorm::new(build, 16)?,
///             head: Linear::new(build, 16, 10, Init::Normal(0.02))?,
///         };
///         build.ret(model)
///     })?;
///     let mut names = Vec::new();
///     model.visit("", &mut |name, _| names.push(name.to_string()));
///     assert_eq!(names[0], "tokens.weight");
///     assert!(names.contains(&"blocks.0.attn.qkv.weight".to_string()));
///
///     let mut opt = Adam::new(s, &model, AdamConfig::adam(1e-3))?;
///     s.scope(|batch| {
///         let tape = Tape::new(batch);
///         let ids = batch.from_slice(&[1i64, 2, 3, 4], &[1, 4])?;
///         let mut x = model.positions.forward(&model.tokens.forward(&tape, &ids)?)?;
///         for block in &model.blocks {
///             x = block.forward(&x, Mode::Train)?;
///         }
///         let logits = model.head.forward(&model.ln.forward(&x, Mode::Train)?, Mode::Train)?;
///         let next = batch.from_slice(&[2i64, 3, 4, 5], &[4])?;
///         let loss = logits.reshape(&[4, 10])?.cross_entropy(&next)?;
///         opt.step(&mut model, &tape.backward(&loss)?)
///     })?;
///     // A checkpoint of every parameter, loaded back into the same struct.
///     let bytes = ndscope::checkpoint::to_bytes(&model)?;
///     ndscope::checkpoint::load_bytes(&mut model, &bytes)?;
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[macro_export]
macro_rules! model {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident<$m:lifetime> {
            $($(#[$field_meta:meta])* $field_vis:vis $field:ident : $ty:ty),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        $vis struct $name<$m> {
            $($(#[$field_meta])* $field_vis $field: $ty,)*
        }

        impl<$m> $crate::nn::Parameters<$m> for $name<$m> {
            fn visit(
                &self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &$crate::Tensor<$m>),
            ) {
                $($crate::nn::Parameters::visit(
                    &self.$field,
                    &format!(concat!("{}", stringify!($field), "."), prefix),
                    f,
                );)*
            }

            fn visit_mut(
                &mut self,
                f: &mut dyn FnMut(&mut $crate::Tensor<$m>) -> $crate::Result<()>,
            ) -> $crate::Result<()> {
                $($crate::nn::Parameters::visit_mut(&mut self.$field, f)?;)*
                Ok(())
            }
        }

        impl<$m> $crate::Movable<$m> for $name<$m> {
            type Moved<'b> = $name<'b>;
            fn move_into<'b>(self, target: &$crate::Scope<'b>) -> $crate::Result<$name<'b>> {
                Ok($name {
                    $($field: $crate::Movable::move_into(self.$field, target)?,)*
                })
            }
        }
    };
}
