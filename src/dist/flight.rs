//! Collectives in flight: started without waiting, their tensors borrowed until they complete.
//!
//! A started collective reads and writes its buffers while the program goes on; in PyTorch,
//! reading a gradient before `work.wait()` is a silent race. Here the [`Flight`] that started it
//! borrows the tensor for the whole flight (as `std::thread::scope` borrows what its threads use)
//! and completes everything it started before [`ProcessGroup::in_flight`] returns. Dropping or
//! leaking a [`Pending`] handle cannot end the borrow early: the flight, not the handle, holds the
//! buffers.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::panic::{self, AssertUnwindSafe};

use std::panic::Location;

use super::group::{ProcessGroup, Started};
use super::{Reduce, operands};
use crate::device::Device;
use crate::error::Result;
use crate::scope::StaysOnItsThread;
use crate::tensor::Tensor;

/// Collectives started and not yet waited for, inside [`ProcessGroup::in_flight`]. Collectives
/// must be started in the same order on every rank; they may be waited for in any order.
pub struct Flight<'f, 'g: 'f> {
    /// Neither `Send` nor `Sync`: MPI's requests belong to the thread that started them. The
    /// fields below are wrapped in [`OnItsThread`], so that this marker is all the compiler names
    /// when a program shares a flight with another thread.
    _thread: StaysOnItsThread,
    group: OnItsThread<&'g ProcessGroup>,
    /// In `ManuallyDrop` so that dropping the flight needs nothing of `'f` (the borrow checker
    /// would otherwise refuse to let the flight be borrowed for `'f`): [`finish`](Self::finish),
    /// which `in_flight` always runs, empties it.
    entries: OnItsThread<RefCell<ManuallyDrop<Vec<Option<Entry<'f>>>>>>,
    /// `'f` is invariant, as `std::thread::Scope`'s is, so a borrow for the flight cannot shrink.
    _invariant: PhantomData<fn(&'f ()) -> &'f ()>,
}

/// A field of [`Flight`], reached only through it.
struct OnItsThread<T>(T);

// SAFETY: an `OnItsThread` is only ever a private field of `Flight`, whose `StaysOnItsThread`
// marker makes it neither `Send` nor `Sync`, so the value inside is never reached from a thread
// other than the one that made the flight. These impls only keep the flight's internals out of
// the compiler's message when a program tries to share a flight (the marker is then all it names).
unsafe impl<T> Send for OnItsThread<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for OnItsThread<T> {}

impl<T> std::ops::Deref for OnItsThread<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// One started collective: its transfer, and what completes it (keeping its buffers alive).
struct Entry<'f> {
    op: &'static str,
    started: Started,
    finish: Box<dyn FnOnce() -> Result<()> + 'f>,
}

/// A collective started on a [`Flight`]; [`wait`](Self::wait) for it, or let the flight complete
/// it when `in_flight` returns.
pub struct Pending<'p, 'f, 'g: 'f> {
    flight: &'p Flight<'f, 'g>,
    index: usize,
}

/// An all-gather started on a [`Flight`]: [`wait`](Self::wait) returns the gathered tensor.
#[must_use = "the gathered tensor is returned by wait()"]
pub struct Gathering<'p, 'f, 'g: 'f, 's> {
    pending: Pending<'p, 'f, 'g>,
    out: Tensor<'s>,
}

impl fmt::Debug for Flight<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let open = self.entries.borrow().iter().filter(|e| e.is_some()).count();
        f.debug_struct("Flight").field("in_flight", &open).finish()
    }
}

impl fmt::Debug for Pending<'_, '_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("index", &self.index)
            .finish()
    }
}

impl fmt::Debug for Gathering<'_, '_, '_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gathering")
            .field("index", &self.pending.index)
            .field("shape", &self.out.shape())
            .finish()
    }
}

impl<'f, 'g: 'f> Flight<'f, 'g> {
    pub(crate) fn new(group: &'g ProcessGroup) -> Flight<'f, 'g> {
        Flight {
            _thread: StaysOnItsThread::default(),
            group: OnItsThread(group),
            entries: OnItsThread(RefCell::new(ManuallyDrop::new(Vec::new()))),
            _invariant: PhantomData,
        }
    }

    /// The group the collectives run in.
    pub fn group(&self) -> &'g ProcessGroup {
        self.group.0
    }

    fn push(&self, entry: Entry<'f>) -> Pending<'_, 'f, 'g> {
        let mut entries = self.entries.borrow_mut();
        entries.push(Some(entry));
        Pending {
            flight: self,
            index: entries.len() - 1,
        }
    }

    /// Starts the sum, mean, max or min of `t` over every rank; when it completes, `t` names the
    /// result (a new tensor of its scope). `t` stays borrowed until the flight ends.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) for a GPU tensor when its GPU
    /// or NCCL is missing; [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) for a
    /// reduction the dtype does not take (a mean of `i64`, a max of 16-bit floats); allocation
    /// errors.
    #[track_caller]
    pub fn all_reduce<'s: 'f>(
        &self,
        t: &'f mut Tensor<'s>,
        reduce: Reduce,
    ) -> Result<Pending<'_, 'f, 'g>> {
        let op = "all_reduce";
        reduce.check(t.dtype())?;
        if t.device() != Device::Cpu {
            // NCCL enqueues it on the GPU's stream, ahead of anything that later reads the result:
            // in flight by construction, and `t` stays borrowed all the same.
            let out = self.group.all_reduce(t, reduce)?;
            return Ok(self.done(op, move || *t = out));
        }
        let (src, mut out) = operands(t, t.shape(), Location::caller())?;
        let started = self.group.transport_all_reduce(
            src.host_bytes(op)?,
            out.host_bytes_mut(op)?,
            src.numel(),
            src.dtype(),
            reduce,
        )?;
        let world = self.group.world_size();
        Ok(self.push(Entry {
            op,
            started,
            finish: Box::new(move || {
                drop(src); // read by the transfer until now
                if reduce == Reduce::Mean && world > 1 {
                    out.mul_scalar_(1.0 / world as f64)?;
                }
                *t = out;
                Ok(())
            }),
        }))
    }

    /// Starts overwriting `t` on every rank with rank `root`'s `t`. `t` stays borrowed until the
    /// flight ends.
    ///
    /// # Errors
    /// [`Error::Distributed`](crate::Error::Distributed) when `root` is not a rank;
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) for a GPU tensor when its GPU
    /// or NCCL is missing.
    pub fn broadcast<'s: 'f>(
        &self,
        t: &'f mut Tensor<'s>,
        root: usize,
    ) -> Result<Pending<'_, 'f, 'g>> {
        if t.device() != Device::Cpu {
            self.group.broadcast_(t, root)?; // on the GPU's stream, as for `all_reduce`
            return Ok(self.done("broadcast", || ()));
        }
        let started = self
            .group
            .transport_broadcast(t.host_bytes_mut("broadcast")?, root)?;
        Ok(self.push(Entry {
            op: "broadcast",
            started,
            // `t` itself is borrowed for the flight, so its block outlives the transfer.
            finish: Box::new(|| Ok(())),
        }))
    }

    /// Starts gathering every rank's `t` into a new `[world_size, ..t.shape()]` tensor of `t`'s
    /// scope, in rank order. `t` stays borrowed (readable, not writable) until the flight ends.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) for a GPU tensor when its GPU
    /// or NCCL is missing; allocation errors.
    #[track_caller]
    pub fn all_gather<'s: 'f>(&self, t: &'f Tensor<'s>) -> Result<Gathering<'_, 'f, 'g, 's>> {
        let op = "all_gather";
        if t.device() != Device::Cpu {
            let out = self.group.all_gather(t)?; // on the GPU's stream, as for `all_reduce`
            let pending = self.done(op, || ());
            return Ok(Gathering { pending, out });
        }
        let mut shape = vec![self.group.world_size()];
        shape.extend_from_slice(t.shape());
        let (src, mut out) = operands(t, &shape, Location::caller())?;
        let started = self
            .group
            .transport_all_gather(src.host_bytes(op)?, out.host_bytes_mut(op)?)?;
        let held = out.clone();
        let pending = self.push(Entry {
            op,
            started,
            finish: Box::new(move || {
                drop((src, held)); // read and written by the transfer until now
                Ok(())
            }),
        });
        Ok(Gathering { pending, out })
    }

    /// An entry for a collective already ordered on a GPU's stream: complete for the host, with
    /// `finish` to run when it is waited for.
    fn done(&self, op: &'static str, finish: impl FnOnce() + 'f) -> Pending<'_, 'f, 'g> {
        self.push(Entry {
            op,
            started: Started::Done,
            finish: Box::new(move || {
                finish();
                Ok(())
            }),
        })
    }

    /// Moves every started collective on without waiting (MPI progresses non-blocking
    /// collectives when it is called): call it between pieces of work that should overlap them.
    pub fn progress(&self) {
        for entry in self.entries.borrow_mut().iter_mut().flatten() {
            self.group.poll(&mut entry.started);
        }
    }

    /// Waits for the collective at `index` and completes it.
    fn complete(&self, index: usize) -> Result<()> {
        let entry = self.entries.borrow_mut()[index].take();
        let Some(mut entry) = entry else {
            return Ok(());
        };
        self.group.complete(entry.op, &mut entry.started);
        (entry.finish)()
    }

    /// Completes every collective still in flight: first every transfer, in the order they
    /// started, then their finishers in the same order; the first error. A finisher that panics
    /// cannot leave a later transfer writing into buffers whose scopes the unwinding then closes:
    /// the transfers have all ended before any finisher runs, and the other finishers still run
    /// before the panic goes on.
    pub(crate) fn finish(&self) -> Result<()> {
        for entry in self.entries.borrow_mut().iter_mut().flatten() {
            self.group.complete(entry.op, &mut entry.started);
        }
        let count = self.entries.borrow().len();
        let mut first = Ok(());
        let mut panicked = None;
        for index in 0..count {
            let entry = self.entries.borrow_mut()[index].take();
            let Some(entry) = entry else {
                continue;
            };
            match panic::catch_unwind(AssertUnwindSafe(entry.finish)) {
                Ok(done) => {
                    if first.is_ok() {
                        first = done;
                    }
                }
                Err(payload) => {
                    panicked.get_or_insert(payload);
                }
            }
        }
        // Every entry is complete; free the list now, while `'f` lasts.
        drop(std::mem::take(&mut **self.entries.borrow_mut()));
        if let Some(payload) = panicked {
            panic::resume_unwind(payload);
        }
        first
    }
}

impl Pending<'_, '_, '_> {
    /// Waits until the collective completes on this rank and finishes it (for an all-reduce,
    /// the tensor then names the result; it stays borrowed until the flight ends).
    ///
    /// # Errors
    /// Allocation errors of finishing a mean.
    pub fn wait(self) -> Result<()> {
        self.flight.complete(self.index)
    }

    /// Whether the collective has completed (moving it on once).
    pub fn is_complete(&self) -> bool {
        let mut entries = self.flight.entries.borrow_mut();
        match &mut entries[self.index] {
            None => true,
            Some(entry) => self.flight.group.poll(&mut entry.started),
        }
    }
}

impl<'s> Gathering<'_, '_, '_, 's> {
    /// Waits until the gather completes and returns the gathered tensor.
    ///
    /// # Errors
    /// None at present; kept for symmetry with [`Pending::wait`].
    pub fn wait(self) -> Result<Tensor<'s>> {
        self.pending.wait()?;
        Ok(self.out)
    }

    /// The gathered tensor, once the gather has completed (waiting for it).
    pub(crate) fn into_output(self) -> Tensor<'s> {
        let _ = self.pending.flight.complete(self.pending.index);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn a_panicking_finisher_lets_every_other_finisher_run_and_then_goes_on_unwinding() {
        let group = ProcessGroup::single();
        let flight = Flight::new(&group);
        let ran = Cell::new(0);
        flight.push(Entry {
            op: "first",
            started: Started::Done,
            finish: Box::new(|| panic!("the first finisher fails")),
        });
        flight.push(Entry {
            op: "second",
            started: Started::Done,
            finish: Box::new(|| {
                ran.set(ran.get() + 1);
                Ok(())
            }),
        });
        let unwound = panic::catch_unwind(AssertUnwindSafe(|| flight.finish()));
        let message = unwound.expect_err("the finisher's panic goes on");
        assert_eq!(
            message.downcast_ref::<&str>(),
            Some(&"the first finisher fails")
        );
        assert_eq!(
            ran.get(),
            1,
            "the later finisher ran before the panic went on"
        );
        assert!(flight.entries.borrow().is_empty(), "every entry is gone");
    }
}
