//! Property tests over what a hostile client controls: forwarding headers and key headers, as
//! arbitrary bytes. Never a panic; forged entries left of the trusted hops never choose the
//! client; a malformed key is treated as absent.

use std::net::{IpAddr, SocketAddr};

use floodgate::key::{ClientIpResolver, DefaultIdentifier, ForwardedHeader};
use floodgate::{Identity, PeerAddr, RequestInfo};
use http::{HeaderMap, HeaderValue, Request};
use proptest::prelude::*;

fn resolver(forwarded: ForwardedHeader) -> ClientIpResolver {
    ClientIpResolver::new(vec!["10.0.0.0/8".parse().unwrap()], 64).with_forwarded(forwarded)
}

/// Header-value bytes as a client may send them (anything but NUL, CR, LF).
fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            any::<u8>().prop_filter("not a line break", |b| !matches!(b, 0 | b'\r' | b'\n')),
            prop::sample::select(b", ;=\"[]:.for".to_vec()),
            prop::sample::select(b"0123456789abcdef".to_vec()),
        ],
        0..300,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    #[test]
    fn any_forwarding_header_resolves_without_panicking(
        lines in prop::collection::vec(header_bytes(), 0..4),
        rfc in any::<bool>(),
    ) {
        let family = if rfc { ForwardedHeader::Forwarded } else { ForwardedHeader::XForwardedFor };
        let mut headers = HeaderMap::new();
        for line in &lines {
            if let Ok(value) = HeaderValue::from_bytes(line) {
                headers.append(family.as_str(), value);
            }
        }
        // From a trusted peer: some address, and no panic, whatever the bytes.
        resolver(family).client_ip("10.0.0.1".parse().unwrap(), &headers);
        // From an untrusted peer the headers change nothing.
        let untrusted_peer = resolver(family).client_ip("203.0.113.1".parse().unwrap(), &headers);
        prop_assert_eq!(untrusted_peer, "203.0.113.1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn forged_entries_left_of_the_client_choose_nothing(
        forged in header_bytes(),
        client in any::<[u8; 4]>(),
    ) {
        let client = IpAddr::from(client);
        prop_assume!(!resolver(ForwardedHeader::XForwardedFor).is_trusted(client));
        let mut chain = forged.clone();
        chain.extend_from_slice(format!(", {client}, 10.9.9.9").as_bytes());
        let Ok(value) = HeaderValue::from_bytes(&chain) else { return Ok(()); };
        let mut headers = HeaderMap::new();
        headers.append("x-forwarded-for", value);
        let resolved = resolver(ForwardedHeader::XForwardedFor)
            .client_ip("10.0.0.1".parse().unwrap(), &headers);
        prop_assert_eq!(resolved, client);
    }

    #[test]
    fn any_key_header_is_a_key_only_when_well_formed(key in header_bytes()) {
        let Ok(value) = HeaderValue::from_bytes(&key) else { return Ok(()); };
        let request = Request::builder()
            .header("x-api-key", value)
            .extension(PeerAddr("198.51.100.1:1".parse::<SocketAddr>().unwrap()))
            .body(())
            .unwrap();
        let identifier = DefaultIdentifier::new();
        let identity = floodgate::key::IdentifyClient::identify(&identifier, &RequestInfo::new(&request));
        let well_formed = !key.is_empty()
            && key.len() <= 256
            && key.iter().all(|byte| (0x21..=0x7e).contains(byte));
        match identity {
            Identity::ApiKey(found) => {
                prop_assert!(well_formed);
                prop_assert_eq!(found.as_bytes(), &key[..]);
            }
            Identity::Ip(_) => prop_assert!(!well_formed),
            other => prop_assert!(false, "unexpected identity {other:?}"),
        }
    }
}
