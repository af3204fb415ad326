//! Request paths as the limiter and the upstream both see them (SPEC §5 "Paths").
//!
//! Endpoint patterns must match what the upstream will serve, and upstreams normalise: if
//! `/%65xport`, `//export` or `/a/../export` reached `/export` upstream while the limiter saw
//! another path, a `POST /export` limit would be decoration. So the gateway normalises the
//! path once, matches on it, and forwards that same path.

use std::fmt;

/// Why a path cannot be normalised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathError {
    /// A `..` segment climbs above the root (`/../x`): answered 400.
    AboveRoot,
    /// A `%` not followed by two hex digits (RFC 3986 §2.1): answered 400, as nginx does. Left
    /// in place it would let `/%%65x` decode to a new escape, `/%ex`, on a second pass.
    BadEscape,
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathError::AboveRoot => f.write_str("the path climbs above the root"),
            PathError::BadEscape => f.write_str("the path has a malformed percent-escape"),
        }
    }
}

impl std::error::Error for PathError {}

/// The normalised form of an absolute path (no query):
/// - percent-encoded unreserved characters decoded (`%65` → `e`); other escapes kept, with
///   upper-case hex digits (`%2f` → `%2F`: an encoded `/` stays encoded);
/// - a `%` that starts no escape refused;
/// - runs of `/` merged into one (as nginx's `merge_slashes`);
/// - dot-segments removed (RFC 3986 §5.2.4), an error if one climbs above the root.
///
/// Returns `None` when the path is already normal, so the common case allocates nothing.
/// Normalising a normal path changes nothing (the function is idempotent).
pub fn normalize(path: &str) -> Result<Option<String>, PathError> {
    if is_normal(path.as_bytes()) {
        return Ok(None);
    }
    let decoded = decode_unreserved(path.as_bytes())?;
    let mut segments: Vec<&[u8]> = Vec::new();
    let mut rest = decoded.as_slice();
    // The leading `/` (absent only from odd targets such as `*`, which are kept as they are).
    let absolute = rest.first() == Some(&b'/');
    if !absolute {
        return Ok(None);
    }
    let mut trailing_slash = false;
    while !rest.is_empty() {
        rest = &rest[1..]; // the `/` before this segment
        let end = rest
            .iter()
            .position(|&byte| byte == b'/')
            .unwrap_or(rest.len());
        let segment = &rest[..end];
        let last = end == rest.len();
        rest = &rest[end..];
        match segment {
            b"" => trailing_slash = last,
            b"." => trailing_slash = true,
            b".." => {
                if segments.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
                trailing_slash = true;
            }
            _ => {
                segments.push(segment);
                trailing_slash = false;
            }
        }
    }
    let mut normal = Vec::with_capacity(decoded.len());
    for segment in &segments {
        normal.push(b'/');
        normal.extend_from_slice(segment);
    }
    if trailing_slash || segments.is_empty() {
        normal.push(b'/');
    }
    if normal == path.as_bytes() {
        // `%` that needed no decoding (`/100%`, `/a%2Fb`): already normal.
        return Ok(None);
    }
    // Only ASCII was written: the input was a URI path, and decoding yields only unreserved
    // ASCII characters.
    Ok(Some(String::from_utf8(normal).unwrap_or_default()))
}

/// `uri` with its path normalised (query kept), or `None` when it already is normal.
pub(crate) fn normalize_uri(uri: &http::Uri) -> Result<Option<http::Uri>, PathError> {
    let Some(path) = normalize(uri.path())? else {
        return Ok(None);
    };
    let path_and_query = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path,
    };
    let mut parts = uri.clone().into_parts();
    // Built from a valid path and query by removing or decoding characters: still valid.
    parts.path_and_query = http::uri::PathAndQuery::try_from(path_and_query).ok();
    Ok(http::Uri::from_parts(parts).ok())
}

/// Fast check: no `%`, no `//`, no `.` or `..` segment.
fn is_normal(path: &[u8]) -> bool {
    if path.first() != Some(&b'/') {
        return true;
    }
    if path.contains(&b'%') || path.windows(2).any(|pair| pair == b"//") {
        return false;
    }
    !path
        .split(|&byte| byte == b'/')
        .any(|segment| segment == b"." || segment == b"..")
}

fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

/// Decodes `%XX` escapes of unreserved characters; upper-cases the hex of the others.
fn decode_unreserved(path: &[u8]) -> Result<Vec<u8>, PathError> {
    let mut out = Vec::with_capacity(path.len());
    let mut index = 0;
    while index < path.len() {
        let byte = path[index];
        if byte == b'%' {
            let (Some(high), Some(low)) = (
                path.get(index + 1).copied().and_then(hex_value),
                path.get(index + 2).copied().and_then(hex_value),
            ) else {
                return Err(PathError::BadEscape);
            };
            let decoded = high << 4 | low;
            if is_unreserved(decoded) {
                out.push(decoded);
            } else {
                out.push(b'%');
                out.push(path[index + 1].to_ascii_uppercase());
                out.push(path[index + 2].to_ascii_uppercase());
            }
            index += 3;
            continue;
        }
        out.push(byte);
        index += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normal(path: &str) -> String {
        normalize(path).unwrap().unwrap_or_else(|| path.to_owned())
    }

    #[test]
    fn spellings_of_one_path_become_that_path() {
        for spelling in [
            "/export",
            "//export",
            "/%65xport",
            "/%65%78port",
            "/./export",
            "/a/../export",
            "/a/b/../../export",
            "///a//..//export",
            "/%2E/export",
            "/x/%2e%2E/export",
        ] {
            assert_eq!(normal(spelling), "/export", "{spelling}");
        }
    }

    #[test]
    fn encoded_slashes_and_reserved_escapes_stay_encoded() {
        assert_eq!(normal("/a%2fb"), "/a%2Fb");
        assert_eq!(normal("/a%2Fb/%20x"), "/a%2Fb/%20x");
        assert_eq!(normal("/a%2f%7E"), "/a%2F~");
    }

    #[test]
    fn trailing_slashes_and_the_root() {
        assert_eq!(normal("/"), "/");
        assert_eq!(normal("/a/"), "/a/");
        assert_eq!(normal("/a/."), "/a/");
        assert_eq!(normal("/a/.."), "/");
        assert_eq!(normal("//"), "/");
        assert_eq!(normal("/a//"), "/a/");
        assert_eq!(normal("*"), "*");
    }

    #[test]
    fn malformed_escapes_are_an_error() {
        for path in ["/100%", "/%zz", "/%%65x", "/%6"] {
            assert_eq!(normalize(path), Err(PathError::BadEscape), "{path}");
        }
    }

    #[test]
    fn climbing_above_the_root_is_an_error() {
        assert_eq!(normalize("/../x"), Err(PathError::AboveRoot));
        assert_eq!(normalize("/a/../../x"), Err(PathError::AboveRoot));
        assert_eq!(normalize("/%2e%2e/x"), Err(PathError::AboveRoot));
    }

    #[test]
    fn normal_paths_are_left_alone() {
        assert_eq!(normalize("/v1/things/42").unwrap(), None);
        assert_eq!(normalize("/a.b/..c/.d").unwrap(), None);
    }
}
