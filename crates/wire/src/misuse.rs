//! Calls that can never complete together, named as types: which peers made which call, and where
//! among their calls (`docs/protocol.md`, "No call waits for a call that will never come"). The
//! master and the peers build a [`Misuse`] where they find one, send it in the messages that end
//! the calls, and every caller's usage error reads it; none of it is parsed from text.

use crate::codec::{Reader, Writer};
use crate::{Epoch, OpHeader, PeerId, Vote, WireError, MAX_MEMBERS};
use std::fmt;

/// An API call, as a usage error names it. Codes are never renumbered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Api {
    /// `all_reduce`.
    AllReduce = 1,
    /// `all_gather`.
    AllGather = 2,
    /// `reduce_scatter`.
    ReduceScatter = 3,
    /// `broadcast`.
    Broadcast = 4,
    /// `barrier`.
    Barrier = 5,
    /// `update_topology`.
    UpdateTopology = 6,
    /// `peers_pending`.
    PeersPending = 7,
    /// `sync_shared_state`.
    SyncSharedState = 8,
    /// `optimize_topology` (its barrier, then its vote).
    OptimizeTopology = 9,
    /// `connect`.
    Connect = 10,
}

impl Api {
    const ALL: [Api; 10] = [
        Api::AllReduce,
        Api::AllGather,
        Api::ReduceScatter,
        Api::Broadcast,
        Api::Barrier,
        Api::UpdateTopology,
        Api::PeersPending,
        Api::SyncSharedState,
        Api::OptimizeTopology,
        Api::Connect,
    ];

    /// The call of code `code`.
    pub fn from_code(code: u8) -> Result<Self, WireError> {
        Api::ALL
            .into_iter()
            .find(|a| *a as u8 == code)
            .ok_or(WireError::InvalidValue { field: "call", value: code.into() })
    }

    /// The call's name, as users know it.
    pub fn name(self) -> &'static str {
        match self {
            Api::AllReduce => "all_reduce",
            Api::AllGather => "all_gather",
            Api::ReduceScatter => "reduce_scatter",
            Api::Broadcast => "broadcast",
            Api::Barrier => "barrier",
            Api::UpdateTopology => "update_topology",
            Api::PeersPending => "peers_pending",
            Api::SyncSharedState => "sync_shared_state",
            Api::OptimizeTopology => "optimize_topology",
            Api::Connect => "connect",
        }
    }

    /// The call of name `name`, if it is one.
    pub fn named(name: &str) -> Option<Self> {
        Api::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Whether the call starts with a collective (the data plane's, invisible to the master).
    pub fn is_collective(self) -> bool {
        !matches!(self, Api::UpdateTopology | Api::PeersPending | Api::SyncSharedState | Api::Connect)
    }
}

impl fmt::Display for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<Vote> for Api {
    fn from(vote: Vote) -> Self {
        match vote {
            Vote::UpdateTopology => Api::UpdateTopology,
            Vote::PeersPending => Api::PeersPending,
            Vote::SyncSharedState => Api::SyncSharedState,
        }
    }
}

/// Where a call stands among its peer's calls: the committed topology, and the collectives the
/// peer had started in it (a collective's own number, for a collective).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    /// The topology in force.
    pub epoch: Epoch,
    /// Collectives started in it before the call (a vote), or the collective's number.
    pub collectives: u64,
}

/// One call, as a usage error names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// A call of the API, where it stood if that matters to the error.
    Api {
        /// The call.
        api: Api,
        /// Where it stood.
        at: Option<Point>,
    },
    /// A tagged transfer.
    Transfer {
        /// A send (else a receive).
        send: bool,
        /// The other end.
        peer: PeerId,
        /// Its tag.
        tag: u64,
    },
}

impl Call {
    /// `api`, wherever it stood.
    pub fn api(api: impl Into<Api>) -> Self {
        Call::Api { api: api.into(), at: None }
    }

    /// The API call it is: `None` for a tagged transfer.
    pub fn of_api(&self) -> Option<Api> {
        match self {
            Call::Api { api, .. } => Some(*api),
            Call::Transfer { .. } => None,
        }
    }

    fn encode(&self, w: &mut Writer) {
        match self {
            Call::Api { api, at } => {
                w.u8(*api as u8);
                w.bool(at.is_some());
                let at = at.unwrap_or(Point { epoch: Epoch(0), collectives: 0 });
                w.u64(at.epoch.0);
                w.u64(at.collectives);
            }
            Call::Transfer { send, peer, tag } => {
                w.u8(TRANSFER);
                w.bool(*send);
                w.u32(peer.0);
                w.u64(*tag);
            }
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(match r.u8()? {
            TRANSFER => Call::Transfer { send: r.bool("send")?, peer: PeerId(r.u32()?), tag: r.u64()? },
            code => {
                let api = Api::from_code(code)?;
                let (known, epoch, collectives) = (r.bool("point")?, Epoch(r.u64()?), r.u64()?);
                Call::Api { api, at: known.then_some(Point { epoch, collectives }) }
            }
        })
    }
}

/// The code of [`Call::Transfer`] where an [`Api`]'s code stands.
const TRANSFER: u8 = 0x80;

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Call::Api { api, at: None } => f.write_str(api.name()),
            Call::Api { api, at: Some(at) } if api.is_collective() => {
                write!(f, "{} (collective number {} of topology {})", api.name(), at.collectives, at.epoch.0)
            }
            Call::Api { api, at: Some(at) } => {
                write!(f, "{} after {} collectives of topology {}", api.name(), at.collectives, at.epoch.0)
            }
            Call::Transfer { send: true, peer, tag } => write!(f, "send to {peer} (p2p, tag {tag})"),
            Call::Transfer { send: false, peer, tag } => write!(f, "recv from {peer} (p2p, tag {tag})"),
        }
    }
}

/// Peers that made the same call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Called {
    /// Who made it: at least one, in increasing order.
    pub peers: Vec<PeerId>,
    /// The call.
    pub call: Call,
}

impl Called {
    /// `call`, made by `peers`.
    ///
    /// # Panics
    /// If `peers` is empty or longer than [`MAX_MEMBERS`]: a misuse names who made each call.
    pub fn new(peers: impl IntoIterator<Item = PeerId>, call: Call) -> Self {
        let mut peers: Vec<PeerId> = peers.into_iter().collect();
        peers.sort_unstable();
        peers.dedup();
        assert!(!peers.is_empty() && peers.len() <= MAX_MEMBERS, "a call is made by 1 to {MAX_MEMBERS} peers");
        Called { peers, call }
    }

    fn encode(&self, w: &mut Writer) {
        w.u32(self.peers.len() as u32);
        for p in &self.peers {
            w.u32(p.0);
        }
        self.call.encode(w);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let n = r.count(MAX_MEMBERS, 4)?;
        if n == 0 {
            return Err(WireError::InvalidValue { field: "callers", value: 0 });
        }
        let peers = (0..n).map(|_| r.u32().map(PeerId)).collect::<Result<Vec<_>, _>>()?;
        if !peers.is_sorted_by(|a, b| a < b) {
            return Err(WireError::InvalidValue { field: "callers' order", value: n as u64 });
        }
        Ok(Called { peers, call: Call::decode(r)? })
    }
}

/// Peers named in a usage error before the rest are counted: a group's whole ring would make an
/// unreadable message.
const NAMED_PEERS: usize = 8;

impl fmt::Display for Called {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.peers.iter().take(NAMED_PEERS).enumerate() {
            write!(f, "{}{p}", if i == 0 { "" } else { ", " })?;
        }
        if self.peers.len() > NAMED_PEERS {
            write!(f, " and {} more", self.peers.len() - NAMED_PEERS)?;
        }
        write!(f, " called {}", self.call)
    }
}

/// Calls that can never complete together: every call they are part of ends with this error
/// (`UsageError` in Python), on every peer that made one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misuse {
    /// The call that ends with it (where one peer found the misuse: its own, or the waiter's).
    pub ours: Called,
    /// The call it can never complete with.
    pub theirs: Called,
    /// `theirs` had ended already, as calls that cannot complete together, when `ours` was made.
    pub settled: bool,
}

impl Misuse {
    /// `ours` can never complete with `theirs`.
    ///
    /// # Panics
    /// If both are the same call of the same peers: that is no misuse.
    pub fn new(ours: Called, theirs: Called) -> Self {
        assert!(ours != theirs, "a call cannot be misused against itself: {ours}");
        Misuse { ours, theirs, settled: false }
    }

    /// As [`Misuse::new`], where `theirs` had ended already as calls that cannot complete together.
    pub fn settled(ours: Called, theirs: Called) -> Self {
        Misuse { settled: true, ..Misuse::new(ours, theirs) }
    }

    /// Every call it names, with the peers that made it.
    pub fn calls(&self) -> [&Called; 2] {
        [&self.ours, &self.theirs]
    }

    /// Whether it names `api` as made by some peer.
    pub fn names(&self, api: Api) -> bool {
        self.calls().iter().any(|c| c.call.of_api() == Some(api))
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        self.ours.encode(w);
        self.theirs.encode(w);
        w.bool(self.settled);
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let (ours, theirs, settled) = (Called::decode(r)?, Called::decode(r)?, r.bool("settled")?);
        if ours == theirs {
            return Err(WireError::InvalidValue { field: "misuse", value: 0 });
        }
        Ok(Misuse { ours, theirs, settled })
    }
}

impl fmt::Display for Misuse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let settled = if self.settled { ", which ended as calls that cannot complete together" } else { "" };
        write!(
            f,
            "{} while {}{settled}: every accepted peer must make the same calls in the same order",
            self.ours, self.theirs
        )
    }
}

/// Two members' calls that were to be one collective and differ, each as its data frames name
/// it: found by the first member at the other's first frame, and told by the master to every
/// participant, so each can say which peer called what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// The member that found the difference, and its call.
    pub ours: (PeerId, OpHeader),
    /// The member whose frame differed, and its call.
    pub theirs: (PeerId, OpHeader),
}

impl Mismatch {
    /// `ours` (a member and its call) found `theirs` different.
    pub fn new(ours: (PeerId, OpHeader), theirs: (PeerId, OpHeader)) -> Self {
        assert!(ours.0 != theirs.0 && ours.1 != theirs.1, "a mismatch is two members' different calls");
        Mismatch { ours, theirs }
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        for (peer, call) in [&self.ours, &self.theirs] {
            w.u32(peer.0);
            call.encode(w);
        }
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let ours = (PeerId(r.u32()?), OpHeader::decode(r)?);
        let theirs = (PeerId(r.u32()?), OpHeader::decode(r)?);
        if ours.0 == theirs.0 || ours.1 == theirs.1 {
            return Err(WireError::InvalidValue { field: "mismatch", value: u64::from(ours.0 .0) });
        }
        Ok(Mismatch { ours, theirs })
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ((p, ours), (q, theirs)) = (self.ours, self.theirs);
        write!(f, "{p} called {ours}; {q} called {theirs}")
    }
}

/// Why something ended: calls that can never complete together, named ([`Misuse`]), calls of one
/// collective that differ ([`Mismatch`]), or an account in words (a lost peer, states that differ,
/// a buffer that does not fit its group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// An account, at most [`MAX_STRING_BYTES`](crate::MAX_STRING_BYTES) bytes (longer ones are
    /// cut at a character boundary).
    Text(String),
    /// Calls that can never complete together.
    Misuse(Box<Misuse>),
    /// Calls of one collective that differ.
    Mismatch(Box<Mismatch>),
}

impl Reason {
    /// An account in words, cut to fit a message.
    pub fn text(reason: impl Into<String>) -> Self {
        Reason::Text(crate::truncate(reason.into(), crate::MAX_STRING_BYTES))
    }

    /// The misuse it names, if it is one.
    pub fn misuse(&self) -> Option<&Misuse> {
        match self {
            Reason::Misuse(m) => Some(m),
            Reason::Text(_) | Reason::Mismatch(_) => None,
        }
    }

    /// The mismatch it names, if it is one.
    pub fn mismatch(&self) -> Option<&Mismatch> {
        match self {
            Reason::Mismatch(m) => Some(m),
            Reason::Text(_) | Reason::Misuse(_) => None,
        }
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        match self {
            Reason::Text(s) => {
                w.u8(0);
                w.str(s);
            }
            Reason::Misuse(m) => {
                w.u8(1);
                m.encode(w);
            }
            Reason::Mismatch(m) => {
                w.u8(2);
                m.encode(w);
            }
        }
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        match r.u8()? {
            0 => Ok(Reason::Text(r.str()?)),
            1 => Ok(Reason::Misuse(Box::new(Misuse::decode(r)?))),
            2 => Ok(Reason::Mismatch(Box::new(Mismatch::decode(r)?))),
            value => Err(WireError::InvalidValue { field: "reason", value: value.into() }),
        }
    }
}

impl From<Misuse> for Reason {
    fn from(m: Misuse) -> Self {
        Reason::Misuse(Box::new(m))
    }
}

impl From<Mismatch> for Reason {
    fn from(m: Mismatch) -> Self {
        Reason::Mismatch(Box::new(m))
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Text(s) => f.write_str(s),
            Reason::Misuse(m) => m.fmt(f),
            Reason::Mismatch(m) => m.fmt(f),
        }
    }
}

#[cfg(test)]
pub(crate) mod strategy {
    use super::*;
    use proptest::prelude::*;

    fn call() -> impl Strategy<Value = Call> {
        prop_oneof![
            (prop::sample::select(Api::ALL.to_vec()), proptest::option::of((any::<u64>(), any::<u64>()))).prop_map(
                |(api, at)| Call::Api { api, at: at.map(|(e, collectives)| Point { epoch: Epoch(e), collectives }) }
            ),
            (any::<bool>(), any::<u32>(), any::<u64>()).prop_map(|(send, p, tag)| Call::Transfer {
                send,
                peer: PeerId(p),
                tag
            }),
        ]
    }

    fn called() -> impl Strategy<Value = Called> {
        (prop::collection::vec(any::<u32>(), 1..12), call())
            .prop_map(|(peers, call)| Called::new(peers.into_iter().map(PeerId), call))
    }

    pub fn misuse() -> impl Strategy<Value = Misuse> {
        (called(), called(), any::<bool>())
            .prop_filter("two calls", |(a, b, _)| a != b)
            .prop_map(|(ours, theirs, settled)| Misuse { ours, theirs, settled })
    }

    pub fn op_header() -> impl Strategy<Value = OpHeader> {
        let codes = (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>());
        let numbers = (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>());
        (codes, numbers, any::<u32>(), any::<u16>()).prop_map(
            |((collective, algorithm, dtype, op, quantization), (epoch, derived, seq, tag, count), root, block)| {
                OpHeader {
                    collective,
                    algorithm,
                    epoch: Epoch(epoch),
                    derived,
                    seq,
                    tag,
                    dtype,
                    op,
                    count,
                    root,
                    quantization,
                    block,
                }
            },
        )
    }

    pub fn mismatch() -> impl Strategy<Value = Mismatch> {
        (any::<u32>(), op_header(), any::<u32>(), op_header())
            .prop_filter("two members' different calls", |(p, a, q, b)| p != q && a != b)
            .prop_map(|(p, a, q, b)| Mismatch::new((PeerId(p), a), (PeerId(q), b)))
    }

    /// Any reason a message may carry where a mismatch cannot be one.
    pub fn reason() -> impl Strategy<Value = Reason> {
        prop_oneof![".{0,300}".prop_map(Reason::text), misuse().prop_map(Reason::from)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vote_at(peer: u32, api: Api, epoch: u64, collectives: u64) -> Called {
        Called::new([PeerId(peer)], Call::Api { api, at: Some(Point { epoch: Epoch(epoch), collectives }) })
    }

    #[test]
    fn a_misuse_reads_as_who_called_what_where() {
        let m = Misuse::new(vote_at(1, Api::UpdateTopology, 2, 3), vote_at(0, Api::AllReduce, 2, 3));
        assert_eq!(
            m.to_string(),
            "peer#1 called update_topology after 3 collectives of topology 2 while peer#0 called all_reduce \
             (collective number 3 of topology 2): every accepted peer must make the same calls in the same order"
        );
        let theirs = Called::new((0..10).rev().map(PeerId), Call::api(Vote::SyncSharedState));
        let send = Called::new([PeerId(12)], Call::Transfer { send: true, peer: PeerId(3), tag: 7 });
        let m = Misuse::settled(send, theirs);
        assert!(m.to_string().starts_with(
            "peer#12 called send to peer#3 (p2p, tag 7) while peer#0, peer#1, peer#2, peer#3, peer#4, peer#5, \
             peer#6, peer#7 and 2 more called sync_shared_state, which ended as"
        ));
        assert!(m.names(Api::SyncSharedState) && !m.names(Api::PeersPending));
    }

    /// A mismatch names two members' different calls; one member, or one call, is no mismatch,
    /// and a failure carries one exactly when it is a mismatch, concerning the other member.
    #[test]
    fn a_mismatch_is_two_members_different_calls_on_both_sides_of_the_wire() {
        let call = OpHeader {
            collective: 1,
            algorithm: 1,
            epoch: Epoch(2),
            derived: 0,
            seq: 7,
            tag: 3,
            dtype: 9,
            op: 1,
            count: 10,
            root: 0,
            quantization: 0,
            block: 0,
        };
        let m = Mismatch::new((PeerId(1), call), (PeerId(2), OpHeader { count: 11, ..call }));
        let mut w = Writer::with_capacity(96);
        m.encode(&mut w);
        assert_eq!(Mismatch::decode(&mut Reader::new(w.as_bytes())), Ok(m));
        assert!(m.to_string().starts_with("peer#1 called collective 1(count=10,"), "{m}");
        for bad in [Mismatch { theirs: (PeerId(1), m.theirs.1), ..m }, Mismatch { theirs: (PeerId(2), call), ..m }] {
            let mut w = Writer::with_capacity(96);
            bad.encode(&mut w);
            assert_eq!(
                Mismatch::decode(&mut Reader::new(w.as_bytes())),
                Err(WireError::InvalidValue { field: "mismatch", value: 1 })
            );
        }
        let words = crate::OpFailure { kind: crate::FailureKind::Mismatch, peer: PeerId(2), reason: Reason::text("x") };
        let other = crate::OpFailure { peer: PeerId(1), ..crate::OpFailure::mismatch(m) };
        for failure in [words, other] {
            let aborted = crate::Message::OpAborted { epoch: Epoch(2), derived: 0, seq: 7, failure };
            let bytes = crate::encode_frame(crate::SessionId(1), &aborted).unwrap();
            assert!(crate::decode_frame(&bytes).is_err(), "a mismatch's failure without its calls");
        }
    }

    #[test]
    fn a_misuse_that_names_no_one_or_one_call_twice_is_malformed() {
        let mut w = Writer::with_capacity(64);
        w.u32(0);
        assert_eq!(
            Misuse::decode(&mut Reader::new(w.as_bytes())),
            Err(WireError::InvalidValue { field: "callers", value: 0 })
        );
        let ours = vote_at(1, Api::PeersPending, 1, 0);
        let mut w = Writer::with_capacity(64);
        Misuse { ours: ours.clone(), theirs: ours, settled: false }.encode(&mut w);
        assert_eq!(
            Misuse::decode(&mut Reader::new(w.as_bytes())),
            Err(WireError::InvalidValue { field: "misuse", value: 0 })
        );
        let mut w = Writer::with_capacity(64);
        w.u32(2);
        w.u32(5);
        w.u32(5);
        assert_eq!(
            Called::decode(&mut Reader::new(w.as_bytes())),
            Err(WireError::InvalidValue { field: "callers' order", value: 2 })
        );
    }

    #[test]
    fn every_api_code_names_its_call_both_ways() {
        for api in Api::ALL {
            assert_eq!(Api::from_code(api as u8), Ok(api));
            assert_eq!(Api::named(api.name()), Some(api));
            assert_ne!(api as u8, TRANSFER);
        }
        assert_eq!(Api::from_code(0), Err(WireError::InvalidValue { field: "call", value: 0 }));
    }
}
