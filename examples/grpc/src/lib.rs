//! A tonic (gRPC) payments service made idempotent with idem (build with `--features
//! tonic`; without it this library is empty, so `cargo test --workspace` does not build
//! tonic): `Pay` over an `#[idempotent]` function (`payments::Shop`), `Refund` a plain
//! method recorded whole by `idem::tonic::IdempotencyLayer` (`payments::serve`).
//!
//! `cargo run -p idem-example-grpc --features tonic` serves it on an SQLite file and calls
//! it as a client would, retries included.

#![cfg(feature = "tonic")]

pub mod payments;
pub mod shop;
