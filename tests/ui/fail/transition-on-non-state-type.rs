use idem::transition;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Color {
    Red,
    Green,
}

fn main() {
    let _ = transition!(Color: Red -> Green);
}
