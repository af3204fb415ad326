//! The JSON form of `ShouldRateLimit` that envoyproxy/ratelimit's `POST /json` speaks: the
//! proto3 JSON mapping (Go's `protojson`) of `RateLimitRequest` and `RateLimitResponse`.
//!
//! This module owns that format. Requests are read as `protojson.Unmarshal` reads them:
//! lowerCamelCase or proto field names (`hitsAddend`, `hits_addend`), `null` for a default,
//! integers as JSON numbers or strings holding one (`"1e2"`, not `"+5"`), enums by name or
//! number, unknown fields refused. Responses are written as `protojson.Marshal` writes them:
//! lowerCamelCase names, enums by name, durations as `"3600s"`, default values left out (an
//! `OK` status with nothing left is `{"code":"OK"}`).

use std::fmt;

use envoy_types::pb::envoy::config::core::v3::HeaderValue as ProtoHeader;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit as ProtoLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt64Value};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

/// The longest error message sent back: a reason, not an echo of the client's body.
const MAX_MESSAGE_CHARS: usize = 200;

/// A request body that is not a `RateLimitRequest` in JSON: why, short enough to send back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvalidRequest(String);

impl fmt::Display for InvalidRequest {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl std::error::Error for InvalidRequest {}

/// Reads a `RateLimitRequest` from its JSON form.
///
/// # Errors
///
/// [`InvalidRequest`] naming the field (`descriptors[0].entries[0].key`) and the problem when
/// the body is not JSON, holds a value of the wrong type, or a field `RateLimitRequest` does
/// not have.
pub(crate) fn parse_request(body: &[u8]) -> Result<RateLimitRequest, InvalidRequest> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let Object(request): Object<JsonRequest> = serde_path_to_error::deserialize(&mut deserializer)
        .map_err(|error| {
            let path = error.path().to_string();
            if path == "." {
                invalid(format_args!("{}", error.inner()))
            } else {
                invalid(format_args!("at {path}: {}", error.inner()))
            }
        })?;
    deserializer
        .end()
        .map_err(|error| invalid(format_args!("{error}")))?;
    Ok(request.into())
}

/// "invalid JSON body: <problem>", cut at [`MAX_MESSAGE_CHARS`].
fn invalid(problem: fmt::Arguments<'_>) -> InvalidRequest {
    let mut message = format!("invalid JSON body: {problem}");
    if let Some((cut, _)) = message.char_indices().nth(MAX_MESSAGE_CHARS) {
        message.truncate(cut);
        message.push('…');
    }
    InvalidRequest(message)
}

/// A message: a JSON object only (serde alone takes an array for a struct; `protojson` does
/// not).
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(std::marker::PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a JSON object")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectVisitor(std::marker::PhantomData))
            .map(Object)
    }
}

/// `RateLimitRequest` as `protojson` reads it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default, deserialize_with = "nullable")]
    domain: String,
    #[serde(default, deserialize_with = "nullable")]
    descriptors: Vec<Object<JsonDescriptor>>,
    #[serde(
        default,
        rename = "hitsAddend",
        alias = "hits_addend",
        deserialize_with = "uint32"
    )]
    hits_addend: u32,
}

/// `RateLimitDescriptor` as `protojson` reads it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default, deserialize_with = "nullable")]
    entries: Vec<Object<JsonEntry>>,
    #[serde(default)]
    limit: Option<Object<JsonOverride>>,
    /// A `google.protobuf.UInt64Value`: its JSON is the bare number; `null` leaves it unset.
    #[serde(
        default,
        rename = "hitsAddend",
        alias = "hits_addend",
        deserialize_with = "wrapped_uint64"
    )]
    hits_addend: Option<u64>,
    #[serde(
        default,
        rename = "isNegativeHits",
        alias = "is_negative_hits",
        deserialize_with = "nullable"
    )]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    #[serde(default, deserialize_with = "nullable")]
    key: String,
    #[serde(default, deserialize_with = "nullable")]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOverride {
    #[serde(
        default,
        rename = "requestsPerUnit",
        alias = "requests_per_unit",
        deserialize_with = "uint32"
    )]
    requests_per_unit: u32,
    #[serde(default, deserialize_with = "unit")]
    unit: i32,
}

impl From<JsonRequest> for RateLimitRequest {
    fn from(request: JsonRequest) -> Self {
        RateLimitRequest {
            domain: request.domain,
            descriptors: request
                .descriptors
                .into_iter()
                .map(|Object(descriptor)| RateLimitDescriptor {
                    entries: descriptor
                        .entries
                        .into_iter()
                        .map(|Object(entry)| Entry {
                            key: entry.key,
                            value: entry.value,
                        })
                        .collect(),
                    limit: descriptor.limit.map(|Object(limit)| RateLimitOverride {
                        requests_per_unit: limit.requests_per_unit,
                        unit: limit.unit,
                    }),
                    hits_addend: descriptor.hits_addend.map(|value| UInt64Value { value }),
                    is_negative_hits: descriptor.is_negative_hits,
                })
                .collect(),
            hits_addend: request.hits_addend,
        }
    }
}

/// A field whose `null` means its default, as in proto3 JSON.
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// An unsigned integer in proto3 JSON: a number (integral) or a decimal string; `None` for
/// `null`.
struct UnsignedVisitor {
    max: u64,
    expecting: &'static str,
}

impl<'de> Visitor<'de> for UnsignedVisitor {
    type Value = Option<u64>;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.expecting)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        if value > self.max {
            return Err(E::invalid_value(de::Unexpected::Unsigned(value), &self));
        }
        Ok(Some(value))
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        match u64::try_from(value) {
            Ok(value) => self.visit_u64(value),
            Err(_) => Err(E::invalid_value(de::Unexpected::Signed(value), &self)),
        }
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
        // `protojson` takes `5.0` and `1e2` for integers, not `5.5`.
        if value.fract() == 0.0 && (0.0..=self.max as f64).contains(&value) {
            Ok(Some(value as u64))
        } else {
            Err(E::invalid_value(de::Unexpected::Float(value), &self))
        }
    }

    /// A string holds a JSON number, as `protojson` reads it: `"1e2"` and `"5.0"` are 100 and
    /// 5; `"+5"`, `"007"` and `" 5"` are not numbers.
    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
        let refused = || E::invalid_value(de::Unexpected::Str(text), &self);
        if text.trim() != text {
            return Err(refused());
        }
        let number: serde_json::Number = serde_json::from_str(text).map_err(|_| refused())?;
        if let Some(value) = number.as_u64() {
            self.visit_u64(value)
        } else if let Some(value) = number.as_i64() {
            self.visit_i64(value)
        } else {
            let value = number.as_f64().ok_or_else(refused)?;
            self.visit_f64(value)
        }
    }
}

fn uint32<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let value = deserializer.deserialize_any(UnsignedVisitor {
        max: u64::from(u32::MAX),
        expecting: "an integer from 0 to 4294967295",
    })?;
    Ok(value.map_or(0, |value| value as u32))
}

fn wrapped_uint64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    deserializer.deserialize_any(UnsignedVisitor {
        max: u64::MAX,
        expecting: "an unsigned integer",
    })
}

/// A `RateLimitUnit`: its name (`"SECOND"`) or its number, as `protojson` takes enums.
struct UnitVisitor;

impl<'de> Visitor<'de> for UnitVisitor {
    type Value = i32;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a unit: SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR")
    }

    fn visit_unit<E: de::Error>(self) -> Result<i32, E> {
        Ok(0)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<i32, E> {
        i32::try_from(value).map_err(|_| E::invalid_value(de::Unexpected::Signed(value), &self))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<i32, E> {
        i32::try_from(value).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(value), &self))
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<i32, E> {
        RateLimitUnit::from_str_name(name)
            .map(|unit| unit as i32)
            .ok_or_else(|| E::invalid_value(de::Unexpected::Str(name), &self))
    }
}

fn unit<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i32, D::Error> {
    deserializer.deserialize_any(UnitVisitor)
}

/// The JSON form of a `RateLimitResponse`, as `protojson.Marshal` writes it.
pub(crate) fn response_json(response: &RateLimitResponse) -> serde_json::Value {
    let json = JsonResponse {
        overall_code: code_name(response.overall_code),
        statuses: response.statuses.iter().map(JsonStatus::from).collect(),
        response_headers_to_add: response
            .response_headers_to_add
            .iter()
            .map(JsonHeader::from)
            .collect(),
    };
    serde_json::to_value(json).unwrap_or(serde_json::Value::Null)
}

/// `RateLimitResponse` as `protojson` writes it (the fields floodgate fills).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonResponse<'r> {
    #[serde(skip_serializing_if = "Option::is_none")]
    overall_code: Option<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    statuses: Vec<JsonStatus<'r>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    response_headers_to_add: Vec<JsonHeader<'r>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonStatus<'r> {
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_limit: Option<JsonLimit<'r>>,
    #[serde(skip_serializing_if = "is_zero")]
    limit_remaining: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_until_reset: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonLimit<'r> {
    #[serde(skip_serializing_if = "str::is_empty")]
    name: &'r str,
    #[serde(skip_serializing_if = "is_zero")]
    requests_per_unit: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    unit: Option<&'static str>,
}

#[derive(Serialize)]
struct JsonHeader<'r> {
    key: &'r str,
    #[serde(skip_serializing_if = "str::is_empty")]
    value: &'r str,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

/// An enum's name, left out when it is the default (`UNKNOWN`, 0).
fn code_name(code: i32) -> Option<&'static str> {
    match Code::try_from(code) {
        Ok(Code::Unknown) => None,
        Ok(code) => Some(code.as_str_name()),
        // floodgate never answers a code outside the enum.
        Err(_) => None,
    }
}

impl<'r> From<&'r DescriptorStatus> for JsonStatus<'r> {
    fn from(status: &'r DescriptorStatus) -> Self {
        JsonStatus {
            code: code_name(status.code),
            current_limit: status.current_limit.as_ref().map(JsonLimit::from),
            limit_remaining: status.limit_remaining,
            duration_until_reset: status.duration_until_reset.as_ref().map(duration_text),
        }
    }
}

impl<'r> From<&'r ProtoLimit> for JsonLimit<'r> {
    fn from(limit: &'r ProtoLimit) -> Self {
        JsonLimit {
            name: &limit.name,
            requests_per_unit: limit.requests_per_unit,
            unit: match Unit::try_from(limit.unit) {
                Ok(Unit::Unknown) | Err(_) => None,
                Ok(unit) => Some(unit.as_str_name()),
            },
        }
    }
}

impl<'r> From<&'r ProtoHeader> for JsonHeader<'r> {
    fn from(header: &'r ProtoHeader) -> Self {
        JsonHeader {
            key: &header.key,
            value: &header.value,
        }
    }
}

/// A `google.protobuf.Duration` as proto3 JSON writes it: seconds with 0, 3, 6 or 9
/// fractional digits and an `s` (`"3600s"`, `"1.500s"`).
fn duration_text(duration: &ProtoDuration) -> String {
    let (seconds, nanos) = (duration.seconds, duration.nanos.unsigned_abs());
    let sign = if seconds < 0 || duration.nanos < 0 {
        "-"
    } else {
        ""
    };
    let seconds = seconds.unsigned_abs();
    if nanos == 0 {
        format!("{sign}{seconds}s")
    } else if nanos % 1_000_000 == 0 {
        format!("{sign}{seconds}.{:03}s", nanos / 1_000_000)
    } else if nanos % 1_000 == 0 {
        format!("{sign}{seconds}.{:06}s", nanos / 1_000)
    } else {
        format!("{sign}{seconds}.{nanos:09}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn error(body: &str) -> String {
        parse_request(body.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn requests_read_as_protojson_reads_them() {
        let request = parse_request(
            br#"{"domain":"api","descriptors":[
                {"entries":[{"key":"tenant","value":"t1"},{"key":"path"}],"hitsAddend":"7",
                 "limit":{"requestsPerUnit":"10","unit":"MINUTE"},"is_negative_hits":false},
                {"entries":null,"hits_addend":null,"limit":{"requests_per_unit":3,"unit":4}}],
               "hits_addend":2.0}"#,
        )
        .unwrap();
        assert_eq!(request.domain, "api");
        assert_eq!(request.hits_addend, 2);
        let first = &request.descriptors[0];
        assert_eq!(
            first
                .entries
                .iter()
                .map(|entry| (entry.key.as_str(), entry.value.as_str()))
                .collect::<Vec<_>>(),
            [("tenant", "t1"), ("path", "")]
        );
        assert_eq!(first.hits_addend, Some(UInt64Value { value: 7 }));
        assert_eq!(
            first.limit,
            Some(RateLimitOverride {
                requests_per_unit: 10,
                unit: RateLimitUnit::Minute as i32
            })
        );
        let second = &request.descriptors[1];
        assert!(second.entries.is_empty());
        assert_eq!(second.hits_addend, None);
        assert_eq!(second.limit.unwrap().unit, RateLimitUnit::Day as i32);
        // A descriptor's 0 is set, not left out (the service decides what it counts).
        let checked = parse_request(br#"{"descriptors":[{"hitsAddend":0}]}"#).unwrap();
        assert_eq!(
            checked.descriptors[0].hits_addend,
            Some(UInt64Value { value: 0 })
        );
        // Everything may be left out.
        assert_eq!(parse_request(b"{}").unwrap(), RateLimitRequest::default());
    }

    #[test]
    fn bad_bodies_are_refused_with_the_field_and_the_problem() {
        assert!(error("domain=api").starts_with("invalid JSON body: expected value"));
        assert!(error("").starts_with("invalid JSON body: EOF"));
        assert!(error("[]").starts_with("invalid JSON body: invalid type: sequence"));
        assert!(error("null").starts_with("invalid JSON body: invalid type: null"));
        let array = error(r#"{"descriptors":[[]]}"#);
        assert!(
            array.starts_with("invalid JSON body: at descriptors[0]: invalid type: sequence"),
            "{array}"
        );
        assert!(error(r#"{"descriptors":[null]}"#).contains("descriptors[0]"));
        assert!(error(r#"{"domain":"api"} {}"#).contains("trailing characters"));
        let wrong_type = error(r#"{"domain":"api","descriptors":[{"entries":[{"key":5}]}]}"#);
        assert!(
            wrong_type.starts_with(
                "invalid JSON body: at descriptors[0].entries[0].key: invalid type: integer `5`"
            ),
            "{wrong_type}"
        );
        let unknown = error(r#"{"domain":"api","descriptor":[]}"#);
        assert!(unknown.contains("unknown field `descriptor`"), "{unknown}");
        assert!(error(r#"{"hitsAddend":-1}"#).contains("hitsAddend"));
        assert!(error(r#"{"hitsAddend":4294967296}"#).contains("hitsAddend"));
        assert!(error(r#"{"hitsAddend":1.5}"#).contains("hitsAddend"));
        // A string holds a JSON number, as protojson reads it: no sign, no leading zero, no
        // space.
        for text in [
            r#""+5""#,
            r#""007""#,
            r#"" 5""#,
            r#""5 ""#,
            r#""""#,
            r#""0x10""#,
        ] {
            let refused = error(&format!(r#"{{"hitsAddend":{text}}}"#));
            assert!(refused.contains("hitsAddend"), "{text}: {refused}");
        }
        for (text, hits) in [
            (r#""1e2""#, 100),
            (r#""5.0""#, 5),
            (r#""0""#, 0),
            (r#""7""#, 7),
        ] {
            let request = parse_request(format!(r#"{{"hitsAddend":{text}}}"#).as_bytes()).unwrap();
            assert_eq!(request.hits_addend, hits, "{text}");
        }
        assert!(error(r#"{"hitsAddend":1,"hits_addend":1}"#).contains("duplicate field"));
        let unit = error(r#"{"descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#);
        assert!(
            unit.contains("descriptors[0].limit.unit") && unit.contains("FORTNIGHT"),
            "{unit}"
        );
    }

    #[test]
    fn error_messages_stay_short_whatever_the_body_holds() {
        let long_value = "x".repeat(100_000);
        let message = error(&format!(
            r#"{{"descriptors":[{{"limit":{{"unit":"{long_value}"}}}}]}}"#
        ));
        assert!(
            message.chars().count() <= MAX_MESSAGE_CHARS + 1,
            "{message}"
        );
        assert!(message.ends_with('…'));
    }

    #[test]
    fn responses_are_written_as_protojson_writes_them() {
        let response = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![
                DescriptorStatus {
                    code: Code::Ok as i32,
                    ..DescriptorStatus::default()
                },
                DescriptorStatus {
                    code: Code::OverLimit as i32,
                    current_limit: Some(ProtoLimit {
                        name: String::new(),
                        requests_per_unit: 2,
                        unit: Unit::Day as i32,
                    }),
                    limit_remaining: 0,
                    duration_until_reset: Some(ProtoDuration {
                        seconds: 3600,
                        nanos: 0,
                    }),
                    ..DescriptorStatus::default()
                },
                DescriptorStatus {
                    code: Code::Ok as i32,
                    current_limit: Some(ProtoLimit {
                        name: "per-tenant".to_owned(),
                        requests_per_unit: 10,
                        unit: Unit::Week as i32,
                    }),
                    limit_remaining: 9,
                    duration_until_reset: Some(ProtoDuration {
                        seconds: 1,
                        nanos: 500_000_000,
                    }),
                    ..DescriptorStatus::default()
                },
            ],
            response_headers_to_add: vec![ProtoHeader {
                key: "retry-after".to_owned(),
                value: "3600".to_owned(),
                ..ProtoHeader::default()
            }],
            ..RateLimitResponse::default()
        };
        assert_eq!(
            response_json(&response),
            json!({
                "overallCode": "OVER_LIMIT",
                "statuses": [
                    {"code": "OK"},
                    {"code": "OVER_LIMIT", "currentLimit": {"requestsPerUnit": 2, "unit": "DAY"},
                     "durationUntilReset": "3600s"},
                    {"code": "OK",
                     "currentLimit": {"name": "per-tenant", "requestsPerUnit": 10, "unit": "WEEK"},
                     "limitRemaining": 9, "durationUntilReset": "1.500s"}
                ],
                "responseHeadersToAdd": [{"key": "retry-after", "value": "3600"}]
            })
        );
        assert_eq!(
            response_json(&RateLimitResponse {
                overall_code: Code::Ok as i32,
                ..RateLimitResponse::default()
            }),
            json!({"overallCode": "OK"})
        );
    }

    #[test]
    fn durations_carry_as_many_digits_as_protojson_writes() {
        let text = |seconds, nanos| duration_text(&ProtoDuration { seconds, nanos });
        assert_eq!(text(0, 0), "0s");
        assert_eq!(text(86_399, 1_000_000), "86399.001s");
        assert_eq!(text(2, 1_000), "2.000001s");
        assert_eq!(text(2, 1), "2.000000001s");
    }
}
