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
