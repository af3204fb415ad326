//! The access log (`access_log`, SPEC §5): one line per request, written off the request path.
//!
//! A request's fields are taken when its answer's head is ready; its line is formatted once
//! the answer's body is sent (or cut short: [`LoggedBody`] writes it when hyper drops the body)
//! and pushed onto a bounded queue; a writer thread of its own takes the whole queue every [`WRITE_EVERY`] and writes it
//! in one go. The request never waits for the disk, nor wakes the writer: it takes a lock for
//! one push. When the queue is full (a slow disk, a pipe nobody reads) the line is dropped and
//! counted in `floodgate_access_log_dropped_total`, so that a stalled log costs lines, never
//! latency. A file is reopened on `SIGUSR1` (after logrotate moved it).
//!
//! A request whose client goes away before its answer's head (its future is dropped) still
//! gets a line, with status 499 as nginx writes it: [`PendingLine`] writes it when dropped.
//!
//! On shutdown the writer writes what is queued, but the process waits for it only
//! [`CLOSE_TIMEOUT`]: an output that takes nothing (a stalled stdout, a FIFO nobody reads, a
//! hung NFS mount) must not keep `SIGTERM` from ending the process. What was left unwritten
//! is logged.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::mem::take;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use floodgate::adaptive::Shed;
use floodgate::{Identity, Outcome, RequestOutcome};
use http::{HeaderMap, Method, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};

use crate::config::{AccessLogFormat, AccessLogSettings, AccessLogTarget};
use crate::outcome::GatewayOutcome;

/// What the gateway learns of a request on its way to the layer: who, which plan, and whether
/// it was answered without a decision. Filled in while the request is answered.
#[derive(Clone, Debug, Default)]
pub(crate) struct RequestFacts {
    /// Who the request is from: only its hash and scope are written, and only for lines that
    /// are (after sampling and `only`).
    pub identity: Option<Identity>,
    /// The plan.
    pub plan: Option<Arc<str>>,
    /// Decided before the rate limit layer: rejected, an unknown key, the gateway's
    /// denylist or allowlist.
    pub early: Option<GatewayOutcome>,
    /// The path: normalised, or as it came for a request refused before normalisation.
    pub path: Option<String>,
}

/// The upstream's part of a request, carried in the response's extensions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct UpstreamFacts {
    /// The status the upstream answered (not what the client got: a 502 has none).
    pub status: Option<StatusCode>,
    /// Time to the upstream's response head.
    pub elapsed: Duration,
}

/// What the request itself says, read before it is handed on (its path, normalised and
/// without the query, comes with [`RequestFacts`]).
#[derive(Debug, Default)]
pub(crate) struct RequestLine {
    method: Method,
    trace_id: Option<String>,
}

impl RequestLine {
    /// The method and the trace id of `traceparent`.
    pub(crate) fn of(method: &Method, headers: &HeaderMap) -> Self {
        RequestLine {
            method: method.clone(),
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

/// How often the writer takes the queue: lines reach the file this long after their request at
/// most (plus the write), and the writer wakes this often, whatever the traffic.
pub(crate) const WRITE_EVERY: Duration = Duration::from_millis(20);

/// How long [`AccessLog::close`] waits for the writer to write what is queued. A healthy
/// output writes a full queue (`buffer` lines, 8,192 by default) in milliseconds; one that
/// has taken nothing for this long is stalled, and the process exits without it.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(3);

/// What the request path and the writer share.
struct Queue {
    lines: Mutex<Vec<String>>,
    capacity: usize,
    /// Reopen the file before the next write.
    reopen: AtomicBool,
    /// The log was replaced or the gateway stops: write what is queued, then stop.
    closed: AtomicBool,
    /// Lines the writer took from the queue and has not yet handed to the output: with those
    /// still queued, what a writer that never finishes leaves unwritten.
    being_written: AtomicUsize,
}

/// The access log of a running gateway. Dropping it makes its writer write what is queued and
/// stop.
pub(crate) struct AccessLog {
    settings: AccessLogSettings,
    queue: Arc<Queue>,
    writer: std::thread::Thread,
    /// Joined by [`AccessLog::close`], once the receiver (whose sender the writer thread holds)
    /// says it ended.
    finished: Mutex<Option<(std::thread::JoinHandle<()>, Receiver<()>)>>,
}

impl std::fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        self.queue.closed.store(true, Ordering::Release);
        self.writer.unpark();
    }
}

impl AccessLog {
    /// Opens the log `settings` describe and starts its writer.
    pub(crate) fn open(settings: &AccessLogSettings) -> Result<AccessLog, std::io::Error> {
        let output = Output::open(&settings.target)?;
        let queue = Arc::new(Queue {
            lines: Mutex::new(Vec::new()),
            capacity: settings.buffer,
            reopen: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            being_written: AtomicUsize::new(0),
        });
        let shared = queue.clone();
        // Never sent on: the sender is dropped when the thread ends, which the receiver sees
        // (a join has no timeout).
        let (ended, ended_receiver) = std::sync::mpsc::sync_channel::<()>(0);
        let writer = std::thread::Builder::new()
            .name("floodgate-access-log".to_owned())
            .spawn(move || {
                let _ended = ended;
                write_lines(output, &shared);
            })?;
        Ok(AccessLog {
            settings: settings.clone(),
            queue,
            writer: writer.thread().clone(),
            finished: Mutex::new(Some((writer, ended_receiver))),
        })
    }

    /// Writes what is queued and stops the writer, waiting for it up to [`CLOSE_TIMEOUT`] (on
    /// shutdown: the last lines are not lost with the process, unless the output is stalled;
    /// then how many were left unwritten is logged, and the process goes on to exit). Lines
    /// recorded later are dropped and counted.
    pub(crate) fn close(&self) {
        self.queue.closed.store(true, Ordering::Release);
        self.writer.unpark();
        let finished = self
            .finished
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some((writer, ended)) = finished else {
            return;
        };
        match ended.recv_timeout(CLOSE_TIMEOUT) {
            Err(RecvTimeoutError::Timeout) => {
                let queued = self
                    .queue
                    .lines
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .len();
                let unwritten = queued + self.queue.being_written.load(Ordering::Acquire);
                // The writer thread is left blocked on its output; it ends with the process.
                tracing::error!(
                    unwritten,
                    target = ?self.settings.target,
                    timeout = ?CLOSE_TIMEOUT,
                    "access log: the output did not take the queue within the shutdown wait \
                     (stalled or slow?); exiting with these lines unwritten (and whatever the \
                     output's buffer held)"
                );
            }
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let _ = writer.join();
            }
        }
    }

    /// Reopens the file before the next write (`SIGUSR1`, after logrotate moved it).
    pub(crate) fn reopen(&self) {
        self.queue.reopen.store(true, Ordering::Release);
        self.writer.unpark();
    }

    /// The line of a request that ended as `answer`, if the sampling and `only` keep it;
    /// its duration and bytes are added when it is written.
    fn line_of(
        &self,
        request: RequestLine,
        facts: RequestFacts,
        answer: Answer<'_>,
    ) -> Option<Line> {
        let (status, extensions) = match answer {
            Answer::Head(response) => (response.status, Some(&response.extensions)),
            Answer::ClientGone => (CLIENT_CLOSED_REQUEST, None),
        };
        let decided = extensions.and_then(|extensions| extensions.get::<RequestOutcome>());
        let upstream = extensions.and_then(|extensions| extensions.get::<UpstreamFacts>());
        let outcome = match (facts.early, answer) {
            (Some(early), _) => early,
            // Shed by `adaptive_concurrency` after the rate limits let it through: the
            // refusal is the shedding's.
            (None, Answer::Head(_)) if extensions.is_some_and(|e| e.get::<Shed>().is_some()) => {
                GatewayOutcome::Shed
            }
            (None, Answer::Head(_)) => GatewayOutcome::Limiter(
                decided.map_or(Outcome::Unlimited, |decided| decided.outcome),
            ),
            // What the limiter decided rides on the answer the client did not wait for.
            (None, Answer::ClientGone) => GatewayOutcome::ClientClosed,
        };
        if self.settings.only_limited && !outcome.is_refused() {
            return None;
        }
        if self.settings.sample < 1.0 && fastrand::f64() >= self.settings.sample {
            return None;
        }
        let binding = decided.and_then(|decided| decided.binding.as_ref());
        Some(Line {
            method: request.method,
            path: facts.path,
            status,
            upstream_status: upstream.and_then(|upstream| upstream.status),
            upstream_elapsed: upstream.map(|upstream| upstream.elapsed),
            identity: facts.identity,
            plan: facts.plan,
            decision: outcome.as_str(),
            limit: binding.map(|binding| (binding.name.clone(), binding.remaining)),
            retry_after: decided
                .and_then(RequestOutcome::retry_after)
                .map(|wait| wait.as_secs_f64().ceil() as u64),
            trace_id: request.trace_id,
        })
    }

    /// Formats `line` and queues it, or counts it dropped when the queue is full.
    fn write(&self, line: &Line, duration: Duration, bytes: u64) {
        let time = rfc3339(SystemTime::now());
        let identity = line
            .identity
            .as_ref()
            .map(|identity| identity.hash().to_string());
        let fields = [
            ("time", Field::Text(Some(&time))),
            ("method", Field::Text(Some(line.method.as_str()))),
            ("path", Field::Text(line.path.as_deref())),
            (
                "status",
                Field::Count(Some(u64::from(line.status.as_u16()))),
            ),
            ("duration_ms", Field::Millis(Some(duration))),
            ("bytes", Field::Count(Some(bytes))),
            (
                "upstream_status",
                Field::Count(
                    line.upstream_status
                        .map(|status| u64::from(status.as_u16())),
                ),
            ),
            ("upstream_ms", Field::Millis(line.upstream_elapsed)),
            ("identity", Field::Text(identity.as_deref())),
            (
                "scope",
                Field::Text(line.identity.as_ref().map(Identity::scope)),
            ),
            ("plan", Field::Text(line.plan.as_deref())),
            ("decision", Field::Text(Some(line.decision))),
            (
                "limit",
                Field::Text(line.limit.as_ref().map(|(name, _)| &**name)),
            ),
            (
                "remaining",
                Field::Count(line.limit.as_ref().map(|(_, remaining)| *remaining)),
            ),
            ("retry_after", Field::Count(line.retry_after)),
            ("trace_id", Field::Text(line.trace_id.as_deref())),
        ];
        let text = match self.settings.format {
            AccessLogFormat::Json => json_line(&fields),
            AccessLogFormat::Text => text_line(&fields),
        };
        let mut lines = self
            .queue
            .lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if lines.len() < self.queue.capacity && !self.queue.closed.load(Ordering::Relaxed) {
            lines.push(text);
        } else {
            drop(lines);
            metrics::counter!(crate::telemetry::ACCESS_LOG_DROPPED_TOTAL).increment(1);
        }
    }
}

/// A request's line, but for its duration and bytes.
struct Line {
    method: Method,
    path: Option<String>,
    status: StatusCode,
    upstream_status: Option<StatusCode>,
    upstream_elapsed: Option<Duration>,
    identity: Option<Identity>,
    plan: Option<Arc<str>>,
    decision: &'static str,
    /// The binding limit's name, and what it has left.
    limit: Option<(Arc<str>, u64)>,
    retry_after: Option<u64>,
    trace_id: Option<String>,
}

/// The status nginx writes for a client that closed its connection before the answer.
const CLIENT_CLOSED_REQUEST: StatusCode = match StatusCode::from_u16(499) {
    Ok(status) => status,
    Err(_) => panic!("499 is a valid status code"),
};

/// How a request ended, for its line.
#[derive(Clone, Copy)]
enum Answer<'a> {
    /// Its answer's head is ready to be sent.
    Head(&'a http::response::Parts),
    /// Its client went away first.
    ClientGone,
}

/// One request's line until its answer's head is ready: [`PendingLine::answered`] hands it
/// to the answer's body ([`LoggedBody`]), which writes it once sent. If the request's future
/// is dropped first (its client went away), it is written when dropped, as a 499.
pub(crate) struct PendingLine {
    log: Arc<AccessLog>,
    request: RequestLine,
    facts: RequestFacts,
    started: Instant,
    /// Set by `answered`, which takes the request and the facts.
    answered: bool,
}

impl PendingLine {
    /// The line of the request `request` describes, timed from now.
    pub(crate) fn new(log: Arc<AccessLog>, request: RequestLine) -> PendingLine {
        PendingLine {
            log,
            request,
            facts: RequestFacts::default(),
            started: Instant::now(),
            answered: false,
        }
    }

    /// What the gateway learns of the request on its way, for the line.
    pub(crate) fn facts(&mut self) -> &mut RequestFacts {
        &mut self.facts
    }

    /// The answer `response` with a body that writes the request's line once it is sent
    /// (or cut short), when the sampling and `only` keep it.
    pub(crate) fn answered<B>(mut self, response: Response<B>) -> Response<LoggedBody<B>> {
        let (parts, body) = response.into_parts();
        self.answered = true;
        let (request, facts) = (take(&mut self.request), take(&mut self.facts));
        let line = self.log.line_of(request, facts, Answer::Head(&parts));
        let sent = line.map(|line| SentLine {
            log: self.log.clone(),
            line,
            started: self.started,
            bytes: 0,
        });
        Response::from_parts(parts, LoggedBody { inner: body, sent })
    }
}

impl Drop for PendingLine {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let (request, facts) = (take(&mut self.request), take(&mut self.facts));
        if let Some(line) = self.log.line_of(request, facts, Answer::ClientGone) {
            self.log.write(&line, self.started.elapsed(), 0);
        }
    }
}

/// A line whose answer's body is being sent: written when the body is dropped (sent in full,
/// or cut short by the client), with the time until then and the bytes sent.
struct SentLine {
    log: Arc<AccessLog>,
    line: Line,
    started: Instant,
    bytes: u64,
}

impl Drop for SentLine {
    fn drop(&mut self) {
        self.log
            .write(&self.line, self.started.elapsed(), self.bytes);
    }
}

pin_project_lite::pin_project! {
    /// An answer's body, counting what is sent of it for the request's line (none when the
    /// request has no line: no log, or one that sampling or `only` left out).
    pub struct LoggedBody<B> {
        #[pin]
        inner: B,
        sent: Option<SentLine>,
    }
}

impl<B> LoggedBody<B> {
    /// `body` with no line to write.
    pub(crate) fn unlogged(body: B) -> Self {
        LoggedBody {
            inner: body,
            sent: None,
        }
    }
}

impl<B: Body<Data = Bytes>> Body for LoggedBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(context));
        if let (Some(sent), Some(Ok(frame))) = (this.sent.as_mut(), &frame)
            && let Some(data) = frame.data_ref()
        {
            sent.bytes += data.len() as u64;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// One value of a line.
#[derive(Clone, Copy)]
enum Field<'a> {
    Text(Option<&'a str>),
    Count(Option<u64>),
    Millis(Option<Duration>),
}

/// `{"key":value,...}`, strings escaped as JSON, absent values `null`.
fn json_line(fields: &[(&str, Field<'_>)]) -> String {
    let mut line = String::with_capacity(384);
    line.push('{');
    for (index, (key, value)) in fields.iter().enumerate() {
        if index > 0 {
            line.push(',');
        }
        line.push('"');
        line.push_str(key);
        line.push_str("\":");
        match value {
            Field::Text(Some(text)) => push_json_string(&mut line, text),
            Field::Count(Some(count)) => {
                let _ = write!(line, "{count}");
            }
            Field::Millis(Some(duration)) => {
                let _ = write!(line, "{}", millis(*duration));
            }
            Field::Text(None) | Field::Count(None) | Field::Millis(None) => line.push_str("null"),
        }
    }
    line.push('}');
    line
}

/// `key=value` pairs; text with spaces, quotes or `=` is quoted as JSON, absent values `-`.
fn text_line(fields: &[(&str, Field<'_>)]) -> String {
    let mut line = String::with_capacity(320);
    for (index, (key, value)) in fields.iter().enumerate() {
        if index > 0 {
            line.push(' ');
        }
        line.push_str(key);
        line.push('=');
        match value {
            Field::Text(Some(text)) if text.is_empty() || text.contains([' ', '"', '=']) => {
                push_json_string(&mut line, text);
            }
            Field::Text(Some(text)) => line.push_str(text),
            Field::Count(Some(count)) => {
                let _ = write!(line, "{count}");
            }
            Field::Millis(Some(duration)) => {
                let _ = write!(line, "{}", millis(*duration));
            }
            Field::Text(None) | Field::Count(None) | Field::Millis(None) => line.push('-'),
        }
    }
    line
}

/// `text` as a JSON string, escaped (paths and plan names are the client's and the file's).
fn push_json_string(line: &mut String, text: &str) {
    line.push('"');
    for c in text.chars() {
        match c {
            '"' => line.push_str("\\\""),
            '\\' => line.push_str("\\\\"),
            '\n' => line.push_str("\\n"),
            '\r' => line.push_str("\\r"),
            '\t' => line.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(line, "\\u{:04x}", u32::from(c));
            }
            c => line.push(c),
        }
    }
    line.push('"');
}

fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1_000_000.0).round() / 1000.0
}

/// `2026-12-01T15:04:05.123Z`.
pub(crate) fn rfc3339(at: SystemTime) -> String {
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

/// The writer thread: every [`WRITE_EVERY`] (or at once when asked to reopen or stop), takes
/// the whole queue, writes it, and flushes; stops once the log is closed and the queue written.
fn write_lines(mut output: Output, queue: &Queue) {
    let mut taken = Vec::new();
    let mut failed = false;
    loop {
        std::thread::park_timeout(WRITE_EVERY);
        let closed = queue.closed.load(Ordering::Acquire);
        if queue.reopen.swap(false, Ordering::AcqRel) {
            output.reopen();
        }
        {
            let mut queued = queue.lines.lock().unwrap_or_else(PoisonError::into_inner);
            std::mem::swap(&mut taken, &mut *queued);
            // Under the queue's lock, so that `close` never sees a line in neither count.
            queue.being_written.store(taken.len(), Ordering::Release);
        }
        for line in taken.drain(..) {
            let written = output.write_line(&line);
            queue.being_written.fetch_sub(1, Ordering::Release);
            match written {
                Ok(()) => failed = false,
                Err(error) => {
                    if !failed {
                        tracing::error!(%error, "cannot write the access log; lines are lost (and counted) until it can");
                    }
                    failed = true;
                    metrics::counter!(crate::telemetry::ACCESS_LOG_DROPPED_TOTAL).increment(1);
                }
            }
        }
        let _ = output.flush();
        if closed {
            return;
        }
    }
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
    fn lines_escape_and_quote_what_needs_it() {
        let fields = [
            ("a", Field::Text(Some("x \"y\"\n"))),
            ("b", Field::Text(None)),
            ("c", Field::Count(Some(3))),
            ("d", Field::Text(Some("plain"))),
            ("e", Field::Millis(Some(Duration::from_micros(1500)))),
        ];
        assert_eq!(
            text_line(&fields),
            "a=\"x \\\"y\\\"\\n\" b=- c=3 d=plain e=1.5"
        );
        let json: serde_json::Value = serde_json::from_str(&json_line(&fields)).unwrap();
        assert_eq!(json["a"], "x \"y\"\n");
        assert_eq!(json["b"], serde_json::Value::Null);
        assert_eq!(json["c"], 3);
        assert_eq!(json["e"], 1.5);
    }
}
