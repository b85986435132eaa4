//! Ownership and memory accounting: what each scope owns, when memory comes back, and what the
//! counters say about it.

use std::panic::{AssertUnwindSafe, catch_unwind};

use ndscope::{Device, Error, Result, Scope, Tensor, Workspace, root, system_stats};

fn run(f: impl for<'s> FnOnce(&'s Scope<'s>) -> Result<()>) {
    root(Device::Cpu, f).unwrap();
}

const F32: usize = 4;

#[test]
fn stats_follow_nested_scopes() {
    run(|root| {
        let w = root.zeros(&[10])?;
        root.named_scope("epoch", |epoch| -> Result<()> {
            let e = epoch.zeros(&[20])?;
            epoch.named_scope("batch", |batch| -> Result<()> {
                let b = batch.zeros(&[30])?;
                let st = batch.stats();
                assert_eq!(
                    (st.live_tensors, st.live_bytes, st.allocations),
                    (1, 30 * F32, 1)
                );
                assert_eq!(epoch.stats().subtree_bytes, 50 * F32);
                assert_eq!(root.stats().subtree_bytes, 60 * F32);
                assert_eq!(root.stats().live_bytes, 10 * F32);
                drop(b);
                assert_eq!(epoch.stats().subtree_bytes, 20 * F32);
                Ok(())
            })?;
            // The closed batch's events are folded into its parent; its peak shows in the parent's.
            let st = epoch.stats();
            assert_eq!(st.allocations, 2);
            assert_eq!(st.peak_bytes, 50 * F32);
            assert_eq!(st.live_tensors, 1);
            drop(e);
            Ok(())
        })?;
        let st = root.stats();
        assert_eq!(
            (st.live_tensors, st.live_bytes, st.subtree_bytes),
            (1, 10 * F32, 10 * F32)
        );
        assert_eq!(st.allocations, 3);
        assert_eq!(st.peak_bytes, 60 * F32);
        root.reset_peak();
        assert_eq!(root.stats().peak_bytes, 10 * F32);
        drop(w);
        assert_eq!(root.stats().live_bytes, 0);
        Ok(())
    });
}

#[test]
fn freed_blocks_are_reused_without_the_system_allocator() {
    run(|s| {
        drop(s.zeros(&[256])?);
        let before = s.stats();
        assert!(before.cached_bytes >= 256 * F32);
        for _ in 0..10 {
            s.scope(|c| c.zeros(&[250]).map(drop))?; // same size class, other scopes of the tree
        }
        let after = s.stats();
        assert_eq!(after.system_allocations, before.system_allocations);
        assert_eq!(after.reuses, before.reuses + 10);
        Ok(())
    });
}

#[test]
fn empty_cache_returns_cached_blocks() {
    run(|s| {
        drop(s.zeros(&[1 << 16])?);
        let cached = s.stats().cached_bytes;
        assert!(cached >= (1 << 16) * F32);
        assert_eq!(s.empty_cache(), cached);
        assert_eq!(s.stats().cached_bytes, 0);
        let before = s.stats().system_allocations;
        drop(s.zeros(&[1 << 16])?);
        assert_eq!(
            s.stats().system_allocations,
            before + 1,
            "the next allocation goes to the system again"
        );
        Ok(())
    });
}

#[test]
fn trim_cache_keeps_at_most_the_limit() {
    run(|s| {
        drop((s.zeros(&[1 << 16])?, s.zeros(&[1 << 10])?, s.zeros(&[16])?));
        let cached = s.stats().cached_bytes;
        let released = s.trim_cache(8 * 1024);
        let after = s.stats().cached_bytes;
        assert!(after <= 8 * 1024 && released == cached - after);
        assert!(after >= (1 << 10) * F32, "the small blocks stay cached");
        // The next small allocation still comes from the cache.
        let before = s.stats().reuses;
        drop(s.zeros(&[16])?);
        assert_eq!(s.stats().reuses, before + 1);
        Ok(())
    });
}

#[test]
fn ret_moves_ownership_without_copying() {
    run(|parent| {
        let (kept, ptr_check) = parent.scope(|child| -> Result<_> {
            let t = child.ones(&[8])?;
            let alias = t.clone();
            let kept = child.ret(t)?;
            assert!(
                kept.shares_storage(&alias),
                "ret of a pool block is not a copy"
            );
            assert_eq!(child.stats().live_tensors, 0);
            Ok((kept, ()))
        })?;
        let () = ptr_check;
        let st = parent.stats();
        assert_eq!((st.live_tensors, st.moved_in), (1, 1));
        assert_eq!(kept.to_vec::<f32>()?, vec![1.0; 8]);
        Ok(())
    });
}

#[test]
fn ret_from_a_workspace_copies_out_of_the_arena() {
    let mut ws = Workspace::with_capacity("batch", 1 << 12);
    run(|parent| {
        let kept = parent.workspace(&mut ws, |w| -> Result<_> {
            let t = w.arange(0.0f32, 4.0, 1.0)?;
            let kept = w.ret(t.clone())?;
            assert!(
                !kept.shares_storage(&t),
                "arena memory is reused next cycle, so ret copies"
            );
            Ok(kept)
        })?;
        assert_eq!(kept.to_vec::<f32>()?, vec![0.0, 1.0, 2.0, 3.0]);
        // The next cycle reuses the arena; the copy is unaffected.
        parent.workspace(&mut ws, |w| w.full(&[4], 9.0).map(drop))?;
        assert_eq!(kept.to_vec::<f32>()?, vec![0.0, 1.0, 2.0, 3.0]);
        Ok(())
    });
}

#[test]
fn workspace_learns_its_size_and_stops_spilling() {
    let mut ws = Workspace::new("batch");
    run(|model| {
        let w = model.randn(&[16, 16])?;
        for cycle in 0..4 {
            model.workspace(&mut ws, |b| -> Result<()> {
                let x = b.randn(&[8, 16])?;
                let h = x.matmul(&w)?.relu()?;
                let _loss = h.sum_all()?;
                Ok(())
            })?;
            if cycle == 0 {
                assert!(
                    ws.last_cycle_spills() > 0,
                    "the first cycle runs before the size is known"
                );
            } else {
                assert_eq!(
                    ws.last_cycle_spills(),
                    0,
                    "cycle {cycle} fits the learned arena"
                );
            }
        }
        assert_eq!(ws.cycles(), 4);
        assert_eq!(ws.grows(), 1);
        assert!(ws.capacity() >= 8 * 16 * F32 * 2);
        Ok(())
    });
}

#[test]
fn move_to_any_live_scope() {
    run(|s| {
        s.scope(|a| -> Result<()> {
            // From a child to its grandparent-level scope.
            let t = a.ones(&[2])?;
            let up = t.move_to(s)?;
            assert_eq!(s.stats().live_tensors, 1);
            // Down into a shorter-lived scope: a unique block changes owner ...
            a.scope(|inner| -> Result<()> {
                let down = up.clone().move_to(inner)?;
                // ... but a shared one stays with its longer-lived owner.
                assert_eq!(inner.stats().live_tensors, 0);
                assert_eq!(down.to_vec::<f32>()?, vec![1.0, 1.0]);
                let own = a.zeros(&[3])?;
                let moved = own.move_to(inner)?;
                assert_eq!(inner.stats().live_tensors, 1);
                drop(moved);
                Ok(())
            })?;
            assert_eq!(a.stats().live_tensors, 0);
            drop(up);
            Ok(())
        })?;
        assert_eq!(s.stats().live_tensors, 0);
        Ok(())
    });
}

#[test]
fn op_results_belong_to_the_innermost_operand_owner() {
    run(|model| {
        let w = model.ones(&[4])?;
        model.scope(|batch| -> Result<()> {
            let x = batch.ones(&[4])?;
            let y = w.mul(&x)?; // model and batch operands: the batch owns the result
            assert_eq!(batch.stats().live_tensors, 2);
            let z = w.add(&w)?; // model operands only: the model owns it, no longer than needed
            assert_eq!(model.stats().live_tensors, 2);
            drop((y, z));
            assert_eq!(model.stats().live_tensors, 1);
            Ok(())
        })
    });
}

#[test]
fn forgotten_handles_are_reclaimed_when_their_scope_closes() {
    run(|s| {
        let cached_before = s.stats().cached_bytes;
        s.scope(|c| -> Result<()> {
            let t = c.zeros(&[1000])?;
            let view = t.narrow(0, 0, 10)?;
            std::mem::forget(t);
            std::mem::forget(view);
            std::mem::forget(c.ones(&[24])?);
            assert_eq!(c.stats().live_tensors, 2);
            Ok(())
        })?;
        let st = s.stats();
        assert_eq!(st.reclaimed_tensors, 2);
        assert_eq!(st.reclaimed_bytes, ((1000 + 24) * F32) as u64);
        assert_eq!(st.subtree_bytes, 0);
        assert!(
            st.cached_bytes >= cached_before + 1000 * F32,
            "reclaimed memory went back to the cache"
        );
        Ok(())
    });
}

/// The cycle's own `Rc` nodes stay leaked, as any `Rc` cycle's do (valgrind reports their 368 bytes as
/// definitely lost); what ndscope reclaims is the tensor memory they hold.
#[test]
fn tensors_held_by_an_rc_cycle_are_reclaimed() {
    use std::cell::RefCell;
    use std::rc::Rc;

    struct Node<'s> {
        _data: Tensor<'s>,
        next: RefCell<Option<Rc<Node<'s>>>>,
    }
    run(|s| {
        s.scope(|c| -> Result<()> {
            let a = Rc::new(Node {
                _data: c.zeros(&[100])?,
                next: RefCell::new(None),
            });
            let b = Rc::new(Node {
                _data: c.zeros(&[200])?,
                next: RefCell::new(Some(a.clone())),
            });
            *a.next.borrow_mut() = Some(b); // a -> b -> a: neither is ever dropped
            Ok(())
        })?;
        let st = s.stats();
        assert_eq!(
            (st.reclaimed_tensors, st.reclaimed_bytes),
            (2, (300 * F32) as u64)
        );
        assert_eq!(st.subtree_bytes, 0);
        Ok(())
    });
}

#[test]
fn siblings_open_at_once_close_in_reverse_order() {
    // `b` is a second child of the model opened while `a` is open: it closes first, so a tensor may
    // move from `b` to `a` (a lives longer) without copying, and from `a` to `b` only with its one handle.
    run(|model| {
        model.named_scope("a", |a| -> Result<()> {
            let from_a = a.ones(&[4])?;
            let kept_in_a = model.named_scope("b", |b| -> Result<_> {
                let t = b.full(&[2], 3.0)?;
                let alias = t.clone();
                let up = t.move_to(a)?;
                assert!(up.shares_storage(&alias) && a.stats().live_tensors == 2);
                let borrowed = from_a.clone().move_to(b)?; // shared: stays owned by `a`
                assert_eq!((b.stats().live_tensors, borrowed.numel()), (0, 4));
                Ok(up)
            })?;
            assert_eq!(kept_in_a.to_vec::<f32>()?, vec![3.0, 3.0]);
            assert_eq!(
                (a.stats().live_tensors, model.stats().subtree_bytes),
                (2, 24)
            );
            Ok(())
        })?;
        assert_eq!(model.stats().subtree_bytes, 0);
        Ok(())
    });
}

#[test]
fn a_panic_inside_a_scope_returns_every_byte() {
    run(|s| {
        let keep = s.ones(&[16])?;
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            s.scope(|c| -> Result<()> {
                let _a = c.zeros(&[512])?;
                let b = c.ones(&[64])?;
                std::mem::forget(b.clone());
                c.scope(|g| -> Result<()> {
                    let _deep = g.zeros(&[128])?;
                    panic!("boom inside a grandchild");
                })
            })
        }));
        assert!(outcome.is_err());
        let st = s.stats();
        assert_eq!(
            st.subtree_bytes,
            16 * F32,
            "only the tensor of the surviving scope is live"
        );
        assert_eq!((st.live_tensors, st.reclaimed_tensors), (1, 1));
        // The tree still works after the panic.
        let after = s.scope(|c| c.ret(c.ones(&[16])?.add(&keep)?))?;
        assert_eq!(after.to_vec::<f32>()?, vec![2.0; 16]);
        Ok(())
    });
}

#[test]
fn capped_scopes_refuse_new_tensors_and_moves_in() {
    run(|model| {
        model.cap();
        match model.zeros(&[2]) {
            Err(Error::Capped { scope, requested }) => {
                assert_eq!((scope.as_str(), requested), ("root", 8))
            }
            other => panic!("expected Capped, got {other:?}"),
        }
        let msg = model.ones(&[1]).unwrap_err().to_string();
        assert!(
            msg.contains("capped") && msg.contains("child scope"),
            "{msg}"
        );
        model.scope(|batch| -> Result<()> {
            let t = batch.ones(&[2])?; // children are not capped
            assert!(matches!(batch.ret(t), Err(Error::Capped { .. })));
            Ok(())
        })?;
        model.uncap();
        assert!(!model.is_capped());
        assert!(model.zeros(&[2]).is_ok());
        Ok(())
    });
}

#[test]
fn budgets_turn_overuse_into_out_of_memory_errors() {
    run(|model| {
        model.set_budget(Some(1000));
        let _w = model.zeros(&[100])?; // 400 bytes
        model.named_scope("batch", |batch| -> Result<()> {
            let _a = batch.zeros(&[100])?; // 800 in the tree
            match batch.zeros(&[100]) {
                Err(Error::OutOfMemory {
                    scope,
                    requested,
                    live,
                    budget,
                    dump,
                    ..
                }) => {
                    assert_eq!(
                        (scope.as_str(), requested, live, budget),
                        ("root", 400, 800, Some(1000))
                    );
                    assert!(dump.contains("scope \"batch\""), "{dump}");
                }
                other => panic!("expected OutOfMemory, got {other:?}"),
            }
            let msg = batch.zeros(&[100]).unwrap_err().to_string();
            assert!(
                msg.contains("400 bytes requested") && msg.contains("budget of 1000"),
                "{msg}"
            );
            assert_eq!(batch.stats().ooms, 2);
            assert!(
                batch.zeros(&[50])?.numel() == 50,
                "what fits is still allowed"
            );
            Ok(())
        })?;
        assert_eq!(model.stats().ooms, 2, "refusals roll up");
        model.set_budget(None);
        assert!(model.zeros(&[1000])?.numel() == 1000);
        Ok(())
    });
}

#[test]
fn ret_within_a_budgeted_parent_is_not_charged_twice() {
    run(|model| {
        model.set_budget(Some(400));
        let t = model.scope(|c| c.ret(c.zeros(&[100])?))?; // 400 bytes: already counted in the tree
        assert_eq!(model.stats().live_bytes, 400);
        drop(t);
        Ok(())
    });
}

#[test]
fn detach_moves_unique_blocks_and_copies_shared_ones() {
    let base = system_stats();
    let detached = root(Device::Cpu, |s| -> Result<_> {
        let t = s.full(&[4], 2.0)?.named("kept");
        let d = t.move_out()?;
        assert!(d.is_moved_out());
        assert_eq!(s.stats().live_tensors, 0, "the block left the tree");
        assert_eq!(d.name(), Some("kept"));
        let shared = s.ones(&[4])?;
        let alias = shared.clone();
        let d2 = shared.move_out()?;
        assert!(!d2.shares_storage(&alias), "a shared block is copied");
        Ok((d, d2))
    })
    .unwrap();
    assert_eq!(system_stats().live_tensors, base.live_tensors + 2);
    let (a, b) = detached;
    let sum = std::thread::spawn(move || {
        a.add(&b)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    })
    .join()
    .unwrap();
    assert_eq!(sum, 12.0);
    assert_eq!(
        system_stats().live_tensors,
        base.live_tensors,
        "detached blocks are freed by their last handle"
    );
}

#[test]
fn detached_tensors_work_inside_scopes() {
    let bias = root(Device::Cpu, |s| s.ones(&[3])?.move_out()).unwrap();
    run(|s| {
        let x = s.full(&[3], 2.0)?;
        let y = x.add(&bias)?; // a scope operand: the scope owns the result
        assert!(!y.is_moved_out());
        assert_eq!(s.stats().live_tensors, 2);
        let kept = s.scope(|c| c.ret(bias.clone()))?; // a system block stays in the system scope
        assert!(kept.is_moved_out());
        Ok(())
    });
}

#[test]
fn moving_between_trees_copies() {
    run(|outer| {
        let from_inner = root(Device::Cpu, |inner| -> Result<_> {
            let t = inner.ones(&[3])?;
            t.move_to(outer) // outer outlives inner's tree: copied into outer's memory
        });
        let t = from_inner?;
        assert_eq!(outer.stats().live_tensors, 1);
        assert_eq!(t.to_vec::<f32>()?, vec![1.0; 3]);
        Ok(())
    });
}

#[test]
fn scope_moved_returns_the_closure_value_to_the_parent() {
    run(|s| {
        let (a, v) = s.scope_moved::<(Tensor, Vec<Tensor>), _>(|c| {
            Ok((c.ones(&[2])?, vec![c.zeros(&[1])?]))
        })?;
        assert_eq!(s.stats().live_tensors, 2);
        assert_eq!((a.numel(), v.len()), (2, 1));
        Ok(())
    });
}

#[test]
fn dump_shows_the_tree_with_names_and_creation_sites() {
    run(|s| {
        let _w = s.randn(&[4, 4])?.named("weight");
        s.named_scope("batch", |b| -> Result<()> {
            let _x = b.zeros(&[2, 4])?;
            let dump = b.dump(); // the whole tree, from the root
            assert!(
                dump.contains("scope \"root\": 1 tensors, 64 B live"),
                "{dump}"
            );
            assert!(dump.contains("tensor \"weight\" f32 [4, 4] 64 B"), "{dump}");
            assert!(
                dump.contains("scope \"batch\": 1 tensors, 32 B live"),
                "{dump}"
            );
            assert!(dump.contains(&format!("created at {}:", file!())), "{dump}");
            Ok(())
        })
    });
}

#[test]
fn unnamed_scopes_are_named_by_their_call_site() {
    run(|s| {
        s.scope(|c| -> Result<()> {
            assert!(
                c.name().starts_with(&format!("scope@{}:", file!())),
                "{}",
                c.name()
            );
            Ok(())
        })
    });
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_is_a_clear_error_in_a_cpu_build() {
    let err = root(Device::Cuda(0), |_| Ok::<_, Error>(())).unwrap_err();
    assert!(matches!(err, Error::DeviceUnavailable { .. }));
    assert!(err.to_string().contains("cuda:0"), "{err}");
    run(|s| {
        let t = s.ones(&[1])?;
        assert!(t.to_device(Device::Cuda(0)).is_err());
        assert!(t.to_device(Device::Cpu)?.shares_storage(&t));
        Ok(())
    });
}
