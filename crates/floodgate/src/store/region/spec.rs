//! A tradeable limit as regions tell each other about it: a gateway, or a region, that never
//! decided a key still has to know its limit to lend from its share of it.

use std::time::Duration;

use crate::limit::{Algorithm, Limit};

/// `"<algorithm> <limit> <window µs> <burst>"`, a limit on a plain window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LimitSpec(pub(crate) String);

impl LimitSpec {
    pub(crate) fn of(limit: &Limit) -> LimitSpec {
        LimitSpec(format!(
            "{} {} {} {}",
            limit.algorithm().as_str(),
            limit.limit(),
            limit.window_micros(),
            limit.burst()
        ))
    }

    /// The limit the spec describes (named `region`: a spec keys nothing by name), or `None`
    /// for text that is not a spec.
    pub(crate) fn limit(&self) -> Option<Limit> {
        let mut parts = self.0.split(' ');
        let algorithm: Algorithm = parts.next()?.parse().ok()?;
        let limit: u64 = parts.next()?.parse().ok()?;
        let window: u64 = parts.next()?.parse().ok()?;
        let burst: u64 = parts.next()?.parse().ok()?;
        if parts.next().is_some() {
            return None;
        }
        let mut builder = Limit::builder("region")
            .algorithm(algorithm)
            .limit(limit)
            .window(Duration::from_micros(window));
        if algorithm.uses_burst() {
            builder = builder.burst(burst);
        }
        builder.build().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_reads_back_as_its_limit() {
        let limit = Limit::builder("api")
            .algorithm(Algorithm::TokenBucket)
            .limit(300)
            .window(Duration::from_secs(1))
            .burst(450)
            .build()
            .unwrap();
        let spec = LimitSpec::of(&limit);
        assert_eq!(spec.0, "token_bucket 300 1000000 450");
        let back = spec.limit().unwrap();
        assert_eq!(
            (back.algorithm(), back.limit(), back.window(), back.burst()),
            (Algorithm::TokenBucket, 300, Duration::from_secs(1), 450)
        );
        for broken in [
            "",
            "token_bucket 300",
            "nope 1 2 3",
            "gcra 1 2 3 4",
            "gcra 0 1 1",
        ] {
            assert!(LimitSpec(broken.into()).limit().is_none(), "{broken}");
        }
    }
}
