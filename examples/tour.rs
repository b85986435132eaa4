//! A tour of ndscope: a model scope, a loop of batch scopes, a workspace, `ret`, caps, budgets,
//! `move_out`, and the tree dump.
//!
//! Run it with `cargo run --release --example tour`.

use ndscope::{Device, Error, Result, Tensor, Workspace, root};

fn main() -> Result<()> {
    let mut ws = Workspace::new("batch-ws");
    let detached = root(Device::Cpu, |model| {
        // Parameters live in the model scope.
        model.set_seed(7);
        let w1 = model.randn(&[64, 128])?.mul_scalar(0.1)?.named("w1");
        let w2 = model.randn(&[128, 10])?.mul_scalar(0.1)?.named("w2");

        // A loop of batch scopes: each batch's tensors are freed when its scope closes, and the
        // next batch reuses their memory from the cache.
        let mut losses = Vec::new();
        for step in 0..5 {
            let loss = model.named_scope("batch", |batch| -> Result<f32> {
                batch.set_seed(step);
                let x = batch.randn(&[32, 64])?;
                let logits = x.matmul(&w1)?.relu()?.matmul(&w2)?; // typed in the batch scope
                let labels = batch.from_slice(&[3i64; 32], &[32, 1])?;
                let nll = logits
                    .log_softmax(-1)?
                    .gather(1, &labels)?
                    .mean_all()?
                    .neg()?;
                nll.to_scalar::<f32>()
            })?;
            losses.push(loss);
        }
        println!("losses of five batches: {losses:.3?}");
        let st = model.stats();
        println!(
            "model scope after the loop: {} live tensors, {} allocations of which {} reused the cache, \
             {} went to the system allocator\n",
            st.live_tensors, st.allocations, st.reuses, st.system_allocations
        );

        // The same loop in a workspace: the first cycle learns the arena size, later cycles only bump
        // a pointer and reset it.
        for step in 0..3 {
            model.workspace(&mut ws, |batch| -> Result<()> {
                let x = batch.randn(&[32, 64])?;
                let _logits = x.matmul(&w1)?.relu()?.matmul(&w2)?;
                Ok(())
            })?;
            println!(
                "workspace cycle {step}: arena {} bytes, {} spills in this cycle",
                ws.capacity(),
                ws.last_cycle_spills()
            );
        }

        // `ret` moves a result to the parent scope; it survives the batch.
        let mean_w = model.scope(|batch| {
            let m = w1.mean(&[0], false)?;
            batch.ret(m.named("mean of w1"))
        })?;
        println!(
            "\nkept from a batch: {:?} {}",
            mean_w.shape(),
            mean_w.dtype()
        );

        // A capped model refuses new tensors; a budget turns overuse into an error with the tree.
        model.cap();
        match model.zeros(&[4]) {
            Err(e @ Error::Capped { .. }) => println!("\ncapped model scope: {e}"),
            other => println!("unexpected: {other:?}"),
        }
        model.uncap();
        model.set_budget(Some(64 * 1024));
        let refused = model.named_scope("big-batch", |batch| batch.zeros(&[1 << 16]).map(drop));
        if let Err(Error::OutOfMemory { ref dump, .. }) = refused {
            println!(
                "\nbudget: {}\ntree at the refusal:\n{dump}",
                refused.as_ref().unwrap_err()
            );
        }
        model.set_budget(None);

        // The whole tree, as DJL's debugDump would show it, from inside a batch.
        model.named_scope("inspect", |batch| -> Result<()> {
            let _activation = batch.ones(&[32, 128])?.named("activation");
            println!("dump:\n{}", batch.dump());
            Ok(())
        })?;

        // A moved-out tensor leaves the tree and may cross threads.
        mean_w.move_out()
    })?;
    let norm = std::thread::spawn(move || -> Result<f32> {
        detached.square()?.sum_all()?.sqrt()?.to_scalar()
    })
    .join()
    .expect("the worker thread does not panic")?;
    println!("norm computed on another thread after the tree closed: {norm:.4}");
    println!("\n{}", preview()?);
    Ok(())
}

/// A tensor as `Display` shows it.
fn preview() -> Result<String> {
    root(Device::Cpu, |s| -> Result<String> {
        let t: Tensor = s.arange(0.0f32, 12.0, 1.0)?.reshape(&[3, 4])?.named("x");
        Ok(t.to_string())
    })
}
