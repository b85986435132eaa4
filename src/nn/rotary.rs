//! The tables of a model's rotary position embedding: the frequencies `θ_i` of its planes, scaled
//! for long contexts the way the checkpoint's `rope_parameters` say, and `cos`/`sin` of every
//! position's angles, kept in the model scope for [`Tensor::rotary`].

use crate::autograd::Var;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::scope::{Movable, MoveOut, Scope};
use crate::tensor::Tensor;

/// How a model's rotary frequencies are scaled (transformers' `rope_type`s).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `"default"`: `θ_i = theta^(-2i / dim)`.
    None,
    /// `"linear"`: every frequency divided by `factor` (positions interpolated).
    Linear {
        /// The context's growth factor.
        factor: f64,
    },
    /// `"llama3"` (Llama 3.1 and later): wavelengths longer than `original_max_positions /
    /// low_freq_factor` are divided by `factor`, those shorter than `original_max_positions /
    /// high_freq_factor` kept, and the ones between interpolated smoothly.
    Llama3 {
        /// The context's growth factor.
        factor: f64,
        /// Where the low frequencies start (in wavelengths of the original context).
        low_freq_factor: f64,
        /// Where the high frequencies start.
        high_freq_factor: f64,
        /// The context the model was trained on before scaling.
        original_max_positions: usize,
    },
    /// `"dynamic"` (dynamic NTK scaling): below `original_max_positions` the default frequencies;
    /// a pass over a sequence of `len` longer than that recomputes them with the base
    /// `theta · (factor · len / original − (factor − 1))^(dim / (dim − 2))` (see
    /// [`dynamic_theta`]), as transformers does on every forward pass. Keys already cached keep
    /// the frequencies they were rotated with, as in transformers' cache. The model computes
    /// sequences up to `factor · original_max_positions` long.
    Dynamic {
        /// The context's growth factor.
        factor: f64,
        /// The context the frequencies are the default ones within (`max_position_embeddings`).
        original_max_positions: usize,
    },
    /// `"yarn"` (Peng et al., 2023; Qwen2.5's long context): each frequency blends its
    /// interpolated value `θ_i / factor` and its original `θ_i` along a linear ramp between the
    /// dimensions that turn `beta_fast` and `beta_slow` times over the original context, and the
    /// tables are multiplied by `attention_factor`.
    Yarn {
        /// The context's growth factor.
        factor: f64,
        /// The context the model was trained on before scaling.
        original_max_positions: usize,
        /// Rotations over the original context below which a dimension is interpolated fully
        /// (transformers' default 32).
        beta_fast: f64,
        /// Rotations above which a dimension keeps its frequency (default 1).
        beta_slow: f64,
        /// Whether the ramp's ends are rounded to whole dimensions (transformers' `truncate`,
        /// default true).
        truncate: bool,
        /// What the cosine and sine tables are multiplied by (`attention_factor`, or from `factor`,
        /// `mscale` and `mscale_all_dim`: `0.1 ln(factor) + 1` by default).
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The longest sequence a model of context `max_positions` computes under this scaling:
    /// `factor` times it for `Dynamic` (frequencies are recomputed for longer passes),
    /// `max_positions` otherwise (the checkpoint's `max_position_embeddings` already names the
    /// scaled context).
    pub fn context(&self, max_positions: usize) -> usize {
        match *self {
            RopeScaling::Dynamic { factor, .. } if factor > 1.0 => {
                (max_positions as f64 * factor).floor() as usize
            }
            _ => max_positions,
        }
    }

    /// What the cosine and sine tables are multiplied by: YaRN's attention factor, 1 otherwise.
    pub fn attention_scaling(&self) -> f64 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }
}

/// A model's rotary position embedding: `cos` and `sin` tables `[max_positions, head_dim / 2]`
/// in the compute dtype, made once in the model scope.
///
/// ```
/// use ndscope::nn::{RopeScaling, RotaryEmbedding};
/// use ndscope::{DType, Device, Tape, root};
///
/// root(Device::Cpu, |m| {
///     let rope = RotaryEmbedding::new(m, 8, 64, 10_000.0, &RopeScaling::None, DType::F32)?;
///     m.scope(|b| {
///         let tape = Tape::new(b);
///         let q = tape.constant(&b.randn(&[3, 2, 8])?); // [tokens, heads, head_dim]
///         let positions = b.from_slice(&[0i64, 1, 2], &[3])?;
///         let turned = rope.apply(&q, &positions)?;
///         assert_eq!(turned.value().shape(), &[3, 2, 8]);
///         Ok::<_, ndscope::Error>(())
///     })
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RotaryEmbedding<'m> {
    cos: Tensor<'m>,
    sin: Tensor<'m>,
}

impl<'m> RotaryEmbedding<'m> {
    /// The tables of positions `0..max_positions` for heads of `head_dim` with base `theta` and
    /// `scaling`, for values of `dtype` (the tables are in its compute dtype: `f64` for `f64`,
    /// `f32` otherwise), in `scope`. Angles and their cosines are computed in `f64`, then rounded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an odd or zero `head_dim`, a `theta` that is not above 1, or a
    /// scaling factor that is not positive and finite; allocation errors.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        head_dim: usize,
        max_positions: usize,
        theta: f64,
        scaling: &RopeScaling,
        dtype: DType,
    ) -> Result<RotaryEmbedding<'m>> {
        let frequencies = inverse_frequencies(head_dim, theta, scaling)?;
        RotaryEmbedding::from_frequencies(
            scope,
            &frequencies,
            max_positions,
            scaling.attention_scaling(),
            dtype,
        )
    }

    /// The tables for given inverse frequencies `θ_i` (`head_dim / 2` of them), each entry times
    /// `attention_scaling` (YaRN scales the embedded values; 1 otherwise).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no frequencies or a non-finite one or scaling; allocation
    /// errors.
    #[track_caller]
    pub fn from_frequencies(
        scope: &Scope<'m>,
        frequencies: &[f64],
        max_positions: usize,
        attention_scaling: f64,
        dtype: DType,
    ) -> Result<RotaryEmbedding<'m>> {
        const OP: &str = "RotaryEmbedding::from_frequencies";
        if frequencies.is_empty()
            || !frequencies.iter().all(|f| f.is_finite())
            || !attention_scaling.is_finite()
        {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "needs at least one frequency, all finite, and a finite attention scaling; got \
                     {} frequencies and scaling {attention_scaling}",
                    frequencies.len()
                ),
            });
        }
        let (cos, sin) = angle_tables(frequencies, max_positions, |p, f| {
            let angle = p as f64 * f;
            (
                angle.cos() * attention_scaling,
                angle.sin() * attention_scaling,
            )
        });
        RotaryEmbedding::from_tables(scope, cos, sin, [max_positions, frequencies.len()], dtype)
    }

    /// The tables as transformers' `float32` rotary forward computes them, for matching its
    /// logits to the last bits (a `float64` transformers model computes its tables so too): each
    /// angle `p · θ_i` is the `f32` product of `p` and `θ_i` (given as `f32` values), and its
    /// cosine and sine are rounded to `f32` once, then multiplied by `attention_scaling` in `f32`
    /// (then widened for `f64` values).
    ///
    /// # Errors
    /// As for [`from_frequencies`](Self::from_frequencies).
    #[track_caller]
    pub fn from_f32_angles(
        scope: &Scope<'m>,
        frequencies: &[f64],
        max_positions: usize,
        attention_scaling: f64,
        dtype: DType,
    ) -> Result<RotaryEmbedding<'m>> {
        // The same checks as the exact tables, on an empty table.
        RotaryEmbedding::from_frequencies(scope, frequencies, 0, attention_scaling, dtype)?;
        let scaling = attention_scaling as f32;
        let (cos, sin) = angle_tables(frequencies, max_positions, |p, f| f32_angle(p, f, scaling));
        RotaryEmbedding::from_tables(scope, cos, sin, [max_positions, frequencies.len()], dtype)
    }

    /// The rows `positions` of the tables [`from_f32_angles`](Self::from_f32_angles) makes, the
    /// same bits, as tables of one row per position (apply them with the positions `0..rows`): a
    /// pass at positions past a model's table computes just its own rows rather than a table of
    /// every position before them.
    ///
    /// # Errors
    /// As for [`from_frequencies`](Self::from_frequencies).
    #[track_caller]
    pub fn rows_at(
        scope: &Scope<'m>,
        positions: &[usize],
        frequencies: &[f64],
        attention_scaling: f64,
        dtype: DType,
    ) -> Result<RotaryEmbedding<'m>> {
        // The same checks as the tables, on an empty table.
        RotaryEmbedding::from_frequencies(scope, frequencies, 0, attention_scaling, dtype)?;
        let scaling = attention_scaling as f32;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for &p in positions {
            let (c, s) = angle_tables(frequencies, 1, |_, f| f32_angle(p, f, scaling));
            cos.extend(c);
            sin.extend(s);
        }
        let shape = [positions.len(), frequencies.len()];
        RotaryEmbedding::from_tables(scope, cos, sin, shape, dtype)
    }

    /// Tables of one row per token, for a pass whose tokens turn at different frequencies (dynamic
    /// scaling over sequences of different lengths): row `r` holds position `positions[r]`'s
    /// angles under `frequencies[r]`, computed as [`from_f32_angles`](Self::from_f32_angles)
    /// computes them. Apply them with the positions `0..rows`, so that each token reads its row.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lists' lengths differ, or a row has no frequencies, a
    /// non-finite one, or another count than the first; allocation errors.
    #[track_caller]
    pub fn rows_from_f32_angles(
        scope: &Scope<'m>,
        positions: &[usize],
        frequencies: &[&[f64]],
        dtype: DType,
    ) -> Result<RotaryEmbedding<'m>> {
        let half = frequencies.first().map_or(0, |f| f.len());
        if positions.len() != frequencies.len()
            || half == 0
            || frequencies
                .iter()
                .any(|f| f.len() != half || !f.iter().all(|x| x.is_finite()))
        {
            return Err(Error::InvalidArgument {
                op: "RotaryEmbedding::rows_from_f32_angles",
                reason: format!(
                    "needs one position and one list of finite frequencies, all {half} long and \
                     at least one, per row; got {} positions and {} lists",
                    positions.len(),
                    frequencies.len()
                ),
            });
        }
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for (&p, row) in positions.iter().zip(frequencies) {
            let (c, s) = angle_tables(row, 1, |_, f| f32_angle(p, f, 1.0));
            cos.extend(c);
            sin.extend(s);
        }
        RotaryEmbedding::from_tables(scope, cos, sin, [positions.len(), half], dtype)
    }

    /// Tables from their values (rounded to `f32` unless `dtype` is `f64`).
    #[track_caller]
    fn from_tables(
        scope: &Scope<'m>,
        cos: Vec<f64>,
        sin: Vec<f64>,
        shape: [usize; 2],
        dtype: DType,
    ) -> Result<RotaryEmbedding<'m>> {
        let (cos, sin) = if dtype == DType::F64 {
            (
                scope.from_slice(&cos, &shape)?,
                scope.from_slice(&sin, &shape)?,
            )
        } else {
            let narrow = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<_>>();
            (
                scope.from_slice(&narrow(cos), &shape)?,
                scope.from_slice(&narrow(sin), &shape)?,
            )
        };
        Ok(RotaryEmbedding {
            cos: cos.named("rotary.cos"),
            sin: sin.named("rotary.sin"),
        })
    }

    /// `[max_positions, head_dim / 2]` cosines.
    pub fn cos(&self) -> &Tensor<'m> {
        &self.cos
    }

    /// `[max_positions, head_dim / 2]` sines.
    pub fn sin(&self) -> &Tensor<'m> {
        &self.sin
    }

    /// The positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.shape()[0]
    }

    /// `x` `[tokens, heads, head_dim]` rotated for each token's position (`i64 [tokens]`): see
    /// [`Tensor::rotary`].
    ///
    /// # Errors
    /// As for [`Tensor::rotary`].
    #[track_caller]
    pub fn apply<'t, 's>(&self, x: &Var<'t, 's>, positions: &Tensor<'s>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        x.rotary(&self.cos, &self.sin, positions)
    }
}

/// The cosine and sine of position `p` at frequency `f` as transformers' `float32` rotary forward
/// computes them: the angle the `f32` product `p · f`, each rounded to `f32` once, times `scaling`
/// in `f32`.
fn f32_angle(p: usize, f: f64, scaling: f32) -> (f64, f64) {
    let angle = f64::from(p as f32 * f as f32);
    (
        f64::from(angle.cos() as f32 * scaling),
        f64::from(angle.sin() as f32 * scaling),
    )
}

/// The `[positions, frequencies]` tables of `entry(p, θ_i)` = (cos, sin) entries, row-major.
fn angle_tables(
    frequencies: &[f64],
    positions: usize,
    entry: impl Fn(usize, f64) -> (f64, f64),
) -> (Vec<f64>, Vec<f64>) {
    let (mut cos, mut sin) = (
        Vec::with_capacity(positions * frequencies.len()),
        Vec::with_capacity(positions * frequencies.len()),
    );
    for p in 0..positions {
        for &f in frequencies {
            let (c, s) = entry(p, f);
            cos.push(c);
            sin.push(s);
        }
    }
    (cos, sin)
}

/// The tables move with the model that holds them (they are not parameters: nothing trains them).
impl<'m> Movable<'m> for RotaryEmbedding<'m> {
    type Moved<'b> = RotaryEmbedding<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<RotaryEmbedding<'b>> {
        Ok(RotaryEmbedding {
            cos: self.cos.move_into(target)?,
            sin: self.sin.move_into(target)?,
        })
    }
}

impl<'m> MoveOut<'m> for RotaryEmbedding<'m> {
    fn move_out(self) -> Result<RotaryEmbedding<'static>> {
        Ok(RotaryEmbedding {
            cos: self.cos.move_out()?,
            sin: self.sin.move_out()?,
        })
    }
}

/// The base dynamic NTK scaling gives a pass over a sequence of `len` tokens:
/// `theta · (factor · len / original − (factor − 1))^(dim / (dim − 2))` above the original
/// context, `theta` within it (transformers' `_compute_dynamic_ntk_parameters`, in `f64` as its
/// Python floats compute it).
pub fn dynamic_theta(
    theta: f64,
    head_dim: usize,
    factor: f64,
    original_max_positions: usize,
    len: usize,
) -> f64 {
    let len = len.max(original_max_positions) as f64;
    let dim = head_dim as f64;
    theta * (factor * len / original_max_positions as f64 - (factor - 1.0)).powf(dim / (dim - 2.0))
}

/// The inverse frequencies `θ_i`, `i < head_dim / 2`, of `theta` under `scaling`, in `f64` (as
/// transformers' `ROPE_INIT_FUNCTIONS` compute them, in `f64` rather than `f32`). For `Dynamic`,
/// the frequencies within the original context.
///
/// # Errors
/// [`Error::InvalidArgument`] for an odd or zero `head_dim`, `theta <= 1`, or factors that are not
/// positive and finite (for `Llama3`: `low_freq_factor < high_freq_factor` and a non-zero original
/// context; for `Dynamic`, a `head_dim` above 2).
pub fn inverse_frequencies(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Result<Vec<f64>> {
    const OP: &str = "rotary inverse_frequencies";
    let bad = |reason: String| Err(Error::InvalidArgument { op: OP, reason });
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return bad(format!(
            "head_dim must be even and positive, not {head_dim}"
        ));
    }
    if !(theta.is_finite() && theta > 1.0) {
        return bad(format!(
            "rope_theta must be a finite number above 1, not {theta}"
        ));
    }
    let base: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let positive = |x: f64| x.is_finite() && x > 0.0;
    match *scaling {
        RopeScaling::None => Ok(base),
        RopeScaling::Linear { factor } => {
            if !positive(factor) {
                return bad(format!("the linear factor must be positive, not {factor}"));
            }
            Ok(base.into_iter().map(|f| f / factor).collect())
        }
        RopeScaling::Dynamic {
            factor,
            original_max_positions,
        } => {
            if !(positive(factor) && original_max_positions > 0 && head_dim > 2) {
                return bad(format!(
                    "dynamic scaling needs a positive factor and original context and a head_dim \
                     above 2; got factor {factor}, max_position_embeddings \
                     {original_max_positions}, head_dim {head_dim}"
                ));
            }
            // The frequencies of passes within the original context; longer passes use
            // `dynamic_theta`'s base.
            Ok(base)
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_positions,
        } => {
            if !(positive(factor)
                && positive(low_freq_factor)
                && positive(high_freq_factor)
                && low_freq_factor < high_freq_factor
                && original_max_positions > 0)
            {
                return bad(format!(
                    "llama3 scaling needs positive factors with low_freq_factor < \
                     high_freq_factor and a positive original context; got factor {factor}, \
                     low_freq_factor {low_freq_factor}, high_freq_factor {high_freq_factor}, \
                     original_max_position_embeddings {original_max_positions}"
                ));
            }
            let old = original_max_positions as f64;
            let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
            Ok(base
                .into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect())
        }
        RopeScaling::Yarn {
            factor,
            original_max_positions,
            beta_fast,
            beta_slow,
            truncate,
            attention_factor,
        } => {
            if !(positive(factor)
                && positive(beta_fast)
                && positive(beta_slow)
                && positive(attention_factor)
                && original_max_positions > 0)
            {
                return bad(format!(
                    "yarn scaling needs positive factor, beta_fast, beta_slow and attention factor \
                     and a positive original context; got factor {factor}, beta_fast {beta_fast}, \
                     beta_slow {beta_slow}, attention factor {attention_factor}, \
                     original_max_position_embeddings {original_max_positions}"
                ));
            }
            // The dimension that turns `rotations` times over the original context.
            let dim = head_dim as f64;
            let correction = |rotations: f64| {
                dim * (original_max_positions as f64 / (rotations * 2.0 * std::f64::consts::PI))
                    .ln()
                    / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001; // transformers' guard against a zero-width ramp
            }
            Ok(base
                .into_iter()
                .enumerate()
                .map(|(i, f)| {
                    // 1 keeps the original frequency (extrapolation), 0 interpolates fully.
                    let keep = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor * (1.0 - keep) + f * keep
                })
                .collect())
        }
    }
}
