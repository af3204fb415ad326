//! The storage key format, in one place: `<prefix>:{<scope>:<identity-hash>}:<rule>:<limit>`.
//!
//! The `{…}` part is a Redis Cluster hash tag: Redis hashes only it, so one identity's limits
//! share one slot and can be decided in one script call; the sharded store places identities
//! by the same tag. Everything that reads a key's parts back reads them here, so the layout
//! and its readers cannot drift apart.
//!
//! Keys built by the layer cannot be misread: the builder refuses a prefix with `{`, `}` or
//! `:` (`RateLimitLayerBuilder::build`, `BuildError::InvalidPrefix`), and rule and limit names
//! are `A-Z a-z 0-9 - _ .` only (`limit::is_valid_name`), so the first `{` of a key opens its
//! tag and the tag's last `:` ends the scope (the hash is 32 hex digits).

use std::fmt::{self, Write as _};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, PoisonError};

use hashbrown::{DefaultHashBuilder, HashTable};

use super::{Identity, IdentityHash, StackText};

/// Checks a storage key prefix: 1 to 64 characters, without `{`, `}` or `:` (they delimit the
/// parts of a key). Plans that build their own keys (a gateway's) use the same rule.
pub fn check_key_prefix(prefix: &str) -> Result<(), crate::error::BuildError> {
    let valid = !prefix.is_empty() && prefix.len() <= 64 && !prefix.contains(['{', '}', ':']);
    if valid {
        Ok(())
    } else {
        Err(crate::error::BuildError::InvalidPrefix(prefix.to_owned()))
    }
}

/// The storage key of one limit for one identity:
/// `<prefix>:{<scope>:<identity-hash>}:<rule>:<limit-name>`. The `{…}` hash tag keeps one
/// identity's limits on one Redis Cluster slot, so they can be decided in one script call.
pub fn storage_key(
    prefix: &str,
    scope: &str,
    hash: &IdentityHash,
    rule: &str,
    limit: &str,
) -> Arc<str> {
    let hex = hash.to_hex();
    let tag = ClientTag {
        scope,
        // Hex digits are ASCII.
        hash: std::str::from_utf8(&hex).unwrap_or_default(),
    };
    // Formatted on the stack, then copied once into the shared string: one allocation per key
    // on the request path instead of two.
    let mut text = StackText::<256>::new();
    match write!(text, "{prefix}:{{{tag}}}:{rule}:{limit}") {
        Ok(()) => Arc::from(text.as_str()),
        Err(_) => Arc::from(format!("{prefix}:{{{tag}}}:{rule}:{limit}")),
    }
}

/// The storage keys of the identities seen lately, so that a client's every request does not
/// hash its identity (SHA-256) and format its keys again: about a sixth of the layer's own
/// time per request on the memory store (`bench/layer_overhead.sh`). Bounded: a shard that
/// holds [`RecentKeys::SHARD_CAPACITY`] identities is emptied before it takes another, so that
/// a flood of one-off clients costs what it did without the cache, and no more memory.
///
/// An identity is hashed once, with the hasher the memory store uses (foldhash, seeded per
/// instance), and that hash both picks the shard and finds the entry in it. foldhash resists
/// deliberate collisions less than SipHash; identities are the client's to choose, but a
/// shard never holds more than [`RecentKeys::SHARD_CAPACITY`] of them, which bounds what a
/// collision flood can cost.
pub(crate) struct RecentKeys {
    hasher: DefaultHashBuilder,
    shards: Box<[Mutex<KeysOf>]>,
}

/// One shard of [`RecentKeys`]: each identity, its hash and its keys, one per limit of the plan.
type KeysOf = HashTable<(Identity, u64, Arc<[Arc<str>]>)>;

impl RecentKeys {
    const SHARDS: usize = 16;
    const SHARD_CAPACITY: usize = 1024;

    pub(crate) fn new() -> RecentKeys {
        RecentKeys {
            hasher: DefaultHashBuilder::default(),
            shards: (0..Self::SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    /// Whether `identity` is small enough to remember: API keys and user ids are capped at
    /// [`super::MAX_IDENTITY_LEN`] where they are read, an application's custom identity is
    /// not, and a bound by count alone must also bound the memory.
    fn worth_keeping(identity: &Identity) -> bool {
        match identity {
            Identity::ApiKey(value) | Identity::User(value) => {
                value.len() <= super::MAX_IDENTITY_LEN
            }
            Identity::Custom { scope, value } => {
                scope.len() + value.len() <= super::MAX_IDENTITY_LEN
            }
            Identity::Ip(_) | Identity::Unknown => true,
        }
    }

    /// The keys of `identity`: remembered, or made by `make` and remembered (if it is not too
    /// large to keep).
    pub(crate) fn get_or_make(
        &self,
        identity: &Identity,
        make: impl FnOnce() -> Arc<[Arc<str>]>,
    ) -> Arc<[Arc<str>]> {
        let hash = self.hasher.hash_one(identity);
        // The table places entries by the hash's low bits and tells them apart by its top
        // seven: the shard is chosen by bits that neither uses.
        let shard = &self.shards[(hash >> 32) as usize % Self::SHARDS];
        let same =
            |(known, known_hash, _): &(Identity, u64, _)| *known_hash == hash && known == identity;
        if let Some((_, _, keys)) = shard
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .find(hash, same)
        {
            return keys.clone();
        }
        let keys = make();
        if !Self::worth_keeping(identity) {
            return keys;
        }
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        if shard.len() >= Self::SHARD_CAPACITY {
            shard.clear();
        }
        // Another request of the same client may have made its keys meanwhile: keep one entry.
        if shard.find(hash, same).is_none() {
            shard.insert_unique(hash, (identity.clone(), hash, keys.clone()), |entry| {
                entry.1
            });
        }
        keys
    }
}

impl std::fmt::Debug for RecentKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecentKeys").finish_non_exhaustive()
    }
}

/// Which characters a part of a storage key keeps ([`key_part`]); every other becomes `_`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyChars {
    /// `A-Z a-z 0-9 - _ .`: the characters of limit and rule names.
    Name,
    /// As [`KeyChars::Name`], and `/`: an endpoint's path.
    Path,
    /// Every character but the key's delimiters, `:`, `{` and `}`.
    Text,
}

impl KeyChars {
    /// Whether a part of this kind keeps `c` as it is.
    pub fn keeps(self, c: char) -> bool {
        let name = c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        match self {
            KeyChars::Name => name,
            KeyChars::Path => name || c == '/',
            KeyChars::Text => !matches!(c, ':' | '{' | '}'),
        }
    }
}

/// `text` as a part of a storage key: each character `chars` does not keep becomes `_`. The
/// one sanitiser of key parts, so that what a key may hold is decided in one place.
pub fn key_part(text: &str, chars: KeyChars) -> String {
    text.chars()
        .map(|c| if chars.keeps(c) { c } else { '_' })
        .collect()
}

/// The part of `key` that Redis Cluster hashes, by Redis's own rule: what lies between the
/// first `{` and the next `}` if that is not empty, else the whole key. Redis Cluster slots
/// (`store::redis::hash_slot`) and sharded placement (`store::redis::rendezvous`) both hash
/// this, so one identity's limits land together under either.
pub fn hash_tag(key: &str) -> &str {
    tag(key).unwrap_or(key)
}

/// The scope inside `key`'s hash tag (`global`, `ip`, `key`, `user`, a custom scope), or
/// `None` for a key without a `<scope>:<hash>` tag.
pub fn scope(key: &str) -> Option<&str> {
    ClientTag::of_key(key).map(|tag| tag.scope)
}

/// A client's tag, `<scope>:<hash>`: what its storage keys hold inside `{…}`, and how hot
/// identities and overrides name the client. Written ([`fmt::Display`]) and read back
/// ([`ClientTag::parse`]) here only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientTag<'a> {
    /// `key`, `user`, `ip`, `unknown` ([`super::IdentityScope`]), `global`, or a custom scope
    /// (which may hold a `:`).
    pub scope: &'a str,
    /// The identity's hash: 32 hex digits (a global ceiling's tag holds its own name here).
    pub hash: &'a str,
}

impl<'a> ClientTag<'a> {
    /// Reads a tag back; `None` for text without a `:`. The hash never holds a `:`, so the
    /// last one ends the scope.
    pub fn parse(text: &'a str) -> Option<ClientTag<'a>> {
        let (scope, hash) = text.rsplit_once(':')?;
        Some(ClientTag { scope, hash })
    }

    /// The tag of a storage key; `None` for a key without one.
    pub fn of_key(key: &'a str) -> Option<ClientTag<'a>> {
        ClientTag::parse(tag(key)?)
    }
}

impl fmt::Display for ClientTag<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.scope, self.hash)
    }
}

/// The non-empty text between the first `{` and the next `}`. `{` and `}` are ASCII, so the
/// byte positions `find` returns are character boundaries.
fn tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Identity;

    #[test]
    fn storage_key_layout_keeps_identity_in_a_hash_tag() {
        let hash = Identity::ApiKey("secret-key".into()).hash();
        let key = storage_key("fg", "key", &hash, "api", "per-second");
        assert_eq!(&*key, format!("fg:{{key:{hash}}}:api:per-second"));
        let long_rule = "r".repeat(300);
        let long = storage_key("fg", "key", &hash, &long_rule, "x");
        assert_eq!(
            &*long,
            format!("fg:{{key:{hash}}}:{long_rule}:x"),
            "falls back to the heap"
        );
        assert!(!key.contains("secret-key"));
        assert_eq!(hash.to_string().len(), 32);
    }

    #[test]
    fn a_built_key_reads_back_its_tag_and_scope() {
        let hash = Identity::ApiKey("secret-key".into()).hash();
        for scope_name in ["global", "ip", "key", "user", "unknown", "tenant", "org:eu"] {
            let key = storage_key("fg", scope_name, &hash, "plan.free", "per-second");
            assert_eq!(hash_tag(&key), format!("{scope_name}:{hash}"));
            assert_eq!(scope(&key), Some(scope_name));
        }
    }

    #[test]
    fn keys_without_a_tag_hash_whole_and_have_no_scope() {
        for key in ["", "plain", "{}", "a{}b", "a{b", "a}b{", "}{"] {
            assert_eq!(hash_tag(key), key, "{key:?}");
            assert_eq!(scope(key), None, "{key:?}");
        }
        assert_eq!(hash_tag("{a}{b}"), "a");
        assert_eq!(
            hash_tag("foo{}{bar}"),
            "foo{}{bar}",
            "an empty first tag counts"
        );
        assert_eq!(hash_tag("foo{{bar}}zap"), "{bar");
        assert_eq!(scope("{tagonly}"), None, "a tag without `:` has no scope");
    }

    /// The rule `slot.rs` applied on bytes before this module existed.
    fn slot_rule(key: &str) -> &[u8] {
        let bytes = key.as_bytes();
        bytes
            .iter()
            .position(|&b| b == b'{')
            .and_then(|open| {
                let rest = &bytes[open + 1..];
                let close = rest.iter().position(|&b| b == b'}')?;
                (close > 0).then(|| &rest[..close])
            })
            .unwrap_or(bytes)
    }

    /// The rule `sharded.rs` applied on `str` before this module existed.
    fn sharded_rule(key: &str) -> &str {
        key.find('{')
            .and_then(|open| {
                let rest = &key[open + 1..];
                let close = rest.find('}')?;
                (close > 0).then(|| &rest[..close])
            })
            .unwrap_or(key)
    }

    #[test]
    fn hash_tag_is_the_rule_both_slots_and_shards_used() {
        // Placement must not move: the one rule gives what each call site computed before.
        let mut keys: Vec<String> = [
            "",
            "{",
            "}",
            "{}",
            "}{",
            "{}{}",
            "a{b",
            "a}b",
            "{a}{b}",
            "{{a}}",
            "{}{a}",
            "a{}b{c}",
            "{a",
            "a}",
            "é{ü}ß",
            "{ü}",
            "x{é}",
            "{}é",
            "fg:{ip:0123}:r:l",
            "foo{{bar}}zap",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        // Every string of up to five characters over an alphabet with both braces, a colon
        // and a multi-byte character.
        let alphabet = ['{', '}', 'a', ':', 'é'];
        let mut layer = vec![String::new()];
        for _ in 0..5 {
            layer = layer
                .iter()
                .flat_map(|prefix| alphabet.iter().map(move |c| format!("{prefix}{c}")))
                .collect();
            keys.extend(layer.iter().cloned());
        }
        let mut random = fastrand::Rng::with_seed(17);
        for _ in 0..10_000 {
            let len = random.usize(0..24);
            let key: String = (0..len)
                .map(|_| match random.u8(0..8) {
                    0 => '{',
                    1 => '}',
                    2 => 'é',
                    _ => random.alphanumeric(),
                })
                .collect();
            keys.push(key);
        }
        for key in &keys {
            assert_eq!(hash_tag(key).as_bytes(), slot_rule(key), "{key:?}");
            assert_eq!(hash_tag(key), sharded_rule(key), "{key:?}");
        }
    }

    fn keys_of(identity: &Identity) -> Arc<[Arc<str>]> {
        let hash = identity.hash();
        Arc::from([storage_key("fg", identity.scope(), &hash, "r", "l")])
    }

    #[test]
    fn recent_keys_are_made_once_per_identity_and_kept_apart() {
        let recent = RecentKeys::new();
        let alice = Identity::ApiKey("alice".into());
        let bob = Identity::User("alice".into());
        let first = recent.get_or_make(&alice, || keys_of(&alice));
        let again = recent.get_or_make(&alice, || panic!("made again"));
        assert!(Arc::ptr_eq(&first, &again));
        let other = recent.get_or_make(&bob, || keys_of(&bob));
        assert_ne!(first, other, "another scope, other keys");
        assert_eq!(&*first, &*keys_of(&alice));
    }

    #[test]
    fn a_full_shard_is_emptied_before_it_takes_another_identity() {
        let recent = RecentKeys::new();
        let identities: Vec<Identity> = (0..20 * RecentKeys::SHARD_CAPACITY)
            .map(|n| Identity::User(n.to_string()))
            .collect();
        for identity in &identities {
            recent.get_or_make(identity, || keys_of(identity));
        }
        for shard in &recent.shards {
            let held = shard.lock().unwrap().len();
            assert!(
                (1..=RecentKeys::SHARD_CAPACITY).contains(&held),
                "{held} identities in one shard"
            );
        }
        // A custom identity too large to keep is made every time.
        let large = Identity::Custom {
            scope: "tenant".into(),
            value: "x".repeat(super::super::MAX_IDENTITY_LEN),
        };
        let made = recent.get_or_make(&large, || keys_of(&large));
        let again = recent.get_or_make(&large, || keys_of(&large));
        assert!(!Arc::ptr_eq(&made, &again));
        assert_eq!(made, again);
        // Whatever was forgotten is made again, the same.
        let first = &identities[0];
        assert_eq!(
            &*recent.get_or_make(first, || keys_of(first)),
            &*keys_of(first)
        );
    }

    #[test]
    fn a_client_tag_reads_back_what_it_writes() {
        let hash = Identity::User("ana".into()).hash();
        let hex = hash.to_string();
        for scope in ["key", "user", "ip", "unknown", "tenant", "org:eu"] {
            let tag = ClientTag { scope, hash: &hex };
            let written = tag.to_string();
            assert_eq!(ClientTag::parse(&written), Some(tag), "{written}");
            let key = storage_key("fg", scope, &hash, "r", "l");
            assert_eq!(ClientTag::of_key(&key), Some(tag), "{key}");
            assert_eq!(hash_tag(&key), written);
        }
        assert_eq!(ClientTag::parse("no-colon"), None);
        assert_eq!(ClientTag::of_key("fg:plain"), None);
    }

    #[test]
    fn key_parts_keep_what_their_kind_allows() {
        assert_eq!(key_part("plan.gold-1_x", KeyChars::Name), "plan.gold-1_x");
        assert_eq!(key_part("a b:{c}/é", KeyChars::Name), "a_b__c___");
        assert_eq!(key_part("/v1/{id}:run", KeyChars::Path), "/v1/_id__run");
        assert_eq!(key_part("api:{eu} é", KeyChars::Text), "api__eu_ é");
    }
}
