use idem::idempotent;

#[derive(serde::Serialize)]
struct TenantId(u64);

#[derive(serde::Serialize)]
struct Pay {
    key: String,
    tenant: TenantId,
}

#[idempotent(scope = "orders.pay", key = cmd.key, principal = cmd.tenant)]
async fn pay(store: &idem::MemoryStore, cmd: Pay) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
