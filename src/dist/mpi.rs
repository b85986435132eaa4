//! The MPI transport: starting MPI, the library's own communicator, and non-blocking collectives
//! on host bytes. Every call into the MPI library is here, each with its `// SAFETY:` argument;
//! the layer above ([`super::group`]) guarantees that the buffers of a started collective stay
//! borrowed until it completes.

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr;

use mpi::ffi;

use super::Reduce;
use super::half_sum::sum_halves;
use crate::dtype::{DType, bf16, f16};
use crate::error::{Error, Result};

/// MPI, started by this process, with a communicator of its own (a duplicate of the world, so a
/// program's own MPI traffic never matches the library's). Finalizes MPI when dropped.
///
/// Not `Send`: MPI is started with `MPI_THREAD_FUNNELED`, so only the thread that started it may
/// call it.
pub(crate) struct Mpi {
    comm: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    local_rank: usize,
    local_size: usize,
    /// `MPI_Op`s summing `bf16` and `f16` elements (MPI has no 16-bit float types).
    sum_bf16: ffi::MPI_Op,
    sum_f16: ffi::MPI_Op,
    _funneled: PhantomData<*const ()>,
}

/// Started collectives: one MPI request per chunk (MPI counts elements in `int`).
pub(crate) struct Requests(Vec<ffi::MPI_Request>);

impl Drop for Requests {
    /// Every path completes its requests before dropping them (a flight completes its entries, a
    /// group waits for the exchanges it abandoned). One still open here means MPI may still write
    /// into a buffer that is about to be reused: ending the job is the only safe answer.
    fn drop(&mut self) {
        // SAFETY: reading an MPI constant.
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        if self.0.iter().all(|r| *r == null) {
            return; // completed: MPI set each to MPI_REQUEST_NULL (no MPI call is needed)
        }
        let mut open = 0;
        for request in &mut self.0 {
            let mut flag: c_int = 0;
            // SAFETY: the request came from a non-blocking call on a communicator still alive (the
            // group that made it outlives it); MPI_Test accepts completed (null) requests too.
            unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            open += usize::from(flag == 0);
        }
        if open > 0 {
            eprintln!(
                "ndscope: {open} MPI transfer(s) were dropped before they completed, so MPI may \
                 still write into their buffers; aborting the MPI job"
            );
            // SAFETY: MPI is initialized (the requests are alive); MPI_Abort does not return.
            unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
            std::process::abort();
        }
    }
}

/// The largest element count one MPI call takes.
const MAX_COUNT: usize = c_int::MAX as usize;

/// `(start, count)` of the pieces of `n` elements one MPI call each takes; one empty piece for 0.
fn chunks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n.div_ceil(MAX_COUNT).max(1)).map(move |i| {
        let start = i * MAX_COUNT;
        (start, (n - start).min(MAX_COUNT))
    })
}

/// The handle an MPI call writes through its out-pointer.
///
/// # Safety
/// `call` must be an MPI call that writes a valid `T` through the pointer when it returns 0.
unsafe fn made<T>(op: &'static str, call: impl FnOnce(*mut T) -> c_int) -> Result<T> {
    let mut out = MaybeUninit::<T>::uninit();
    check(op, call(out.as_mut_ptr()))?;
    // SAFETY: the call returned 0, so it wrote the handle (the caller's contract).
    Ok(unsafe { out.assume_init() })
}

fn check(op: &'static str, code: c_int) -> Result<()> {
    // MPI's default error handler aborts the job on failure; a non-zero code reaching here means a
    // program set another handler, so say which call failed.
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Distributed {
            op,
            reason: format!("the MPI library returned error code {code}"),
        })
    }
}

impl Mpi {
    /// Starts MPI (`MPI_Init_thread`, funneled) unless the program already did, duplicates the
    /// world communicator, finds this rank's place among the ranks of its node, and registers the
    /// 16-bit sums.
    pub(crate) fn start() -> Result<Mpi> {
        let op = "ProcessGroup::mpi";
        let (mut initialized, mut finalized) = (0, 0);
        // SAFETY: MPI_Initialized and MPI_Finalized may be called at any time, from any thread; the
        // flags are valid for writes.
        unsafe {
            check(op, ffi::MPI_Initialized(&mut initialized))?;
            check(op, ffi::MPI_Finalized(&mut finalized))?;
        }
        if initialized != 0 || finalized != 0 {
            return Err(Error::Distributed {
                op,
                reason: "MPI was already started (or finished) in this process; make one \
                         ProcessGroup per process, at the start of main, and pass it by reference"
                    .into(),
            });
        }
        let mut provided: c_int = 0;
        // SAFETY: MPI is not initialized (checked above); null argc/argv are allowed since MPI-2;
        // `provided` is valid for writes.
        unsafe {
            check(
                op,
                ffi::MPI_Init_thread(
                    ptr::null_mut(),
                    ptr::null_mut(),
                    ffi::RSMPI_THREAD_FUNNELED,
                    &mut provided,
                ),
            )?;
        }
        // SAFETY: an initialized static of the MPI library.
        if provided < unsafe { ffi::RSMPI_THREAD_FUNNELED } {
            // The library is started, so finalize before refusing.
            // SAFETY: MPI was initialized just above and nothing else uses it yet.
            unsafe { ffi::MPI_Finalize() };
            return Err(Error::Distributed {
                op,
                reason: "this MPI library does not allow a multi-threaded process \
                         (MPI_THREAD_FUNNELED); ndscope's host kernels run on a thread pool, so \
                         use an MPI built with thread support"
                    .into(),
            });
        }
        let (mut rank, mut world, mut local_rank, mut local_size) = (0, 0, 0, 0);
        // SAFETY: MPI is initialized; every out-pointer is valid for writes (`made` hands each call
        // its own); the reduction functions match MPI_User_function's signature and never unwind.
        let (comm, sum_bf16, sum_f16) = unsafe {
            let comm = made(op, |c| ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, c))?;
            check(op, ffi::MPI_Comm_rank(comm, &mut rank))?;
            check(op, ffi::MPI_Comm_size(comm, &mut world))?;
            let mut local = made(op, |c| {
                ffi::MPI_Comm_split_type(
                    comm,
                    ffi::RSMPI_COMM_TYPE_SHARED,
                    rank,
                    ffi::RSMPI_INFO_NULL,
                    c,
                )
            })?;
            check(op, ffi::MPI_Comm_rank(local, &mut local_rank))?;
            check(op, ffi::MPI_Comm_size(local, &mut local_size))?;
            check(op, ffi::MPI_Comm_free(&mut local))?;
            let sum_bf16 = made(op, |o| {
                ffi::MPI_Op_create(Some(sum_halves::<bf16, ffi::MPI_Datatype>), 1, o)
            })?;
            let sum_f16 = made(op, |o| {
                ffi::MPI_Op_create(Some(sum_halves::<f16, ffi::MPI_Datatype>), 1, o)
            })?;
            (comm, sum_bf16, sum_f16)
        };
        Ok(Mpi {
            comm,
            rank: rank as usize,
            world: world as usize,
            local_rank: local_rank as usize,
            local_size: local_size as usize,
            sum_bf16,
            sum_f16,
            _funneled: PhantomData,
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn local_rank(&self) -> usize {
        self.local_rank
    }

    pub(crate) fn local_size(&self) -> usize {
        self.local_size
    }

    /// The MPI datatype and operation reducing `dtype` elements with `reduce` (a mean is a sum
    /// here; the caller divides).
    fn reduction(&self, dtype: DType, reduce: Reduce) -> Result<(ffi::MPI_Datatype, ffi::MPI_Op)> {
        // SAFETY: the RSMPI_ constants are initialized statics of the MPI library's handles.
        let (float, double, u16s, sum, max, min, i64s) = unsafe {
            (
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_DOUBLE,
                ffi::RSMPI_UINT16_T,
                ffi::RSMPI_SUM,
                ffi::RSMPI_MAX,
                ffi::RSMPI_MIN,
                ffi::RSMPI_INT64_T,
            )
        };
        let op = match reduce {
            Reduce::Sum | Reduce::Mean => sum,
            Reduce::Max => max,
            Reduce::Min => min,
        };
        Ok(match (dtype, reduce) {
            (DType::F32, _) => (float, op),
            (DType::F64, _) => (double, op),
            (DType::I64, _) => (i64s, op),
            (DType::BF16, Reduce::Sum | Reduce::Mean) => (u16s, self.sum_bf16),
            (DType::F16, Reduce::Sum | Reduce::Mean) => (u16s, self.sum_f16),
            _ => {
                return Err(Error::UnsupportedDType {
                    op: "all_reduce",
                    dtype,
                    expected: "f32, f64, bf16 or f16 for a sum or mean; f32, f64 or i64 for a max \
                               or min",
                });
            }
        })
    }

    /// Starts an all-reduce of `elements` values of `dtype` from `send` into `recv`.
    ///
    /// # Safety
    /// `send` must be valid for reads and `recv` for writes of `elements * dtype.size()` bytes, not
    /// overlapping, until the returned requests complete ([`test`](Self::test) says so).
    pub(crate) unsafe fn all_reduce(
        &self,
        send: *const u8,
        recv: *mut u8,
        elements: usize,
        dtype: DType,
        reduce: Reduce,
    ) -> Result<Requests> {
        let (datatype, op) = self.reduction(dtype, reduce)?;
        // In `Requests` from the first chunk on: if a later chunk fails to start, dropping them
        // ends the job unless the started ones have completed (their buffers go back on return).
        let mut requests = Requests(Vec::with_capacity(elements.div_ceil(MAX_COUNT).max(1)));
        for (start, count) in chunks(elements) {
            let at = start * dtype.size();
            // SAFETY: by the caller's contract the chunk `at..at + count * size` is in both
            // buffers and stays valid until the request completes; the handles are valid.
            let request = unsafe {
                made("all_reduce", |r| {
                    ffi::MPI_Iallreduce(
                        send.add(at).cast::<c_void>(),
                        recv.add(at).cast::<c_void>(),
                        count as c_int,
                        datatype,
                        op,
                        self.comm,
                        r,
                    )
                })?
            };
            requests.0.push(request);
        }
        Ok(requests)
    }

    /// An all-reduce of `elements` values of `dtype` from `send` into `recv`, returning when it is
    /// complete on this rank: MPI's blocking algorithms, several times faster than the
    /// non-blocking ones for mid-sized messages (see BENCHMARKS.md).
    ///
    /// # Safety
    /// `send` must be valid for reads and `recv` for writes of `elements * dtype.size()` bytes, not
    /// overlapping.
    pub(crate) unsafe fn all_reduce_now(
        &self,
        send: *const u8,
        recv: *mut u8,
        elements: usize,
        dtype: DType,
        reduce: Reduce,
    ) -> Result<()> {
        let (datatype, op) = self.reduction(dtype, reduce)?;
        for (start, count) in chunks(elements) {
            let at = start * dtype.size();
            // SAFETY: by the caller's contract the chunk is in both buffers; the handles are valid.
            unsafe {
                check(
                    "all_reduce",
                    ffi::MPI_Allreduce(
                        send.add(at).cast::<c_void>(),
                        recv.add(at).cast::<c_void>(),
                        count as c_int,
                        datatype,
                        op,
                        self.comm,
                    ),
                )?;
            }
        }
        Ok(())
    }

    /// Starts a broadcast of `bytes` bytes at `buf` from rank `root`.
    ///
    /// # Safety
    /// `buf` must be valid for reads and writes of `bytes` bytes until the requests complete.
    pub(crate) unsafe fn broadcast(
        &self,
        buf: *mut u8,
        bytes: usize,
        root: usize,
    ) -> Result<Requests> {
        // As for `all_reduce`: started chunks are in `Requests` at once.
        let mut requests = Requests(Vec::with_capacity(bytes.div_ceil(MAX_COUNT).max(1)));
        for (start, count) in chunks(bytes) {
            // SAFETY: by the caller's contract the chunk is valid until the request completes; the
            // root is a rank of the communicator (the caller checked it).
            let request = unsafe {
                made("broadcast", |r| {
                    ffi::MPI_Ibcast(
                        buf.add(start).cast::<c_void>(),
                        count as c_int,
                        ffi::RSMPI_UINT8_T,
                        root as c_int,
                        self.comm,
                        r,
                    )
                })?
            };
            requests.0.push(request);
        }
        Ok(requests)
    }

    /// Starts an all-gather of `bytes` bytes from every rank into `recv`, rank by rank.
    ///
    /// # Safety
    /// `send` must be valid for reads of `bytes` bytes and `recv` for writes of `bytes * world`,
    /// not overlapping, until the requests complete.
    pub(crate) unsafe fn all_gather(
        &self,
        send: *const u8,
        recv: *mut u8,
        bytes: usize,
    ) -> Result<Requests> {
        if bytes > MAX_COUNT {
            return Err(Error::Distributed {
                op: "all_gather",
                reason: format!(
                    "each rank sends {bytes} bytes and one MPI call takes at most {MAX_COUNT}; \
                     gather the tensor in slices"
                ),
            });
        }
        // SAFETY: by the caller's contract; the handles are valid.
        let request = unsafe {
            made("all_gather", |r| {
                ffi::MPI_Iallgather(
                    send.cast::<c_void>(),
                    bytes as c_int,
                    ffi::RSMPI_UINT8_T,
                    recv.cast::<c_void>(),
                    bytes as c_int,
                    ffi::RSMPI_UINT8_T,
                    self.comm,
                    r,
                )
            })?
        };
        Ok(Requests(vec![request]))
    }

    /// Whether every request has completed (each completed one is released by MPI); moves the
    /// started collectives on.
    pub(crate) fn test(&self, requests: &mut Requests) -> bool {
        let mut done = true;
        for request in &mut requests.0 {
            let mut flag: c_int = 0;
            // SAFETY: the request came from a non-blocking call on this communicator; MPI sets a
            // completed one to MPI_REQUEST_NULL, which MPI_Test accepts again.
            unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            done &= flag != 0;
        }
        done
    }

    /// Ends every rank of the job, printing `message` first: for a collective whose buffers MPI
    /// may still write, where returning would hand that memory back to its scope.
    pub(crate) fn abort(&self, message: &str) -> ! {
        eprintln!(
            "ndscope: rank {}: {message}; aborting the MPI job",
            self.rank
        );
        // SAFETY: MPI is initialized; MPI_Abort does not return when it works.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
        std::process::abort()
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        // SAFETY: the handles were made in `start` and no request on the communicator is pending
        // (every started collective is waited for, or the job was aborted); MPI_Finalize is the
        // last MPI call of the process.
        unsafe {
            ffi::MPI_Op_free(&mut self.sum_bf16);
            ffi::MPI_Op_free(&mut self.sum_f16);
            ffi::MPI_Comm_free(&mut self.comm);
            ffi::MPI_Finalize();
        }
    }
}
