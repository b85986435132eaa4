use ndscope::*;
fn main() -> Result<()> {
    root(Device::Cpu, |s| {
        println!("{}", s.dump());
        let mut top = Vec::new();
        s.named_scope("program", |c| -> Result<()> {
            let a = c.full(&[0], 0.0)?;
            top.push(c.ret(a)?);
            let b = c.full(&[17], 1.0)?;
            std::mem::forget(b);
            Ok(())
        })?;
        drop(top);
        println!("{}", s.dump());
        Ok(())
    })
}
