//! The bearer credential of an `Authorization` value (RFC 6750 §2.1), read in one place for
//! the library's API keys and the gateway's tokens.
//!
//! RFC 7235 puts one space between the scheme and the credential, and the scheme's case is
//! free. Upstreams are more lenient still: many split the value on any run of whitespace. A
//! credential the limiter did not read but the upstream does is a tenant served without being
//! counted, so the value is read as the most lenient upstream reads it: `Bearer`, `bearer` and
//! `BEARER`, followed by spaces or tabs in any number, all name the same credential.

/// The credential of an `Authorization` value in the bearer scheme: the scheme in any case,
/// then any run of spaces and tabs (or Latin-1's NEL and NBSP), then the credential with
/// those trimmed around it (empty when the value is the scheme alone). `None` for another scheme (`Basic`,
/// `Bearerish`), whose value is not a bearer credential.
///
/// ```
/// use floodgate::key::bearer_credential;
/// assert_eq!(bearer_credential(b"Bearer abc"), Some(&b"abc"[..]));
/// assert_eq!(bearer_credential(b"bEaReR\t  abc "), Some(&b"abc"[..]));
/// assert_eq!(bearer_credential(b"Basic dXNlcjpwYXNz"), None);
/// ```
pub fn bearer_credential(value: &[u8]) -> Option<&[u8]> {
    let value = trim_blanks(value);
    let scheme = value.get(..6)?;
    let rest = &value[6..];
    let separated = rest.first().is_none_or(|byte| is_blank(*byte));
    (scheme.eq_ignore_ascii_case(b"bearer") && separated).then(|| trim_blanks(rest))
}

/// Whitespace an upstream may split an `Authorization` value on: spaces and tabs (a header
/// value holds no line breaks), and the two Latin-1 spaces (NEL, NBSP) that a value decoded
/// as Latin-1 and split on Unicode whitespace (Python's `str.split()`) also breaks at.
fn is_blank(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | 0x85 | 0xa0)
}

fn trim_blanks(mut bytes: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = bytes
        && is_blank(*first)
    {
        bytes = rest;
    }
    while let [rest @ .., last] = bytes
        && is_blank(*last)
    {
        bytes = rest;
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_an_upstream_reads_is_a_bearer_credential() {
        for value in [
            &b"Bearer abc"[..],
            b"bearer abc",
            b"BEARER abc",
            b"Bearer\tabc",
            b"Bearer   abc",
            b"  Bearer \t abc \t",
            b"Bearer\xa0abc",
            b"Bearer\x85abc",
        ] {
            assert_eq!(
                bearer_credential(value),
                Some(&b"abc"[..]),
                "{}",
                String::from_utf8_lossy(value)
            );
        }
        assert_eq!(bearer_credential(b"Bearer"), Some(&b""[..]));
        assert_eq!(bearer_credential(b"Bearer \t "), Some(&b""[..]));
        // The credential keeps what is inside it.
        assert_eq!(bearer_credential(b"Bearer a b"), Some(&b"a b"[..]));
    }

    #[test]
    fn other_schemes_and_short_values_are_not() {
        for value in [
            &b"Basic dXNlcjpwYXNz"[..],
            b"Bearerabc",
            b"Beare",
            b"",
            b"\xff\xfe",
            b"Bearer\xffabc",
            b"Bearer.abc",
        ] {
            assert_eq!(
                bearer_credential(value),
                None,
                "{}",
                String::from_utf8_lossy(value)
            );
        }
    }
}
