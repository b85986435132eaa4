//! The compile-fail suite: programs that would leak a tensor out of its scope must not compile, and
//! the legal patterns must. The `.stderr` files pin rustc 1.95's messages (see `rust-toolchain.toml`);
//! bless changes with `TRYBUILD=overwrite cargo test --test ui`.

#[rustversion::attr(not(stable(1.95)), ignore = "the pinned messages are rustc 1.95's")]
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui-tests/fail/*.rs");
    t.pass("ui-tests/pass/*.rs");
}
