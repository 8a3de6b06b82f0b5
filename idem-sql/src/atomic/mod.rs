//! The atomic-mode claim. It runs in `store.rs`, beside the pool store that calls it, where a
//! reader following a key finds it: which of the ledger's statements run, in which order, and
//! what their rows decide (the row they return, `ClaimRow`, and what a live one answers, are
//! the ledger's: `ledger/row.rs`). The nested store (`nested.rs`) runs the same claim in a
//! body's transaction.

mod nested;
mod store;

pub use nested::{ConnClaimed, ConnStore, Nested, NestedClaim};
pub use store::{ClaimStep, Claimed, ClaimedTx, claim};
