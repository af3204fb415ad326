//! Redis Cluster hash slots: which keys can share one script call.

use crate::key::storage::hash_tag;

/// CRC16-CCITT (XMODEM), as Redis Cluster uses for key slots.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The cluster slot of `key`: the CRC16 of its [`hash_tag`] (its `{hash tag}` if it has a
/// non-empty one, else the whole key), modulo 16384.
pub fn hash_slot(key: &str) -> u16 {
    crc16(hash_tag(key).as_bytes()) % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_redis_cluster_keyslot() {
        // Values from `CLUSTER KEYSLOT` in the Redis Cluster specification's examples.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(hash_slot("foo"), 12182);
        assert_eq!(
            hash_slot("{user1000}.following"),
            hash_slot("{user1000}.followers")
        );
        assert_eq!(hash_slot("foo{}{bar}"), hash_slot("foo{}{bar}"));
        assert_ne!(
            hash_slot("foo{}{bar}"),
            hash_slot("bar"),
            "an empty tag hashes the whole key"
        );
        assert_eq!(hash_slot("foo{{bar}}zap"), hash_slot("{bar"));
    }

    #[test]
    fn one_identity_shares_one_slot() {
        let a = "fg:{ip:0123456789abcdef0123456789abcdef}:api:per-second";
        let b = "fg:{ip:0123456789abcdef0123456789abcdef}:api:daily";
        assert_eq!(hash_slot(a), hash_slot(b));
    }
}
