//! Tagged point-to-point transfers: [`Communicator::send`], [`Communicator::recv`],
//! [`Communicator::recv_any`] and their non-blocking forms, matched by (member, tag) in any order,
//! beside the collectives; several with one tag in the order each side made them.
//!
//! A transfer concerns two members and needs no agreement: the master plays no part. The engine
//! runs it over the link to its member (`engine/p2p.rs`: offer, answer, parts straight into the
//! receiver's buffer); this module registers it, and ends it where the engine cannot tell: its
//! bound passed, the master removed the member (frozen or cut off: its streams never close), or a
//! new topology replaced the one it runs in.

use crate::communicator::Work;
use crate::driver::Connected;
use crate::error::{Error, Result, Usage};
use crate::plane::{DataPlane, Owner, Transfer, TransferCall};
use crate::{Communicator, Info};
use shoal_collective::DType;
use shoal_engine::{Direction, End, RawBuf, TransferSpec};
use shoal_proto::peer::CallId;
use shoal_wire::PeerId;
use std::time::Instant;

impl Communicator {
    /// Sends `buf` (elements of `dtype`) to member `peer` of our group, matched there by a
    /// [`Communicator::recv`] from us with the same `tag`, in any order with other transfers
    /// and collectives. Returns once the receiver holds every byte: both ends end alike, unless
    /// one is removed from the run (`docs/protocol.md`, "A transfer's outcome when its links
    /// fail").
    ///
    /// Several sends to `peer` with one tag may be in flight: its receives with that tag take them
    /// in the order they were made (MPI's and NCCL's "non-overtaking" rule).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (nothing sent) for a bad buffer or rank; [`Error::Misuse`] if the
    /// other end's call can never let it complete; [`Error::CollectiveMismatch`] on both ends if the
    /// receive's count or dtype differs; [`Error::PeerLost`] if `peer` dies, freezes or leaves,
    /// or the topology changes, first (retryable: ranks may have changed); [`Error::Timeout`].
    pub fn send(&self, buf: &[u8], dtype: DType, peer: usize, tag: u64) -> Result<Info> {
        user_tag(tag)?;
        crate::communicator::check_buffer(buf, dtype)?;
        // The engine only reads a send's buffer.
        let raw = RawBuf::of_shared(buf);
        self.transfer(raw, None, Direction::Send, dtype, Some(peer), tag)
    }

    /// Receives into `buf` what member `peer` sends us with [`Communicator::send`] with `tag`:
    /// the same count and dtype, or both ends fail. The bytes go straight into `buf`.
    ///
    /// # Errors
    /// As [`Communicator::send`]. A failed receive may leave `buf` partly written.
    pub fn recv(&self, buf: &mut [u8], dtype: DType, peer: usize, tag: u64) -> Result<Info> {
        user_tag(tag)?;
        crate::communicator::check_buffer(buf, dtype)?;
        self.transfer(RawBuf::new(buf), None, Direction::Recv, dtype, Some(peer), tag)
    }

    /// Receives into `buf` what the first member of our group to send us with `tag` sends
    /// (torch's `recv` without `src`, MPI's `MPI_ANY_SOURCE`): [`Info::peer`] names it. Sends
    /// that arrived before it are taken in the order they came, each member's in the order it
    /// made them; a receive posted earlier, from that member or from any, takes its send first.
    ///
    /// It waits on every other member: once each says its call can never send to us (it waits
    /// in a vote or collective for ours), it ends with [`Error::Misuse`]; their calls go on.
    ///
    /// # Errors
    /// As [`Communicator::recv`]; [`Error::InvalidArgument`] in a group of one.
    pub fn recv_any(&self, buf: &mut [u8], dtype: DType, tag: u64) -> Result<Info> {
        user_tag(tag)?;
        crate::communicator::check_buffer(buf, dtype)?;
        self.transfer(RawBuf::new(buf), None, Direction::Recv, dtype, None, tag)
    }

    /// Starts [`Communicator::send`] and returns at once: [`Communicator::wait`] for it. Up to
    /// any number of transfers move at once, each to a member with a tag of its own.
    ///
    /// # Errors
    /// As [`Communicator::send`] for a bad buffer, rank or tag.
    pub fn isend<B>(&self, buf: B, dtype: DType, peer: usize, tag: u64) -> Result<Work<B>>
    where
        B: AsRef<[u8]> + Send + 'static,
    {
        user_tag(tag)?;
        crate::communicator::check_buffer(buf.as_ref(), dtype)?;
        let owned = Box::new(buf);
        let raw = RawBuf::of_shared((*owned).as_ref());
        self.start_transfer(raw, owned, Direction::Send, dtype, Some(peer), tag)
    }

    /// Starts [`Communicator::recv`] into `buf` and returns at once: [`Communicator::wait`] for
    /// it, then [`Work::into_buffer`] gives the buffer back.
    ///
    /// # Errors
    /// As [`Communicator::isend`].
    pub fn irecv<B>(&self, buf: B, dtype: DType, peer: usize, tag: u64) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        self.start_recv(buf, dtype, Some(peer), tag)
    }

    /// Starts [`Communicator::recv_any`] into `buf` and returns at once, as
    /// [`Communicator::irecv`].
    ///
    /// # Errors
    /// As [`Communicator::irecv`]; [`Error::InvalidArgument`] in a group of one.
    pub fn irecv_any<B>(&self, buf: B, dtype: DType, tag: u64) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        self.start_recv(buf, dtype, None, tag)
    }

    fn start_recv<B>(&self, buf: B, dtype: DType, peer: Option<usize>, tag: u64) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        user_tag(tag)?;
        let mut owned = Box::new(buf);
        crate::communicator::check_buffer((*owned).as_mut(), dtype)?;
        let raw = RawBuf::new((*owned).as_mut());
        self.start_transfer(raw, owned, Direction::Recv, dtype, peer, tag)
    }

    pub(crate) fn transfer(
        &self,
        buf: RawBuf,
        owner: Option<Owner>,
        direction: Direction,
        dtype: DType,
        peer: Option<usize>,
        tag: u64,
    ) -> Result<Info> {
        let c = self.connected()?;
        let mut data = self.lock_data();
        let call = self.post_transfer(&c, &mut data, buf, owner, direction, dtype, peer, tag)?;
        // The buffer is borrowed for this call only: it must be out of the engine when we return.
        self.finish_call(&c, data, call, direction.name())
    }

    pub(crate) fn start_transfer<B: Send + 'static>(
        &self,
        buf: RawBuf,
        owned: Box<B>,
        direction: Direction,
        dtype: DType,
        peer: Option<usize>,
        tag: u64,
    ) -> Result<Work<B>> {
        let c = self.connected()?;
        let mut data = self.lock_data();
        let call = self.post_transfer(&c, &mut data, buf, Some(owned), direction, dtype, peer, tag)?;
        Ok(self.leave_running(&c, data, call, direction.name()))
    }

    /// Registers a transfer with member `rank` (a receive: `None`, any member) and posts it to
    /// the engine of the topology in force.
    #[allow(clippy::too_many_arguments)]
    fn post_transfer(
        &self,
        c: &Connected,
        data: &mut DataPlane,
        buf: RawBuf,
        owner: Option<Owner>,
        direction: Direction,
        dtype: DType,
        rank: Option<usize>,
        tag: u64,
    ) -> Result<CallId> {
        let (Some(position), Some(exec)) = (data.position.as_ref(), data.exec.as_mut()) else {
            return Err(Error::NotConnected);
        };
        // A derived group's ranks name its members.
        let (ours, world, members) = self.placed(position);
        let (end, to, peer) = match rank {
            Some(rank) if rank >= world || rank == ours => {
                let (call, epoch) = (direction.name(), position.epoch.0);
                return Err(Usage::RankUnfit { call, rank, ours: rank == ours, world, epoch }.into());
            }
            Some(rank) => {
                let to = members.get(rank).copied().unwrap_or(rank);
                (End::Member(to), Some(to), position.ring[to].peer)
            }
            None if world < 2 => {
                return Err(Error::InvalidArgument("recv from any member in a group of one".into()));
            }
            None => {
                let all = if members.is_empty() { (0..world).collect() } else { members.clone() };
                (End::AnyOf(all.into_iter().filter(|&r| r != position.rank).collect()), None, PeerId::ANY)
            }
        };
        let transfer = shoal_wire::Call::Transfer { send: direction == Direction::Send, peer, tag };
        if let Some(misuse) = c.control.own_input(|p, _| p.p2p_settled(transfer)) {
            log::warn!("{misuse}");
            return Err(Error::Misuse(misuse));
        }
        let call = c.control.own_input(|p, _| p.reserve_call());
        let chunk_bytes = self.config.chunk_bytes.unwrap_or(crate::DEFAULT_CHUNK_BYTES);
        data.stats.started(call, direction.name(), tag, buf.len() as u64);
        exec.post_transfer(call.0, TransferSpec { direction, peer: end, tag, dtype, buf, chunk_bytes });
        let started = Instant::now();
        let kept = TransferCall { buf, owner, dtype, world, members, rank: ours, started };
        let send = direction == Direction::Send;
        let transfer = Transfer::new(peer, to, send, tag, position.epoch, started + self.config.timeout, kept);
        data.calls.transfers.start(call, transfer);
        Ok(call)
    }
}

/// Refuses a tag of the library's own range ([`crate::PROBE_TAGS`]) in an application's transfer.
fn user_tag(tag: u64) -> Result<()> {
    if tag >= crate::PROBE_TAGS {
        return Err(Error::InvalidArgument(format!("tag {tag}: tags from 2**63 up are reserved for shoal itself")));
    }
    Ok(())
}
