//! The body of a recorded or collected answer: its message bytes, then its trailers.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;

/// An answer's whole body: the data (if any), then the trailers (if any).
pub(super) struct Answer {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Answer {
    pub(super) fn new(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let frame = match this.data.take() {
            Some(data) => Some(Frame::data(data)),
            None => this.trailers.take().map(Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}
