// A gradient being all-reduced is borrowed by the flight until it ends: reading it meanwhile (a
// silent race in PyTorch before `work.wait()`) does not compile.
use ndscope::dist::{ProcessGroup, Reduce};
use ndscope::{Device, root};

fn main() {
    let group = ProcessGroup::single();
    root(Device::Cpu, |s| {
        let mut grad = s.ones(&[4])?;
        group.in_flight(|flight| {
            let pending = flight.all_reduce(&mut grad, Reduce::Mean)?;
            let early = grad.to_vec::<f32>()?; // still on the wire
            pending.wait()?;
            println!("{early:?}");
            Ok(())
        })
    })
    .unwrap();
}
