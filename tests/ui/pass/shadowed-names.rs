#![allow(dead_code)]

use idem::idempotent;

// Names the expansion must not pick up from the caller's scope.
type Result = ();
struct Error;
struct Ok;
struct Err;
struct Option;
struct Some;
struct None;
struct Box;
struct Duration;
struct Site;
struct Call;
struct Concurrency;
fn store() {}
fn key() {}

#[idempotent(scope = "shadow.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) -> ::core::result::Result<u8, idem::Error> {
    let _ = store;
    ::core::result::Result::Ok(1)
}

fn main() {}
