//! What became of a request in the gateway: the layer's [`Outcome`], or what the gateway
//! decided before the layer saw the request. One value per request, read by the access log.

use floodgate::Outcome;

/// What became of a request, as the access log's `decision` field names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GatewayOutcome {
    /// What the rate limit layer made of it (the gateway's allowlist and denylist, which
    /// answer before the layer, say [`Outcome::Bypassed`] and [`Outcome::Denylisted`] too).
    Limiter(Outcome),
    /// Refused before any identity: a malformed head or path.
    Rejected,
    /// An API key no client has: 401.
    UnknownKey,
    /// A token `identity.jwt` does not trust: 401.
    InvalidToken,
    /// The client went away before the answer's head (499).
    ClientClosed,
    /// Refused by `adaptive_concurrency`: 503 (SPEC §11).
    Shed,
}

impl GatewayOutcome {
    /// The `decision` field's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            GatewayOutcome::Limiter(outcome) => outcome.as_str(),
            GatewayOutcome::Rejected => "rejected",
            GatewayOutcome::UnknownKey => "unknown_key",
            GatewayOutcome::InvalidToken => "invalid_token",
            GatewayOutcome::ClientClosed => "client_closed",
            GatewayOutcome::Shed => "shed",
        }
    }

    /// Whether the limiter refused the request (`access_log.only: limited`): the layer's
    /// refusals, an unknown API key, a refused token and a request shed.
    pub(crate) fn is_refused(self) -> bool {
        match self {
            GatewayOutcome::Limiter(outcome) => outcome.is_refused(),
            GatewayOutcome::UnknownKey | GatewayOutcome::InvalidToken | GatewayOutcome::Shed => {
                true
            }
            GatewayOutcome::Rejected | GatewayOutcome::ClientClosed => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateways_own_outcomes_are_named_apart_from_the_layers() {
        let own = [
            GatewayOutcome::Rejected,
            GatewayOutcome::UnknownKey,
            GatewayOutcome::InvalidToken,
            GatewayOutcome::ClientClosed,
            GatewayOutcome::Shed,
        ];
        for outcome in own {
            assert_ne!(
                outcome.as_str(),
                GatewayOutcome::Limiter(Outcome::Unlimited).as_str()
            );
        }
        assert!(GatewayOutcome::UnknownKey.is_refused());
        assert!(GatewayOutcome::InvalidToken.is_refused());
        assert!(GatewayOutcome::Shed.is_refused());
        assert!(!GatewayOutcome::Rejected.is_refused());
        assert!(GatewayOutcome::Limiter(Outcome::Limited).is_refused());
        assert!(!GatewayOutcome::Limiter(Outcome::ShadowLimited).is_refused());
        assert_eq!(
            GatewayOutcome::Limiter(Outcome::FallbackLimited).as_str(),
            "fallback_limited"
        );
    }
}
