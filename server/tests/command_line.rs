//! The server's command line: help, and every bad option or model path ends the process with a
//! message that names what was wrong (exit 2 for the command line, 1 for a model that does not
//! load), before any port is bound.

use std::process::{Command, Output};

fn server(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ndscope-server"))
        .args(args)
        .output()
        .expect("the server binary runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn help_prints_the_usage_and_succeeds() {
    let out = server(&["--help"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let usage = String::from_utf8_lossy(&out.stdout);
    assert!(usage.contains("--model PATH"), "{usage}");
    assert!(usage.contains("--port N"), "{usage}");
}

#[test]
fn a_bad_command_line_names_the_option_and_exits_2() {
    for (args, says) in [
        (&[][..], "--model PATH is needed"),
        (
            &["--model", "m", "--port", "http"][..],
            "--port: `http` is not a port",
        ),
        (
            &["--model", "m", "--batch", "0"][..],
            "--batch and --block must be at least 1",
        ),
        (
            &["--model", "m", "--colour", "red"][..],
            "unknown option --colour",
        ),
        (&["--model"][..], "--model needs a value"),
        (
            &["--model", "m", "--host", "local host"][..],
            "--host: `local host` is not an IP address",
        ),
    ] {
        let out = server(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(says),
            "{args:?}: expected `{says}` in\n{}",
            stderr(&out)
        );
        assert!(
            stderr(&out).contains("usage:"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn a_model_that_is_not_there_is_named_and_exits_1() {
    let missing = std::env::temp_dir().join("ndscope-server-no-such-model");
    let out = server(&["--model", missing.to_str().unwrap(), "--port", "0"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("ndscope-server-no-such-model"),
        "the error should name the path: {}",
        stderr(&out)
    );
}
