#[derive(Debug, Clone, Copy, PartialEq, Eq, idem::StateMachine)]
#[transitions(Pending -> Paid)]
enum OrderStatus {
    Pending,
    Paid(u32),
}

fn main() {}
