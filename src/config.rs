//! [`Config`]: what a layer shares with every service it makes, and how its operations record.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::attributes::{Executor, Operation, SeriesKey};
use crate::limit::{Acquire, Capacity, LimitId};
use crate::metrics::{MetricsSource, Series};

/// What a layer shares with every service it makes.
pub(crate) struct Config<C, L, P> {
    pub(crate) limit: L,
    /// Whether the limit hears each operation's end ([`Acquire::hears_ends`]), asked once.
    pub(crate) hears: bool,
    pub(crate) classifier: C,
    pub(crate) protocol: P,
    /// Whether the protocol answers rejections: every protocol but the generic layer's `()`.
    pub(crate) answers: bool,
    pub(crate) operation: Operation,
    pub(crate) executor: Executor,
    pub(crate) metrics: MetricsSource,
    /// The capacity given with [`capacity`](crate::ResourcesOperationLayer::capacity).
    pub(crate) capacity: Option<Capacity>,
    /// How long an operation of the layer may wait
    /// ([`queue_timeout`](crate::ResourcesOperationLayer::queue_timeout)).
    pub(crate) queue_timeout: Option<Duration>,
    /// Whether a per-request layer chooses its operations (then a request that matched no
    /// route is its chooser's to place, not a mistake).
    pub(crate) per_request: bool,
    /// How its operations record, once decided.
    recording: OnceLock<Recording>,
}

/// How a layer's operations record, decided once: see [`Config::recording`].
#[derive(Debug)]
pub(crate) struct Recording {
    /// `None` when metrics are disabled.
    pub(crate) series: Option<Series>,
    /// Whether an operation records anything: with a series, or for a limit that hears ends.
    pub(crate) records: bool,
    /// Which limit it is, if the limit says ([`Acquire::id`]).
    pub(crate) limit_id: Option<LimitId>,
    /// The limit's name and readings, for the operations' spans.
    pub(crate) capacity: Option<Capacity>,
    /// The operations' series, as their limit hears it.
    pub(crate) key: SeriesKey,
}

impl<C, L: Acquire, P> Config<C, L, P> {
    /// A configuration of `limit`, tagged `other`/`other`, reporting to the global provider.
    pub(crate) fn new(limit: L, classifier: C, protocol: P, answers: bool) -> Self {
        Self {
            hears: limit.hears_ends(),
            limit,
            classifier,
            protocol,
            answers,
            operation: Operation::Other,
            executor: Executor::Other,
            metrics: MetricsSource::Global,
            capacity: None,
            queue_timeout: None,
            per_request: false,
            recording: OnceLock::new(),
        }
    }

    /// The series this layer's operations record through; `None` when metrics are disabled.
    /// The global metrics are decided here, at the first call.
    #[inline]
    pub(crate) fn series(&self) -> Option<&Series> {
        self.recording().series.as_ref()
    }

    /// How this layer's operations record: through which series, and whether an operation
    /// records at all (it does with metrics, or for a limit that hears ends). Decided at the
    /// first call, the global metrics with it.
    #[inline]
    pub(crate) fn recording(&self) -> &Recording {
        self.recording.get_or_init(|| {
            let capacity = self.capacity.clone().or_else(|| self.limit.capacity());
            let series = self
                .metrics
                .resolve()
                .series(self.operation, self.executor, capacity.as_ref())
                .cloned();
            Recording {
                records: series.is_some() || self.hears,
                series,
                limit_id: self.limit.id(),
                capacity,
                key: SeriesKey::new(self.operation, self.executor),
            }
        })
    }

    /// Whether a service of this layer could be left with a rejection it cannot answer.
    #[track_caller]
    pub(crate) fn check(&self) {
        if !self.answers {
            self.refuse_unanswerable();
        }
    }

    /// Refuses a limit that may turn operations away (a queue bound or a queue timeout), for a
    /// layer that cannot answer a rejection.
    #[track_caller]
    pub(crate) fn refuse_unanswerable(&self) {
        if self.limit.may_reject() || self.queue_timeout.is_some() {
            panic!(
                "tower-resources-operation: this limit ({}, {:?}) may turn operations away (a \
                 queue bound or a queue timeout), but this layer cannot answer a rejection: give \
                 it a protocol that answers, such as .protocol(RejectAsError) for a BoxError \
                 service, or use new_for_http / new_for_grpc",
                std::any::type_name::<L>(),
                self.described_limit()
            );
        }
    }

    /// The limit, as a warning names it: `"workers"` (2 at once), or its type.
    pub(crate) fn named_limit(&self) -> String {
        let DescribedLimit { name, capacity } = self.described_limit();
        let name = match name {
            Some(name) => format!("{name:?}"),
            None => std::any::type_name::<L>().to_owned(),
        };
        match capacity {
            Some(capacity) => format!(": the limit {name} ({capacity} at once)"),
            None => format!(": the limit {name}"),
        }
    }

    /// The limit, as `Debug` shows it: its name and capacity, as the metrics see them.
    pub(crate) fn described_limit(&self) -> DescribedLimit {
        let capacity = self.capacity.clone().or_else(|| self.limit.capacity());
        DescribedLimit {
            name: capacity.as_ref().and_then(Capacity::shared_name).cloned(),
            capacity: capacity.as_ref().and_then(Capacity::get),
        }
    }
}

impl<C, L, P> Config<C, L, P> {
    /// The same configuration with another classifier, limit or protocol; its recording is
    /// decided anew.
    pub(crate) fn map<D, M, Q>(
        self,
        classifier: impl FnOnce(C) -> D,
        limit: impl FnOnce(L) -> M,
        protocol: impl FnOnce(P) -> Q,
    ) -> Config<D, M, Q> {
        Config {
            limit: limit(self.limit),
            hears: self.hears,
            classifier: classifier(self.classifier),
            protocol: protocol(self.protocol),
            answers: self.answers,
            operation: self.operation,
            executor: self.executor,
            metrics: self.metrics,
            capacity: self.capacity,
            queue_timeout: self.queue_timeout,
            per_request: self.per_request,
            recording: OnceLock::new(),
        }
    }

    /// Forgets how its operations record, to decide it anew after a change.
    pub(crate) fn changed(&mut self) {
        self.recording = OnceLock::new();
    }
}

impl<C: Clone, L: Clone, P: Clone> Clone for Config<C, L, P> {
    /// The same configuration, whose recording is decided anew.
    fn clone(&self) -> Self {
        Self {
            limit: self.limit.clone(),
            hears: self.hears,
            classifier: self.classifier.clone(),
            protocol: self.protocol.clone(),
            answers: self.answers,
            operation: self.operation,
            executor: self.executor,
            metrics: self.metrics.clone(),
            capacity: self.capacity.clone(),
            queue_timeout: self.queue_timeout,
            per_request: self.per_request,
            recording: OnceLock::new(),
        }
    }
}

/// A layer's limit in its `Debug` output.
pub(crate) struct DescribedLimit {
    name: Option<Arc<str>>,
    capacity: Option<usize>,
}

impl fmt::Debug for DescribedLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limit")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .finish()
    }
}
