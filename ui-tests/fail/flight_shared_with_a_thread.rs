// Collectives in flight belong to the thread that started them; a flight cannot be shared.
use ndscope::dist::{ProcessGroup, Reduce};
use ndscope::{root, Device, Result};

fn main() -> Result<()> {
    let group = ProcessGroup::single();
    root(Device::Cpu, |s| {
        let mut t = s.ones(&[4])?;
        group.in_flight(|flight| {
            std::thread::scope(|threads| {
                threads.spawn(|| flight.all_reduce(&mut t, Reduce::Sum).map(|_| ()));
            });
            Ok(())
        })
    })
}
