//! Run credentials: a peer proves it knows the run's secret without sending it.
//!
//! The master opens every control connection with a fresh random nonce (`Challenge`); the peer's
//! `Join` carries the nonce's keyed hash under a key derived from the secret (BLAKE3 in its key
//! derivation and keyed-hash modes). The secret never crosses the wire, a proof is worthless on
//! any other connection (another nonce), and the comparison takes the same time whatever bytes
//! differ.

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
