//! How errors and logs name a call: the API verb a collective is part of, and a call as its
//! frames describe it ([`Described`]), which a mismatch names on both sides.

use shoal_collective::{Algorithm, CollectiveKind, DType, Format, ReduceOp};
use shoal_wire::{Api, OpHeader};
use std::fmt;

/// The call collective `header` is part of, as its caller knows it.
pub(crate) fn verb_of(header: &OpHeader) -> Option<Api> {
    CollectiveKind::from_code(header.collective).map(|k| verb(k, header.tag))
}

/// The call a collective of `kind` with `tag` is part of, as its caller knows it.
pub(crate) fn verb(kind: CollectiveKind, tag: u64) -> Api {
    match kind {
        // The barrier that `optimize_topology` starts with.
        CollectiveKind::Barrier if tag == crate::tags::BARRIER_TAG => Api::OptimizeTopology,
        CollectiveKind::Barrier => Api::Barrier,
        CollectiveKind::AllReduce => Api::AllReduce,
        CollectiveKind::AllGather => Api::AllGather,
        CollectiveKind::ReduceScatter => Api::ReduceScatter,
        CollectiveKind::Broadcast => Api::Broadcast,
    }
}

/// A call as its data frames describe it: what a peer compares with its own call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Described {
    /// A collective, by its whole header: kind, count, dtype, op, root, quantization, tag,
    /// algorithm, topology and number.
    Collective(OpHeader),
    /// One end of a tagged transfer.
    Transfer {
        /// A send (else a receive).
        send: bool,
        /// Elements.
        count: u64,
        /// The elements' type, by wire code.
        dtype: u8,
        /// The application's tag.
        tag: u64,
        /// The rank of the member at the other end, where it is our call.
        rank: Option<usize>,
    },
}

impl fmt::Display for Described {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Described::Collective(h) => {
                let dtype = DType::from_code(h.dtype).map_or("?", DType::name);
                let op = ReduceOp::from_code(h.op).map_or("?", ReduceOp::name);
                let kind = verb_of(&h).map_or("collective", Api::name);
                let algorithm = Algorithm::from_code(h.algorithm).map_or("?", Algorithm::name);
                write!(f, "{kind}(count={}, dtype={dtype}, op={op}", h.count)?;
                if h.collective == CollectiveKind::Broadcast.code() {
                    write!(f, ", root={}", h.root)?;
                }
                match Format::from_code(h.quantization) {
                    None => {}
                    Some(q) if q.is_blockwise() => write!(f, ", quantization={}/{}", q.name(), h.block)?,
                    Some(q) => write!(f, ", quantization={}", q.name())?,
                }
                let (tag, epoch, seq) = (h.tag, h.epoch.0, h.seq);
                write!(f, ", tag={tag}, algorithm={algorithm}, topology={epoch}, number={seq})")
            }
            Described::Transfer { send, count, dtype, tag, rank } => {
                let (verb, dtype) =
                    (shoal_proto::peer::transfer_verb(send), DType::from_code(dtype).map_or("?", DType::name));
                write!(f, "{verb}(count={count}, dtype={dtype}, tag={tag})")?;
                match rank {
                    Some(rank) => write!(f, " {} rank {rank}", if send { "to" } else { "from" }),
                    None => Ok(()),
                }
            }
        }
    }
}
