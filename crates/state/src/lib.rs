//! shoal's shared state. So far: the content hash that tells whether two peers hold the same
//! tensor (`docs/state.md`).
//!
//! A tensor's hash is BLAKE3 over a header — a domain string, the dtype's code, the number of
//! dimensions and each dimension — followed by the element bytes in memory order (little-endian,
//! as every supported host stores them). The header makes tensors with equal bytes but another
//! dtype or shape hash differently. BLAKE3 is a tree hash: the result is the same however the
//! bytes are fed (in one slice, in pieces, or split across threads), so large tensors are hashed
//! in parallel without changing a bit of the answer.
#![warn(missing_docs)]
#![deny(unsafe_code)]

use shoal_collective::DType;
use std::fmt;

/// Tensors at least this large are hashed on several threads.
pub const PARALLEL_BYTES: usize = 1 << 20;
const DOMAIN: &[u8] = b"shoal tensor hash v1\0";

/// The hash of a tensor's dtype, shape and contents.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TensorHash(pub [u8; 32]);

impl fmt::Display for TensorHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for TensorHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TensorHash({self})")
    }
}

/// Why a tensor cannot be hashed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// The bytes do not make the shape's number of elements.
    #[error("{bytes} bytes do not hold a {shape:?} tensor of {dtype} ({expected} bytes)")]
    SizeMismatch {
        /// The dtype's name.
        dtype: &'static str,
        /// The shape.
        shape: Vec<u64>,
        /// Bytes given.
        bytes: usize,
        /// Bytes the shape needs.
        expected: u128,
    },
}

/// Hashes one tensor. `bytes` are its elements in memory order (C-contiguous).
///
/// # Errors
/// [`HashError::SizeMismatch`] if `bytes` is not `shape`'s element count times the dtype's size.
///
/// # Examples
/// ```
/// use shoal_state::hash_tensor;
/// use shoal_collective::DType;
/// let a = hash_tensor(DType::F32, &[2], &[0u8; 8]).unwrap();
/// let b = hash_tensor(DType::I32, &[2], &[0u8; 8]).unwrap();
/// assert_ne!(a, b, "the dtype is part of the hash");
/// ```
pub fn hash_tensor(dtype: DType, shape: &[u64], bytes: &[u8]) -> Result<TensorHash, HashError> {
    check_layout(dtype, shape, bytes.len())?;
    let mut hasher = with_header(dtype, shape);
    if bytes.len() >= PARALLEL_BYTES {
        hasher.update_rayon(bytes);
    } else {
        hasher.update(bytes);
    }
    Ok(TensorHash(*hasher.finalize().as_bytes()))
}

/// Checks that `bytes` bytes hold a `shape` tensor of `dtype`, as [`hash_tensor`] does.
///
/// # Errors
/// [`HashError::SizeMismatch`] if they do not.
pub fn check_layout(dtype: DType, shape: &[u64], bytes: usize) -> Result<(), HashError> {
    let expected = shape.iter().fold(dtype.size() as u128, |n, d| n.saturating_mul(u128::from(*d)));
    if expected != bytes as u128 {
        return Err(HashError::SizeMismatch { dtype: dtype.name(), shape: shape.to_vec(), bytes, expected });
    }
    Ok(())
}

/// A hasher fed the header: the domain, the dtype's code, the number of dimensions, each one.
fn with_header(dtype: DType, shape: &[u64]) -> blake3::Hasher {
    let mut hasher = blake3::Hasher::new();
    hasher.update(DOMAIN);
    hasher.update(&[dtype.code()]);
    hasher.update(&(shape.len() as u32).to_le_bytes());
    for d in shape {
        hasher.update(&d.to_le_bytes());
    }
    hasher
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reference: the same header and bytes, fed to a serial hasher one slice at a time. (The
    /// header's layout is checked against an independent BLAKE3 in `tests/test_hash.py`.)
    fn reference(dtype: DType, shape: &[u64], bytes: &[u8], piece: usize) -> TensorHash {
        let mut h = with_header(dtype, shape);
        for chunk in bytes.chunks(piece.max(1)) {
            h.update(chunk);
        }
        TensorHash(*h.finalize().as_bytes())
    }

    proptest! {
        #[test]
        fn the_hash_does_not_depend_on_how_the_bytes_are_fed(len in 0usize..5000, piece in 1usize..700, seed: u8) {
            let bytes: Vec<u8> = (0..len * 4).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let shape = [len as u64];
            prop_assert_eq!(hash_tensor(DType::F32, &shape, &bytes).unwrap(), reference(DType::F32, &shape, &bytes, piece));
        }
    }

    #[test]
    fn parallel_hashing_of_large_tensors_matches_serial_and_any_alignment() {
        let bytes: Vec<u8> = (0..(9 << 20) + 13).map(|i: usize| (i % 251) as u8).collect();
        let n = (bytes.len() - 13) as u64;
        // The same logical bytes at another address (misaligned by one).
        let shifted: Vec<u8> = std::iter::once(0).chain(bytes.iter().copied()).collect();
        let a = hash_tensor(DType::U8, &[n], &bytes[..n as usize]).unwrap();
        let b = hash_tensor(DType::U8, &[n], &shifted[1..=n as usize]).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, reference(DType::U8, &[n], &bytes[..n as usize], 65536));
    }

    #[test]
    fn shape_dtype_and_contents_all_count() {
        let zeros = [0u8; 24];
        let h = |dtype, shape: &[u64], bytes: &[u8]| hash_tensor(dtype, shape, bytes).unwrap();
        let base = h(DType::F32, &[2, 3], &zeros);
        assert_ne!(base, h(DType::F32, &[3, 2], &zeros));
        assert_ne!(base, h(DType::F32, &[6], &zeros));
        assert_ne!(base, h(DType::I32, &[2, 3], &zeros));
        let mut one = zeros;
        one[23] = 1;
        assert_ne!(base, h(DType::F32, &[2, 3], &one));
        // A scalar has no dimensions and one element.
        assert!(hash_tensor(DType::F64, &[], &[0u8; 8]).is_ok());
        assert_eq!(
            hash_tensor(DType::F32, &[2, 3], &zeros[..20]),
            Err(HashError::SizeMismatch { dtype: "f32", shape: vec![2, 3], bytes: 20, expected: 24 })
        );
        assert_eq!(h(DType::U8, &[0], &[]).to_string().len(), 64);
    }
}
