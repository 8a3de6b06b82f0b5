//! The types of a conditional write as the web frameworks take them: the request's
//! [`IfMatch`] and the response's [`ETag`] (their extractor and header impls are in
//! `frameworks/`, behind each framework's feature).

use idem_core::EntityTag;

/// The `If-Match` precondition of a request, as an extractor (axum and actix-web, features
/// `axum`, `actix`): a route that takes `IfMatch`
/// requires the header (428 `precondition-required` without it) and refuses a malformed one
/// (400 `invalid-precondition`); take `Option<IfMatch>` where a precondition is optional.
/// Several `If-Match` field lines are one list (RFC 9110 §5.3).
///
/// It dereferences to the precondition itself, [`idem_core::IfMatch`], so `&if_match` goes
/// where a store expects `&idem::IfMatch` (`Stateful::update_if_match`), and it is
/// fingerprinted as that precondition: passed to an `#[idempotent]` function, it is part of
/// the request's fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct IfMatch(pub idem_core::IfMatch);

impl IfMatch {
    /// The precondition.
    pub fn into_inner(self) -> idem_core::IfMatch {
        self.0
    }
}

impl std::ops::Deref for IfMatch {
    type Target = idem_core::IfMatch;

    fn deref(&self) -> &idem_core::IfMatch {
        &self.0
    }
}

impl From<idem_core::IfMatch> for IfMatch {
    fn from(precondition: idem_core::IfMatch) -> Self {
        Self(precondition)
    }
}

impl From<IfMatch> for idem_core::IfMatch {
    fn from(if_match: IfMatch) -> Self {
        if_match.0
    }
}

/// The `ETag` header of a response: an axum response part (`(ETag(EntityTag::from_version(3)),
/// Json(order))`) or an actix-web header (`HttpResponse::Ok().insert_header(ETag(tag))`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ETag(pub EntityTag);

impl From<EntityTag> for ETag {
    fn from(tag: EntityTag) -> Self {
        Self(tag)
    }
}
