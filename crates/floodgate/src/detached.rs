//! Store calls nobody waits for: a lease released when a response body is dropped, a cost
//! settled from a body's trailers.

use std::future::Future;
use std::task::Context;

/// Runs a store call nobody waits for: at once if it is ready at once (the memory store),
/// else in the background on the current runtime (a networked store).
pub(crate) fn run_detached(work: impl Future<Output = ()> + Send + 'static) {
    let mut work = Box::pin(work);
    let mut context = Context::from_waker(std::task::Waker::noop());
    if work.as_mut().poll(&mut context).is_pending() {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(work);
            }
            Err(_) => tracing::warn!(
                "a store call could not finish: no Tokio runtime to run it on (a lease expires \
                 with its window; a settlement is not made)"
            ),
        }
    }
}
