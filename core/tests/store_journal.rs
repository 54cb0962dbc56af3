//! The turn journal (CONTRACT §9) against a real Postgres: every write fenced like a
//! checkpoint, interrupted turns taken over by the next epoch, events appended in one
//! statement across sessions, replay in id order across epochs.

mod support;

use std::time::Duration;

use leasehold_core::{
    store::{Answer, Append, Begun, Claim, Error, JournalEvent, NewTurn, TurnKind, TurnState},
    Epoch, EventId, Owner, SessionKey,
};
use support::{boot, key, store, LONG_TTL};

fn fenced<T: std::fmt::Debug>(r: Result<T, Error>) -> bool {
    matches!(r, Err(Error::Fenced { .. }))
}

fn turn<'a>(id: &'a str, body: &'a [u8]) -> NewTurn<'a> {
    NewTurn { turn_id: id, kind: TurnKind::Turn, content_type: Some("application/json"), body }
}

fn event(epoch: i64, seq: u64, turn_id: Option<&str>, text: &str) -> JournalEvent {
    JournalEvent {
        id: EventId { epoch: Epoch(epoch), seq },
        turn_id: turn_id.map(str::to_owned),
        kind: "token".to_owned(),
        data: format!("{{\"text\":\"{text}\"}}"),
    }
}

fn append(key: &SessionKey, owner: &Owner, event: JournalEvent) -> Append {
    Append { key: key.clone(), owner: owner.clone(), event }
}

fn answer(body: &str) -> Answer {
    Answer { status: 200, content_type: Some("application/json".to_owned()), body: body.as_bytes().to_vec() }
}

#[tokio::test]
async fn a_turn_is_journaled_once_and_its_recorded_answer_found_again() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();
    let t = turn("t1", b"{\"text\":\"hi\"}");
    assert_eq!(store.begin_turn(&s, &a, Epoch(1), &t).await.unwrap(), Begun::Started);
    // Begun again at our epoch (its attempt here was halted): not journaled again, taken
    // over as a second attempt.
    let Begun::Resumed(running) = store.begin_turn(&s, &a, Epoch(1), &t).await.unwrap() else {
        panic!("a second begin of a running turn must take it over")
    };
    assert_eq!((running.state, running.epoch, running.attempts), (TurnState::Running, Epoch(1), 2));
    assert_eq!(running.digest, t.digest());
    store.finish_turn(&s, &a, Epoch(1), "t1", &answer("{\"n\":1}")).await.unwrap();
    let Begun::Existing(done) = store.begin_turn(&s, &a, Epoch(1), &t).await.unwrap() else {
        panic!("a finished turn must be found")
    };
    assert_eq!(done.state, TurnState::Finished);
    assert_eq!(done.answer, Some(answer("{\"n\":1}")));
    assert_eq!(done.request, b"{\"text\":\"hi\"}");
    // Finishing twice does not overwrite the recorded answer.
    assert!(fenced(store.finish_turn(&s, &a, Epoch(1), "t1", &answer("{\"n\":2}")).await));
    assert_eq!(store.get_turn(&s, "t1").await.unwrap().unwrap().answer, Some(answer("{\"n\":1}")));
    assert_eq!(store.get_turn(&s, "nope").await.unwrap(), None);
}

#[tokio::test]
async fn a_stale_owner_journals_appends_and_answers_nothing() {
    let store = store().await;
    let a = boot(&store, "node-a", Duration::from_millis(300)).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();
    assert_eq!(store.begin_turn(&s, &a, Epoch(1), &turn("t1", b"x")).await.unwrap(), Begun::Started);
    let landed = store.append_events(&[append(&s, &a, event(1, 1, Some("t1"), "a"))]).await.unwrap();
    assert_eq!(landed, vec![(s.clone(), EventId { epoch: Epoch(1), seq: 1 })]);
    tokio::time::sleep(Duration::from_millis(400)).await; // a paused past its TTL
    assert_eq!(store.claim(&s, &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });

    assert!(fenced(store.begin_turn(&s, &a, Epoch(1), &turn("t2", b"y")).await));
    assert!(store
        .append_events(&[append(&s, &a, event(1, 2, Some("t1"), "zombie"))])
        .await
        .unwrap()
        .is_empty());
    assert!(fenced(store.finish_turn(&s, &a, Epoch(1), "t1", &answer("zombie")).await));
    assert!(!store.cancel_turn(&s, &a, Epoch(1), "t1").await.unwrap());
    assert_eq!(store.get_turn(&s, "t2").await.unwrap(), None, "the zombie's turn was never journaled");
    let events = store.events_after(&s, None, 100).await.unwrap();
    assert_eq!(events.len(), 1, "only the event published while the lease held: {events:?}");
    assert_eq!(store.get_turn(&s, "t1").await.unwrap().unwrap().state, TurnState::Running);
}

#[tokio::test]
async fn the_next_owner_takes_over_an_interrupted_turn_and_reads_its_events() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();
    let t = turn("t1", b"{\"tokens\":5}");
    store.begin_turn(&s, &a, Epoch(1), &t).await.unwrap();
    let batch: Vec<_> = (1..=3).map(|n| append(&s, &a, event(1, n, Some("t1"), &n.to_string()))).collect();
    assert_eq!(store.append_events(&batch).await.unwrap().len(), 3);
    store.revoke_node(a.node_id()).await.unwrap(); // a dies; b takes over at epoch 2
    assert!(store.orphaned_turns(10).await.unwrap().contains(&s), "an unowned session with a running turn");
    assert_eq!(store.claim(&s, &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    assert!(store.orphaned_turns(10).await.unwrap().is_empty(), "owned again");

    let unfinished = store.unfinished_turns(&s).await.unwrap();
    assert_eq!(unfinished.iter().map(|t| t.turn_id.as_str()).collect::<Vec<_>>(), ["t1"]);
    let Begun::Resumed(resumed) = store.begin_turn(&s, &b, Epoch(2), &t).await.unwrap() else {
        panic!("the new owner must take the interrupted turn over")
    };
    assert_eq!(
        (resumed.epoch, resumed.attempts, resumed.request.as_slice()),
        (Epoch(2), 2, &b"{\"tokens\":5}"[..])
    );
    // A zombie of epoch 1 cannot take it back.
    assert_eq!(store.resume_turn(&s, &a, Epoch(1), "t1").await.unwrap(), None);
    let earlier = store.turn_events(&s, "t1", Epoch(2)).await.unwrap();
    assert_eq!(earlier.iter().map(|e| e.id.seq).collect::<Vec<_>>(), [1, 2, 3]);

    store.append_events(&[append(&s, &b, event(2, 1, Some("t1"), "4"))]).await.unwrap();
    store.finish_turn(&s, &b, Epoch(2), "t1", &answer("done")).await.unwrap();
    // Replay across the two epochs, in id order, from any point.
    let ids = |events: Vec<JournalEvent>| events.into_iter().map(|e| e.id.to_string()).collect::<Vec<_>>();
    assert_eq!(ids(store.events_after(&s, None, 100).await.unwrap()), ["1-1", "1-2", "1-3", "2-1"]);
    let after = EventId::parse("1-2");
    assert_eq!(ids(store.events_after(&s, after, 100).await.unwrap()), ["1-3", "2-1"]);
    assert_eq!(ids(store.events_after(&s, after, 1).await.unwrap()), ["1-3"]);
}

#[tokio::test]
async fn one_append_serves_many_sessions_and_drops_only_the_fenced_ones() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let (s1, s2) = (key("s1"), key("s2"));
    store.claim(&s1, &a).await.unwrap();
    store.claim(&s2, &a).await.unwrap();
    // s2 is released and taken by b: a's events for it must not land.
    assert!(store.release(&s2, &a, Epoch(1)).await.unwrap());
    assert_eq!(store.claim(&s2, &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    let batch = vec![
        append(&s1, &a, event(1, 1, None, "a")),
        append(&s2, &a, event(1, 1, None, "zombie")),
        append(&s1, &a, event(1, 2, None, "b")),
        append(&s2, &b, event(2, 1, None, "c")),
    ];
    let landed = store.append_events(&batch).await.unwrap();
    let want = [(s1.clone(), "1-1"), (s1.clone(), "1-2"), (s2.clone(), "2-1")];
    assert_eq!(
        landed.iter().map(|(k, id)| (k.clone(), id.to_string())).collect::<Vec<_>>(),
        want.iter().map(|(k, id)| (k.clone(), (*id).to_owned())).collect::<Vec<_>>()
    );
    let s2_events = store.events_after(&s2, None, 10).await.unwrap();
    assert_eq!(s2_events.len(), 1);
    assert_eq!(s2_events[0].data, "{\"text\":\"c\"}");
}

#[tokio::test]
async fn a_cancelled_turn_is_not_resumed_and_retention_collects_old_answers() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();
    store.begin_turn(&s, &a, Epoch(1), &turn("t1", b"x")).await.unwrap();
    store.begin_turn(&s, &a, Epoch(1), &turn("t2", b"y")).await.unwrap();
    store.append_events(&[append(&s, &a, event(1, 1, Some("t1"), "a"))]).await.unwrap();
    assert!(store.cancel_turn(&s, &a, Epoch(1), "t1").await.unwrap());
    assert!(!store.cancel_turn(&s, &a, Epoch(1), "t1").await.unwrap(), "already cancelled");
    assert!(fenced(store.finish_turn(&s, &a, Epoch(1), "t1", &answer("late")).await));
    assert_eq!(store.get_turn(&s, "t1").await.unwrap().unwrap().state, TurnState::Cancelled);
    let unfinished = store.unfinished_turns(&s).await.unwrap();
    assert_eq!(unfinished.iter().map(|t| t.turn_id.as_str()).collect::<Vec<_>>(), ["t2"]);

    // A long retention keeps it; a zero one collects the cancelled turn and its events,
    // never the running one.
    assert_eq!(store.collect_turns(Duration::from_secs(3600), 100).await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(20)).await; // finished_at < now() - 1 ms
    assert_eq!(store.collect_turns(Duration::from_millis(1), 100).await.unwrap(), 1);
    assert_eq!(store.get_turn(&s, "t1").await.unwrap(), None);
    assert!(store.events_after(&s, None, 10).await.unwrap().is_empty());
    assert_eq!(store.get_turn(&s, "t2").await.unwrap().unwrap().state, TurnState::Running);
}

/// The session moves between `begin_turn`'s two statements (its insert finds the turn
/// journaled, then the lease is taken over before the resume): the turn is still running,
/// the next owner's to resume, so the stale owner is fenced, not told it stands (which
/// the sidecar answered as a final `409 cancelled`). The takeover is made to land in
/// that window by a trigger that fires on the insert attempt, inside the first statement.
#[tokio::test]
async fn a_takeover_between_begin_and_resume_fences_the_stale_owner() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let s = key("raced");
    store.claim(&s, &a).await.unwrap();
    let t = turn("raced-1", b"{\"text\":\"raced\"}");
    assert_eq!(store.begin_turn(&s, &a, Epoch(1), &t).await.unwrap(), Begun::Started);
    // node-a's attempt is halted; as node-a begins it again, node-b takes the session over.
    let takeover = format!(
        "CREATE FUNCTION take_over() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
             UPDATE agent_leases SET owner = '{}', epoch = epoch + 1 WHERE agent_key = NEW.agent_key;
             RETURN NEW;
         END $$",
        b.as_str()
    );
    sqlx::query(&takeover).execute(store.pool()).await.unwrap();
    sqlx::query(
        "CREATE TRIGGER take_over BEFORE INSERT ON agent_turns FOR EACH ROW \
         WHEN (NEW.turn_id = 'raced-1') EXECUTE FUNCTION take_over()",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let raced = store.begin_turn(&s, &a, Epoch(1), &t).await;
    let shown = format!("{raced:?}");
    assert!(fenced(raced), "a running turn the stale owner cannot resume: {shown}");
    sqlx::query("DROP TRIGGER take_over ON agent_turns").execute(store.pool()).await.unwrap();
    let lease: (String, i64) =
        sqlx::query_as("SELECT owner, epoch FROM agent_leases WHERE agent_key = 'raced'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(lease, (b.as_str().to_owned(), 2), "the takeover landed inside begin_turn");
    // Still running at epoch 1, untouched: the next owner resumes it.
    let record = store.get_turn(&s, "raced-1").await.unwrap().unwrap();
    assert_eq!((record.state, record.epoch, record.attempts), (TurnState::Running, Epoch(1), 1));
    let Begun::Resumed(resumed) = store.begin_turn(&s, &b, Epoch(2), &t).await.unwrap() else {
        panic!("the next owner resumes the raced turn")
    };
    assert_eq!((resumed.epoch, resumed.attempts), (Epoch(2), 2));
}
