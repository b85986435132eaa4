//! Property tests: broadcasting and views agree with index arithmetic on plain vectors for random
//! shapes, strides and operands.

mod common;

use common::*;
use ndscope::{Device, Result, Tensor, root};
use proptest::prelude::*;

/// A shape of rank 0..=4 with dimensions 1..=4.
fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..=4, 0..=4)
}

/// A shape and another that broadcasts with it (some dimensions set to 1, some leading ones dropped).
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    shape()
        .prop_flat_map(|a| {
            let n = a.len();
            (Just(a), prop::collection::vec(any::<bool>(), n), 0..=n)
        })
        .prop_map(|(a, ones, drop)| {
            let b: Vec<usize> = a
                .iter()
                .zip(&ones)
                .map(|(&d, &one)| if one { 1 } else { d })
                .collect();
            (a, b[drop..].to_vec())
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn broadcasting_matches_the_reference((sa, sb) in broadcast_pair(), swap in any::<bool>(), seed in 0u64..1000) {
        let (sa, sb) = if swap { (sb, sa) } else { (sa, sb) };
        root(Device::Cpu, |s| -> Result<()> {
            let av = values(sa.iter().product(), seed);
            let bv = values(sb.iter().product(), seed + 1);
            let a = s.from_slice(&av, &sa)?;
            let b = s.from_slice(&bv, &sb)?;
            let sum = a.add(&b)?;
            assert_eq!(sum.shape(), broadcast_shape(&sa, &sb).as_slice());
            assert_close(&sum.to_vec_f64()?, &binary(&av, &sa, &bv, &sb, |x, y| x + y), 1e-12);
            let prod = b.mul(&a)?;
            assert_close(&prod.to_vec_f64()?, &binary(&bv, &sb, &av, &sa, |x, y| x * y), 1e-12);
            Ok(())
        }).unwrap();
    }

    #[test]
    fn permuted_and_narrowed_views_read_the_right_elements(
        shape in prop::collection::vec(1usize..=5, 1..=4),
        perm_seed in any::<u64>(),
        cut in any::<(u8, u8, u8)>(),
    ) {
        root(Device::Cpu, |s| -> Result<()> {
            let n: usize = shape.iter().product();
            let data: Vec<f64> = (0..n).map(|i| i as f64).collect();
            let x = s.from_slice(&data, &shape)?;
            // A permutation from the seed.
            let mut perm: Vec<usize> = (0..shape.len()).collect();
            let mut r = perm_seed;
            for i in (1..perm.len()).rev() {
                perm.swap(i, (r % (i as u64 + 1)) as usize);
                r /= i as u64 + 1;
            }
            let p = x.permute(&perm)?;
            // Narrow one axis of the permuted view.
            let axis = cut.0 as usize % shape.len();
            let size = p.shape()[axis];
            let start = cut.1 as usize % size;
            let len = cut.2 as usize % (size - start) + 1;
            let v = p.narrow(axis as isize, start, len)?;
            // Reference: element at view index i is data[Σ idx_orig[d] * stride[d]].
            let st = strides(&shape);
            let want: Vec<f64> = indices(v.shape()).iter().map(|i| {
                let mut orig = vec![0; shape.len()];
                for (k, &pk) in perm.iter().enumerate() {
                    orig[pk] = i[k] + if k == axis { start } else { 0 };
                }
                orig.iter().zip(&st).map(|(a, b)| (a * b) as f64).sum()
            }).collect();
            assert_eq!(v.to_vec::<f64>()?, want.clone());
            // contiguous() and reshape round-trips keep the values.
            let c = v.contiguous()?;
            assert!(c.is_contiguous());
            assert_eq!(c.reshape(&[c.numel()])?.to_vec::<f64>()?, want.clone());
            assert_eq!(v.sum_all()?.to_scalar::<f64>()?, want.iter().sum::<f64>());
            Ok(())
        }).unwrap();
    }

    #[test]
    fn broadcast_views_repeat_without_copying(base in shape(), extra in prop::collection::vec(1usize..=3, 0..=2)) {
        root(Device::Cpu, |s| -> Result<()> {
            let ones_shape: Vec<usize> = base.iter().map(|_| 1).collect();
            let x = s.from_slice(&[7.0f32], &[1])?.reshape(&ones_shape)?;
            let target: Vec<usize> = extra.iter().chain(&base).copied().collect();
            let b = x.broadcast_to(&target)?;
            assert!(b.shares_storage(&x));
            assert_eq!(b.to_vec::<f32>()?, vec![7.0; target.iter().product()]);
            Ok(())
        }).unwrap();
    }

    #[test]
    fn reshape_of_contiguous_is_a_view(shape in shape()) {
        root(Device::Cpu, |s| -> Result<()> {
            let n: usize = shape.iter().product();
            let x = s.arange(0.0f32, n as f32, 1.0)?;
            let r = x.reshape(&shape)?;
            assert!(r.shares_storage(&x));
            let back: Tensor = r.flatten()?;
            assert_eq!(back.to_vec::<f32>()?, x.to_vec::<f32>()?);
            Ok(())
        }).unwrap();
    }
}
