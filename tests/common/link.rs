//! A TCP link to a server that a test can break, without touching the server: cut, every
//! connection through it ends and new ones are refused (a server that died, as a pool sees it:
//! a killed Galera node); hung, the connections it has stop carrying bytes but stay open (a
//! peer gone without a word: a dropped route, a NAT that forgot the flow), while new ones work.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Forwards a local port to a server until [`cut`](Self::cut).
pub struct Link {
    port: u16,
    cut: watch::Sender<bool>,
    /// Bumped by [`hang`](Self::hang): connections made before stop carrying bytes.
    hung: watch::Sender<u64>,
    /// The listener and the connections still open through it.
    open: Arc<AtomicUsize>,
}

impl Link {
    /// Forwards a free local port to the server `url` names (`scheme://[user@]host:port/...`).
    pub async fn to(url: &str) -> Self {
        let upstream = authority(url).to_owned();
        let (hung, on_hang) = watch::channel(0);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a local port");
        let port = listener.local_addr().expect("its address").port();
        let (cut, mut on_cut) = watch::channel(false);
        let open = Arc::new(AtomicUsize::new(1));
        let listening = Arc::clone(&open);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = on_cut.changed() => break,
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        listening.fetch_add(1, Ordering::SeqCst);
                        let (open, on_cut, on_hang, upstream) = (
                            Arc::clone(&listening),
                            on_cut.clone(),
                            on_hang.clone(),
                            upstream.clone(),
                        );
                        tokio::spawn(forward(client, upstream, on_cut, on_hang, open));
                    }
                }
            }
            // Dropping the listener refuses every later connection.
            drop(listener);
            listening.fetch_sub(1, Ordering::SeqCst);
        });
        Link {
            port,
            cut,
            hung,
            open,
        }
    }

    /// `url` with its host and port replaced by this link's.
    pub fn url(&self, url: &str) -> String {
        url.replacen(authority(url), &format!("127.0.0.1:{}", self.port), 1)
    }

    /// Makes the connections through the link stop carrying bytes, both ways, without closing
    /// them; connections made afterwards work.
    pub fn hang(&self) {
        self.hung.send_modify(|generation| *generation += 1);
    }

    /// Ends every connection through the link and stops listening; returns once both are
    /// done, so the next statement on one of its connections fails.
    pub async fn cut(&self) {
        let _ = self.cut.send(true);
        let started = Instant::now();
        while self.open.load(Ordering::SeqCst) > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the link's connections did not end"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Copies bytes both ways until either side closes or the link is cut; then both sockets are
/// dropped, which ends the connection for the client.
async fn forward(
    mut client: TcpStream,
    upstream: String,
    mut on_cut: watch::Receiver<bool>,
    mut on_hang: watch::Receiver<u64>,
    open: Arc<AtomicUsize>,
) {
    let born = *on_hang.borrow_and_update();
    if let Ok(mut server) = TcpStream::connect(&upstream).await {
        let hung = tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
            _ = on_cut.wait_for(|cut| *cut) => false,
            _ = on_hang.wait_for(|generation| *generation != born) => true,
        };
        if hung {
            // Both sockets stay open, carrying nothing, until the link is cut or dropped.
            let _ = on_cut.wait_for(|cut| *cut).await;
        }
        drop(server);
    }
    drop(client);
    open.fetch_sub(1, Ordering::SeqCst);
}

/// The `host:port` of a database URL.
fn authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest
        .split_once('/')
        .map_or(rest, |(authority, _)| authority);
    rest.rsplit_once('@').map_or(rest, |(_, host)| host)
}
