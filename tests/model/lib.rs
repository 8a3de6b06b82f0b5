//! The model lives in `protocol.rs`, an integration test: `cargo test -p idem-model -- --nocapture`
//! prints the states each check explored and the counterexamples the mutation tests find.
