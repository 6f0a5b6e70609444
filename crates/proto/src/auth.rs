//! Run credentials: a peer proves it knows the run's secret without sending it.
//!
//! The master opens every control connection with a fresh random nonce (`Challenge`); the peer's
//! `Join` carries the nonce's keyed hash under a key derived from the secret (BLAKE3 in its key
//! derivation and keyed-hash modes). The secret never crosses the wire, a proof is worthless on
//! any other connection (another nonce), and the comparison takes the same time whatever bytes
//! differ.

use shoal_wire::{Epoch, PeerId, SessionId};
use std::fmt;

/// The key a run's secret derives: what the master checks proofs with and a peer makes them with.
#[derive(Clone, PartialEq, Eq)]
pub struct RunKey([u8; 32]);

/// Domain separation: a key derived here is good for nothing else.
const CONTEXT: &str = "shoal 2026-11 run secret: Join proof";

impl RunKey {
    /// The key of secret `secret` (any bytes; a passphrase is fine, a long random one better).
    pub fn from_secret(secret: &[u8]) -> Self {
        RunKey(blake3::derive_key(CONTEXT, secret))
    }

    /// The proof that answers `nonce`.
    pub fn prove(&self, nonce: &[u8; 32]) -> [u8; 32] {
        *blake3::keyed_hash(&self.0, nonce).as_bytes()
    }

    /// Whether `proof` answers `nonce`, in constant time.
    pub fn verify(&self, nonce: &[u8; 32], proof: &[u8; 32]) -> bool {
        blake3::keyed_hash(&self.0, nonce) == blake3::Hash::from_bytes(*proof)
    }
}

/// The run's key for data connections, which the master draws for the run and hands each peer
/// it registers (`Registered`): every connection a peer dials opens with a frame (`PeerHello`,
/// `FetchRequest`) that carries a keyed hash of its fields and the session under this key. A
/// stranger who reaches a peer's data port, even one that knows every member's id and address,
/// cannot make one; with a run secret, no stranger is ever registered to learn the key.
#[derive(Clone, PartialEq, Eq)]
pub struct DataKey(pub [u8; 32]);

impl DataKey {
    /// The tag of a `PeerHello` with these fields.
    #[allow(clippy::too_many_arguments)]
    pub fn hello(
        &self,
        session: SessionId,
        from: PeerId,
        to: PeerId,
        epoch: Epoch,
        stream: u16,
        streams: u16,
        reverse: bool,
    ) -> [u8; 32] {
        self.tag(
            b"PeerHello",
            session,
            from,
            to,
            &[&epoch.0.to_le_bytes(), &stream.to_le_bytes(), &streams.to_le_bytes(), &[u8::from(reverse)]],
        )
    }

    /// The tag of a `FetchRequest` with these fields.
    #[allow(clippy::too_many_arguments)]
    pub fn fetch(
        &self,
        session: SessionId,
        from: PeerId,
        to: PeerId,
        round: u64,
        index: u32,
        offset: u64,
        len: u64,
    ) -> [u8; 32] {
        let fields: [&[u8]; 4] =
            [&round.to_le_bytes(), &index.to_le_bytes(), &offset.to_le_bytes(), &len.to_le_bytes()];
        self.tag(b"FetchRequest", session, from, to, &fields)
    }

    /// The keyed hash of a greeting of kind `what` from `from` to `to` in `session`, and its
    /// other fields (fixed-width, so no two field lists hash alike).
    fn tag(&self, what: &[u8], session: SessionId, from: PeerId, to: PeerId, fields: &[&[u8]]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(what);
        h.update(&session.0.to_le_bytes());
        h.update(&from.0.to_le_bytes());
        h.update(&to.0.to_le_bytes());
        for field in fields {
            h.update(field);
        }
        *h.finalize().as_bytes()
    }

    /// Whether `mac` equals `expected`, in constant time.
    pub fn matches(expected: [u8; 32], mac: &[u8; 32]) -> bool {
        blake3::Hash::from_bytes(expected) == blake3::Hash::from_bytes(*mac)
    }
}

impl fmt::Debug for DataKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataKey(..)")
    }
}

impl fmt::Debug for RunKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never in a log.
        f.write_str("RunKey(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_answers_its_nonce_under_its_secret_only() {
        let key = RunKey::from_secret(b"correct horse");
        let nonce = [7u8; 32];
        let proof = key.prove(&nonce);
        assert!(key.verify(&nonce, &proof));
        assert!(!key.verify(&[8u8; 32], &proof), "replayed on another connection");
        assert!(!RunKey::from_secret(b"wrong horse").verify(&nonce, &proof));
        assert!(!key.verify(&nonce, &[0u8; 32]), "no proof");
        assert_eq!(format!("{key:?}"), "RunKey(..)");
    }
}
