//! Derived groups: [`Communicator::split`] and [`Communicator::new_group`] (`docs/protocol.md`,
//! "Derived groups").
//!
//! A derived group is some members of a communicator's group, chosen by the members themselves
//! in one collective of that group (an all-gather of what each asks for), and admitted by none:
//! its collectives and transfers run over the connections the topology already has, by ranks of
//! its own. Each member names it alike (a hash of the group it came from, its members and how
//! many groups were derived before), so its collectives are numbered apart from every other
//! group's. In each later topology it is those of its members still in the run, in their order.

use crate::error::{Error, Result};
use crate::plane::place;
use crate::tags::SPLIT_TAG;
use crate::Communicator;
use shoal_collective::DType;
use shoal_proto::peer::{Derived, RingPosition};
use shoal_wire::PeerId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What each member brings to a split, as `u64`s: its color (+1; 0: none), its key (its bits),
/// the groups it derived so far, its id, and (for `new_group`) a hash of the ranks it named.
const WORDS: usize = 5;

impl Communicator {
    /// Splits this communicator's group into derived groups, like `MPI_Comm_split`: every member
    /// calls it (it is a collective of the group); those that give the same `color` form one
    /// group, ranked by `key` and then by their rank here; a member that gives no color is in
    /// none and gets `None`. The groups share this communicator's connections: their first
    /// collective opens nothing that the group's own collectives opened already.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`]: the split is one, and on failure (say
    /// [`Error::PeerLost`]) no member has a new group; call it again, all of you.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        self.derive(color, key, 0)
    }

    /// The derived group of the members at `ranks` (this group's ranks), like
    /// `torch.distributed.new_group`: every member of this group calls it with the same ranks
    /// (it is a collective of the group), and those at `ranks` form a group ranked as `ranks`
    /// sorted; the others get `None`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (nothing sent) if a rank is out of the group or named twice,
    /// and on every member if they named different ranks; otherwise as
    /// [`Communicator::split`].
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        let (me, world) = (self.rank().ok_or(Error::NotConnected)?, self.group_world_size().unwrap_or(0));
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len() || sorted.last().is_some_and(|&r| r >= world) {
            return Err(Error::InvalidArgument(format!(
                "new_group({ranks:?}): ranks of a group of {world}, each once"
            )));
        }
        let bytes: Vec<u8> = sorted.iter().flat_map(|&r| (r as u64).to_le_bytes()).collect();
        let named = u64::from_le_bytes(blake3::hash(&bytes).as_bytes()[..8].try_into().expect("8 bytes"));
        let color = sorted.contains(&me).then_some(0);
        // Ranked by their rank here: `key` is ours.
        self.derive(color, me as i64, named.max(1))
    }

    /// The derived group of the members at `ranks` (this group's ranks, in their order), named
    /// `name`, formed without a collective: only those members call it, each with the same
    /// `ranks` and `name` (a name no other subgroup of this group was given, such as
    /// `torch.distributed`'s group name). It runs like a group of [`Communicator::new_group`],
    /// ranked as `ranks`; the members that are not at `ranks` get `None` and need not call it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a rank is out of the group or named twice;
    /// [`Error::NotConnected`] before `connect()`. Members that give different ranks or names
    /// form different groups, whose collectives never meet (each fails at its bound).
    pub fn subgroup(&self, ranks: &[usize], name: &[u8]) -> Result<Option<Communicator>> {
        let position = self.position().ok_or(Error::NotConnected)?;
        let ids = self.member_ids(&position);
        let mut seen = vec![false; ids.len()];
        for &r in ranks {
            if r >= ids.len() || std::mem::replace(&mut seen[r], true) {
                return Err(Error::InvalidArgument(format!(
                    "subgroup({ranks:?}): ranks of a group of {}, each once",
                    ids.len()
                )));
            }
        }
        let peers: Vec<PeerId> = ranks.iter().map(|&r| ids[r]).collect();
        self.subgroup_of(&peers, name)
    }

    /// [`Communicator::subgroup`] of the members with ids `peers`, in that order: for members
    /// that know each other by id (a rendezvous outside shoal told them), not by a rank that a
    /// new topology may change meanwhile.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a peer is not a member of this group or is named twice;
    /// [`Error::NotConnected`] before `connect()`.
    pub fn subgroup_of(&self, peers: &[PeerId], name: &[u8]) -> Result<Option<Communicator>> {
        let position = self.position().ok_or(Error::NotConnected)?;
        let ids = self.member_ids(&position);
        let mut sorted = peers.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != peers.len() || !peers.iter().all(|p| ids.contains(p)) {
            return Err(Error::InvalidArgument(format!("subgroup of {peers:?}: members of this group, each once")));
        }
        let me = position.ring[position.rank].peer;
        if !peers.contains(&me) {
            return Ok(None);
        }
        let members: Arc<[PeerId]> = peers.into();
        let parent = self.derived.as_ref().map_or(0, |d| d.id);
        let id = group_id(&[b"subgroup", &parent.to_le_bytes(), name], &members);
        log::info!("{me}: subgroup {id:#x} of {} members: {members:?}", members.len());
        Ok(Some(Communicator {
            shared: Arc::clone(&self.shared),
            derived: Some(Derived { id, members }),
            derivations: AtomicU64::new(0),
        }))
    }

    /// The split every member asked for (`named`: the hash of `new_group`'s ranks, else 0).
    fn derive(&self, color: Option<u32>, key: i64, named: u64) -> Result<Option<Communicator>> {
        let me = self.peer_id().ok_or(Error::NotConnected)?;
        let mine = [
            color.map_or(0, |c| u64::from(c) + 1),
            key as u64,
            self.derivations.load(Ordering::SeqCst),
            u64::from(me.0),
            named,
        ];
        let world = self.group_world_size().ok_or(Error::NotConnected)?;
        let mut all = vec![0u64; WORDS * world];
        let out: &mut [u8] = bytemuck::cast_slice_mut(&mut all);
        let info = self.all_gather(out, bytemuck::cast_slice(&mine), DType::U64, SPLIT_TAG, None)?;
        let asked: Vec<&[u64]> = all.chunks(WORDS).take(info.world_size).collect();
        if asked.iter().any(|a| a[4] != named) {
            return Err(Error::InvalidArgument("new_group: the members named different ranks".into()));
        }
        // Every member counts the groups derived so far alike: the most any of them derived.
        let round = asked.iter().map(|a| a[2]).max().unwrap_or(0);
        self.derivations.store(round + 1, Ordering::SeqCst);
        let Some(color) = color else { return Ok(None) };
        let mut ours: Vec<(i64, usize, PeerId)> = (asked.iter().enumerate())
            .filter(|(_, a)| a[0] == u64::from(color) + 1)
            .map(|(rank, a)| (a[1] as i64, rank, PeerId(a[3] as u32)))
            .collect();
        ours.sort_unstable();
        let members: Arc<[PeerId]> = ours.into_iter().map(|(_, _, p)| p).collect();
        let parent = self.derived.as_ref().map_or(0, |d| d.id);
        let id = derived_id(parent, round, color, &members);
        log::info!("{me}: derived group {id:#x} of {} members: {members:?}", members.len());
        Ok(Some(Communicator {
            shared: Arc::clone(&self.shared),
            derived: Some(Derived { id, members }),
            derivations: AtomicU64::new(0),
        }))
    }

    /// Refuses `call` on a derived group: it is the whole group's (admission, votes, syncs).
    pub(crate) fn whole_group(&self, call: &str) -> Result<()> {
        match &self.derived {
            None => Ok(()),
            Some(d) => Err(Error::InvalidArgument(format!(
                "{call} on derived group {:#x}: it is a call of the whole group, made on the communicator the group \
                 was derived from",
                d.id
            ))),
        }
    }

    /// The ids of this handle's group's members in the topology of `position`, by their rank.
    fn member_ids(&self, position: &RingPosition) -> Vec<PeerId> {
        match &self.derived {
            None => position.ring.iter().map(|m| m.peer).collect(),
            Some(d) => d.ranks_in(&position.ring).into_iter().map(|r| position.ring[r].peer).collect(),
        }
    }

    /// This handle's group in the topology of `position`: our rank in it, its size, and the
    /// topology's rank of each member by their rank in the group (empty: the whole group).
    pub(crate) fn placed(&self, position: &RingPosition) -> (usize, usize, Vec<usize>) {
        let members = self.derived.as_ref().map_or_else(Vec::new, |d| d.ranks_in(&position.ring));
        let (rank, world) = place(position, &members);
        (rank, world, members)
    }
}

/// The name of the derived group of `members` with `color`, the `round`-th derived from group
/// `parent` (0: the whole group): the same on every member, never 0.
fn derived_id(parent: u64, round: u64, color: u32, members: &[PeerId]) -> u64 {
    group_id(&[&parent.to_le_bytes(), &round.to_le_bytes(), &color.to_le_bytes()], members)
}

/// A derived group's name: a hash of what names it and of its members, never 0.
fn group_id(parts: &[&[u8]], members: &[PeerId]) -> u64 {
    let mut h = blake3::Hasher::new();
    for part in parts {
        h.update(part);
    }
    for p in members {
        h.update(&p.0.to_le_bytes());
    }
    let id = u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"));
    id.max(1)
}
