// A lease commits at once and outlives any transaction: a lease-mode function cannot take
// another call's transaction as its connection (here the in-memory store's; SeaORM's
// `&DatabaseTransaction` is refused the same way).
use idem::idempotent;

#[idempotent(scope = "orders.charge", key = key, lease = "30s")]
async fn charge(tx: &idem::MemoryTx, key: String) -> Result<u32, idem::Error> {
    let _ = tx;
    Ok(1)
}

fn main() {}
