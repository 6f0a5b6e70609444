//! The header of a data frame: what opens every chunk, token and tagged-transfer frame on the
//! streams between peers (`docs/wire.md`, "Data frames"). The engine writes the body straight
//! from (and reads it straight into) the caller's buffer; this is only the fixed 64 bytes before
//! it, so the data path decodes nothing but these.
//!
//! Layout, little-endian: magic `SHF1` (4), kind (1), collective (1), dtype (1), op (1), body
//! length (4), unit (4), epoch (8), seq (8), tag (8), count (8), algorithm (1), quantization
//! (1), block (2), root (4), derived group (8). The collective's whole [`OpHeader`] travels in every frame, so a
//! peer that runs another collective is caught at its first frame.

use crate::{Epoch, OpHeader};

/// Bytes of a data frame's header.
pub const DATA_FRAME_BYTES: usize = 64;
/// The four bytes that open every data frame: `SHF1` read as a little-endian u32.
pub const DATA_MAGIC: u32 = u32::from_le_bytes(*b"SHF1");

/// The fields' sizes add up to the header's, checked when this crate compiles.
const _: () = assert!(
    size_of::<u32>() // magic
        + 4 * size_of::<u8>() // kind, collective, dtype, op
        + 2 * size_of::<u32>() // len, unit
        + 5 * size_of::<u64>() // epoch, seq, tag, count, derived
        + 2 * size_of::<u8>() // algorithm, quantization
        + size_of::<u16>() // block
        + size_of::<u32>() // root
        == DATA_FRAME_BYTES
);

/// What a data frame carries. Codes are never renumbered; retired ones stay reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A chunk of a collective's schedule: `len` bytes of unit `unit` follow.
    Chunk = 1,
    /// A confirmation token of a collective: the token of rank `unit`; no body.
    Token = 2,
    /// A tagged transfer offered by its sender: `count` elements of `dtype` under `tag`.
    Offer = 3,
    /// The receiver takes an offer.
    Accept = 4,
    /// The receiver refuses an offer (its count or dtype differs).
    Refuse = 5,
    /// A part of an accepted transfer: `len` bytes of part `unit` follow.
    Part = 6,
    /// The sender withdraws its offer.
    Withdraw = 7,
    /// The receiver read the whole transfer out of the sender's memory (both on one host).
    Pulled = 8,
    /// The sender saw `Pulled`: the transfer ended at both ends.
    Confirmed = 9,
    /// Every part arrived at the receiver: the transfer ended at both ends.
    Received = 10,
}

impl FrameKind {
    /// The kind of code `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        use FrameKind::*;
        [Chunk, Token, Offer, Accept, Refuse, Part, Withdraw, Pulled, Confirmed, Received]
            .into_iter()
            .find(|k| *k as u8 == code)
    }

    /// Whether it belongs to a tagged transfer rather than a collective.
    pub fn is_transfer(self) -> bool {
        self >= FrameKind::Offer
    }
}

/// One data frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataFrame {
    /// What it carries.
    pub kind: FrameKind,
    /// Bytes of body that follow (a chunk's or a part's); 0 otherwise.
    pub len: u32,
    /// A chunk's unit of the schedule, a token's rank, or a part's number.
    pub unit: u32,
    /// The collective or transfer it belongs to.
    pub op: OpHeader,
}

/// Why bytes are not a data frame's header. The stream they came on is out of step or not a
/// peer's: it is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DataFrameError {
    /// The header does not start with [`DATA_MAGIC`].
    #[error("a data frame without its magic ({got:#010x})")]
    BadMagic {
        /// The four bytes found instead.
        got: u32,
    },
    /// The kind code is none of [`FrameKind`]'s.
    #[error("a data frame of unknown kind {code}")]
    UnknownKind {
        /// The code found.
        code: u8,
    },
}

impl DataFrame {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; DATA_FRAME_BYTES] {
        let mut b = [0u8; DATA_FRAME_BYTES];
        b[0..4].copy_from_slice(&DATA_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.op.collective;
        b[6] = self.op.dtype;
        b[7] = self.op.op;
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.unit.to_le_bytes());
        b[16..24].copy_from_slice(&self.op.epoch.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.op.seq.to_le_bytes());
        b[32..40].copy_from_slice(&self.op.tag.to_le_bytes());
        b[40..48].copy_from_slice(&self.op.count.to_le_bytes());
        b[48] = self.op.algorithm;
        b[49] = self.op.quantization;
        b[50..52].copy_from_slice(&self.op.block.to_le_bytes());
        b[52..56].copy_from_slice(&self.op.root.to_le_bytes());
        b[56..64].copy_from_slice(&self.op.derived.to_le_bytes());
        b
    }

    /// The header in `b`.
    ///
    /// # Errors
    /// [`DataFrameError`] if `b` does not open with the magic or names no kind. What the
    /// [`OpHeader`] names is checked by whoever matches it against its own collective.
    pub fn decode(b: &[u8; DATA_FRAME_BYTES]) -> Result<DataFrame, DataFrameError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(std::array::from_fn(|k| b[i + k]));
        if u32_at(0) != DATA_MAGIC {
            return Err(DataFrameError::BadMagic { got: u32_at(0) });
        }
        let kind = FrameKind::from_code(b[4]).ok_or(DataFrameError::UnknownKind { code: b[4] })?;
        let op = OpHeader {
            collective: b[5],
            algorithm: b[48],
            epoch: Epoch(u64_at(16)),
            derived: u64_at(56),
            seq: u64_at(24),
            tag: u64_at(32),
            dtype: b[6],
            op: b[7],
            count: u64_at(40),
            root: u32_at(52),
            quantization: b[49],
            block: u16::from_le_bytes([b[50], b[51]]),
        };
        let frame = DataFrame { kind, len: u32_at(8), unit: u32_at(12), op };
        debug_assert_eq!(frame.encode(), *b, "a decoded header encodes to its bytes");
        Ok(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(seq: u64, tag: u64) -> OpHeader {
        OpHeader {
            collective: 1,
            algorithm: 2,
            epoch: Epoch(3),
            derived: 0,
            seq,
            tag,
            dtype: 11,
            op: 1,
            count: 100,
            root: 0,
            quantization: 0,
            block: 0,
        }
    }

    #[test]
    fn a_header_round_trips_and_a_foreign_one_is_named() {
        let f = DataFrame { kind: FrameKind::Chunk, len: 4096, unit: 7, op: header(3, 9) };
        assert_eq!(DataFrame::decode(&f.encode()), Ok(f));
        let mut bad = f.encode();
        bad[4] = FrameKind::Received as u8 + 1;
        assert_eq!(DataFrame::decode(&bad), Err(DataFrameError::UnknownKind { code: 11 }));
        bad[0] = b'X';
        assert!(matches!(DataFrame::decode(&bad), Err(DataFrameError::BadMagic { .. })));
    }

    proptest! {
        /// Any 64 bytes decode without panicking, and whatever decodes encodes back to them.
        #[test]
        fn any_bytes_decode_or_are_refused_and_decoded_ones_encode_back(bytes in prop::array::uniform32(any::<u8>()),
                                                                        more in prop::array::uniform32(any::<u8>()),
                                                                        kind in 0u8..12) {
            let mut b = [0u8; DATA_FRAME_BYTES];
            b[..32].copy_from_slice(&bytes);
            b[32..].copy_from_slice(&more);
            b[0..4].copy_from_slice(&DATA_MAGIC.to_le_bytes());
            b[4] = kind;
            match DataFrame::decode(&b) {
                Ok(f) => prop_assert_eq!(f.encode(), b),
                Err(e) => prop_assert_eq!(e, DataFrameError::UnknownKind { code: kind }),
            }
        }
    }
}
