//! Compile-time diagnostics suite of `#[idempotent]` (trybuild); the cases live in `pass/`
//! and `fail/`, the runner in `ui.rs`. This library is empty.
