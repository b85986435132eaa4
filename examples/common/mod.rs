//! What the training examples share: the command-line entry point.

/// Parses the command line with `parse`, prints `usage` for `--help` (an empty error) or after a
/// parse error (exit status 2), and runs `run` with the main thread computing as one of the CPU
/// backend's workers ([`ndscope::threads::work_on_this_thread`]), printing its error and exiting
/// with status 1 on failure.
pub fn main_with<O>(
    usage: &str,
    parse: impl FnOnce(std::iter::Skip<std::env::Args>) -> Result<O, String>,
    run: impl FnOnce(&O) -> ndscope::Result<()>,
) {
    let options = match parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(message) => {
            if message.is_empty() {
                println!("{usage}");
                return;
            }
            eprintln!("error: {message}\n\n{usage}");
            std::process::exit(2);
        }
    };
    if let Err(e) = ndscope::threads::work_on_this_thread(None).and_then(|_| run(&options)) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// One line on a planned workspace (nothing for a bump workspace, or before its first cycle closed):
/// the plan of the largest step kept — its peak beside the lower bound and beside what a bump arena
/// needs for the same step — and how many cycles replayed a plan.
pub fn plan_summary(ws: &ndscope::Workspace) -> Option<String> {
    let plan = ws.plans().iter().max_by_key(|p| p.peak())?;
    Some(format!(
        "workspace plan of the largest step: {} slots, peak {} B = {:.3}x the lower bound {} B (a bump \
         arena needs {} B); {} of {} cycles replayed a plan, {} plan(s) solved",
        plan.slots().len(),
        plan.peak(),
        plan.ratio_to_lower_bound(),
        plan.lower_bound(),
        plan.bump_size(),
        ws.replayed_cycles(),
        ws.cycles(),
        ws.plans_solved()
    ))
}

/// How the examples' training steps compute (`--dtype`): in `f32`, or in batch scopes that autocast
/// to `bf16` or `f16` (f32 master weights and optimizer state in the model scope; `f16` with dynamic
/// loss scaling).
pub struct Precision {
    dtype: ndscope::DType,
    scaler: Option<ndscope::optim::LossScaler>,
}

/// The dtype a `--dtype` value names: `f32`, `bf16` or `f16`.
pub fn parse_dtype(value: &str) -> Result<ndscope::DType, String> {
    use ndscope::DType;
    let dtype: DType = value
        .parse()
        .map_err(|e: ndscope::ParseDTypeError| format!("--dtype: {e}"))?;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(format!("--dtype: {value:?} is not f32, bf16 or f16"));
    }
    Ok(dtype)
}

impl Precision {
    /// Steps in `dtype` (`f32`, `bf16` or `f16`; `f16` with a loss scaler).
    pub fn new(dtype: ndscope::DType) -> Precision {
        Precision {
            dtype,
            scaler: (dtype == ndscope::DType::F16).then(ndscope::optim::LossScaler::new),
        }
    }

    /// The dtype inputs are stored in and products computed in.
    #[allow(dead_code)] // the GPT example feeds token ids, which keep their integer dtype
    pub fn dtype(&self) -> ndscope::DType {
        self.dtype
    }

    /// Sets up a batch (or evaluation) scope: autocast to the 16-bit dtype, if any.
    pub fn enter(&self, scope: &ndscope::Scope<'_>) -> ndscope::Result<()> {
        if self.dtype != ndscope::DType::F32 {
            scope.autocast(self.dtype)?;
        }
        Ok(())
    }

    /// The backward pass from `loss` and, unless loss scaling finds inf/NaN gradients (the step is
    /// then skipped and the scale lowered), the optimizer step `step`.
    #[allow(dead_code)] // train.rs scales and unscales itself, around the data-parallel average
    pub fn backward_and_step<'s>(
        &mut self,
        tape: &ndscope::Tape<'s>,
        loss: &ndscope::Var<'_, 's>,
        step: impl FnOnce(&ndscope::Gradients<'s>) -> ndscope::Result<()>,
    ) -> ndscope::Result<()> {
        let mut grads = tape.backward(&self.scale(loss)?)?;
        if self.unscale(&mut grads)? {
            step(&grads)?;
        }
        Ok(())
    }

    /// The loss to run the backward pass from: multiplied by the loss scale under f16.
    pub fn scale<'t, 's>(
        &self,
        loss: &ndscope::Var<'t, 's>,
    ) -> ndscope::Result<ndscope::Var<'t, 's>> {
        match &self.scaler {
            Some(scaler) => scaler.scale_loss(loss),
            None => Ok(loss.clone()),
        }
    }

    /// Divides gradients of a scaled loss by the scale; `false` when they overflowed (skip the
    /// step). Always `true` without loss scaling.
    pub fn unscale(&mut self, grads: &mut ndscope::Gradients<'_>) -> ndscope::Result<bool> {
        match &mut self.scaler {
            Some(scaler) => scaler.unscale(grads),
            None => Ok(true),
        }
    }

    /// What the model line says about precision.
    pub fn describe(&self) -> &'static str {
        match self.dtype {
            ndscope::DType::BF16 => "bf16 autocast (f32 master weights)",
            ndscope::DType::F16 => "f16 autocast with loss scaling (f32 master weights)",
            _ => "f32",
        }
    }

    /// A line on loss scaling at the end of training (nothing without it).
    pub fn report(&self) -> Option<String> {
        self.scaler.as_ref().map(|s| {
            format!(
                "loss scaling: scale {} at the end; steps skipped for inf/NaN gradients: {}",
                s.scale(),
                s.skipped_steps()
            )
        })
    }
}

/// splitmix64: the examples' data, batches and loads come from their seed alone. (Not every example
/// draws numbers, nor uses every method.)
#[allow(dead_code)]
pub struct Rng(pub u64);

#[allow(dead_code)]
impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A whole number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A uniform draw in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A field of /proc/self/status in bytes (Linux), e.g. `VmHWM` (the peak resident set) or `VmRSS`;
/// `None` where the system does not report it.
#[allow(dead_code)] // only the examples that report their process's peak call it
pub fn status_bytes(field: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[allow(dead_code)] // only the examples that train data-parallel call it
/// The mean of each rank's `value` (every rank calls it at the same point), computed in a child of
/// `scope`; `value` itself in a world of one.
pub fn mean_over_ranks(
    group: &ndscope::dist::ProcessGroup,
    scope: &ndscope::Scope<'_>,
    value: f64,
) -> ndscope::Result<f64> {
    if group.world_size() == 1 {
        return Ok(value);
    }
    scope.scope(|s| {
        let mean = group.all_reduce(&s.from_slice(&[value], &[1])?, ndscope::dist::Reduce::Mean)?;
        Ok(mean.to_vec::<f64>()?[0])
    })
}

#[allow(dead_code)] // only the examples that train data-parallel call it
/// The examples' `--distributed`: the MPI job `mpirun` launched (with the `mpi` feature), else a
/// world of one; `--timeout`'s seconds, if given, are how long a rank waits for a peer.
pub fn process_group(
    distributed: bool,
    timeout: Option<f64>,
) -> ndscope::Result<ndscope::dist::ProcessGroup> {
    let group = if distributed {
        ndscope::dist::ProcessGroup::mpi()?
    } else {
        ndscope::dist::ProcessGroup::single()
    };
    if let Some(seconds) = timeout {
        group.set_timeout(std::time::Duration::from_secs_f64(seconds));
    }
    Ok(group)
}

#[allow(dead_code)] // only the examples that train data-parallel call it
/// `--timeout`'s value: a positive, finite number of seconds.
pub fn timeout_seconds(value: &str) -> Result<f64, String> {
    value
        .parse()
        .ok()
        .filter(|s: &f64| *s > 0.0 && s.is_finite())
        .ok_or_else(|| format!("--timeout: {value:?} is not a positive number of seconds"))
}
