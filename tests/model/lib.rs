//! The model lives in `protocol.rs`, an integration test: `cargo test -p idem-model --release`.
