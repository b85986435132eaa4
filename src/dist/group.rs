//! The process group: which rank this process is, and the collectives that run across all of them.

use std::cell::{Cell, Ref, RefCell};
use std::fmt;
use std::panic::{self, AssertUnwindSafe, Location};
use std::path::Path;
use std::time::{Duration, Instant};

use super::flight::Flight;
use super::{Reduce, operands};
use crate::checkpoint;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::scope::StaysOnItsThread;
use crate::tensor::{GpuCommunicator, GpuReduce, Tensor};

#[cfg(feature = "mpi")]
use super::mpi::{Mpi, Requests};
#[cfg(feature = "mpi")]
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(feature = "mpi")]
use std::sync::{Arc, Mutex};

/// The ranks of a data-parallel job and the collectives between them: one per process, made at
/// the start of `main` and passed by reference.
///
/// [`ProcessGroup::mpi`] joins the job `mpirun -np N` (or Slurm's `srun`) launched: it starts MPI,
/// reads this process's rank, the world size, and its rank among the processes of its machine
/// ([`local_rank`](Self::local_rank), the GPU to bind to), and finalizes MPI when dropped.
/// [`ProcessGroup::single`] is a world of one, needing no MPI: the same program then trains on one
/// process, and every collective is the identity.
///
/// Collectives take host tensors (over MPI) and, with the `cuda` feature, GPU tensors (over NCCL, on
/// the GPU's stream); the dtypes each reduction takes are listed on
/// [`all_reduce`](Self::all_reduce). Each process keeps its own scope tree; a
/// collective's result is a tensor of the operand's scope, so the scope rules hold on every rank.
///
/// ```
/// use ndscope::dist::{ProcessGroup, Reduce};
/// use ndscope::{Device, root};
///
/// let group = ProcessGroup::single(); // ProcessGroup::mpi()? under mpirun
/// root(Device::Cpu, |s| {
///     let local = s.from_slice(&[1.0f32, 2.0], &[2])?;
///     let summed = group.all_reduce(&local, Reduce::Sum)?; // every rank's `local`, added
///     assert_eq!(summed.to_vec::<f32>()?, vec![1.0, 2.0]); // a world of one
///     let gathered = group.all_gather(&local)?; // [world, 2]
///     assert_eq!(gathered.shape(), &[1, 2]);
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct ProcessGroup {
    /// Neither `Send` nor `Sync`, with or without features: MPI is initialised for the thread
    /// that made the group (`MPI_THREAD_FUNNELED`), and a GPU's communicator for its stream.
    _thread: StaysOnItsThread,
    /// The NCCL communicator for GPU tensors, made at the first collective on one (dropped before
    /// MPI is finalized).
    nccl: RefCell<Option<GpuCommunicator>>,
    transport: Transport,
    timeout: Cell<Duration>,
    /// Seconds spent waiting for collectives to complete, since the group started.
    waited: Cell<f64>,
    /// The library's exchanges (`exchange_max`) made so far: each is tagged with its number.
    exchanges: Cell<u64>,
    /// Library-owned exchanges that timed out: MPI may still write their buffers, so they stay
    /// here until a late peer completes them or the job ends.
    #[cfg(feature = "mpi")]
    abandoned: RefCell<Vec<Abandoned>>,
    #[cfg(not(feature = "mpi"))]
    abandoned: RefCell<Vec<()>>,
    #[cfg(feature = "mpi")]
    watchdog: Option<Watchdog>,
}

/// A timed-out exchange, the buffers MPI may still write, and the error it returned.
#[cfg(feature = "mpi")]
type Abandoned = (Started, Vec<Box<[u8]>>, String);

/// How long a dropping group waits for the exchanges that timed out earlier, each of which has
/// already waited a whole timeout: a peer that is still absent is not coming, and waiting a
/// second timeout would only double the time the job takes to end.
#[cfg(feature = "mpi")]
const ABANDONED_GRACE: Duration = Duration::from_secs(1);

enum Transport {
    Single,
    #[cfg(feature = "mpi")]
    Mpi(Mpi),
}

/// Ends the process when a blocking collective outlives the timeout: a blocking MPI call cannot be
/// given up, and returning would hand its buffers back while MPI may still write them. A thread of
/// its own that never calls MPI; `mpirun` then ends the job and names the rank.
#[cfg(feature = "mpi")]
struct Watchdog {
    /// Milliseconds after `epoch` at which the running call is late; 0 when none runs.
    deadline: Arc<AtomicU64>,
    op: Arc<Mutex<&'static str>>,
    epoch: Instant,
}

#[cfg(feature = "mpi")]
impl Watchdog {
    fn start(rank: usize) -> Watchdog {
        let deadline = Arc::new(AtomicU64::new(0));
        let op = Arc::new(Mutex::new(""));
        let epoch = Instant::now();
        let (late, name) = (Arc::clone(&deadline), Arc::clone(&op));
        std::thread::Builder::new()
            .name("ndscope collective watchdog".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(50));
                    if Arc::strong_count(&late) == 1 {
                        return; // the group is gone
                    }
                    let due = late.load(Ordering::Acquire);
                    if due != 0 && epoch.elapsed().as_millis() as u64 > due {
                        let op = *name.lock().unwrap_or_else(|e| e.into_inner());
                        eprintln!(
                            "ndscope: rank {rank}: {op} did not complete within the process group's \
                             timeout: a peer never joined it (it died, hangs, or runs another step); \
                             ending this process, which ends the MPI job"
                        );
                        std::process::abort();
                    }
                }
            })
            .expect("a thread for the collective watchdog");
        Watchdog {
            deadline,
            op,
            epoch,
        }
    }
}

/// A started transfer: MPI requests, or nothing for a world of one (done at once).
pub(crate) enum Started {
    Done,
    #[cfg(feature = "mpi")]
    Mpi(Requests),
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("local_rank", &self.local_rank())
            .field("transport", &self.transport_name())
            .field("timeout", &self.timeout.get())
            .finish()
    }
}

/// Slots of a library exchange's tag on the wire: what it is and this rank's count, each twice
/// (as `x` and `i64::MAX - x`, so that one max-reduction shows whether every rank sent the same),
/// and when this rank gives up waiting (with its rank in the low [`RANK_BITS`]), negated.
const TAG_SLOTS: usize = 5;

/// Low bits of a deadline slot that hold the rank.
const RANK_BITS: u32 = 20;

/// How far past a peer's deadline an exchange must complete before this rank concludes that the
/// peer gave up on it: more than the clocks of one job's machines disagree.
const CLOCK_SKEW_MS: i64 = 250;

/// Milliseconds since the Unix epoch: ranks on different machines compare deadlines in it.
fn unix_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Value slots of every library exchange (unused ones travel as 0): one size for all, so ranks in
/// different exchanges meet in one MPI call instead of failing inside MPI on a size mismatch.
const VALUE_SLOTS: usize = 4;

/// 8-byte slots of an operation's name in a mismatch report (longer names are cut).
const NAME_SLOTS: usize = 6;

/// The exchange every rank makes when its group is dropped, before MPI is finalized.
#[cfg(feature = "mpi")]
const FINISHING: &str = "the end of its ProcessGroup";

/// A non-negative number for an operation's name (FNV-1a): ranks compare them, not the names.
fn op_code(op: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in op.as_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 1) as i64
}

/// How long [`ProcessGroup::wait_for`] polls back to back before it sleeps between polls.
const SPIN_BEFORE_SLEEPING: Duration = Duration::from_millis(5);

/// The timeout a new group starts with.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl ProcessGroup {
    fn with(transport: Transport) -> ProcessGroup {
        ProcessGroup {
            _thread: StaysOnItsThread::default(),
            nccl: RefCell::new(None),
            transport,
            timeout: Cell::new(DEFAULT_TIMEOUT),
            waited: Cell::new(0.0),
            exchanges: Cell::new(0),
            abandoned: RefCell::new(Vec::new()),
            #[cfg(feature = "mpi")]
            watchdog: None,
        }
    }

    /// A world of one process, without MPI.
    pub fn single() -> ProcessGroup {
        ProcessGroup::with(Transport::Single)
    }

    /// Joins the MPI job this process was launched in (`mpirun -np N ...`); a process started
    /// without `mpirun` is a world of one. Call it once per process; MPI is finalized when the
    /// group is dropped.
    ///
    /// # Errors
    /// [`Error::Distributed`] when ndscope was built without the `mpi` feature, when MPI was
    /// already started in this process, or when the MPI library allows no threads.
    pub fn mpi() -> Result<ProcessGroup> {
        #[cfg(feature = "mpi")]
        {
            let mpi = Mpi::start()?;
            let mut group = ProcessGroup::with(Transport::Mpi(mpi));
            group.watchdog = Some(Watchdog::start(group.rank()));
            Ok(group)
        }
        #[cfg(not(feature = "mpi"))]
        {
            Err(Error::Distributed {
                op: "ProcessGroup::mpi",
                reason: "ndscope was built without MPI; build with `--features mpi` (after \
                         installing MPI: `apt-get install libopenmpi-dev openmpi-bin libclang-dev`) \
                         and launch with `mpirun -np N`"
                    .into(),
            })
        }
    }

    /// This process's rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        match &self.transport {
            Transport::Single => 0,
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.rank(),
        }
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        match &self.transport {
            Transport::Single => 1,
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.world(),
        }
    }

    /// This process's rank among the processes on its machine: the GPU it binds to
    /// (`Device::Cuda(group.local_rank())` with one process per GPU).
    pub fn local_rank(&self) -> usize {
        match &self.transport {
            Transport::Single => 0,
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.local_rank(),
        }
    }

    /// The number of processes on this machine.
    pub fn local_size(&self) -> usize {
        match &self.transport {
            Transport::Single => 1,
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.local_size(),
        }
    }

    /// Whether this is rank 0, the rank that writes checkpoints and logs.
    pub fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// `"mpi"` or `"single"`.
    pub fn transport_name(&self) -> &'static str {
        match &self.transport {
            Transport::Single => "single",
            #[cfg(feature = "mpi")]
            Transport::Mpi(_) => "mpi",
        }
    }

    /// How long a collective may wait for its peers (5 minutes unless set). An exchange the library
    /// owns the buffers of (the per-step agreement of [`agree`](Self::agree), which
    /// [`DataParallel`](super::DataParallel) runs before its all-reduce) returns
    /// [`Error::CollectiveTimeout`]; a collective on tensors aborts the job with a message naming
    /// the rank and the collective, since MPI may still write memory that returning would give back
    /// to its scope.
    pub fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout);
    }

    /// The collectives' timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    /// Seconds this process has spent waiting for collectives to complete since the group started:
    /// read it before and after a step for the step's communication time.
    pub fn waited_seconds(&self) -> f64 {
        self.waited.get()
    }

    /// The sum, mean, max or min of `t` over every rank, as a new tensor of `t`'s scope (the same
    /// on every rank). Every rank must call it with the same shape and dtype.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] for a GPU tensor when its GPU or NCCL is
    /// missing; [`Error::UnsupportedDType`] for a reduction the dtype does not take (a mean of
    /// `i64`, a max of 16-bit floats); allocation errors.
    #[track_caller]
    pub fn all_reduce<'s>(&self, t: &Tensor<'s>, reduce: Reduce) -> Result<Tensor<'s>> {
        let op = "all_reduce";
        reduce.check(t.dtype())?;
        let (src, mut out) = operands(t, t.shape(), Location::caller())?;
        if let Device::Cuda(ordinal) = t.device() {
            let reduce = match reduce {
                Reduce::Sum | Reduce::Mean => GpuReduce::Sum,
                Reduce::Max => GpuReduce::Max,
                Reduce::Min => GpuReduce::Min,
            };
            self.nccl(op, ordinal)?
                .all_reduce(op, &src, &mut out, reduce)?;
            drop(src);
        } else {
            self.host_all_reduce(op, &src, &mut out, reduce)?;
        }
        if reduce == Reduce::Mean && self.world_size() > 1 {
            out.mul_scalar_(1.0 / self.world_size() as f64)?;
        }
        Ok(out)
    }

    /// `all_reduce` of host tensors: MPI's blocking call under the watchdog.
    fn host_all_reduce(
        &self,
        op: &'static str,
        src: &Tensor<'_>,
        out: &mut Tensor<'_>,
        reduce: Reduce,
    ) -> Result<()> {
        let (send, recv) = (src.host_bytes(op)?, out.host_bytes_mut(op)?);
        match &self.transport {
            Transport::Single => {
                let _ = reduce; // over one rank every reduction is the identity
                recv.copy_from_slice(send);
            }
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => self.watched(op, || {
                // SAFETY: both buffers are borrowed for the whole call, which returns when the
                // all-reduce is complete on this rank.
                unsafe {
                    m.all_reduce_now(
                        send.as_ptr(),
                        recv.as_mut_ptr(),
                        src.numel(),
                        src.dtype(),
                        reduce,
                    )
                }
            })?,
        }
        Ok(())
    }

    /// This rank's NCCL communicator, on GPU `ordinal`: made at the first collective on a GPU
    /// tensor (every rank makes it at the same collective, rank 0's unique id sent over MPI).
    fn nccl(&self, op: &'static str, ordinal: usize) -> Result<Ref<'_, GpuCommunicator>> {
        if self.nccl.borrow().is_none() {
            // Every rank checks its GPU and rank 0 makes the id before anyone waits in NCCL's
            // start, so a rank without a GPU or NCCL stops them all with its reason.
            let ready = Device::Cuda(ordinal).check_available().and_then(|()| {
                if self.is_root() {
                    GpuCommunicator::unique_id(ordinal).map(|id| id.to_vec())
                } else {
                    Ok(vec![0; 128])
                }
            });
            let id = self.agree(op, ready)?;
            let id = self.exchange_bytes(op, id, 0)?;
            let id: [u8; 128] = id.try_into().expect("128 bytes from every rank");
            let comm = GpuCommunicator::join(ordinal, self.rank(), self.world_size(), &id)?;
            *self.nccl.borrow_mut() = Some(comm);
        }
        let nccl = Ref::map(self.nccl.borrow(), |n| n.as_ref().expect("made above"));
        if nccl.ordinal() != ordinal {
            return Err(Error::Distributed {
                op,
                reason: format!(
                    "this rank's GPU collectives run on cuda:{}, and this tensor is on cuda:{ordinal}; \
                     NCCL gives each process one GPU: keep a rank's tensors on \
                     Device::Cuda(group.local_rank())",
                    nccl.ordinal()
                ),
            });
        }
        Ok(nccl)
    }

    /// [`all_reduce`](Self::all_reduce) into `t` (its handle then names the result).
    ///
    /// # Errors
    /// As for [`all_reduce`](Self::all_reduce).
    #[track_caller]
    pub fn all_reduce_(&self, t: &mut Tensor<'_>, reduce: Reduce) -> Result<()> {
        *t = self.all_reduce(t, reduce)?;
        Ok(())
    }

    /// Overwrites `t` on every rank with rank `root`'s `t`.
    ///
    /// # Errors
    /// [`Error::Distributed`] when `root` is not a rank;
    /// [`Error::DeviceUnavailable`] for a GPU tensor when its GPU or NCCL is missing.
    pub fn broadcast_(&self, t: &mut Tensor<'_>, root: usize) -> Result<()> {
        if let Device::Cuda(ordinal) = t.device() {
            self.check_root("broadcast", root)?;
            return self
                .nccl("broadcast", ordinal)?
                .broadcast_("broadcast", t, root);
        }
        self.in_flight(|flight| flight.broadcast(t, root).map(drop))
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root < self.world_size() {
            return Ok(());
        }
        Err(Error::Distributed {
            op,
            reason: format!(
                "root rank {root} is not a rank of this group of {} processes",
                self.world_size()
            ),
        })
    }

    /// Every rank's `t`, stacked in rank order: `[world_size, ..t.shape()]`, in `t`'s scope.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] for a GPU tensor when its GPU or NCCL is
    /// missing; allocation errors.
    #[track_caller]
    pub fn all_gather<'s>(&self, t: &Tensor<'s>) -> Result<Tensor<'s>> {
        if let Device::Cuda(ordinal) = t.device() {
            let op = "all_gather";
            let mut shape = vec![self.world_size()];
            shape.extend_from_slice(t.shape());
            let (src, mut out) = operands(t, &shape, Location::caller())?;
            self.nccl(op, ordinal)?
                .all_gather(op, &src, &mut out, self.world_size())?;
            return Ok(out);
        }
        let mut out = None;
        self.in_flight(|flight| {
            out = Some(flight.all_gather(t)?.into_output());
            Ok(())
        })?;
        Ok(out.expect("set inside the flight"))
    }

    /// Waits until every rank has reached this call.
    ///
    /// # Errors
    /// [`Error::CollectiveTimeout`] when a peer does not arrive within the timeout.
    pub fn barrier(&self) -> Result<()> {
        self.exchange_max("barrier", &mut [0]).map(drop)
    }

    /// Makes a rank's failure every rank's: each rank passes the result of its own work (a step, a
    /// load), and every rank gets `Ok` only when every rank succeeded. A rank that failed gets its
    /// own error back; the others get [`Error::PeerFailed`] with the lowest failing rank's message.
    /// Call it at the same point on every rank, so that an error on one rank stops them all instead
    /// of leaving them waiting in the next collective.
    ///
    /// ```
    /// use ndscope::dist::ProcessGroup;
    ///
    /// let group = ProcessGroup::single();
    /// let local: ndscope::Result<u32> = Ok(7);
    /// assert_eq!(group.agree("step", local)?, 7);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// This rank's error; [`Error::PeerFailed`]; [`Error::CollectiveTimeout`] when a peer never
    /// comes.
    pub fn agree<T>(&self, op: &'static str, local: Result<T>) -> Result<T> {
        let failure = local.as_ref().err().map(ToString::to_string);
        match self.first_failure(op, failure)? {
            None => local,
            Some((rank, _)) if rank == self.rank() => local,
            Some((rank, message)) => Err(Error::PeerFailed { op, rank, message }),
        }
    }

    /// Rank 0 writes `params` to `path` (a safetensors checkpoint, as [`checkpoint::save`]); the
    /// other ranks wait for it, and a failure to write reaches every rank. Every rank can then load
    /// it with [`checkpoint::load`].
    ///
    /// # Errors
    /// The write's error on rank 0, [`Error::PeerFailed`] naming rank 0 on the others.
    pub fn save_checkpoint<'m>(
        &self,
        params: &(impl Parameters<'m> + ?Sized),
        path: impl AsRef<Path>,
    ) -> Result<()> {
        let written = if self.is_root() {
            checkpoint::save(params, path)
        } else {
            Ok(())
        };
        self.agree("save_checkpoint", written)
    }

    /// The lowest rank whose `failure` is `Some`, and its message; `None` on every rank when none
    /// failed.
    pub(crate) fn first_failure(
        &self,
        op: &'static str,
        failure: Option<String>,
    ) -> Result<Option<(usize, String)>> {
        self.first_failure_counting(op, failure, 0)
            .map(|(first, _)| first)
    }

    /// As [`agree`](Self::agree), and every rank must also pass the same `count` (the examples in
    /// its slice of a batch): ranks that succeeded with different counts get
    /// [`Error::Distributed`] listing each rank's.
    pub(crate) fn agree_counting<T>(
        &self,
        op: &'static str,
        local: Result<T>,
        count: usize,
        what: &str,
    ) -> Result<T> {
        let failure = local.as_ref().err().map(ToString::to_string);
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        match self.first_failure_counting(op, failure, count)? {
            (Some((rank, _)), _) if rank == self.rank() => local,
            (Some((rank, message)), _) => Err(Error::PeerFailed { op, rank, message }),
            (None, true) => local,
            (None, false) => {
                let counts = self.each_rank(op, count)?;
                let list: Vec<String> = counts
                    .iter()
                    .enumerate()
                    .map(|(rank, n)| format!("rank {rank}: {n}"))
                    .collect();
                Err(Error::Distributed {
                    op,
                    reason: format!(
                        "the ranks have different numbers of {what} in this step ({}): the mean \
                         over the ranks would weight them unequally; give every rank the same \
                         number (drop or pad the last batch)",
                        list.join(", ")
                    ),
                })
            }
        }
    }

    /// The lowest failing rank and its message (as [`first_failure`](Self::first_failure)), and
    /// whether every rank passed the same `count`.
    fn first_failure_counting(
        &self,
        op: &'static str,
        failure: Option<String>,
        count: i64,
    ) -> Result<(Option<(usize, String)>, bool)> {
        let world = self.world_size() as i64;
        let mine = failure.as_ref().map_or(0, |_| world - self.rank() as i64);
        let [highest, high, high_not] =
            self.exchange_max(op, &mut [mine, count, i64::MAX - count])?;
        let same = high == i64::MAX - high_not;
        if highest == 0 {
            return Ok((None, same));
        }
        let rank = (world - highest) as usize;
        let message = self.broadcast_text(op, failure.unwrap_or_default(), rank)?;
        Ok((Some((rank, message)), same))
    }

    /// Every rank's `value`, in rank order (after a tagged exchange that brought every rank here).
    fn each_rank(&self, op: &'static str, value: i64) -> Result<Vec<i64>> {
        let mut slots = vec![i64::MIN; self.world_size()];
        slots[self.rank()] = value;
        self.exchange_slots(op, &slots)
    }

    /// Rank `root`'s `text`, on every rank: a path, a run name, anything rank 0 decides for all.
    ///
    /// # Errors
    /// [`Error::Distributed`] when `root` is not a rank; [`Error::CollectiveTimeout`].
    pub fn broadcast_string(&self, text: &str, root: usize) -> Result<String> {
        self.check_root("broadcast_string", root)?;
        self.broadcast_text("broadcast_string", text.to_string(), root)
    }

    /// Rank `root`'s `text`, on every rank.
    pub(crate) fn broadcast_text(
        &self,
        op: &'static str,
        text: String,
        root: usize,
    ) -> Result<String> {
        if self.world_size() == 1 {
            return Ok(text);
        }
        let mine = if self.rank() == root {
            text.len() as i64
        } else {
            0
        };
        let [len] = self.exchange_max(op, &mut [mine])?;
        let mut bytes = text.into_bytes();
        bytes.resize(len as usize, 0);
        let bytes = self.exchange_bytes(op, bytes, root)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The element-wise max of `values` over every rank, through buffers the library owns: a
    /// timeout is an [`Error::CollectiveTimeout`].
    ///
    /// Every such exchange is tagged with what it is (`op`) and this rank's count of exchanges,
    /// and all have one size on the wire, so ranks at different points of the program (one in a
    /// `barrier`, another in a step's agreement; one finishing while another steps) meet in the
    /// same MPI call and learn it: [`Error::CollectiveMismatch`] on every rank, naming each side's
    /// operation, instead of one value matched against another silently.
    pub(crate) fn exchange_max<const N: usize>(
        &self,
        op: &'static str,
        values: &mut [i64; N],
    ) -> Result<[i64; N]> {
        const {
            assert!(
                N <= VALUE_SLOTS,
                "an exchange carries at most VALUE_SLOTS values"
            )
        };
        if self.world_size() == 1 {
            return Ok(*values);
        }
        let count = self.exchanges.get();
        self.exchanges.set(count + 1);
        let (what, which) = (op_code(op), count as i64);
        // When this rank gives up waiting, with its rank: the max of the negation is the earliest.
        let gives_up = unix_millis() + self.timeout.get().as_millis() as i64;
        let deadline = -((gives_up << RANK_BITS) | self.rank() as i64);
        // The max of x and of MAX - x over the ranks agree only when every rank sent the same x.
        let mut wire = [0i64; TAG_SLOTS + VALUE_SLOTS];
        wire[..TAG_SLOTS].copy_from_slice(&[
            what,
            i64::MAX - what,
            which,
            i64::MAX - which,
            deadline,
        ]);
        wire[TAG_SLOTS..TAG_SLOTS + N].copy_from_slice(values);
        let got = self.exchange_slots(op, &wire)?;
        let same = |at: usize| got[at] == i64::MAX - got[at + 1];
        if !(same(0) && same(2)) {
            return Err(self.mismatch(op, count));
        }
        // A rank that arrives after a peer's timeout passed completes the exchange that peer
        // abandoned: every value looks fine, but that peer has returned a timeout and stopped.
        let earliest = -got[4];
        let (rank, gave_up) = (
            (earliest & ((1 << RANK_BITS) - 1)) as usize,
            earliest >> RANK_BITS,
        );
        let late = unix_millis() - gave_up;
        if rank != self.rank() && late > CLOCK_SKEW_MS {
            return Err(Error::PeerFailed {
                op,
                rank,
                message: format!(
                    "it stopped waiting for this rank in {op}: its timeout passed {:.1} s before \
                     this rank arrived (it returned Error::CollectiveTimeout)",
                    late as f64 / 1000.0
                ),
            });
        }
        let mut out = [0i64; N];
        out.copy_from_slice(&got[TAG_SLOTS..TAG_SLOTS + N]);
        Ok(out)
    }

    /// After an exchange whose tags differed (every rank saw the same maxima, so every rank is
    /// here): each rank's exchange count and operation name, and the error naming the lowest rank
    /// that was elsewhere.
    fn mismatch(&self, op: &'static str, count: u64) -> Error {
        let world = self.world_size();
        let row = 1 + NAME_SLOTS;
        // Each rank writes its own row; the max with every other rank's i64::MIN is that row.
        let mut rows = vec![i64::MIN; world * row];
        let mine = &mut rows[self.rank() * row..(self.rank() + 1) * row];
        mine[0] = count as i64;
        let mut name = [0u8; NAME_SLOTS * 8];
        let len = op.len().min(name.len());
        name[..len].copy_from_slice(&op.as_bytes()[..len]);
        for (slot, bytes) in mine[1..].iter_mut().zip(name.chunks_exact(8)) {
            *slot = i64::from_le_bytes(bytes.try_into().expect("8 bytes"));
        }
        let rows = match self.exchange_slots(op, &rows) {
            Ok(rows) => rows,
            Err(e) => return e,
        };
        let name_of = |r: &[i64]| {
            let bytes: Vec<u8> = r[1..].iter().flat_map(|v| v.to_le_bytes()).collect();
            String::from_utf8_lossy(&bytes)
                .trim_end_matches('\0')
                .to_string()
        };
        let (peer, theirs) = rows
            .chunks_exact(row)
            .enumerate()
            .find(|(_, r)| r[0] != count as i64 || name_of(r) != op)
            .unwrap_or((self.rank(), &rows[..row]));
        Error::CollectiveMismatch {
            op,
            rank: self.rank(),
            exchange: count,
            peer,
            peer_op: name_of(theirs),
            peer_exchange: theirs[0] as u64,
        }
    }

    /// The element-wise max of `values` over every rank (each rank passes as many), waited for
    /// under the timeout.
    fn exchange_slots(&self, op: &'static str, values: &[i64]) -> Result<Vec<i64>> {
        match &self.transport {
            Transport::Single => {
                let _ = op; // nothing to wait for
                Ok(values.to_vec())
            }
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => {
                let send: Box<[u8]> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                let mut recv = vec![0u8; send.len()].into_boxed_slice();
                // SAFETY: both boxes live until the requests complete: `finish_owned` waits for
                // them, or keeps them in `abandoned` for as long as MPI may use them.
                let requests = unsafe {
                    m.all_reduce(
                        send.as_ptr(),
                        recv.as_mut_ptr(),
                        values.len(),
                        DType::I64,
                        Reduce::Max,
                    )?
                };
                let recv = self.finish_owned(op, requests, vec![send, recv])?;
                Ok(recv
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect())
            }
        }
    }

    /// Rank `root`'s `bytes` (every rank passes a buffer of the same length).
    fn exchange_bytes(&self, op: &'static str, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        match &self.transport {
            Transport::Single => {
                let _ = (op, root); // this rank is the root
                Ok(bytes)
            }
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => {
                let mut buf = bytes.into_boxed_slice();
                // SAFETY: the box lives until the request completes (see `exchange_max`).
                let requests = unsafe { m.broadcast(buf.as_mut_ptr(), buf.len(), root)? };
                Ok(self.finish_owned(op, requests, vec![buf])?.into_vec())
            }
        }
    }

    /// Runs a blocking collective under the watchdog, counting its time as waiting.
    #[cfg(feature = "mpi")]
    fn watched<R>(&self, op: &'static str, call: impl FnOnce() -> R) -> R {
        let begin = Instant::now();
        let watchdog = self.watchdog.as_ref().expect("an MPI group has a watchdog");
        *watchdog.op.lock().unwrap_or_else(|e| e.into_inner()) = op;
        let due = watchdog.epoch.elapsed() + self.timeout.get();
        watchdog
            .deadline
            .store((due.as_millis() as u64).max(1), Ordering::Release);
        let out = call();
        watchdog.deadline.store(0, Ordering::Release);
        self.waited
            .set(self.waited.get() + begin.elapsed().as_secs_f64());
        out
    }

    /// Waits for an exchange on library-owned `buffers` and returns the last one; on timeout keeps
    /// them (MPI may still write them) and returns [`Error::CollectiveTimeout`].
    #[cfg(feature = "mpi")]
    fn finish_owned(
        &self,
        op: &'static str,
        requests: Requests,
        mut buffers: Vec<Box<[u8]>>,
    ) -> Result<Box<[u8]>> {
        let mut started = Started::Mpi(requests);
        if self.wait_for(&mut started) {
            return Ok(buffers.pop().expect("at least one buffer"));
        }
        let error = Error::CollectiveTimeout {
            op,
            rank: self.rank(),
            seconds: self.timeout.get().as_secs_f64(),
        };
        self.abandoned
            .borrow_mut()
            .push((started, buffers, error.to_string()));
        Err(error)
    }

    /// Starts an all-reduce of `send` into `recv` (for a [`Flight`], which keeps both borrowed
    /// until it completes).
    pub(crate) fn transport_all_reduce(
        &self,
        send: &[u8],
        recv: &mut [u8],
        elements: usize,
        dtype: DType,
        reduce: Reduce,
    ) -> Result<Started> {
        match &self.transport {
            Transport::Single => {
                recv.copy_from_slice(send);
                let _ = (elements, dtype, reduce);
                Ok(Started::Done)
            }
            #[cfg(feature = "mpi")]
            // SAFETY: the flight that calls this keeps both buffers borrowed until the requests
            // complete (it waits for every started transfer before it returns, panics included).
            Transport::Mpi(m) => Ok(Started::Mpi(unsafe {
                m.all_reduce(send.as_ptr(), recv.as_mut_ptr(), elements, dtype, reduce)?
            })),
        }
    }

    pub(crate) fn transport_broadcast(&self, buf: &mut [u8], root: usize) -> Result<Started> {
        self.check_root("broadcast", root)?;
        match &self.transport {
            Transport::Single => {
                let _ = buf; // rank 0's tensor is already everyone's
                Ok(Started::Done)
            }
            #[cfg(feature = "mpi")]
            // SAFETY: as in `transport_all_reduce`.
            Transport::Mpi(m) => Ok(Started::Mpi(unsafe {
                m.broadcast(buf.as_mut_ptr(), buf.len(), root)?
            })),
        }
    }

    pub(crate) fn transport_all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<Started> {
        match &self.transport {
            Transport::Single => {
                recv.copy_from_slice(send);
                Ok(Started::Done)
            }
            #[cfg(feature = "mpi")]
            // SAFETY: as in `transport_all_reduce`.
            Transport::Mpi(m) => Ok(Started::Mpi(unsafe {
                m.all_gather(send.as_ptr(), recv.as_mut_ptr(), send.len())?
            })),
        }
    }

    /// Moves started transfers on; whether they completed.
    pub(crate) fn poll(&self, started: &mut Started) -> bool {
        match (started, &self.transport) {
            (Started::Done, _) => true,
            #[cfg(feature = "mpi")]
            (Started::Mpi(requests), Transport::Mpi(m)) => m.test(requests),
            #[cfg(feature = "mpi")]
            (Started::Mpi(_), Transport::Single) => unreachable!("MPI requests of a single group"),
        }
    }

    /// Waits for `started` until the timeout; whether it completed.
    pub(crate) fn wait_for(&self, started: &mut Started) -> bool {
        let begin = Instant::now();
        let done = self.poll_until(started, begin + self.timeout.get());
        self.waited
            .set(self.waited.get() + begin.elapsed().as_secs_f64());
        done
    }

    /// Polls `started` until it completes or `deadline` passes; whether it completed.
    fn poll_until(&self, started: &mut Started, deadline: Instant) -> bool {
        let begin = Instant::now();
        let mut done = self.poll(started);
        while !done && Instant::now() < deadline {
            // Polling drives MPI's progress, so a transfer under way is polled back to back; one
            // still open after a few milliseconds is waiting for a peer, and is then polled every
            // 100 µs instead of spinning a core for up to the whole timeout.
            if begin.elapsed() < SPIN_BEFORE_SLEEPING {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
            done = self.poll(started);
        }
        done
    }

    /// Waits for a transfer whose buffers the caller borrows; a timeout ends the job (see
    /// [`set_timeout`](Self::set_timeout)).
    pub(crate) fn complete(&self, op: &'static str, started: &mut Started) {
        if !self.wait_for(started) {
            self.abort(&format!(
                "{op} did not complete in {} s: a peer never joined it (it died, hangs, or runs \
                 another step)",
                self.timeout.get().as_secs_f64()
            ));
        }
    }

    fn abort(&self, message: &str) -> ! {
        match &self.transport {
            Transport::Single => unreachable!("a world of one never waits: {message}"),
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.abort(message),
        }
    }

    /// Runs `f` with a [`Flight`] on which collectives start without waiting for each other (so
    /// bucketed all-reduces overlap); every collective started is complete when `in_flight`
    /// returns, whether `f` returned, failed or panicked. A tensor in flight stays mutably
    /// borrowed until then, so reading it, writing it, or closing its scope meanwhile does not
    /// compile.
    ///
    /// ```
    /// use ndscope::dist::{ProcessGroup, Reduce};
    /// use ndscope::{Device, root};
    ///
    /// let group = ProcessGroup::single();
    /// root(Device::Cpu, |s| {
    ///     let mut a = s.from_slice(&[1.0f32, 2.0], &[2])?;
    ///     let mut b = s.from_slice(&[3.0f64], &[1])?;
    ///     group.in_flight(|flight| {
    ///         let first = flight.all_reduce(&mut a, Reduce::Mean)?; // started
    ///         flight.all_reduce(&mut b, Reduce::Sum)?; // started too; waited for at the end
    ///         first.wait()?; // or wait for one now
    ///         Ok(())
    ///     })?;
    ///     assert_eq!(a.to_vec::<f32>()?, vec![1.0, 2.0]); // complete: readable again
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// What `f` returns, and the errors of finishing the collectives it started.
    pub fn in_flight<'g, R>(
        &'g self,
        f: impl for<'f> FnOnce(&'f Flight<'f, 'g>) -> Result<R>,
    ) -> Result<R> {
        let flight = Flight::new(self);
        // A panic in `f` must not unwind past the borrowed buffers while MPI may still use them:
        // complete everything first, then go on unwinding.
        let out = panic::catch_unwind(AssertUnwindSafe(|| f(&flight)));
        let finished = flight.finish();
        let out = out.unwrap_or_else(|payload| panic::resume_unwind(payload))?;
        finished?;
        Ok(out)
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        #[cfg(feature = "mpi")]
        if std::thread::panicking() && self.world_size() > 1 {
            // Finalizing here would leave the other ranks waiting in their next collective for a
            // whole timeout (and Open MPI may then crash or hang between one rank's finalize and
            // another's abort): end the job now. The panic's message is already printed above.
            self.abort("this rank panicked (its message is above), so its peers would wait for it");
        }
        #[cfg(feature = "mpi")]
        {
            let mut abandoned = std::mem::take(&mut *self.abandoned.borrow_mut());
            // A late peer may have completed a timed-out exchange; one still in MPI's hands would
            // make MPI_Finalize wait for it. Each already waited a whole timeout, so only a short
            // grace now; the job then ends with the timeout's own message, which the program may
            // not have printed yet (the group is often dropped on the way out of the error).
            let deadline = Instant::now() + ABANDONED_GRACE.min(self.timeout.get());
            for (started, _, error) in &mut abandoned {
                if !self.poll_until(started, deadline) {
                    self.abort(&format!(
                        "{error}; that exchange never completed, so MPI cannot finish cleanly"
                    ));
                }
            }
            // Finalize only when every rank is finishing too: a rank that leaves while another
            // still steps meets that rank's next exchange here, and both learn it (the other
            // rank as an `Error::CollectiveMismatch` naming this one); one that never comes is a
            // timeout. Either way the job must end now, not hang in MPI_Finalize.
            if self.world_size() > 1
                && let Err(e) = self.exchange_max(FINISHING, &mut [])
            {
                self.abort(&e.to_string());
            }
        }
        #[cfg(not(feature = "mpi"))]
        let _ = &self.abandoned;
    }
}
