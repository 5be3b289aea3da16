//! The crate's own surface: its errors (a kind, the limit, the address without its password,
//! the cause), where its background work runs (`build` within a runtime, or `build_pair` for
//! the caller to run), and its own instruments, registered only when asked and silent once
//! their limit is gone.

mod support;

use std::error::Error as _;
use std::net::TcpListener;
use std::time::Duration;

use support::redis_server::RedisServer;
use support::{within, Data, Telemetry};
use tower_resources_operation::names::LIMIT_ATTRIBUTE;
use tower_resources_operation::{Acquire, Rejection};
use tower_resources_operation_redis::metrics::{FAILED_OPEN_INSTRUMENT, LEASES_LOST_INSTRUMENT};
use tower_resources_operation_redis::{Error, ErrorKind, RedisLimit, RedisLimitBuilder};

/// A limit whose refreshes and fallback polls are far off: whatever happens within a test
/// happens by a call.
fn patient(name: &'static str, capacity: usize) -> RedisLimitBuilder {
    RedisLimit::builder(name, capacity)
        .lease_ttl(Duration::from_secs(60))
        .call_timeout(Duration::from_secs(5))
        .fallback_poll(Duration::from_secs(20))
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

#[test]
fn build_outside_a_runtime_is_an_error_that_says_so_and_build_pair_needs_none() {
    let error = RedisLimit::builder("judges", 2)
        .build("redis://127.0.0.1:6379/")
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::NoRuntime);
    assert_eq!(error.limit(), "judges");
    assert_eq!(error.address(), "redis://127.0.0.1:6379/0");
    let message = error.to_string();
    for said in [
        "\"judges\"",
        "redis://127.0.0.1:6379/0",
        "tokio runtime",
        "build_pair",
    ] {
        assert!(message.contains(said), "{said:?} in {message}");
    }
    assert!(error.source().is_some(), "tokio's own error is the source");

    let (limit, background) = RedisLimit::builder("judges", 2)
        .build_pair("redis://127.0.0.1:6379/")
        .expect("no runtime needed");
    assert_eq!((limit.name(), limit.capacity()), ("judges", 2));
    drop((limit, background));
}

#[test]
fn an_address_that_is_not_a_redis_url_is_an_error_that_hides_its_password() {
    for address in [
        "http://user:hunter2@cache.internal:6379/",
        "redis://user:hunter2@cache.internal:notaport/",
    ] {
        let error = RedisLimit::builder("judges", 2)
            .build_pair(address)
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidAddress, "{address}");
        let message = format!("{error} / {error:?} / {}", error.address());
        assert!(message.contains("cache.internal"), "{message}");
        assert!(
            !message.contains("hunter2"),
            "the password shown: {message}"
        );
        assert!(error.source().is_some());
    }
    // A good one is said without its password too.
    let (limit, _background) = RedisLimit::builder("judges", 2)
        .build_pair("redis://user:hunter2@cache.internal:6380/3")
        .unwrap();
    assert_eq!(limit.address(), "redis://cache.internal:6380/3");
    assert!(!format!("{limit:?}").contains("hunter2"));
}

/// What `give` panicked with.
fn refusal(give: impl FnOnce()) -> String {
    let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(give))
        .expect_err("the value is refused");
    match payload.downcast_ref::<String>() {
        Some(message) => message.clone(),
        None => payload.downcast_ref::<&str>().unwrap().to_string(),
    }
}

/// One rule for bad values, in both crates: refused when the limit is built, with a panic that
/// names the value, before anything runs (what only the environment can say, an address or a
/// runtime, is an error instead).
#[test]
fn each_bad_setting_is_refused_when_the_limit_is_built_naming_the_value() {
    let address = "redis://127.0.0.1:6379/";
    let builder = || RedisLimit::builder("judges", 2);
    let call = Duration::from_millis(500);
    let ttl = refusal(|| {
        let built = builder()
            .lease_ttl(Duration::from_secs(1))
            .call_timeout(call);
        drop(built.build_pair(address))
    });
    assert!(ttl.contains("1s") && ttl.contains("500ms"), "{ttl}");
    // Whatever the order the two were given in.
    let ttl = refusal(|| {
        let built = builder()
            .call_timeout(call)
            .lease_ttl(Duration::from_millis(20));
        drop(built.build_pair(address))
    });
    assert!(ttl.contains("20ms") && ttl.contains("30 ms"), "{ttl}");

    let zero = refusal(|| drop(RedisLimit::builder("judges", 0)));
    assert!(zero.contains("\"judges\" has a capacity of 0"), "{zero}");
    let call = refusal(|| drop(RedisLimit::builder("judges", 2).call_timeout(Duration::ZERO)));
    assert!(
        call.contains("call timeout") && call.contains("0ns"),
        "{call}"
    );
    let poll =
        refusal(|| drop(RedisLimit::builder("judges", 2).fallback_poll(Duration::from_micros(10))));
    assert!(
        poll.contains("fallback poll") && poll.contains("10µs"),
        "{poll}"
    );
    let tick = refusal(|| drop(RedisLimit::builder("judges", 2).adaptive_tick(Duration::ZERO)));
    assert!(
        tick.contains("adaptive tick") && tick.contains("0ns"),
        "{tick}"
    );
    let name = refusal(|| drop(RedisLimit::builder(String::from("judges of 2026"), 2)));
    assert!(name.contains("judges of 2026"), "{name}");

    // The settings at their edges are taken.
    let (limit, _background) = RedisLimit::builder("judges", 1)
        .call_timeout(Duration::from_millis(10))
        .lease_ttl(Duration::from_millis(30))
        .fallback_poll(Duration::from_millis(1))
        .adaptive_tick(Duration::from_millis(1))
        .build_pair(address)
        .unwrap();
    assert_eq!(limit.capacity(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_is_an_error_that_names_the_address_and_the_cause() {
    let address = format!("redis://127.0.0.1:{}/", closed_port());
    let limit = RedisLimit::builder("judges", 2)
        .call_timeout(Duration::from_secs(1))
        .build(&address)
        .unwrap();
    let error = within("ready", limit.ready()).await.unwrap_err();
    assert!(error.is_unavailable(), "{error:?}");
    assert!(!error.is_short_circuited());
    assert_eq!(error.address(), format!("{address}0"));
    let message = error.to_string();
    assert!(message.contains(&format!("{address}0")), "{message}");
    assert!(error.source().is_some(), "the cause: {message}");
    assert!(!limit.is_reachable());

    // A caller after it is answered without asking, with the failure as the cause.
    let started = std::time::Instant::now();
    let refused = within("an acquire", limit.acquire()).await.unwrap_err();
    // Well within the call timeout: it did not ask.
    assert!(started.elapsed() < Duration::from_millis(300), "at once");
    assert_eq!(refused.rejection(), Rejection::Unavailable);
    let cause = refused
        .source()
        .and_then(|source| source.downcast_ref::<Error>())
        .expect("this crate's error");
    assert!(cause.is_short_circuited());
    assert_eq!(cause.kind(), error.kind());
    assert!(cause.source().is_some(), "the failure that started it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn ready_says_whether_redis_answers_now_not_whether_it_once_connected() {
    let redis = RedisServer::start_required();
    let limit = RedisLimit::builder("judges", 2)
        .call_timeout(Duration::from_millis(300))
        .build(redis.url())
        .unwrap();
    limit.ready().await.unwrap();
    redis.pause();
    let error = within("ready", limit.ready()).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Timeout, "{error}");
    assert!(error.to_string().contains("300ms"), "{error}");
    assert!(!limit.is_reachable());
    redis.resume();
    within("ready", limit.ready()).await.unwrap();
    assert!(limit.is_reachable(), "its answer ends the outage");
}

// ---------------------------------------------------------------------------------------------
// Background work
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn build_pair_leaves_the_background_work_to_the_caller_and_it_ends_with_the_limit() {
    let redis = RedisServer::start_required();
    let (limit, background) = patient("judges", 2).build_pair(redis.url()).unwrap();
    let permit = within("a place", limit.acquire()).await.unwrap();
    assert_eq!(limit.fleet().await.unwrap().active, 1);

    // Not run yet: the release waits for it.
    drop(permit);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(limit.fleet().await.unwrap().active, 1, "nobody sent it");
    let running = tokio::spawn(background);
    within("the release", async {
        while limit.fleet().await.unwrap().active != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;

    // It ends once every handle is gone.
    drop(limit);
    within("the background work ends", running).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn build_spawns_its_background_work_on_the_current_runtime() {
    let redis = RedisServer::start_required();
    let limit = patient("judges", 2).build(redis.url()).unwrap();
    drop(within("a place", limit.acquire()).await.unwrap());
    within("the release", async {
        while limit.fleet().await.unwrap().active != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// The crate's own instruments
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn the_fleet_instruments_are_registered_only_when_asked_and_stop_with_their_limit() {
    let redis = RedisServer::start_required();
    let t = Telemetry::new();
    let limit = patient("judges", 2).build(redis.url()).unwrap();
    limit.ready().await.unwrap();
    let names = [FAILED_OPEN_INSTRUMENT, LEASES_LOST_INSTRUMENT];
    for name in names {
        assert!(t.exported(name).is_none(), "{name} registered unasked");
    }

    limit.register_metrics(&t.meter());
    for name in names {
        let exported = t.exported(name).expect("registered");
        assert_eq!(exported.unit, "{operation}", "{name}");
        assert!(!exported.description.is_empty(), "{name}");
        let Data::Sum { monotonic, points } = exported.data else {
            panic!("{name} is not a sum: {:?}", exported.data);
        };
        assert!(monotonic, "{name} is a counter");
        assert_eq!(points.len(), 1, "{name}: {points:?}");
        assert_eq!(points[0].value, 0);
        assert_eq!(
            points[0]
                .attributes
                .get(LIMIT_ATTRIBUTE)
                .map(String::as_str),
            Some("judges")
        );
    }

    // Gone, it reports nothing more.
    drop(limit);
    for name in names {
        assert!(t.live(name).is_empty(), "{name} after the limit is gone");
    }
}
