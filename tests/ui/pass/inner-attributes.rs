#![deny(unused_variables)]
#![allow(clippy::mixed_attributes_style)] // outer and inner attributes are the point here

use idem::idempotent;

#[idempotent(scope = "attrs.pay", key = key)]
/// Outer doc comments and attributes stay on the function.
#[allow(clippy::needless_return)]
#[must_use = "the answer says whether the payment went through"]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u8, idem::Error> {
    #![allow(unused_variables)]
    let _ = store;
    let unused = 1;
    return Ok(1);
}

fn main() {}
