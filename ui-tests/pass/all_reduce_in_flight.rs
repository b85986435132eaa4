// The legal form: start the all-reduces, do other work, and read the gradients once the flight has
// ended (every collective it started is complete then).
use ndscope::dist::{ProcessGroup, Reduce};
use ndscope::{Device, root};

fn main() {
    let group = ProcessGroup::single();
    root(Device::Cpu, |s| {
        let mut first = s.ones(&[4])?;
        let mut second = s.ones(&[2, 2])?;
        group.in_flight(|flight| {
            flight.all_reduce(&mut first, Reduce::Mean)?;
            let other = s.randn(&[8])?.sum_all()?; // overlaps the all-reduce
            flight.all_reduce(&mut second, Reduce::Sum)?.wait()?;
            drop(other);
            Ok(())
        })?;
        assert_eq!(first.to_vec::<f32>()?, vec![1.0; 4]);
        assert_eq!(second.to_vec::<f32>()?, vec![1.0; 4]);
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}
