//! Data-parallel training across processes, run under `mpirun -np N` (CI runs 1, 2 and 3 ranks):
//! collectives against references computed on one rank, data parallelism against one process on
//! the whole batch, and the faults (a failing rank, a different model, a rank that never joins).
//!
//! A test binary of its own main (`harness = false`): MPI is started once per process, on the main
//! thread, and every rank runs every case in the same order. A case's failure on any rank is
//! agreed on, so every rank reports it and the job exits non-zero instead of hanging.

use std::panic::{self, AssertUnwindSafe};
use std::time::Duration;

use ndscope::data::{Dataset, Loader};
use ndscope::dist::{DataParallel, ProcessGroup, Reduce};
use ndscope::models::Llama;
use ndscope::nn::{Mode, Parameters};
use ndscope::optim::{Adam, AdamConfig, GradientAccumulator, LossScaler, Optimizer};
use ndscope::{
    DType, Device, Error, Gradients, Result, Scope, Tape, Tensor, Var, checkpoint, root,
};

type Case = fn(&ProcessGroup) -> Result<()>;

fn main() {
    let group = ProcessGroup::mpi().expect("MPI starts");
    if let Ok(fault) = std::env::var("NDSCOPE_DIST_FAULT") {
        // Not a case: a job that must end (non-zero, naming the rank) rather than hang. .ci/mpi
        // checks the exit status and the message.
        vanishing_peer(&group, &fault);
        return;
    }
    // A failing case is reported once per rank below; the default hook's backtrace is noise here.
    panic::set_hook(Box::new(|info| eprintln!("panic: {info}")));
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let cases: &[(&str, Case)] = &[
        (
            "all_reduce_sums_averages_and_extremes_every_rank",
            all_reduce_reference,
        ),
        ("sixteen_bit_sums_match_the_widened_sum", sixteen_bit_sums),
        (
            "broadcast_and_all_gather_move_every_rank_s_tensor",
            broadcast_and_gather,
        ),
        (
            "collectives_in_flight_complete_in_any_order",
            in_flight_any_order,
        ),
        (
            "averaged_gradients_equal_the_full_batch_gradients",
            gradients_equal_full_batch,
        ),
        (
            "bucket_boundaries_inside_tensors_change_no_bit",
            buckets_change_no_bit,
        ),
        (
            "adamw_steps_leave_identical_parameters_on_every_rank",
            adamw_identical,
        ),
        (
            "accumulated_micro_batches_are_averaged_once",
            accumulation_averages_once,
        ),
        ("half_precision_gradients_average", half_gradients_average),
        (
            "an_overflow_on_one_rank_skips_the_step_on_all",
            overflow_skips_everywhere,
        ),
        (
            "an_error_on_one_rank_reaches_every_rank",
            error_reaches_every_rank,
        ),
        (
            "a_rank_whose_model_differs_is_named_on_every_rank",
            model_mismatch_named,
        ),
        (
            "a_rank_that_never_joins_is_a_timeout",
            never_joins_times_out,
        ),
        (
            "ranks_in_different_exchanges_name_each_other",
            different_exchanges_named,
        ),
        (
            "ranks_with_different_batch_sizes_are_refused",
            different_batch_sizes_refused,
        ),
        (
            "rank_zero_writes_the_checkpoint_every_rank_loads_it",
            checkpoint_on_root,
        ),
        (
            "a_llama_s_averaged_gradients_equal_its_full_batch_gradients",
            llama_equals_full_batch,
        ),
        #[cfg(feature = "cuda")]
        (
            "gpu_tensors_reduce_through_nccl_as_host_ones_through_mpi",
            gpu_like_host,
        ),
    ];
    let (rank, world) = (group.rank(), group.world_size());
    let mut failed = 0;
    for (name, case) in cases {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let outcome = match panic::catch_unwind(AssertUnwindSafe(|| case(&group))) {
            Ok(result) => result,
            Err(payload) => Err(Error::Distributed {
                op: "test case",
                reason: payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panicked".into()),
            }),
        };
        match group.agree("test case", outcome) {
            Ok(()) => println!("rank {rank}/{world}: {name} ... ok"),
            Err(e) => {
                failed += 1;
                println!("rank {rank}/{world}: {name} ... FAILED: {e}");
            }
        }
    }
    drop(group);
    if failed > 0 {
        std::process::exit(1);
    }
}

fn check(condition: bool, what: impl FnOnce() -> String) -> Result<()> {
    if condition {
        Ok(())
    } else {
        Err(Error::Distributed {
            op: "assertion",
            reason: what(),
        })
    }
}

/// `values[i] = f(rank, i)` on this rank, and the same for every rank.
fn rank_values(rank: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((rank * 7 + i * 3) % 11) as f64 * 0.25 - 1.0 + rank as f64 * 0.125)
        .collect()
}

fn all_reduce_reference(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let n = 37;
    root(Device::Cpu, |s| {
        for dtype in [DType::F32, DType::F64] {
            let mine = s.from_slice(&rank_values(rank, n), &[n])?.to_dtype(dtype)?;
            for reduce in [Reduce::Sum, Reduce::Mean, Reduce::Max, Reduce::Min] {
                let got = group.all_reduce(&mine, reduce)?.to_vec_f64()?;
                let every: Vec<Vec<f64>> = (0..world).map(|r| rank_values(r, n)).collect();
                for (i, g) in got.iter().enumerate() {
                    let column = every.iter().map(|v| v[i]);
                    let want = match reduce {
                        Reduce::Sum => column.sum::<f64>(),
                        Reduce::Mean => column.sum::<f64>() / world as f64,
                        Reduce::Max => column.fold(f64::MIN, f64::max),
                        Reduce::Min => column.fold(f64::MAX, f64::min),
                    };
                    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
                    check((g - want).abs() <= tol, || {
                        format!("{dtype:?} {reduce:?} element {i}: got {g}, want {want}")
                    })?;
                }
            }
        }
        // The in-place form, on a strided view.
        let mut t = s.from_slice(&rank_values(rank, 6), &[2, 3])?.t()?;
        group.all_reduce_(&mut t, Reduce::Sum)?;
        check(t.shape() == [3, 2], || format!("shape {:?}", t.shape()))?;
        let i64s = s.from_slice(&[rank as i64, 5 - rank as i64], &[2])?;
        let max = group.all_reduce(&i64s, Reduce::Max)?.to_vec::<i64>()?;
        check(max == vec![world as i64 - 1, 5], || format!("{max:?}"))?;
        // What the reductions refuse, before anything starts (so the ranks stay in step).
        let refused = group.all_reduce(&i64s, Reduce::Mean);
        check(
            matches!(refused, Err(Error::UnsupportedDType { .. })),
            || format!("{refused:?}"),
        )?;
        Ok(())
    })
}

fn sixteen_bit_sums(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let n = 64;
    root(Device::Cpu, |s| {
        for dtype in [DType::BF16, DType::F16] {
            let mine = s.from_slice(&rank_values(rank, n), &[n])?.to_dtype(dtype)?;
            let got = group.all_reduce(&mine, Reduce::Mean)?.to_vec_f64()?;
            for (i, g) in got.iter().enumerate() {
                let want = (0..world)
                    .map(|r| {
                        // Each rank's value as the 16-bit type holds it.
                        let v = rank_values(r, n)[i];
                        s.from_slice(&[v], &[1])?
                            .to_dtype(dtype)?
                            .to_vec_f64()
                            .map(|x| x[0])
                    })
                    .sum::<Result<f64>>()?
                    / world as f64;
                let tol = if dtype == DType::BF16 { 2e-2 } else { 2e-3 };
                check((g - want).abs() <= tol * want.abs().max(1.0), || {
                    format!("{dtype:?} element {i}: got {g}, want {want}")
                })?;
            }
            let refused = group.all_reduce(&mine, Reduce::Max);
            check(
                matches!(refused, Err(Error::UnsupportedDType { .. })),
                || format!("{refused:?}"),
            )?;
        }
        Ok(())
    })
}

fn broadcast_and_gather(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    root(Device::Cpu, |s| {
        let from = world - 1;
        let mut t = s.from_slice(&rank_values(rank, 5), &[5])?;
        group.broadcast_(&mut t, from)?;
        check(t.to_vec_f64()? == rank_values(from, 5), || {
            "broadcast".into()
        })?;
        let bad = group.broadcast_(&mut t, world);
        check(matches!(bad, Err(Error::Distributed { .. })), || {
            format!("{bad:?}")
        })?;
        let mine = s
            .from_slice(&rank_values(rank, 4), &[2, 2])?
            .to_dtype(DType::BF16)?;
        let all = group.all_gather(&mine)?;
        check(all.shape() == [world, 2, 2], || {
            format!("{:?}", all.shape())
        })?;
        for r in 0..world {
            let want = s
                .from_slice(&rank_values(r, 4), &[2, 2])?
                .to_dtype(DType::BF16)?;
            let got = all.narrow(0, r, 1)?;
            check(got.to_vec_f64()? == want.to_vec_f64()?, || {
                format!("rank {r}'s slice")
            })?;
        }
        Ok(())
    })
}

fn in_flight_any_order(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    root(Device::Cpu, |s| {
        let mut a = s.from_slice(&rank_values(rank, 1000), &[1000])?;
        let mut b = s.full(&[3], rank as f64 + 1.0)?;
        let c = s.full(&[2], rank as f64)?;
        let mut gathered = None;
        group.in_flight(|flight| {
            let first = flight.all_reduce(&mut a, Reduce::Sum)?;
            let second = flight.all_reduce(&mut b, Reduce::Mean)?;
            let third = flight.all_gather(&c)?;
            second.wait()?; // out of order
            gathered = Some(third.wait()?);
            flight.progress();
            let _ = first; // never waited for: the flight completes it
            Ok(())
        })?;
        let triangle = (world * (world + 1)) as f32 / 2.0 / world as f32;
        check(b.to_vec::<f32>()? == vec![triangle; 3], || format!("{b}"))?;
        let want_a: Vec<f64> = (0..1000)
            .map(|i| (0..world).map(|r| rank_values(r, 1000)[i]).sum())
            .collect();
        let got_a = a.to_vec_f64()?;
        check(
            got_a.iter().zip(&want_a).all(|(g, w)| (g - w).abs() < 1e-4),
            || "the first all-reduce".into(),
        )?;
        let gathered = gathered.expect("waited");
        check(gathered.shape() == [world, 2], || format!("{gathered}"))?;
        Ok(())
    })
}

// ---- data parallelism ----------------------------------------------------------------------

const FEATURES: usize = 5;
const CLASSES: usize = 3;
const HIDDEN: usize = 7;

/// Ten examples (three ranks pad them to twelve).
fn dataset() -> Dataset {
    let rows = 10;
    let features = (0..rows * FEATURES)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let labels = (0..rows).map(|i| (i * 5 % CLASSES) as i64).collect();
    Dataset::new(features, labels, FEATURES, CLASSES).expect("a valid dataset")
}

/// A two-layer net in f64: `[w1, b1, w2]`, initialised from `seed`.
fn model<'m>(m: &Scope<'m>, seed: u64, dtype: DType) -> Result<Vec<Tensor<'m>>> {
    m.set_seed(seed);
    Ok(vec![
        m.randn(&[FEATURES, HIDDEN])?
            .mul_scalar(0.5)?
            .to_dtype(dtype)?,
        m.randn(&[HIDDEN])?.mul_scalar(0.1)?.to_dtype(dtype)?,
        m.randn(&[HIDDEN, CLASSES])?
            .mul_scalar(0.5)?
            .to_dtype(dtype)?,
    ])
}

fn loss<'t, 's>(
    tape: &'t Tape<'s>,
    params: &[Tensor<'s>],
    x: &Tensor<'s>,
    labels: &Tensor<'s>,
) -> Result<Var<'t, 's>> {
    let dtype = params[0].dtype();
    let x = tape.constant(&x.to_dtype(dtype)?);
    let w1 = tape.param(&params[0]);
    let b1 = tape.param(&params[1]);
    let w2 = tape.param(&params[2]);
    x.matmul(&w1)?
        .add(&b1)?
        .tanh()?
        .matmul(&w2)?
        .cross_entropy(labels)
}

/// This rank's examples (features, labels) of epoch 0, batch `b`, under `world` ranks.
fn shard_batch(
    data: &Dataset,
    rank: usize,
    world: usize,
    batch: usize,
) -> Result<(Vec<f32>, Vec<i64>)> {
    let loader = Loader::new(data, 2)?.shuffle(3).shard(rank, world)?;
    let mut out = None;
    let mut i = 0;
    loader.for_each_batch(0, false, |b| {
        if i == batch {
            out = Some((b.features().to_vec(), b.labels().to_vec()));
        }
        i += 1;
        Ok(())
    })?;
    Ok(out.expect("the batch exists"))
}

/// Every rank's batch `b`, concatenated in rank order: what one process trains on.
fn whole_batch(data: &Dataset, world: usize, batch: usize) -> Result<(Vec<f32>, Vec<i64>)> {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in 0..world {
        let (xr, yr) = shard_batch(data, r, world, batch)?;
        x.extend(xr);
        y.extend(yr);
    }
    Ok((x, y))
}

fn grads_of(grads: &Gradients<'_>, params: &[Tensor<'_>]) -> Result<Vec<Vec<f64>>> {
    params
        .iter()
        .map(|p| grads.get(p).expect("a gradient").to_vec_f64())
        .collect()
}

fn gradients_equal_full_batch(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    root(Device::Cpu, |m| {
        let mut params = model(m, 11 + rank as u64, DType::F64)?; // rank 0's values win
        let ddp = DataParallel::new(group, &mut params)?;
        let (x, y) = shard_batch(&data, rank, world, 0)?;
        let got = m.scope(|b| {
            let tape = Tape::new(b);
            let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
            let labels = b.from_slice(&y, &[y.len()])?;
            let grads = ddp.backward(&params, &tape, y.len(), || {
                loss(&tape, &params, &xs, &labels)
            })?;
            grads_of(&grads, &params)
        })?;
        let (x, y) = whole_batch(&data, world, 0)?;
        let want = m.scope(|b| {
            let tape = Tape::new(b);
            let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
            let labels = b.from_slice(&y, &[y.len()])?;
            let grads = tape.backward(&loss(&tape, &params, &xs, &labels)?)?;
            grads_of(&grads, &params)
        })?;
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            check((g - w).abs() <= 1e-12, || {
                format!("averaged {g}, full batch {w}")
            })?;
        }
        check(ddp.last_sync().buckets == 1, || {
            format!("{:?}", ddp.last_sync())
        })?;
        Ok(())
    })
}

/// Averaged gradients with the given bucket size.
fn averaged_bits(group: &ProcessGroup, bucket_bytes: usize) -> Result<(Vec<u64>, usize)> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    root(Device::Cpu, |m| {
        let mut params = model(m, 5, DType::F64)?;
        let ddp = DataParallel::new(group, &mut params)?.with_bucket_bytes(bucket_bytes)?;
        let (x, y) = shard_batch(&data, rank, world, 1)?;
        let bits = m.scope(|b| {
            let tape = Tape::new(b);
            let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
            let labels = b.from_slice(&y, &[y.len()])?;
            let grads = ddp.backward(&params, &tape, y.len(), || {
                loss(&tape, &params, &xs, &labels)
            })?;
            Ok::<_, Error>(
                grads_of(&grads, &params)?
                    .into_iter()
                    .flatten()
                    .map(f64::to_bits)
                    .collect(),
            )
        })?;
        Ok((bits, ddp.last_sync().buckets))
    })
}

/// Token sequence `i` of the Llama case: 12 ids below the tiny model's vocabulary.
fn llama_sequence(i: usize) -> Vec<i64> {
    (0..12)
        .map(|t| ((i * 131 + t * 37 + 5) % 500) as i64)
        .collect()
}

/// Every gradient of a Llama's next-token loss on `sequences`, in parameter order.
fn llama_gradients<'m>(
    m: &Scope<'m>,
    model: &Llama<'m>,
    sequences: &[Vec<i64>],
    ddp: Option<&DataParallel<'_>>,
) -> Result<Vec<Vec<f64>>> {
    m.scope(|b| {
        let flat: Vec<i64> = sequences.concat();
        let ids = b.from_slice(&flat, &[sequences.len(), flat.len() / sequences.len()])?;
        let tape = Tape::new(b);
        let forward = || Llama::loss(&model.forward(&tape, &ids, Mode::Train)?, &ids);
        let grads = match ddp {
            Some(ddp) => ddp.backward(model, &tape, sequences.len(), forward)?,
            None => tape.backward(&forward()?)?,
        };
        let mut out = Vec::new();
        model.visit("", &mut |_, p| {
            out.push(grads.get(p).expect("a gradient").to_vec_f64().unwrap());
        });
        Ok(out)
    })
}

/// A pretrained transformer (llama-tiny, recomputing its blocks) trained data-parallel: one
/// sequence per rank, averaged, equals one process on every rank's sequence.
fn llama_equals_full_batch(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/data/llama-tiny");
    root(Device::Cpu, |m| {
        let mut model = Llama::from_pretrained(m, dir, DType::F64)?;
        model.set_recompute(true);
        let ddp = DataParallel::new(group, &mut model)?;
        let got = llama_gradients(m, &model, &[llama_sequence(rank)], Some(&ddp))?;
        let all: Vec<Vec<i64>> = (0..world).map(llama_sequence).collect();
        let want = llama_gradients(m, &model, &all, None)?;
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            check((g - w).abs() <= 1e-12 * (1.0 + w.abs()), || {
                format!("averaged {g}, full batch {w}")
            })?;
        }
        Ok(())
    })
}

fn buckets_change_no_bit(group: &ProcessGroup) -> Result<()> {
    let (whole, one) = averaged_bits(group, 1 << 20)?;
    // 24 bytes: three f64s, so w1's 35 elements span twelve buckets and b1 starts inside one.
    let (cut, many) = averaged_bits(group, 24)?;
    check(one == 1, || format!("{one} buckets"))?;
    let elements = FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES;
    check(many == elements.div_ceil(3), || format!("{many} buckets"))?;
    check(whole == cut, || {
        "the bucket size changed the average".into()
    })
}

fn adamw_identical(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    let steps = 3;
    root(Device::Cpu, |m| {
        let mut params = model(m, 100 + rank as u64, DType::F64)?;
        let ddp = DataParallel::new(group, &mut params)?;
        let mut reference: Vec<Tensor<'_>> = params
            .iter()
            .map(|p| p.contiguous().and_then(|c| c.mul_scalar(1.0)))
            .collect::<Result<_>>()?;
        let config = AdamConfig::adamw(0.05, 0.01);
        let mut opt = Adam::new(m, &params, config)?;
        let mut single = Adam::new(m, &reference, config)?;
        for step in 0..steps {
            let (x, y) = shard_batch(&data, rank, world, step % 2)?;
            m.scope(|b| {
                let tape = Tape::new(b);
                let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
                let labels = b.from_slice(&y, &[y.len()])?;
                let grads = ddp.backward(&params, &tape, y.len(), || {
                    loss(&tape, &params, &xs, &labels)
                })?;
                opt.step(&mut params, &grads)
            })?;
            let (x, y) = whole_batch(&data, world, step % 2)?;
            m.scope(|b| {
                let tape = Tape::new(b);
                let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
                let labels = b.from_slice(&y, &[y.len()])?;
                let grads = tape.backward(&loss(&tape, &reference, &xs, &labels)?)?;
                single.step(&mut reference, &grads)
            })?;
        }
        for (p, r) in params.iter().zip(&reference) {
            let all = group.all_gather(p)?;
            for other in 0..world {
                let theirs = all.narrow(0, other, 1)?.to_vec::<f64>()?;
                let mine = p.to_vec::<f64>()?;
                check(
                    theirs
                        .iter()
                        .zip(&mine)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    || format!("rank {other}'s parameters differ from rank {rank}'s"),
                )?;
            }
            for (a, b) in p.to_vec::<f64>()?.iter().zip(r.to_vec::<f64>()?) {
                check((a - b).abs() <= 1e-12, || format!("{a} vs one process {b}"))?;
            }
        }
        Ok(())
    })
}

fn accumulation_averages_once(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    root(Device::Cpu, |m| {
        let mut params = model(m, 9, DType::F64)?;
        let ddp = DataParallel::new(group, &mut params)?;
        let mut sums = GradientAccumulator::new(m, &params)?;
        for micro in 0..2 {
            let (x, y) = shard_batch(&data, rank, world, micro)?;
            m.scope(|b| {
                let tape = Tape::new(b);
                let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
                let labels = b.from_slice(&y, &[y.len()])?;
                sums.add(&tape.backward(&loss(&tape, &params, &xs, &labels)?)?) // no all-reduce
            })?;
        }
        let waited = group.waited_seconds();
        ddp.average(&params, sums.sums_mut())?; // one all-reduce for both micro-batches
        check(group.waited_seconds() >= waited, || {
            "time went backwards".into()
        })?;
        let got = grads_of(sums.sums(), &params)?;
        let mut want = vec![Vec::new(); 3];
        for micro in 0..2 {
            let (x, y) = whole_batch(&data, world, micro)?;
            let g = m.scope(|b| {
                let tape = Tape::new(b);
                let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
                let labels = b.from_slice(&y, &[y.len()])?;
                grads_of(
                    &tape.backward(&loss(&tape, &params, &xs, &labels)?)?,
                    &params,
                )
            })?;
            for (w, g) in want.iter_mut().zip(g) {
                if w.is_empty() {
                    *w = g;
                } else {
                    w.iter_mut().zip(g).for_each(|(a, b)| *a += b);
                }
            }
        }
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            check((g - w).abs() <= 1e-12, || {
                format!("accumulated {g}, full {w}")
            })?;
        }
        Ok(())
    })
}

fn half_gradients_average(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    root(Device::Cpu, |m| {
        for dtype in [DType::BF16, DType::F16] {
            let mut params = model(m, 21, dtype)?;
            let ddp = DataParallel::new(group, &mut params)?;
            let (x, y) = shard_batch(&data, rank, world, 0)?;
            let (got, local) = m.scope(|b| {
                let tape = Tape::new(b);
                let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
                let labels = b.from_slice(&y, &[y.len()])?;
                let grads = tape.backward(&loss(&tape, &params, &xs, &labels)?)?;
                let local = grads_of(&grads, &params)?;
                let mut grads = grads;
                ddp.average(&params, &mut grads)?;
                Ok::<_, Error>((grads_of(&grads, &params)?, local))
            })?;
            // The reference: every rank's 16-bit gradient, averaged in f64.
            let every = m.scope(|b| {
                let flat: Vec<f64> = local.iter().flatten().copied().collect();
                let t = b.from_slice(&flat, &[flat.len()])?;
                group.all_gather(&t)?.to_vec_f64()
            })?;
            let n = every.len() / world;
            for (i, g) in got.iter().flatten().enumerate() {
                let want = (0..world).map(|r| every[r * n + i]).sum::<f64>() / world as f64;
                check((g - want).abs() <= 2e-2 * want.abs().max(0.05), || {
                    format!("{dtype:?} element {i}: averaged {g}, want {want}")
                })?;
            }
        }
        Ok(())
    })
}

fn overflow_skips_everywhere(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    root(Device::Cpu, |m| {
        let mut params = model(m, 4, DType::F32)?;
        let ddp = DataParallel::new(group, &mut params)?;
        let before: Vec<Vec<f64>> = params
            .iter()
            .map(|p| p.to_vec_f64())
            .collect::<Result<_>>()?;
        let mut opt = Adam::new(m, &params, AdamConfig::adamw(0.1, 0.0))?;
        let mut scaler = LossScaler::new();
        let (x, y) = shard_batch(&data, rank, world, 0)?;
        let stepped = m.scope(|b| {
            let tape = Tape::new(b);
            // Only the last rank's examples overflow.
            let scale = if rank == world - 1 {
                f32::INFINITY
            } else {
                1.0
            };
            let x: Vec<f32> = x.iter().map(|v| v * scale).collect();
            let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
            let labels = b.from_slice(&y, &[y.len()])?;
            let mut grads = ddp.backward(&params, &tape, y.len(), || {
                scaler.scale_loss(&loss(&tape, &params, &xs, &labels)?)
            })?;
            scaler.step(&mut opt, &mut params, &mut grads)
        })?;
        check(!stepped, || format!("rank {rank} stepped"))?;
        check(scaler.skipped_steps() == 1, || "no skip counted".into())?;
        let after: Vec<Vec<f64>> = params
            .iter()
            .map(|p| p.to_vec_f64())
            .collect::<Result<_>>()?;
        check(before == after, || "the parameters moved".into())
    })
}

fn error_reaches_every_rank(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    let failing = world - 1;
    root(Device::Cpu, |m| {
        let mut params = model(m, 8, DType::F64)?;
        let ddp = DataParallel::new(group, &mut params)?;
        let (x, y) = shard_batch(&data, rank, world, 0)?;
        let outcome = m.scope(|b| {
            let tape = Tape::new(b);
            let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
            // The failing rank's labels do not match its batch: bad input on one rank.
            let n = if rank == failing {
                y.len() - 1
            } else {
                y.len()
            };
            let labels = b.from_slice(&y[..n], &[n])?;
            ddp.backward(&params, &tape, y.len(), || {
                loss(&tape, &params, &xs, &labels)
            })
            .map(drop)
        });
        match outcome {
            Err(Error::PeerFailed {
                rank: r, message, ..
            }) if rank != failing => {
                check(r == failing, || format!("named rank {r}"))?;
                check(
                    message.contains("cross_entropy") || message.contains("shape"),
                    || format!("the message: {message}"),
                )
            }
            Err(Error::PeerFailed { .. }) => Err(Error::Distributed {
                op: "assertion",
                reason: "the failing rank got PeerFailed instead of its own error".into(),
            }),
            Err(_) if rank == failing => Ok(()),
            other => Err(Error::Distributed {
                op: "assertion",
                reason: format!("rank {rank} got {other:?}"),
            }),
        }?;
        // The ranks are still in step: the next collective works.
        let ones = m.full(&[2], 1.0)?;
        let sum = group.all_reduce(&ones, Reduce::Sum)?.to_vec::<f32>()?;
        check(sum == vec![world as f32; 2], || format!("{sum:?}"))
    })
}

fn model_mismatch_named(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    if world == 1 {
        return Ok(()); // one rank cannot differ from itself
    }
    let differing = world - 1;
    root(Device::Cpu, |m| {
        let mut params = model(m, 1, DType::F64)?;
        if rank == differing {
            params[1] = m.full_dtype(&[HIDDEN + 1], 0.0, DType::F64)?;
        }
        match DataParallel::new(group, &mut params) {
            Err(Error::ParameterMismatch {
                rank: r,
                difference,
            }) => {
                check(r == differing, || format!("named rank {r}"))?;
                check(difference.contains("parameter 1"), || difference.clone())?;
                check(
                    difference.contains("[8]") && difference.contains("[7]"),
                    || difference,
                )
            }
            other => Err(Error::Distributed {
                op: "assertion",
                reason: format!("rank {rank} got {other:?}"),
            }),
        }
    })
}

fn never_joins_times_out(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    if world == 1 {
        return Ok(()); // nobody to wait for
    }
    let timeout = Duration::from_millis(300);
    let before = group.timeout();
    group.set_timeout(timeout);
    let outcome = if rank == 0 {
        match group.agree("step", Ok(())) {
            Err(Error::CollectiveTimeout {
                rank: 0, seconds, ..
            }) => check(seconds == timeout.as_secs_f64(), || format!("{seconds} s")),
            other => Err(Error::Distributed {
                op: "assertion",
                reason: format!("rank 0 got {other:?} instead of a timeout"),
            }),
        }
    } else {
        // Late: after rank 0 gave up. Joining completes the exchange rank 0 left behind, and the
        // deadline rank 0 sent in it tells this rank that rank 0 has stopped waiting.
        std::thread::sleep(timeout * 4);
        match group.agree("step", Ok(())) {
            Err(Error::PeerFailed {
                rank: 0, message, ..
            }) => check(message.contains("its timeout passed"), || {
                format!("the late rank was told {message:?}")
            }),
            other => Err(Error::Distributed {
                op: "assertion",
                reason: format!("the late rank got {other:?} instead of rank 0's timeout"),
            }),
        }
    };
    group.set_timeout(before);
    outcome
}

/// Rank 0 in a barrier while the others agree on a step: on the wire both are one small
/// all-reduce, and before the tags a barrier returned `Ok` against a step's agreement. Now every
/// rank gets `CollectiveMismatch` naming what the other side was doing; the next exchange works.
fn different_exchanges_named(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    if world == 1 {
        return Ok(()); // nobody to disagree with
    }
    let outcome = if rank == 0 {
        group.barrier()
    } else {
        group.agree("step", Ok(()))
    };
    let (mine, theirs, peer) = if rank == 0 {
        ("barrier", "step", 1)
    } else {
        ("step", "barrier", 0)
    };
    match outcome {
        Err(Error::CollectiveMismatch {
            op,
            rank: r,
            peer: p,
            peer_op,
            exchange,
            peer_exchange,
        }) => check(
            op == mine && r == rank && p == peer && peer_op == theirs && exchange == peer_exchange,
            || {
                format!(
                    "rank {rank}: {op} #{exchange} against rank {p}'s {peer_op} #{peer_exchange}"
                )
            },
        )?,
        other => {
            return Err(Error::Distributed {
                op: "assertion",
                reason: format!("rank {rank} got {other:?} instead of a mismatch"),
            });
        }
    }
    group.barrier()
}

/// Every rank's slice a different size: the averaged gradients would weight them unequally, so
/// `DataParallel::backward` refuses on every rank, listing each rank's count; equal sizes pass.
fn different_batch_sizes_refused(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let data = dataset();
    root(Device::Cpu, |m| {
        let mut params = model(m, 8, DType::F64)?;
        let ddp = DataParallel::new(group, &mut params)?;
        let (x, y) = shard_batch(&data, rank, world, 0)?;
        let n = y.len() - rank.min(1); // rank 0 has one example more than the others
        let outcome = m.scope(|b| {
            let tape = Tape::new(b);
            let xs = b.from_slice(&x[..n * FEATURES], &[n, FEATURES])?;
            let labels = b.from_slice(&y[..n], &[n])?;
            ddp.backward(&params, &tape, n, || loss(&tape, &params, &xs, &labels))
                .map(drop)
        });
        if world == 1 {
            return outcome;
        }
        match outcome {
            Err(Error::Distributed { reason, .. }) => check(
                reason.contains(&format!(
                    "rank 0: {}, rank 1: {}",
                    n + rank.min(1),
                    y.len() - 1
                )),
                || format!("rank {rank} was told {reason:?}"),
            ),
            other => Err(Error::Distributed {
                op: "assertion",
                reason: format!("rank {rank} got {other:?} instead of the batch sizes"),
            }),
        }
    })
}

fn checkpoint_on_root(group: &ProcessGroup) -> Result<()> {
    let rank = group.rank();
    let dir = std::env::temp_dir();
    let mine = dir
        .join(format!(
            "ndscope-distributed-{}.safetensors",
            std::process::id()
        ))
        .display()
        .to_string();
    let path = group.broadcast_string(&mine, 0)?;
    root(Device::Cpu, |m| {
        let mut params = model(m, 30 + rank as u64, DType::F32)?;
        let _ = DataParallel::new(group, &mut params)?;
        group.save_checkpoint(&params, &path)?;
        let mut loaded = model(m, 99, DType::F32)?;
        checkpoint::load(&mut loaded, &path)?;
        for (a, b) in params.iter().zip(&loaded) {
            check(a.to_vec::<f32>()? == b.to_vec::<f32>()?, || {
                "loaded differs".into()
            })?;
        }
        group.barrier()?;
        if group.is_root() {
            std::fs::remove_file(&path).map_err(|e| Error::Io {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        }
        // A write that fails on rank 0 fails on every rank.
        let bad = group.save_checkpoint(&params, "/nonexistent-dir/x.safetensors");
        match (rank, bad) {
            (0, Err(Error::Io { .. })) => Ok(()),
            (r, Err(Error::PeerFailed { rank: 0, .. })) if r != 0 => Ok(()),
            (_, other) => Err(Error::Distributed {
                op: "assertion",
                reason: format!("rank {rank}: {other:?}"),
            }),
        }
    })
}

/// Rank 0 all-reduces a tensor (blocking, or on a flight) with a one-second timeout while the other
/// ranks never join: the process group must end the job with a message naming rank 0 and the
/// collective, not hang. Returning from here is the failure.
fn vanishing_peer(group: &ProcessGroup, fault: &str) {
    group.set_timeout(Duration::from_secs(if fault == "exchange" { 8 } else { 1 }));
    if fault == "stopped" {
        // A rank that stops (SIGSTOP: a hung node, a debugger) while its peer is in a step's
        // agreement with an 8 s timeout: the peer prints the typed timeout and the job ends about
        // a second later, not after a second timeout.
        group.set_timeout(Duration::from_secs(8));
        if group.rank() != 0 {
            let me = std::process::id().to_string();
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &me])
                .status();
            return;
        }
        if let Err(e) = group.agree("step", Ok(())) {
            eprintln!("rank 0: {e}");
        }
        return;
    }
    if fault == "early" {
        // A rank that finishes (drops its group) while its peer goes on to a step, 60 s timeout:
        // both learn it at once from the tags, and the job ends.
        group.set_timeout(Duration::from_secs(60));
        if group.rank() == 0
            && let Err(e) = group.agree("step", Ok(()))
        {
            eprintln!("rank 0: {e}");
        }
        return;
    }
    if group.rank() != 0 {
        if fault == "panic" {
            group.set_timeout(Duration::from_secs(60));
            let _ = group.barrier(); // waits for rank 0, which panics
        }
        std::thread::sleep(Duration::from_secs(60)); // never joins; mpirun ends it
        return;
    }
    if fault == "panic" {
        // A rank that panics while its peer waits in a barrier with a long timeout: the job must
        // end at once, not after the peer's timeout.
        group.set_timeout(Duration::from_secs(60));
        panic!("rank 0 fails on purpose");
    }
    if fault == "exchange" {
        // A library-owned exchange: a typed timeout, which the program returns (as the examples
        // do with `?`) without printing it; dropping the group must then end the job within a
        // second, printing that timeout, instead of waiting a second timeout.
        let outcome = group.barrier();
        assert!(
            matches!(outcome, Err(ndscope::Error::CollectiveTimeout { .. })),
            "{outcome:?}"
        );
        return;
    }
    let outcome = root(Device::Cpu, |s| {
        let mut t = s.ones(&[1024])?;
        match fault {
            "blocking" => group.all_reduce_(&mut t, Reduce::Sum),
            _ => group.in_flight(|flight| flight.all_reduce(&mut t, Reduce::Sum).map(drop)),
        }
    });
    println!("rank 0: the all-reduce returned ({outcome:?}) although no peer joined it");
}

/// Every GPU collective against the same collective of host tensors, and a data-parallel step on
/// GPU parameters against the same step on the host (needs a GPU per rank and NCCL; skipped, saying
/// why, without them).
#[cfg(feature = "cuda")]
fn gpu_like_host(group: &ProcessGroup) -> Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let device = Device::Cuda(group.local_rank());
    if let Err(e) = device.check_available() {
        println!("rank {rank}: GPU collectives skipped: {e}");
        return Ok(());
    }
    let close = |a: &[f64], b: &[f64], tol: f64, what: &str| {
        check(
            a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= tol * y.abs().max(1.0)),
            || format!("{what}: GPU {a:?} vs host {b:?}"),
        )
    };
    root(Device::Cpu, |host| {
        root(device, |gpu| {
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let mine = host
                    .from_slice(&rank_values(rank, 33), &[33])?
                    .to_dtype(dtype)?;
                let on_gpu = mine.to_device(gpu.device())?;
                let tol = if dtype.is_half() { 1e-2 } else { 1e-6 };
                for reduce in [Reduce::Sum, Reduce::Mean] {
                    let want = group.all_reduce(&mine, reduce)?.to_vec_f64()?;
                    let got = group.all_reduce(&on_gpu, reduce)?.to_vec_f64()?;
                    close(&got, &want, tol, &format!("{dtype:?} {reduce:?}"))?;
                }
            }
            let mut t = gpu.from_slice(&rank_values(rank, 5), &[5])?;
            group.broadcast_(&mut t, world - 1)?;
            close(
                &t.to_vec_f64()?,
                &rank_values(world - 1, 5),
                0.0,
                "broadcast",
            )?;
            let mine = gpu.from_slice(&rank_values(rank, 4), &[4])?;
            let all = group.all_gather(&mine)?.to_vec_f64()?;
            let want: Vec<f64> = (0..world).flat_map(|r| rank_values(r, 4)).collect();
            close(&all, &want, 0.0, "all_gather")?;
            let mut a = gpu.ones(&[8])?;
            group.in_flight(|flight| flight.all_reduce(&mut a, Reduce::Sum).map(drop))?;
            close(&a.to_vec_f64()?, &[world as f64; 8], 0.0, "in flight")?;
            // One data-parallel step, on the GPU and on the host.
            let data = dataset();
            let (x, y) = shard_batch(&data, rank, world, 0)?;
            let step = |s: &Scope<'_>| -> Result<Vec<Vec<f64>>> {
                // The same values in `s`, whichever device it is on.
                let mut params = model(host, 13, DType::F64)?
                    .iter()
                    .map(|p| s.from_slice(&p.to_vec::<f64>()?, p.shape()))
                    .collect::<Result<Vec<_>>>()?;
                let ddp = DataParallel::new(group, &mut params)?;
                s.scope(|b| {
                    let tape = Tape::new(b);
                    let xs = b.from_slice(&x, &[y.len(), FEATURES])?;
                    let labels = b.from_slice(&y, &[y.len()])?;
                    let grads = ddp.backward(&params, &tape, y.len(), || {
                        loss(&tape, &params, &xs, &labels)
                    })?;
                    grads_of(&grads, &params)
                })
            };
            let (on_gpu, on_host) = (step(gpu)?, step(host)?);
            close(
                &on_gpu.concat(),
                &on_host.concat(),
                1e-10,
                "data-parallel gradients",
            )
        })
    })
}
