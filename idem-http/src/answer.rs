//! An answer that is not a JSON value (a `303 See Other` with its `Location`, a rendered page,
//! a flash cookie), recorded whole as an `#[idempotent]` call's value and replayed with its
//! status and headers.

use http::header::{CONTENT_TYPE, LOCATION, SET_COOKIE};
use http::{HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use crate::problem::Problem;
use crate::replay::mark_replayed;

/// An HTTP answer kept as it is: its status, its headers in order, its text body. Returned as
/// the value of an `#[idempotent]` function, it is recorded with the call's effects, and a
/// retry gets it again as it was, status and headers included (`Idempotent-Replayed: true`
/// added); `idem::axum::respond_answer` and `idem::actix::respond_answer` answer it.
///
/// ```
/// use idem_http::Answer;
///
/// // Post/Redirect/Get with a flash message: the retry of a submitted form gets the same.
/// let published = Answer::see_other("/admin/newsletters")
///     .set_cookie("flash=Issue%20published; Path=/admin; Max-Age=60");
/// let response = published.to_response(false);
/// assert_eq!(response.status(), 303);
/// assert_eq!(response.headers()["location"], "/admin/newsletters");
/// assert_eq!(response.headers()["set-cookie"], "flash=Issue%20published; Path=/admin; Max-Age=60");
/// assert_eq!(published.to_response(true).headers()["idempotent-replayed"], "true");
/// ```
///
/// It is recorded in the ledger as written, so keep secrets out of it (a session cookie is not
/// an answer to replay: a flash message is). A header name or value that is not valid, or a
/// status outside 100–999, is answered as a 500 problem saying which, first execution and
/// replay alike, rather than sent half-formed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    /// An answer with `status` (e.g. `204`), no headers and an empty body.
    pub fn new(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: String::new(),
        }
    }

    /// `303 See Other` to `location`: after a form is submitted, the browser GETs `location`
    /// (Post/Redirect/Get), and a resubmitted form is answered the same.
    pub fn see_other(location: impl Into<String>) -> Self {
        Self::new(303).header(LOCATION.as_str(), location)
    }

    /// `200 OK` with a rendered page: `Content-Type: text/html; charset=utf-8`.
    pub fn html(page: impl Into<String>) -> Self {
        Self::new(200)
            .header(CONTENT_TYPE.as_str(), "text/html; charset=utf-8")
            .body(page)
    }

    /// The same answer with `status` (`Answer::html(page).status(422)`: the form again,
    /// with its errors).
    pub fn status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    /// Adds a header `name: value` (a repeated name adds a field line).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Adds a `Set-Cookie: cookie` header: a flash message, say.
    pub fn set_cookie(self, cookie: impl Into<String>) -> Self {
        self.header(SET_COOKIE.as_str(), cookie)
    }

    /// The same answer with `body`.
    pub fn body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }

    /// Its status.
    pub fn status_code(&self) -> u16 {
        self.status
    }

    /// Its headers, in order.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// Its body.
    pub fn body_text(&self) -> &str {
        &self.body
    }

    /// The answer as a response, marked `Idempotent-Replayed: true` when `replayed`.
    pub fn to_response(&self, replayed: bool) -> http::Response<Vec<u8>> {
        let mut response = match self.checked() {
            Ok(response) => response,
            Err(detail) => {
                tracing::error!(%detail, "an idempotent call's answer is not a valid HTTP answer");
                Problem::new(500, "invalid-answer", "Invalid answer", detail).to_response()
            }
        };
        if replayed {
            mark_replayed(response.headers_mut());
        }
        response
    }

    /// The response, or what makes it invalid.
    fn checked(&self) -> Result<http::Response<Vec<u8>>, String> {
        let status = StatusCode::from_u16(self.status)
            .map_err(|_| format!("the answer's status {} is not 100-999", self.status))?;
        let mut response = http::Response::new(self.body.clone().into_bytes());
        *response.status_mut() = status;
        for (name, value) in &self.headers {
            let name = HeaderName::try_from(name.as_str())
                .map_err(|_| format!("the answer's header name `{name}` is not valid"))?;
            let value = HeaderValue::try_from(value.as_str()).map_err(|_| {
                format!("the answer's `{name}` header has a value that is not valid")
            })?;
            response.headers_mut().append(name, value);
        }
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_recorded_and_replayed_as_it_was() {
        let page = Answer::html("<p>Saved</p>")
            .status(201)
            .set_cookie("flash=a")
            .set_cookie("flash2=b");
        let recorded = serde_json::to_string(&page).expect("json");
        let replayed: Answer = serde_json::from_str(&recorded).expect("json");
        assert_eq!(replayed, page);
        let response = replayed.to_response(true);
        assert_eq!(response.status(), 201);
        let cookies: Vec<_> = response.headers().get_all(SET_COOKIE).iter().collect();
        assert_eq!(cookies, ["flash=a", "flash2=b"]);
        assert_eq!(response.headers()[CONTENT_TYPE], "text/html; charset=utf-8");
        assert_eq!(response.body(), b"<p>Saved</p>");
        assert!(
            page.to_response(false)
                .headers()
                .get("idempotent-replayed")
                .is_none()
        );
    }

    #[test]
    fn an_invalid_answer_is_a_500_that_says_why() {
        for (answer, says) in [
            (Answer::see_other("/a\nb"), "`location`"),
            (Answer::new(303).header("bad name", "x"), "`bad name`"),
            (Answer::new(42), "42"),
        ] {
            let response = answer.to_response(false);
            assert_eq!(response.status(), 500);
            let body = String::from_utf8(response.into_body()).expect("text");
            assert!(body.contains(says), "{body}");
        }
    }
}
