//! Random programs of nested scopes (pool and workspace), checked against a simple model.
//!
//! A program allocates, computes (arithmetic, views, reductions), clones, drops, forgets, returns
//! (`ret`), moves (`move_to`) and detaches tensors, caps its scope or sets a budget and allocates
//! anyway, opens child scopes and panics inside them. After every step each live handle must still hold
//! the values the model says (a use-after-free, a double free or an arena overwrite would change them);
//! a scope never owns more blocks than its handles and forgotten handles account for; every closing
//! scope must hand exactly its remaining blocks to the reclaim count; a subtree that forgot nothing must
//! close with nothing left; and detached tensors must keep their values after the tree is gone, and
//! free them when dropped. CI runs 4,096 programs;
//! `PROPTEST_CASES=100000 cargo test --release --test scope_programs` runs a longer campaign.

use std::panic::{AssertUnwindSafe, catch_unwind};

use ndscope::{Child, Device, Result, Tensor, Workspace, root};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Action {
    /// A new tensor of `len` elements, all equal to `value`.
    Alloc {
        len: usize,
        value: i8,
    },
    /// `3 * t` through two temporaries.
    Compute(usize),
    /// A view of the first half (sharing the block).
    View(usize),
    /// `max(-t, 0)` through two temporaries.
    NegRelu(usize),
    /// The sum of all elements (when it is exact in `f32`).
    SumAll(usize),
    /// `move_to` the parent scope.
    MoveUp(usize),
    /// Cap the scope, check that an allocation is refused, uncap.
    CappedAlloc,
    /// Set a budget of exactly the live bytes, check that an allocation is refused, lift it.
    OverBudgetAlloc,
    Clone(usize),
    Drop(usize),
    Forget(usize),
    Ret(usize),
    Detach(usize),
    /// A child scope (a workspace cycle when `workspace`) running its own program.
    Child {
        workspace: bool,
        program: Vec<Action>,
    },
    Panic,
}

fn program() -> impl Strategy<Value = Vec<Action>> {
    let leaf = prop_oneof![
        4 => (0usize..40, any::<i8>()).prop_map(|(len, value)| Action::Alloc { len, value }),
        2 => any::<usize>().prop_map(Action::Compute),
        1 => any::<usize>().prop_map(Action::View),
        1 => any::<usize>().prop_map(Action::NegRelu),
        1 => any::<usize>().prop_map(Action::SumAll),
        1 => any::<usize>().prop_map(Action::MoveUp),
        1 => Just(Action::CappedAlloc),
        1 => Just(Action::OverBudgetAlloc),
        2 => any::<usize>().prop_map(Action::Clone),
        2 => any::<usize>().prop_map(Action::Drop),
        1 => any::<usize>().prop_map(Action::Forget),
        2 => any::<usize>().prop_map(Action::Ret),
        1 => any::<usize>().prop_map(Action::Detach),
        1 => Just(Action::Panic),
    ];
    let action = leaf.prop_recursive(3, 48, 8, |inner| {
        prop_oneof![
            4 => inner.clone(),
            1 => (any::<bool>(), prop::collection::vec(inner, 0..8))
                .prop_map(|(workspace, program)| Action::Child { workspace, program }),
        ]
    });
    prop::collection::vec(action, 0..16)
}

/// A live handle and the values the model expects it to hold.
struct Held<'s> {
    t: Tensor<'s>,
    want: Vec<f32>,
}

/// What a run observed, for checks after the tree has closed.
#[derive(Default)]
struct Run {
    detached: Vec<Held<'static>>,
    panics: usize,
}

fn check(held: &[Held<'_>]) {
    for (i, h) in held.iter().enumerate() {
        assert_eq!(
            h.t.to_vec::<f32>().unwrap(),
            h.want,
            "handle {i} changed under us"
        );
    }
}

/// Runs `program` in `c`, returning values to `up` (the parent's handles). Returns whether anything
/// in this subtree was forgotten.
fn exec<'c, 'p>(
    c: &Child<'c, 'p>,
    program: &[Action],
    up: &mut Vec<Held<'p>>,
    workspaces: &mut [Workspace],
    run: &mut Run,
) -> Result<bool> {
    let mut local: Vec<Held<'c>> = Vec::new();
    let mut forgot = false;
    let mut forgotten_here = 0;
    for action in program {
        let n = local.len();
        match action {
            Action::Alloc { len, value } => {
                let v = *value as f32;
                local.push(Held {
                    t: c.full(&[*len], f64::from(v))?,
                    want: vec![v; *len],
                });
            }
            Action::Compute(i) if n > 0 => {
                let h = &local[i % n];
                let t = h.t.mul_scalar(2.0)?.add(&h.t)?;
                let want = h.want.iter().map(|v| v * 3.0).collect();
                local.push(Held { t, want });
            }
            Action::View(i) if n > 0 => {
                let h = &local[i % n];
                let half = h.want.len() / 2;
                local.push(Held {
                    t: h.t.narrow(0, 0, half)?,
                    want: h.want[..half].to_vec(),
                });
            }
            Action::NegRelu(i) if n > 0 => {
                let h = &local[i % n];
                let want = h.want.iter().map(|v| (-v).max(0.0)).collect();
                local.push(Held {
                    t: h.t.neg()?.relu()?,
                    want,
                });
            }
            Action::SumAll(i) if n > 0 => {
                let h = &local[i % n];
                // Exact in f32 whatever the summation order: every partial sum is an integer < 2^24.
                let exact =
                    h.want.iter().map(|v| f64::from(v.abs())).sum::<f64>() < f64::from(1u32 << 24);
                if exact {
                    local.push(Held {
                        t: h.t.sum_all()?.reshape(&[1])?,
                        want: vec![h.want.iter().sum()],
                    });
                }
            }
            Action::MoveUp(i) if n > 0 => {
                let h = local.swap_remove(i % n);
                up.push(Held {
                    t: h.t.move_to(c.parent())?,
                    want: h.want,
                });
            }
            Action::CappedAlloc => {
                let before = c.stats();
                c.cap();
                let refused = c.full(&[4], 1.0);
                c.uncap();
                assert!(
                    matches!(refused, Err(ndscope::Error::Capped { .. })),
                    "a capped scope allocated"
                );
                assert_eq!(c.stats().live_bytes, before.live_bytes);
            }
            Action::OverBudgetAlloc => {
                let before = c.stats();
                c.set_budget(Some(before.subtree_bytes));
                let refused = c.full(&[4], 1.0);
                c.set_budget(None);
                assert!(
                    matches!(refused, Err(ndscope::Error::OutOfMemory { .. })),
                    "an allocation past the budget succeeded"
                );
                let after = c.stats();
                assert_eq!(
                    (after.live_bytes, after.ooms),
                    (before.live_bytes, before.ooms + 1)
                );
            }
            Action::Clone(i) if n > 0 => {
                let h = &local[i % n];
                local.push(Held {
                    t: h.t.clone(),
                    want: h.want.clone(),
                });
            }
            Action::Drop(i) if n > 0 => drop(local.swap_remove(i % n)),
            Action::Forget(i) if n > 0 => {
                std::mem::forget(local.swap_remove(i % n).t);
                forgot = true;
                forgotten_here += 1;
            }
            Action::Ret(i) if n > 0 => {
                let h = local.swap_remove(i % n);
                up.push(Held {
                    t: c.ret(h.t)?,
                    want: h.want,
                });
            }
            Action::Detach(i) if n > 0 => {
                let h = local.swap_remove(i % n);
                run.detached.push(Held {
                    t: h.t.move_out()?,
                    want: h.want,
                });
            }
            Action::Child { workspace, program } => {
                let (ws, rest) = match workspaces.split_first_mut() {
                    Some((first, rest)) if *workspace => (Some(first), rest),
                    _ => (None, &mut *workspaces),
                };
                let mut body =
                    |g: &Child<'_, 'c>, local: &mut Vec<Held<'c>>, run: &mut Run| -> Result<bool> {
                        let forgot = exec(g, program, local, rest, run)?;
                        // Before the child closes: with every handle gone, what it still owns is exactly
                        // what forgotten handles hold, and nothing at all if nothing was forgotten.
                        let st = g.stats();
                        assert_eq!(
                            st.subtree_bytes, st.live_bytes,
                            "every grandchild has closed"
                        );
                        if !forgot {
                            assert_eq!(st.live_tensors, 0, "a subtree that forgot nothing leaked");
                        }
                        Ok(forgot)
                    };
                let before = c.stats();
                let outcome = catch_unwind(AssertUnwindSafe(|| match ws {
                    Some(ws) => c.workspace(ws, |g| body(g, &mut local, run)),
                    None => c.scope(|g| body(g, &mut local, run)),
                }));
                match outcome {
                    Ok(result) => forgot |= result?,
                    Err(payload) => {
                        deliberate_or_resume(payload);
                        run.panics += 1;
                        forgot = true; // a panic may have skipped the child's own checks
                    }
                }
                let after = c.stats();
                assert!(after.reclaimed_tensors >= before.reclaimed_tensors);
                assert_eq!(
                    after.subtree_bytes, after.live_bytes,
                    "the child returned all it held"
                );
            }
            Action::Panic => std::panic::panic_any(DELIBERATE),
            _ => {} // an action on an empty list
        }
        check(&local);
        check(up);
        // Every block this scope owns is reachable from a handle here, or was forgotten here (or
        // in a child whose forgotten block was returned with `ret` by a clone).
        let owned = c.stats().live_tensors;
        assert!(
            owned <= local.len() + forgotten_here || forgot,
            "scope owns {owned} blocks with {} handles and nothing forgotten",
            local.len()
        );
    }
    Ok(forgot)
}

const DELIBERATE: &str = "a panic inside a scope program";

/// Lets a deliberate panic end there; any other panic (a failed check) keeps unwinding to the test.
fn deliberate_or_resume(payload: Box<dyn std::any::Any + Send>) {
    if payload.downcast_ref::<&str>() != Some(&DELIBERATE) {
        std::panic::resume_unwind(payload);
    }
}

/// Keeps the deliberate panics quiet; any other panic (a failed check) prints as usual.
fn quiet_deliberate_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&DELIBERATE) {
                default(info);
            }
        }));
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn scope_programs_keep_values_and_return_every_byte(program in program()) {
        quiet_deliberate_panics();
        // Small arenas: programs both fit in them and spill out of them.
        let mut workspaces: Vec<Workspace> = (0..4).map(|_| Workspace::with_capacity("cycle", 1024)).collect();
        let mut run = Run::default();
        let detached_before = ndscope::system_stats();
        let kept = root(Device::Cpu, |s| -> Result<Vec<Vec<f32>>> {
            let mut top: Vec<Held<'_>> = Vec::new();
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                s.named_scope("program", |c| exec(c, &program, &mut top, &mut workspaces, &mut run))
            }));
            let forgot = match outcome {
                Ok(result) => result?,
                Err(payload) => {
                    deliberate_or_resume(payload);
                    run.panics += 1;
                    true
                }
            };
            check(&top);
            let values = top.iter().map(|h| h.want.clone()).collect();
            drop(top);
            let st = s.stats();
            assert_eq!(st.subtree_bytes, st.live_bytes, "every child has closed");
            if !forgot {
                // Otherwise a forgotten handle's clone may have been returned up to the root, whose
                // block the root rightly keeps until it closes.
                assert_eq!((st.live_tensors, st.live_bytes), (0, 0), "root holds nothing:\n{}", s.dump());
                assert_eq!(st.reclaimed_tensors, 0, "nothing to reclaim when nothing was forgotten");
            }
            Ok(values)
        })
        .unwrap();
        let _ = kept;
        // Detached tensors outlive the tree with their values, and free them when dropped.
        check(&run.detached);
        drop(run);
        let detached_after = ndscope::system_stats();
        prop_assert_eq!(detached_after.live_tensors, detached_before.live_tensors);
        prop_assert_eq!(detached_after.live_bytes, detached_before.live_bytes);
    }
}
