//! The payments example's service (`examples/payments/app.rs`) and the shop modules it uses,
//! for the tests that drive it.

#![allow(dead_code, unreachable_pub)]

#[path = "../../examples/payments/app.rs"]
pub mod app;
#[path = "../../examples/shop/model.rs"]
pub mod model;
#[path = "../../examples/shop/service.rs"]
pub mod service;
