//! Little-endian primitive encoding with bounds checked on every read.

use crate::{WireError, MAX_STRING_BYTES};

/// Appends little-endian primitives to a byte vector.
#[derive(Debug, Default)]
pub struct Writer {
    bytes: Vec<u8>,
    /// The first field that could not be encoded: [`Writer::finish`] returns it.
    error: Option<WireError>,
}

impl Writer {
    /// A writer with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Writer { bytes: Vec::with_capacity(capacity), error: None }
    }
    /// Appends one byte.
    pub fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }
    /// Appends a little-endian u16.
    pub fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    /// Appends a little-endian u32.
    pub fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    /// Appends a little-endian u64.
    pub fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    /// Appends a bool as one byte, 0 or 1.
    pub fn bool(&mut self, v: bool) {
        self.u8(v as u8);
    }
    /// Appends raw bytes without a length.
    pub fn bytes(&mut self, v: &[u8]) {
        self.bytes.extend_from_slice(v);
    }
    /// Appends a string as a u16 length and its UTF-8 bytes. A string longer than
    /// [`MAX_STRING_BYTES`] is not written: [`Writer::finish`] reports it.
    pub fn str(&mut self, v: &str) {
        if v.len() > MAX_STRING_BYTES {
            self.error.get_or_insert(WireError::StringTooLong { len: v.len(), max: MAX_STRING_BYTES });
            return;
        }
        self.u16(v.len() as u16);
        self.bytes(v.as_bytes());
    }
    /// The bytes written so far.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Consumes the writer, returning its bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
    /// Consumes the writer, returning its bytes, or the first field that could not be encoded.
    ///
    /// # Errors
    /// [`WireError::StringTooLong`] if a string was over [`MAX_STRING_BYTES`].
    pub fn finish(self) -> Result<Vec<u8>, WireError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.bytes),
        }
    }
}

/// Reads little-endian primitives from a byte slice; every read is bounds-checked.
#[derive(Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }
    /// Reads `N` bytes as they are.
    pub fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let end = self.pos.checked_add(N).ok_or(WireError::Truncated)?;
        let slice = self.bytes.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        // The slice has exactly N bytes by construction.
        Ok(slice.try_into().expect("slice of length N"))
    }
    /// Reads 32 bytes (a hash).
    pub fn hash(&mut self) -> Result<[u8; 32], WireError> {
        self.take::<32>()
    }
    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take::<1>()?[0])
    }
    /// Reads a little-endian u16.
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    /// Reads a little-endian u32.
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    /// Reads a little-endian u64.
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    /// Reads a bool; anything but 0 or 1 is an error.
    pub fn bool(&mut self, field: &'static str) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(WireError::InvalidValue { field, value: v.into() }),
        }
    }
    /// Reads a string written by [`Writer::str`], checking its length before copying it.
    pub fn str(&mut self) -> Result<String, WireError> {
        let len = self.u16()? as usize;
        if len > MAX_STRING_BYTES {
            return Err(WireError::StringTooLong { len, max: MAX_STRING_BYTES });
        }
        let end = self.pos + len;
        let slice = self.bytes.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        String::from_utf8(slice.to_vec()).map_err(|_| WireError::BadUtf8)
    }
    /// Reads a list count and checks it against `max` and against the bytes that remain, given
    /// that each entry needs at least `min_entry_bytes`.
    pub fn count(&mut self, max: usize, min_entry_bytes: usize) -> Result<usize, WireError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(WireError::TooManyEntries { len, max });
        }
        if len.saturating_mul(min_entry_bytes) > self.remaining() {
            return Err(WireError::Truncated);
        }
        Ok(len)
    }
    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }
    /// Fails unless every byte was read.
    pub fn finish(self) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(WireError::TrailingBytes(n)),
        }
    }
}
