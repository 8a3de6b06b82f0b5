//! The contract's types as each web framework takes them, behind that framework's feature:
//! the key as an extractor, the problem as an error response. (The orphan rule puts these
//! impls here, beside the types; the adapter crates add the rest.)

#[cfg(feature = "actix")]
pub mod actix;
#[cfg(feature = "axum")]
mod axum;
