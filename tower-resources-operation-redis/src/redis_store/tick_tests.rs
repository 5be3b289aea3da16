//! The tick script's reply, decoded: what a tick tells the leader and the other members.

use super::*;
use tower_resources_operation::{Executor, Operation};

fn strings(fields: &[&str]) -> Vec<String> {
    fields.iter().map(|field| (*field).to_owned()).collect()
}

/// The tick's reply `values`, decoded whole.
fn parse_ticked(values: &[String]) -> Result<Ticked, Malformed> {
    let mut reply = Decoder::new(values, scripts::TICK_REPLY);
    let ticked = decode_ticked(&mut reply)?;
    reply.finish()?;
    Ok(ticked)
}

#[test]
fn a_tick_that_took_no_window_says_what_the_fleet_knows() {
    let ticked = parse_ticked(&strings(&["0", "7", "12", "0", "40", "", "", "", "", ""])).unwrap();
    assert_eq!(
        (ticked.capacity, ticked.leads, ticked.age_ms),
        (7, false, 40)
    );
    assert_eq!((ticked.known.epoch, ticked.known.decreased), (12, 0));
    assert_eq!(ticked.known.rtt_us, None);
    assert!(ticked.taken.is_none());
}

#[test]
fn a_taken_window_makes_the_fleets_sample_series_by_series() {
    let fields = strings(&[
        "1",
        "8",
        "5",
        "1",
        "150",
        "3",
        "50000",
        "51000",
        "52000", // known
        "judge/inline/1000000/4.000/-1/12.500 nobody/knows/1/1/1/1 verify/subprocess/x",
        "ended",
        "8",
        "congested",
        "1",
        "stale",
        "2",
        "rejected",
        "0", // counts
        "samples",
        "4",
        "active_sum",
        "30",
        "peak",
        "9",
        "announced",
        "1",
        "verify/subprocess/e",
        "9",
        "verify/subprocess/o",
        "6",
        "verify/subprocess/v",
        "300000",
        "verify/subprocess/t",
        "6",
        "verify/subprocess/s",
        "300000",
        "verify/subprocess/q",
        "14648437",
        "verify/subprocess/m",
        "49000",
        "judge/inline/e",
        "2",
        "judge/inline/o",
        "2",
        "judge/inline/v",
        "2000000",
        "judge/inline/t",
        "2",
        "judge/inline/s",
        "2000000",
        "judge/inline/q",
        "1953125",
        "judge/inline/m",
        "1000000",
        "nobody/knows/e",
        "5",
        "verify/subprocess/zz",
        "1", // not ours: skipped
    ]);
    let ticked = parse_ticked(&fields).unwrap();
    assert!(ticked.leads);
    assert_eq!(ticked.known.baseline_us, Some(51_000));
    assert_eq!(
        ticked.handed,
        "judge/inline/1000000/4.000/-1/12.500 nobody/knows/1/1/1/1 verify/subprocess/x",
        "handed over as the last leader wrote it"
    );
    let adaptive = tower_resources_operation::adaptive::Adaptive::new(
        tower_resources_operation::adaptive::Vegas::default(),
        1..=64,
    );
    let taken = ticked.taken.unwrap();
    assert!(!taken.is_thin(8), "11 ended of 8 places");
    assert!(taken.is_thin(23), "11 ended of 23 places");
    let sample = taken.sample(8, &adaptive, ticked.age_ms);
    assert_eq!(
        (sample.ended, sample.congested, sample.stale_congested),
        (8, 1, 2)
    );
    let verify = sample
        .series_of(Operation::Verify, Executor::Subprocess)
        .expect("the verifies, read by kind");
    assert_eq!(verify.mean_run_time, Some(Duration::from_millis(50)));
    assert_eq!(verify.min_run_time, Some(Duration::from_millis(49)));
    let judge = sample
        .series_of(Operation::Judge, Executor::Inline)
        .unwrap();
    assert_eq!(judge.mean_run_time, Some(Duration::from_secs(1)));
    assert_eq!(sample.series().count(), 2, "{sample:?}");
    assert_eq!((sample.peak_in_flight, sample.in_flight), (9, 7.5));
    assert!(!sample.round_trip, "congested");
    assert_eq!(sample.elapsed, Duration::from_millis(150));
}
