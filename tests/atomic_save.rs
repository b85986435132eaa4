//! Saving a checkpoint never loses the previous one (`checkpoint::save`, `write_atomically`, and
//! through them `save_pretrained` and the distributed rank-0 save): a save that fails halfway, or a
//! process killed in the middle of one, leaves the old file byte for byte, and a `Weights` that maps
//! the old file keeps reading it after a save over it.
//!
//! The faults are real: a child process (this test binary, run again with `NDSCOPE_SAVE_CHILD` set)
//! saves under a file-size limit (`ulimit -f`), so its write fails with `EFBIG` halfway, or, with the
//! limit's signal not ignored, the kernel kills it right there; another child is killed with SIGKILL
//! while it saves a large checkpoint again and again.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ndscope::nn::{Activation, Init, Sequential, mlp};
use ndscope::weights::Weights;
use ndscope::{DType, Device, Result, Scope, checkpoint, root};

/// The variable a child process reads its work from: `ACTION PATH WIDTH VALUE`.
const CHILD: &str = "NDSCOPE_SAVE_CHILD";

/// An MLP `[width, width, 2]` whose every parameter is `value`.
fn model<'s>(s: &Scope<'s>, width: usize, value: f64) -> Result<Sequential<'s>> {
    mlp(
        s,
        &[width, width, 2],
        Activation::Relu,
        Init::Constant(value),
    )
}

/// The bytes `checkpoint::save` writes for `model(width, value)`.
fn saved_bytes(width: usize, value: f64) -> Vec<u8> {
    root(Device::Cpu, |s| {
        checkpoint::to_bytes(&model(s, width, value)?)
    })
    .unwrap()
}

/// A fresh directory holding `model.safetensors` = `model(8, 0.25)`; returns it and the file.
fn directory_with_old_checkpoint(test: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("ndscope-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    root(Device::Cpu, |s| {
        checkpoint::save(&model(s, 8, 0.25)?, &path)
    })
    .unwrap();
    assert!(std::fs::read(&path).unwrap() == saved_bytes(8, 0.25));
    (dir, path)
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// This test binary running only `child_process`, with `work` in `CHILD`, under `sh -c PREFIX`.
fn child(prefix: &str, work: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "{prefix} exec \"$0\" --exact child_process --ignored --nocapture --test-threads=1"
        ))
        .arg(exe)
        .env(CHILD, work)
        .stdin(Stdio::null());
    c
}

/// Not a test of its own (hence ignored): the work of a child process, which `CHILD` names.
#[test]
#[ignore = "the child process of the other tests, which run it"]
fn child_process() {
    let work = std::env::var(CHILD).expect("run by the other tests, with NDSCOPE_SAVE_CHILD set");
    let [action, path, width, value] = work.split(' ').collect::<Vec<_>>()[..] else {
        panic!("{CHILD}={work}: expected ACTION PATH WIDTH VALUE");
    };
    let width: usize = width.parse().unwrap();
    let value: f64 = value.parse().unwrap();
    root(Device::Cpu, |s| {
        let m = model(s, width, value)?;
        match action {
            "save" => match checkpoint::save(&m, path) {
                Ok(()) => println!("child: saved"),
                Err(e) => println!("child: error: {e}"),
            },
            "save-forever" => loop {
                checkpoint::save(&m, path)?;
            },
            _ => panic!("unknown action {action}"),
        }
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

/// The file-size limit `sh`'s `ulimit -f` sets, in its blocks (512 or 1,024 bytes): far below the
/// 4 MiB of the new checkpoint, far above nothing.
const LIMIT_BLOCKS: u32 = 64;
/// The width of the new checkpoint: `[1024, 1024, 2]` is about 4 MiB.
const NEW_WIDTH: usize = 1024;

/// A child that saves the new checkpoint over `path` under the file-size limit, after `before` (a
/// shell command, or nothing).
fn save_past_the_limit(path: &Path, before: &str) -> Command {
    child(
        &format!("{before} ulimit -f {LIMIT_BLOCKS};"),
        &format!("save {} {NEW_WIDTH} 0.5", path.display()),
    )
}

#[test]
fn a_save_that_fails_halfway_leaves_the_old_file_byte_identical() {
    let (dir, path) = directory_with_old_checkpoint("failed-save");
    let old = std::fs::read(&path).unwrap();
    // With SIGXFSZ ignored, the write past the limit fails with EFBIG, halfway through the file.
    let out = save_past_the_limit(&path, "trap '' XFSZ;")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("child: error:")
            && stdout.contains("model.safetensors")
            && stdout.contains("writing failed"),
        "the save must fail with a typed error naming the file: {stdout}"
    );
    // Compared with `==`: a failure must not print megabytes of bytes.
    assert!(
        std::fs::read(&path).unwrap() == old,
        "the old checkpoint changed"
    );
    assert_eq!(
        listing(&dir),
        ["model.safetensors"],
        "the temporary file is removed"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_process_killed_in_the_middle_of_a_save_leaves_the_old_checkpoint() {
    let (dir, path) = directory_with_old_checkpoint("killed-save");
    let old = std::fs::read(&path).unwrap();
    // The limit's signal, not ignored, kills the child in the write that crosses it.
    let status = save_past_the_limit(&path, "")
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(
        status.signal(),
        Some(25),
        "the child must die of SIGXFSZ: {status:?}"
    );
    // Compared with `==`: a failure must not print megabytes of bytes.
    assert!(
        std::fs::read(&path).unwrap() == old,
        "the old checkpoint changed"
    );
    root(Device::Cpu, |s| {
        let mut m = model(s, 8, 0.0)?;
        checkpoint::load(&mut m, &path)?;
        assert!(
            checkpoint::to_bytes(&m)? == old,
            "it loads, as the old model"
        );
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
    // What a killed save leaves: its temporary file, beside the intact checkpoint.
    let names = listing(&dir);
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names[0].starts_with(".model.safetensors.ndscope-tmp-"),
        "{names:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sigkill_during_saves_always_leaves_a_whole_checkpoint() {
    let (dir, path) = directory_with_old_checkpoint("sigkill-save");
    let old = std::fs::read(&path).unwrap();
    let mut saver = child(
        "",
        &format!("save-forever {} {NEW_WIDTH} 0.5", path.display()),
    )
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    // Kill it once a save is under way: its temporary file exists and holds bytes.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let writing = listing(&dir).iter().any(|n| {
            n.contains(".ndscope-tmp-") && std::fs::metadata(dir.join(n)).is_ok_and(|m| m.len() > 0)
        });
        if writing {
            break;
        }
        assert!(Instant::now() < deadline, "the child never started a save");
        if let Some(status) = saver.try_wait().unwrap() {
            panic!("the child ended before it was killed: {status:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    saver.kill().unwrap();
    let status = saver.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    let now = std::fs::read(&path).unwrap();
    assert!(
        now == old || now == saved_bytes(NEW_WIDTH, 0.5),
        "after the kill the checkpoint is neither the old nor the new one ({} bytes)",
        now.len()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn saving_over_a_mapped_checkpoint_leaves_the_map_readable() {
    let (dir, path) = directory_with_old_checkpoint("mapped-save");
    let old_map = Weights::open(&path).unwrap();
    root(Device::Cpu, |s| {
        checkpoint::save(&model(s, 8, 0.75)?, &path)?;
        // The old map still reads the old values: the save made a new file, the old one lives on.
        let w = old_map.tensor(s, "0.weight", &[8, 8], DType::F32)?;
        assert!(w.to_vec::<f32>()?.iter().all(|&v| v == 0.25));
        let new_map = Weights::open(&path)?;
        let w = new_map.tensor(s, "0.weight", &[8, 8], DType::F32)?;
        assert!(w.to_vec::<f32>()?.iter().all(|&v| v == 0.75));
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
    drop(old_map);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_save_into_a_directory_that_cannot_take_it_is_a_typed_error() {
    let dir = std::env::temp_dir().join(format!("ndscope-bad-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    root(Device::Cpu, |s| {
        let m = model(s, 4, 0.5)?;
        // A directory where the file should be.
        let e = checkpoint::save(&m, &dir).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        // A directory that does not exist.
        let e = checkpoint::save(&m, dir.join("missing/model.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot create a file in its directory"), "{e}");
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
    assert!(listing(&dir).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_read_checkpoint_does_not_see_a_rewrite_in_place() {
    let (dir, path) = directory_with_old_checkpoint("read-checkpoint");
    let copied = Weights::read(&path).unwrap();
    // Another program truncates and rewrites the file in place, as `fs::write` does.
    std::fs::write(&path, saved_bytes(4, 0.75)).unwrap();
    root(Device::Cpu, |s| {
        let w = copied.tensor(s, "0.weight", &[8, 8], DType::F32)?;
        assert!(w.to_vec::<f32>()?.iter().all(|&v| v == 0.25));
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
