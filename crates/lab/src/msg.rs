//! The nfnetlink_queue messages the delay program sends and reads, as bytes.
//!
//! Layout (linux/netlink.h, linux/netfilter/nfnetlink*.h): a netlink header (native byte
//! order), a 4-byte nfnetlink header whose `res_id` is the queue number (big-endian), then
//! attributes (`len`, `type` in native order; values big-endian; each padded to 4 bytes).
//! Pure functions, so they are tested without a kernel.

pub const NLMSG_HDRLEN: usize = 16;
const NFGEN_HDRLEN: usize = 4;
const NLA_HDRLEN: usize = 4;

const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;

const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQNL_MSG_VERDICT_BATCH: u16 = 3;

const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;

const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
/// Accept rather than drop when the queue is full or a notification cannot be delivered.
pub const NFQA_CFG_F_FAIL_OPEN: u32 = 1;
/// Queue large (GSO) segments whole instead of cutting them into MTU-sized packets first.
pub const NFQA_CFG_F_GSO: u32 = 4;
const NF_ACCEPT: u32 = 1;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A request to the queue subsystem: headers, then the attributes appended with [`Request::attr`].
struct Request(Vec<u8>);

impl Request {
    fn new(msg_type: u16, flags: u16, seq: u32, queue: u16) -> Self {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&0u32.to_ne_bytes()); // length, set in `finish`
        b.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | msg_type).to_ne_bytes());
        b.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
        b.extend_from_slice(&[0, 0]); // family (unspecified), nfnetlink version 0
        b.extend_from_slice(&queue.to_be_bytes());
        Request(b)
    }

    fn attr(mut self, kind: u16, value: &[u8]) -> Self {
        let len = NLA_HDRLEN + value.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(value);
        self.0.resize(align4(self.0.len()), 0);
        self
    }

    fn finish(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

/// Binds this socket to `queue` (acknowledged).
pub fn bind(queue: u16, seq: u32) -> Vec<u8> {
    let cmd = [NFQNL_CFG_CMD_BIND, 0, 0, 0]; // command, pad, protocol family (unused since 3.8)
    Request::new(NFQNL_MSG_CONFIG, NLM_F_ACK, seq, queue).attr(NFQA_CFG_CMD, &cmd).finish()
}

/// Sets `queue` to copy metadata only, hold up to `max_len` packets and use `flags`
/// (acknowledged).
pub fn configure(queue: u16, seq: u32, max_len: u32, flags: u32) -> Vec<u8> {
    let mut params = [0u8; 5]; // copy range (unused with metadata only), copy mode
    params[4] = NFQNL_COPY_META;
    Request::new(NFQNL_MSG_CONFIG, NLM_F_ACK, seq, queue)
        .attr(NFQA_CFG_PARAMS, &params)
        .attr(NFQA_CFG_QUEUE_MAXLEN, &max_len.to_be_bytes())
        .attr(NFQA_CFG_MASK, &flags.to_be_bytes())
        .attr(NFQA_CFG_FLAGS, &flags.to_be_bytes())
        .finish()
}

/// Accepts every packet of `queue` up to and including `id`.
pub fn accept_through(queue: u16, id: u32) -> Vec<u8> {
    let mut hdr = [0u8; 8];
    hdr[..4].copy_from_slice(&NF_ACCEPT.to_be_bytes());
    hdr[4..].copy_from_slice(&id.to_be_bytes());
    Request::new(NFQNL_MSG_VERDICT_BATCH, 0, 0, queue).attr(NFQA_VERDICT_HDR, &hdr).finish()
}

/// What the kernel sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// A packet waits on `queue` under `id`.
    Packet { queue: u16, id: u32 },
    /// The answer to request `seq`: 0, or a negative errno.
    Ack { seq: u32, error: i32 },
    /// Anything else (ignored).
    Other,
}

/// The messages in one datagram; stops at the first malformed one.
pub fn parse(mut buf: &[u8]) -> Vec<Message> {
    let mut out = Vec::new();
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            break;
        }
        let kind = u16::from_ne_bytes(buf[4..6].try_into().unwrap());
        let seq = u32::from_ne_bytes(buf[8..12].try_into().unwrap());
        let body = &buf[NLMSG_HDRLEN..len];
        out.push(match kind {
            NLMSG_ERROR if body.len() >= 4 => {
                Message::Ack { seq, error: i32::from_ne_bytes(body[..4].try_into().unwrap()) }
            }
            k if k == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET && body.len() >= NFGEN_HDRLEN => {
                let queue = u16::from_be_bytes(body[2..4].try_into().unwrap());
                packet_id(&body[NFGEN_HDRLEN..]).map_or(Message::Other, |id| Message::Packet { queue, id })
            }
            _ => Message::Other,
        });
        buf = &buf[align4(len).min(buf.len())..];
    }
    out
}

fn packet_id(mut attrs: &[u8]) -> Option<u32> {
    while attrs.len() >= NLA_HDRLEN {
        let len = u16::from_ne_bytes(attrs[0..2].try_into().unwrap()) as usize;
        let kind = u16::from_ne_bytes(attrs[2..4].try_into().unwrap()) & 0x3fff; // minus nested/byte-order bits
        if len < NLA_HDRLEN || len > attrs.len() {
            return None;
        }
        if kind == NFQA_PACKET_HDR && len >= NLA_HDRLEN + 4 {
            return Some(u32::from_be_bytes(attrs[4..8].try_into().unwrap()));
        }
        attrs = &attrs[align4(len).min(attrs.len())..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: u16, len: usize, seq: u32) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&(len as u32).to_ne_bytes());
        b.extend_from_slice(&kind.to_ne_bytes());
        b.extend_from_slice(&0u16.to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        b.extend_from_slice(&7u32.to_ne_bytes());
        b
    }

    /// A packet notification as the kernel writes it: headers, a hardware-address attribute
    /// first (so the parser must skip one), then the packet header attribute.
    fn packet(queue: u16, id: u32) -> Vec<u8> {
        let mut attrs = Vec::new();
        attrs.extend_from_slice(&10u16.to_ne_bytes()); // 6-byte value, padded to 8
        attrs.extend_from_slice(&9u16.to_ne_bytes());
        attrs.extend_from_slice(&[1, 2, 3, 4, 5, 6, 0, 0]);
        attrs.extend_from_slice(&11u16.to_ne_bytes());
        attrs.extend_from_slice(&NFQA_PACKET_HDR.to_ne_bytes());
        attrs.extend_from_slice(&id.to_be_bytes());
        attrs.extend_from_slice(&[0x08, 0x00, 1, 0]); // protocol, hook, pad
        let len = NLMSG_HDRLEN + NFGEN_HDRLEN + attrs.len();
        let mut b = header(NFNL_SUBSYS_QUEUE << 8, len, 0);
        b.extend_from_slice(&[2, 0]);
        b.extend_from_slice(&queue.to_be_bytes());
        b.extend_from_slice(&attrs);
        b
    }

    #[test]
    fn requests_have_the_kernel_layout() {
        let b = accept_through(0x0102, 0xa0b0c0d0);
        assert_eq!(b.len(), 16 + 4 + 4 + 8);
        assert_eq!(u32::from_ne_bytes(b[0..4].try_into().unwrap()), 32);
        assert_eq!(u16::from_ne_bytes(b[4..6].try_into().unwrap()), 0x0303);
        assert_eq!(u16::from_ne_bytes(b[6..8].try_into().unwrap()), NLM_F_REQUEST);
        assert_eq!(&b[16..20], &[0, 0, 1, 2]);
        assert_eq!(u16::from_ne_bytes(b[20..22].try_into().unwrap()), 12);
        assert_eq!(&b[24..], &[0, 0, 0, 1, 0xa0, 0xb0, 0xc0, 0xd0]);

        let c = configure(3, 9, 4096, NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO);
        assert_eq!(c.len() % 4, 0);
        assert_eq!(u32::from_ne_bytes(c[0..4].try_into().unwrap()) as usize, c.len());
        assert_eq!(u16::from_ne_bytes(c[6..8].try_into().unwrap()), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(u32::from_ne_bytes(c[8..12].try_into().unwrap()), 9);
        // params: 4 + 5 bytes, padded to 12; then three 8-byte u32 attributes.
        assert_eq!(u16::from_ne_bytes(c[20..22].try_into().unwrap()), 9);
        assert_eq!(c[28], NFQNL_COPY_META);
        assert_eq!(c.len(), 20 + 12 + 8 * 3);
        assert_eq!(&c[36..40], &4096u32.to_be_bytes());
        assert_eq!(&c[c.len() - 4..], &5u32.to_be_bytes());

        let d = bind(7, 1);
        assert_eq!(d.len(), 28);
        assert_eq!(d[24], NFQNL_CFG_CMD_BIND);
    }

    #[test]
    fn parses_packets_and_acks_in_one_datagram() {
        let mut buf = packet(3, 41);
        buf.extend(packet(65535, u32::MAX));
        let mut ack = header(NLMSG_ERROR, 16 + 4 + 16, 5);
        ack.extend_from_slice(&(-1i32).to_ne_bytes());
        ack.extend_from_slice(&[0; 16]);
        buf.extend(ack);
        assert_eq!(
            parse(&buf),
            vec![
                Message::Packet { queue: 3, id: 41 },
                Message::Packet { queue: 65535, id: u32::MAX },
                Message::Ack { seq: 5, error: -1 }
            ]
        );
    }

    proptest::proptest! {
        /// Whatever the socket hands over, parsing neither panics nor reads past the datagram,
        /// and packets in front of garbage are still found.
        #[test]
        fn any_bytes_parse_without_panic(ids in proptest::collection::vec((0u16..4, proptest::num::u32::ANY), 0..8),
                                         garbage in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let mut buf = Vec::new();
            for &(queue, id) in &ids {
                buf.extend(packet(queue, id));
            }
            buf.extend_from_slice(&garbage);
            let got = parse(&buf);
            let want: Vec<Message> = ids.iter().map(|&(queue, id)| Message::Packet { queue, id }).collect();
            proptest::prop_assert_eq!(&got[..want.len()], &want[..]);
        }
    }

    #[test]
    fn truncated_or_garbage_input_yields_what_came_before_it() {
        let good = packet(1, 2);
        for cut in 0..good.len() {
            let mut buf = packet(1, 1);
            buf.extend_from_slice(&good[..cut]);
            let got = parse(&buf);
            assert_eq!(got[0], Message::Packet { queue: 1, id: 1 });
            assert!(got.len() == 1, "cut at {cut}: {got:?}");
        }
        let mut bad = packet(1, 1);
        bad[0..4].copy_from_slice(&3u32.to_ne_bytes()); // shorter than a header
        assert!(parse(&bad).is_empty());
    }
}
