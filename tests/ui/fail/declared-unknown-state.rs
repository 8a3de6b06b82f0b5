#[derive(Debug, Clone, Copy, PartialEq, Eq, idem::StateMachine)]
#[transitions(Pending -> Paid, Paid -> Shiped)]
enum OrderStatus {
    Pending,
    Paid,
    Shipped,
}

fn main() {}
