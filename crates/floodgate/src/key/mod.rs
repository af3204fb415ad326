//! Client identity: who a request counts against, and the storage keys it is counted under.
//!
//! The default identifier follows SPEC §3, in order: an API key (header, or
//! `Authorization: Bearer`, read as leniently as upstreams read it: [`bearer_credential`]), then a user id (a [`UserId`] request extension set by the app's
//! auth layer, or a header honoured only from a trusted proxy), then the client IP.
//! Identities are never stored raw: keys, logs and metrics carry an [`IdentityHash`].

mod bearer;
mod client_ip;
mod identifier;
mod identity;
pub mod storage;

pub use bearer::bearer_credential;
pub use client_ip::{ClientIpResolver, ForwardedHeader};
pub use identifier::{
    DefaultIdentifier, IdentifyClient, IdentityError, MAX_IDENTITY_LEN, PeerAddr, RequestInfo,
    UserId, VerifyApiKey,
};
pub use identity::{Identity, IdentityHash, IdentityScope, UnknownScope};
pub use storage::{ClientTag, KeyChars, key_part, storage_key};

use std::fmt;

/// A fixed-capacity text buffer on the stack; writing past its end fails instead of growing.
struct StackText<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> StackText<N> {
    fn new() -> Self {
        StackText {
            bytes: [0; N],
            len: 0,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    fn as_str(&self) -> &str {
        // Only whole `&str`s are ever written, so the bytes are valid UTF-8.
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

impl<const N: usize> fmt::Write for StackText<N> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let end = self.len + text.len();
        let slot = self.bytes.get_mut(self.len..end).ok_or(fmt::Error)?;
        slot.copy_from_slice(text.as_bytes());
        self.len = end;
        Ok(())
    }
}
