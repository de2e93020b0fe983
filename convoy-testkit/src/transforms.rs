//! The conformance case for transforms: outputs published through the subscription's outbox (or,
//! for a transport's bare subscription, through the bed's publisher, as a convoy connection
//! does), each with its id derived from its input's, handled downstream once and in key order.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use convoy_core::transform::{Output, PublishingOutbox};
use convoy_core::{
    transform_fn, Delivery, Engine, HandlerError, OutgoingMessage, Publisher, EVENT_ID_HEADER,
};

use crate::checker::OrderChecker;
use crate::conformance::{self, test_config, ConformanceTarget};
use crate::probe::{self, decode_seq};

/// The header that tells an output from an input: the case forwards to the bed's own topic.
const OUTPUT: &str = "conformance-output";

/// A transform copies every input back to the bed's topic, marked; the same engine handles the
/// copies and records them. Every output is handled exactly once, in its key's order, and
/// carries `<input id>/out/0`; each input is handled once.
pub async fn transform_outputs_follow_their_inputs(target: &dyn ConformanceTarget) {
    let bed = conformance::bed(target, 2).await;
    let publisher = bed.publisher();
    let outputs = Arc::new(OrderChecker::new());
    if let Err(e) = probe::publish_load(publisher.as_ref(), &outputs, "t", 4, 25).await {
        panic!("publishing the inputs failed: {e}");
    }
    let ids = Arc::new(Mutex::new(Vec::<String>::new()));
    let (seen, recorded) = (outputs.clone(), ids.clone());
    let transform = transform_fn(move |d: Delivery| {
        let (seen, recorded) = (seen.clone(), recorded.clone());
        async move {
            let key = d.key().cloned().unwrap_or_default();
            let seq =
                decode_seq(d.payload()).ok_or_else(|| HandlerError::malformed("not a probe payload"))?;
            if d.headers().get(OUTPUT).is_none() {
                let copy = OutgoingMessage::new(key, d.payload().clone()).header(OUTPUT, "1");
                return Ok(vec![Output::new("the bed's topic", copy)]);
            }
            seen.handled(&key, seq, None);
            let id = d
                .headers()
                .get_str(EVENT_ID_HEADER)
                .unwrap_or_default()
                .to_owned();
            recorded.lock().unwrap_or_else(|p| p.into_inner()).push(id);
            Ok(Vec::new())
        }
    });
    let mut subscription = conformance::subscribe(bed.as_ref()).await;
    if subscription.outbox.is_none() {
        let publisher = publisher.clone();
        subscription.outbox = Some(Arc::new(PublishingOutbox::new(move |_| {
            Ok(publisher.clone() as Arc<dyn Publisher>)
        })));
    }
    let engine = match Engine::transform_builder(transform)
        .config(test_config(bed.group()))
        .dead_letter_sink(bed.dead_letter_sink())
        .build()
    {
        Ok(engine) => engine,
        Err(e) => panic!("test engine config rejected: {e}"),
    };
    let running = engine.spawn(subscription);
    conformance::wait_complete(&outputs, "every output handled").await;
    let report = conformance::stop(running).await;
    conformance::assert_clean(&outputs.report(), "outputs");
    assert_eq!(outputs.report().duplicates, 0, "an output was handled twice");
    assert_eq!(report.stats.handled, 200, "100 inputs and 100 outputs, each once");
    let ids = ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        ids.iter().all(|id| id.ends_with("/out/0")),
        "an output's id derives from its input's: {ids:?}"
    );
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        100,
        "outputs' ids are distinct"
    );
}
