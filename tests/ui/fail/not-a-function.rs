use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key)]
struct Pay {
    key: String,
}

fn main() {}
