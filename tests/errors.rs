//! Every error path: bad input gets a typed error whose message says what was wrong and what to do.

use ndscope::{DType, Device, Error, Result, Scope, Tensor, root};

fn run(f: impl for<'s> FnOnce(&'s Scope<'s>) -> Result<()>) {
    root(Device::Cpu, f).unwrap();
}

/// Asserts `r` is an error matching `pat` whose message contains every `needles`.
macro_rules! assert_err {
    ($r:expr, $pat:pat, $($needle:expr),*) => {{
        let e = $r.expect_err("expected an error");
        assert!(matches!(e, $pat), "unexpected variant: {e:?}");
        let msg = e.to_string();
        $(assert!(msg.contains($needle), "message {msg:?} lacks {:?}", $needle);)*
    }};
}

#[test]
fn shape_mismatches_name_both_shapes() {
    run(|s| {
        let (a, b) = (s.zeros(&[2, 3])?, s.zeros(&[4, 3])?);
        assert_err!(
            a.add(&b),
            Error::ShapeMismatch { .. },
            "add",
            "[2, 3]",
            "[4, 3]",
            "broadcast"
        );
        assert_err!(
            a.matmul(&b),
            Error::ShapeMismatch { .. },
            "matmul",
            "[2, 3]",
            "[4, 3]",
            "last dimension"
        );
        assert_err!(
            Tensor::concat(&[&a, &s.zeros(&[2, 2, 1])?], 0),
            Error::ShapeMismatch { .. },
            "concat"
        );
        assert_err!(
            Tensor::stack(&[&a, &b], 0),
            Error::ShapeMismatch { .. },
            "stack",
            "equal shapes"
        );
        assert_err!(
            a.broadcast_to(&[3, 3]),
            Error::ShapeMismatch { .. },
            "broadcast_to"
        );
        assert_err!(
            a.broadcast_to(&[3]),
            Error::ShapeMismatch { .. },
            "broadcast_to"
        );
        let mut m = s.zeros(&[3])?;
        assert_err!(m.add_(&a), Error::ShapeMismatch { .. }, "add_", "in-place");
        let idx = s.from_slice(&[0i64], &[1])?;
        assert_err!(
            a.gather(1, &idx),
            Error::ShapeMismatch { .. },
            "gather",
            "same rank"
        );
        Ok(())
    });
}

#[test]
fn dtype_mismatches_and_unsupported_dtypes() {
    run(|s| {
        let f = s.zeros(&[2])?;
        let i = s.from_slice(&[1i64, 2], &[2])?;
        assert_err!(
            f.add(&i),
            Error::DTypeMismatch { .. },
            "f32",
            "i64",
            "to_dtype"
        );
        assert_err!(
            i.exp(),
            Error::UnsupportedDType { .. },
            "exp",
            "i64",
            "float"
        );
        assert_err!(i.matmul(&i), Error::UnsupportedDType { .. }, "matmul");
        assert_err!(i.softmax(0), Error::UnsupportedDType { .. }, "softmax");
        assert_err!(i.mean_all(), Error::UnsupportedDType { .. }, "mean");
        assert_err!(
            f.to_vec::<f64>(),
            Error::ElementType { .. },
            "holds f32 elements, not f64",
            "to_vec::<f32>()"
        );
        assert_err!(
            f.as_slice::<i64>(),
            Error::ElementType { .. },
            "as_slice",
            "DType::I64"
        );
        assert_err!(i.to_scalar::<f32>(), Error::ElementType { .. }, "to_scalar");
        assert_err!(
            f.index_select(0, &f),
            Error::UnsupportedDType { .. },
            "i64 indices"
        );
        Ok(())
    });
}

#[test]
fn axes_and_indices_out_of_range() {
    run(|s| {
        let a = s.zeros(&[2, 3])?;
        assert_err!(
            a.sum(&[2], false),
            Error::AxisOutOfRange {
                axis: 2,
                rank: 2,
                ..
            },
            "axis 2",
            "rank 2"
        );
        assert_err!(
            a.softmax(-3),
            Error::AxisOutOfRange { axis: -3, .. },
            "axis -3"
        );
        assert_err!(
            a.sum(&[0, -2], false),
            Error::InvalidArgument { .. },
            "named twice"
        );
        assert_err!(a.transpose(0, 5), Error::AxisOutOfRange { .. }, "transpose");
        assert_err!(a.unsqueeze(4), Error::AxisOutOfRange { .. }, "unsqueeze");
        let idx = s.from_slice(&[0i64, 3], &[2])?;
        assert_err!(
            a.index_select(1, &idx),
            Error::IndexOutOfRange {
                index: 3,
                size: 3,
                ..
            },
            "index 3",
            "0..3"
        );
        let neg = s.from_slice(&[-1i64, 0, 0, 0, 0, 0], &[2, 3])?;
        assert_err!(
            a.gather(1, &neg),
            Error::IndexOutOfRange { index: -1, .. },
            "gather"
        );
        assert_err!(
            s.zeros(&[0])?.argmax(0, false),
            Error::InvalidShape { .. },
            "argmax",
            "empty"
        );
        assert_err!(
            s.zeros(&[2, 0])?.max(&[1], false),
            Error::InvalidShape { .. },
            "empty axis"
        );
        Ok(())
    });
}

#[test]
fn bad_shapes_and_lengths() {
    run(|s| {
        assert_err!(
            s.from_slice(&[1.0f32, 2.0, 3.0], &[2, 2]),
            Error::DataLength {
                expected: 4,
                got: 3,
                ..
            },
            "4 elements",
            "3"
        );
        let a = s.zeros(&[2, 3])?;
        assert_err!(
            a.reshape(&[4, 2]),
            Error::InvalidShape { .. },
            "reshape",
            "8 elements",
            "[2, 3]"
        );
        assert_err!(
            a.narrow(1, 2, 2),
            Error::InvalidShape { .. },
            "2..4",
            "size 3"
        );
        assert_err!(
            a.narrow(1, usize::MAX, 2),
            Error::InvalidShape { .. },
            "narrow"
        );
        assert_err!(a.squeeze(0), Error::InvalidShape { .. }, "size 2");
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = a.slice(1, 2..1);
        assert_err!(reversed, Error::InvalidShape { .. }, "reversed");
        assert_err!(a.slice(0, 1..3), Error::InvalidShape { .. }, "1..3");
        assert_err!(
            a.permute(&[0, 0]),
            Error::InvalidShape { .. },
            "permutation"
        );
        assert_err!(a.permute(&[0]), Error::InvalidShape { .. }, "permutation");
        assert_err!(
            a.t()?.t()?.sum(&[0], false)?.t(),
            Error::InvalidShape { .. },
            "2-D"
        );
        assert_err!(
            a.to_scalar::<f32>(),
            Error::InvalidShape { .. },
            "6 elements"
        );
        assert_err!(
            a.t()?.as_slice::<f32>(),
            Error::NotContiguous { .. },
            "contiguous()"
        );
        assert_err!(
            s.ones(&[])?.matmul(&a),
            Error::InvalidShape { .. },
            "rank 1 or more"
        );
        assert_err!(Tensor::concat(&[], 0), Error::Empty { .. }, "at least one");
        assert_err!(a.clamp(1.0, -1.0), Error::InvalidArgument { .. }, "ordered");
        assert_err!(
            s.arange(0.0f32, 1.0, 0.0),
            Error::InvalidArgument { .. },
            "non-zero step"
        );
        assert_err!(
            s.arange(0.0f64, f64::INFINITY, 1.0),
            Error::InvalidArgument { .. },
            "finite"
        );
        Ok(())
    });
}

#[test]
fn huge_and_overflowing_shapes_are_errors_not_aborts() {
    run(|s| {
        assert_err!(
            s.zeros(&[usize::MAX, 2]),
            Error::SizeOverflow { .. },
            "check the dimensions"
        );
        assert_err!(
            s.zeros(&[1 << 40, 1 << 30]),
            Error::SizeOverflow { .. },
            "bytes"
        );
        assert_err!(
            s.arange(0.0f64, 1e300, 1e-300),
            Error::SizeOverflow { .. },
            "dimensions"
        );
        // Representable, but far more than the machine has: the system allocator says no.
        assert_err!(
            s.zeros(&[1 << 60]),
            Error::OutOfMemory { budget: None, .. },
            "cpu allocator refused"
        );
        assert_eq!(s.stats().ooms, 1);
        Ok(())
    });
}

#[test]
fn integer_division_by_zero() {
    run(|s| {
        let a = s.from_slice(&[4i64, 6], &[2])?;
        assert_err!(
            a.div(&s.from_slice(&[2i64, 0], &[2])?),
            Error::DivisionByZero { .. },
            "division by zero"
        );
        assert_err!(
            a.div_scalar(0.0),
            Error::DivisionByZero { .. },
            "div_scalar"
        );
        assert_eq!(
            a.div(&s.from_slice(&[2i64], &[1])?)?.to_vec::<i64>()?,
            vec![2, 3]
        );
        // Floats follow IEEE 754.
        let f = s
            .from_slice(&[1.0f32, 0.0], &[2])?
            .div(&s.zeros(&[2])?)?
            .to_vec::<f32>()?;
        assert!(f[0].is_infinite() && f[1].is_nan());
        Ok(())
    });
}

#[test]
fn nan_and_infinity_flow_through_without_panics() {
    run(|s| {
        let x = s.from_slice(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0], &[4])?;
        assert!(x.sum_all()?.to_scalar::<f32>()?.is_nan());
        assert!(x.max(&[0], false)?.to_scalar::<f32>()?.is_nan());
        assert!(
            x.relu()?.to_vec::<f32>()?[0].is_nan(),
            "relu keeps NaN visible"
        );
        assert_eq!(x.clamp(-1.0, 1.0)?.to_vec::<f32>()?[1..], [1.0, -1.0, 1.0]);
        assert_eq!(
            x.to_dtype(DType::I64)?.to_vec::<i64>()?,
            vec![0, i64::MAX, i64::MIN, 1]
        );
        let _ = x.softmax(0)?.log_softmax(0)?.matmul(&x)?;
        Ok(())
    });
}

#[test]
fn device_names_parse_and_bad_ones_say_what_to_write() {
    assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
    assert_eq!(" CUDA:3 ".parse::<Device>().unwrap(), Device::Cuda(3));
    assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
    for d in [Device::Cpu, Device::Cuda(0), Device::Cuda(12)] {
        assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
    }
    for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "", "cpu:0"] {
        let err = bad.parse::<Device>().unwrap_err();
        assert!(
            matches!(&err, Error::InvalidDevice { text } if text == bad),
            "{err:?}"
        );
        assert!(err.to_string().contains("`cuda:N`"), "{err}");
    }
}

#[test]
fn arguments_that_are_not_shapes_are_invalid_arguments() {
    use ndscope::serve::Sampling;
    for t in [-1.0, f64::NAN, f64::INFINITY] {
        let e = Sampling::with_temperature(t).check().unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { op: "Sampling", .. }),
            "{e}"
        );
        assert!(
            e.to_string()
                .starts_with("Sampling: the temperature must be a finite number >= 0"),
            "the message names the setting, not a shape: {e}"
        );
    }
    let top_p = Sampling {
        top_p: 1.5,
        ..Sampling::GREEDY
    };
    let e = top_p.check().unwrap_err();
    assert!(e.to_string().contains("top_p must be in (0, 1]"), "{e}");
}
