//! Layers built from tensors the caller holds (`Linear`, `LayerNorm`, `RmsNorm` and `Conv2d`'s
//! `from_tensors`): they compute what their definitions say with exactly those tensors, and a
//! tensor of the wrong shape or dtype is refused where the layer is made, naming it (a tensor on
//! another device too, which a build without a GPU cannot make here).

use ndscope::nn::{Conv2d, Init, LayerNorm, Linear, Mode, Module, RmsNorm, WeightLayout};
use ndscope::{Conv2dOptions, DType, Device, Error, Result, Scope, Tape, Tensor, root};

/// `layer(x)`, in f64.
fn forward<'s>(s: &'s Scope<'s>, layer: &impl Module<'s>, x: &Tensor<'s>) -> Result<Vec<f64>> {
    let tape = Tape::new(s);
    let y = layer.forward(&tape.constant(x), Mode::Eval)?;
    y.value().to_dtype(DType::F64)?.to_vec::<f64>()
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{a:?} against {b:?}"
        );
    }
}

#[test]
fn a_linear_layer_of_given_tensors_computes_x_w_plus_b_in_either_layout() -> Result<()> {
    root(Device::Cpu, |s| {
        let (batch, fan_in, fan_out) = (3, 4, 5);
        let x = s.randn(&[batch, fan_in])?;
        let w = s.randn(&[fan_out, fan_in])?; // [out, in]
        let b = s.randn(&[fan_out])?;
        let (xv, wv, bv) = (x.to_vec::<f32>()?, w.to_vec::<f32>()?, b.to_vec::<f32>()?);
        // The definition, in f64 loops.
        let mut want = vec![0.0f64; batch * fan_out];
        for r in 0..batch {
            for o in 0..fan_out {
                want[r * fan_out + o] = f64::from(bv[o])
                    + (0..fan_in)
                        .map(|i| f64::from(xv[r * fan_in + i]) * f64::from(wv[o * fan_in + i]))
                        .sum::<f64>();
            }
        }
        let out_in = Linear::from_tensors(w.clone(), Some(b.clone()), WeightLayout::OutIn)?;
        assert_eq!(
            (out_in.in_features(), out_in.out_features()),
            (fan_in, fan_out)
        );
        close(&forward(s, &out_in, &x)?, &want);
        // The same map stored [in, out].
        let in_out =
            Linear::from_tensors(w.t()?.contiguous()?, Some(b.clone()), WeightLayout::InOut)?;
        assert_eq!(
            (in_out.in_features(), in_out.out_features()),
            (fan_in, fan_out)
        );
        close(&forward(s, &in_out, &x)?, &want);
        // Without a bias.
        let plain = Linear::from_tensors(w.clone(), None, WeightLayout::OutIn)?;
        let unbiased: Vec<f64> = want
            .iter()
            .enumerate()
            .map(|(i, v)| v - f64::from(bv[i % fan_out]))
            .collect();
        close(&forward(s, &plain, &x)?, &unbiased);
        Ok(())
    })
}

#[test]
fn norms_and_convolutions_of_given_tensors_equal_the_layers_with_those_parameters() -> Result<()> {
    root(Device::Cpu, |s| {
        let x = s.randn(&[2, 6])?;
        let (scale, shift) = (s.randn(&[6])?, s.randn(&[6])?);
        let mut made = LayerNorm::with_options(s, 6, 1e-3, true)?;
        made.weight = scale.clone();
        made.bias = Some(shift.clone());
        let given = LayerNorm::from_tensors(scale.clone(), Some(shift), 1e-3)?;
        assert_eq!(given.eps(), 1e-3);
        close(&forward(s, &given, &x)?, &forward(s, &made, &x)?);

        let mut made = RmsNorm::with_eps(s, 6, 1e-4)?;
        made.weight = scale.clone();
        let given = RmsNorm::from_tensors(scale, 1e-4)?;
        close(&forward(s, &given, &x)?, &forward(s, &made, &x)?);

        let images = s.randn(&[2, 4, 5, 5])?;
        let options = Conv2dOptions {
            padding: [1, 1],
            groups: 2,
            ..Default::default()
        };
        let (w, b) = (s.randn(&[6, 2, 3, 3])?, s.randn(&[6])?);
        let mut made = Conv2d::new(s, 4, 6, [3, 3], options, Init::Constant(0.0))?;
        made.weight = w.clone();
        made.bias = b.clone();
        let given = Conv2d::from_tensors(w, b, options)?;
        close(&forward(s, &given, &images)?, &forward(s, &made, &images)?);
        Ok(())
    })
}

#[test]
fn given_tensors_of_the_wrong_shape_or_dtype_are_refused_by_name() -> Result<()> {
    root(Device::Cpu, |s| {
        let w = s.randn(&[3, 2])?;
        let message = |r: Result<String>| r.unwrap_err().to_string();
        let e = Linear::from_tensors(s.randn(&[3, 2, 1])?, None, WeightLayout::OutIn).unwrap_err();
        assert!(
            matches!(e, Error::InvalidShape { .. }) && e.to_string().contains("matrix"),
            "{e}"
        );
        // [out, in] = [3, 2] wants a bias of 3; [in, out] wants 2.
        let e = message(
            Linear::from_tensors(w.clone(), Some(s.zeros(&[2])?), WeightLayout::OutIn)
                .map(|_| String::new()),
        );
        assert!(e.contains("the bias must have the shape [3]"), "{e}");
        Linear::from_tensors(w.clone(), Some(s.zeros(&[2])?), WeightLayout::InOut)?;
        let e = Linear::from_tensors(s.zeros(&[0, 2])?, None, WeightLayout::OutIn).unwrap_err();
        assert!(e.to_string().contains("without a zero dimension"), "{e}");
        let e =
            Linear::from_tensors(w.to_dtype(DType::I64)?, None, WeightLayout::OutIn).unwrap_err();
        assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
        let e = Linear::from_tensors(
            w.clone(),
            Some(s.zeros(&[3])?.to_dtype(DType::F64)?),
            WeightLayout::OutIn,
        )
        .unwrap_err();
        assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");

        let e = LayerNorm::from_tensors(w.clone(), None, 1e-5).unwrap_err();
        assert!(e.to_string().contains("vector"), "{e}");
        let e = LayerNorm::from_tensors(s.ones(&[4])?, Some(s.zeros(&[5])?), 1e-5).unwrap_err();
        assert!(
            e.to_string().contains("the bias must have the shape [4]"),
            "{e}"
        );
        let e = RmsNorm::from_tensors(s.ones(&[4])?, -1.0).unwrap_err();
        assert!(matches!(e, Error::InvalidShape { .. }), "{e}");

        let e = Conv2d::from_tensors(
            s.randn(&[6, 2, 3])?,
            s.zeros(&[6])?,
            Conv2dOptions::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("kh, kw"), "{e}");
        let options = Conv2dOptions {
            groups: 4,
            ..Default::default()
        };
        let e = Conv2d::from_tensors(s.randn(&[6, 1, 3, 3])?, s.zeros(&[6])?, options).unwrap_err();
        assert!(e.to_string().contains("multiple of the groups (4)"), "{e}");
        let e = Conv2d::from_tensors(
            s.randn(&[6, 1, 3, 3])?,
            s.zeros(&[3])?,
            Conv2dOptions::default(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("the bias must have the shape [6]"),
            "{e}"
        );
        Ok(())
    })
}
