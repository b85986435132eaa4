//! The CUDA backend against the host: every op and a whole training step run on each available GPU
//! and on the CPU, and must agree; GPU scopes keep the host's memory rules (stats, caps, budgets,
//! workspaces, faults, no allocator call in a steady step, every byte back after a panic).
//!
//! Needs `--features cuda`. On a machine without a usable GPU each test says so and checks only what
//! it can: that asking for the GPU is a clear `DeviceUnavailable` error, and that the cases run on the
//! host (the GPU half of each comparison is then skipped).
#![cfg(feature = "cuda")]

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, LossScaler, Optimizer, Sgd, SgdConfig};
use ndscope::{
    AttentionSpec, Causal, DType, Device, Error, Fault, Input, Result, Scope, StepGraph, Tape,
    Tensor, Workspace, root,
};

/// The GPU the tests use, or `None` with the reason printed. With `NDSCOPE_REQUIRE_GPU=1` (what
/// `cudasim/run` sets, and CI's simulated run) a missing GPU fails the test instead of skipping it.
fn gpu() -> Option<Device> {
    let device = Device::Cuda(0);
    match device.check_available() {
        Ok(()) => Some(device),
        Err(e) if gpu_required() => {
            panic!("NDSCOPE_REQUIRE_GPU=1, but the GPU cannot be used: {e}")
        }
        Err(e) => {
            eprintln!("skipping the GPU half of this test: {e}");
            None
        }
    }
}

fn gpu_required() -> bool {
    std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1")
}

/// Process-wide GPU counters (`gpu_memory`) move whenever any test allocates on the GPU, and cargo runs
/// tests on parallel threads. A test that reads them, or that fills the GPU, holds this lock
/// exclusively; every other test holds it shared while it uses the GPU, so the GPU tests run in
/// parallel with each other but never beside a reader of the counters or a test that fills the GPU.
/// Never take it twice on one thread (`run_on` and `agree` take it): `RwLock` lets a waiting writer
/// go first, so a second read behind it deadlocks.
static GPU_COUNTERS: RwLock<()> = RwLock::new(());

fn gpu_shared() -> RwLockReadGuard<'static, ()> {
    GPU_COUNTERS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn gpu_exclusive() -> RwLockWriteGuard<'static, ()> {
    GPU_COUNTERS
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The devices to compare with the host: the host itself (so the cases run everywhere) and the GPU.
fn devices() -> Vec<Device> {
    let mut out = vec![Device::Cpu];
    out.extend(gpu());
    out
}

/// A case: tensors computed in a root scope, compared across devices.
type Case = dyn for<'s> Fn(&'s Scope<'s>) -> Result<Vec<Tensor<'s>>>;

/// Runs `case` in a root scope on `device` and returns every output as host `f64` values with its
/// shape.
fn run_on(device: Device, case: &Case) -> Result<Vec<(Vec<usize>, Vec<f64>)>> {
    let _gpu = device.is_cuda().then(gpu_shared);
    root(device, |s| {
        s.set_seed(7);
        let outs = case(s)?;
        outs.iter()
            .map(|t| {
                assert_eq!(
                    t.device(),
                    device,
                    "an op's result lives on its operands' device"
                );
                Ok((t.shape().to_vec(), t.to_vec_f64()?))
            })
            .collect()
    })
}

/// Runs `case` on the host and on every other device, and hands each device's outputs with the
/// host's to `check(device, output, shape, host, got)`, after checking their count and shapes.
fn against_host(name: &str, case: &Case, check: impl Fn(Device, usize, &[usize], &[f64], &[f64])) {
    let host = run_on(Device::Cpu, case).unwrap_or_else(|e| panic!("{name} on the host: {e}"));
    for device in devices().into_iter().skip(1) {
        let got = run_on(device, case).unwrap_or_else(|e| panic!("{name} on {device}: {e}"));
        assert_eq!(got.len(), host.len(), "{name}: output count on {device}");
        for (k, ((hs, hv), (gs, gv))) in host.iter().zip(&got).enumerate() {
            assert_eq!(hs, gs, "{name}: shape of output {k} on {device}");
            check(device, k, hs, hv, gv);
        }
    }
}

/// Checks that `case` gives the host's results on every device, within `tol` (relative, plus the
/// same absolute floor).
fn agree(name: &str, tol: f64, case: &Case) {
    against_host(name, case, |device, k, _, hv, gv| {
        for (i, (h, g)) in hv.iter().zip(gv).enumerate() {
            let close =
                (h.is_nan() && g.is_nan()) || h == g || (h - g).abs() <= tol * (1.0 + h.abs());
            assert!(
                close,
                "{name}: output {k}[{i}] is {g} on {device}, {h} on the host"
            );
        }
    });
}

/// Checks a quantized model's outputs (rows of logits) against the host's on every device.
///
/// A quantized product rounds its activations to 8 bits per block of 32, so a value that falls
/// within a last bit of a half step rounds to neighbouring levels on two devices whose sums differ
/// in that bit (one such flip was seen: -1.7843042e-3 against -1.7843125e-3 on a step of
/// 3.5686493e-3). From that layer on, that token's logits differ by a few thousandths of their
/// range. So: every row agrees within `1e-4`, except at most one row in eight, which must agree
/// within 2 % of its largest logit. A wrong kernel (a scale, a block, an offset) moves every row.
fn agree_quantized(name: &str, case: &Case) {
    against_host(name, case, |device, k, shape, hv, gv| {
        let width = *shape.last().expect("logits have a vocabulary axis");
        let rows = hv.len() / width;
        let mut flipped = Vec::new();
        for (r, (h, g)) in hv.chunks(width).zip(gv.chunks(width)).enumerate() {
            let range = h.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let mut exact = true;
            for (i, (h, g)) in h.iter().zip(g).enumerate() {
                let d = (h - g).abs();
                exact &= d <= 1e-4 * (1.0 + h.abs());
                assert!(
                    d <= 0.02 * range,
                    "{name}: output {k} row {r} [{i}] is {g} on {device}, {h} on the host"
                );
            }
            if !exact {
                flipped.push(r);
            }
        }
        assert!(
            flipped.len() <= rows.div_ceil(8),
            "{name}: output {k}: rows {flipped:?} of {rows} differ beyond 1e-4 on {device}"
        );
    });
}

/// Fused attention of `q`, `k`, `v` under `spec` and `lengths`, and the gradients of a random
/// weighting of its output (in the operands' dtype): `[out, dq, dk, dv]`.
fn attention_and_gradients<'s>(
    s: &'s Scope<'s>,
    [q, k, v]: [&Tensor<'s>; 3],
    spec: AttentionSpec,
    lengths: &Tensor<'s>,
) -> Result<Vec<Tensor<'s>>> {
    let tape = Tape::new(s);
    let (qv, kv, vv) = (tape.param(q), tape.param(k), tape.param(v));
    let out = qv.attention(&kv, &vv, spec, Some(lengths))?;
    let w = s.randn(out.shape())?.to_dtype(q.dtype())?;
    let loss = out.mul(&tape.constant(&w))?.sum_all()?;
    let grads = tape.backward(&loss)?;
    let grad = |x: &Tensor<'s>| grads.get(x).expect("a gradient");
    Ok(vec![out.into_value(), grad(q), grad(k), grad(v)])
}

/// Fused attention's forward and backward kernels against the host's, for every mask, key lengths,
/// strided heads (views of one projection), lengths past a warp's 32 and the host's tiles, one query
/// against a long cache, and every float dtype.
#[test]
fn fused_attention_agrees_with_the_host() {
    let masks = [
        (Causal::None, None),
        (Causal::TopLeft, None),
        (Causal::BottomRight, None),
        (Causal::TopLeft, Some(37)),
        (Causal::BottomRight, Some(5)),
    ];
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-4), (DType::BF16, 2e-2)] {
        for (causal, window) in masks {
            for (queries, keys) in [(70, 150), (1, 300), (65, 65)] {
                agree(
                    &format!(
                        "fused attention in {dtype}, {causal:?}, window {window:?}, {queries} over \
                         {keys}"
                    ),
                    tol,
                    &move |s| {
                        let spec = AttentionSpec {
                            causal,
                            scale: None,
                            window,
                        };
                        let qkv = s
                            .randn(&[2, queries.max(keys), 3, 3, 16])?
                            .to_dtype(dtype)?;
                        let heads = qkv.permute(&[2, 0, 3, 1, 4])?;
                        let part = |i: usize, len: usize| -> Result<Tensor<'_>> {
                            heads.narrow(0, i, 1)?.squeeze(0)?.narrow(2, 0, len)
                        };
                        let (q, k, v) = (part(0, queries)?, part(1, keys)?, part(2, keys)?);
                        let lengths = s.from_slice(&[keys as i64, keys as i64 / 2], &[2])?;
                        let mut outs = attention_and_gradients(s, [&q, &k, &v], spec, &lengths)?;
                        outs.push(q.attention(&k, &v, spec, None)?);
                        Ok(outs)
                    },
                );
            }
        }
    }
}

/// Fused attention at head widths on both sides of the tiled kernels' limits (64 and 128 wide tiles,
/// a width no multiple of 4, and a width past 128, which the warp-per-row kernels take), values
/// narrower than keys, in every 16-bit dtype and f32: value and gradients against the host.
#[test]
fn fused_attention_agrees_with_the_host_at_every_head_width() {
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
        for (width, vwidth) in [(64, 64), (66, 40), (128, 128), (130, 96)] {
            agree(
                &format!("fused attention in {dtype}, heads {width} and {vwidth} wide"),
                tol,
                &move |s| {
                    let spec = AttentionSpec {
                        causal: Causal::BottomRight,
                        scale: None,
                        window: None,
                    };
                    let q = s.randn(&[2, 2, 37, width])?.to_dtype(dtype)?;
                    let k = s.randn(&[2, 2, 70, width])?.to_dtype(dtype)?;
                    let v = s.randn(&[2, 2, 70, vwidth])?.to_dtype(dtype)?;
                    let lengths = s.from_slice(&[70i64, 45], &[2])?;
                    attention_and_gradients(s, [&q, &k, &v], spec, &lengths)
                },
            );
        }
    }
}

#[test]
fn asking_for_a_gpu_that_cannot_be_used_is_a_clear_error() {
    match Device::Cuda(0).check_available() {
        Ok(()) => {
            let dev = root(Device::Cuda(0), |s| Ok::<_, Error>(s.ones(&[2])?.device())).unwrap();
            assert_eq!(dev, Device::Cuda(0));
        }
        Err(e) => {
            assert!(!gpu_required(), "NDSCOPE_REQUIRE_GPU=1, but: {e}");
            assert!(matches!(e, Error::DeviceUnavailable { .. }), "{e:?}");
            let text = e.to_string();
            assert!(text.contains("cuda:0"), "{text}");
            assert!(
                text.contains("driver") || text.contains("CUDA device"),
                "{text}"
            );
            let err = root(Device::Cuda(0), |_| Ok::<_, Error>(())).unwrap_err();
            assert_eq!(err.to_string(), text, "the reason is the same every time");
            root(Device::Cpu, |s| {
                let t = s.ones(&[1])?;
                assert!(matches!(
                    t.to_device(Device::Cuda(0)),
                    Err(Error::DeviceUnavailable { .. })
                ));
                Ok::<_, Error>(())
            })
            .unwrap();
        }
    }
    // An ordinal no machine has is refused on every machine.
    let err = Device::Cuda(4096).check_available().unwrap_err();
    assert!(err.to_string().contains("cuda:4096"), "{err}");
}

#[test]
fn elementwise_ops_agree_with_the_host() {
    agree("unary", 1e-5, &|s| {
        let x = s.randn(&[33, 17])?;
        let pos = x.abs()?.add_scalar(0.1)?;
        Ok(vec![
            x.neg()?,
            x.abs()?,
            x.square()?,
            x.relu()?,
            x.exp()?,
            pos.log()?,
            pos.sqrt()?,
            pos.recip()?,
            x.tanh()?,
            x.sin()?,
            x.cos()?,
            x.sigmoid()?,
            x.gelu()?,
            x.gelu_exact()?,
            x.silu()?,
            x.erf()?,
            pos.log1p()?,
            x.expm1()?,
            x.add_scalar(1.5)?,
            x.sub_scalar(0.5)?,
            x.mul_scalar(-2.0)?,
            x.div_scalar(4.0)?,
            pos.powf(1.5)?,
            x.clamp(-0.5, 0.25)?,
        ])
    });
    agree("binary with broadcasting and strides", 1e-5, &|s| {
        let a = s.randn(&[4, 5, 6])?;
        let b = s.randn(&[5, 1])?;
        let t = s.randn(&[6, 5])?.t()?; // a strided operand
        let pos = a.abs()?.add_scalar(0.5)?;
        Ok(vec![
            a.add(&b)?,
            a.sub(&b)?,
            a.mul(&t)?,
            a.div(&b.abs()?.add_scalar(1.0)?)?,
            a.maximum(&t)?,
            a.minimum(&b)?,
            a.eq(&a)?,
            a.ne(&b)?,
            a.lt(&b)?,
            a.le(&t)?,
            a.gt(&b)?,
            a.ge(&t)?,
            pos.pow(&b)?,
        ])
    });
    agree("where, casts and integers", 0.0, &|s| {
        let x = s.randn(&[3, 8])?;
        let mask = x.gt(&s.zeros(&[1])?)?;
        let ints = s.arange(-6i64, 6, 1)?.reshape(&[3, 4])?;
        Ok(vec![
            Tensor::where_cond(&mask, &x, &x.neg()?)?,
            Tensor::where_cond(&mask.to_dtype(DType::I64)?, &x, &s.zeros(&[1])?)?,
            x.mul_scalar(3.0)?.to_dtype(DType::I64)?,
            x.to_dtype(DType::F64)?.to_dtype(DType::F32)?,
            ints.to_dtype(DType::F32)?,
            ints.mul_scalar(3.0)?.add(&ints)?.abs()?,
            ints.t()?.contiguous()?,
        ])
    });
    agree("in-place ops and copies", 1e-6, &|s| {
        let mut a = s.randn(&[6, 7])?;
        let b = s.randn(&[7])?;
        let shared = a.clone(); // copy-on-write: `shared` keeps the old values
        a.add_(&b)?;
        a.axpy_(-0.5, &b)?;
        a.mul_scalar_(2.0)?;
        a.add_scalar_(1.0)?;
        let mut f = s.zeros(&[5])?;
        f.fill_(3.0)?;
        let mut c = s.zeros(&[2, 3])?;
        c.copy_from_slice_(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
        let mut d = s.zeros(&[6, 7])?;
        d.copy_from_(&a.t()?.contiguous()?.t()?)?;
        let joined = Tensor::concat(&[&a, &d.narrow(0, 1, 2)?], 0)?;
        let stacked = Tensor::stack(&[&b, &b.neg()?], 1)?;
        Ok(vec![a, shared, f, c, d, joined, stacked])
    });
}

#[test]
fn reductions_softmax_and_indexing_agree_with_the_host() {
    agree("reductions", 1e-4, &|s| {
        let x = s.randn(&[7, 300, 3])?;
        Ok(vec![
            x.sum(&[1], false)?,
            x.sum(&[0, 2], true)?,
            x.mean(&[-1], false)?,
            x.max(&[1], false)?,
            x.min(&[0], true)?,
            x.sum_all()?,
            x.mean_all()?,
            x.argmax(1, false)?,
            x.argmax(-1, true)?,
            x.transpose(-1, -2)?.sum(&[0], false)?,
        ])
    });
    // Few long rows: the GPU splits each row over many blocks (reduce_part and reduce_join); 50,001
    // elements into 6 uneven parts, a whole-tensor sum of 2M into 244.
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-4), (DType::BF16, 1e-2)] {
        agree(&format!("long-row reductions in {dtype}"), tol, &move |s| {
            let x = s.randn(&[3, 50_001])?.to_dtype(dtype)?;
            let flat = s.randn(&[2000, 1000])?.to_dtype(dtype)?;
            Ok(vec![
                x.sum(&[1], false)?,
                x.mean(&[1], true)?,
                x.max(&[1], false)?,
                x.min(&[1], false)?,
                x.t()?.sum(&[0], false)?,
                flat.sum_all()?,
                flat.mean_all()?,
            ])
        });
    }
    agree("long-row reductions in i64", 0.0, &|s| {
        let x = s
            .randn(&[2, 70_000])?
            .mul_scalar(100.0)?
            .to_dtype(DType::I64)?;
        Ok(vec![x.sum(&[1], false)?, x.max(&[1], false)?, x.sum_all()?])
    });
    agree("softmax", 1e-5, &|s| {
        let x = s.randn(&[9, 1000])?.mul_scalar(5.0)?;
        Ok(vec![
            x.softmax(-1)?,
            x.log_softmax(-1)?,
            x.softmax(0)?,
            x.log_softmax(0)?,
        ])
    });
    agree("gather and index_select", 0.0, &|s| {
        let x = s.randn(&[5, 6])?;
        let index = s.from_slice(&[0i64, 5, 2, 2, 1, 4, 3, 0, 5, 5], &[5, 2])?;
        let rows = s.from_slice(&[4i64, 0, 4, 2], &[4])?;
        Ok(vec![
            x.gather(1, &index)?,
            x.index_select(0, &rows)?,
            x.index_select(1, &rows)?,
        ])
    });
    agree("scatter_add and index_add", 1e-5, &|s| {
        // Repeated indices: the GPU adds them atomically, in no fixed order.
        let base = s.randn(&[5, 6])?;
        let index = s.from_slice(&[0i64, 5, 2, 2, 1, 4, 3, 0, 5, 5, 2, 2], &[6, 2])?;
        let src = s.randn(&[6, 2])?;
        let rows = s.from_slice(&[4i64, 0, 4, 2, 4], &[5])?;
        let slices = s.randn(&[5, 6])?;
        let wide = s.zeros(&[2, 3])?.to_dtype(DType::F64)?;
        let many = s.from_slice(&vec![1i64; 4000], &[2, 2000])?;
        Ok(vec![
            base.narrow(0, 0, 5)?
                .scatter_add(1, &index.narrow(0, 0, 5)?, &src.narrow(0, 0, 5)?)?,
            base.index_add(0, &rows, &slices)?,
            base.t()?.index_add(1, &rows, &slices.t()?)?, // strided operands
            wide.scatter_add(1, &many, &s.ones(&[2, 2000])?.to_dtype(DType::F64)?)?,
            s.zeros(&[3])?.to_dtype(DType::I64)?.index_add(
                0,
                &s.from_slice(&[2i64, 2, 0], &[3])?,
                &s.from_slice(&[7i64, -3, 5], &[3])?,
            )?,
        ])
    });
    agree("gather and index_select backward", 1e-5, &|s| {
        let x = s.randn(&[5, 6])?;
        let index = s.from_slice(&[0i64, 5, 2, 2, 1, 4, 3, 0, 5, 5], &[5, 2])?;
        let rows = s.from_slice(&[4i64, 0, 4, 2], &[4])?;
        let tape = Tape::new(s);
        let w = tape.constant(&s.randn(&[4, 6])?);
        let loss = tape
            .param(&x)
            .gather(1, &index)?
            .sum_all()?
            .add(&tape.param(&x).index_select(0, &rows)?.mul(&w)?.sum_all()?)?;
        let grads = tape.backward(&loss)?;
        Ok(vec![grads.get(&x).expect("x has a gradient").deep_copy()?])
    });
    agree("matmul", 1e-4, &|s| {
        let a = s.randn(&[17, 33])?;
        let b = s.randn(&[33, 9])?;
        let batch = s.randn(&[3, 17, 33])?;
        let v = s.randn(&[33])?;
        Ok(vec![
            a.matmul(&b)?,
            b.t()?.matmul(&a.t()?)?, // both operands transposed views
            batch.matmul(&b)?,       // a batch against one matrix
            batch.matmul(&batch.transpose(1, 2)?)?, // batched, transposed: packed first
            a.matmul(&v)?,           // matrix-vector
            v.matmul(&b)?,           // vector-matrix
            a.narrow(1, 0, 0)?.matmul(&b.narrow(0, 0, 0)?)?, // k = 0: zeros
        ])
    });
}

/// Grouped-query attention (8 query heads over 2 key and value heads), value and gradients, with
/// and without a causal mask, in f64, f32 and bf16.
#[test]
fn grouped_query_attention_agrees_with_the_host() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-4), (DType::BF16, 2e-2)] {
        for causal in [Causal::None, Causal::BottomRight] {
            agree(
                &format!("grouped-query attention in {dtype}, {causal:?}"),
                tol,
                &move |s| {
                    let q = s.randn(&[2, 8, 40, 16])?.to_dtype(dtype)?;
                    let k = s.randn(&[2, 2, 70, 16])?.to_dtype(dtype)?;
                    let v = s.randn(&[2, 2, 70, 16])?.to_dtype(dtype)?;
                    let w = s.randn(&[2, 8, 40, 16])?.to_dtype(dtype)?;
                    let tape = Tape::new(s);
                    let (vq, vk, vv) = (tape.param(&q), tape.param(&k), tape.param(&v));
                    let spec = AttentionSpec {
                        causal,
                        scale: None,
                        window: None,
                    };
                    let out = vq.attention(&vk, &vv, spec, None)?;
                    let grads = tape.backward(&out.mul(&tape.constant(&w))?.sum_all()?)?;
                    Ok(vec![
                        out.value().clone(),
                        grads.get(&q).expect("watched"),
                        grads.get(&k).expect("watched"),
                        grads.get(&v).expect("watched"),
                    ])
                },
            );
        }
    }
}

/// Rotary embedding and its derivative in every float dtype, positions out of order and repeated,
/// tables with Llama 3 scaling.
#[test]
fn rotary_embedding_agrees_with_the_host() {
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-5),
        (DType::BF16, 1e-2),
        (DType::F16, 2e-3),
    ] {
        agree(&format!("rotary in {dtype}"), tol, &move |s| {
            let scaling = nn::RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 64,
            };
            let rope = nn::RotaryEmbedding::new(s, 32, 300, 500_000.0, &scaling, dtype)?;
            let x = s.randn(&[9, 4, 32])?.to_dtype(dtype)?;
            let positions = s.from_slice(&[0i64, 299, 3, 3, 150, 64, 1, 0, 200], &[9])?;
            let tape = Tape::new(s);
            let v = tape.param(&x);
            let y = rope.apply(&v, &positions)?;
            let w = s.randn(&[9, 4, 32])?.to_dtype(dtype)?;
            let grads = tape.backward(&y.mul(&tape.constant(&w))?.sum_all()?)?;
            Ok(vec![y.value().clone(), grads.get(&x).expect("watched")])
        });
    }
}

/// Indices made from host data are checked against the axis from what the host saw, without a read
/// back (which waits for the GPU's queue); one written on the GPU since is read again, so an index
/// out of range stays an error rather than a kernel's NaN.
#[test]
fn indices_seen_on_the_host_stay_checked_until_written_on_the_gpu() {
    let Some(device) = gpu() else { return };
    let _gpu = gpu_exclusive();
    root(device, |s| {
        let waits = || ndscope::gpu_memory(device).map(|m| m.host_waits);
        let x = s.from_slice(&[0.0f32, 1.0, 2.0, 3.0], &[4, 1])?;
        let before = waits()?;
        let rows = s.from_slice(&[3i64, 0, 2], &[3])?;
        let picked = x.index_select(0, &rows)?;
        let counted = x.index_select(0, &s.arange(0i64, 4, 1)?)?;
        let (cos, sin) = (s.ones(&[4, 1])?, s.zeros(&[4, 1])?); // no turn
        let turned = s
            .ones(&[2, 1, 2])?
            .rotary(&cos, &sin, &s.from_slice(&[3i64, 0], &[2])?)?;
        assert_eq!(
            waits()? - before,
            0,
            "checked without reading the indices back"
        );
        assert_eq!(picked.to_vec::<f32>()?, [3.0, 0.0, 2.0]);
        assert_eq!(counted.to_vec::<f32>()?, [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(turned.to_vec::<f32>()?, [1.0; 4]);
        let outside = s.from_slice(&[1i64, 4], &[2])?;
        assert!(matches!(
            x.index_select(0, &outside),
            Err(Error::IndexOutOfRange {
                index: 4,
                size: 4,
                ..
            })
        ));
        // [0, 1] on the host, then [0, 10] on the GPU: what the host saw no longer holds.
        let mut moved = s.from_slice(&[0i64, 1], &[2])?;
        moved.add_(&s.from_slice(&[0i64, 9], &[2])?)?;
        assert!(matches!(
            x.index_select(0, &moved),
            Err(Error::IndexOutOfRange {
                index: 10,
                size: 4,
                ..
            })
        ));
        let mut shared = s.from_slice(&[0i64, 1], &[2])?;
        let before = shared.clone();
        shared.add_(&s.from_slice(&[0i64, 9], &[2])?)?; // a private copy: `before` keeps [0, 1]
        assert_eq!(x.index_select(0, &before)?.to_vec::<f32>()?, [0.0, 1.0]);
        assert!(x.index_select(0, &shared).is_err());
        let past = s.from_slice(&[2i64, 7], &[2])?;
        assert!(matches!(
            s.ones(&[2, 1, 2])?.rotary(&cos, &sin, &past),
            Err(Error::IndexOutOfRange {
                index: 7,
                size: 4,
                ..
            })
        ));
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn transformer_ops_agree_with_the_host() {
    agree(
        "masks, triangles and the new maps' derivatives",
        1e-5,
        &|s| {
            let x = s.randn(&[3, 5, 6])?;
            let mask = x.gt(&s.zeros(&[1])?)?;
            let tape = Tape::new(s);
            let v = tape.param(&x);
            let w = s.randn(&[3, 5, 6])?;
            let loss = v
                .gelu_exact()?
                .add(&v.silu()?)?
                .add(&v.erf()?)?
                .masked_fill(&mask.narrow(2, 0, 1)?, -2.0)?
                .tril(1)?
                .mul(&tape.constant(&w))?
                .sum_all()?;
            let grads = tape.backward(&loss)?;
            Ok(vec![
                x.masked_fill(&mask, f64::NEG_INFINITY)?,
                x.tril(0)?,
                x.triu(-1)?,
                loss.into_value(),
                grads.get(&x).expect("x has a gradient").deep_copy()?,
            ])
        },
    );
    agree(
        "norms and causal attention, forward and backward",
        1e-4,
        &|s| {
            let x = s.randn(&[2, 7, 8])?;
            let (gamma, beta) = (s.randn(&[8])?, s.randn(&[8])?);
            let tape = Tape::new(s);
            let (xv, g, b) = (tape.param(&x), tape.param(&gamma), tape.param(&beta));
            let normed = xv.layer_norm(Some(&g), Some(&b), 1e-5)?;
            let rms = xv.rms_norm(Some(&g), 1e-6)?;
            let options = nn::AttentionOptions {
                causal: true,
                dropout: 0.0,
            };
            let a = nn::scaled_dot_product_attention(&normed, &rms, &xv, options, Mode::Train)?;
            let loss = a.output.square()?.sum_all()?;
            let grads = tape.backward(&loss)?;
            let grad = |t: &Tensor<'_>| grads.get(t).expect("watched").deep_copy();
            Ok(vec![
                a.output.into_value(),
                a.weights.into_value(),
                grad(&x)?,
                grad(&gamma)?,
                grad(&beta)?,
            ])
        },
    );
}

#[test]
fn random_draws_are_the_same_on_every_device() {
    // Uniform draws are exact on every device; normal draws go through the GPU's own `log` and
    // `cos` in f64 before rounding to f32.
    agree("rand, same seed", 0.0, &|s| {
        s.set_seed(21);
        Ok(vec![s.rand(&[257, 33])?, s.rand(&[5])?])
    });
    agree("randn, same seed", 1e-6, &|s| {
        s.set_seed(22);
        Ok(vec![s.randn(&[1000, 17])?, s.randn(&[3])?])
    });
    agree("dropout masks, same seed", 0.0, &|s| {
        s.set_seed(23);
        let tape = Tape::new(s);
        let x = tape.constant(&s.ones(&[64, 32])?);
        let dropped =
            <nn::Dropout as Module<'_>>::forward(&nn::Dropout::new(0.3)?, &x, Mode::Train)?;
        Ok(vec![dropped.into_value()])
    });
}

#[test]
fn convolution_and_pooling_agree_with_the_host() {
    agree(
        "conv2d, pooling, unfold and fold, forward and backward",
        1e-4,
        &|s| {
            let x = s.randn(&[2, 4, 9, 8])?;
            let w = s.randn(&[6, 2, 3, 3])?;
            let b = s.randn(&[6])?;
            let options = ndscope::Conv2dOptions {
                stride: [2, 1],
                padding: [1, 2],
                dilation: [1, 2],
                groups: 2,
            };
            let tape = Tape::new(s);
            let (xv, wv, bv) = (tape.param(&x), tape.param(&w), tape.param(&b));
            let y = xv.conv2d(&wv, Some(&bv), &options)?;
            let pooled = y.max_pool2d([2, 2], [2, 2], [1, 1])?;
            let averaged = xv.avg_pool2d([3, 3], [2, 2], [1, 1])?;
            let adaptive = xv.adaptive_avg_pool2d([3, 5])?;
            let loss = pooled
                .square()?
                .sum_all()?
                .add(&averaged.sum_all()?)?
                .add(&adaptive.square()?.sum_all()?)?;
            let grads = tape.backward(&loss)?;
            let grad = |t: &Tensor<'_>| grads.get(t).expect("watched").deep_copy();
            let cols = x.unfold2d([2, 3], &options)?;
            Ok(vec![
                y.into_value(),
                pooled.into_value(),
                averaged.into_value(),
                adaptive.into_value(),
                grad(&x)?,
                grad(&w)?,
                grad(&b)?,
                cols.fold2d([9, 8], [2, 3], &options)?,
                cols,
            ])
        },
    );
    agree("batch norm in training and evaluation", 1e-4, &|s| {
        let bn = nn::BatchNorm2d::new(s, 3)?;
        let x = s.randn(&[4, 3, 5, 5])?;
        let tape = Tape::new(s);
        let y = bn.forward(&tape.param(&x), Mode::Train)?;
        let grads = tape.backward(&y.square()?.sum_all()?)?;
        let eval = bn.forward(&tape.constant(&x), Mode::Eval)?;
        let running = [
            bn.running_mean.borrow().deep_copy()?,
            bn.running_var.borrow().deep_copy()?,
        ];
        let [mean, var] = running;
        Ok(vec![
            y.into_value(),
            grads.get(&x).expect("watched").deep_copy()?,
            eval.into_value(),
            mean,
            var,
        ])
    });
}

/// Three SGD steps of a two-block causal transformer on token ids, from the same seed; returns
/// the parameters and the losses. SGD rather than Adam: some gradients are zero in exact arithmetic
/// (a key bias shifts every score of a row, which the softmax ignores), so both devices compute
/// rounding noise there, and Adam would scale that noise up to a full learning-rate step.
fn train_transformer<'m>(m: &Scope<'m>, checkpoint: bool) -> Result<Vec<Tensor<'m>>> {
    let opts = nn::AttentionOptions {
        causal: true,
        dropout: 0.0,
    };
    let init = Init::Normal(0.1);
    let mut model = TinyGpt {
        table: nn::Embedding::new(m, 11, 16, init)?,
        positions: nn::PositionalEmbedding::new(m, 6, 16, init)?,
        blocks: vec![
            nn::TransformerBlock::new(m, 16, 4, opts, init)?,
            nn::TransformerBlock::new(m, 16, 4, opts, init)?,
        ],
        head: nn::Linear::new(m, 16, 11, init)?,
    };
    let mut opt = Sgd::new(m, &model, SgdConfig::new(0.1).momentum(0.9))?;
    let mut losses = Vec::new();
    for step in 0..3i64 {
        let loss = m.scope(|b| -> Result<f64> {
            let ids: Vec<i64> = (0..24).map(|i| (i * 7 + step) % 11).collect();
            let ids = b.from_slice(&ids, &[4, 6])?;
            let tape = Tape::new(b);
            let tokens = model.table.forward(&tape, &ids.narrow(1, 0, 5)?)?;
            let mut x = model.positions.forward(&tokens)?;
            for block in &model.blocks {
                x = if checkpoint {
                    nn::Recomputed::new(block.clone()).forward(&x, Mode::Train)?
                } else {
                    block.forward(&x, Mode::Train)?
                };
            }
            let logits = model.head.forward(&x, Mode::Train)?.reshape(&[20, 11])?;
            let next = ids.narrow(1, 1, 5)?.contiguous()?.reshape(&[20])?;
            let loss = logits.cross_entropy(&next)?;
            let grads = tape.backward(&loss)?;
            opt.step(&mut model, &grads)?;
            loss.value().to_dtype(DType::F64)?.to_scalar::<f64>()
        })?;
        losses.push(loss);
    }
    let mut out: Vec<Tensor<'m>> = Vec::new();
    ndscope::nn::Parameters::visit(&model, "", &mut |_, p| out.push(p.clone()));
    out.push(m.from_slice(&losses, &[losses.len()])?);
    Ok(out)
}

ndscope::model! {
    /// A two-block decoder, declared as a user would.
    struct TinyGpt<'m> {
        table: nn::Embedding<'m>,
        positions: nn::PositionalEmbedding<'m>,
        blocks: Vec<nn::TransformerBlock<'m>>,
        head: nn::Linear<'m>,
    }
}

#[test]
fn a_transformer_training_step_agrees_with_the_host() {
    agree(
        "embedding + 2 transformer blocks + SGD, 3 steps",
        1e-4,
        &|m| train_transformer(m, false),
    );
}

/// Recomputed blocks recompute on the device what the host recomputes; on the host the
/// checkpointed step equals the plain one bit for bit (`tests/checkpoint.rs`).
#[test]
fn a_checkpointed_transformer_training_step_agrees_with_the_host() {
    agree(
        "embedding + 2 checkpointed transformer blocks + SGD, 3 steps",
        1e-4,
        &|m| train_transformer(m, true),
    );
}

#[test]
fn cross_entropy_options_agree_with_the_host() {
    use ndscope::nn::{CrossEntropy, Reduction};
    agree(
        "cross_entropy: ignore_index, reductions, smoothing; forward and backward",
        1e-5,
        &|s| {
            let x = s.randn(&[2, 3, 11])?;
            let labels = s.from_slice(&[4i64, -100, 10, 0, 3, -100], &[2, 3])?;
            let mut outs = Vec::new();
            for (reduction, eps) in [
                (Reduction::Mean, 0.0),
                (Reduction::Sum, 0.1),
                (Reduction::None, 0.2),
            ] {
                let tape = Tape::new(s);
                let logits = tape.param(&x);
                let options = CrossEntropy {
                    reduction,
                    label_smoothing: eps,
                    ..CrossEntropy::ignoring(-100)
                };
                let loss = logits.cross_entropy_with(&labels, options)?;
                let total = loss.sum_all()?;
                let grads = tape.backward(&total)?;
                outs.push(loss.value().clone());
                outs.push(grads.get(&x).expect("watched").deep_copy()?);
            }
            Ok(outs)
        },
    );
}

/// The pretrained tiny GPT-2 (loaded onto the scope's device: one upload per tensor), forward and
/// backward on fixed ids, optionally under autocast: the logits, the loss and the gradients of the
/// tied embedding and of a `Conv1D` weight.
fn pretrained_gpt2<'s>(s: &'s Scope<'s>, autocast: Option<DType>) -> Result<Vec<Tensor<'s>>> {
    use ndscope::models::Gpt2;
    let model = Gpt2::from_pretrained(s, "data/gpt2-tiny", DType::F32)?;
    if let Some(dtype) = autocast {
        s.autocast(dtype)?;
    }
    let tape = Tape::new(s);
    let ids: Vec<i64> = (0..64).map(|i| (i * 37 + 11) % 1000).collect();
    let ids = s.from_slice(&ids, &[2, 32])?;
    let logits = model.forward(&tape, &ids, Mode::Train)?;
    let loss = Gpt2::loss(&logits, &ids)?;
    let grads = tape.backward(&loss)?;
    let grad = |t: &Tensor<'_>| grads.get(t).expect("watched").deep_copy();
    Ok(vec![
        logits.value().to_dtype(DType::F32)?,
        loss.value().clone(),
        grad(&model.wte.weight)?,
        grad(&model.blocks[1].attn.qkv.weight)?,
    ])
}

#[test]
fn the_pretrained_gpt2_agrees_with_the_host() {
    agree("GPT-2 (tiny) forward and backward, f32", 1e-4, &|s| {
        pretrained_gpt2(s, None)
    });
    agree(
        "GPT-2 (tiny) forward and backward, bf16 autocast",
        3e-2,
        &|s| pretrained_gpt2(s, Some(DType::BF16)),
    );
}

/// Five training steps of a small MLP from the same seed, in `f32` or in batch scopes that autocast
/// (`f16` with a loss scaler); returns the parameters and the losses.
fn train<'m>(m: &Scope<'m>, adam: bool, autocast: Option<DType>) -> Result<Vec<Tensor<'m>>> {
    let mut model = nn::mlp(m, &[20, 32, 4], Activation::Gelu, Init::KaimingUniform)?;
    let mut losses = Vec::new();
    let mut opt_adam = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-2))?;
    let mut opt_sgd = Sgd::new(m, &model, SgdConfig::new(0.05).momentum(0.9))?;
    let mut scaler = (autocast == Some(DType::F16)).then(LossScaler::new);
    for step in 0..5 {
        let loss = m.scope(|b| -> Result<f64> {
            if let Some(dtype) = autocast {
                b.autocast(dtype)?;
            }
            b.set_seed(100 + step);
            let x = b.randn(&[16, 20])?;
            let labels =
                b.from_slice(&[0i64, 1, 2, 3, 3, 2, 1, 0, 1, 1, 2, 2, 0, 3, 0, 1], &[16])?;
            let tape = Tape::new(b);
            let logits = model.forward(&tape.constant(&x), Mode::Train)?;
            let loss = logits.cross_entropy(&labels)?;
            let grads = match &mut scaler {
                Some(scaler) => {
                    let mut grads = tape.backward(&scaler.scale_loss(&loss)?)?;
                    assert!(
                        scaler.unscale(&mut grads)?,
                        "no overflow at the starting scale"
                    );
                    grads
                }
                None => tape.backward(&loss)?,
            };
            if adam {
                opt_adam.step(&mut model, &grads)?;
            } else {
                opt_sgd.step(&mut model, &grads)?;
            }
            loss.value().to_dtype(DType::F64)?.to_scalar::<f64>()
        })?;
        losses.push(loss);
    }
    let mut out: Vec<Tensor<'m>> = Vec::new();
    ndscope::nn::Parameters::visit(&model, "", &mut |_, p| out.push(p.clone()));
    out.push(m.from_slice(&losses, &[losses.len()])?);
    Ok(out)
}

#[test]
fn a_training_step_agrees_with_the_host() {
    agree("MLP + cross-entropy + AdamW, 5 steps", 1e-4, &|m| {
        train(m, true, None)
    });
    agree("MLP + cross-entropy + SGD momentum, 5 steps", 1e-4, &|m| {
        train(m, false, None)
    });
}

#[test]
fn a_steady_training_step_calls_no_gpu_allocator() {
    let Some(device) = gpu() else { return };
    let _gpu = gpu_shared();
    root(device, |m| {
        let mut model = nn::mlp(m, &[64, 128, 10], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adam(1e-3))?;
        let mut ws = Workspace::new("batch");
        for i in 0..6 {
            // The tree's own count: a closing workspace cycle adds its allocations, arena growth
            // included, to its parent's (the process-wide `gpu_memory` counter is the other tests' too).
            let before = m.stats().device_allocations;
            m.workspace(&mut ws, |b| -> Result<()> {
                b.set_seed(i);
                let x = b.randn(&[32, 64])?;
                let labels = b.from_slice(&[3i64; 32], &[32])?;
                let tape = Tape::new(b);
                let loss = model
                    .forward(&tape.constant(&x), Mode::Train)?
                    .cross_entropy(&labels)?;
                let grads = tape.backward(&loss)?;
                opt.step(&mut model, &grads)
            })?;
            let after = m.stats().device_allocations;
            if i >= 2 {
                assert_eq!(before, after, "step {i} called the GPU allocator");
                assert_eq!(
                    ws.last_cycle_spills(),
                    0,
                    "step {i} spilled out of the arena"
                );
            }
        }
        assert_eq!(ws.device(), device, "the workspace learned a GPU arena");
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn one_trees_idle_gpu_memory_gives_way_to_another_trees_request() {
    let Some(device) = gpu() else { return };
    let _gpu = gpu_exclusive(); // fills the GPU
    let total = ndscope::gpu_memory(device).unwrap().total_bytes;
    let share = total / 10 * 6 / 4; // floats: 60% of the GPU, two of which do not fit
    let cached = std::sync::Barrier::new(2);
    let asked = std::sync::Barrier::new(2);
    std::thread::scope(|threads| {
        let cacher = threads.spawn(|| {
            root(device, |s| -> Result<usize> {
                drop(s.empty(&[share], DType::F32)?);
                let idle = s.stats().cached_bytes;
                cached.wait(); // the block sits idle in this tree's pool
                asked.wait(); // the other tree has asked
                assert_eq!(s.stats().cached_bytes, 0, "released for the other tree");
                Ok(idle)
            })
        });
        let (served, m) = root(device, |s| -> Result<_> {
            cached.wait();
            let t = s.empty(&[share], DType::F32).map(|t| t.numel());
            let m = s.memory_stats(device);
            asked.wait();
            Ok((t, m))
        })
        .unwrap();
        let idle = cacher.join().expect("no panic").unwrap();
        assert!(idle >= share * 4, "the first tree cached its block: {idle}");
        assert_eq!(served.expect("served after the release"), share);
        assert_eq!((m.retries, m.failures), (1, 0), "{m}");
        assert!(m.released_for_retries as usize >= share * 4, "{m}");
    });
}

#[test]
fn gpu_scopes_keep_the_memory_rules() {
    let Some(device) = gpu() else { return };
    let _gpu = gpu_exclusive(); // reads the process-wide reserved bytes
    let reserved_before = ndscope::gpu_memory(device).unwrap().reserved_bytes;
    root(device, |s| {
        // Mixed devices are refused, naming both.
        let host = root(Device::Cpu, |h| h.ones(&[4])?.move_out()).unwrap();
        let g = s.ones(&[4])?;
        let err = g.add(&host).unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("cuda:0") && text.contains("cpu"), "{text}");
        // Host views of GPU memory say so.
        assert!(matches!(g.as_slice::<f32>(), Err(Error::NotOnHost { .. })));
        // Copies both ways keep the values; stats and dumps count GPU blocks.
        let back = g.mul_scalar(3.0)?.to_device(Device::Cpu)?;
        assert_eq!(back.to_vec::<f32>()?, vec![3.0; 4]);
        assert!(s.dump().contains("on cuda:0"), "{}", s.dump());
        // Budgets and caps hold on the GPU.
        s.scope(|c| {
            c.set_budget(Some(1024));
            let err = c.zeros(&[1024]).unwrap_err();
            assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
            c.cap();
            assert!(matches!(c.zeros(&[1]), Err(Error::Capped { .. })));
        });
        // A fault injected at a GPU allocation fails that op only.
        s.inject_fault(1, Fault::OutOfBudget);
        assert!(s.zeros(&[8]).is_err());
        assert_eq!(s.zeros(&[8])?.to_vec::<f32>()?, vec![0.0; 8]);
        // A panic inside a GPU scope returns its bytes.
        let live = s.stats().subtree_bytes;
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            s.scope(|c| {
                let _big = c.zeros(&[1 << 20]).unwrap();
                panic!("boom");
            })
        }));
        assert!(caught.is_err());
        assert_eq!(s.stats().subtree_bytes, live);
        Ok::<_, Error>(())
    })
    .unwrap();
    assert_eq!(
        ndscope::gpu_memory(device).unwrap().reserved_bytes,
        reserved_before,
        "closing the tree handed every cached GPU block back"
    );
}

/// Batch `i` of a deterministic stream for the step-graph tests: 784 features, 10 classes.
fn graph_batch(i: usize) -> (Vec<f32>, Vec<i64>) {
    let x = (0..128 * 784)
        .map(|k| ((k * 31 + i * 17) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let y = (0..128).map(|r| ((r * 7 + i) % 10) as i64).collect();
    (x, y)
}

/// Trains the 784-256-10 MLP with AdamW (or SGD with momentum) for `steps` calls of a step graph on
/// `device` (captured, or eager when `capture` is false); returns the losses, the final parameters,
/// and the graph's (eager steps, captures, replays).
fn train_graph(
    device: Device,
    capture: bool,
    adam: bool,
    steps: usize,
) -> Result<(Vec<f32>, Vec<f64>, [u64; 3])> {
    train_graph_with(device, capture, adam, steps, false)
}

/// `train_graph`, with the whole MLP one checkpointed segment when `checkpoint`.
fn train_graph_with(
    device: Device,
    capture: bool,
    adam: bool,
    steps: usize,
    checkpoint: bool,
) -> Result<(Vec<f32>, Vec<f64>, [u64; 3])> {
    root(device, |s| {
        s.set_seed(3);
        s.named_scope("model", |m| {
            let mut model = nn::mlp(m, &[784, 256, 10], Activation::Relu, Init::KaimingUniform)?;
            let mut adamw = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-2))?;
            let mut sgd = Sgd::new(m, &model, SgdConfig::new(0.05).momentum(0.9))?;
            let mut step = StepGraph::new("step", |b, inputs| {
                let tape = Tape::new(b);
                let x = tape.constant(&inputs[0]);
                let logits = if checkpoint {
                    nn::Recomputed::new(model.clone()).forward(&x, Mode::Train)?
                } else {
                    model.forward(&x, Mode::Train)?
                };
                let loss = logits.cross_entropy(&inputs[1])?;
                let grads = tape.backward(&loss)?;
                if adam {
                    adamw.step(&mut model, &grads)?;
                } else {
                    sgd.step(&mut model, &grads)?;
                }
                Ok(loss.value().clone())
            });
            if !capture {
                step = step.without_capture();
            }
            let mut losses = Vec::new();
            for i in 0..steps {
                let (x, y) = graph_batch(i);
                losses.push(step.run(m, &[Input::new(&x, &[128, 784]), Input::new(&y, &[128])])?);
            }
            let counts = [step.eager_steps(), step.captures(), step.replays()];
            drop(step);
            let mut params = Vec::new();
            ndscope::nn::Parameters::visit(&model, "", &mut |_, p| {
                params.extend(p.to_vec_f64().expect("a parameter reads back"))
            });
            Ok((losses, params, counts))
        })
    })
}

#[test]
fn a_captured_step_replays_bit_identical_to_eager_steps() {
    let Some(device) = gpu() else { return };
    // A capture records every launch on the GPU's one stream: no other test may use the GPU meanwhile.
    let _gpu = gpu_exclusive();
    // Three eager steps plan the workspace, the fourth is captured, then 100 replays.
    let steps = 104;
    for adam in [true, false] {
        let optimizer = if adam { "AdamW" } else { "SGD" };
        let (eager_losses, eager_params, eager_counts) =
            train_graph(device, false, adam, steps).expect("eager steps");
        let (graph_losses, graph_params, graph_counts) =
            train_graph(device, true, adam, steps).expect("captured steps");
        assert_eq!(eager_counts, [steps as u64, 0, 0]);
        assert_eq!(graph_counts, [3, 1, 100], "{optimizer}");
        assert_eq!(
            graph_losses, eager_losses,
            "{optimizer}: every loss, bit for bit"
        );
        assert_eq!(
            graph_params, eager_params,
            "{optimizer}: the parameters after {steps} steps, bit for bit"
        );
        let host = train_graph(Device::Cpu, true, adam, 8).expect("the same steps on the host");
        assert_eq!(host.2, [8, 0, 0], "the host runs every step eagerly");
        for (h, g) in host.0.iter().zip(&graph_losses) {
            assert!(
                (h - g).abs() <= 1e-4 * h.abs().max(1.0),
                "{optimizer}: host {h} against GPU {g}"
            );
        }
    }
}

/// A checkpointed segment's scopes take planned slots of the step's workspace, so the captured step
/// holds the recomputation too.
#[test]
fn a_captured_checkpointed_step_replays_bit_identical_to_eager_steps() {
    let Some(device) = gpu() else { return };
    let _gpu = gpu_exclusive();
    let steps = 24;
    let eager = train_graph_with(device, false, true, steps, true).expect("eager steps");
    let graph = train_graph_with(device, true, true, steps, true).expect("captured steps");
    let plain = train_graph_with(device, false, true, steps, false).expect("plain steps");
    assert_eq!(graph.2, [3, 1, 20], "captured once, then replayed");
    assert_eq!(graph.0, eager.0, "every loss, bit for bit");
    assert_eq!(graph.1, eager.1, "the parameters, bit for bit");
    for (c, p) in eager.0.iter().zip(&plain.0) {
        assert!(
            (c - p).abs() <= 1e-5 * p.abs().max(1.0),
            "checkpointed {c} against plain {p}"
        );
    }
}

#[test]
fn what_a_captured_step_cannot_do_is_a_typed_error() {
    let Some(device) = gpu() else { return };
    let _gpu = gpu_exclusive();
    let (x, y) = graph_batch(0);
    // Each step is fine eagerly; the error comes when the fourth call captures it.
    let refused = |what: &str, expected_op: &str, kind: usize| {
        root(device, |m| -> Result<()> {
            let mut model = nn::mlp(m, &[784, 16, 10], Activation::Relu, Init::KaimingUniform)?;
            let mut sgd = Sgd::new(m, &model, SgdConfig::new(0.05))?;
            let mut step = StepGraph::new("step", |b, inputs| {
                let tape = Tape::new(b);
                let mut x = inputs[0].clone();
                if kind == 2 {
                    x = x.add(&b.rand(&[128, 784])?)?;
                }
                let loss = model
                    .forward(&tape.constant(&x), Mode::Train)?
                    .cross_entropy(&inputs[1])?;
                let grads = tape.backward(&loss)?;
                sgd.step(&mut model, &grads)?;
                if kind == 1 {
                    // A scatter checks its indices on the host before writing through them.
                    let counts = b.zeros(&[10])?.index_add(0, &inputs[1], &b.ones(&[128])?)?;
                    drop(counts);
                }
                if kind == 0 {
                    let _ = loss.value().to_scalar::<f32>()?;
                }
                Ok(loss.value().clone())
            });
            let inputs = || [Input::new(&x, &[128, 784]), Input::new(&y, &[128])];
            for _ in 0..3 {
                step.run(m, &inputs())?;
            }
            let err = step.run(m, &inputs()).expect_err(what);
            match &err {
                Error::InsideCapture { op, .. } => assert_eq!(*op, expected_op, "{what}: {err}"),
                other => panic!("{what}: expected InsideCapture, got {other}"),
            }
            // The step runs eagerly from then on, and the GPU works normally.
            step.run(m, &inputs())?;
            assert_eq!((step.captures(), step.replays()), (0, 0));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    };
    refused("a host read of the loss", "to_scalar", 0);
    refused(
        "a scatter, which checks its indices on the host",
        "index_add",
        1,
    );
    refused("random numbers", "rand", 2);
}

/// Standard normal samples rounded to `dtype`.
fn randn_in<'s>(s: &Scope<'s>, shape: &[usize], dtype: DType) -> Result<Tensor<'s>> {
    s.randn(shape)?.to_dtype(dtype)
}

/// Every op in `bf16` and `f16` on the GPU against the host: the same `f32` arithmetic and one
/// rounding on both, so results agree to a rounding of the dtype (a kernel's `f32` math or summation
/// order may land on the other side of a rounding boundary).
#[test]
fn sixteen_bit_ops_agree_with_the_host() {
    for dtype in [DType::BF16, DType::F16] {
        let tol = 2.0 * dtype.epsilon();
        agree(&format!("{dtype}: elementwise"), tol, &move |s| {
            let x = randn_in(s, &[33, 17], dtype)?;
            let y = randn_in(s, &[17], dtype)?;
            let pos = x.abs()?.add_scalar(0.1)?;
            Ok(vec![
                x.neg()?,
                x.relu()?,
                x.exp()?,
                pos.log()?,
                pos.sqrt()?,
                x.tanh()?,
                x.sigmoid()?,
                x.gelu()?,
                x.silu()?,
                x.erf()?,
                x.mul_scalar(-2.0)?,
                x.clamp(-0.5, 0.25)?,
                x.add(&y)?,
                x.mul(&y)?,
                x.div(&y.abs()?.add_scalar(1.0)?)?,
                x.t()?.sub(&x.t()?.contiguous()?)?,
                Tensor::where_cond(&x.gt(&y)?, &x, &y.broadcast_to(&[33, 17])?)?,
                x.to_dtype(DType::F32)?,
                x.to_dtype(DType::F64)?,
                x.mul_scalar(8.0)?.to_dtype(DType::I64)?,
                s.randn(&[40])?.to_dtype(DType::F16)?.to_dtype(dtype)?,
            ])
        });
        agree(
            &format!("{dtype}: reductions, softmax, indexing"),
            tol,
            &move |s| {
                let x = randn_in(s, &[9, 300], dtype)?;
                let rows = s.from_slice(&[3i64, 0, 3, 8], &[4])?;
                let mut acc = randn_in(s, &[9, 300], dtype)?;
                acc.add_(&x)?;
                Ok(vec![
                    x.sum(&[1], false)?,
                    x.sum(&[0], true)?,
                    x.mean_all()?,
                    x.max(&[1], false)?,
                    x.min(&[0], false)?,
                    x.argmax(1, false)?,
                    x.cumsum(1)?,
                    x.softmax(-1)?,
                    x.log_softmax(0)?,
                    x.rms_norm(Some(&x.narrow(0, 2, 1)?.reshape(&[300])?), 1e-5)?,
                    x.rms_norm(None, 1e-6)?,
                    x.index_select(0, &rows)?,
                    x.index_add(0, &rows, &x.narrow(0, 0, 4)?)?,
                    acc,
                ])
            },
        );
        agree(&format!("{dtype}: products and windows"), tol, &move |s| {
            let a = randn_in(s, &[64, 96], dtype)?;
            let b = randn_in(s, &[96, 40], dtype)?;
            let batched = randn_in(s, &[3, 16, 96], dtype)?;
            let image = randn_in(s, &[2, 3, 8, 8], dtype)?;
            let padded = ndscope::Conv2dOptions {
                padding: [1, 1],
                ..Default::default()
            };
            let cols = image.unfold2d([3, 3], &padded)?;
            Ok(vec![
                a.matmul(&b)?,
                a.t()?.t()?.matmul(&b.t()?.contiguous()?.t()?)?,
                batched.matmul(&b)?,
                cols.clone(),
                cols.fold2d([8, 8], [3, 3], &padded)?,
            ])
        });
        // The same Philox numbers, rounded through f32 on both.
        agree(&format!("{dtype}: random draws"), 0.0, &move |s| {
            Ok(vec![s.rand(&[1000])?.to_dtype(dtype)?])
        });
    }
}

#[test]
fn an_autocast_training_step_agrees_with_the_host() {
    // Adam scales a rounding difference in a gradient to a step of up to `lr`: the tolerance is a few
    // learning rates.
    agree("MLP in bf16 autocast + AdamW, 5 steps", 5e-2, &|m| {
        train(m, true, Some(DType::BF16))
    });
    agree(
        "MLP in f16 autocast + loss scaling + AdamW, 5 steps",
        5e-2,
        &|m| train(m, true, Some(DType::F16)),
    );
}

#[test]
fn tf32_products_are_opt_in_and_shown_in_the_dump() {
    let Some(device) = gpu() else { return };
    let _gpu = gpu_shared();
    root(device, |s| {
        let a = s.randn(&[256, 512])?;
        let b = s.randn(&[512, 128])?;
        let full = a.matmul(&b)?.to_vec::<f32>()?;
        let exact = a
            .to_dtype(DType::F64)?
            .matmul(&b.to_dtype(DType::F64)?)?
            .to_vec::<f64>()?;
        s.allow_tf32(true);
        assert!(s.dump().contains("[tf32 products]"), "{}", s.dump());
        let fast = a.matmul(&b)?.to_vec::<f32>()?;
        let error = |got: &[f32]| {
            got.iter()
                .zip(&exact)
                .map(|(g, e)| (f64::from(*g) - e).abs())
                .fold(0.0, f64::max)
        };
        let (full_error, tf32_error) = (error(&full), error(&fast));
        // TF32 keeps 10 significand bits: its error is far above f32's, and still small against
        // sqrt(512) ~ 23, the size of the entries.
        assert!(
            tf32_error > 10.0 * full_error,
            "tf32 {tf32_error} vs f32 {full_error}"
        );
        assert!(tf32_error < 0.1, "tf32 error {tf32_error}");
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Paged attention and page writes against the host: three sequences fed a prompt, then single
/// tokens and a chunk, blocks of 4 (every sequence crosses several), and a fork of one mid-block.
#[test]
fn paged_attention_agrees_with_the_host() {
    use ndscope::kv::{KvPool, KvShape, KvStep};
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-4), (DType::BF16, 2e-2)] {
        agree(&format!("paged attention in {dtype}"), tol, &move |s| {
            let shape = KvShape {
                layers: 2,
                heads: 3,
                head_width: 40,
                dtype,
            };
            let pool = KvPool::new(s, shape, 4, 48)?;
            let mut caches = [pool.cache(s, 40)?, pool.cache(s, 40)?, pool.cache(s, 40)?];
            let mut outs = Vec::new();
            for counts in [[5usize, 1, 17], [1, 1, 1], [1, 9, 1]] {
                let rows: usize = counts.iter().sum();
                let mut step = KvStep::new(&pool, caches.iter_mut().collect(), &counts)?;
                for layer in 0..2 {
                    let qkv = s.randn(&[rows, 3, 3, 40])?.to_dtype(dtype)?;
                    outs.push(step.attend(layer, &qkv, 0.2)?);
                }
                step.finish();
            }
            let mut fork = caches[0].fork(s, &pool, 40)?;
            let mut step = KvStep::new(&pool, vec![&mut fork], &[1])?;
            outs.push(step.attend(1, &s.randn(&[1, 3, 3, 40])?.to_dtype(dtype)?, 0.2)?);
            step.finish();
            Ok(outs)
        });
    }
}

/// Grouped-query attention through the pages (6 query heads over 2 cached heads) on the GPU gives
/// the host's outputs.
#[test]
fn grouped_paged_attention_agrees_with_the_host() {
    use ndscope::kv::{KvPool, KvShape, KvStep};
    let cases = [None, Some(3)].into_iter().flat_map(|window| {
        [(DType::F64, 1e-12), (DType::F32, 1e-4), (DType::BF16, 2e-2)].map(|(d, t)| (d, t, window))
    });
    for (dtype, tol, window) in cases {
        agree(
            &format!("grouped paged attention in {dtype}, window {window:?}"),
            tol,
            &move |s| {
                let shape = KvShape {
                    layers: 1,
                    heads: 2,
                    head_width: 40,
                    dtype,
                };
                let pool = KvPool::new(s, shape, 4, 32)?;
                let mut caches = [pool.cache(s, 40)?, pool.cache(s, 40)?];
                let mut outs = Vec::new();
                for counts in [[9usize, 1], [1, 1], [2, 7]] {
                    let rows: usize = counts.iter().sum();
                    let mut step = KvStep::new(&pool, caches.iter_mut().collect(), &counts)?;
                    let q = s.randn(&[rows, 6, 40])?.to_dtype(dtype)?;
                    let kv = s.randn(&[rows, 2, 2, 40])?.to_dtype(dtype)?;
                    outs.push(step.attend_in_window(0, &q, &kv, 0.2, window)?);
                    step.finish();
                }
                Ok(outs)
            },
        );
    }
}

/// The tiny GPT-2 decoding against its cache on the GPU gives the host's logits.
#[test]
fn gpt2_decoding_agrees_with_the_host() {
    use ndscope::kv::{CausalLm, KvPool};
    use ndscope::models::Gpt2;
    agree("GPT-2 decoding", 1e-4, &|s| {
        let gpt2 = Gpt2::from_pretrained(s, "data/gpt2-tiny", DType::F32)?;
        let pool = KvPool::new(s, gpt2.kv_shape(), 16, 16)?;
        let (mut a, mut b) = (pool.cache(s, 64)?, pool.cache(s, 64)?);
        let mut outs = Vec::new();
        let mut caches = [&mut a, &mut b];
        s.scope(|step| -> Result<()> {
            let logits = gpt2.decode(step, &pool, &mut caches, &[&[33, 292, 482], &[5; 20]])?;
            outs.push(logits.to_vec::<f32>()?);
            let logits = gpt2.decode(step, &pool, &mut caches, &[&[7], &[8]])?;
            outs.push(logits.to_vec::<f32>()?);
            Ok(())
        })?;
        outs.iter().map(|v| s.from_slice(v, &[v.len()])).collect()
    });
}

/// The tiny Llama (grouped heads, rotary positions) on the GPU: a training step's logits and
/// gradients and cached decoding give the host's.
#[test]
fn llama_agrees_with_the_host() {
    use ndscope::kv::{CausalLm, KvPool};
    use ndscope::models::Llama;
    use ndscope::nn::Parameters;
    // Mistral's window (16) is shorter than its 24-token rows and the 20-token prompt.
    for (dir, rows) in [("data/llama-tiny", [2, 12]), ("data/mistral-tiny", [1, 24])] {
        agree(dir, 1e-4, &move |s| {
            let llama = Llama::from_pretrained(s, dir, DType::F32)?;
            let ids: Vec<i64> = (0..24).map(|i| (i * 37 % 1000) as i64).collect();
            let input = s.from_slice(&ids, &rows)?;
            let tape = Tape::new(s);
            let logits = llama.forward(&tape, &input, Mode::Train)?;
            let grads = tape.backward(&logits.square()?.mean_all()?)?;
            let mut outs = vec![logits.value().clone()];
            llama.visit("", &mut |_, p| outs.push(grads.get(p).expect("a gradient")));
            let pool = KvPool::new(s, llama.kv_shape(), 4, 16)?;
            let (mut a, mut b) = (pool.cache(s, 24)?, pool.cache(s, 24)?);
            let mut caches = [&mut a, &mut b];
            s.scope(|step| -> Result<()> {
                let first = llama.decode(step, &pool, &mut caches, &[&ids[..20], &ids[20..]])?;
                outs.push(s.from_slice(&first.to_vec::<f32>()?, &[2, 1000])?);
                let next = llama.decode(step, &pool, &mut caches, &[&[7], &[8]])?;
                outs.push(s.from_slice(&next.to_vec::<f32>()?, &[2, 1000])?);
                Ok(())
            })?;
            Ok(outs)
        });
    }
}

/// A decoding step on the GPU makes the host wait for the GPU once, for its logits: everything the
/// step checks (token ids, positions, the rows scored) is checked from what the host built, so the
/// host queues the whole step while the GPU runs it. (Each layer's rotary positions were read back
/// before, a wait per call: the host and the GPU then took turns.)
#[test]
fn a_decoding_step_waits_for_the_gpu_once() {
    use ndscope::gpu_memory;
    use ndscope::kv::{CausalLm, KvPool};
    use ndscope::models::AutoModel;
    let Some(device) = gpu() else { return };
    let _gpu = gpu_exclusive();
    for dir in ["data/gpt2-tiny", "data/llama-tiny", "data/mistral-tiny"] {
        root(device, |s| {
            let model = AutoModel::from_pretrained(s, dir, DType::F32)?;
            let pool = KvPool::new(s, model.kv_shape(), 4, 32)?;
            let (mut a, mut b) = (pool.cache(s, 40)?, pool.cache(s, 40)?);
            let mut caches = [&mut a, &mut b];
            let waits = || gpu_memory(device).map(|m| m.host_waits);
            for tokens in [&[&[3i64, 9, 27][..], &[5; 20][..]], &[&[7][..], &[8][..]]] {
                s.scope(|step| -> Result<()> {
                    let before = waits()?;
                    let logits = model.decode(step, &pool, &mut caches, tokens)?;
                    let next = logits.to_vec::<f32>()?;
                    assert_eq!(waits()? - before, 1, "{dir}: {} logits", next.len());
                    Ok(())
                })?;
            }
            Ok::<_, Error>(())
        })
        .unwrap();
    }
}

/// Collectives on GPU tensors go through NCCL, here as a world of one (no MPI needed, and NCCL
/// refuses two ranks on one GPU): an all-reduce gives the tensor back, a mean of one rank too, a
/// gather stacks it once, and a data-parallel step gives the plain step's gradients. Without a GPU
/// (or without libnccl) the collective is a clear `DeviceUnavailable`.
#[test]
fn collectives_on_gpu_tensors_go_through_nccl() {
    use ndscope::dist::{DataParallel, ProcessGroup, Reduce};
    let group = ProcessGroup::single();
    let Some(device) = gpu() else {
        // The host path still works, and the GPU's absence is the error a GPU tensor would meet.
        let err = Device::Cuda(0).check_available().unwrap_err();
        assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
        return;
    };
    let _gpu = gpu_shared();
    root(device, |s| {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let t = s.randn(&[1000])?.to_dtype(dtype)?;
            for reduce in [Reduce::Sum, Reduce::Mean] {
                let out = group.all_reduce(&t, reduce)?;
                assert_eq!(out.device(), device);
                assert_eq!(out.to_vec_f64()?, t.to_vec_f64()?, "{dtype:?} {reduce:?}");
            }
        }
        let t = s.randn(&[2, 3])?;
        let gathered = group.all_gather(&t)?;
        assert_eq!(gathered.shape(), &[1, 2, 3]);
        assert_eq!(gathered.to_vec::<f32>()?, t.to_vec::<f32>()?);
        let mut b = t.clone();
        group.broadcast_(&mut b, 0)?;
        assert_eq!(b.to_vec::<f32>()?, t.to_vec::<f32>()?);
        let mut model = nn::mlp(s, &[4, 8, 3], Activation::Tanh, Init::XavierUniform)?;
        let ddp = DataParallel::new(&group, &mut model)?;
        let features: Vec<f32> = (0..20).map(|i| (i as f32 * 0.37).sin()).collect();
        let gradients = |averaged: bool| {
            s.scope(|b| {
                let tape = Tape::new(b);
                let x = tape.constant(&b.from_slice(&features, &[5, 4])?);
                let labels = b.from_slice(&[0i64, 1, 2, 0, 1], &[5])?;
                let forward = || model.forward(&x, Mode::Train)?.cross_entropy(&labels);
                let grads = if averaged {
                    ddp.backward(&model, &tape, 5, forward)?
                } else {
                    tape.backward(&forward()?)?
                };
                let mut values = Vec::new();
                ndscope::nn::Parameters::visit(&model, "", &mut |_, p| {
                    values.push(grads.get(p).map(|g| g.to_vec_f64()));
                });
                values
                    .into_iter()
                    .map(|g| g.expect("a gradient per parameter"))
                    .collect::<Result<Vec<_>>>()
            })
        };
        assert_eq!(gradients(true)?, gradients(false)?);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Blocks of `ty` for an `n × k` matrix: random levels and scale bits, every block's `f16` scale
/// (and minimum) replaced by a small finite value so that no block decodes to infinities.
fn random_blocks(ty: ndscope::quant::QuantType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    use ndscope::quant::QuantType as Q;
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let len = ty.bytes_for(n * k).expect("whole blocks");
    let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
    // Where each format keeps its f16 scale and minimum inside a block.
    let scales: &[usize] = match ty {
        Q::Q4_0 | Q::Q5_0 | Q::Q8_0 => &[0],
        Q::Q4_1 | Q::Q5_1 | Q::Q4_K | Q::Q5_K => &[0, 2],
        Q::Q2_K => &[80, 82],
        Q::Q3_K => &[108],
        Q::Q6_K => &[208],
        _ => unreachable!("a block format"),
    };
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &at in scales {
            // f16 values in [2^-10, 2^-6): exponent bits 5..8, random mantissa.
            let bits = (((5 + next() % 4) as u16) << 10) | (next() as u16 & 0x3ff);
            block[at..at + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    bytes
}

/// The GPU's quantized products against the host's, for every block format: one to 17 rows (the
/// kernel takes 8 at a time) and 40, a weight row count no launch shape divides, rows of 2,304 values (nine
/// K blocks, 72 steps of 32: a lane's two steps in flight, and a lane with one left over), `bf16`
/// and 3-D activations, and a row of zeros (a block whose scale is 0).
#[test]
fn quantized_products_agree_with_the_host() {
    use ndscope::QuantTensor;
    use ndscope::quant::QuantType as Q;
    let types = [
        Q::Q4_0,
        Q::Q4_1,
        Q::Q5_0,
        Q::Q5_1,
        Q::Q8_0,
        Q::Q2_K,
        Q::Q3_K,
        Q::Q4_K,
        Q::Q5_K,
        Q::Q6_K,
    ];
    for (i, ty) in types.into_iter().enumerate() {
        let (n, k) = (37, 2304);
        let bytes = random_blocks(ty, n, k, i as u64 + 1);
        let blocks = bytes.clone();
        agree(&format!("{} products", ty.name()), 1e-4, &move |s| {
            let w = QuantTensor::from_blocks(s, &blocks, ty, &[n, k])?;
            let mut outs = Vec::new();
            for m in [1, 3, 9, 17] {
                let mut x = s.randn(&[m, k])?.to_vec::<f32>()?;
                x[..k].fill(0.0);
                let x = s.from_slice(&x, &[m, k])?;
                outs.push(x.matmul_quantized_t(&w)?);
            }
            Ok(outs)
        });
        // 40 rows: five passes of 8 over the weight, in one launch.
        let tall = bytes.clone();
        agree(
            &format!("{} products of 40 rows", ty.name()),
            1e-4,
            &move |s| {
                let w = QuantTensor::from_blocks(s, &tall, ty, &[n, k])?;
                Ok(vec![s.randn(&[40, k])?.matmul_quantized_t(&w)?])
            },
        );
        // In bf16 the result is rounded to 8 bits: sums a last f32 bit apart may round apart.
        agree(
            &format!("{} products of bf16", ty.name()),
            1e-2,
            &move |s| {
                let w = QuantTensor::from_blocks(s, &bytes, ty, &[n, k])?;
                let x = s.randn(&[2, 3, k])?.to_dtype(DType::BF16)?;
                Ok(vec![x.matmul_quantized_t(&w)?])
            },
        );
    }
}

/// A GGUF file's Llama computing on its quantized blocks on the GPU (the tiny model's rows of 64
/// and 176 values keep llama.cpp from K-quants: its Q4_K_M file holds Q5_0, Q8_0 and F16
/// matrices) gives the host's logits, over a whole sequence and decoding against a cache, but for
/// the activation rounding flips [`agree_quantized`] allows.
#[test]
fn a_quantized_llama_agrees_with_the_host() {
    use ndscope::kv::{CausalLm, KvPool};
    use ndscope::models::Llama;
    for file in [
        "data/gguf/llama-tiny-Q4_K_M.gguf",
        "data/gguf/llama-tiny-Q8_0.gguf",
    ] {
        agree_quantized(file, &move |s| {
            let llama = Llama::from_gguf_quantized(s, file, DType::F32)?;
            let ids: Vec<i64> = (0..24).map(|i| (i * 37 % 1000) as i64).collect();
            let tape = Tape::new(s);
            let logits = llama.forward(&tape, &s.from_slice(&ids, &[2, 12])?, Mode::Eval)?;
            let mut outs = vec![logits.value().clone()];
            let pool = KvPool::new(s, llama.kv_shape(), 4, 16)?;
            let mut cache = pool.cache(s, 24)?;
            s.scope(|step| -> Result<()> {
                let first = llama.decode(step, &pool, &mut [&mut cache], &[&ids[..20]])?;
                outs.push(s.from_slice(&first.to_vec::<f32>()?, first.shape())?);
                let next = llama.decode(step, &pool, &mut [&mut cache], &[&[7]])?;
                outs.push(s.from_slice(&next.to_vec::<f32>()?, next.shape())?);
                Ok(())
            })?;
            Ok(outs)
        });
    }
}
