//! How many connections a listener lets greet at once: in all and from one address. A stranger
//! who opens connections by the thousand (or trickles bytes on each) holds at most its address's
//! share, and honest dialers from elsewhere still get in; a connection's pass is given back when
//! its greeting ends, however it ends.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// The connections a [`Gate`] holds, and why it refused one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Full {
    /// As many connections as the gate holds in all are greeting.
    #[error("{0} connections are greeting already")]
    Total(usize),
    /// As many as it holds from one address are greeting from this one.
    #[error("{1} connections from {0} are greeting already")]
    Source(IpAddr, usize),
}

/// Counts greeting connections, in all and per source address, against caps.
#[derive(Debug)]
pub struct Gate {
    total: usize,
    per_source: usize,
    /// Addresses that may take `reserve` places past `total`: where the run's members were, so
    /// strangers filling the gate cannot crowd them out when they come back.
    trusted: HashSet<IpAddr>,
    reserve: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

impl Gate {
    /// A gate for at most `total` connections, `per_source` of them from one address.
    pub fn new(total: usize, per_source: usize) -> Arc<Gate> {
        Gate::trusting(total, per_source, HashSet::new(), 0)
    }

    /// As [`Gate::new`], with `reserve` more places that only connections from `trusted`
    /// addresses may take.
    pub fn trusting(total: usize, per_source: usize, trusted: HashSet<IpAddr>, reserve: usize) -> Arc<Gate> {
        assert!(per_source > 0 && per_source <= total, "a gate that holds nothing refuses everyone");
        Arc::new(Gate { total, per_source, trusted, reserve, held: Mutex::default() })
    }

    /// A pass for a connection from `from`, given back when dropped; or why there is none.
    ///
    /// # Errors
    /// [`Full`] if the gate holds its cap in all or from `from`.
    pub fn enter(self: &Arc<Self>, from: IpAddr) -> Result<Pass, Full> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let cap = self.total + if self.trusted.contains(&from) { self.reserve } else { 0 };
        if held.total >= cap {
            return Err(Full::Total(held.total));
        }
        let there = held.by_source.entry(from).or_insert(0);
        if *there >= self.per_source {
            return Err(Full::Source(from, *there));
        }
        *there += 1;
        held.total += 1;
        debug_assert!(held.total <= self.total + self.reserve && held.by_source.values().sum::<usize>() == held.total);
        Ok(Pass { gate: Arc::clone(self), from })
    }

    /// Whether no connection, from wherever, could enter now: a listener then leaves the next
    /// ones in its accept queue (where the kernel holds them, or has their dialers send their
    /// SYNs again) rather than take them only to close them.
    pub fn full(&self) -> bool {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).total >= self.total + self.reserve
    }

    /// Connections holding a pass now.
    pub fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).total
    }
}

/// One connection's place in a [`Gate`], until dropped.
#[derive(Debug)]
pub struct Pass {
    gate: Arc<Gate>,
    from: IpAddr,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut held = self.gate.held.lock().unwrap_or_else(PoisonError::into_inner);
        let there = held.by_source.get_mut(&self.from).expect("a pass's source is counted");
        *there -= 1;
        if *there == 0 {
            held.by_source.remove(&self.from);
        }
        held.total -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_holds_its_share_and_others_still_enter() {
        let gate = Gate::new(5, 2);
        let (a, b, c): (IpAddr, IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap());
        let first: Vec<Pass> = (0..2).map(|_| gate.enter(a).unwrap()).collect();
        assert_eq!(gate.enter(a).unwrap_err(), Full::Source(a, 2));
        let mut others: Vec<Pass> = [b, b, c].iter().map(|&ip| gate.enter(ip).unwrap()).collect();
        assert_eq!(gate.enter(c).unwrap_err(), Full::Total(5));
        others.pop();
        assert_eq!(gate.held(), 4);
        let again = gate.enter(c).unwrap();
        drop(first);
        assert_eq!(gate.held(), 3);
        let back = gate.enter(a).unwrap();
        assert_eq!(gate.enter(a).map(drop), Ok(()), "a's share is free again");
        drop((again, back, others));
        assert_eq!(gate.held(), 0);
    }

    #[test]
    fn trusted_addresses_get_in_past_a_full_gate() {
        let (member, stranger, other): (IpAddr, IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap());
        let gate = Gate::trusting(2, 2, HashSet::from([member]), 1);
        let _full: Vec<Pass> = (0..2).map(|_| gate.enter(stranger).unwrap()).collect();
        assert_eq!(gate.enter(other).unwrap_err(), Full::Total(2));
        let _back = gate.enter(member).unwrap();
        assert_eq!(gate.enter(member).unwrap_err(), Full::Total(3), "the reserve is spent");
    }
}
