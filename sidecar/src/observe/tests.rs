use super::*;

fn key() -> SessionKey {
    SessionKey::parse("s").unwrap()
}

fn ids(events: &[Event]) -> Vec<String> {
    events.iter().map(|e| e.id.to_string()).collect()
}

#[test]
fn ids_grow_per_epoch_and_restart_at_a_new_epoch() {
    let hubs = Hubs::default();
    let got: Vec<String> =
        [1, 1, 2, 2].into_iter().map(|e| hubs.publish(&key(), Epoch(e), "token", "{}").to_string()).collect();
    assert_eq!(got, ["1-1", "1-2", "2-1", "2-2"]);
    assert!(EventId::parse("x-1").is_none() && EventId::parse("1").is_none());
}

#[test]
fn replay_is_the_current_turn_or_everything_after_an_id() {
    let hubs = Hubs::default();
    for kind in ["turn_started", "token", "turn_finished", "turn_started", "token"] {
        hubs.publish(&key(), Epoch(1), kind, "{}");
    }
    assert_eq!(ids(&hubs.subscribe(&key(), None).replay), ["1-4", "1-5"], "current turn so far");
    let after = EventId::parse("1-2").unwrap();
    assert_eq!(ids(&hubs.subscribe(&key(), Some(after)).replay), ["1-3", "1-4", "1-5"]);
}

#[test]
fn stale_epochs_and_duplicates_are_never_ingested() {
    let hubs = Hubs::default();
    let event = |id: &str| Event::new(EventId::parse(id).unwrap(), "token", "{}");
    let mut live = hubs.subscribe(&key(), None).live;
    assert!(hubs.ingest(&key(), event("2-1")));
    assert!(!hubs.ingest(&key(), event("1-9")), "lower epoch after a higher one");
    assert!(!hubs.ingest(&key(), event("2-1")), "duplicate");
    assert!(hubs.ingest(&key(), event("2-2")));
    let mut got = Vec::new();
    while let Ok(Message::Event(e)) = live.try_recv() {
        got.push(e.id.to_string());
    }
    assert_eq!(got, ["2-1", "2-2"]);
}

const ROOMY: StreamLimits = StreamLimits { per_node: 100, per_session: 100 };

#[test]
fn the_first_observer_starts_a_follower_and_the_last_lets_it_go() {
    let hubs = Hubs::default();
    assert_eq!(hubs.observer_joined(&key(), ROOMY), Some(true), "first observer: start following");
    assert_eq!(hubs.observer_joined(&key(), ROOMY), Some(false), "second: the same follower serves it");
    assert_eq!(hubs.observer_count(), 2);
    hubs.observer_left(&key());
    assert!(!hubs.follower_done(&key(), false), "one observer is still there");
    hubs.observer_left(&key());
    assert!(hubs.follower_done(&key(), false));
    assert_eq!(hubs.observer_count(), 0);
    assert_eq!(hubs.observer_joined(&key(), ROOMY), Some(true), "following starts again");
}

#[test]
fn observers_past_a_limit_are_refused_and_not_counted() {
    let hubs = Hubs::default();
    let limits = StreamLimits { per_node: 3, per_session: 2 };
    let other = SessionKey::parse("other").unwrap();
    assert!(hubs.observer_joined(&key(), limits).is_some());
    assert!(hubs.observer_joined(&key(), limits).is_some());
    assert_eq!(hubs.observer_joined(&key(), limits), None, "per session");
    assert!(hubs.observer_joined(&other, limits).is_some());
    assert_eq!(hubs.observer_joined(&other, limits), None, "per node");
    assert_eq!(hubs.observer_count(), 3, "refusals are not counted");
    hubs.observer_left(&key());
    assert!(hubs.observer_joined(&other, limits).is_some(), "room again");
}

#[test]
fn idle_is_announced_once_until_an_event_arrives() {
    let hubs = Hubs::default();
    let mut live = hubs.subscribe(&key(), None).live;
    hubs.set_idle(&key(), None);
    hubs.set_idle(&key(), None);
    assert!(hubs.subscribe(&key(), None).idle);
    hubs.publish(&key(), Epoch(1), "turn_started", "{}");
    assert!(!hubs.subscribe(&key(), None).idle);
    assert!(matches!(live.try_recv(), Ok(Message::Primed)), "no owner: nothing to backfill");
    assert!(matches!(live.try_recv(), Ok(Message::Idle)));
    assert!(matches!(live.try_recv(), Ok(Message::Event(_))));
}

#[test]
fn nothing_of_an_ended_epoch_is_taken_after_idle() {
    let hubs = Hubs::default();
    let event = |id: &str| Event::new(EventId::parse(id).unwrap(), "token", "{}");
    assert!(hubs.ingest(&key(), event("1-3")));
    hubs.set_idle(&key(), Some(Epoch(1)));
    let mut live = hubs.subscribe(&key(), None).live;
    assert!(!hubs.ingest(&key(), event("1-4")), "epoch 1 ended before the idle");
    assert!(hubs.ingest(&key(), event("2-1")), "the next owner's events pass");
    assert!(matches!(live.try_recv(), Ok(Message::Event(e)) if e.id == EventId::parse("2-1").unwrap()));
    assert_eq!(hubs.publish(&key(), Epoch(3), "turn_started", "{}"), EventId::parse("3-1").unwrap());
}

#[test]
fn a_subscriber_before_the_backfill_waits_for_primed_then_replays() {
    let hubs = Hubs::default();
    let early = hubs.subscribe(&key(), None);
    assert!(!early.primed && early.replay.is_empty());
    let event = |id: &str, kind: &str| Event::new(EventId::parse(id).unwrap(), kind, "{}");
    // The upstream backfill: an old turn and the current one.
    for (id, kind) in
        [("1-1", "turn_started"), ("1-2", "turn_finished"), ("1-3", "turn_started"), ("1-4", "token")]
    {
        hubs.ingest(&key(), event(id, kind));
    }
    hubs.mark_primed(&key());
    assert_eq!(ids(&hubs.replay(&key(), None)), ["1-3", "1-4"], "the current turn, as on the owner");
    assert_eq!(ids(&hubs.replay(&key(), EventId::parse("1-1"))), ["1-2", "1-3", "1-4"]);
    let late = hubs.subscribe(&key(), None);
    assert!(late.primed);
    assert_eq!(ids(&late.replay), ["1-3", "1-4"]);
}

#[test]
fn the_replay_buffer_is_bounded_in_bytes_as_well_as_count() {
    let hubs = Hubs::default();
    let big = format!("\"{}\"", "x".repeat(64 * 1024));
    for _ in 0..64 {
        hubs.publish(&key(), Epoch(1), "token", &big);
    }
    let kept = hubs.replay(&key(), EventId::parse("1-0"));
    let bytes: usize = kept.iter().map(|e| e.frame.len()).sum();
    assert!(bytes <= REPLAY_BYTES, "{bytes} bytes kept");
    assert!(kept.len() >= 15 && kept.len() < 64, "{} kept", kept.len());
    assert_eq!(kept.last().unwrap().id, EventId::parse("1-64").unwrap(), "the newest are kept");
}

#[test]
fn a_released_session_without_observers_leaves_no_hub() {
    let hubs = Hubs::default();
    hubs.publish(&key(), Epoch(1), "turn_started", "{}");
    assert_eq!(hubs.len(), 1);
    hubs.moved(&key());
    assert!(hubs.is_empty(), "no hub, no replay buffer kept for it");
}
