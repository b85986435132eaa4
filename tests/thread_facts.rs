//! Which types may cross threads: scopes nest strictly in time on one thread, scoped tensors stay on
//! it, and only detached tensors (`Tensor<'static>`) and workspaces may be sent; process groups and
//! flights of collectives stay on the thread that made them.

use ndscope::{Child, Scope, Tensor, Workspace};
use static_assertions::{assert_impl_all, assert_not_impl_any};

assert_not_impl_any!(Scope<'static>: Send, Sync);
assert_not_impl_any!(Child<'static, 'static>: Send, Sync);
assert_impl_all!(Tensor<'static>: Send, Sync, Clone);
assert_impl_all!(Workspace: Send);
assert_not_impl_any!(Workspace: Sync, Clone);
assert_impl_all!(ndscope::Error: Send, Sync, std::error::Error);
// Collectives belong to the thread that started MPI (and a GPU's stream), with or without features.
assert_not_impl_any!(ndscope::dist::ProcessGroup: Send, Sync);
assert_not_impl_any!(ndscope::dist::Flight<'static, 'static>: Send, Sync);

/// The compile-time facts above are checked when this file compiles; this test documents the one
/// run-time consequence: a detached tensor used from several threads at once.
#[test]
fn detached_tensors_are_shared_across_threads() {
    let t = ndscope::root(ndscope::Device::Cpu, |s| s.ones(&[1000])?.move_out()).unwrap();
    let sums: Vec<f32> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| t.clone().sum_all().unwrap().to_scalar::<f32>().unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![1000.0; 4]);
}

/// Many threads clone, update (copy-on-write) and drop handles of one detached block at once: the
/// shared values never change, every private copy holds its own result, and the block is freed once.
#[test]
fn detached_blocks_survive_concurrent_clones_updates_and_drops() {
    let shared = ndscope::root(ndscope::Device::Cpu, |s| {
        s.arange(0.0f32, 64.0, 1.0)?.move_out()
    })
    .unwrap();
    let want: Vec<f32> = (0..64).map(|i| i as f32).collect();
    std::thread::scope(|scope| {
        for t in 0..4 {
            let shared = &shared;
            let want = &want;
            scope.spawn(move || {
                for i in 0..2_000 {
                    let mut mine = shared.clone();
                    mine.add_scalar_((t * 10_000 + i) as f64).unwrap(); // shared: copies first
                    let got = mine.to_vec::<f32>().unwrap();
                    assert_eq!(got[0], (t * 10_000 + i) as f32);
                    assert_eq!(
                        shared.to_vec::<f32>().unwrap(),
                        *want,
                        "the shared block changed"
                    );
                    drop(mine);
                }
            });
        }
    });
    assert_eq!(shared.to_vec::<f32>().unwrap(), want);
}
