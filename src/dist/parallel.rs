//! Data parallelism: every rank holds the whole model, trains on its slice of each batch, and
//! averages gradients with the others before the optimizer steps, so every rank takes the same step.

use std::cell::Cell;
use std::time::Instant;

use super::{ProcessGroup, Reduce};
use crate::autograd::{Gradients, Tape, Var};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::tensor::Tensor;

/// Averages gradients across the ranks of a [`ProcessGroup`], in buckets, so that N ranks on batch
/// slices take the step one process would take on the whole batch.
///
/// - [`new`](Self::new) checks that every rank built the same model (names, shapes, dtypes; a rank
///   that differs gets [`Error::ParameterMismatch`] naming the first difference, on every rank) and
///   copies rank 0's parameters to every rank.
/// - [`backward`](Self::backward) runs the backward pass, agrees with the other ranks that every
///   one of them got this far ([`ProcessGroup::agree`]: an error on one rank reaches all), then
///   [`average`](Self::average)s the gradients.
/// - [`average`](Self::average) flattens host gradients into buckets of at most
///   [`bucket_bytes`](Self::bucket_bytes) (25 MiB unless set, as PyTorch's DDP; a bucket boundary
///   may fall inside a tensor), in the gradients' scope, and all-reduces them one after the other
///   right after the backward pass (the tape has no per-bucket hooks). GPU gradients are not
///   bucketed: each is all-reduced by NCCL on the GPU's stream, and
///   [`last_sync`](Self::last_sync)`().buckets` counts those all-reduces. The averaged gradients are the
///   same bits on every rank, so an optimizer (and a [`LossScaler`](crate::optim::LossScaler)'s
///   skip decision) takes the same step everywhere.
/// - Gradient accumulation: accumulate micro-batches locally, then average the sums once
///   ([`GradientAccumulator::sums_mut`](crate::optim::GradientAccumulator::sums_mut)): the
///   micro-batches before the last need no communication (PyTorch's `no_sync`).
///
/// ```
/// use ndscope::dist::{DataParallel, ProcessGroup};
/// use ndscope::nn::{self, Activation, Init, Mode, Module};
/// use ndscope::optim::{Adam, AdamConfig, Optimizer};
/// use ndscope::{Device, Tape, root};
///
/// let group = ProcessGroup::single(); // ProcessGroup::mpi()? under mpirun
/// root(Device::Cpu, |m| {
///     let mut model = nn::mlp(m, &[2, 8, 2], Activation::Tanh, Init::XavierUniform)?;
///     let ddp = DataParallel::new(&group, &mut model)?; // same model everywhere, rank 0's values
///     let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-4))?;
///     m.scope(|batch| {
///         let tape = Tape::new(batch);
///         let x = tape.constant(&batch.randn(&[4, 2])?); // this rank's slice of the batch
///         let labels = batch.from_slice(&[0i64, 1, 1, 0], &[4])?;
///         // The forward pass runs inside, so an error there reaches every rank.
///         let grads = ddp.backward(&model, &tape, 4, || {
///             model.forward(&x, Mode::Train)?.cross_entropy(&labels)
///         })?; // averaged over the ranks
///         opt.step(&mut model, &grads)
///     })?;
///     assert_eq!(ddp.last_sync().buckets, 1);
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug)]
pub struct DataParallel<'g> {
    group: &'g ProcessGroup,
    bucket_bytes: usize,
    last: Cell<SyncReport>,
}

/// What the last [`DataParallel::average`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncReport {
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Gradient bytes all-reduced (per rank).
    pub bytes: usize,
    /// Seconds the averaging took: flattening, the all-reduces, copying back.
    pub seconds: f64,
    /// Of those, seconds spent waiting for the all-reduces to complete.
    pub waited_seconds: f64,
}

/// The bucket size a new [`DataParallel`] starts with: PyTorch DDP's default.
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// A run of one gradient's elements in a bucket.
#[derive(Debug, Clone, Copy)]
struct Piece {
    /// Which gradient (index into the gradients in parameter order).
    grad: usize,
    /// First element of the gradient in this piece.
    start: usize,
    /// Elements.
    len: usize,
}

/// Gradients of one dtype, flattened into one all-reduce.
#[derive(Debug)]
struct Bucket {
    dtype: DType,
    elements: usize,
    pieces: Vec<Piece>,
}

impl<'g> DataParallel<'g> {
    /// Checks that every rank's `params` have the same names, shapes and dtypes, then overwrites
    /// them with rank 0's values. Every rank must call it at the same point.
    ///
    /// # Errors
    /// [`Error::ParameterMismatch`] on every rank when a rank's parameters differ from rank 0's;
    /// [`Error::CollectiveTimeout`] when a rank never comes; transport errors.
    pub fn new<'m, P: Parameters<'m> + ?Sized>(
        group: &'g ProcessGroup,
        params: &mut P,
    ) -> Result<DataParallel<'g>> {
        let op = "DataParallel::new";
        let mine = signature(params);
        let theirs = group.broadcast_text(op, mine.join("\n"), 0)?;
        let theirs: Vec<&str> = theirs.split('\n').filter(|l| !l.is_empty()).collect();
        let difference = first_difference(&mine, &theirs);
        if let Some((rank, difference)) = group.first_failure(op, difference)? {
            return Err(Error::ParameterMismatch { rank, difference });
        }
        params.visit_mut(&mut |p| group.broadcast_(p, 0))?;
        Ok(DataParallel {
            group,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            last: Cell::new(SyncReport::default()),
        })
    }

    /// Sets the bucket size in bytes (every rank must use the same).
    ///
    /// # Errors
    /// [`Error::Distributed`] for 0.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Result<DataParallel<'g>> {
        if bytes == 0 {
            return Err(Error::Distributed {
                op: "DataParallel::with_bucket_bytes",
                reason: "a bucket must hold at least one byte; the default is 25 MiB".into(),
            });
        }
        self.bucket_bytes = bytes;
        Ok(self)
    }

    /// The bucket size in bytes.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// The process group.
    pub fn group(&self) -> &'g ProcessGroup {
        self.group
    }

    /// What the last [`average`](Self::average) did.
    pub fn last_sync(&self) -> SyncReport {
        self.last.get()
    }

    /// Runs `forward` (this rank's forward pass over its slice of the batch, `examples` of them,
    /// returning the loss) and the backward pass, and returns the gradients averaged over every
    /// rank. Before anything is averaged, every rank learns whether every rank's forward and
    /// backward pass succeeded, and whether every rank had the same number of examples: if not,
    /// each rank returns an error (its own, [`Error::PeerFailed`], or [`Error::Distributed`]
    /// listing each rank's examples) instead of waiting for the failed rank in the all-reduce or
    /// averaging unequal slices as equals. Taking the forward pass as a closure means its errors
    /// cannot bypass that agreement.
    ///
    /// # Errors
    /// This rank's error, [`Error::PeerFailed`], [`Error::CollectiveTimeout`],
    /// [`Error::CollectiveMismatch`]; [`Error::Distributed`] when the ranks' `examples` differ; as
    /// for [`average`](Self::average).
    pub fn backward<'m, 't, 's, P: Parameters<'m> + ?Sized>(
        &self,
        params: &P,
        tape: &'t Tape<'s>,
        examples: usize,
        forward: impl FnOnce() -> Result<Var<'t, 's>>,
    ) -> Result<Gradients<'s>> {
        let grads = forward().and_then(|loss| tape.backward(&loss));
        let mut grads =
            self.group
                .agree_counting("DataParallel::backward", grads, examples, "examples")?;
        self.average(params, &mut grads)?;
        Ok(grads)
    }

    /// Replaces every gradient in `grads` by its mean over the ranks (the same bits on every
    /// rank). `params` fixes the order (every rank's is the same, checked by [`new`](Self::new));
    /// a parameter without a gradient on every rank is left out, one with a gradient on some ranks
    /// only is an error on all of them.
    ///
    /// # Errors
    /// [`Error::Distributed`] when the ranks' gradients are not for the same parameters;
    /// [`Error::DeviceUnavailable`] for GPU gradients when the GPU or NCCL is missing;
    /// allocation errors.
    #[track_caller]
    pub fn average<'m, P: Parameters<'m> + ?Sized>(
        &self,
        params: &P,
        grads: &mut Gradients<'_>,
    ) -> Result<()> {
        let op = "DataParallel::average";
        let begin = Instant::now();
        let waited_before = self.group.waited_seconds();
        // One entry per parameter block, in visit order.
        let mut present: Vec<Tensor<'_>> = Vec::new();
        params.visit("", &mut |_, p| {
            if !present.iter().any(|q| q.block_id() == p.block_id()) {
                present.push(p.clone());
            }
        });
        let mut order: Vec<&Tensor<'_>> = Vec::new();
        let mut mask = Vec::with_capacity(present.len());
        for p in &present {
            // The block's gradient itself: `get` would copy a view's into block order to answer.
            let has = grads.block_gradient_mut(p).is_some();
            mask.push(has);
            if has {
                order.push(p);
            }
        }
        self.check_same_gradients(op, &mask)?;
        if order.first().is_some_and(|p| p.device() != Device::Cpu) {
            return self.average_on_gpu(&order, grads, begin, waited_before);
        }
        // Each gradient contiguous and in its block's own shape (the backward pass may leave one
        // strided).
        let mut flat_grads: Vec<Tensor<'_>> = Vec::with_capacity(order.len());
        for p in &order {
            let g = grads.block_gradient_mut(p).expect("present");
            if !g.is_contiguous() {
                *g = g.contiguous()?;
            }
            flat_grads.push(g.clone());
        }
        let buckets = plan_buckets(&flat_grads, self.bucket_bytes);
        let bytes = buckets.iter().map(|b| b.elements * b.dtype.size()).sum();
        if self.group.world_size() == 1 {
            // The mean over one rank is its own gradient: nothing to move.
            self.record(buckets.len(), bytes, begin, waited_before);
            return Ok(());
        }
        let location = std::panic::Location::caller();
        let mut flats = buckets
            .iter()
            .map(|b| {
                let like = &flat_grads[b.pieces[0].grad];
                Tensor::output_of(&[like], b.dtype, &[b.elements], location)
            })
            .collect::<Result<Vec<_>>>()?;
        // Blocking all-reduces, bucket after bucket: MPI moves a non-blocking collective on only
        // inside MPI calls, so on the host an all-reduce in flight overlaps little, and MPI's
        // blocking algorithms are up to 4x faster for mid-sized buckets (BENCHMARKS.md).
        for (bucket, flat) in buckets.iter().zip(flats.iter_mut()) {
            fill(op, bucket, &flat_grads, flat)?;
            self.group.all_reduce_(flat, Reduce::Mean)?;
        }
        drop(flat_grads);
        for (bucket, flat) in buckets.iter().zip(&flats) {
            let size = bucket.dtype.size();
            let src = flat.host_bytes(op)?;
            let mut at = 0;
            for piece in &bucket.pieces {
                let g = grads
                    .block_gradient_mut(order[piece.grad])
                    .expect("present");
                let dst = g.host_bytes_mut(op)?;
                let bytes = piece.len * size;
                dst[piece.start * size..piece.start * size + bytes]
                    .copy_from_slice(&src[at..at + bytes]);
                at += bytes;
            }
        }
        self.record(buckets.len(), bytes, begin, waited_before);
        Ok(())
    }

    /// Sets [`last_sync`](Self::last_sync) for an average that began at `begin`, when the group had
    /// waited `waited_before` seconds.
    fn record(&self, buckets: usize, bytes: usize, begin: Instant, waited_before: f64) {
        self.last.set(SyncReport {
            buckets,
            bytes,
            seconds: begin.elapsed().as_secs_f64(),
            waited_seconds: self.group.waited_seconds() - waited_before,
        });
    }

    /// GPU gradients: one NCCL all-reduce per gradient, enqueued on the GPU's stream (the buckets
    /// are the host path's: flattening them on a GPU is left for when it can be measured there).
    fn average_on_gpu(
        &self,
        order: &[&Tensor<'_>],
        grads: &mut Gradients<'_>,
        begin: Instant,
        waited_before: f64,
    ) -> Result<()> {
        let mut bytes = 0;
        for p in order {
            let g = grads.block_gradient_mut(p).expect("present");
            bytes += g.numel() * g.dtype().size();
            self.group.all_reduce_(g, Reduce::Mean)?;
        }
        self.record(order.len(), bytes, begin, waited_before);
        Ok(())
    }

    /// Refuses, on every rank, gradients that are not for the same parameters on every rank.
    fn check_same_gradients(&self, op: &'static str, mask: &[bool]) -> Result<()> {
        if self.group.world_size() == 1 {
            return Ok(());
        }
        // FNV-1a over which parameters have a gradient; the max of `h` and of `!h` over the ranks
        // agree with each other only when every rank has the same `h`.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &m in mask {
            h = (h ^ u64::from(m)).wrapping_mul(0x0100_0000_01b3);
        }
        let h = (h >> 1) as i64; // non-negative, so the max compares them as numbers
        let [high, high_not] = self.group.exchange_max(op, &mut [h, i64::MAX - h])?;
        if high == i64::MAX - high_not {
            return Ok(());
        }
        Err(Error::Distributed {
            op,
            reason: "the ranks' gradients are not for the same parameters: a parameter has a \
                     gradient on some ranks only (a branch of the model that only some ranks' \
                     batches use); make every rank's loss use the same parameters"
                .into(),
        })
    }
}

/// `name dtype [shape]` per parameter, in visit order.
fn signature<'m, P: Parameters<'m> + ?Sized>(params: &P) -> Vec<String> {
    let mut lines = Vec::new();
    params.visit("", &mut |name, p| {
        lines.push(format!("{name} {:?} {:?}", p.dtype(), p.shape()));
    });
    lines
}

/// How this rank's parameter list differs from rank 0's, first difference only.
fn first_difference(mine: &[String], root: &[&str]) -> Option<String> {
    for (i, (a, b)) in mine.iter().zip(root).enumerate() {
        if a != b {
            return Some(format!(
                "parameter {i} is `{a}` here and `{b}` on rank 0 (name, dtype, shape)"
            ));
        }
    }
    match mine.len().cmp(&root.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Less => Some(format!(
            "it has {} parameters and rank 0 has {}; the first it lacks is `{}`",
            mine.len(),
            root.len(),
            root[mine.len()]
        )),
        std::cmp::Ordering::Greater => Some(format!(
            "it has {} parameters and rank 0 has {}; the first rank 0 lacks is `{}`",
            mine.len(),
            root.len(),
            mine[root.len()]
        )),
    }
}

/// Cuts the gradients, in order, into buckets of one dtype and at most `bucket_bytes` (at least
/// one element); a boundary may fall inside a gradient.
fn plan_buckets(grads: &[Tensor<'_>], bucket_bytes: usize) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    for (index, g) in grads.iter().enumerate() {
        let (dtype, numel) = (g.dtype(), g.numel());
        let cap = (bucket_bytes / dtype.size()).max(1);
        let mut start = 0;
        while start < numel {
            let open = buckets
                .last_mut()
                .filter(|b| b.dtype == dtype && b.elements < cap);
            let bucket = match open {
                Some(b) => b,
                None => {
                    buckets.push(Bucket {
                        dtype,
                        elements: 0,
                        pieces: Vec::new(),
                    });
                    buckets.last_mut().expect("just pushed")
                }
            };
            let len = (numel - start).min(cap - bucket.elements);
            bucket.pieces.push(Piece {
                grad: index,
                start,
                len,
            });
            bucket.elements += len;
            start += len;
        }
    }
    buckets
}

/// Copies the bucket's pieces of `grads` into `flat`, in order.
fn fill(
    op: &'static str,
    bucket: &Bucket,
    grads: &[Tensor<'_>],
    flat: &mut Tensor<'_>,
) -> Result<()> {
    let size = bucket.dtype.size();
    let dst = flat.host_bytes_mut(op)?;
    let mut at = 0;
    for piece in &bucket.pieces {
        let src = grads[piece.grad].host_bytes(op)?;
        let bytes = piece.len * size;
        dst[at..at + bytes].copy_from_slice(&src[piece.start * size..piece.start * size + bytes]);
        at += bytes;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::scope::root;

    #[test]
    fn buckets_cut_inside_and_across_gradients_and_never_mix_dtypes() {
        root(Device::Cpu, |s| {
            let grads = vec![
                s.zeros(&[3])?,                       // 12 bytes
                s.zeros(&[5])?,                       // 20 bytes
                s.zeros(&[2])?.to_dtype(DType::F64)?, // 16 bytes
                s.zeros(&[1])?,                       // 4 bytes
            ];
            let buckets = plan_buckets(&grads, 16); // 4 f32s or 2 f64s per bucket
            type Cut = (DType, Vec<(usize, usize, usize)>);
            let shape: Vec<Cut> = buckets
                .iter()
                .map(|b| {
                    (
                        b.dtype,
                        b.pieces.iter().map(|p| (p.grad, p.start, p.len)).collect(),
                    )
                })
                .collect();
            assert_eq!(
                shape,
                vec![
                    (DType::F32, vec![(0, 0, 3), (1, 0, 1)]),
                    (DType::F32, vec![(1, 1, 4)]),
                    (DType::F64, vec![(2, 0, 2)]),
                    (DType::F32, vec![(3, 0, 1)]),
                ]
            );
            for b in &buckets {
                assert_eq!(b.elements, b.pieces.iter().map(|p| p.len).sum::<usize>());
                assert!(b.elements * b.dtype.size() <= 16);
            }
            Ok::<_, Error>(())
        })
        .unwrap();
    }

    #[test]
    fn the_first_difference_names_the_parameter_or_the_count() {
        let mine = vec!["a F32 [2]".to_string(), "b F32 [3]".to_string()];
        assert_eq!(first_difference(&mine, &["a F32 [2]", "b F32 [3]"]), None);
        let diff = first_difference(&mine, &["a F32 [2]", "b F32 [4]"]).unwrap();
        assert!(
            diff.contains("parameter 1 is `b F32 [3]` here and `b F32 [4]` on rank 0"),
            "{diff}"
        );
        let diff = first_difference(&mine, &["a F32 [2]"]).unwrap();
        assert!(diff.contains("rank 0 lacks is `b F32 [3]`"), "{diff}");
        let diff = first_difference(&mine[..1], &["a F32 [2]", "b F32 [3]"]).unwrap();
        assert!(diff.contains("the first it lacks is `b F32 [3]`"), "{diff}");
    }
}
