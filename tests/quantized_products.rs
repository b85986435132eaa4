//! Products with block-quantized matrices (`QuantTensor`, `Tensor::matmul_quantized_t`): every
//! quantized tensor of llama.cpp-made GGUF files against an f64 product of its decoded values,
//! within the bound the activations' 8-bit rounding allows; shapes, dtypes, errors and the memory a
//! scope holds for them. (The kernels' exact arithmetic, every format and both the AVX2 and the
//! portable path, is held in `backend::cpu::quant_product`'s unit tests.)

use ndscope::quant::QuantType;
use ndscope::weights::Weights;
use ndscope::{DType, Device, Error, QuantTensor, Result, Scope, root};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

/// Asserts `got` (`[m, n]`) is `x wᵀ` (f64) within the rounding of `x` to 8 bits per block of 32:
/// half a step `d = max|x_block| / 127` per value, plus up to 127 times `d`'s own rounding to
/// `f16` (2^-11 of it), times `Σ|w|` per block, plus `f32` summation.
fn assert_product(got: &[f32], x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize), what: &str) {
    for t in 0..m {
        let xr = &x[t * k..(t + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            let exact: f64 = xr
                .iter()
                .zip(wr)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            let mut bound = 0.0f64;
            for (xb, wb) in xr.chunks(32).zip(wr.chunks(32)) {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                let wsum: f64 = wb.iter().map(|v| f64::from(v.abs())).sum();
                let magnitude: f64 = xb
                    .iter()
                    .zip(wb)
                    .map(|(a, b)| f64::from(a.abs() * b.abs()))
                    .sum();
                let step = amax / 127.0;
                bound += wsum * step * (0.5 + 127.0 / 2048.0) * (1.0 + 1e-6) + magnitude * 1e-6;
            }
            let g = f64::from(got[t * n + j]);
            assert!(
                (g - exact).abs() <= bound + 1e-30,
                "{what} [{t}][{j}]: {g} vs exact {exact} (bound {bound:e})"
            );
        }
    }
}

#[test]
fn every_quantized_tensor_of_llama_cpp_files_multiplies_as_its_decoded_values() -> Result<()> {
    let mut checked = std::collections::HashSet::new();
    for file in [
        "data/gguf/llama-tiny-Q8_0.gguf",
        "data/gguf/llama-tiny-Q4_0.gguf",
        "data/gguf/llama-tiny-Q4_K_M.gguf",
        "data/gguf/gpt2-tiny-Q4_K_M.gguf",
    ] {
        let weights = Weights::open(file)?;
        root(Device::Cpu, |s| {
            let names: Vec<String> = weights.names().map(String::from).collect();
            for name in names {
                let Some(ty) = weights.quantized(&name)? else {
                    continue;
                };
                let shape = weights.info(&name)?.1.to_vec();
                let (n, k) = (shape[0], shape[1]);
                let q = weights.quantized_tensor(s, &name, &shape)?;
                assert_eq!((q.ty(), q.shape()), (ty, [n, k]));
                let decoded = weights
                    .tensor(s, &name, &shape, DType::F32)?
                    .to_vec::<f32>()?;
                for m in [1, 5] {
                    let x = values(m * k, (m * n) as u64);
                    let got = s
                        .from_slice(&x, &[m, k])?
                        .matmul_quantized_t(&q)?
                        .to_vec::<f32>()?;
                    assert_product(
                        &got,
                        &x,
                        &decoded,
                        (m, k, n),
                        &format!("{file} {name} {ty}"),
                    );
                }
                checked.insert(ty);
            }
            Ok::<_, Error>(())
        })?;
    }
    // The files hold Q8_0, Q4_0 and Q5_0 (llama-quantize's fallback for rows of 64 in Q4_K_M).
    assert!(checked.len() >= 3, "{checked:?}");
    Ok(())
}

#[test]
fn leading_axes_and_16_bit_rows_keep_their_shape_and_dtype() -> Result<()> {
    root(Device::Cpu, |s| {
        let (k, n) = (64, 3);
        let w = s.from_slice(&values(n * k, 3), &[n, k])?;
        let q = QuantTensor::quantize(&w, QuantType::Q4_0)?;
        let x = s.from_slice(&values(2 * 2 * k, 4), &[2, 2, k])?;
        let y = x.matmul_quantized_t(&q)?;
        assert_eq!((y.shape(), y.dtype()), (&[2, 2, n][..], DType::F32));
        let flat = x.reshape(&[4, k])?.matmul_quantized_t(&q)?;
        assert_eq!(y.to_vec::<f32>()?, flat.to_vec::<f32>()?);
        // A row viewed out of a bigger tensor (a nonzero offset) multiplies as the copied row.
        let row = x.reshape(&[4, k])?.narrow(0, 3, 1)?;
        assert_eq!(
            row.matmul_quantized_t(&q)?.to_vec::<f32>()?,
            flat.to_vec::<f32>()?[3 * n..]
        );
        let yb = x.to_dtype(DType::BF16)?.matmul_quantized_t(&q)?;
        assert_eq!((yb.shape(), yb.dtype()), (&[2, 2, n][..], DType::BF16));
        Ok(())
    })
}

#[test]
fn bad_operands_are_typed_errors_that_say_what_to_do() -> Result<()> {
    root(Device::Cpu, |s| {
        let w = s.from_slice(&values(2 * 64, 5), &[2, 64])?;
        let q = QuantTensor::quantize(&w, QuantType::Q8_0)?;
        let err = s
            .from_slice(&values(32, 6), &[1, 32])?
            .matmul_quantized_t(&q)
            .unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
        assert!(err.to_string().contains("row length"), "{err}");
        let err = s
            .from_slice(&[1i64; 64], &[1, 64])?
            .matmul_quantized_t(&q)
            .unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType { .. }), "{err}");
        let odd = s.from_slice(&values(2 * 40, 7), &[2, 40])?;
        let err = QuantTensor::quantize(&odd, QuantType::Q4_0).unwrap_err();
        assert!(err.to_string().contains("blocks of 32"), "{err}");
        let err = QuantTensor::quantize(&w, QuantType::Q4_K).unwrap_err();
        assert!(err.to_string().contains("blocks of 256"), "{err}");
        let err = QuantTensor::quantize(&w, QuantType::Q3_K).unwrap_err();
        assert!(err.to_string().contains("llama-quantize"), "{err}");
        let err = QuantTensor::quantize(&w, QuantType::F16).unwrap_err();
        assert!(err.to_string().contains("float type"), "{err}");
        // A GGUF tensor stored as plain floats is not a quantized matrix.
        let weights = Weights::open("data/gguf/llama-tiny-Q4_K_M.gguf")?;
        let err = weights
            .quantized_tensor(s, "blk.0.ffn_down.weight", &[64, 176])
            .unwrap_err();
        assert!(err.to_string().contains("Weights::tensor"), "{err}");
        let err = weights
            .quantized_tensor(s, "blk.0.attn_q.weight", &[32, 64])
            .unwrap_err();
        assert!(matches!(err, Error::TensorMismatch { .. }), "{err}");
        Ok(())
    })
}

#[test]
fn a_scope_counts_quantized_bytes_and_returns_them() -> Result<()> {
    root(Device::Cpu, |outer: &Scope<'_>| {
        let before = outer.stats().live_bytes;
        let kept = outer.scope(|inner| {
            let w = inner.from_slice(&values(64 * 256, 8), &[64, 256])?;
            let q = QuantTensor::quantize(&w, QuantType::Q4_0)?;
            assert_eq!(q.nbytes(), 64 * 8 * 18);
            assert!(inner.stats().live_bytes >= q.nbytes() + 64 * 256 * 4);
            inner.ret(q)
        })?;
        // Moved out: the outer scope now holds the blocks (at least their bytes), the inner is gone.
        assert!(outer.stats().live_bytes - before >= kept.nbytes());
        let x = outer.from_slice(&values(256, 9), &[1, 256])?;
        assert_eq!(x.matmul_quantized_t(&kept)?.shape(), &[1, 64]);
        drop(kept);
        drop(x);
        assert_eq!(outer.stats().live_bytes, before);
        Ok(())
    })
}

#[test]
fn a_quantized_linear_computes_on_its_blocks_and_trains_what_is_under_it() -> Result<()> {
    use ndscope::nn::{Linear, Mode, Module, Parameters};
    use ndscope::{Movable, Tape};
    let (m, k, n) = (3, 64, 5);
    root(Device::Cpu, |s| {
        let w = s.from_slice(&values(n * k, 3), &[n, k])?;
        let q = QuantTensor::quantize(&w, QuantType::Q4_0)?;
        let decoded = q.dequantize(DType::F32)?;
        let bias = s.from_slice(&values(n, 4), &[n])?;
        let layer = Linear::from_quantized(q.clone(), Some(bias.clone()))?;
        assert_eq!((layer.in_features(), layer.out_features()), (k, n));
        assert_eq!(layer.weight.shape(), [0]); // the dense field is empty
        assert_eq!(
            layer.quantized_weight().map(QuantTensor::ty),
            Some(QuantType::Q4_0)
        );
        // The bias is the layer's only parameter: optimizers and checkpoints never see the blocks.
        let mut names = Vec::new();
        layer.visit("", &mut |name, _| names.push(name.to_string()));
        assert_eq!(names, ["bias"]);

        let x = s.from_slice(&values(m * k, 5), &[m, k])?;
        let g = s.from_slice(&values(m * n, 6), &[m, n])?;
        let tape = Tape::new(s);
        let input = tape.param(&x);
        let y = layer.forward(&input, Mode::Train)?;
        // Forward: the quantized product plus the bias.
        let want = x.matmul_quantized_t(&q)?.add(&bias)?;
        assert_eq!(y.value().to_vec::<f32>()?, want.to_vec::<f32>()?);
        // Backward: the input's gradient is g W with W the decoded blocks; the bias's is Σ g.
        let loss = y.mul(&tape.constant(&g))?.sum_all()?;
        let grads = tape.backward(&loss)?;
        let gx = grads.get(&x).expect("x is a parameter").to_vec::<f32>()?;
        let (gv, wv) = (g.to_vec::<f32>()?, decoded.to_vec::<f32>()?);
        for t in 0..m {
            for i in 0..k {
                let want: f64 = (0..n)
                    .map(|j| f64::from(gv[t * n + j]) * f64::from(wv[j * k + i]))
                    .sum();
                assert!(
                    (f64::from(gx[t * k + i]) - want).abs() <= 1e-5,
                    "[{t}][{i}]"
                );
            }
        }
        let gb = grads
            .get(&bias)
            .expect("the bias is a parameter")
            .to_vec::<f32>()?;
        for j in 0..n {
            let want: f32 = (0..m).map(|t| gv[t * n + j]).sum();
            assert!((gb[j] - want).abs() <= 1e-5);
        }
        // The layer moves with its blocks.
        let moved = s.scope(|inner| {
            let copy = layer.clone().move_into(inner)?;
            let ty = copy.quantized_weight().map(|q| q.nbytes());
            Ok::<_, Error>(ty)
        })?;
        assert_eq!(moved, Some(q.nbytes()));
        Ok(())
    })
}

/// Random blocks of `ty` with finite scales: random bytes, each `f16` scale field set to a small
/// value.
fn random_blocks(ty: QuantType, values: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut bytes: Vec<u8> = (0..ty.bytes_for(values).unwrap())
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let scales: &[usize] = match ty {
        QuantType::Q4_K => &[0, 2],
        QuantType::Q6_K => &[208],
        _ => &[0],
    };
    for (i, block) in bytes.chunks_exact_mut(ty.block_bytes()).enumerate() {
        for &at in scales {
            let v = half::f16::from_f32(0.01 * (1 + (i + at) % 5) as f32);
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    bytes
}

/// The formats a CPU with AVX-512 VNNI stores in strips of 16 interleaved rows, with rows past the
/// last whole strip: what comes back out (decoded, looked up, multiplied) is what the file holds.
#[test]
fn blocks_kept_in_the_kernels_order_decode_look_up_and_multiply_as_stored() -> Result<()> {
    let (n, k) = (35, 512);
    for ty in [
        QuantType::Q4_0,
        QuantType::Q8_0,
        QuantType::Q4_K,
        QuantType::Q6_K,
    ] {
        let bytes = random_blocks(ty, n * k, ty.ggml() as u64);
        let mut decoded = vec![0.0f32; n * k];
        ndscope::quant::dequantize(ty, &bytes, &mut decoded)?;
        root(Device::Cpu, |s| {
            let q = QuantTensor::from_blocks(s, &bytes, ty, &[n, k])?;
            assert_eq!(q.dequantize(DType::F32)?.to_vec::<f32>()?, decoded, "{ty}");
            let picked = [34usize, 0, 17, 16, 15, 33, 31, 32];
            let ids: Vec<i64> = picked.iter().map(|&r| r as i64).collect();
            let rows = q
                .index_select(&s.from_slice(&ids, &[ids.len()])?, DType::F32)?
                .to_vec::<f32>()?;
            for (i, &r) in picked.iter().enumerate() {
                assert_eq!(
                    rows[i * k..(i + 1) * k],
                    decoded[r * k..(r + 1) * k],
                    "{ty} {r}"
                );
            }
            for m in [1, 3, 9] {
                let x = values(m * k, m as u64);
                let got = s
                    .from_slice(&x, &[m, k])?
                    .matmul_quantized_t(&q)?
                    .to_vec::<f32>()?;
                assert_product(&got, &x, &decoded, (m, k, n), &format!("{ty} m={m}"));
            }
            Ok::<_, Error>(())
        })?;
    }
    Ok(())
}

#[test]
fn quantized_rows_decode_only_the_rows_asked_for() -> Result<()> {
    root(Device::Cpu, |s| {
        let w = s.from_slice(&values(6 * 32, 8), &[6, 32])?;
        let q = QuantTensor::quantize(&w, QuantType::Q8_0)?;
        let all = q.dequantize(DType::F32)?.to_vec::<f32>()?;
        let ids = s.from_slice(&[4i64, 0, 4], &[3])?;
        let rows = q.index_select(&ids, DType::F32)?;
        assert_eq!(rows.shape(), [3, 32]);
        let got = rows.to_vec::<f32>()?;
        for (r, &id) in [4usize, 0, 4].iter().enumerate() {
            assert_eq!(got[r * 32..(r + 1) * 32], all[id * 32..(id + 1) * 32]);
        }
        assert_eq!(q.index_select(&ids, DType::BF16)?.dtype(), DType::BF16);
        let bad = s.from_slice(&[6i64], &[1])?;
        assert!(matches!(
            q.index_select(&bad, DType::F32),
            Err(Error::IndexOutOfRange {
                index: 6,
                size: 6,
                ..
            })
        ));
        let floats = s.from_slice(&[1.0f32], &[1])?;
        assert!(matches!(
            q.index_select(&floats, DType::F32),
            Err(Error::UnsupportedDType { .. })
        ));
        Ok(())
    })
}

#[test]
fn a_quantized_model_holds_its_file_in_blocks_and_refuses_to_save_as_safetensors() -> Result<()> {
    use ndscope::models::{Gpt2, Llama};
    use ndscope::nn::Parameters;
    let file = "data/gguf/llama-tiny-Q4_0.gguf";
    root(Device::Cpu, |s| {
        let before = s.stats().live_bytes;
        let llama = Llama::from_gguf_quantized(s, file, DType::F32)?;
        let held = s.stats().live_bytes - before;
        // The blocks as stored (the norms and the F16 matrices llama-quantize leaves in F16
        // decoded to f32): well under the decoded model's bytes.
        let decoded = Llama::from_gguf(s, file, DType::F32)?;
        let dense = decoded.parameter_elements() * 4;
        assert!(
            held * 2 < dense,
            "{held} bytes held quantized, {dense} decoded"
        );
        let dir =
            std::env::temp_dir().join(format!("ndscope-quantized-save-{}", std::process::id()));
        let err = llama.save_pretrained(&dir).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert!(err.to_string().contains("from_gguf"), "{err}");
        assert!(!dir.join("model.safetensors").exists());
        let gpt2 = Gpt2::from_gguf_quantized(s, "data/gguf/gpt2-tiny-Q4_0.gguf", DType::F32)?;
        // GPT-2's tied table stays in its blocks too: a lookup decodes its rows, the head computes
        // on them, and it is no parameter.
        assert_eq!(
            gpt2.wte_blocks().map(QuantTensor::ty),
            Some(QuantType::Q8_0)
        );
        assert_eq!(gpt2.wte.weight.shape(), [0]);
        assert_eq!((gpt2.wte.num(), gpt2.wte.dim()), (0, 0));
        let mut names = Vec::new();
        gpt2.visit("", &mut |name, _| names.push(name.to_string()));
        assert!(
            !names.is_empty() && names.iter().all(|name| !name.contains("wte")),
            "{names:?}"
        );
        assert!(gpt2.save_pretrained(&dir).is_err());
        // A file without quantized tensors holds no blocks: its model saves.
        let plain = Gpt2::from_gguf_quantized(s, "data/gguf/gpt2-tiny-F32.gguf", DType::F32)?;
        assert!(plain.wte_blocks().is_none());
        plain.save_pretrained(&dir)?;
        assert!(dir.join("model.safetensors").exists());
        std::fs::remove_dir_all(&dir).ok();
        Ok(())
    })
}

#[test]
fn joining_the_pool_after_it_was_built_is_a_typed_error() {
    // Any op may build rayon's global pool; after that the calling thread cannot join it.
    assert!(rayon::current_num_threads() >= 1);
    let err = ndscope::threads::work_on_this_thread(None).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("first thing in main"), "{err}");
}
