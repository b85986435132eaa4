//! Rotary position embedding (`Tensor::rotary`, `Var::rotary`, `nn::RotaryEmbedding`): the op
//! against plain f64 loops of its stated semantics in every float dtype, its derivative against
//! central finite differences, the scalings' frequencies against their formulas written out
//! regime by regime, and bad input as typed errors.

use ndscope::nn::{RopeScaling, RotaryEmbedding, inverse_frequencies};
use ndscope::{DType, Device, Error, Result, Scope, Tape, Tensor, Var, root};

/// Deterministic values in `[lo, hi)`.
fn values(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            lo + (hi - lo) * ((state >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

const LLAMA3: RopeScaling = RopeScaling::Llama3 {
    factor: 4.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_positions: 32,
};

/// The op's semantics, in f64 loops: each plane `(i, i + dim/2)` of each (token, head) turned by
/// the table's angle at the token's position.
fn reference(
    x: &[f64],
    shape: [usize; 3],
    cos: &[f64],
    sin: &[f64],
    positions: &[i64],
) -> Vec<f64> {
    let [tokens, heads, dim] = shape;
    let half = dim / 2;
    let mut out = vec![0.0; x.len()];
    for (t, &p) in positions.iter().enumerate().take(tokens) {
        let p = p as usize;
        for h in 0..heads {
            let row = (t * heads + h) * dim;
            for i in 0..half {
                let (c, s) = (cos[p * half + i], sin[p * half + i]);
                let (a, b) = (x[row + i], x[row + half + i]);
                out[row + i] = a * c - b * s;
                out[row + half + i] = b * c + a * s;
            }
        }
    }
    out
}

#[test]
fn rotary_agrees_with_f64_loops_in_every_float_dtype() {
    let shape = [7, 3, 16];
    let x: Vec<f64> = values(7 * 3 * 16, 1, -2.0, 2.0);
    // Positions out of order and repeated, as packed rows of several sequences have them.
    let positions = [0i64, 5, 63, 5, 17, 1, 40];
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-6),
        (DType::BF16, 1e-2),
        (DType::F16, 2e-3),
    ] {
        root(Device::Cpu, |s| {
            let rope = RotaryEmbedding::new(s, 16, 64, 10_000.0, &LLAMA3, dtype)?;
            let xs = s.from_slice(&x, &shape)?.to_dtype(dtype)?;
            let rounded = xs.to_vec_f64()?; // the input as the dtype holds it
            let pos = s.from_slice(&positions, &[7])?;
            let got = xs.rotary(rope.cos(), rope.sin(), &pos)?.to_vec_f64()?;
            let want = reference(
                &rounded,
                shape,
                &rope.cos().to_vec_f64()?,
                &rope.sin().to_vec_f64()?,
                &positions,
            );
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= tol * (1.0 + w.abs()),
                    "{dtype} [{k}]: {g} vs {w}"
                );
            }
            Ok::<_, Error>(())
        })
        .unwrap();
    }
}

#[test]
fn the_tables_hold_cos_and_sin_of_position_times_frequency() {
    root(Device::Cpu, |s| {
        let rope = RotaryEmbedding::new(s, 8, 50, 500.0, &RopeScaling::None, DType::F64)?;
        assert_eq!(rope.cos().shape(), &[50, 4]);
        assert_eq!(rope.max_positions(), 50);
        let (cos, sin) = (rope.cos().to_vec::<f64>()?, rope.sin().to_vec::<f64>()?);
        for p in 0..50 {
            for i in 0..4 {
                let angle = p as f64 * 500f64.powf(-(2.0 * i as f64) / 8.0);
                assert!((cos[p * 4 + i] - angle.cos()).abs() < 1e-15);
                assert!((sin[p * 4 + i] - angle.sin()).abs() < 1e-15);
            }
        }
        // A rotation keeps each plane's length.
        let x = s.from_slice(&values(2 * 8, 3, -1.0, 1.0), &[2, 1, 8])?;
        let pos = s.from_slice(&[49i64, 7], &[2])?;
        let y = x.rotary(rope.cos(), rope.sin(), &pos)?;
        let norm = |t: &Tensor<'_>| -> Result<Vec<f64>> {
            let v = t.to_vec::<f64>()?;
            Ok((0..2)
                .flat_map(|r| (0..4).map(move |i| (r, i)))
                .map(|(r, i)| v[r * 8 + i].hypot(v[r * 8 + 4 + i]))
                .collect())
        };
        for (a, b) in norm(&x)?.iter().zip(norm(&y)?) {
            assert!((a - b).abs() < 1e-14);
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn each_scaling_gives_its_formulas_frequencies() {
    let (dim, theta) = (16, 10_000.0f64);
    let base: Vec<f64> = (0..8)
        .map(|i| theta.powf(-(2.0 * i as f64) / 16.0))
        .collect();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-15 * b;
    let plain = inverse_frequencies(dim, theta, &RopeScaling::None).unwrap();
    assert!(
        plain.iter().zip(&base).all(|(p, b)| close(*p, *b)),
        "{plain:?}"
    );
    let linear = inverse_frequencies(dim, theta, &RopeScaling::Linear { factor: 2.5 }).unwrap();
    assert!(
        linear.iter().zip(&base).all(|(l, b)| close(*l, b / 2.5)),
        "{linear:?}"
    );
    // Llama 3 with a context of 32, factors 1 and 4: wavelengths under 8 are kept, over 32 divided
    // by 4, and between them interpolated by (32 / wavelength - 1) / 3.
    let llama3 = inverse_frequencies(dim, theta, &LLAMA3).unwrap();
    let mut regimes = [0; 3];
    for (got, f) in llama3.iter().zip(&base) {
        let wavelength = 2.0 * std::f64::consts::PI / f;
        let want = if wavelength < 8.0 {
            regimes[0] += 1;
            *f
        } else if wavelength > 32.0 {
            regimes[2] += 1;
            f / 4.0
        } else {
            regimes[1] += 1;
            let smooth = (32.0 / wavelength - 1.0) / 3.0;
            (1.0 - smooth) * f / 4.0 + smooth * f
        };
        assert!((got - want).abs() <= 1e-15 * want, "{got} vs {want}");
    }
    assert_eq!(regimes, [1, 1, 6], "each regime is exercised");
}

/// `sum(rotary(x) * w)` and its gradient in `x`, on the tape or not.
/// YaRN's frequencies and attention factor against what transformers 5.24 computes
/// (`ROPE_INIT_FUNCTIONS["yarn"]` for a head of 16; its float32 frequencies, so within 1e-7): the
/// defaults (beta 32/1, truncated ramp, `0.1 ln(factor) + 1`), and every option set.
#[test]
fn yarn_gives_transformers_frequencies_and_attention_factor() {
    let cases: [(f64, RopeScaling, [f64; 8], f64); 2] = [
        (
            10_000.0,
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_positions: 32,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
                attention_factor: 0.1 * 4f64.ln() + 1.0,
            },
            [
                1.0,
                0.197_642_356_157_302_86,
                0.025_000_000_372_529_03,
                0.007_905_694_656_074_047,
                0.002_499_999_944_120_645_5,
                0.000_790_569_465_607_404_7,
                0.000_250_000_011_874_362_8,
                7.905_694_656_074_047e-5,
            ],
            1.138_629_436_111_989,
        ),
        (
            1_000_000.0,
            RopeScaling::Yarn {
                factor: 8.0,
                original_max_positions: 64,
                beta_fast: 16.0,
                beta_slow: 2.0,
                truncate: false,
                // mscale 0.7 over mscale_all_dim 1.0, as LlamaConfig computes it.
                attention_factor: (0.07 * 8f64.ln() + 1.0) / (0.1 * 8f64.ln() + 1.0),
            },
            [
                1.0,
                0.022_228_492_423_892_02,
                0.003_952_847_328_037_023_5,
                0.000_702_926_656_231_284_1,
                0.000_125_000_005_937_181_4,
                2.222_849_252_575_542_8e-5,
                3.952_846_782_340_202_5e-6,
                7.029_266_839_708_725e-7,
            ],
            0.948_355_852_350_339_9,
        ),
    ];
    for (theta, scaling, want, factor) in cases {
        let got = inverse_frequencies(16, theta, &scaling).unwrap();
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                ((g - w) / w).abs() < 1e-6,
                "{scaling:?}: frequency {i} is {g}, transformers' {w}"
            );
        }
        assert!((scaling.attention_scaling() - factor).abs() < 1e-12);
        // The tables carry the factor.
        root(Device::Cpu, |m| {
            let rope = RotaryEmbedding::new(m, 16, 4, theta, &scaling, DType::F64)?;
            let cos = rope.cos().to_vec::<f64>()?;
            assert!((cos[0] - factor).abs() < 1e-12, "cos(0) = {}", cos[0]);
            Ok::<_, Error>(())
        })
        .unwrap();
    }
}

fn projected(s: &Scope<'_>, x: &[f64], with_grad: bool) -> Result<(f64, Vec<f64>)> {
    let rope = RotaryEmbedding::new(s, 6, 20, 100.0, &LLAMA3, DType::F64)?;
    s.scope(|b| {
        let xs = b.from_slice(x, &[3, 2, 6])?;
        let pos = b.from_slice(&[19i64, 0, 4], &[3])?;
        let w = b.from_slice(&values(36, 9, -1.0, 1.0), &[3, 2, 6])?;
        let tape = Tape::new(b);
        let v: Var = tape.param(&xs);
        let loss = rope.apply(&v, &pos)?.mul(&tape.constant(&w))?.sum_all()?;
        let value = loss.value().to_scalar::<f64>()?;
        if !with_grad {
            return Ok((value, Vec::new()));
        }
        let grads = tape.backward(&loss)?;
        Ok((value, grads.get(&xs).expect("watched").to_vec::<f64>()?))
    })
}

#[test]
fn the_derivative_agrees_with_finite_differences() {
    let x = values(36, 5, -1.5, 1.5);
    let h = 1e-6;
    root(Device::Cpu, |s| {
        let (_, grad) = projected(s, &x, true)?;
        let mut probe = x.clone();
        for j in 0..x.len() {
            probe[j] = x[j] + h;
            let (up, _) = projected(s, &probe, false)?;
            probe[j] = x[j] - h;
            let (down, _) = projected(s, &probe, false)?;
            probe[j] = x[j];
            let numeric = (up - down) / (2.0 * h);
            assert!(
                (grad[j] - numeric).abs() <= 1e-7 * (1.0 + numeric.abs()),
                "d/dx[{j}] is {}, finite differences give {numeric}",
                grad[j]
            );
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn bad_input_is_a_typed_error_naming_what_to_fix() {
    root(Device::Cpu, |s| {
        let rope = RotaryEmbedding::new(s, 8, 10, 10_000.0, &RopeScaling::None, DType::F32)?;
        let (cos, sin) = (rope.cos(), rope.sin());
        let x = s.randn(&[2, 1, 8])?;
        let pos = s.from_slice(&[0i64, 1], &[2])?;
        let err = |r: Result<Tensor<'_>>| r.unwrap_err();
        let e = err(x.rotary(cos, sin, &s.from_slice(&[0i64, 10], &[2])?));
        assert!(
            matches!(
                e,
                Error::IndexOutOfRange {
                    index: 10,
                    size: 10,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(x.reshape(&[2, 8])?.rotary(cos, sin, &pos));
        assert!(
            matches!(e, Error::InvalidShape { .. })
                && e.to_string().contains("[tokens, heads, head_dim]"),
            "{e}"
        );
        let e = err(s.randn(&[2, 1, 7])?.rotary(cos, sin, &pos));
        assert!(e.to_string().contains("must be even"), "{e}");
        let e = err(s.randn(&[2, 1, 6])?.rotary(cos, sin, &pos));
        assert!(e.to_string().contains("[max_positions, 3]"), "{e}");
        let e = err(x.to_dtype(DType::F64)?.rotary(cos, sin, &pos));
        assert!(
            matches!(e, Error::UnsupportedDType { .. }) && e.to_string().contains("f64 tables"),
            "{e}"
        );
        let e = err(x.rotary(cos, sin, &s.from_slice(&[0i64], &[1])?));
        assert!(e.to_string().contains("one per token"), "{e}");
        let e = err(x.rotary(cos, sin, &pos.to_dtype(DType::F32)?));
        assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
        for (dim, theta, scaling) in [
            (7, 10_000.0, RopeScaling::None),
            (8, 1.0, RopeScaling::None),
            (8, 10_000.0, RopeScaling::Linear { factor: 0.0 }),
            (
                8,
                10_000.0,
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 4.0,
                    high_freq_factor: 1.0,
                    original_max_positions: 8192,
                },
            ),
        ] {
            let e = RotaryEmbedding::new(s, dim, 4, theta, &scaling, DType::F32).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}
