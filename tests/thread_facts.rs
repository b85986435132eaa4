//! Which types may cross threads: scopes nest strictly in time on one thread, scoped tensors stay on
//! it, and only detached tensors (`Tensor<'static>`) and workspaces may be sent.

use ndscope::{Child, Scope, Tensor, Workspace};
use static_assertions::{assert_impl_all, assert_not_impl_any};

assert_not_impl_any!(Scope<'static>: Send, Sync);
assert_not_impl_any!(Child<'static, 'static>: Send, Sync);
assert_impl_all!(Tensor<'static>: Send, Sync, Clone);
assert_impl_all!(Workspace: Send);
assert_not_impl_any!(Workspace: Sync, Clone);
assert_impl_all!(ndscope::Error: Send, Sync, std::error::Error);

/// The compile-time facts above are checked when this file compiles; this test documents the one
/// run-time consequence: a detached tensor used from several threads at once.
#[test]
fn detached_tensors_are_shared_across_threads() {
    let t = ndscope::root(ndscope::Device::Cpu, |s| s.ones(&[1000])?.detach()).unwrap();
    let sums: Vec<f32> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| t.clone().sum_all().unwrap().to_scalar::<f32>().unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![1000.0; 4]);
}
