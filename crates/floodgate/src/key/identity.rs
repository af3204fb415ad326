//! Who a request counts against ([`Identity`]), and the stable hash that stands for it in
//! storage keys, logs and metrics ([`IdentityHash`]): identities are never stored raw.

use std::fmt::{self, Write as _};
use std::net::IpAddr;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::StackText;

/// Who a request counts against.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    /// An API key.
    ApiKey(String),
    /// A user id.
    User(String),
    /// A client IP (IPv6 already grouped by prefix).
    Ip(IpAddr),
    /// An application-defined identity in its own scope.
    Custom {
        /// The scope, kept apart from the built-in ones (`tenant`, `org`, ...).
        scope: Arc<str>,
        /// The value within the scope.
        value: String,
    },
    /// Nothing identified the client (no peer address was available). All such requests
    /// share one budget, so that unidentifiable traffic is limited rather than free.
    Unknown,
}

impl Identity {
    /// The scope part of storage keys: `key`, `user`, `ip`, the custom scope, or `unknown`.
    pub fn scope(&self) -> &str {
        match self {
            Identity::ApiKey(_) => "key",
            Identity::User(_) => "user",
            Identity::Ip(_) => "ip",
            Identity::Custom { scope, .. } => scope,
            Identity::Unknown => "unknown",
        }
    }

    /// The stable hash that stands for this identity in keys, logs and metrics.
    pub fn hash(&self) -> IdentityHash {
        let mut hasher = Sha256::new();
        hasher.update(self.scope().as_bytes());
        hasher.update(b":");
        match self {
            Identity::ApiKey(value) | Identity::User(value) | Identity::Custom { value, .. } => {
                hasher.update(value.as_bytes())
            }
            Identity::Ip(ip) => {
                let mut text = StackText::<64>::new();
                let _ = write!(text, "{ip}");
                hasher.update(text.as_bytes())
            }
            Identity::Unknown => {}
        }
        let digest = hasher.finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        IdentityHash(bytes)
    }
}

/// The first 16 bytes of SHA-256 over `scope:value`; displayed as 32 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdentityHash(pub [u8; 16]);

impl IdentityHash {
    /// The 32 lowercase hex digits.
    pub fn to_hex(&self) -> [u8; 32] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 32];
        for (index, byte) in self.0.iter().enumerate() {
            hex[2 * index] = DIGITS[usize::from(byte >> 4)];
            hex[2 * index + 1] = DIGITS[usize::from(byte & 0x0f)];
        }
        hex
    }
}

impl fmt::Display for IdentityHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        // Hex digits are ASCII.
        f.write_str(std::str::from_utf8(&hex).unwrap_or_default())
    }
}

impl fmt::Debug for IdentityHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdentityHash({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_stable_and_scoped() {
        // First 16 bytes of SHA-256("key:abc"), from `printf 'key:abc' | sha256sum`.
        assert_eq!(
            Identity::ApiKey("abc".into()).hash().to_string(),
            "09309b29285f2554ee45a02d29fa5de0"
        );
        assert_ne!(
            Identity::ApiKey("abc".into()).hash(),
            Identity::User("abc".into()).hash()
        );
    }
}
