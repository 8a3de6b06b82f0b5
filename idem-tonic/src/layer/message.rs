//! The request message of a unary call, decoded from its gRPC frame and fingerprinted.

use idem_core::call::Call;
use serde::Serialize;
use tonic::{Code, Status};

/// Decodes a unary call's body as its method's message and adds the message to the call's
/// fingerprint.
pub(super) type Fingerprint = fn(&[u8], &mut Call) -> Result<(), Status>;

/// The message of a unary call's body: one gRPC frame (a compression flag, a 4-byte
/// big-endian length, the message).
fn one_message(body: &[u8]) -> Result<&[u8], Status> {
    let invalid = |why: &str| {
        Status::new(
            Code::InvalidArgument,
            format!("the request is not one gRPC message: {why}"),
        )
    };
    let [compressed, a, b, c, d, message @ ..] = body else {
        return Err(invalid("shorter than a frame's header"));
    };
    if *compressed != 0 {
        return Err(Status::new(
            Code::Unimplemented,
            "idempotent methods take uncompressed requests: the fingerprint is the decoded message",
        ));
    }
    let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
    if message.len() != len {
        return Err(invalid(if message.len() > len {
            "more than one message (unary methods only)"
        } else {
            "the frame is cut short"
        }));
    }
    Ok(message)
}

/// [`Fingerprint`] for methods whose request message is `M`.
pub(super) fn fingerprint_as<M>(body: &[u8], call: &mut Call) -> Result<(), Status>
where
    M: prost::Message + Default + Serialize,
{
    let message = M::decode(one_message(body)?).map_err(|e| {
        Status::new(
            Code::InvalidArgument,
            format!("the request message does not decode: {e}"),
        )
    })?;
    call.named_arg("message", &message);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_is_exactly_one_uncompressed_frame() {
        assert_eq!(one_message(&[0, 0, 0, 0, 2, 8, 1]).expect("one"), &[8, 1]);
        let code = |body: &[u8]| one_message(body).expect_err("not one message").code();
        assert_eq!(code(&[0, 0, 0]), Code::InvalidArgument);
        assert_eq!(code(&[0, 0, 0, 0, 3, 8, 1]), Code::InvalidArgument);
        assert_eq!(code(&[0, 0, 0, 0, 1, 8, 1]), Code::InvalidArgument);
        assert_eq!(code(&[1, 0, 0, 0, 2, 8, 1]), Code::Unimplemented);
    }
}
