use idem::transition;

#[derive(Debug, Clone, Copy, PartialEq, Eq, idem::StateMachine)]
#[transitions(Pending -> Paid)]
enum OrderStatus {
    Pending,
    Paid,
}

fn main() {
    let _ = transition!(OrderStatus: Pending -> Shipped);
}
