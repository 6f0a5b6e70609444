//! Where what a topology no longer needs is dropped: on a thread of its own, off the call's path.
//!
//! An engine superseded at take-up holds every pool of its topology: after small collectives
//! ran one-shot or two-shot in a large group, a pool to every member. Closing them is the
//! kernel's work, a FIN or RST per stream through the network stack; in the 64-peer lab (63
//! pools of 4 streams per member, every member at once on 2 cores) it took 0.8–1 s, all of it
//! inside the `update_topology()` that took up the new topology. The closer takes that out of
//! the call: one thread per communicator, started when first needed, at most [`CLOSING_MAX`]
//! engines queued (past that, or without a thread, the caller drops in place, as before).

use std::sync::mpsc::{sync_channel, SyncSender};
use std::thread;

/// Superseded engines queued for the closer at most: each holds its pools' descriptors until
/// closed, and topologies never change faster than a vote's round trip.
pub(crate) const CLOSING_MAX: usize = 4;

/// Drops what it is given on its own thread.
pub(crate) struct Closer<T: Send + 'static> {
    /// The thread's queue: not started yet, started, or not to be had (no thread).
    queue: Option<Option<SyncSender<T>>>,
}

impl<T: Send + 'static> Default for Closer<T> {
    fn default() -> Self {
        Closer { queue: None }
    }
}

impl<T: Send + 'static> Closer<T> {
    /// Drops `retired` on the closer's thread, or here if its queue is full or it has none.
    pub fn close(&mut self, retired: T) {
        if let Some(queue) = self.queue.get_or_insert_with(start::<T>) {
            // Full or gone: the error hands it back, dropped here with it.
            let _ = queue.try_send(retired);
        }
    }
}

/// The closer's thread: it drops what arrives until the communicator, which holds the sender,
/// is gone.
fn start<T: Send + 'static>() -> Option<SyncSender<T>> {
    let (tx, rx) = sync_channel::<T>(CLOSING_MAX);
    let spawned = thread::Builder::new().name("shoal-close".into()).spawn(move || rx.into_iter().for_each(drop));
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            log::warn!("no thread to close superseded pools on, closing them in place: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(10);

    /// Says when its drop starts, waits until the test lets it go, then says on which thread it
    /// was dropped.
    struct SlowToClose {
        go: Receiver<()>,
        said: Sender<Option<String>>,
    }

    impl Drop for SlowToClose {
        fn drop(&mut self) {
            let _ = self.said.send(None);
            let _ = self.go.recv_timeout(WAIT);
            let _ = self.said.send(thread::current().name().map(String::from));
        }
    }

    fn slow(said: &Sender<Option<String>>) -> (Sender<()>, SlowToClose) {
        let (go_tx, go) = channel();
        (go_tx, SlowToClose { go, said: said.clone() })
    }

    #[test]
    fn a_slow_close_happens_off_the_callers_thread() {
        let mut closer = Closer::default();
        let (said, heard) = channel();
        let (go, engine) = slow(&said);
        // Dropped in place, `close` would return only when its wait timed out.
        closer.close(engine);
        assert_eq!(heard.recv_timeout(WAIT), Ok(None), "its close started");
        go.send(()).unwrap();
        assert_eq!(heard.recv_timeout(WAIT), Ok(Some("shoal-close".into())));
    }

    #[test]
    fn past_its_queue_the_caller_closes_in_place() {
        let mut closer = Closer::default();
        let (said, heard) = channel();
        let mut gates = Vec::new();
        // One held by the thread, then CLOSING_MAX queued behind it.
        for k in 0..=CLOSING_MAX {
            let (go, engine) = slow(&said);
            gates.push(go);
            closer.close(engine);
            if k == 0 {
                assert_eq!(heard.recv_timeout(WAIT), Ok(None), "the thread holds the first");
            }
        }
        // One more finds no room: dropped here, at once, since it is let go before.
        let (go, engine) = slow(&said);
        go.send(()).unwrap();
        closer.close(engine);
        let here = thread::current().name().map(String::from);
        assert_eq!((heard.try_recv(), heard.try_recv()), (Ok(None), Ok(here)));
        gates.iter().for_each(|g| g.send(()).unwrap());
        let closed: Vec<_> = (0..2 * CLOSING_MAX + 1).filter_map(|_| heard.recv_timeout(WAIT).unwrap()).collect();
        assert_eq!(closed, vec!["shoal-close"; CLOSING_MAX + 1]);
    }
}
