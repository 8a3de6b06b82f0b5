//! Compile-time diagnostics of `#[idempotent]`.
//!
//! `pass/*.rs` must compile; `fail/*.rs` must fail with exactly the neighbouring `.stderr`.
//! Regenerate with `TRYBUILD=overwrite cargo test -p idem-ui-tests` and review the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass(concat!(env!("CARGO_MANIFEST_DIR"), "/pass/*.rs"));
    t.compile_fail(concat!(env!("CARGO_MANIFEST_DIR"), "/fail/*.rs"));
}
