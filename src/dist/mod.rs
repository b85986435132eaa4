//! Training beyond one process: a process group over MPI, collectives on tensors, and data
//! parallelism.
//!
//! `mpirun -np N` starts N copies of a program; each joins with [`ProcessGroup::mpi`], keeps its
//! own scope tree, trains on its slice of every batch ([`Loader::shard`](crate::data::Loader::shard))
//! and averages gradients with the others ([`DataParallel`]), so that all N take the step one
//! process would take on the whole batch. Collectives run through the MPI library the job was
//! launched with (Open MPI, MPICH), built in with the `mpi` feature; without it, and for a program
//! started without `mpirun`, [`ProcessGroup::single`] is a world of one that needs no MPI.
//!
//! Collectives that run while the program goes on borrow their tensors for as long as they may
//! touch them ([`ProcessGroup::in_flight`]): reading a gradient before its all-reduce completed, or
//! closing the scope it lives in, does not compile.
//!
//! GPU tensors go through NCCL (with the `cuda` feature; `libnccl` is loaded at run time), one GPU
//! per process (`Device::Cuda(group.local_rank())`), enqueued on the GPU's stream: NCCL's unique id
//! travels over MPI, as nccl-tests and Horovod do it.

use std::panic::Location;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

mod flight;
mod group;
mod half_sum;
#[cfg(feature = "mpi")]
mod mpi;
mod parallel;

pub use flight::{Flight, Gathering, Pending};
pub use group::ProcessGroup;
pub use parallel::{DEFAULT_BUCKET_BYTES, DataParallel, SyncReport};

/// How a collective combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// The element-wise sum.
    Sum,
    /// The element-wise sum divided by the world size (the same bits on every rank).
    Mean,
    /// The element-wise maximum.
    Max,
    /// The element-wise minimum.
    Min,
}

impl Reduce {
    /// Refuses a reduction the dtype does not take, before anything starts (so that every rank
    /// refuses it at the same point and the ranks stay in step).
    pub(crate) fn check(self, dtype: DType) -> Result<()> {
        let fine = match dtype {
            DType::F32 | DType::F64 => true,
            DType::BF16 | DType::F16 => matches!(self, Reduce::Sum | Reduce::Mean),
            DType::I64 => self != Reduce::Mean,
        };
        if fine {
            Ok(())
        } else {
            Err(Error::UnsupportedDType {
                op: "all_reduce",
                dtype,
                expected: "f32 or f64 for any reduction; bf16 or f16 for a sum or mean; i64 for a \
                           sum, max or min",
            })
        }
    }
}

/// A collective's operands: `t`'s elements contiguous (`t` itself when it already is), and a fresh
/// host output of `shape` in `t`'s scope for the result.
pub(crate) fn operands<'s>(
    t: &Tensor<'s>,
    shape: &[usize],
    at: &'static Location<'static>,
) -> Result<(Tensor<'s>, Tensor<'s>)> {
    let src = if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let out = Tensor::output_of(&[t], t.dtype(), shape, at)?;
    Ok((src, out))
}
