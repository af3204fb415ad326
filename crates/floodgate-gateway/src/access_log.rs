//! The access log (`access_log`, SPEC §5): one line per request, written off the request path.
//!
//! A request's line is formatted where the request is answered and handed to a writer thread
//! through a bounded queue: the request never waits for the disk. When the queue is full (a
//! slow disk, a pipe nobody reads) the line is dropped and counted in
//! `floodgate_access_log_dropped_total`, so that a stalled log costs lines, never latency. A
//! file is reopened on `SIGUSR1` (after logrotate moved it); the writer flushes whenever the
//! queue runs empty.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use floodgate::Decision;
use floodgate::decision::DecisionSource;
use http::{HeaderMap, Method, StatusCode};
use serde_json::{Value, json};

use crate::config::{AccessLogFormat, AccessLogSettings, AccessLogTarget};

/// What the gateway knew of a request before the layer: who, which plan, and whether it was
/// answered without a decision. Carried to the access log in the response's extensions.
#[derive(Clone, Debug, Default)]
pub struct RequestFacts {
    /// `<hash>` of the identity (never the raw key), and its scope.
    pub identity: Option<(String, String)>,
    /// The plan.
    pub plan: Option<Arc<str>>,
    /// Decided before any limit: `denylisted`, `unknown_key`, `rejected`, `bypassed`.
    pub early: Option<&'static str>,
    /// The normalised path (absent for a request refused before normalisation).
    pub path: Option<String>,
}

/// The upstream's part of a request, carried in the response's extensions.
#[derive(Clone, Copy, Debug)]
pub struct UpstreamFacts {
    /// The status the upstream answered (not what the client got: a 502 has none).
    pub status: Option<StatusCode>,
    /// Time to the upstream's response head.
    pub elapsed: Duration,
}

/// What the request itself says, read before it is handed on.
#[derive(Debug)]
pub struct RequestLine {
    method: Method,
    path: String,
    trace_id: Option<String>,
}

impl RequestLine {
    /// The method, the normalised path (no query: it may hold secrets) and the trace id of
    /// `traceparent`.
    pub fn of(method: &Method, path: &str, headers: &HeaderMap) -> Self {
        RequestLine {
            method: method.clone(),
            path: path.to_owned(),
            trace_id: headers
                .get("traceparent")
                .and_then(|value| value.to_str().ok())
                .and_then(trace_id),
        }
    }
}

/// The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), if it is one.
fn trace_id(traceparent: &str) -> Option<String> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |text: &str, len: usize| {
        text.len() == len
            && text
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && hex(flags, 2)
        && (version != "00" || parts.next().is_none());
    valid.then(|| trace.to_owned())
}

/// One message to the writer.
enum Message {
    Line(String),
}

/// The access log of a running gateway. Dropping it lets its writer finish the queue and stop.
pub struct AccessLog {
    settings: AccessLogSettings,
    queue: SyncSender<Message>,
    reopen: Arc<AtomicBool>,
}

impl std::fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl AccessLog {
    /// Opens the log `settings` describe and starts its writer.
    pub fn open(settings: &AccessLogSettings) -> Result<AccessLog, std::io::Error> {
        let output = Output::open(&settings.target)?;
        let (queue, lines) = sync_channel(settings.buffer);
        let reopen = Arc::new(AtomicBool::new(false));
        let flag = reopen.clone();
        std::thread::Builder::new()
            .name("floodgate-access-log".to_owned())
            .spawn(move || write_lines(output, lines, &flag))?;
        Ok(AccessLog {
            settings: settings.clone(),
            queue,
            reopen,
        })
    }

    /// The settings it was opened with.
    pub fn settings(&self) -> &AccessLogSettings {
        &self.settings
    }

    /// Reopens the file before the next line (`SIGUSR1`, after logrotate moved it).
    pub fn reopen(&self) {
        self.reopen.store(true, Ordering::Release);
    }

    /// Logs one answered request, if the sampling and `only` let it through.
    pub fn record(
        &self,
        request: &RequestLine,
        response: &http::response::Parts,
        duration: Duration,
    ) {
        let facts = response.extensions.get::<RequestFacts>();
        let decision = response.extensions.get::<Decision>();
        let upstream = response.extensions.get::<UpstreamFacts>();
        let label = decision_label(facts, decision, upstream, response.status);
        if self.settings.only_limited && !is_limited(label) {
            return;
        }
        if self.settings.sample < 1.0 && fastrand::f64() >= self.settings.sample {
            return;
        }
        let binding = decision.and_then(Decision::binding_limit);
        let fields = json!({
            "time": rfc3339(SystemTime::now()),
            "method": request.method.as_str(),
            "path": facts.and_then(|facts| facts.path.as_deref()).unwrap_or(&request.path),
            "status": response.status.as_u16(),
            "duration_ms": millis(duration),
            "upstream_status": upstream.and_then(|upstream| upstream.status).map(|status| status.as_u16()),
            "upstream_ms": upstream.map(|upstream| millis(upstream.elapsed)),
            "identity": facts.and_then(|facts| facts.identity.as_ref()).map(|(hash, _)| hash),
            "scope": facts.and_then(|facts| facts.identity.as_ref()).map(|(_, scope)| scope),
            "plan": facts.and_then(|facts| facts.plan.as_deref()),
            "decision": label,
            "limit": binding.map(|binding| &*binding.name),
            "remaining": binding.map(|binding| binding.remaining),
            "retry_after": decision
                .and_then(Decision::retry_after)
                .filter(|_| label != "allowed")
                .map(|wait| wait.as_secs_f64().ceil() as u64),
            "trace_id": request.trace_id,
        });
        let line = match self.settings.format {
            AccessLogFormat::Json => fields.to_string(),
            AccessLogFormat::Text => text_line(&fields),
        };
        match self.queue.try_send(Message::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                metrics::counter!(crate::telemetry::ACCESS_LOG_DROPPED_TOTAL).increment(1);
            }
        }
    }
}

/// What the request's answer was, as the log names it.
fn decision_label(
    facts: Option<&RequestFacts>,
    decision: Option<&Decision>,
    upstream: Option<&UpstreamFacts>,
    status: StatusCode,
) -> &'static str {
    if let Some(early) = facts.and_then(|facts| facts.early) {
        return early;
    }
    match decision {
        Some(decision) => match (decision.source(), decision.is_allowed()) {
            (DecisionSource::Store, true) => "allowed",
            // A denial the client did not get: shadow mode or a canary outside its share.
            (DecisionSource::Store, false) if status != StatusCode::TOO_MANY_REQUESTS => {
                "shadow_limited"
            }
            (DecisionSource::Store, false) => "limited",
            (_, true) => "fallback_allowed",
            (_, false) => "fallback_limited",
        },
        // The store failed under `on_store_error: closed`: answered 503, nothing upstream.
        None if upstream.is_none() && status == StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        None => "unlimited",
    }
}

/// Whether `label` is a request the limiter refused (`only: limited`).
fn is_limited(label: &str) -> bool {
    matches!(
        label,
        "limited" | "fallback_limited" | "denylisted" | "unknown_key" | "unavailable"
    )
}

fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1_000_000.0).round() / 1000.0
}

/// `key=value` pairs in the JSON line's order; strings with spaces or quotes are quoted,
/// absent values are `-`.
fn text_line(fields: &Value) -> String {
    let Some(object) = fields.as_object() else {
        return String::new();
    };
    let mut line = String::new();
    for (key, value) in object {
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(key);
        line.push('=');
        match value {
            Value::Null => line.push('-'),
            Value::String(text) if text.is_empty() || text.contains([' ', '"', '=']) => {
                line.push_str(&Value::String(text.clone()).to_string());
            }
            Value::String(text) => line.push_str(text),
            other => line.push_str(&other.to_string()),
        }
    }
    line
}

/// `2026-12-01T15:04:05.123Z`.
fn rfc3339(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

/// Where the writer writes.
enum Output {
    Stdout(std::io::Stdout),
    File {
        path: PathBuf,
        file: BufWriter<File>,
    },
}

impl Output {
    fn open(target: &AccessLogTarget) -> Result<Output, std::io::Error> {
        Ok(match target {
            AccessLogTarget::Stdout => Output::Stdout(std::io::stdout()),
            AccessLogTarget::File(path) => Output::File {
                path: path.clone(),
                file: BufWriter::with_capacity(64 * 1024, open_append(path)?),
            },
        })
    }

    fn write_line(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Output::Stdout(stdout) => {
                let mut stdout = stdout.lock();
                stdout.write_all(line.as_bytes())?;
                stdout.write_all(b"\n")
            }
            Output::File { file, .. } => {
                file.write_all(line.as_bytes())?;
                file.write_all(b"\n")
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Output::Stdout(stdout) => stdout.flush(),
            Output::File { file, .. } => file.flush(),
        }
    }

    /// Opens the file's path again (the old file was moved away); stdout has nothing to do.
    fn reopen(&mut self) {
        let Output::File { path, file } = self else {
            return;
        };
        let _ = file.flush();
        match open_append(path) {
            Ok(reopened) => {
                *file = BufWriter::with_capacity(64 * 1024, reopened);
                tracing::info!(path = %path.display(), "access log reopened");
            }
            Err(error) => {
                tracing::error!(path = %path.display(), %error, "could not reopen the access log; still writing to the file it had open")
            }
        }
    }
}

fn open_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// The writer thread: writes what comes, flushes whenever the queue is empty, reopens when
/// asked, and stops once every sender is gone and the queue is drained.
fn write_lines(mut output: Output, lines: Receiver<Message>, reopen: &AtomicBool) {
    let mut failed = false;
    while let Ok(first) = lines.recv() {
        if reopen.swap(false, Ordering::AcqRel) {
            output.reopen();
        }
        let mut next = Some(first);
        while let Some(Message::Line(line)) = next {
            if let Err(error) = output.write_line(&line) {
                if !failed {
                    tracing::error!(%error, "cannot write the access log; lines are lost until it can");
                }
                failed = true;
            } else {
                failed = false;
            }
            next = lines.try_recv().ok();
        }
        let _ = output.flush();
    }
    let _ = output.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_ids_are_read_from_valid_traceparents_only() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert_eq!(
            trace_id(&format!("00-{id}-00f067aa0ba902b7-01")).as_deref(),
            Some(id)
        );
        assert_eq!(
            trace_id(&format!("00-{}-00f067aa0ba902b7-01", "0".repeat(32))),
            None
        );
        assert_eq!(trace_id("00-xyz-00f067aa0ba902b7-01"), None);
        assert_eq!(trace_id(&format!("00-{id}-00f067aa0ba902b7")), None);
        assert_eq!(
            trace_id(&format!("00-{}-00f067aa0ba902b7-01", id.to_uppercase())),
            None
        );
    }

    #[test]
    fn times_are_rfc3339_in_utc() {
        let at = UNIX_EPOCH + Duration::from_millis(1_764_601_445_123);
        assert_eq!(rfc3339(at), "2025-12-01T15:04:05.123Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00.000Z"
        );
    }

    #[test]
    fn text_lines_quote_what_needs_it() {
        let line = text_line(&json!({"a": "x y", "b": null, "c": 3, "d": "plain"}));
        assert_eq!(line, "a=\"x y\" b=- c=3 d=plain");
    }
}
