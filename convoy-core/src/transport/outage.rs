//! Waiting out a broker outage while a member joins: a member started while a node restarts
//! or a cluster elects a leader joins once it is over, as a running member reconnects, instead
//! of failing its `subscribe`.

use std::future::Future;
use std::time::Duration;

use super::TransportError;

/// How long joining waits out an outage before `subscribe` fails with it.
pub const JOIN_WITHIN: Duration = Duration::from_secs(30);

/// Runs `attempt` again while it fails with [`TransportError::Unavailable`], with backoff (100 ms
/// doubling to 2 s), for up to `within`; logs each retry with `what`. Any other error — a
/// refused login, a bad certificate, a mismatching topology — returns at once, and so does an
/// outage that outlasts `within`.
pub async fn wait_out_outage<T, F, Fut>(
    within: Duration,
    what: &str,
    mut attempt: F,
) -> Result<T, TransportError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, TransportError>>,
{
    let deadline = tokio::time::Instant::now() + within;
    let mut backoff = Duration::from_millis(100);
    loop {
        match attempt().await {
            Err(TransportError::Unavailable(e)) if tokio::time::Instant::now() + backoff < deadline => {
                tracing::warn!(error = %e, retry_in = ?backoff, "{what}: the broker is unavailable; trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            done => return done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_waited_out_within_its_bound_and_other_errors_are_not() {
        let mut calls = 0;
        let joined = wait_out_outage(JOIN_WITHIN, "joining", || {
            calls += 1;
            let down = calls < 4;
            async move {
                match down {
                    true => Err(TransportError::Unavailable("connection reset".into())),
                    false => Ok(calls),
                }
            }
        })
        .await;
        assert_eq!(joined.ok(), Some(4));

        let mut calls = 0;
        let refused = wait_out_outage(JOIN_WITHIN, "joining", || {
            calls += 1;
            async { Err::<(), _>(TransportError::Fatal("bad password".into())) }
        })
        .await;
        assert!(refused.is_err_and(|e| e.is_fatal()));
        assert_eq!(calls, 1, "a refusal is not tried again");

        let started = tokio::time::Instant::now();
        let gone = wait_out_outage(JOIN_WITHIN, "joining", || async {
            Err::<(), _>(TransportError::Unavailable("down".into()))
        })
        .await;
        assert!(matches!(gone, Err(TransportError::Unavailable(_))));
        assert!(started.elapsed() <= JOIN_WITHIN);
        assert!(started.elapsed() >= JOIN_WITHIN - Duration::from_secs(2));
    }
}
