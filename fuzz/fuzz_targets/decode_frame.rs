//! Arbitrary bytes as a frame: decoding never panics, and whatever decodes encodes back to a
//! frame that decodes to the same message. The first two bytes also pick a kind for a bare body,
//! so every message's body decoder meets garbage of its own.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_wire::{decode_frame, encode_frame, Message};

fuzz_target!(|data: &[u8]| {
    if let Ok((session, message)) = decode_frame(data) {
        let again = encode_frame(session, &message).expect("a decoded message encodes");
        assert_eq!(decode_frame(&again).expect("and decodes again"), (session, message));
    }
    if let [a, b, body @ ..] = data {
        if let Ok(message) = Message::decode_body(u16::from_le_bytes([*a, *b]), body) {
            let again = encode_frame(shoal_wire::SessionId(1), &message).expect("a decoded body encodes");
            assert_eq!(decode_frame(&again).expect("and decodes again").1, message);
        }
    }
});
