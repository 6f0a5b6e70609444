//! shoal's wire format: the framing and encoding of every control message exchanged between
//! peers and the master, and of the small headers that open peer-to-peer data streams.
//!
//! This crate does no IO, keeps no clock and spawns no thread. It turns messages into bytes and
//! bytes into messages, and it never panics on input: every length and count read from the
//! network is checked against a named maximum before anything is allocated.
//!
//! Every message travels in a frame: a fixed 32-byte [`FrameHeader`] (magic, protocol version,
//! kind, body length, session id, and separate CRC-32 checksums of the header and of the body)
//! followed by the body. Kind codes are never renumbered; retired ones stay reserved. Tensor
//! bytes travel in data frames ([`DataFrame`]), whose header carries an [`OpHeader`] and no
//! checksum (see `docs/wire.md`), so the data path pays for no second checksum.
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod codec;
mod data;
mod message;
mod misuse;
mod report;

pub use codec::{Reader, Writer};
pub use data::{DataFrame, DataFrameError, FrameKind, DATA_FRAME_BYTES, DATA_MAGIC};
pub use message::*;
pub use misuse::{Api, Call, Called, Mismatch, Misuse, Point, Reason};
pub use report::*;

/// The protocol version this build speaks. Peers and masters of different versions refuse to
/// talk to each other with [`WireError::VersionMismatch`].
pub const PROTOCOL_VERSION: u16 = 19;
/// The four bytes that open every frame: `SHOL` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"SHOL");
/// Size of the fixed frame header.
pub const HEADER_BYTES: usize = 32;
/// Largest body a frame may carry. Control messages are small; this bounds what a malformed or
/// hostile sender can make a receiver allocate.
pub const MAX_BODY_BYTES: u32 = 2 << 20;
/// Longest string (an address, a reason) inside a message.
pub const MAX_STRING_BYTES: usize = 256;
/// Most members a topology message may list.
pub const MAX_MEMBERS: usize = 4096;
/// Most tensors one shared state may hold.
pub const MAX_STATE_ENTRIES: usize = 2048;
/// Most dimensions a tensor of a shared state may have.
pub const MAX_DIMS: usize = 16;

const _: () = assert!(HEADER_BYTES == 4 + 2 + 2 + 4 + 2 + 2 + 8 + 4 + 4);
// The largest shared-state vote must fit in a frame.
const _: () = assert!(
    MAX_BODY_BYTES as usize
        >= 8 + 1 + 1 + 4 + MAX_STATE_ENTRIES * (2 + MAX_STRING_BYTES + 1 + 4 + 8 * MAX_DIMS + 32 + 1)
);
// The largest topology message must fit in a frame.
const _: () = assert!(MAX_BODY_BYTES as usize >= 8 + 4 + MAX_MEMBERS * (4 + 4 + 2 + MAX_STRING_BYTES));

/// Identifies one run of a master. Every frame after the first `Join` carries it, so a peer of an
/// earlier run (or a stray process) cannot talk into a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SessionId(pub u64);

/// The fixed header in front of every frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Protocol version of the sender.
    pub version: u16,
    /// Message kind code (see [`Message::kind`]).
    pub kind: u16,
    /// Length of the body that follows, at most [`MAX_BODY_BYTES`].
    pub body_len: u32,
    /// The run this frame belongs to; zero before the master has assigned one.
    pub session: SessionId,
    /// CRC-32 of the body.
    pub body_crc: u32,
}

impl FrameHeader {
    /// Decodes and checks a header: magic, header checksum, version and body length.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::HeaderChecksum`], [`WireError::VersionMismatch`] or
    /// [`WireError::BodyTooLarge`].
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<FrameHeader, WireError> {
        let mut r = Reader::new(bytes);
        let magic = r.u32()?;
        if magic != MAGIC {
            return Err(WireError::BadMagic { got: magic });
        }
        let version = r.u16()?;
        let kind = r.u16()?;
        let body_len = r.u32()?;
        let _flags = r.u16()?;
        let _reserved = r.u16()?;
        let session = SessionId(r.u64()?);
        let body_crc = r.u32()?;
        let header_crc = r.u32()?;
        let expected = crc(&bytes[..HEADER_BYTES - 4]);
        if header_crc != expected {
            return Err(WireError::HeaderChecksum);
        }
        if version != PROTOCOL_VERSION {
            return Err(WireError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: version });
        }
        if body_len > MAX_BODY_BYTES {
            return Err(WireError::BodyTooLarge { len: body_len, max: MAX_BODY_BYTES });
        }
        Ok(FrameHeader { version, kind, body_len, session, body_crc })
    }
}

/// Encodes `message` as one complete frame (header and body) for `session`.
///
/// # Examples
/// ```
/// use shoal_wire::{decode_frame, encode_frame, Message, SessionId};
/// let bytes = encode_frame(SessionId(7), &Message::Heartbeat).unwrap();
/// let (session, message) = decode_frame(&bytes).unwrap();
/// assert_eq!((session, message), (SessionId(7), Message::Heartbeat));
/// ```
///
/// # Errors
/// [`WireError::StringTooLong`] if a string field is over [`MAX_STRING_BYTES`] (a name or an
/// address the user gave): nothing is encoded, and the caller tells the user which.
pub fn encode_frame(session: SessionId, message: &Message) -> Result<Vec<u8>, WireError> {
    let mut body = Writer::with_capacity(64);
    message.encode_body(&mut body);
    let body = body.finish()?;
    // Every list is bounded and every string checked, so the limits bound the body: a bug if not.
    assert!(body.len() <= MAX_BODY_BYTES as usize, "message exceeds MAX_BODY_BYTES: a bug");
    let mut w = Writer::with_capacity(HEADER_BYTES + body.len());
    w.u32(MAGIC);
    w.u16(PROTOCOL_VERSION);
    w.u16(message.kind());
    w.u32(body.len() as u32);
    w.u16(0);
    w.u16(0);
    w.u64(session.0);
    w.u32(crc(&body));
    let header_crc = crc(&w.as_bytes()[..HEADER_BYTES - 4]);
    w.u32(header_crc);
    debug_assert_eq!(w.as_bytes().len(), HEADER_BYTES);
    w.bytes(&body);
    Ok(w.into_bytes())
}

/// Decodes the body of a frame whose header was checked by [`FrameHeader::decode`].
///
/// # Errors
/// [`WireError::BodyChecksum`] if the body does not match the header, or any decoding error of
/// [`Message::decode_body`].
pub fn decode_body(header: &FrameHeader, body: &[u8]) -> Result<Message, WireError> {
    if body.len() != header.body_len as usize {
        return Err(WireError::Truncated);
    }
    if crc(body) != header.body_crc {
        return Err(WireError::BodyChecksum);
    }
    Message::decode_body(header.kind, body)
}

/// Decodes one complete frame held in `bytes`, which must contain exactly that frame.
///
/// # Errors
/// Any [`WireError`] naming what is wrong with the bytes.
pub fn decode_frame(bytes: &[u8]) -> Result<(SessionId, Message), WireError> {
    let head: &[u8; HEADER_BYTES] =
        bytes.get(..HEADER_BYTES).and_then(|h| h.try_into().ok()).ok_or(WireError::Truncated)?;
    let header = FrameHeader::decode(head)?;
    let message = decode_body(&header, &bytes[HEADER_BYTES..])?;
    Ok((header.session, message))
}

/// Everything that can be wrong with bytes received from the network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The frame does not start with [`MAGIC`]: not a shoal peer, or a desynchronised stream.
    #[error("bad magic {got:#010x}: not a shoal frame")]
    BadMagic {
        /// The four bytes received instead.
        got: u32,
    },
    /// The header's checksum does not match its contents.
    #[error("frame header checksum mismatch")]
    HeaderChecksum,
    /// The body's checksum does not match the header.
    #[error("frame body checksum mismatch")]
    BodyChecksum,
    /// The sender speaks another protocol version.
    #[error("protocol version mismatch: we speak {ours}, the other side {theirs}")]
    VersionMismatch {
        /// Our [`PROTOCOL_VERSION`].
        ours: u16,
        /// The version in the received header.
        theirs: u16,
    },
    /// The announced body is larger than [`MAX_BODY_BYTES`].
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    BodyTooLarge {
        /// Announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The message ended before all its fields were read.
    #[error("message truncated")]
    Truncated,
    /// Bytes were left over after the last field.
    #[error("{0} unexpected bytes after the message")]
    TrailingBytes(usize),
    /// The kind code names no message this version knows.
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    /// A string is longer than [`MAX_STRING_BYTES`].
    #[error("string of {len} bytes exceeds the limit of {max}")]
    StringTooLong {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A string is not UTF-8.
    #[error("string is not valid UTF-8")]
    BadUtf8,
    /// A list holds more entries than its limit.
    #[error("list of {len} entries exceeds the limit of {max}")]
    TooManyEntries {
        /// Announced count.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An enumerated field holds a value with no meaning.
    #[error("invalid value {value} for {field}")]
    InvalidValue {
        /// Which field.
        field: &'static str,
        /// What arrived.
        value: u64,
    },
}

fn crc(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}
