use idem::idempotent;

#[derive(serde::Serialize)]
struct RequestId(u64);

#[derive(serde::Serialize)]
struct Pay {
    id: RequestId,
}

#[idempotent(scope = "orders.pay", key = cmd.id)]
async fn pay(store: &idem::MemoryStore, cmd: Pay) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
