use idem::transition;

#[derive(Debug, Clone, Copy, PartialEq, Eq, idem::StateMachine)]
#[transitions(Pending -> Paid, Pending -> Cancelled)]
enum OrderStatus {
    Pending,
    Paid,
    Cancelled,
}

fn main() {
    let _ = transition!(OrderStatus: Cancelled -> Paid);
}
