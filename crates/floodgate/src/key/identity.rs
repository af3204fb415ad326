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

/// The scopes of the built-in identities, as storage keys, logs and the admin API name them:
/// `key`, `user`, `ip`, `unknown`. (A custom identity's scope is its own.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdentityScope {
    /// An API key's: `key`.
    ApiKey,
    /// A user id's: `user`.
    User,
    /// A client IP's: `ip`.
    Ip,
    /// An unidentified client's: `unknown`.
    Unknown,
}

impl IdentityScope {
    /// Every built-in scope.
    pub const ALL: [IdentityScope; 4] = [
        IdentityScope::ApiKey,
        IdentityScope::User,
        IdentityScope::Ip,
        IdentityScope::Unknown,
    ];

    /// The scope's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            IdentityScope::ApiKey => "key",
            IdentityScope::User => "user",
            IdentityScope::Ip => "ip",
            IdentityScope::Unknown => "unknown",
        }
    }

    /// Whether clients of this scope are anonymous (counted by IP, or not identified at all).
    pub const fn is_anonymous(self) -> bool {
        matches!(self, IdentityScope::Ip | IdentityScope::Unknown)
    }
}

impl fmt::Display for IdentityScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not a built-in identity scope.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not an identity scope; expected key, user, ip or unknown")]
pub struct UnknownScope(pub String);

impl std::str::FromStr for IdentityScope {
    type Err = UnknownScope;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        IdentityScope::ALL
            .into_iter()
            .find(|scope| scope.as_str() == name)
            .ok_or_else(|| UnknownScope(name.to_owned()))
    }
}

impl Identity {
    /// The scope part of storage keys: `key`, `user`, `ip`, the custom scope, or `unknown`.
    pub fn scope(&self) -> &str {
        match self {
            Identity::ApiKey(_) => IdentityScope::ApiKey.as_str(),
            Identity::User(_) => IdentityScope::User.as_str(),
            Identity::Ip(_) => IdentityScope::Ip.as_str(),
            Identity::Custom { scope, .. } => scope,
            Identity::Unknown => IdentityScope::Unknown.as_str(),
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
    fn built_in_scopes_read_back_their_names() {
        for scope in IdentityScope::ALL {
            assert_eq!(scope.as_str().parse(), Ok(scope));
        }
        assert!("Key".parse::<IdentityScope>().is_err());
        assert!("tenant".parse::<IdentityScope>().is_err());
        assert_eq!(Identity::Unknown.scope(), "unknown");
    }

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
