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
    assert_eq!(ids(&hubs.subscribe(&key(), None).replay.events), ["1-4", "1-5"], "current turn so far");
    let after = EventId::parse("1-2").unwrap();
    assert_eq!(ids(&hubs.subscribe(&key(), Some(after)).replay.events), ["1-3", "1-4", "1-5"]);
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

#[test]
fn an_ended_epochs_floor_holds_back_streams_but_not_the_journal() {
    let hubs = Hubs::default();
    let event = |id: &str| Event::new(EventId::parse(id).unwrap(), "token", "{}");
    assert!(hubs.ingest(&key(), event("1-4")));
    hubs.set_idle(&key(), Some(Epoch(2)));
    assert!(!hubs.ingest(&key(), event("2-1")), "a stream's late event of the ended epoch");
    assert_eq!(
        hubs.last_delivered(&key()),
        Some(EventId::parse("1-4").unwrap()),
        "the floor is not delivered"
    );
    assert!(hubs.ingest_journaled(&key(), event("2-1")), "journaled under the fence: delivered");
    assert!(!hubs.ingest_journaled(&key(), event("2-1")), "once");
    assert!(!hubs.ingest_journaled(&key(), event("1-3")), "nothing older than what was delivered");
    assert!(hubs.ingest(&key(), event("3-1")));
    assert_eq!(hubs.last_delivered(&key()), Some(EventId::parse("3-1").unwrap()));
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
    assert!(!early.primed && early.replay.events.is_empty());
    let event = |id: &str, kind: &str| Event::new(EventId::parse(id).unwrap(), kind, "{}");
    // The upstream backfill: an old turn and the current one.
    for (id, kind) in
        [("1-1", "turn_started"), ("1-2", "turn_finished"), ("1-3", "turn_started"), ("1-4", "token")]
    {
        hubs.ingest(&key(), event(id, kind));
    }
    hubs.mark_primed(&key());
    assert_eq!(ids(&hubs.replay(&key(), None).events), ["1-3", "1-4"], "the current turn, as on the owner");
    assert_eq!(ids(&hubs.replay(&key(), EventId::parse("1-1")).events), ["1-2", "1-3", "1-4"]);
    let late = hubs.subscribe(&key(), None);
    assert!(late.primed);
    assert_eq!(ids(&late.replay.events), ["1-3", "1-4"]);
}

#[test]
fn the_replay_buffer_is_bounded_in_bytes_as_well_as_count() {
    let hubs = Hubs::default();
    let big = format!("\"{}\"", "x".repeat(64 * 1024));
    for _ in 0..64 {
        hubs.publish(&key(), Epoch(1), "token", &big);
    }
    let kept = hubs.replay(&key(), EventId::parse("1-0")).events;
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

fn id(s: &str) -> EventId {
    EventId::parse(s).unwrap()
}

#[test]
fn memory_covers_an_id_only_from_its_oldest_event_or_the_one_right_before() {
    assert!(memory_covers(Some(id("2-5")), id("2-4")), "the very next id");
    assert!(memory_covers(Some(id("2-5")), id("2-5")), "at the oldest");
    assert!(memory_covers(Some(id("2-5")), id("2-9")), "after the oldest");
    assert!(memory_covers(Some(id("2-5")), id("3-1")), "a later epoch than anything buffered");
    assert!(!memory_covers(Some(id("2-5")), id("2-3")), "2-4 may be missing");
    assert!(!memory_covers(Some(id("2-1")), id("1-7")), "epoch 1 may have gone on after 1-7");
    assert!(memory_covers(Some(id("2-1")), id("2-0")), "2-0: from the epoch's start, all buffered");
    assert!(!memory_covers(Some(id("3-1")), id("2-0")), "another epoch, even at seq 0");
    assert!(!memory_covers(None, id("1-1")), "nothing buffered");
    assert!(!memory_covers(Some(id(&format!("1-{}", u64::MAX))), id(&format!("1-{}", u64::MAX - 2))));
}

#[test]
fn a_replay_after_an_id_says_what_the_journal_must_fill_in() {
    let hubs = Hubs::default();
    let event = |s: &str| Event::new(id(s), "token", "{}");
    assert_eq!(hubs.replay(&key(), Some(id("1-3"))).gap, Gap::ToEnd, "nothing in memory");
    for s in ["1-4", "1-5", "1-6"] {
        hubs.ingest(&key(), event(s));
    }
    let covered = hubs.replay(&key(), Some(id("1-3")));
    assert_eq!(
        (ids(&covered.events), covered.gap),
        (vec!["1-4".into(), "1-5".into(), "1-6".into()], Gap::None)
    );
    assert_eq!(hubs.replay(&key(), Some(id("1-5"))).gap, Gap::None);
    let short = hubs.replay(&key(), Some(id("1-2")));
    assert_eq!((ids(&short.events).len(), short.gap), (3, Gap::Before(id("1-4"))), "1-3 is not in memory");
    // A new epoch: epoch 1 may have gone on past 1-6 in the journal, so only the run of
    // epoch 2 counts, even for an id memory holds.
    hubs.ingest(&key(), event("2-1"));
    hubs.ingest(&key(), event("2-2"));
    let across = hubs.replay(&key(), Some(id("1-5")));
    assert_eq!(
        (ids(&across.events), across.gap),
        (vec!["1-6".into(), "2-1".into(), "2-2".into()], Gap::Before(id("2-1"))),
        "all memory has, for a reader that cannot read the journal"
    );
    assert_eq!(hubs.replay(&key(), Some(id("2-1"))).gap, Gap::None);
    // A hole within an epoch (an upstream that skipped) is not trusted either.
    hubs.ingest(&key(), event("2-5"));
    assert_eq!(hubs.replay(&key(), Some(id("2-2"))).gap, Gap::Before(id("2-5")));
    // Without an id: the current turn from memory, never the journal.
    assert_eq!(hubs.replay(&key(), None).gap, Gap::None);
}
