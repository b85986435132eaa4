//! Every op's numbers against the plain f64 loops of `common`.

mod common;

use common::*;
use ndscope::{DType, Device, Error, Result, Scope, Tensor, root};

fn run(f: impl for<'s> FnOnce(&'s Scope<'s>) -> Result<()>) {
    root(Device::Cpu, f).unwrap();
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// A tensor with values `values(n, seed)` in `shape`.
fn tensor<'s>(s: &Scope<'s>, shape: &[usize], seed: u64) -> Result<(Tensor<'s>, Vec<f64>)> {
    let n = shape.iter().product();
    let v: Vec<f64> = f32s(&values(n, seed)).iter().map(|&x| x as f64).collect();
    Ok((s.from_slice(&f32s(&v), shape)?, v))
}

#[test]
fn binary_ops_broadcast_like_numpy() {
    run(|s| {
        let cases: [(&[usize], &[usize]); 6] = [
            (&[2, 3], &[2, 3]),
            (&[2, 3], &[3]),
            (&[4, 1], &[1, 5]),
            (&[3], &[2, 1, 3]),
            (&[], &[2, 2]),
            (&[2, 1, 3], &[4, 1]),
        ];
        type Op = (&'static str, fn(f64, f64) -> f64);
        let ops: [Op; 7] = [
            ("add", |a, b| a + b),
            ("sub", |a, b| a - b),
            ("mul", |a, b| a * b),
            ("div", |a, b| a / b),
            ("maximum", f64::max),
            ("minimum", f64::min),
            ("gt", |a, b| (a > b) as u8 as f64),
        ];
        for (k, (sa, sb)) in cases.iter().enumerate() {
            let (a, av) = tensor(s, sa, k as u64)?;
            let (b, bv) = tensor(s, sb, 100 + k as u64)?;
            for (name, f) in ops {
                let got = match name {
                    "add" => a.add(&b)?,
                    "sub" => a.sub(&b)?,
                    "mul" => a.mul(&b)?,
                    "div" => a.div(&b)?,
                    "maximum" => a.maximum(&b)?,
                    "minimum" => a.minimum(&b)?,
                    _ => a.gt(&b)?,
                };
                assert_eq!(
                    got.shape(),
                    broadcast_shape(sa, sb).as_slice(),
                    "{name} {sa:?} {sb:?}"
                );
                assert_close(&got.to_vec_f64()?, &binary(&av, sa, &bv, sb, f), 1e-6);
            }
        }
        Ok(())
    });
}

#[test]
fn comparisons_give_ones_and_zeros_in_the_operand_dtype() {
    run(|s| {
        let a = s.from_slice(&[1i64, 2, 3], &[3])?;
        let b = s.from_slice(&[2i64], &[1])?;
        assert_eq!(a.eq(&b)?.to_vec::<i64>()?, vec![0, 1, 0]);
        assert_eq!(a.ne(&b)?.to_vec::<i64>()?, vec![1, 0, 1]);
        assert_eq!(a.lt(&b)?.to_vec::<i64>()?, vec![1, 0, 0]);
        assert_eq!(a.le(&b)?.to_vec::<i64>()?, vec![1, 1, 0]);
        assert_eq!(a.ge(&b)?.to_vec::<i64>()?, vec![0, 1, 1]);
        Ok(())
    });
}

#[test]
fn binary_ops_read_strided_views() {
    run(|s| {
        let (a, av) = tensor(s, &[3, 4], 1)?;
        let (b, bv) = tensor(s, &[4, 3], 2)?;
        // a + b^T, and a narrowed column block times a broadcast row.
        let got = a.add(&b.t()?)?;
        let bt: Vec<f64> = indices(&[3, 4])
            .iter()
            .map(|i| bv[i[1] * 3 + i[0]])
            .collect();
        assert_close(
            &got.to_vec_f64()?,
            &binary(&av, &[3, 4], &bt, &[3, 4], |x, y| x + y),
            1e-6,
        );
        let cols = a.narrow(1, 1, 2)?;
        let want: Vec<f64> = indices(&[3, 2])
            .iter()
            .map(|i| av[i[0] * 4 + i[1] + 1] * 2.0)
            .collect();
        assert_close(
            &cols.mul(&s.full(&[1, 2], 2.0)?)?.to_vec_f64()?,
            &want,
            1e-6,
        );
        Ok(())
    });
}

#[test]
fn unary_ops_match_std() {
    run(|s| {
        let (x, xv) = tensor(s, &[2, 5], 9)?;
        type Op<'a> = (
            &'static str,
            fn(&Tensor<'a>) -> Result<Tensor<'a>>,
            fn(f64) -> f64,
        );
        let ops: Vec<Op<'_>> = vec![
            ("neg", |t| t.neg(), |x| -x),
            ("abs", |t| t.abs(), f64::abs),
            ("square", |t| t.square(), |x| x * x),
            ("relu", |t| t.relu(), |x| x.max(0.0)),
            ("exp", |t| t.exp(), f64::exp),
            ("tanh", |t| t.tanh(), f64::tanh),
            ("sin", |t| t.sin(), f64::sin),
            ("cos", |t| t.cos(), f64::cos),
            ("sigmoid", |t| t.sigmoid(), |x| 1.0 / (1.0 + (-x).exp())),
            ("recip", |t| t.recip(), |x| 1.0 / x),
            ("expm1", |t| t.expm1(), f64::exp_m1),
            (
                "gelu",
                |t| t.gelu(),
                |x| {
                    0.5 * x
                        * (1.0
                            + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3)))
                                .tanh())
                },
            ),
        ];
        for (name, op, f) in ops {
            let want: Vec<f64> = xv.iter().map(|&v| f(v)).collect();
            let got = op(&x)?;
            assert_close(&got.to_vec_f64()?, &want, 1e-5);
            assert_eq!(got.shape(), &[2, 5], "{name}");
        }
        let pos = x.abs()?.add_scalar(0.5)?;
        let pv: Vec<f64> = xv.iter().map(|v| v.abs() + 0.5).collect();
        assert_close(
            &pos.log1p()?.to_vec_f64()?,
            &pv.iter().map(|v| v.ln_1p()).collect::<Vec<_>>(),
            1e-5,
        );
        assert_close(
            &pos.log()?.to_vec_f64()?,
            &pv.iter().map(|v| v.ln()).collect::<Vec<_>>(),
            1e-5,
        );
        assert_close(
            &pos.sqrt()?.to_vec_f64()?,
            &pv.iter().map(|v| v.sqrt()).collect::<Vec<_>>(),
            1e-5,
        );
        assert_close(
            &pos.powf(1.5)?.to_vec_f64()?,
            &pv.iter().map(|v| v.powf(1.5)).collect::<Vec<_>>(),
            1e-5,
        );
        let e = s.full(&[1], 2.0)?;
        assert_close(
            &pos.pow(&e)?.to_vec_f64()?,
            &pv.iter().map(|v| v * v).collect::<Vec<_>>(),
            1e-5,
        );
        Ok(())
    });
}

#[test]
fn sigmoid_is_finite_for_large_inputs() {
    run(|s| {
        let x = s.from_slice(&[-1000.0f32, 1000.0, 0.0], &[3])?;
        assert_eq!(x.sigmoid()?.to_vec::<f32>()?, vec![0.0, 1.0, 0.5]);
        Ok(())
    });
}

#[test]
fn scalar_ops_and_clamp() {
    run(|s| {
        let (x, xv) = tensor(s, &[7], 3)?;
        let m = |f: fn(f64) -> f64| xv.iter().map(|&v| f(v)).collect::<Vec<_>>();
        assert_close(&x.add_scalar(1.5)?.to_vec_f64()?, &m(|v| v + 1.5), 1e-6);
        assert_close(&x.mul_scalar(-3.0)?.to_vec_f64()?, &m(|v| v * -3.0), 1e-6);
        assert_close(&x.div_scalar(4.0)?.to_vec_f64()?, &m(|v| v / 4.0), 1e-6);
        assert_close(
            &x.clamp(-0.5, 0.5)?.to_vec_f64()?,
            &m(|v| v.clamp(-0.5, 0.5)),
            1e-6,
        );
        let i = s.from_slice(&[7i64, -7, 9], &[3])?;
        assert_eq!(i.div_scalar(2.0)?.to_vec::<i64>()?, vec![3, -3, 4]);
        Ok(())
    });
}

#[test]
fn where_cond_broadcasts_three_ways() {
    run(|s| {
        let cond = s.from_slice(&[1.0f32, 0.0], &[2, 1])?;
        let a = s.from_slice(&[1.0f64, 2.0, 3.0], &[3])?;
        let b = s.full_dtype(&[1], -1.0, DType::F64)?;
        let cond64 = cond.to_dtype(DType::F64)?;
        let got = Tensor::where_cond(&cond64, &a, &b)?;
        assert_eq!(got.shape(), &[2, 3]);
        assert_eq!(got.to_vec::<f64>()?, vec![1.0, 2.0, 3.0, -1.0, -1.0, -1.0]);
        // A condition of another dtype than the branches.
        let mixed = Tensor::where_cond(&cond, &a, &b)?;
        assert_eq!(mixed.to_vec::<f64>()?, got.to_vec::<f64>()?);
        Ok(())
    });
}

#[test]
fn dtype_casts() {
    run(|s| {
        let x = s.from_slice(&[1.7f32, -2.2, f32::NAN, 1e30], &[4])?;
        assert_eq!(
            x.to_dtype(DType::I64)?.to_vec::<i64>()?,
            vec![1, -2, 0, i64::MAX]
        );
        assert_eq!(x.to_dtype(DType::F64)?.to_vec::<f64>()?[0], 1.7f32 as f64);
        let i = s.arange(0i64, 4, 1)?;
        assert_eq!(
            i.to_dtype(DType::F32)?.to_vec::<f32>()?,
            vec![0.0, 1.0, 2.0, 3.0]
        );
        Ok(())
    });
}

#[test]
fn matmul_2d_batched_transposed_and_vectors() {
    run(|s| {
        for (m, k, n) in [(1, 1, 1), (3, 4, 5), (17, 33, 9), (64, 64, 64)] {
            let (a, av) = tensor(s, &[m, k], 11)?;
            let (b, bv) = tensor(s, &[k, n], 12)?;
            assert_close(
                &a.matmul(&b)?.to_vec_f64()?,
                &matmul(&av, &bv, m, k, n),
                1e-4,
            );
            // (b^T a^T)^T through strided views.
            let via_t = b.t()?.matmul(&a.t()?)?.t()?;
            assert_close(&via_t.to_vec_f64()?, &matmul(&av, &bv, m, k, n), 1e-4);
        }
        // A `Linear`'s `x Wᵀ` (W stored [n, k]) with more rows than decoding's streamed products
        // take: alone, then batched over one weight.
        let transposed = |wv: &[f64], k: usize, n: usize| -> Vec<f64> {
            (0..k * n).map(|i| wv[(i % n) * k + i / n]).collect()
        };
        // (40, 1030, 100) and the second batch below: from 32 rows by 64 weight rows of 1,024 or
        // more, the weight is transposed a chunk at a time before `gemm` (AVX-512 CPUs), with
        // edges past the 16 × 16 blocks.
        for (m, k, n) in [(17, 64, 5), (40, 130, 33), (40, 1030, 100)] {
            let (x, xv) = tensor(s, &[m, k], 17)?;
            let (w, wv) = tensor(s, &[n, k], 18)?;
            let want = matmul(&xv, &transposed(&wv, k, n), m, k, n);
            assert_close(&x.matmul(&w.t()?)?.to_vec_f64()?, &want, 1e-4);
        }
        for (m, k, n) in [(20, 100, 7), (33, 1040, 70)] {
            let (x, xv) = tensor(s, &[2, m, k], 19)?;
            let (w, wv) = tensor(s, &[n, k], 20)?;
            let wt = transposed(&wv, k, n);
            let mut want = matmul(&xv[..m * k], &wt, m, k, n);
            want.extend(matmul(&xv[m * k..], &wt, m, k, n));
            assert_close(&x.matmul(&w.t()?)?.to_vec_f64()?, &want, 1e-4);
        }
        // Batched with a broadcast batch dimension: [2, 3, 4] @ [4, 2].
        let (a, av) = tensor(s, &[2, 3, 4], 13)?;
        let (b, bv) = tensor(s, &[4, 2], 14)?;
        let got = a.matmul(&b)?;
        assert_eq!(got.shape(), &[2, 3, 2]);
        let mut want = matmul(&av[..12], &bv, 3, 4, 2);
        want.extend(matmul(&av[12..], &bv, 3, 4, 2));
        assert_close(&got.to_vec_f64()?, &want, 1e-5);
        // [2, 1, 2, 3] @ [3, 3, 2]: batch dims broadcast to [2, 3].
        let (c, _) = tensor(s, &[2, 1, 2, 3], 15)?;
        let (d, _) = tensor(s, &[3, 3, 2], 16)?;
        assert_eq!(c.matmul(&d)?.shape(), &[2, 3, 2, 2]);
        // Vectors.
        let v = s.from_slice(&[1.0f32, 2.0], &[2])?;
        let mat = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
        assert_eq!(v.matmul(&mat)?.to_vec::<f32>()?, vec![7.0, 10.0]);
        assert_eq!(mat.matmul(&v)?.to_vec::<f32>()?, vec![5.0, 11.0]);
        assert_eq!(v.matmul(&v)?.shape(), &[] as &[usize]);
        // f64 and an empty inner dimension.
        let a64 = s.from_slice(&[1.0f64, 2.0], &[1, 2])?;
        assert_eq!(a64.matmul(&a64.t()?)?.to_vec::<f64>()?, vec![5.0]);
        assert_eq!(
            s.zeros(&[2, 0])?
                .matmul(&s.zeros(&[0, 3])?)?
                .to_vec::<f32>()?,
            vec![0.0; 6]
        );
        Ok(())
    });
}

#[test]
fn large_matmul_uses_threads_and_stays_exact_enough() {
    run(|s| {
        let (m, k, n) = (96, 80, 72);
        let (a, av) = tensor(s, &[m, k], 21)?;
        let (b, bv) = tensor(s, &[k, n], 22)?;
        assert_close(
            &a.matmul(&b)?.to_vec_f64()?,
            &matmul(&av, &bv, m, k, n),
            1e-4,
        );
        Ok(())
    });
}

#[test]
fn reductions_over_any_axes() {
    run(|s| {
        let shape = [2, 3, 4];
        let (x, xv) = tensor(s, &shape, 31)?;
        let xt = x.permute(&[2, 0, 1])?; // a strided input: shape [4, 2, 3]
        let xtv = xt.contiguous()?.to_vec_f64()?;
        for axes in [
            vec![0],
            vec![1],
            vec![2],
            vec![0, 2],
            vec![1, 2],
            vec![0, 1, 2],
        ] {
            let ia: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
            assert_close(
                &x.sum(&ia, true)?.to_vec_f64()?,
                &reduce(&xv, &shape, &axes, 0.0, |a, b| a + b),
                1e-5,
            );
            assert_close(
                &x.max(&ia, false)?.to_vec_f64()?,
                &reduce(&xv, &shape, &axes, f64::MIN, f64::max),
                1e-6,
            );
            assert_close(
                &x.min(&ia, false)?.to_vec_f64()?,
                &reduce(&xv, &shape, &axes, f64::MAX, f64::min),
                1e-6,
            );
            let count: usize = axes.iter().map(|&a| shape[a]).product();
            let mean: Vec<f64> = reduce(&xv, &shape, &axes, 0.0, |a, b| a + b)
                .iter()
                .map(|v| v / count as f64)
                .collect();
            assert_close(&x.mean(&ia, false)?.to_vec_f64()?, &mean, 1e-5);
            let tshape = [4, 2, 3];
            assert_close(
                &xt.sum(&ia, true)?.to_vec_f64()?,
                &reduce(&xtv, &tshape, &axes, 0.0, |a, b| a + b),
                1e-5,
            );
        }
        assert_eq!(x.sum(&[-1], false)?.shape(), &[2, 3]);
        assert_eq!(x.sum(&[0, 2], true)?.shape(), &[1, 3, 1]);
        assert_close(&x.sum_all()?.to_vec_f64()?, &[xv.iter().sum()], 1e-5);
        assert_close(
            &x.mean_all()?.to_vec_f64()?,
            &[xv.iter().sum::<f64>() / 24.0],
            1e-5,
        );
        // Empty sums are zero.
        assert_eq!(
            s.zeros(&[0, 3])?.sum(&[0], false)?.to_vec::<f32>()?,
            vec![0.0; 3]
        );
        Ok(())
    });
}

#[test]
fn reductions_of_large_rows_run_in_parallel_correctly() {
    run(|s| {
        let (x, xv) = tensor(s, &[64, 2048], 41)?;
        let want = reduce(&xv, &[64, 2048], &[1], 0.0, |a, b| a + b);
        assert_close(&x.sum(&[1], false)?.to_vec_f64()?, &want, 1e-4);
        let want0 = reduce(&xv, &[64, 2048], &[0], 0.0, |a, b| a + b);
        assert_close(&x.sum(&[0], false)?.to_vec_f64()?, &want0, 1e-4);
        Ok(())
    });
}

#[test]
fn leading_reductions_equal_the_strided_walk_bit_for_bit() {
    // A bias's gradient: the sum over leading axes of a contiguous tensor has its own loop
    // (column runs, in parallel); a strided view of the same values takes the general walk, which
    // combines each column's rows in the same order, so both give the same bits. 70 × 1,100
    // elements: parallel, and a ragged last run of columns.
    run(|s| {
        let (wide, _) = tensor(s, &[70, 2 * 1100], 43)?;
        let mut values = wide.to_vec::<f32>()?;
        values[5 * 2200 + 17] = f32::NAN;
        values[9 * 2200 + 1099] = f32::INFINITY;
        let wide = s.from_slice(&values, &[70, 2200])?;
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let wide = wide.to_dtype(dtype)?;
            let strided = wide.narrow(1, 0, 1100)?;
            let contiguous = strided.contiguous()?;
            let as_3d = contiguous.reshape(&[7, 10, 1100])?;
            let bits = |t: Tensor<'_>| -> Result<Vec<u64>> {
                Ok(t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect())
            };
            for (name, leading, walked) in [
                (
                    "sum",
                    contiguous.sum(&[0], false)?,
                    strided.sum(&[0], false)?,
                ),
                (
                    "mean",
                    contiguous.mean(&[0], false)?,
                    strided.mean(&[0], false)?,
                ),
                (
                    "max",
                    contiguous.max(&[0], false)?,
                    strided.max(&[0], false)?,
                ),
                (
                    "min",
                    contiguous.min(&[0], false)?,
                    strided.min(&[0], false)?,
                ),
                (
                    "sum of two axes",
                    as_3d.sum(&[0, 1], false)?,
                    strided.sum(&[0], false)?,
                ),
            ] {
                let (leading, walked) = (bits(leading)?, bits(walked)?);
                let differs = leading.iter().zip(&walked).position(|(a, b)| a != b);
                assert_eq!(
                    differs, None,
                    "{dtype:?} {name}: the first column that differs"
                );
            }
            let sums = contiguous.sum(&[0], false)?.to_vec_f64()?;
            assert!(
                sums[17].is_nan() && sums[1099] == f64::INFINITY,
                "{dtype:?}"
            );
        }
        // Nothing to reduce over: zeros for sums.
        assert_eq!(
            s.zeros(&[0, 3, 4])?.sum(&[0, 1], false)?.to_vec::<f32>()?,
            vec![0.0; 4]
        );
        Ok(())
    });
}

#[test]
fn argmax_picks_first_maximum_and_first_nan() {
    run(|s| {
        let x = s.from_slice(&[1.0f32, 3.0, 3.0, 0.0, -1.0, 2.0], &[2, 3])?;
        assert_eq!(x.argmax(1, false)?.to_vec::<i64>()?, vec![1, 2]);
        assert_eq!(x.argmax(0, true)?.shape(), &[1, 3]);
        assert_eq!(x.argmax(0, false)?.to_vec::<i64>()?, vec![0, 0, 0]);
        let n = s.from_slice(&[1.0f32, f32::NAN, 5.0], &[3])?;
        assert_eq!(n.argmax(0, false)?.to_vec::<i64>()?, vec![1]);
        assert!(n.max(&[0], false)?.to_scalar::<f32>()?.is_nan());
        // Strided input.
        assert_eq!(x.t()?.argmax(0, false)?.to_vec::<i64>()?, vec![1, 2]);
        Ok(())
    });
}

fn ref_softmax(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

#[test]
fn softmax_and_log_softmax_on_every_axis() {
    run(|s| {
        let (x, xv) = tensor(s, &[3, 4], 51)?;
        let sm = x.softmax(1)?.to_vec_f64()?;
        let want: Vec<f64> = xv.chunks(4).flat_map(ref_softmax).collect();
        assert_close(&sm, &want, 1e-6);
        let lsm = x.log_softmax(-1)?.to_vec_f64()?;
        assert_close(&lsm, &want.iter().map(|v| v.ln()).collect::<Vec<_>>(), 1e-5);
        // Axis 0: columns.
        let cols = x.softmax(0)?;
        assert_eq!(cols.shape(), &[3, 4]);
        let cv = cols.to_vec_f64()?;
        for j in 0..4 {
            let col: Vec<f64> = (0..3).map(|i| xv[i * 4 + j]).collect();
            let want = ref_softmax(&col);
            for i in 0..3 {
                assert!((cv[i * 4 + j] - want[i]).abs() < 1e-6);
            }
        }
        // Stability: huge logits, and a fully masked row.
        let big = s
            .from_slice(&[1e4f32, 0.0, -1e4], &[3])?
            .log_softmax(0)?
            .to_vec::<f32>()?;
        assert!(big.iter().all(|v| v.is_finite()) && big[0] == 0.0);
        let masked = s
            .full(&[2], f64::NEG_INFINITY)?
            .softmax(0)?
            .to_vec::<f32>()?;
        assert!(masked.iter().all(|v| v.is_nan()));
        Ok(())
    });
}

#[test]
fn gather_and_index_select() {
    run(|s| {
        let (x, xv) = tensor(s, &[3, 4], 61)?;
        let idx = s.from_slice(&[3i64, 0, 1, 1, 2, 2], &[3, 2])?;
        let g = x.gather(1, &idx)?;
        let want: Vec<f64> = vec![xv[3], xv[0], xv[5], xv[5], xv[10], xv[10]];
        assert_close(&g.to_vec_f64()?, &want, 0.0);
        let idx0 = s.from_slice(&[2i64, 0, 1, 0], &[1, 4])?;
        assert_close(
            &x.gather(0, &idx0)?.to_vec_f64()?,
            &[xv[8], xv[1], xv[6], xv[3]],
            0.0,
        );
        let sel = x.index_select(1, &s.from_slice(&[3i64, 3, 0], &[3])?)?;
        assert_eq!(sel.shape(), &[3, 3]);
        let want: Vec<f64> = (0..3)
            .flat_map(|r| [xv[r * 4 + 3], xv[r * 4 + 3], xv[r * 4]])
            .collect();
        assert_close(&sel.to_vec_f64()?, &want, 0.0);
        // On a transposed view.
        let selt = x.t()?.index_select(0, &s.from_slice(&[1i64], &[1])?)?;
        assert_close(&selt.to_vec_f64()?, &[xv[1], xv[5], xv[9]], 0.0);
        Ok(())
    });
}

#[test]
fn concat_and_stack() {
    run(|s| {
        let a = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
        let b = s.from_slice(&[5.0f32, 6.0], &[2, 1])?;
        let c = Tensor::concat(&[&a, &b], 1)?;
        assert_eq!(c.to_vec::<f32>()?, vec![1.0, 2.0, 5.0, 3.0, 4.0, 6.0]);
        let r = Tensor::concat(&[&a, &a.t()?], 0)?;
        assert_eq!(
            r.to_vec::<f32>()?,
            vec![1.0, 2.0, 3.0, 4.0, 1.0, 3.0, 2.0, 4.0]
        );
        let st = Tensor::stack(&[&a, &a], 0)?;
        assert_eq!(st.shape(), &[2, 2, 2]);
        let st1 = Tensor::stack(&[&b.flatten()?, &b.flatten()?], 1)?;
        assert_eq!(st1.to_vec::<f32>()?, vec![5.0, 5.0, 6.0, 6.0]);
        Ok(())
    });
}

#[test]
fn views_share_storage_and_copy_only_when_needed() {
    run(|s| {
        let x = s.arange(0.0f32, 24.0, 1.0)?.reshape(&[2, 3, 4])?;
        let t = x.transpose(0, 2)?;
        assert!(t.shares_storage(&x) && !t.is_contiguous());
        assert_eq!(t.shape(), &[4, 3, 2]);
        assert_eq!(
            t.narrow(0, 1, 1)?.squeeze(0)?.to_vec::<f32>()?,
            vec![1.0, 13.0, 5.0, 17.0, 9.0, 21.0]
        );
        let c = t.contiguous()?;
        assert!(!c.shares_storage(&x) && c.is_contiguous());
        assert!(x.contiguous()?.shares_storage(&x));
        let r = t.reshape(&[24])?; // strided: copies
        assert!(!r.shares_storage(&x));
        assert_eq!(r.to_vec::<f32>()?[..4], [0.0, 12.0, 4.0, 16.0]);
        let u = x.unsqueeze(0)?.unsqueeze(-1)?;
        assert_eq!(u.shape(), &[1, 2, 3, 4, 1]);
        assert!(u.shares_storage(&x));
        let b = s
            .from_slice(&[1.0f32, 2.0], &[2, 1])?
            .broadcast_to(&[3, 2, 4])?;
        assert_eq!(b.strides(), &[0, 1, 0]);
        assert_eq!(b.sum_all()?.to_scalar::<f32>()?, 36.0);
        assert_eq!(x.permute(&[1, 2, 0])?.shape(), &[3, 4, 2]);
        Ok(())
    });
}

#[test]
fn in_place_ops_copy_on_write() {
    run(|s| {
        let mut a = s.from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
        let alias = a.clone();
        a.add_(&s.ones(&[1])?)?;
        assert_eq!(a.to_vec::<f32>()?, vec![2.0, 3.0, 4.0]);
        assert_eq!(
            alias.to_vec::<f32>()?,
            vec![1.0, 2.0, 3.0],
            "the alias keeps its values"
        );
        let before = s.stats().allocations;
        a.mul_scalar_(2.0)?; // unique now: no copy, no allocation
        a.axpy_(0.5, &s.full(&[3], 2.0)?)?;
        assert_eq!(a.to_vec::<f32>()?, vec![5.0, 7.0, 9.0]);
        assert_eq!(
            s.stats().allocations,
            before + 1,
            "only the full() operand was allocated"
        );
        a.sub_(&alias)?;
        a.mul_(&s.full(&[1], 10.0)?)?;
        assert_eq!(a.to_vec::<f32>()?, vec![40.0, 50.0, 60.0]);
        a.copy_from_(&s.full(&[1], 7.0)?)?;
        a.add_scalar_(1.0)?;
        assert_eq!(a.to_vec::<f32>()?, vec![8.0; 3]);
        let mut view = s.arange(0.0f32, 6.0, 1.0)?.reshape(&[2, 3])?.t()?;
        view.fill_(3.0)?;
        assert_eq!(view.shape(), &[3, 2]);
        assert_eq!(view.to_vec::<f32>()?, vec![3.0; 6]);
        Ok(())
    });
}

#[test]
fn creation_ops_and_scalars() {
    run(|s| {
        assert_eq!(s.full(&[2], 1.5)?.to_vec::<f32>()?, vec![1.5, 1.5]);
        assert_eq!(s.arange(0i64, 5, 2)?.to_vec::<i64>()?, vec![0, 2, 4]);
        assert_eq!(
            s.arange(1.0f64, 0.0, -0.25)?.to_vec::<f64>()?,
            vec![1.0, 0.75, 0.5, 0.25]
        );
        let r = s.rand(&[1000])?.to_vec::<f32>()?;
        assert!(r.iter().all(|v| (0.0..1.0).contains(v)));
        s.set_seed(3);
        let a = s.randn(&[5])?.to_vec::<f32>()?;
        s.set_seed(3);
        assert_eq!(a, s.randn(&[5])?.to_vec::<f32>()?);
        assert_eq!(s.ones(&[])?.to_scalar::<f32>()?, 1.0);
        assert_eq!(s.zeros(&[0])?.to_vec::<f32>()?, Vec::<f32>::new());
        Ok(())
    });
}

#[test]
fn large_elementwise_chain_matches_reference() {
    // Over PARALLEL_MIN elements, so the threaded paths run.
    run(|s| {
        let n = 300_001;
        let (x, xv) = tensor(s, &[n], 71)?;
        let (row, rv) = tensor(s, &[1], 72)?;
        let y = x.mul(&row)?.add_scalar(1.0)?.tanh()?.softmax(0)?;
        let t: Vec<f64> = xv.iter().map(|v| (v * rv[0] + 1.0).tanh()).collect();
        let want = ref_softmax(&t);
        assert_close(&y.to_vec_f64()?, &want, 1e-4);
        Ok(())
    });
}

#[test]
fn display_is_readable() {
    run(|s| {
        let x = s.arange(0.0f32, 6.0, 1.0)?.reshape(&[2, 3])?.named("x");
        assert_eq!(
            x.to_string(),
            "Tensor[f32; [2, 3]] \"x\"\n[[0.0000, 1.0000, 2.0000],\n [3.0000, 4.0000, 5.0000]]"
        );
        let long = s.arange(0i64, 100, 1)?;
        assert_eq!(
            long.to_string(),
            "Tensor[i64; [100]]\n[0, 1, 2, ..., 97, 98, 99]"
        );
        assert_eq!(s.zeros(&[0, 2])?.to_string(), "Tensor[f32; [0, 2]]\n[]");
        // Strided views print in logical order.
        let t = s.arange(0i64, 6, 1)?.reshape(&[2, 3])?.t()?;
        assert_eq!(
            t.to_string(),
            "Tensor[i64; [3, 2]]\n[[0, 3],\n [1, 4],\n [2, 5]]"
        );
        let big = s.zeros(&[7, 8])?;
        assert_eq!(big.to_string().lines().count(), 8, "rows elided:\n{big}");
        Ok(())
    });
}

#[test]
fn log1p_and_expm1_keep_the_digits_near_zero() {
    run(|s| {
        let tiny = s.from_slice(&[1e-10f64, -1e-12, 0.0], &[3])?;
        // (1 + x).log() and x.exp() - 1 lose every digit here; the dedicated maps keep them.
        assert_eq!(
            tiny.log1p()?.to_vec::<f64>()?,
            vec![1e-10f64.ln_1p(), (-1e-12f64).ln_1p(), 0.0]
        );
        assert_eq!(
            tiny.expm1()?.to_vec::<f64>()?,
            vec![1e-10f64.exp_m1(), (-1e-12f64).exp_m1(), 0.0]
        );
        assert!(
            (tiny.log1p()?.to_vec::<f64>()?[0] - 1e-10).abs() < 1e-19,
            "the naive form is off by 8e-18"
        );
        let ints = s.from_slice(&[1i64, 2], &[2])?;
        assert!(matches!(
            ints.log1p(),
            Err(Error::UnsupportedDType { op: "log1p", .. })
        ));
        assert!(matches!(
            ints.expm1(),
            Err(Error::UnsupportedDType { op: "expm1", .. })
        ));
        Ok(())
    });
}

#[test]
fn deep_copies_and_like_constructors() {
    run(|s| {
        let x = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
        let mut copy = x.deep_copy()?;
        assert!(!copy.shares_storage(&x));
        copy.add_scalar_(1.0)?;
        assert_eq!(
            x.to_vec::<f32>()?,
            vec![1.0, 2.0, 3.0, 4.0],
            "the original is untouched"
        );
        // A strided view copies into a contiguous block in logical order.
        let t = x.t()?.deep_copy()?;
        assert!(t.is_contiguous());
        assert_eq!(t.to_vec::<f32>()?, vec![1.0, 3.0, 2.0, 4.0]);
        // clone, contiguous and a same-dtype to_dtype are aliases, as documented.
        assert!(x.clone().shares_storage(&x) && x.contiguous()?.shares_storage(&x));
        assert!(x.to_dtype(DType::F32)?.shares_storage(&x));

        let labels = s.from_slice(&[3i64, 1, 2], &[3])?;
        let z = s.zeros_like(&labels)?;
        assert_eq!((z.shape(), z.dtype()), (&[3usize][..], DType::I64));
        assert_eq!(z.to_vec::<i64>()?, vec![0, 0, 0]);
        assert_eq!(s.ones_like(&x)?.to_vec::<f32>()?, vec![1.0; 4]);
        assert_eq!(s.full_like(&x, -2.5)?.to_vec::<f32>()?, vec![-2.5; 4]);
        assert_eq!(s.full(&[2], 0.1)?.to_vec::<f32>()?, vec![0.1f32; 2]);
        assert_eq!(
            x.sub_scalar(1.0)?.to_vec::<f32>()?,
            vec![0.0, 1.0, 2.0, 3.0]
        );
        assert_eq!(labels.sub_scalar(1.0)?.to_vec::<i64>()?, vec![2, 0, 1]);
        Ok(())
    });
}

#[test]
fn argmin_is_the_first_smallest() {
    run(|s| {
        let x = s.from_slice(&[3.0f32, 1.0, 2.0, 1.0, 5.0, -4.0], &[2, 3])?;
        assert_eq!(x.argmin(1, false)?.to_vec::<i64>()?, vec![1, 2]);
        assert_eq!(x.argmin(0, true)?.to_vec::<i64>()?, vec![1, 0, 1]);
        assert_eq!(x.argmin(0, true)?.shape(), &[1, 3]);
        let nan = s.from_slice(&[2.0f32, f32::NAN, -1.0], &[3])?;
        assert_eq!(
            nan.argmin(0, false)?.to_vec::<i64>()?,
            vec![1],
            "NaN wins, as in argmax"
        );
        let ints = s.from_slice(&[0i64, i64::MIN, i64::MAX, i64::MIN], &[4])?;
        assert_eq!(ints.argmin(0, false)?.to_vec::<i64>()?, vec![1]);
        let wide = s.from_slice(&[i64::MAX, 5, i64::MAX], &[3])?;
        assert_eq!(wide.argmin(0, false)?.to_vec::<i64>()?, vec![1]);
        assert!(matches!(
            s.zeros(&[2, 0])?.argmin(1, false),
            Err(Error::InvalidShape { op: "argmin", .. })
        ));
        Ok(())
    });
}

#[test]
fn values_read_back_as_f64_whatever_the_dtype() {
    run(|s| {
        assert_eq!(
            s.from_slice(&[1i64, -2], &[2])?.to_vec_f64()?,
            vec![1.0, -2.0]
        );
        assert_eq!(s.from_slice(&[0.5f32], &[1])?.to_vec_f64()?, vec![0.5]);
        Ok(())
    });
}

/// `erf` by its Taylor series, summed in f64 (independent of the library's `libm` implementation;
/// accurate to ~1e-12 for |x| <= 3).
fn ref_erf(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn erf_exact_gelu_and_silu_match_their_definitions() {
    run(|s| {
        let xv: Vec<f64> = (0..61).map(|i| -3.0 + 0.1 * i as f64).collect();
        for dtype in [DType::F32, DType::F64] {
            let x = s.from_slice(&xv, &[61])?.to_dtype(dtype)?;
            let tol = if dtype == DType::F32 { 2e-6 } else { 1e-12 };
            let erf: Vec<f64> = xv.iter().map(|&v| ref_erf(v)).collect();
            assert_close(&x.erf()?.to_vec_f64()?, &erf, tol);
            let gelu: Vec<f64> = xv
                .iter()
                .map(|&v| 0.5 * v * (1.0 + ref_erf(v / 2f64.sqrt())))
                .collect();
            assert_close(&x.gelu_exact()?.to_vec_f64()?, &gelu, tol);
            let silu: Vec<f64> = xv.iter().map(|&v| v / (1.0 + (-v).exp())).collect();
            assert_close(&x.silu()?.to_vec_f64()?, &silu, tol);
        }
        // Far tails: no NaN where e^-x overflows.
        let big = s.from_slice(&[-1000.0f32, 1000.0], &[2])?;
        assert_eq!(big.silu()?.to_vec::<f32>()?, vec![-0.0, 1000.0]);
        assert_eq!(big.gelu_exact()?.to_vec::<f32>()?, vec![-0.0, 1000.0]);
        assert!(
            s.from_slice(&[1i64], &[1])?.erf().is_err(),
            "erf is float-only"
        );
        Ok(())
    });
}

#[test]
fn masked_fill_tril_and_triu() {
    run(|s| {
        let (x, xv) = tensor(s, &[2, 3, 4], 31)?;
        for k in [-2isize, -1, 0, 1, 3] {
            let (lower, upper) = (x.tril(k)?.to_vec_f64()?, x.triu(k)?.to_vec_f64()?);
            for (n, idx) in indices(&[2, 3, 4]).iter().enumerate() {
                let d = idx[2] as isize - idx[1] as isize;
                assert_eq!(
                    lower[n],
                    if d <= k { xv[n] } else { 0.0 },
                    "tril({k}) at {idx:?}"
                );
                assert_eq!(
                    upper[n],
                    if d >= k { xv[n] } else { 0.0 },
                    "triu({k}) at {idx:?}"
                );
            }
        }
        // A masked infinity does not become NaN (a multiplication by zero would).
        let inf = s.full(&[2, 2], f64::INFINITY)?;
        assert_eq!(
            inf.tril(0)?.to_vec::<f32>()?,
            vec![f32::INFINITY, 0.0, f32::INFINITY, f32::INFINITY]
        );
        // masked_fill: a [3, 1] mask of any dtype broadcast over the last axis.
        let mask = s.from_slice(&[1i64, 0, 1], &[3, 1])?;
        let filled = x.masked_fill(&mask, -7.0)?.to_vec_f64()?;
        for (n, idx) in indices(&[2, 3, 4]).iter().enumerate() {
            let want = if idx[1] != 1 { -7.0 } else { xv[n] };
            assert_eq!(filled[n], want, "masked_fill at {idx:?}");
        }
        // A mask may not make the result larger than the tensor it masks.
        let wide = s.zeros(&[5, 3, 4])?;
        assert!(matches!(
            x.masked_fill(&wide, 0.0),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            s.zeros(&[4])?.tril(0),
            Err(Error::InvalidShape { .. })
        ));
        Ok(())
    });
}

#[test]
fn layer_norm_and_rms_norm_normalise_each_row() {
    run(|s| {
        let (rows, width) = (6, 5);
        let (x, xv) = tensor(s, &[2, 3, width], 41)?;
        let (w, wv) = tensor(s, &[width], 42)?;
        let (b, bv) = tensor(s, &[width], 43)?;
        let tape = ndscope::Tape::no_grad(s);
        let (xs, ws, bs) = (tape.constant(&x), tape.constant(&w), tape.constant(&b));
        let layer = xs
            .layer_norm(Some(&ws), Some(&bs), 1e-5)?
            .value()
            .to_vec_f64()?;
        let rms = xs.rms_norm(Some(&ws), 1e-6)?.value().to_vec_f64()?;
        let (mut want_layer, mut want_rms) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let row = &xv[r * width..(r + 1) * width];
            let mean = row.iter().sum::<f64>() / width as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
            let ms = row.iter().map(|v| v * v).sum::<f64>() / width as f64;
            for j in 0..width {
                want_layer.push((row[j] - mean) / (var + 1e-5).sqrt() * wv[j] + bv[j]);
                want_rms.push(row[j] / (ms + 1e-6).sqrt() * wv[j]);
            }
        }
        assert_close(&layer, &want_layer, 1e-5);
        assert_close(&rms, &want_rms, 1e-5);
        // Without the affine parameters, each row has mean 0 and variance 1.
        let plain = xs.layer_norm(None, None, 1e-12)?.value().to_vec_f64()?;
        for row in plain.chunks(width) {
            assert!(row.iter().sum::<f64>().abs() < 1e-5);
            assert!((row.iter().map(|v| v * v).sum::<f64>() / width as f64 - 1.0).abs() < 1e-4);
        }
        assert!(matches!(
            xs.layer_norm(Some(&bs.reshape(&[5, 1])?), None, 1e-5),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            xs.rms_norm(None, 0.0),
            Err(Error::InvalidShape { .. })
        ));
        Ok(())
    });
}

#[test]
fn rms_norm_rounds_16_bit_rows_as_transformers_does() {
    run(|s| {
        let (rows, width) = (4, 9);
        let (x, xv) = tensor(s, &[rows, width], 51)?;
        let (w, _) = tensor(s, &[width], 52)?;
        let reference = |xv: &[f64], wv: Option<&[f64]>, eps: f64, round: &dyn Fn(f64) -> f64| {
            let mut want = Vec::new();
            for row in xv.chunks(width) {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / width as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                for (j, &v) in row.iter().enumerate() {
                    let n = round(v * inv);
                    want.push(wv.map_or(n, |w| round(n * w[j])));
                }
            }
            want
        };
        // f32 and f64: the plain formula, with and without a weight.
        for dtype in [DType::F32, DType::F64] {
            let (xd, wd) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
            let wv = wd.to_vec_f64()?;
            let got = xd.rms_norm(Some(&wd), 1e-6)?.to_vec_f64()?;
            assert_close(&got, &reference(&xv, Some(&wv), 1e-6, &|v| v), 1e-6);
            let got = xd.rms_norm(None, 1e-6)?.to_vec_f64()?;
            assert_close(&got, &reference(&xv, None, 1e-6, &|v| v), 1e-6);
        }
        // 16 bits: the normalised value rounded to the dtype, then scaled and rounded again (the
        // f64 reference's inverse may put a value one unit in the last place away).
        let round_bf16 = |v: f64| f64::from(ndscope::bf16::from_f64(v));
        let round_f16 = |v: f64| f64::from(ndscope::f16::from_f64(v));
        for (dtype, round) in [
            (DType::BF16, &round_bf16 as &dyn Fn(f64) -> f64),
            (DType::F16, &round_f16),
        ] {
            let (xh, wh) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
            let (xr, wr) = (xh.to_vec_f64()?, wh.to_vec_f64()?);
            let got = xh.rms_norm(Some(&wh), 1e-5)?.to_vec_f64()?;
            let want = reference(&xr, Some(&wr), 1e-5, round);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 2.0 * dtype.epsilon() * w.abs(),
                    "{dtype}: {g} against {w}"
                );
            }
            // Rounded once before the weight: not the value the whole product would round to.
            let unrounded = reference(&xr, Some(&wr), 1e-5, &|v| v);
            let once: Vec<f64> = unrounded.iter().map(|&v| round(v)).collect();
            assert!(got.iter().zip(&once).any(|(g, o)| g != o), "{dtype}");
        }
        assert!(matches!(
            x.rms_norm(Some(&w.to_dtype(DType::BF16)?), 1e-6),
            Err(Error::DTypeMismatch { .. })
        ));
        assert!(matches!(
            x.to_dtype(DType::I64)?.rms_norm(None, 1e-6),
            Err(Error::UnsupportedDType { .. })
        ));
        assert!(matches!(
            x.rms_norm(Some(&w.narrow(0, 0, 4)?), 1e-6),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            x.rms_norm(None, f64::NAN),
            Err(Error::InvalidShape { .. })
        ));
        Ok(())
    });
}

/// Attention by plain loops: `[batch, len, d]` operands (`dims`), scores scaled by `1/sqrt(d)`.
fn ref_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dims: (usize, usize, usize),
    causal: bool,
) -> (Vec<f64>, Vec<f64>) {
    let (batch, len, d) = dims;
    let (lq, lk) = (len, len);
    let (mut out, mut weights) = (vec![0.0; batch * lq * d], vec![0.0; batch * lq * lk]);
    for b in 0..batch {
        for i in 0..lq {
            let scores: Vec<f64> = (0..lk)
                .map(|j| {
                    if causal && j > i {
                        f64::NEG_INFINITY
                    } else {
                        (0..d)
                            .map(|c| q[(b * lq + i) * d + c] * k[(b * lk + j) * d + c])
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    }
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            for j in 0..lk {
                let w = (scores[j] - max).exp() / total;
                weights[(b * lq + i) * lk + j] = w;
                for c in 0..d {
                    out[(b * lq + i) * d + c] += w * v[(b * lk + j) * d + c];
                }
            }
        }
    }
    (out, weights)
}

#[test]
fn attention_matches_a_plain_loop_with_and_without_the_causal_mask() {
    use ndscope::nn::{AttentionOptions, Mode, scaled_dot_product_attention};
    run(|s| {
        let (batch, len, d) = (2, 5, 4);
        let (q, qv) = tensor(s, &[batch, len, d], 51)?;
        let (k, kv) = tensor(s, &[batch, len, d], 52)?;
        let (v, vv) = tensor(s, &[batch, len, d], 53)?;
        // Large scores: the softmax must subtract the row maximum to stay finite.
        let (q, qv) = (
            q.mul_scalar(30.0)?,
            qv.iter().map(|x| x * 30.0).collect::<Vec<_>>(),
        );
        let tape = ndscope::Tape::no_grad(s);
        for causal in [false, true] {
            let options = AttentionOptions {
                causal,
                dropout: 0.5,
            };
            // Dropout is off in evaluation.
            let a = scaled_dot_product_attention(
                &tape.constant(&q),
                &tape.constant(&k),
                &tape.constant(&v),
                options,
                Mode::Eval,
            )?;
            let (want_out, want_w) = ref_attention(&qv, &kv, &vv, (batch, len, d), causal);
            assert_close(&a.output.value().to_vec_f64()?, &want_out, 1e-5);
            assert_close(&a.weights.value().to_vec_f64()?, &want_w, 1e-5);
        }
        let short = s.zeros(&[batch, len, d + 1])?;
        let options = AttentionOptions {
            causal: false,
            dropout: 0.0,
        };
        let err = scaled_dot_product_attention(
            &tape.constant(&q),
            &tape.constant(&short),
            &tape.constant(&v),
            options,
            Mode::Eval,
        );
        assert!(matches!(err, Err(Error::ShapeMismatch { .. })));
        Ok(())
    });
}

/// Cross-correlation by plain loops over `[n, c, h, w]` with `[o, c / groups, kh, kw]` weights.
#[allow(clippy::needless_range_loop)]
fn ref_conv2d(
    x: &[f64],
    xs: [usize; 4],
    w: &[f64],
    ws: [usize; 4],
    bias: &[f64],
    o: &ndscope::Conv2dOptions,
) -> (Vec<f64>, [usize; 4]) {
    let [n, c, h, wd] = xs;
    let [oc, cg, kh, kw] = ws;
    let out_dim = |size: usize, k: usize, a: usize| {
        (size + 2 * o.padding[a] - o.dilation[a] * (k - 1) - 1) / o.stride[a] + 1
    };
    let (oh, ow) = (out_dim(h, kh, 0), out_dim(wd, kw, 1));
    let per_group = oc / o.groups;
    let mut out = vec![0.0; n * oc * oh * ow];
    for b in 0..n {
        for q in 0..oc {
            let g = q / per_group;
            for y in 0..oh {
                for xx in 0..ow {
                    let mut acc = bias[q];
                    for ci in 0..cg {
                        for i in 0..kh {
                            for j in 0..kw {
                                let iy = (y * o.stride[0] + i * o.dilation[0]) as isize
                                    - o.padding[0] as isize;
                                let ix = (xx * o.stride[1] + j * o.dilation[1]) as isize
                                    - o.padding[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let ch = g * cg + ci;
                                acc += w[((q * cg + ci) * kh + i) * kw + j]
                                    * x[((b * c + ch) * h + iy as usize) * wd + ix as usize];
                            }
                        }
                    }
                    out[((b * oc + q) * oh + y) * ow + xx] = acc;
                }
            }
        }
    }
    (out, [n, oc, oh, ow])
}

#[test]
fn conv2d_matches_a_plain_loop_for_every_option() {
    use ndscope::Conv2dOptions;
    run(|s| {
        let cases = [
            ([2, 3, 7, 6], [4, 3, 3, 3], Conv2dOptions::default()),
            (
                [1, 2, 8, 8],
                [2, 2, 3, 2],
                Conv2dOptions {
                    stride: [2, 3],
                    padding: [1, 2],
                    ..Conv2dOptions::default()
                },
            ),
            (
                [2, 2, 9, 9],
                [3, 2, 2, 3],
                Conv2dOptions {
                    dilation: [2, 3],
                    padding: [1, 1],
                    ..Conv2dOptions::default()
                },
            ),
            (
                [1, 4, 5, 5],
                [6, 2, 3, 3],
                Conv2dOptions {
                    groups: 2,
                    padding: [1, 1],
                    ..Conv2dOptions::default()
                },
            ),
            ([3, 1, 4, 4], [2, 1, 1, 1], Conv2dOptions::default()),
        ];
        let tape = ndscope::Tape::no_grad(s);
        for (k, (xs, ws, options)) in cases.into_iter().enumerate() {
            let (x, xv) = tensor(s, &xs, 60 + k as u64)?;
            let (w, wv) = tensor(s, &ws, 70 + k as u64)?;
            let (b, bv) = tensor(s, &[ws[0]], 80 + k as u64)?;
            let got =
                tape.constant(&x)
                    .conv2d(&tape.constant(&w), Some(&tape.constant(&b)), &options)?;
            let (want, shape) = ref_conv2d(&xv, xs, &wv, ws, &bv, &options);
            assert_eq!(got.shape(), &shape, "case {k}");
            assert_close(&got.value().to_vec_f64()?, &want, 1e-5);
        }
        // The weight must match the channels and groups; the window must fit.
        let x = tape.constant(&s.zeros(&[1, 4, 5, 5])?);
        let two_groups = Conv2dOptions {
            groups: 2,
            ..Conv2dOptions::default()
        };
        assert!(matches!(
            x.conv2d(&tape.constant(&s.zeros(&[2, 4, 3, 3])?), None, &two_groups),
            Err(Error::InvalidShape { .. })
        ));
        assert!(matches!(
            x.conv2d(
                &tape.constant(&s.zeros(&[2, 4, 6, 6])?),
                None,
                &Conv2dOptions::default()
            ),
            Err(Error::InvalidShape { .. })
        ));
        let zero_stride = Conv2dOptions {
            stride: [0, 1],
            ..Conv2dOptions::default()
        };
        assert!(matches!(
            x.conv2d(&tape.constant(&s.zeros(&[2, 4, 3, 3])?), None, &zero_stride),
            Err(Error::InvalidShape { .. })
        ));
        assert!(matches!(
            tape.constant(&s.zeros(&[4, 5, 5])?)
                .unfold2d([2, 2], &Conv2dOptions::default()),
            Err(Error::InvalidShape { .. })
        ));
        Ok(())
    });
}

#[test]
fn pooling_and_fold_match_plain_loops() {
    use ndscope::Conv2dOptions;
    run(|s| {
        let (n, c, h, w) = (2, 3, 7, 6);
        let (x, xv) = tensor(s, &[n, c, h, w], 90)?;
        let at = |p: usize, y: isize, xx: isize| -> Option<f64> {
            (y >= 0 && xx >= 0 && y < h as isize && xx < w as isize)
                .then(|| xv[(p * h + y as usize) * w + xx as usize])
        };
        let tape = ndscope::Tape::no_grad(s);
        let xc = tape.constant(&x);
        let (k, st, pad) = ([3, 2], [2, 2], [1, 1]);
        let (oh, ow) = ((h + 2 - 3) / 2 + 1, (w + 2 - 2) / 2 + 1);
        let (mut want_max, mut want_avg) = (Vec::new(), Vec::new());
        for p in 0..n * c {
            for y in 0..oh {
                for xx in 0..ow {
                    let taps: Vec<Option<f64>> = (0..k[0])
                        .flat_map(|i| (0..k[1]).map(move |j| (i, j)))
                        .map(|(i, j)| {
                            at(
                                p,
                                (y * st[0] + i) as isize - pad[0] as isize,
                                (xx * st[1] + j) as isize - pad[1] as isize,
                            )
                        })
                        .collect();
                    want_max.push(
                        taps.iter()
                            .flatten()
                            .cloned()
                            .fold(f64::NEG_INFINITY, f64::max),
                    );
                    want_avg.push(
                        taps.iter().map(|t| t.unwrap_or(0.0)).sum::<f64>() / taps.len() as f64,
                    );
                }
            }
        }
        let max = xc.max_pool2d(k, st, pad)?;
        assert_eq!(max.shape(), &[n, c, oh, ow]);
        assert_close(&max.value().to_vec_f64()?, &want_max, 1e-6);
        assert_close(
            &xc.avg_pool2d(k, st, pad)?.value().to_vec_f64()?,
            &want_avg,
            1e-6,
        );
        assert!(matches!(
            xc.max_pool2d([2, 2], [2, 2], [2, 0]),
            Err(Error::InvalidShape { .. })
        ));
        // Adaptive pooling to 3x4: PyTorch's windows floor(i H / 3) .. ceil((i + 1) H / 3).
        let mut want = Vec::new();
        for p in 0..n * c {
            for i in 0..3 {
                for j in 0..4 {
                    let (y0, y1) = (i * h / 3, ((i + 1) * h).div_ceil(3));
                    let (x0, x1) = (j * w / 4, ((j + 1) * w).div_ceil(4));
                    let cells: Vec<f64> = (y0..y1)
                        .flat_map(|y| (x0..x1).map(move |xx| (y, xx)))
                        .map(|(y, xx)| xv[(p * h + y) * w + xx])
                        .collect();
                    want.push(cells.iter().sum::<f64>() / cells.len() as f64);
                }
            }
        }
        assert_close(
            &xc.adaptive_avg_pool2d([3, 4])?.value().to_vec_f64()?,
            &want,
            1e-6,
        );
        // fold2d sums every tap back where it was read: folding unfolded ones counts the taps.
        let options = Conv2dOptions {
            stride: [2, 1],
            padding: [1, 0],
            dilation: [1, 2],
            groups: 1,
        };
        let ones = s.ones(&[1, 1, 5, 6])?;
        let counts = ones
            .unfold2d([2, 2], &options)?
            .fold2d([5, 6], [2, 2], &options)?
            .to_vec_f64()?;
        for y in 0..5 {
            for xx in 0..6 {
                let mut taps = 0.0;
                for (i, j) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    let ty = y + 1 - i;
                    let tx = xx as isize - 2 * j as isize;
                    if ty % 2 == 0 && ty / 2 < 3 && tx >= 0 && (tx as usize) < 4 {
                        taps += 1.0;
                    }
                }
                assert_eq!(counts[y * 6 + xx], taps, "taps reading ({y}, {xx})");
            }
        }
        Ok(())
    });
}

#[test]
fn cumsum_along_every_axis() {
    run(|s| {
        let shape = [3, 4, 5];
        let (x, xv) = tensor(s, &shape, 95)?;
        for axis in 0..3 {
            let got = x.cumsum(axis as isize)?.to_vec_f64()?;
            for (n, idx) in indices(&shape).iter().enumerate() {
                let mut want = 0.0;
                for j in 0..=idx[axis] {
                    let mut at = idx.clone();
                    at[axis] = j;
                    want += xv[(at[0] * 4 + at[1]) * 5 + at[2]];
                }
                assert!(
                    (got[n] - want).abs() < 1e-5,
                    "cumsum({axis}) at {idx:?}: {} vs {want}",
                    got[n]
                );
            }
        }
        let ints = s.arange(1i64, 7, 1)?.reshape(&[2, 3])?;
        assert_eq!(ints.cumsum(-1)?.to_vec::<i64>()?, vec![1, 3, 6, 4, 9, 15]);
        assert!(matches!(ints.cumsum(2), Err(Error::AxisOutOfRange { .. })));
        assert_eq!(s.full(&[], 2.0)?.cumsum(0)?.to_vec::<f32>()?, vec![2.0]);
        Ok(())
    });
}

/// Cross-entropy of one row of logits against `label` with smoothing `eps`, in f64 loops.
fn ref_cross_entropy(row: &[f64], label: usize, eps: f64) -> f64 {
    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let mean_log_p = row.iter().map(|x| x - lse).sum::<f64>() / row.len() as f64;
    -(1.0 - eps) * (row[label] - lse) - eps * mean_log_p
}

#[test]
fn cross_entropy_with_ignored_labels_reductions_and_smoothing() {
    use ndscope::Tape;
    use ndscope::nn::{CrossEntropy, Reduction};
    run(|s| {
        let (classes, labels) = (7, [3i64, -100, 0, 6, -100, 2, 5, 1]);
        let (logits, lv) = tensor(s, &[2, 4, classes], 31)?;
        let label_tensor = s.from_slice(&labels, &[2, 4])?;
        let tape = Tape::no_grad(s);
        let x = tape.constant(&logits);
        for eps in [0.0, 0.15] {
            let per_row: Vec<f64> = labels
                .iter()
                .enumerate()
                .map(|(r, &l)| {
                    if l < 0 {
                        0.0
                    } else {
                        ref_cross_entropy(&lv[r * classes..(r + 1) * classes], l as usize, eps)
                    }
                })
                .collect();
            let kept = labels.iter().filter(|&&l| l >= 0).count() as f64;
            let options = |reduction| CrossEntropy {
                reduction,
                label_smoothing: eps,
                ..CrossEntropy::ignoring(-100)
            };
            let none = x.cross_entropy_with(&label_tensor, options(Reduction::None))?;
            assert_eq!(none.shape(), &[2, 4]);
            assert_close(&none.value().to_vec_f64()?, &per_row, 1e-5);
            let sum = x.cross_entropy_with(&label_tensor, options(Reduction::Sum))?;
            let mean = x.cross_entropy_with(&label_tensor, options(Reduction::Mean))?;
            let total: f64 = per_row.iter().sum();
            assert_close(&sum.value().to_vec_f64()?, &[total], 1e-5);
            assert_close(&mean.value().to_vec_f64()?, &[total / kept], 1e-5);
        }
        // No ignore_index: the plain mean over every row, 2-D as before and [.., C] alike.
        let valid = s.from_slice(&[3i64, 4, 0, 6, 1, 2, 5, 1], &[2, 4])?;
        let plain = x.cross_entropy(&valid)?.value().to_vec_f64()?;
        let flat = tape
            .constant(&logits.reshape(&[8, classes])?)
            .cross_entropy(&valid.reshape(&[8])?)?
            .value()
            .to_vec_f64()?;
        assert_eq!(plain, flat);
        // Every label ignored: 0 / 0, as PyTorch.
        let ignored = s.from_slice(&[-100i64; 8], &[2, 4])?;
        let nan = x.cross_entropy_with(&ignored, CrossEntropy::ignoring(-100))?;
        assert!(nan.value().to_scalar::<f32>()?.is_nan());
        // Bad input: shapes, dtypes, smoothing, labels out of range.
        for (bad, says) in [
            (
                x.cross_entropy(&s.from_slice(&[1i64; 8], &[8])?),
                "labels of shape [2, 4]",
            ),
            (x.cross_entropy(&s.zeros(&[2, 4])?), "i64 labels"),
            (
                x.cross_entropy_with(
                    &valid,
                    CrossEntropy {
                        label_smoothing: 1.5,
                        ..CrossEntropy::default()
                    },
                ),
                "label_smoothing",
            ),
        ] {
            let err = bad.unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
        let out_of_range = s.from_slice(&[7i64, 0, 0, 0, 0, 0, 0, 0], &[2, 4])?;
        assert!(matches!(
            x.cross_entropy(&out_of_range),
            Err(Error::IndexOutOfRange { .. })
        ));
        Ok(())
    });
}

/// Softmax, log-softmax and fused cross-entropy over long rows (the vectorised lanes and their
/// tails: lengths around 16, a thousand, GPT-2's vocabulary), against f64 loops, with huge
/// magnitudes, `-inf` entries, a row of `-inf` (NaN, as PyTorch) and a row holding NaN.
#[test]
fn long_rows_match_f64_loops_with_extreme_values() {
    root(Device::Cpu, |s| {
        for len in [1usize, 15, 16, 17, 33, 1000] {
            let mut data = values(4 * len, len as u64);
            data.iter_mut().for_each(|v| *v *= 30.0); // e^60 apart: no room for a missing shift
            data[len / 2] = f64::NEG_INFINITY; // a masked entry in row 0
            data[len] = 1e30; // a huge entry in row 1
            let (masked, nan) = (&mut data[2 * len..3 * len], 3 * len + len / 3);
            masked.fill(f64::NEG_INFINITY);
            data[nan] = f64::NAN;
            for dtype in [DType::F64, DType::F32] {
                let x = s.from_slice(&data, &[4, len])?.to_dtype(dtype)?;
                let exact = x.to_vec_f64()?;
                let tol = if dtype == DType::F64 { 1e-13 } else { 2e-6 };
                let (sm, lsm) = (
                    x.softmax(-1)?.to_vec_f64()?,
                    x.log_softmax(-1)?.to_vec_f64()?,
                );
                for (r, row) in exact.chunks(len).enumerate() {
                    let (got, got_log) = (&sm[r * len..][..len], &lsm[r * len..][..len]);
                    if r >= 2 {
                        // A row of -inf and a row holding NaN have no distribution.
                        assert!(got.iter().chain(got_log).all(|v| v.is_nan()), "row {r}");
                        continue;
                    }
                    let want = ref_softmax(row);
                    assert_close(got, &want, tol);
                    let log_want: Vec<f64> = want.iter().map(|p| p.ln()).collect();
                    for (g, w) in got_log.iter().zip(&log_want) {
                        assert!(
                            (g.is_nan() && w.is_nan())
                                || g == w
                                || (g - w).abs() <= tol * (1.0 + w.abs()),
                            "log_softmax {dtype} len {len}: {g} vs {w}"
                        );
                    }
                }
            }
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn fused_cross_entropy_over_a_large_vocabulary_matches_an_f64_loop() {
    use ndscope::Tape;
    use ndscope::nn::{CrossEntropy, Reduction};
    root(Device::Cpu, |s| {
        let (rows, classes) = (5, 50257);
        let data: Vec<f64> = values(rows * classes, 3).iter().map(|v| v * 8.0).collect();
        let labels: Vec<i64> = vec![0, 50256, 1234, -100, 7];
        let labels_t = s.from_slice(&labels, &[rows])?;
        for (dtype, smoothing) in [
            (DType::F64, 0.0),
            (DType::F64, 0.1),
            (DType::F32, 0.0),
            (DType::BF16, 0.1),
        ] {
            let x = s.from_slice(&data, &[rows, classes])?.to_dtype(dtype)?;
            let exact = x.to_vec_f64()?;
            // The f64 reference: mean over the kept rows of -((1-ε) log p_label + ε mean_j log p_j).
            let mut loss = 0.0;
            let mut grad = vec![0.0; rows * classes];
            let kept = labels.iter().filter(|&&l| l != -100).count() as f64;
            for (r, row) in exact.chunks(classes).enumerate() {
                if labels[r] == -100 {
                    continue;
                }
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                let mean_logp = row.iter().map(|v| v - lse).sum::<f64>() / classes as f64;
                let label = labels[r] as usize;
                loss -= ((1.0 - smoothing) * (row[label] - lse) + smoothing * mean_logp) / kept;
                for (j, v) in row.iter().enumerate() {
                    let hot = if j == label { 1.0 - smoothing } else { 0.0 };
                    grad[r * classes + j] =
                        ((v - lse).exp() - hot - smoothing / classes as f64) / kept;
                }
            }
            let tape = Tape::new(s);
            let xv = tape.param(&x);
            let options = CrossEntropy {
                ignore_index: Some(-100),
                reduction: Reduction::Mean,
                label_smoothing: smoothing,
            };
            let got = xv.cross_entropy_with(&labels_t, options)?;
            // 16-bit logits give an f32 loss, computed without a 16-bit intermediate.
            let want_dtype = if dtype == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            assert_eq!(got.value().dtype(), want_dtype);
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            let got_loss = got.value().to_vec_f64()?[0];
            assert!(
                (got_loss - loss).abs() <= tol * loss.abs(),
                "{dtype}: loss {got_loss} vs {loss}"
            );
            let g = tape.backward(&got)?.get(&x).expect("a gradient");
            assert_eq!(g.dtype(), dtype);
            let g = g.to_vec_f64()?;
            let step = match dtype {
                DType::F64 => 1e-12,
                // exp(x - lse) carries the f32 rounding of x - lse (|x - lse| up to ~40) relative.
                DType::F32 => 1e-5,
                _ => 1.0 / 128.0,
            };
            for (i, (a, b)) in g.iter().zip(&grad).enumerate() {
                assert!(
                    (a - b).abs() <= step * b.abs() + 1e-12,
                    "{dtype}: grad[{i}] {a} vs {b}"
                );
            }
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Converting a view whose rows are runs of consecutive elements (a head's slice of packed rows,
/// as a decoding step rounds its queries, keys and values for a 16-bit cache) rounds every element
/// as one conversion of its `f64` value would, to both 16-bit types and back, with tiny, huge and
/// subnormal values among them; small views and views large enough to split across threads.
#[test]
fn converting_a_view_of_runs_rounds_each_element_once() {
    root(Device::Cpu, |s| {
        for (rows, cols) in [(3usize, 37usize), (700, 131)] {
            let mut data: Vec<f32> = values(rows * cols, 11).iter().map(|&v| v as f32).collect();
            // Out of f16's range, under its smallest normal, and ties between 16-bit neighbours.
            let specials = [
                7.0e4f32,
                -1.0e5,
                3.0e-6,
                -6.0e-8,
                1.0 + 1.0 / 2048.0,
                1.0 + 1.0 / 256.0,
            ];
            for (i, v) in specials.iter().enumerate() {
                data[i * 5 + 1] = *v;
            }
            let x = s.from_slice(&data, &[rows, cols])?;
            for view in [x.narrow(1, 1, cols - 3)?, x.narrow(1, 2, 16)?] {
                let exact = view.to_vec_f64()?;
                for dtype in [DType::F16, DType::BF16] {
                    let want: Vec<f64> = exact
                        .iter()
                        .map(|&v| match dtype {
                            // Each value is an `f32`: one rounding of it (`half`'s own).
                            DType::F16 => ndscope::f16::from_f32(v as f32).to_f64(),
                            _ => ndscope::bf16::from_f32(v as f32).to_f64(),
                        })
                        .collect();
                    let got = view.to_dtype(dtype)?;
                    assert!(got.is_contiguous());
                    let got_values = got.to_vec_f64()?;
                    if let Some(i) = (0..want.len()).find(|&i| got_values[i] != want[i]) {
                        panic!(
                            "{dtype} of a {rows}x{cols} view: element {i} of {exact} rounded to {} \
                             where one rounding gives {}",
                            got_values[i],
                            want[i],
                            exact = exact[i]
                        );
                    }
                    // And back: a view of the 16-bit values widens exactly.
                    let back = got.narrow(1, 1, got.shape()[1] - 1)?.to_dtype(DType::F32)?;
                    let kept: Vec<f64> = want
                        .chunks(got.shape()[1])
                        .flat_map(|row| row[1..].to_vec())
                        .collect();
                    assert!(back.to_vec_f64()? == kept, "{dtype} of a view widened");
                }
            }
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Converting a permuted view (a transposed weight under autocast) converts the elements in memory
/// order and keeps the permutation: same values, same shape, and the view stays a view.
#[test]
fn converting_a_permuted_view_keeps_its_values_and_permutation() {
    root(Device::Cpu, |s| {
        let x = s.from_slice(&values(2 * 3 * 5, 4), &[2, 3, 5])?;
        for view in [
            x.transpose(1, 2)?,
            x.permute(&[2, 0, 1])?,
            x.narrow(2, 1, 3)?.transpose(0, 2)?,
        ] {
            let want: Vec<f64> = view
                .to_vec_f64()?
                .iter()
                .map(|&v| ndscope::bf16::from_f64(v).to_f64())
                .collect();
            let got = view.to_dtype(DType::BF16)?;
            assert_eq!(got.shape(), view.shape());
            assert_eq!(got.to_vec_f64()?, want);
            assert_eq!(got.to_dtype(DType::F32)?.to_vec_f64()?, want);
        }
        // A dense permutation stays a view of converted memory; the narrowed one is packed.
        assert!(!x.transpose(1, 2)?.to_dtype(DType::BF16)?.is_contiguous());
        Ok::<_, Error>(())
    })
    .unwrap();
}
