//! Fault injection: make the n-th allocation of a tree fail, to test that every failure point of a
//! program (a training step, say) leaves the scope tree consistent and loses nothing.

use std::cell::Cell;

use crate::error::Result;
use crate::scope::node::{ScopeNode, over_budget};

/// What an injected fault does at the allocation it hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The allocation is refused as over budget: it returns
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) with a budget equal to the bytes the
    /// scope's subtree holds, exactly as a real budget refusal would.
    OutOfBudget,
    /// The allocation panics, as a bug inside an op would.
    Panic,
}

/// A countdown to the allocation that fails.
#[derive(Default)]
pub(crate) struct FaultPlan {
    armed: Cell<Option<(u64, Fault)>>,
}

impl FaultPlan {
    pub(crate) fn arm(&self, nth: u64, fault: Fault) {
        self.armed.set((nth > 0).then_some((nth, fault)));
    }

    pub(crate) fn disarm(&self) {
        self.armed.set(None);
    }

    pub(crate) fn is_armed(&self) -> bool {
        self.armed.get().is_some()
    }

    /// Counts one allocation of `bytes` in `node`; fails it when the countdown reaches it.
    #[inline]
    pub(crate) fn on_alloc(&self, node: &ScopeNode, bytes: usize) -> Result<()> {
        let Some((left, fault)) = self.armed.get() else {
            return Ok(());
        };
        if left > 1 {
            self.armed.set(Some((left - 1, fault)));
            return Ok(());
        }
        self.armed.set(None);
        match fault {
            Fault::OutOfBudget => {
                node.stats.borrow_mut().ooms += 1;
                let live = node.stats.borrow().subtree_bytes;
                Err(over_budget(node.name, node.device, bytes, live, live, node))
            }
            Fault::Panic => panic!(
                "injected fault: panic at an allocation of {bytes} bytes in scope \"{}\"",
                node.name
            ),
        }
    }
}
