use idem::{StateMachine, Transition, transition};

#[derive(Debug, Clone, Copy, PartialEq, Eq, idem::StateMachine)]
#[transitions(Pending -> Paid, Pending -> Cancelled, Paid -> Shipped)]
enum OrderStatus {
    Pending,
    Paid,
    Cancelled,
    Shipped,
}

const PAY: Transition<OrderStatus> = transition!(OrderStatus: Pending -> Paid);

fn main() {
    const { assert!(OrderStatus::can_transition(OrderStatus::Paid, OrderStatus::Shipped)) };
    assert_eq!(PAY.to(), OrderStatus::Paid);
    assert_eq!(OrderStatus::transitions().len(), 3);
    assert_eq!(OrderStatus::Cancelled.name(), "Cancelled");
    assert!(OrderStatus::to_mermaid().contains("Pending --> Paid"));
}
