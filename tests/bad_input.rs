//! Bad input at the edges: empty and zero-sized shapes, shapes too large for memory, element counts
//! that overflow, NaN and infinity in data. Each gets a typed error or a well-defined result, never a
//! panic.

use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::{DType, Device, Error, Tape, Tensor, root};

#[test]
fn zero_sized_tensors_flow_through_every_op() {
    root(Device::Cpu, |s| {
        let x = s.zeros(&[0, 3])?;
        assert_eq!(x.numel(), 0);
        assert_eq!(x.add(&s.ones(&[3])?)?.shape(), &[0, 3]);
        assert_eq!(x.matmul(&s.ones(&[3, 2])?)?.shape(), &[0, 2]);
        assert_eq!(
            s.ones(&[2, 0])?
                .matmul(&s.ones(&[0, 4])?)?
                .to_vec::<f32>()?,
            vec![0.0; 8]
        );
        assert_eq!(x.sum(&[0], false)?.to_vec::<f32>()?, vec![0.0; 3]);
        assert_eq!(x.softmax(-1)?.shape(), &[0, 3]);
        assert_eq!(x.t()?.reshape(&[3, 0])?.shape(), &[3, 0]);
        assert_eq!(
            Tensor::concat(&[&x, &s.ones(&[2, 3])?], 0)?.shape(),
            &[2, 3]
        );
        assert!(x.to_vec::<f32>()?.is_empty());
        // An empty batch through a model and its loss: a typed result, not a panic.
        let model = nn::mlp(s, &[3, 2], Activation::Relu, Init::KaimingUniform)?;
        let tape = Tape::new(s);
        let logits = model.forward(&tape.constant(&x), Mode::Train)?;
        assert_eq!(logits.shape(), &[0, 2]);
        let loss = logits.cross_entropy(&s.from_slice::<i64>(&[], &[0])?)?;
        assert!(
            loss.value().to_scalar::<f32>()?.is_nan(),
            "the mean over no examples is NaN"
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn reductions_of_nothing_have_the_identity_or_an_error() {
    root(Device::Cpu, |s| {
        let x = s.zeros(&[0])?;
        assert_eq!(x.sum_all()?.to_scalar::<f32>()?, 0.0);
        assert!(x.mean_all()?.to_scalar::<f32>()?.is_nan());
        let err = x.argmax(0, false).unwrap_err();
        assert!(matches!(err, Error::InvalidShape { .. }), "{err}");
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn shapes_too_large_for_memory_are_refused() {
    root(Device::Cpu, |s| {
        for shape in [
            vec![usize::MAX, 2],
            vec![1 << 62],
            vec![0, 2, usize::MAX],
            vec![1 << 31, 1 << 31, 4],
        ] {
            let err = s.zeros(&shape).unwrap_err();
            assert!(
                matches!(err, Error::SizeOverflow { .. }),
                "{shape:?}: {err}"
            );
            assert!(err.to_string().contains("check the dimensions"), "{err}");
        }
        // Representable, but more than any machine has: the system allocator refuses.
        let err = s.zeros(&[1 << 58]).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { budget: None, .. }),
            "{err}"
        );
        assert_eq!(s.stats().ooms, 1);
        // Views cannot claim impossible shapes either.
        let x = s.zeros(&[0, 1])?;
        assert!(matches!(
            x.broadcast_to(&[0, usize::MAX, 2]),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            x.reshape(&[0, usize::MAX, 2]),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            s.from_slice::<f32>(&[], &[usize::MAX, 0, 3]),
            Err(Error::SizeOverflow { .. })
        ));
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn nan_and_infinity_propagate_without_panics() {
    root(Device::Cpu, |s| {
        let x = s.from_slice(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0], &[1, 4])?;
        let sm = x.softmax(-1)?.to_vec::<f32>()?;
        assert!(
            sm.iter().all(|v| v.is_nan()),
            "a NaN row gives NaN probabilities: {sm:?}"
        );
        assert!(
            x.max(&[1], false)?.to_scalar::<f32>()?.is_nan(),
            "max propagates NaN"
        );
        assert_eq!(
            x.argmax(1, false)?.to_vec::<i64>()?,
            vec![0],
            "NaN is the largest, as in NumPy"
        );
        let inf_row = s.from_slice(&[f32::INFINITY, 0.0], &[1, 2])?;
        let p = inf_row.softmax(-1)?.to_vec::<f32>()?;
        assert!(p[0].is_nan() || p[0] == 1.0, "{p:?}");
        let tape = Tape::new(s);
        let ce = tape
            .constant(&x)
            .cross_entropy(&s.from_slice(&[3i64], &[1])?)?;
        assert!(ce.value().to_scalar::<f32>()?.is_nan());
        assert_eq!(x.relu()?.to_vec::<f32>()?[1], f32::INFINITY);
        assert!(
            x.to_dtype(DType::I64)?.to_vec::<i64>()?.len() == 4,
            "casts saturate, NaN becomes 0"
        );
        // Gradients through NaN are NaN, and the step still returns.
        let w = s.from_slice(&[f32::NAN, 1.0], &[2])?;
        let tape = Tape::new(s);
        let loss = tape.param(&w).square()?.sum_all()?;
        let g = tape.backward(&loss)?;
        assert!(g.get(&w).unwrap().to_vec::<f32>()?[0].is_nan());
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn integer_division_by_zero_is_an_error() {
    root(Device::Cpu, |s| {
        let a = s.from_slice(&[4i64, 2], &[2])?;
        let err = a.div(&s.from_slice(&[2i64, 0], &[2])?).unwrap_err();
        assert!(matches!(err, Error::DivisionByZero { .. }), "{err}");
        Ok::<_, Error>(())
    })
    .unwrap();
}
