//! Caching is never why a program runs out of memory. Under an address-space limit (`ulimit -v`, that
//! is `setrlimit(RLIMIT_AS)`, in a child process running one test of this binary), requests of ever
//! new sizes, each dropped at once, are served up to nearly the limit after a tebibyte of churn, and
//! one tree's cache gives way to another tree's request.

use std::process::Command;
use std::sync::{Arc, Barrier};

use ndscope::{DType, Device, Error, Result, root};

/// Set in the child: the address-space limit in bytes it runs under.
const LIMIT_VAR: &str = "NDSCOPE_ADDRESS_SPACE_LIMIT";
/// The limit the tests set: 8 GiB of address space, the test binary's own few hundred MiB included.
const LIMIT: usize = 8 << 30;
const GIB: f64 = (1u64 << 30) as f64;

/// The limit when running as the child of [`under_limit`], else `None`.
fn child_limit() -> Option<usize> {
    std::env::var(LIMIT_VAR).ok().and_then(|v| v.parse().ok())
}

/// Runs test `name` of this binary alone in a child process limited to `limit` bytes of address
/// space, and fails with its output if it fails.
fn under_limit(name: &str, limit: usize) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {} && exec \"$0\" \"$@\"", limit / 1024))
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(LIMIT_VAR, limit.to_string())
        .output()
        .expect("sh runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the child failed:\n{text}");
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
    print!("{text}");
}

/// Bytes of an `f32` tensor of `bytes` bytes, rounded down to whole elements.
fn floats(bytes: usize) -> [usize; 1] {
    [bytes / 4]
}

#[test]
fn a_tebibyte_of_churn_leaves_the_whole_limit_usable() {
    let Some(limit) = child_limit() else {
        return under_limit("a_tebibyte_of_churn_leaves_the_whole_limit_usable", LIMIT);
    };
    root(Device::Cpu, |s| -> Result<()> {
        // No cache bound: only the refusal policy stands between the cache and the limit.
        s.set_cache_limit(Device::Cpu, None);
        let (mut churned, mut largest_refused_below_95) = (0u128, None);
        let mut size = 64usize << 20;
        while churned < 1 << 40 {
            match s.empty(&floats(size), DType::F32) {
                Ok(t) => churned += t.numel() as u128 * 4,
                Err(Error::OutOfMemory { .. }) if size > limit / 100 * 95 => size = 64 << 20,
                Err(e) => largest_refused_below_95 = Some((size, e.to_string())),
            }
            if largest_refused_below_95.is_some() {
                break;
            }
            size = size + size / 14; // 1.07x: every size new until the limit refuses
        }
        assert_eq!(
            largest_refused_below_95, None,
            "refused below 95% of the limit"
        );
        let m = s.memory_stats(Device::Cpu);
        assert!(m.free_calls > 0, "idle segments went back: {m}");
        let big = s.empty(&floats(limit / 100 * 95), DType::F32)?;
        println!(
            "served {:.2} GiB (95% of the {:.1} GiB limit) after {:.0} GiB of churn; {m}",
            big.numel() as f64 * 4.0 / GIB,
            limit as f64 / GIB,
            churned as f64 / GIB
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn one_trees_cache_gives_way_to_another_trees_request() {
    let Some(limit) = child_limit() else {
        return under_limit("one_trees_cache_gives_way_to_another_trees_request", LIMIT);
    };
    let share = limit / 10 * 6; // two of them do not fit
    let both_open = Arc::new(Barrier::new(2));
    let done = Arc::new(Barrier::new(2));
    let (b1, d1) = (Arc::clone(&both_open), Arc::clone(&done));
    let cacher = std::thread::spawn(move || {
        root(Device::Cpu, |s| -> Result<usize> {
            s.set_cache_limit(Device::Cpu, None);
            drop(s.empty(&floats(share), DType::F32)?);
            let cached = s.stats().cached_bytes;
            b1.wait(); // the block sits in this tree's cache
            d1.wait(); // the other tree has asked
            assert_eq!(s.stats().cached_bytes, 0, "released for the other tree");
            Ok(cached)
        })
    });
    let asker = root(Device::Cpu, |s| -> Result<_> {
        both_open.wait();
        let t = s.empty(&floats(share), DType::F32);
        let m = s.memory_stats(Device::Cpu);
        done.wait();
        Ok((t.map(|t| t.numel()), m))
    })
    .unwrap();
    let cached = cacher.join().expect("no panic").unwrap();
    assert!(cached >= share, "the first tree cached its block: {cached}");
    let (served, m) = asker;
    assert_eq!(served.expect("served after the release"), share / 4);
    assert_eq!((m.refusals, m.retries), (1, 1), "{m}");
    assert!(m.released_for_retries as usize >= share, "{m}");
}

#[test]
fn a_request_beyond_the_limit_is_an_error_that_says_what_was_released() {
    let Some(limit) = child_limit() else {
        return under_limit(
            "a_request_beyond_the_limit_is_an_error_that_says_what_was_released",
            LIMIT,
        );
    };
    root(Device::Cpu, |s| -> Result<()> {
        s.set_cache_limit(Device::Cpu, None);
        let _live = s.empty(&floats(limit / 4), DType::F32)?;
        drop(s.empty(&floats(limit / 3), DType::F32)?); // cached
        let err = s.empty(&floats(limit), DType::F32).unwrap_err();
        let Error::OutOfMemory {
            device,
            live,
            released,
            cached,
            budget,
            ..
        } = &err
        else {
            panic!("expected OutOfMemory, got {err:?}")
        };
        assert_eq!((device.as_str(), *budget, *cached), ("cpu", None, 0));
        assert!(*live >= limit / 4 && *released >= limit / 3, "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("cpu allocator refused") && msg.contains("went back"),
            "{msg}"
        );
        let m = s.memory_stats(Device::Cpu);
        assert_eq!((m.failures, m.cached_bytes), (1, 0), "{m}");
        Ok(())
    })
    .unwrap();
}
