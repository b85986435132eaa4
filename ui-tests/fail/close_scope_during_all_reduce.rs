// A tensor in flight must outlive the flight: one made in a scope that closes inside it (so its
// memory would go back while MPI still writes it) does not compile.
use ndscope::dist::{ProcessGroup, Reduce};
use ndscope::{Device, root};

fn main() {
    let group = ProcessGroup::single();
    root(Device::Cpu, |s| {
        group.in_flight(|flight| {
            s.scope(|batch| {
                let mut grad = batch.ones(&[4])?;
                flight.all_reduce(&mut grad, Reduce::Sum)?;
                Ok(())
            }) // `batch` closes here, the all-reduce may still run
        })
    })
    .unwrap();
}
