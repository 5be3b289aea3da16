#![cfg(feature = "tonic")]
//! The body-end form of the layer (`until_body_end`) on real tonic servers and clients over
//! 127.0.0.1: a server stream's operation lasts until its last message and trailers, and its
//! outcome comes from the `grpc-status` of those trailers (where the head-end form, tower's
//! semantics, sees `ok`); a unary call's outcome is read at its head when tonic answers
//! trailers-only, at its trailers otherwise. Also: gRPC deadlines (the client's `grpc-timeout`
//! firing mid-stream, tonic's `Server::timeout`) end operations as `timeout`; a client that hangs
//! up mid-stream ends them as `cancelled`; a limit of 1 holds a second stream until the first
//! ends; the per-request form over a whole `Server` limits and records only the methods it is
//! told to; a gRPC layer answers RESOURCE_EXHAUSTED to a call that finds the limit full.
//!
//! The service is the tests' `Backend` (in `support::grpc`), whose `Watch` streams are fed by
//! the test, message by message, through a channel: the test decides when each message goes, how
//! the stream ends, and sees when the server drops it. Every test ends with the live counts back
//! to 0 and the permits back.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use tokio::time::Instant;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckResponse;
use tower::ServiceExt as _;

use support::grpc::{
    asking, check, check_past_a_client_deadline, connect, drain, grpc_layer, message, serve,
    serve_timing_out, serve_with, serving, watch, Backend, GrpcLayer, Served, WatchCall,
};
use support::{assert_idle, eventually, within, Telemetry, DEADLINE};
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};
use tower_resources_operation::per_request::{ByRoute, Choice};
use tower_resources_operation::{AtBodyEnd, Executor, Limit, Operation, ResourcesOperationLayer};

/// The series of the per-service layers of this file.
const TOOL_PROCESS: [(&str, &str); 2] = [
    (OPERATION_ATTRIBUTE, "tool"),
    (EXECUTOR_ATTRIBUTE, "process"),
];

/// The gRPC layer of `new_for_grpc` on `limit`, tagged tool/process, in the default (head-end)
/// form.
fn at_head(telemetry: &Telemetry, limit: &Limit) -> GrpcLayer {
    grpc_layer(telemetry, limit)
        .operation(Operation::Tool)
        .executor(Executor::Process)
}

/// [`at_head`], in the body-end form.
fn body_end(
    telemetry: &Telemetry,
    limit: &Limit,
) -> tower_resources_operation::HttpLayer<Limit, AtBodyEnd> {
    at_head(telemetry, limit).until_body_end()
}

// ---------------------------------------------------------------------------------------------
// A `Check` as a bare HTTP/2 request.

/// What a unary call put where: the `grpc-status` of its response head and of its trailers.
#[derive(Debug, PartialEq, Eq)]
struct StatusPlaces {
    head: Option<String>,
    trailers: Option<String>,
}

/// One `Check` of `service` sent as a bare HTTP/2 request, read to its end: where the answer put
/// its `grpc-status`.
async fn raw_check(channel: &Channel, service: &str) -> StatusPlaces {
    // The protobuf of HealthCheckRequest { service }: field 1, length-delimited.
    let length = u8::try_from(service.len()).expect("a short service name");
    assert!(length < 0x80, "a one-byte varint");
    let mut message = vec![0x0a, length];
    message.extend_from_slice(service.as_bytes());
    // The gRPC frame: not compressed, the length in 4 bytes big-endian, the message.
    let mut frame = vec![0];
    frame.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&message);

    let request = http::Request::post("/grpc.health.v1.Health/Check")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(Full::new(Bytes::from(frame))))
        .unwrap();
    let response = within("the Check's answer", channel.clone().oneshot(request))
        .await
        .unwrap();
    let head = grpc_status(response.headers());
    let collected = within("the Check's body", response.into_body().collect())
        .await
        .unwrap();
    StatusPlaces {
        head,
        trailers: collected.trailers().and_then(grpc_status),
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get("grpc-status")
        .map(|value| value.to_str().unwrap().to_owned())
}

// ---------------------------------------------------------------------------------------------
// Reading the metrics.

/// How many operations of `series` ended, whatever their outcome.
fn ended_at_all(telemetry: &Telemetry, series: &[(&str, &str)]) -> u64 {
    telemetry.count(DURATION_INSTRUMENT, series)
}

// ---------------------------------------------------------------------------------------------
// A status only the trailers carry.

/// How the streams of the next test fail, after their messages.
fn failures() -> [Status; 2] {
    [
        Status::internal("the watch broke"),
        Status::unavailable("the watched service went away"),
    ]
}

/// A server stream that sends messages and then fails has its status only in the trailers. The
/// body-end form reads it there: `error`. The head-end form ended the operation with the head,
/// which carries no status: `ok` (the documented limitation the body-end form fixes).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_that_fails_after_its_messages_is_an_error_at_body_end_and_ok_at_head() {
    // The body-end form.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut served = serve(body_end(&telemetry, &limit)).await;

    for (round, failure) in (1..).zip(failures()) {
        let code = failure.code();
        let (mut stream, call) = served.streaming("", 2).await;
        // Two messages out, the stream still open: the operation still runs, holding its permit.
        assert_eq!(
            ended_at_all(&telemetry, &TOOL_PROCESS),
            round - 1,
            "{code:?}"
        );
        assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
        assert_eq!(limit.available(), 0);

        call.fail(failure);
        let status = message(&mut stream).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        // The operation ended when its trailers went out, before the client read them.
        assert_eq!(telemetry.ended(&TOOL_PROCESS, "error"), round, "{code:?}");
        assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), round);
        assert_idle(&telemetry, &limit);
    }
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "error"), 2);
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 0);
    assert_idle(&telemetry, &limit);

    // The head-end form, same calls.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut served = serve(at_head(&telemetry, &limit)).await;

    for failure in failures() {
        let code = failure.code();
        let (mut stream, call) = served.streaming("", 2).await;
        // The head is out: the head-end operation is over while the stream still streams.
        assert_eq!(limit.available(), 1);
        call.fail(failure);
        let status = message(&mut stream).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
    }
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 2);
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "error"), 0);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// The outcome a stream's trailers carry.

/// A stream that ends normally (trailers with `grpc-status` 0) is `ok`; one whose trailers
/// carry DEADLINE_EXCEEDED (4) is `timeout`, CANCELLED (1) `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_ends_with_the_outcome_its_trailers_carry() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut served = serve(body_end(&telemetry, &limit)).await;

    let endings: [(Option<Status>, Result<(), Code>, &str); 3] = [
        (None, Ok(()), "ok"),
        (
            Some(Status::deadline_exceeded("the watch ran out of time")),
            Err(Code::DeadlineExceeded),
            "timeout",
        ),
        (
            Some(Status::cancelled("the watch was called off")),
            Err(Code::Cancelled),
            "cancelled",
        ),
    ];
    for (ending, seen, outcome) in endings {
        let (stream, call) = served.streaming("", 0).await;
        call.send();
        call.send();
        call.send();
        match ending {
            None => call.finish(),
            Some(status) => call.fail(status),
        }
        let (messages, status) = drain(stream).await;
        assert_eq!(messages, 3, "{outcome}");
        assert_eq!(status.map_err(|s| s.code()), seen, "{outcome}");
        assert_eq!(telemetry.ended(&TOOL_PROCESS, outcome), 1, "{outcome}");
        assert_idle(&telemetry, &limit);
    }
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 3);
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "error"), 0);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS), 3);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// Unary calls.

/// A unary call that succeeds answers a head without `grpc-status` and trailers with
/// `grpc-status` 0: `ok` in both forms (the head-end form sees no status in the head, the
/// body-end form reads the trailers). A handler's `Err(Status)` is answered trailers-only (the
/// status in the head, no trailers): both forms decide at the head. In the body-end form that
/// is what makes it an error: the body ends with no trailers, which alone would be `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unary_calls_are_ok_from_their_trailers_and_failures_are_decided_at_the_head() {
    async fn calls(channel: &Channel, backend: &Backend) {
        assert_eq!(
            check(channel, "ok").await.unwrap(),
            ServingStatus::Serving as i32
        );
        assert_eq!(
            raw_check(channel, "ok").await,
            StatusPlaces {
                head: None,
                trailers: Some("0".to_owned()),
            },
            "a unary success: no status in the head, 0 in the trailers"
        );
        for (service, code, number) in [
            ("internal", Code::Internal, "13"),
            ("deadline", Code::DeadlineExceeded, "4"),
            ("cancelled", Code::Cancelled, "1"),
        ] {
            let status = check(channel, service).await.unwrap_err();
            assert_eq!(status.code(), code, "{service}: {status:?}");
            assert_eq!(
                raw_check(channel, service).await,
                StatusPlaces {
                    head: Some(number.to_owned()),
                    trailers: None,
                },
                "{service}: a trailers-only answer"
            );
        }
        assert_eq!(backend.checks(), 8);
    }

    for body_end_form in [true, false] {
        let form = if body_end_form { "body end" } else { "head" };
        let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
        let served = if body_end_form {
            serve(body_end(&telemetry, &limit)).await
        } else {
            serve(at_head(&telemetry, &limit)).await
        };

        calls(&served.channel, &served.backend).await;

        let outcomes = telemetry.outcomes(&TOOL_PROCESS);
        let expected = [("cancelled", 2), ("error", 2), ("ok", 2), ("timeout", 2)]
            .map(|(outcome, n)| (outcome.to_owned(), n))
            .into_iter()
            .collect();
        assert_eq!(outcomes, expected, "{form}");
        assert_idle(&telemetry, &limit);
    }
}

// ---------------------------------------------------------------------------------------------
// Deadlines.

/// Opens a `Watch` with a client deadline of `client_deadline`, sent as `grpc-timeout`, on a
/// stream that runs longer (a message every 20 ms until the server drops it), and gives up 100 ms
/// past the deadline, mid-stream: drops the stream, which resets it. Returns once the server has
/// dropped the body. (The client's clock starts before the request travels; giving up a little
/// late keeps the drop past the deadline as the server counts it, however slow the trip.)
async fn give_up_at_the_deadline_mid_stream(
    served: &mut Served,
    limit: &Limit,
    client_deadline: Duration,
) {
    let mut request = asking("ticking");
    request.set_timeout(client_deadline);
    let gives_up = Instant::now() + client_deadline + Duration::from_millis(100);
    let mut stream = tokio::time::timeout_at(
        gives_up,
        HealthClient::new(served.channel.clone()).watch(request),
    )
    .await
    .expect("the head came after the client's deadline")
    .unwrap()
    .into_inner();
    let call = served.next_watch().await;
    let feed = call.feed.clone();
    let ticker = tokio::spawn(async move {
        let mut sent = 0_usize;
        while feed.send(Ok(serving())).is_ok() {
            sent += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sent
    });

    let mut received = 0;
    let read = tokio::time::timeout_at(gives_up, async {
        while let Some(response) = stream.message().await? {
            assert_eq!(response.status, ServingStatus::Serving as i32);
            received += 1;
        }
        Ok::<_, Status>(())
    })
    .await;
    assert!(
        read.is_err(),
        "the stream ended before the deadline: {read:?}"
    );
    assert!(
        received >= 1,
        "the stream was under way when the deadline fired"
    );
    assert_eq!(
        limit.available(),
        0,
        "the stream holds its permit until then"
    );
    drop(stream); // the client's deadline fired: it cancels the call

    call.dropped().await;
    let sent = within("the ticker", ticker).await.unwrap();
    assert!(sent >= received);
}

/// Streams one message on `call` and ends it normally; checks that the client read just that
/// on `stream`.
async fn one_message_then_the_end(stream: Streaming<HealthCheckResponse>, call: WatchCall) {
    call.send();
    call.finish();
    let (messages, status) = drain(stream).await;
    assert_eq!((messages, status.map_err(|s| s.code())), (1, Ok(())));
}

/// Waits until an operation ended (the server sees a reset or a timeout on its own time), then
/// checks that it is the only one, and that it ended `outcome`.
async fn the_one_operation_ended(telemetry: &Telemetry, outcome: &str) {
    eventually("the operation ended", || {
        ended_at_all(telemetry, &TOOL_PROCESS) == 1
    })
    .await;
    assert_eq!(
        telemetry.outcomes(&TOOL_PROCESS),
        BTreeMap::from([(outcome.to_owned(), 1)])
    );
}

/// The client sends its deadline as `grpc-timeout` and gives up at it, mid-stream: it drops the
/// stream, the client resets it, the server drops the body. `new_for_grpc` reads the deadline
/// (its `Grpc` protocol), so the operation ends `timeout`, not `cancelled`; a layer that reads no
/// deadline (`.protocol(())`) sees the same drop as `cancelled`. (tonic's server
/// applies `grpc-timeout` to the response head only: a stream goes on until someone drops it.) A
/// stream that ends before the client's deadline is still `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_deadline_that_fires_mid_stream_ends_the_operation_as_timeout() {
    let client_deadline = Duration::from_millis(300);
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut served = serve(body_end(&telemetry, &limit)).await;

    give_up_at_the_deadline_mid_stream(&mut served, &limit, client_deadline).await;
    the_one_operation_ended(&telemetry, "timeout").await;
    assert_idle(&telemetry, &limit);

    // A stream that ends within its deadline is `ok`, deadline or not.
    let mut request = asking("short");
    request.set_timeout(DEADLINE);
    let stream = HealthClient::new(served.channel.clone())
        .watch(request)
        .await
        .unwrap()
        .into_inner();
    one_message_then_the_end(stream, served.next_watch().await).await;
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 1);
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "timeout"), 1);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_idle(&telemetry, &limit);

    // The contrast: a body-end layer that reads no deadline.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut served = serve(body_end(&telemetry, &limit).protocol(())).await;

    give_up_at_the_deadline_mid_stream(&mut served, &limit, client_deadline).await;
    the_one_operation_ended(&telemetry, "cancelled").await;
    assert_idle(&telemetry, &limit);
}

/// tonic's own `Server::timeout` drops a unary call whose handler runs too long (and answers
/// CANCELLED, "Timeout expired"); the body-end layer told `.server_timeout(server_timeout)`
/// counts that drop as `timeout`, as it
/// does the client's own `grpc-timeout`, which tonic enforces the same way before the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tonics_server_timeout_on_a_unary_call_is_timeout_in_the_body_end_form() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let server_timeout = Duration::from_millis(300);
    let served = serve_timing_out(server_timeout, body_end(&telemetry, &limit)).await;
    let channel = &served.channel;

    // The server's own timeout.
    let hung = tokio::spawn({
        let channel = channel.clone();
        async move { check(&channel, "hang").await }
    });
    within("the handler's start", served.backend.hanging.notified()).await;
    assert_eq!(limit.available(), 0);
    let status = hung.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    the_one_operation_ended(&telemetry, "timeout").await;
    assert_idle(&telemetry, &limit);

    // The client's deadline, shorter than the server's.
    check_past_a_client_deadline(channel).await;
    eventually("the second operation ended", || {
        ended_at_all(&telemetry, &TOOL_PROCESS) == 2
    })
    .await;
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "timeout"), 2);
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "cancelled"), 0);

    // The permit is back: a call within the deadline is served, and `ok`.
    check(channel, "ok").await.unwrap();
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 1);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// A limit of 1, held by a stream.

/// With a limit of 1, a second stream waits until the first has sent its last message and its
/// trailers: its handler is not called before, its queue time covers the rest of the first
/// stream, and the permit goes back when the second stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_limit_of_one_a_second_stream_waits_for_the_first_stream_to_end() {
    const REST: Duration = Duration::from_millis(150);
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut served = serve(body_end(&telemetry, &limit)).await;

    let (mut first, first_call) = served.streaming("first", 1).await;
    assert_eq!(first_call.service, "first");

    let second_channel = connect(served.addr).await;
    let second = tokio::spawn(async move {
        let stream = watch(&second_channel, "second").await?;
        Ok::<_, Status>(drain(stream).await)
    });
    eventually("the second stream waits for the permit", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS) == 1
    })
    .await;
    let queued_by = Instant::now();
    assert_eq!(limit.queued(), 1);
    served.assert_no_watch_started("the second stream was admitted while the first ran");

    // The rest of the first stream: a message, a while, its last message.
    first_call.send();
    assert!(message(&mut first).await.unwrap().is_some());
    tokio::time::sleep(REST).await;
    first_call.send();
    assert!(message(&mut first).await.unwrap().is_some());
    served.assert_no_watch_started(
        "the second stream was admitted before the first sent its trailers",
    );
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 0);
    assert_eq!(limit.available(), 0);

    // Its trailers: the first operation ends and hands its permit to the second.
    let first_ends = Instant::now();
    first_call.finish();
    assert!(message(&mut first).await.unwrap().is_none(), "a normal end");
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 1);
    let second_call = served.next_watch().await;
    assert_eq!(second_call.service, "second");
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(limit.available(), 0, "the second stream holds the permit");

    second_call.send();
    second_call.finish();
    let (messages, status) = within("the second stream", second).await.unwrap().unwrap();
    assert_eq!((messages, status.map_err(|s| s.code())), (1, Ok(())));

    // The second started waiting before `queued_by` and was admitted after `first_ends`.
    let rest = first_ends.duration_since(queued_by).as_secs_f64() * 1000.0;
    assert!(rest >= REST.as_secs_f64() * 1000.0);
    let waited = telemetry
        .max(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS)
        .expect("queue samples");
    assert!(
        waited >= rest,
        "the second stream waited {waited} ms, the rest of the first took {rest} ms"
    );
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS), 2);
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 2);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_eq!(served.backend.checks(), 0);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// A client that hangs up mid-stream.

/// A client that drops the stream mid-way (no deadline involved) resets it; the server drops the
/// body, which ends the operation `cancelled` and frees the permit for the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_hangs_up_mid_stream_ends_the_operation_cancelled_and_frees_the_permit() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut served = serve(body_end(&telemetry, &limit)).await;

    let (stream, call) = served.streaming("abandoned", 1).await;
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(limit.available(), 0);

    drop(stream); // the client hangs up
    call.dropped().await;
    the_one_operation_ended(&telemetry, "cancelled").await;
    assert_idle(&telemetry, &limit);

    // The permit is free again: the next stream is admitted at once, and ends `ok`.
    let (stream, call) = served.streaming("next", 0).await;
    assert_eq!(call.service, "next");
    one_message_then_the_end(stream, call).await;
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 1);
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "cancelled"), 1);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// Per request, over a whole server.

/// One body-end layer on `Server::builder()`, choosing per method: `Watch` calls are limited and
/// recorded as judge/inline; `Check` calls are neither, so a `Check` answers while the limit is
/// full of `Watch` streams, and records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_request_over_a_whole_server_limits_and_records_watch_but_not_check() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(2));
    let layer = grpc_layer(&telemetry, &limit).until_body_end().per_request(
        ByRoute::new()
            .route(
                "grpc.health.v1.Health/Watch",
                Choice::limited(Operation::Judge, Executor::Inline),
            )
            .route("grpc.health.v1.Health/Check", Choice::Unlimited),
    );
    let mut served = serve_with(|health, incoming| {
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(incoming)
    })
    .await;
    let judge_inline = [
        (OPERATION_ATTRIBUTE, "judge"),
        (EXECUTOR_ATTRIBUTE, "inline"),
    ];

    // Two streams fill the limit; a third waits.
    let (a, a_call) = served.streaming("a", 0).await;
    let (b, b_call) = served.streaming("b", 0).await;
    assert_eq!(limit.available(), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &judge_inline), 2);
    let c = tokio::spawn({
        let channel = served.channel.clone();
        async move { drain(watch(&channel, "c").await?).await.1 }
    });
    eventually("the third stream waits for a permit", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &judge_inline) == 1
    })
    .await;
    served.assert_no_watch_started("a third stream ran beside two on a limit of 2");

    // Check is not limited: it answers now, and is recorded nowhere.
    for _ in 0..3 {
        assert_eq!(
            check(&served.channel, "ok").await.unwrap(),
            ServingStatus::Serving as i32
        );
    }
    let status = check(&served.channel, "internal").await.unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert_eq!(served.backend.checks(), 4);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(
        telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]),
        2,
        "a and b"
    );
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &[]), 1, "c");
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 2, "a and b");

    // The first stream to end lets the third in.
    a_call.send();
    a_call.finish();
    assert_eq!(drain(a).await.0, 1);
    let c_call = served.next_watch().await;
    assert_eq!(c_call.service, "c");
    b_call.fail(Status::internal("b broke"));
    assert_eq!(drain(b).await.1.unwrap_err().code(), Code::Internal);
    c_call.finish();
    within("c", c).await.unwrap().unwrap();

    let outcomes = telemetry.outcomes(&judge_inline);
    assert_eq!(outcomes.get("ok"), Some(&2), "{outcomes:?}");
    assert_eq!(outcomes.get("error"), Some(&1), "{outcomes:?}");
    // Only the three Watch calls were recorded, all as judge/inline.
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 3);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]), 3);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &judge_inline), 3);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// Rejections in gRPC.

/// A gRPC layer on a limit that lets nobody wait: a call that finds the limit full (here
/// held by a stream) is answered RESOURCE_EXHAUSTED without reaching its handler, and counted in
/// `gym.resources.operation.rejected{rejection="queue_full"}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_that_finds_the_limit_full_gets_resource_exhausted_and_is_counted_rejected() {
    let (telemetry, limit) = (Telemetry::new(), Limit::with_max_queued(1, 0));
    let mut served = serve(body_end(&telemetry, &limit)).await;
    let queue_full = [
        TOOL_PROCESS[0],
        TOOL_PROCESS[1],
        (REJECTION_ATTRIBUTE, "queue_full"),
    ];

    // A stream holds the one permit.
    let (mut holder, holder_call) = served.streaming("holder", 1).await;
    assert_eq!(limit.available(), 0);

    let status = check(&served.channel, "ok").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("queue is full"), "{status:?}");
    let status = watch(&served.channel, "turned away").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        served.backend.checks(),
        0,
        "a rejected call never reaches its handler"
    );
    served.assert_no_watch_started("a rejected stream reached its handler");
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &queue_full), 2);
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &[]), 2);
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS), 0);
    assert_eq!(
        telemetry.count(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS),
        1,
        "the holder only"
    );
    assert_eq!(
        ended_at_all(&telemetry, &TOOL_PROCESS),
        0,
        "the holder still runs"
    );

    // The holder ends; the permit is back and the next call is served.
    holder_call.finish();
    assert!(message(&mut holder).await.unwrap().is_none());
    assert_eq!(limit.available(), 1);
    check(&served.channel, "ok").await.unwrap();
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 2);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &[]), 2);
    assert_idle(&telemetry, &limit);
}

/// `new(..).until_body_end()`: the generic layer reads a gRPC stream's outcome from its trailers,
/// as the gRPC one does, and a trailers-only failure from its head.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_generic_layer_in_the_body_end_form_reads_a_streams_trailers() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let generic = ResourcesOperationLayer::new(limit.clone())
        .operation(Operation::Tool)
        .executor(Executor::Process)
        .metrics(telemetry.metrics.clone())
        .until_body_end();
    let mut served = serve(generic).await;

    let (mut stream, call) = served.streaming("", 2).await;
    call.fail(Status::internal("the tool broke midway"));
    let status = message(&mut stream).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "error"), 1);

    let (stream, call) = served.streaming("", 0).await;
    call.send();
    call.fail(Status::deadline_exceeded("the watch ran out of time"));
    let (messages, status) = drain(stream).await;
    assert_eq!(
        (messages, status.map_err(|s| s.code())),
        (1, Err(Code::DeadlineExceeded))
    );
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "timeout"), 1);

    let failed = check(&served.channel, "internal").await.unwrap_err();
    assert_eq!(failed.code(), Code::Internal);
    assert_eq!(
        telemetry.ended(&TOOL_PROCESS, "error"),
        2,
        "trailers-only, at the head"
    );
    assert_eq!(telemetry.ended(&TOOL_PROCESS, "ok"), 0);
    assert_idle(&telemetry, &limit);
}
