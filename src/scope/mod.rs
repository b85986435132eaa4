//! Scopes: the managers that own tensor memory.
//!
//! [`root`] opens a tree; [`Scope::scope`] opens a child that closes when its closure returns. A
//! tensor created in a scope carries the scope's lifetime, so the borrow checker refuses every program
//! in which a tensor outlives its scope. See the crate docs for the rules and `docs/why-not-compile.md`
//! for what the compiler's messages mean.

pub(crate) mod dump;
mod fault;
mod movable;
pub(crate) mod node;
pub(crate) mod system;
mod timeline;

use std::marker::PhantomData;
use std::ops::Deref;
use std::panic::Location;

pub use fault::Fault;
pub use movable::{Movable, MoveOut};
pub use system::system_stats;
pub use timeline::{EventKind, MemoryEvent, Timeline};

use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::arena::Workspace;
use crate::memory::stats::{MemoryStats, ScopeStats};
use crate::rng::Stream;
use node::{CloseOnDrop, ScopeName, ScopeNode, TreeState};

/// A memory manager that owns the tensors created in it; `'s` is its brand.
///
/// The brand is invariant: a `Scope<'a>` never passes for a `Scope<'b>`, so a scope is the only one
/// that can hand out `Tensor<'s>` for its `'s`, and a child's `ret` only accepts its own tensors (or
/// tensors of longer-lived scopes, which are safe to return anyway). A `Scope` is neither `Send` nor
/// `Sync`: scopes nest strictly in time on one thread.
pub struct Scope<'s> {
    pub(crate) node: ScopeNode,
    _brand: PhantomData<fn(&'s ()) -> &'s ()>,
    _thread: StaysOnItsThread,
}

/// Makes [`Scope`] (and so [`Child`]) neither `Send` nor `Sync`, and the types of other modules
/// that must stay on their thread (`dist::Flight`, `dist::ProcessGroup`). When a program tries to
/// share one with another thread, the compiler names this marker instead of the type's internals.
#[derive(Default)]
pub(crate) struct StaysOnItsThread(PhantomData<*const ()>);

/// A scope opened inside a parent scope `'p`; it dereferences to its own [`Scope<'c>`].
///
/// The closure of [`Scope::scope`] receives `&'c Child<'c, 'p>`; the reference's lifetime makes the
/// compiler assume `'p: 'c` (the parent outlives the child), which is what lets [`Child::ret`] turn a
/// `Tensor<'c>` into a `Tensor<'p>`.
pub struct Child<'c, 'p> {
    scope: Scope<'c>,
    parent: &'c Scope<'p>,
}

impl<'c> Deref for Child<'c, '_> {
    type Target = Scope<'c>;
    fn deref(&self) -> &Scope<'c> {
        &self.scope
    }
}

/// Opens a scope tree on `device` and runs `f` in its root scope. Every tensor of the tree is freed
/// when `f` returns or unwinds, including tensors whose handles were forgotten.
///
/// The closure returns a `Result` whose error type can hold an [`Error`](crate::Error), so `?` works inside it.
///
/// ```
/// use ndscope::{Device, root};
/// let total = root(Device::Cpu, |s| {
///     let x = s.from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
///     x.sum_all()?.to_scalar::<f32>()
/// })?;
/// assert_eq!(total, 6.0);
/// # Ok::<(), ndscope::Error>(())
/// ```
///
/// # Errors
/// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) when `device` cannot be used by this build or machine; otherwise
/// whatever `f` returns.
#[track_caller]
pub fn root<R, E, F>(device: Device, f: F) -> std::result::Result<R, E>
where
    E: From<crate::Error>,
    F: for<'s> FnOnce(&'s Scope<'s>) -> std::result::Result<R, E>,
{
    device.check_available()?;
    let tree = TreeState::new();
    let scope = Scope {
        node: ScopeNode::new(&tree, None, ScopeName::Named("root"), device),
        _brand: PhantomData,
        _thread: StaysOnItsThread::default(),
    };
    scope.node.link(None);
    let _close = CloseOnDrop(&scope.node);
    f(&scope)
}

impl<'s> Scope<'s> {
    fn child<'c>(&'c self, name: ScopeName) -> Child<'c, 's> {
        let node = ScopeNode::new(self.node.tree(), Some(&self.node), name, self.node.device);
        Child {
            scope: Scope {
                node,
                _brand: PhantomData,
                _thread: StaysOnItsThread::default(),
            },
            parent: self,
        }
    }

    /// Runs `f` in `child`, which sits at its final address: links it into the tree and closes it when
    /// `f` returns or unwinds.
    fn enter<'c, R>(
        child: &'c Child<'c, 's>,
        arena: Option<&mut Workspace>,
        f: impl FnOnce(&'c Child<'c, 's>) -> R,
    ) -> R {
        child.scope.node.link(arena);
        let _close = CloseOnDrop(&child.scope.node);
        f(child)
    }

    /// Opens a child scope, runs `f` in it, and closes it: every tensor created in the child and not
    /// moved out with [`Child::ret`] is freed. Nothing that mentions the child's lifetime can leave
    /// the closure.
    ///
    /// ```
    /// # use ndscope::{Device, root};
    /// root(Device::Cpu, |model| {
    ///     let w = model.ones(&[4])?;
    ///     let doubled = model.scope(|batch| {
    ///         let x = batch.full(&[4], 2.0)?;
    ///         let y = x.mul(&w)?;          // a model tensor beside a batch tensor: typed in the batch
    ///         batch.ret(y)                 // moved to the model scope, no copy
    ///     })?;
    ///     assert_eq!(doubled.to_vec::<f32>()?, vec![2.0; 4]);
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn scope<R>(&self, f: impl for<'c> FnOnce(&'c Child<'c, 's>) -> R) -> R {
        let child = self.child(ScopeName::Site(Location::caller()));
        Self::enter(&child, None, f)
    }

    /// Like [`scope`](Self::scope), with a name shown by [`dump`](Self::dump) and in errors.
    pub fn named_scope<R>(
        &self,
        name: &'static str,
        f: impl for<'c> FnOnce(&'c Child<'c, 's>) -> R,
    ) -> R {
        let child = self.child(ScopeName::Named(name));
        Self::enter(&child, None, f)
    }

    /// Opens a child scope backed by the arena of `ws` for one cycle. Its allocations bump a pointer
    /// in the arena (or spill to the pool when it is full); when the closure returns the arena is reset
    /// in O(1) and grown to what the cycle needed, ready for the next cycle. Move results out with
    /// [`Child::ret`] (a copy into the parent's memory: the arena is reused).
    pub fn workspace<R>(
        &self,
        ws: &mut Workspace,
        f: impl for<'c> FnOnce(&'c Child<'c, 's>) -> R,
    ) -> R {
        let child = self.child(ScopeName::Named(ws.name()));
        Self::enter(&child, Some(ws), f)
    }

    /// Opens a child scope and moves whatever the closure returns to this scope in one step, as
    /// MXNet's `ResourceScope.using` did. Name the returned type with its lifetime elided:
    ///
    /// ```
    /// # use ndscope::{Device, root, Tensor};
    /// root(Device::Cpu, |s| {
    ///     let (a, b) = s.scope_moved::<(Tensor, Tensor), _>(|c| {
    ///         let a = c.ones(&[2])?;
    ///         let b = a.add_scalar(1.0)?;
    ///         Ok((a, b))
    ///     })?;
    ///     assert_eq!(b.to_vec::<f32>()?, vec![2.0, 2.0]);
    ///     # let _ = a;
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn scope_moved<T, F>(&self, f: F) -> Result<T::Moved<'s>>
    where
        T: Movable<'s>,
        F: for<'c> FnOnce(&'c Child<'c, 's>) -> Result<T::Moved<'c>>,
        for<'c> T::Moved<'c>: Movable<'c, Moved<'s> = T::Moved<'s>>,
    {
        let child = self.child(ScopeName::Site(Location::caller()));
        Self::enter(&child, None, |c| f(c)?.move_into(self))
    }

    /// The scope's name (unnamed scopes are named by where they were opened).
    pub fn name(&self) -> String {
        self.node.name.to_string()
    }

    /// The device of the scope's memory.
    pub fn device(&self) -> Device {
        self.node.device
    }

    /// A snapshot of the scope's memory counters.
    pub fn stats(&self) -> ScopeStats {
        let mut s = *self.node.stats.borrow();
        s.cached_bytes = self.node.tree().cached_bytes();
        s
    }

    /// Restarts `peak_bytes` from the current `subtree_bytes`.
    pub fn reset_peak(&self) {
        let mut s = self.node.stats.borrow_mut();
        s.peak_bytes = s.subtree_bytes;
    }

    /// The whole tree (from its root) as text: each scope with its counters, each live tensor with its
    /// name, dtype, shape, bytes, handle count and the source line that created it. The ndscope answer
    /// to DJL's `debugDump`.
    pub fn dump(&self) -> String {
        dump::dump_tree(self.node.root())
    }

    /// Shows `note`'s line under this scope in [`dump`](Self::dump) while it lives.
    pub(crate) fn add_note(&self, note: std::sync::Weak<dyn node::Note>) {
        self.node.add_note(note);
    }

    /// Refuses any further block in this scope (allocations and moves in) with [`Error::Capped`](crate::Error::Capped), as
    /// DJL's `NDManager.cap()` does. Child scopes are unaffected.
    pub fn cap(&self) {
        self.node.set_capped(true);
    }

    /// Lifts [`cap`](Self::cap).
    pub fn uncap(&self) {
        self.node.set_capped(false);
    }

    /// Whether [`cap`](Self::cap) is in force.
    pub fn is_capped(&self) -> bool {
        self.node.is_capped()
    }

    /// Makes this scope refuse new tensors while one of its child scopes is open, with
    /// [`Error::OuterAllocation`](crate::Error::OuterAllocation) naming the child and the line that
    /// made the tensor; `false` goes back to counting them. Moves in (`ret`) are still accepted.
    ///
    /// Every scope counts such allocations ([`ScopeStats::outer_allocations`] and a line in
    /// [`dump`](Self::dump)): a step computing in the model scope because its inputs were created
    /// there (an op's result belongs to the innermost owner of its operands) is the leak DJL's docs
    /// warn about ("an intermediate NDArray gets into an upper-level NDManager"). A strict model
    /// scope turns it into an error at the first such tensor:
    ///
    /// ```
    /// use ndscope::{Device, Error, root};
    /// root(Device::Cpu, |model| {
    ///     model.set_strict(true);
    ///     let w = model.ones(&[4])?;                       // before any child: fine
    ///     let err = model.scope(|batch| -> ndscope::Result<()> {
    ///         let x = batch.full(&[4], 2.0)?;
    ///         let _fine = w.mul(&x)?;                       // owned by the batch
    ///         let input = model.from_slice(&[1.0f32; 4], &[4])?; // the mistake
    ///         let _y = w.mul(&input)?;
    ///         Ok(())
    ///     });
    ///     assert!(matches!(err, Err(Error::OuterAllocation { .. })));
    ///     assert_eq!(model.stats().outer_allocations, 0); // refused, not counted
    ///     Ok::<_, Error>(())
    /// })?;
    /// # Ok::<(), Error>(())
    /// ```
    pub fn set_strict(&self, strict: bool) {
        self.node.set_strict(strict);
    }

    /// Whether [`set_strict`](Self::set_strict) is in force.
    pub fn is_strict(&self) -> bool {
        self.node.is_strict()
    }

    /// Limits the live bytes of this scope and every scope below it. An allocation that would exceed
    /// it returns [`Error::OutOfMemory`](crate::Error::OutOfMemory) with the tree dump; `None` removes the limit.
    pub fn set_budget(&self, bytes: Option<usize>) {
        self.node.set_budget(bytes);
    }

    /// The byte budget of this scope's subtree, if one is set.
    pub fn budget(&self) -> Option<usize> {
        self.node.budget()
    }

    /// Mixed precision for the differentiable ops recorded on tapes of this scope and of the scopes
    /// opened inside it later (PyTorch's `torch.autocast`): matrix products and convolutions cast
    /// their operands to `dtype` (`DType::BF16` or `DType::F16`) and compute in it; an elementwise op
    /// whose operands mix float dtypes runs in `dtype`; softmax, log-softmax, the losses and layer
    /// and RMS norms run in `f32`; batch norm keeps its input's dtype (its sums accumulate in `f32`).
    /// The casts of the parameters live in this scope and are freed with it, so the model scope keeps
    /// `f32` master weights and optimizer state, and the gradients come back in the parameters'
    /// dtype. `dump()` shows `[autocast bf16]` on the scope.
    ///
    /// ```
    /// use ndscope::nn::{self, Activation, Init, Mode, Module};
    /// use ndscope::{DType, Device, Tape, root};
    ///
    /// root(Device::Cpu, |m| {
    ///     let model = nn::mlp(m, &[4, 8, 3], Activation::Relu, Init::KaimingUniform)?;
    ///     m.scope(|b| {
    ///         b.autocast(DType::BF16)?;
    ///         let tape = Tape::new(b);
    ///         let x = tape.constant(&b.randn(&[2, 4])?);
    ///         let logits = model.forward(&x, Mode::Train)?;
    ///         assert_eq!(logits.value().dtype(), DType::BF16); // computed in bf16
    ///         let loss = logits.cross_entropy(&b.from_slice(&[0i64, 2], &[2])?)?;
    ///         assert_eq!(loss.value().dtype(), DType::F32); // losses in f32
    ///         let grads = tape.backward(&loss)?;
    ///         assert!(grads.iter().all(|g| g.dtype() == DType::F32)); // as the parameters
    ///         assert!(b.dump().contains("[autocast bf16]"));
    ///         Ok(())
    ///     })
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) for a dtype other than `bf16` and
    /// `f16`.
    pub fn autocast(&self, dtype: DType) -> Result<()> {
        if !dtype.is_half() {
            return Err(crate::Error::UnsupportedDType {
                op: "autocast",
                dtype,
                expected: "a 16-bit float dtype (DType::BF16 or DType::F16)",
            });
        }
        self.node.set_autocast(Some(dtype));
        Ok(())
    }

    /// Ends [`autocast`](Self::autocast) in this scope (scopes opened later inside it inherit that).
    pub fn no_autocast(&self) {
        self.node.set_autocast(None);
    }

    /// The dtype [`autocast`](Self::autocast) computes matrix products in here, if any.
    pub fn autocast_dtype(&self) -> Option<DType> {
        self.node.autocast()
    }

    /// Lets `f32` matrix products whose output this scope owns (and those of scopes opened inside it
    /// later) read their operands as TF32 on a GPU's tensor cores: 10-bit significands, `f32`
    /// accumulation and range, several times the speed. Off by default, as in PyTorch
    /// (`torch.backends.cuda.matmul.allow_tf32`); the host always computes in full `f32`. `dump()`
    /// shows `[tf32 products]` on the scope.
    ///
    /// ```
    /// use ndscope::{Device, root};
    ///
    /// root(Device::Cpu, |s| {
    ///     assert!(!s.allows_tf32());
    ///     s.allow_tf32(true);
    ///     s.scope(|inner| {
    ///         assert!(inner.allows_tf32()); // inherited
    ///         Ok(())
    ///     })?;
    ///     assert!(s.dump().contains("[tf32 products]"));
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn allow_tf32(&self, allowed: bool) {
        self.node.set_tf32(allowed);
    }

    /// Whether [`allow_tf32`](Self::allow_tf32) is in force here.
    pub fn allows_tf32(&self) -> bool {
        self.node.tf32()
    }

    /// Hands every cached free block of the tree back to the system allocator and returns how many
    /// bytes that released. Live tensors are unaffected; later allocations refill the cache. Large
    /// host blocks go back lazily ([`lazily_freed_host_bytes`](crate::lazily_freed_host_bytes)).
    pub fn empty_cache(&self) -> usize {
        self.node.tree().empty_cache()
    }

    /// Hands cached free blocks back to the system allocator, largest first, until at most
    /// `max_cached` bytes stay cached, and returns how many bytes that released. A long-running
    /// program can call it between phases to bound the cache without losing it entirely.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// drop((s.zeros(&[1 << 16])?, s.zeros(&[16])?)); // 256 KiB and 64 B go to the cache
    /// s.trim_cache(1024);
    /// assert!(s.stats().cached_bytes <= 1024);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    pub fn trim_cache(&self, max_cached: usize) -> usize {
        self.node.tree().trim_cache(max_cached)
    }

    /// The tree's memory on `device`: live, allocated, reserved and cached bytes with their peaks,
    /// the device allocator's calls, refusals and the retries they caused. All zero for a device the
    /// tree has not allocated on.
    ///
    /// ```
    /// use ndscope::{DType, Device, root};
    /// root(Device::Cpu, |s| {
    ///     let big = s.empty(&[4 << 20], DType::F32)?; // 16 MiB: a segment of its own
    ///     drop(big);
    ///     let m = s.memory_stats(Device::Cpu);
    ///     assert_eq!((m.live_bytes, m.peak_live_bytes), (0, 16 << 20));
    ///     assert_eq!((m.reserved_bytes, m.cached_bytes, m.segments), (16 << 20, 16 << 20, 1));
    ///     assert_eq!(m.fragmentation(), 1.0);
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn memory_stats(&self, device: Device) -> MemoryStats {
        self.node.tree().memory_stats(device)
    }

    /// Restarts the peaks of [`memory_stats`](Self::memory_stats) (every device of the tree) from the
    /// current values, to measure a phase of a program on its own.
    pub fn reset_memory_peaks(&self) {
        self.node.tree().reset_memory_peaks();
    }

    /// Bounds the idle bytes the tree keeps cached on `device` (`None`: no bound), returning idle
    /// blocks beyond it to the device's allocator now and whenever a freed block takes the cache
    /// over the bound. Host memory is bounded by default to an eighth of the machine's physical memory,
    /// so that a cache alone never drives a process into the kernel's OOM killer; GPU memory is not,
    /// since the GPU's allocator refuses instead, and a refusal makes every tree on the GPU release
    /// its idle blocks before the request is retried. Idle space inside a segment that still holds a
    /// live tensor stays cached until the segment empties. Host memory past the limit goes back to
    /// the kernel lazily: its pages stay mapped for a later request of its size until the kernel
    /// needs them ([`lazily_freed_host_bytes`](crate::lazily_freed_host_bytes)).
    ///
    /// ```
    /// use ndscope::{Device, root};
    /// root(Device::Cpu, |s| {
    ///     s.set_cache_limit(Device::Cpu, Some(1 << 20));
    ///     drop(s.zeros(&[1 << 20])?); // 4 MiB in a 20 MiB segment, idle once the tensor drops
    ///     assert_eq!(s.stats().cached_bytes, 0, "over the limit: returned to the system");
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn set_cache_limit(&self, device: Device, max_cached: Option<usize>) {
        self.node.tree().set_cache_limit(device, max_cached);
    }

    /// Fault injection for tests: the `nth` allocation from now anywhere in this scope's tree
    /// (counting from 1) fails with `fault`, once. Run a step once to count its allocations
    /// (`stats().allocations`), then inject a fault at each of them in turn to check that every failure
    /// point leaves the tree consistent. `nth == 0` disarms.
    ///
    /// ```
    /// use ndscope::{Device, Error, Fault, root};
    /// root(Device::Cpu, |s| {
    ///     s.inject_fault(2, Fault::OutOfBudget);
    ///     let a = s.zeros(&[4])?;                   // the first allocation succeeds
    ///     let b = a.add_scalar(1.0);                // the second is refused
    ///     assert!(matches!(b, Err(Error::OutOfMemory { .. })));
    ///     assert!(a.add_scalar(1.0).is_ok());       // the fault fired once
    ///     Ok::<_, Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn inject_fault(&self, nth: u64, fault: Fault) {
        self.node.tree().faults.arm(nth, fault);
    }

    /// Disarms a fault set with [`inject_fault`](Self::inject_fault) that has not fired yet; returns
    /// whether one was armed.
    pub fn clear_fault(&self) -> bool {
        let faults = &self.node.tree().faults;
        let armed = faults.is_armed();
        faults.disarm();
        armed
    }

    /// Starts recording a memory timeline for this scope's whole tree: every allocation, free, move
    /// and reclaim, with its time, scope, bytes and tensor. Restarting discards what was recorded.
    /// Recording costs one small record per event; it is off unless started.
    ///
    /// ```
    /// use ndscope::{Device, root};
    /// root(Device::Cpu, |model| {
    ///     model.record_timeline();
    ///     for _ in 0..3 {
    ///         model.named_scope("batch", |b| b.ones(&[256]).map(drop))?;
    ///         model.mark_step();
    ///     }
    ///     let timeline = model.take_timeline();
    ///     assert_eq!(timeline.events().len(), 6); // an alloc and a free per step
    ///     assert_eq!(timeline.live_bytes_by_scope()["batch"].last(), Some(&(timeline.events()[5].time_us, 0)));
    ///     assert!(timeline.to_svg("batches").starts_with("<svg"));
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn record_timeline(&self) {
        self.node.tree().timeline.start(self.node.root());
    }

    /// Stops recording and returns the timeline recorded since [`record_timeline`](Self::record_timeline)
    /// (empty if it was not started).
    pub fn take_timeline(&self) -> Timeline {
        self.node.tree().timeline.stop()
    }

    /// Advances the step counter that recorded events carry (call it once per training step); returns
    /// the new step number.
    pub fn mark_step(&self) -> u64 {
        self.node.tree().timeline.mark_step()
    }

    /// Reseeds the tree's random generator (used by [`rand`](Self::rand), [`randn`](Self::randn),
    /// dropout and the initialisers): the next draws are those of a tree that started with `seed`.
    pub fn set_seed(&self, seed: u64) {
        self.node.tree().random.set(Stream::new(seed));
    }

    /// The tree's random generator as it stands: a checkpointed segment keeps it to replay its draws
    /// (dropout) when it is recomputed.
    pub(crate) fn random_stream(&self) -> Stream {
        self.node.tree().random.get()
    }

    /// Puts the tree's random generator where [`random_stream`](Self::random_stream) found it.
    pub(crate) fn set_random_stream(&self, stream: Stream) {
        self.node.tree().random.set(stream);
    }

    /// Places op results in this scope (unless an operand's owner closes sooner) until the guard
    /// drops. Only for code whose every result is typed with this scope's brand (see
    /// [`Placement`](node::Placement)).
    pub(crate) fn place_results(&self) -> node::Placement<'_> {
        node::Placement::into(&self.node)
    }

    /// The seed of the tree's generator and the first counter of a draw of `n` elements, which the
    /// generator skips past.
    pub(crate) fn reserve_random(&self, n: usize) -> (u64, u64) {
        let cell = &self.node.tree().random;
        let mut stream = cell.get();
        let first = stream.reserve(n);
        cell.set(stream);
        (stream.seed, first)
    }
}

impl<'c, 'p> Child<'c, 'p> {
    /// Moves `value` (a tensor, or a tuple, array, `Vec`, `Option` or user type of tensors) to the
    /// parent scope, so it outlives this one. Pool blocks change owner without copying; arena blocks
    /// (workspace scopes) are copied into the parent's memory.
    ///
    /// # Errors
    /// When the parent is capped or over budget, or a copy cannot be allocated.
    pub fn ret<T: Movable<'c>>(&self, value: T) -> Result<T::Moved<'p>> {
        value.move_into(self.parent)
    }

    /// The parent scope.
    pub fn parent(&self) -> &'c Scope<'p> {
        self.parent
    }
}

impl std::fmt::Debug for Child<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Child")
            .field("scope", &self.scope)
            .field("parent", &self.parent.name())
            .finish()
    }
}

impl std::fmt::Debug for Scope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("name", &self.name())
            .field("device", &self.device())
            .finish()
    }
}
