//! What the training examples share: the command-line entry point.

/// Parses the command line with `parse`, prints `usage` for `--help` (an empty error) or after a
/// parse error (exit status 2), and runs `run`, printing its error and exiting with status 1 on
/// failure.
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
    if let Err(e) = run(&options) {
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
