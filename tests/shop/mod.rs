//! The payments example's service (`examples/payments/app.rs`), its actix-web twin
//! (`examples/payments/actix_app.rs`) and the shop modules they use, for the tests that drive
//! them.

#![allow(dead_code, unreachable_pub)]

#[path = "../../examples/payments/actix_app.rs"]
pub mod actix_app;
#[path = "../../examples/payments/app.rs"]
pub mod app;
#[path = "../../examples/shop/model.rs"]
pub mod model;
#[path = "../../examples/shop/service.rs"]
pub mod service;
