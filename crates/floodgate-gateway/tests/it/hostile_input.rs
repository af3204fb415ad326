//! Property tests over what a hostile client or a broken file controls: request paths and
//! configuration text. Never a panic; path normalisation is idempotent and agrees with itself
//! on every spelling of one path.

use floodgate_gateway::check_text;
use floodgate_gateway::normalize;
use proptest::prelude::*;

/// Path bytes as clients write them, rich in the characters normalisation cares about.
fn path_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec![
            "/", "/", ".", "..", "%", "%2e", "%2E", "%2f", "%65", "%7e", "%zz", "a", "b", "~", "-",
            "%00", "%ff",
        ]),
        0..40,
    )
    .prop_map(|parts| format!("/{}", parts.concat()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3_000))]

    #[test]
    fn normalisation_is_idempotent(path in path_text()) {
        if let Ok(normal) = normalize(&path) {
            let normal = normal.unwrap_or_else(|| path.clone());
            prop_assert_eq!(normalize(&normal), Ok(None), "{} -> {}", path, normal);
            prop_assert!(normal.starts_with('/'));
            prop_assert!(!normal.contains("//"));
            prop_assert!(normal.split('/').all(|segment| segment != "." && segment != ".."));
        }
    }

    #[test]
    fn spelling_a_segment_out_changes_nothing(segments in prop::collection::vec("[a-z]{1,6}", 1..6)) {
        let plain = format!("/{}", segments.join("/"));
        // Each letter percent-encoded, slashes doubled, a detour through `..`.
        let encoded: String = plain
            .chars()
            .map(|c| if c == '/' { "//".to_owned() } else { format!("%{:02X}", c as u32) })
            .collect();
        let detour = format!("/x/..{plain}/.");
        prop_assert_eq!(normalize(&encoded).unwrap(), Some(plain.clone()));
        prop_assert_eq!(normalize(&detour).unwrap(), Some(format!("{plain}/")));
    }

    #[test]
    fn any_configuration_text_is_an_answer_not_a_panic(text in "\\PC{0,400}") {
        let _ = check_text(&text);
    }

    #[test]
    fn yaml_made_of_config_words_is_an_answer_not_a_panic(
        words in prop::collection::vec(
            prop::sample::select(vec![
                "plans:", "limits:", "- ", "{", "}", "[", "]", "name:", "limit:", "window:",
                "&a", "*a", "<<:", "1s", "0", "-1", "\n", "  ", "store:", "backend:", "redis",
                "server:", "max_head_bytes:", "identity:", "forwarded:", "x-forwarded-for",
                "\"", "'", ":", "algorithm:", "gcra", "99999999999999999999",
            ]),
            0..80,
        )
    ) {
        let _ = check_text(&words.concat());
    }
}
