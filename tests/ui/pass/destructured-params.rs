use idem::idempotent;
use serde::Serialize;

#[derive(Serialize)]
struct Point {
    x: i64,
    y: i64,
}

#[derive(Serialize)]
struct Cmd {
    key: String,
    note: String,
}

#[idempotent(scope = "geo.move", key = key)]
async fn move_to(
    store: &idem::MemoryStore,
    key: u32,
    Point { x, y }: Point,
    (dx, dy): (i64, i64),
) -> Result<i64, idem::Error> {
    let _ = store;
    Ok(x + y + dx + dy)
}

#[idempotent(scope = "geo.note", key = key, skip(note))]
async fn note(
    store: &idem::MemoryStore,
    Cmd { key, note }: Cmd,
    _unused: u8,
) -> Result<usize, idem::Error> {
    let _ = store;
    Ok(note.len() + key.len())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    assert_eq!(
        move_to(&store, 1, Point { x: 1, y: 2 }, (3, 4))
            .await
            .unwrap(),
        10
    );
    let cmd = Cmd {
        key: "k".to_owned(),
        note: "n".to_owned(),
    };
    assert_eq!(note(&store, cmd, 0).await.unwrap(), 2);
}
