//! Quantized chunks: the formats a collective may send its chunks in, and their kernels.
//!
//! A [`Codec`] turns a chunk of a float tensor into fewer bytes ([`Codec::encode`]) and back
//! ([`Codec::decode`], [`Codec::add_decoded`]):
//!
//! - `fp16`, `bf16`: each element cast to IEEE half precision or bfloat16, rounded to nearest
//!   (ties to even).
//! - `int8`, `int4`: the chunk is cut into blocks of [`Quantization::block`] elements (the last
//!   may be shorter); each block is `lo`, `scale` (little-endian, in the tensor's accumulation
//!   type: f64 for f64 tensors, else f32), then one code per element (int4: two per byte, the
//!   first in the low nibble), `q = round((x - lo) / scale)` in `0 ..= 255` (int4: `0 ..= 15`),
//!   with `lo` the block's minimum and `scale` its span over the top code (min-max, round to
//!   nearest, ties to even). An element decodes as `lo + q * scale`, at most half a step from the original.
//!   A block holding a NaN or an infinity (or whose span overflows) decodes as NaN throughout:
//!   a non-finite gradient stays visible.
//!
//! Decoding is plain IEEE arithmetic in a fixed order, so every peer decodes a chunk's bytes to
//! the same values: the engine forwards received bytes as they are, never re-encoding them, and
//! the peer that encodes a chunk keeps the decoded values itself (`docs/algorithms.md`,
//! "Quantized collectives").

use crate::kernels::KernelError;
use crate::{DType, ReduceOp};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A quantized format. Codes are part of the wire format: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// IEEE 754 half precision, each element cast.
    F16,
    /// bfloat16, each element cast.
    BF16,
    /// Block-wise min-max to 8-bit codes.
    Int8,
    /// Block-wise min-max to 4-bit codes.
    Int4,
}

impl Format {
    /// Every format, in code order.
    pub const ALL: [Format; 4] = [Format::F16, Format::BF16, Format::Int8, Format::Int4];

    /// The name used by the API (`quantization="int8"`).
    pub fn name(self) -> &'static str {
        match self {
            Format::F16 => "fp16",
            Format::BF16 => "bf16",
            Format::Int8 => "int8",
            Format::Int4 => "int4",
        }
    }

    /// Parses a name written by [`Format::name`].
    pub fn from_name(name: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Wire code (0 stands for no quantization).
    pub fn code(self) -> u8 {
        self as u8 + 1
    }

    /// Inverse of [`Format::code`].
    pub fn from_code(code: u8) -> Option<Format> {
        Format::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// Whether it quantizes block by block (and takes a block size).
    pub fn is_blockwise(self) -> bool {
        matches!(self, Format::Int8 | Format::Int4)
    }

    /// The block size when the caller names none: the smallest at which the block's header
    /// costs at most a sixteenth of its codes (accuracy improves as blocks shrink; the header is
    /// what it costs on the wire). `docs/algorithms.md` has the measurements.
    pub fn default_block(self) -> usize {
        match self {
            Format::Int8 => 128,
            Format::Int4 => 256,
            Format::F16 | Format::BF16 => 0,
        }
    }

    /// The highest code of a block-wise format.
    fn top(self) -> u32 {
        match self {
            Format::Int8 => 255,
            Format::Int4 => 15,
            Format::F16 | Format::BF16 => unreachable!("not block-wise"),
        }
    }
}

/// How a collective quantizes its chunks: a format and, for a block-wise one, its block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quantization {
    format: Format,
    block: usize,
}

/// Why a quantization does not apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct QuantError(String);

impl Quantization {
    /// The smallest block size.
    pub const MIN_BLOCK: usize = 8;
    /// The largest block size (a frame's header holds it in 16 bits).
    pub const MAX_BLOCK: usize = 32768;

    /// `format` in blocks of `block` elements (block-wise formats; `None`: the default).
    ///
    /// # Errors
    /// If a block size is given for a cast, or is out of range.
    pub fn new(format: Format, block: Option<usize>) -> Result<Self, QuantError> {
        let block = match (format.is_blockwise(), block) {
            (false, None) => 0,
            (false, Some(b)) => {
                return Err(QuantError(format!("quantization_block={b}: {} casts every element", format.name())));
            }
            (true, None) => format.default_block(),
            (true, Some(b)) if (Self::MIN_BLOCK..=Self::MAX_BLOCK).contains(&b) => b,
            (true, Some(b)) => {
                let (lo, hi) = (Self::MIN_BLOCK, Self::MAX_BLOCK);
                return Err(QuantError(format!("quantization_block={b}: expected {lo} to {hi} elements")));
            }
        };
        Ok(Quantization { format, block })
    }

    /// Parses the API's names: `"fp16"`, `"bf16"`, `"int8"`, `"int4"`.
    ///
    /// # Errors
    /// An unknown name, or a block size [`Quantization::new`] refuses.
    pub fn parse(name: &str, block: Option<usize>) -> Result<Self, QuantError> {
        let format = Format::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = Format::ALL.iter().map(|f| f.name()).collect();
            QuantError(format!("unknown quantization {name:?}: expected None or one of {}", names.join(", ")))
        })?;
        Self::new(format, block)
    }

    /// The format.
    pub fn format(self) -> Format {
        self.format
    }

    /// Elements per block (0 for a cast).
    pub fn block(self) -> usize {
        self.block
    }

    /// The wire form: format code, and block size.
    pub fn to_wire(this: Option<Self>) -> (u8, u16) {
        this.map_or((0, 0), |q| (q.format.code(), q.block as u16))
    }

    /// The codec for chunks of a `dtype` tensor reduced with `op` (`None`: not reduced, an
    /// all-gather), or `None` where it would change nothing (`fp16` of an f16 tensor).
    ///
    /// # Errors
    /// Where it is meaningless: an integer tensor, an operator other than sum and average, a
    /// cast to the other 16-bit float (it loses precision and saves no bytes).
    pub fn codec(self, dtype: DType, op: Option<ReduceOp>) -> Result<Option<Codec>, QuantError> {
        let name = self.format.name();
        if !dtype.is_float() {
            return Err(QuantError(format!("quantization={name:?} applies to float tensors, not {}", dtype.name())));
        }
        if let Some(op) = op.filter(|o| !matches!(o, ReduceOp::Sum | ReduceOp::Avg)) {
            return Err(QuantError(format!("quantization={name:?} applies to op sum and avg, not {}", op.name())));
        }
        match (self.format, dtype) {
            (Format::F16, DType::F16) | (Format::BF16, DType::BF16) => Ok(None),
            (Format::F16, DType::BF16) | (Format::BF16, DType::F16) => Err(QuantError(format!(
                "quantization={name:?} of a {} tensor loses precision and sends as many bytes",
                dtype.name()
            ))),
            _ => Ok(Some(Codec { q: self, dtype })),
        }
    }
}

/// A quantization applied to one tensor's element type: encodes and decodes its chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Codec {
    q: Quantization,
    dtype: DType,
}

impl Codec {
    /// The quantization.
    pub fn quantization(&self) -> Quantization {
        self.q
    }

    /// Bytes of `lo` and of `scale` in a block's header.
    fn header_half(&self) -> usize {
        if self.dtype == DType::F64 {
            8
        } else {
            4
        }
    }

    /// Bytes of the codes of `n` elements of a block.
    fn codes(&self, n: usize) -> usize {
        match self.q.format {
            Format::Int8 => n,
            Format::Int4 => n.div_ceil(2),
            Format::F16 | Format::BF16 => 2 * n,
        }
    }

    /// Bytes of one block of `n` elements on the wire.
    fn block_bytes(&self, n: usize) -> usize {
        2 * self.header_half() + self.codes(n)
    }

    /// Bytes of a chunk of `elems` elements on the wire.
    pub fn encoded_len(&self, elems: usize) -> usize {
        if !self.q.format.is_blockwise() {
            return self.codes(elems);
        }
        let (whole, rest) = (elems / self.q.block, elems % self.q.block);
        whole * self.block_bytes(self.q.block) + if rest > 0 { self.block_bytes(rest) } else { 0 }
    }

    /// Encodes `src` (elements of the tensor's type, as bytes) into `dst`, which holds
    /// [`Codec::encoded_len`] bytes.
    ///
    /// # Errors
    /// [`KernelError`] if `src` is misaligned or the lengths do not fit.
    pub fn encode(&self, src: &[u8], dst: &mut [u8]) -> Result<(), KernelError> {
        let elems = self.elems_of(src)?;
        self.check_encoded(dst.len(), elems, src.len())?;
        match self.dtype {
            DType::F32 => self.encode_as::<f32>(cast(src)?, dst),
            DType::F64 => self.encode_as::<f64>(cast(src)?, dst),
            DType::F16 => self.encode_as::<f16>(cast(src)?, dst),
            DType::BF16 => self.encode_as::<bf16>(cast(src)?, dst),
            _ => unreachable!("a codec has a float type"),
        }
        Ok(())
    }

    /// Decodes `src` (a chunk [`Codec::encode`] wrote) into `dst`.
    ///
    /// # Errors
    /// [`KernelError`] if `dst` is misaligned or the lengths do not fit.
    pub fn decode(&self, src: &[u8], dst: &mut [u8]) -> Result<(), KernelError> {
        self.decode_with(src, dst, false)
    }

    /// Adds the decoded `src` into `dst`, element by element (in f32, or f64 for an f64
    /// tensor, rounded back once).
    ///
    /// # Errors
    /// As [`Codec::decode`].
    pub fn add_decoded(&self, src: &[u8], dst: &mut [u8]) -> Result<(), KernelError> {
        self.decode_with(src, dst, true)
    }

    /// Encodes `buf` into `dst` and leaves the decoded values in `buf`: what every peer that
    /// receives `dst` will hold.
    ///
    /// # Errors
    /// As [`Codec::encode`].
    pub fn round_trip(&self, buf: &mut [u8], dst: &mut [u8]) -> Result<(), KernelError> {
        self.encode(buf, dst)?;
        self.decode(dst, buf)
    }

    fn elems_of(&self, buf: &[u8]) -> Result<usize, KernelError> {
        let elem = self.dtype.size();
        if !buf.len().is_multiple_of(elem) {
            return Err(KernelError::Length { dst: buf.len(), src: buf.len(), elem });
        }
        Ok(buf.len() / elem)
    }

    fn check_encoded(&self, encoded: usize, elems: usize, plain: usize) -> Result<(), KernelError> {
        if encoded != self.encoded_len(elems) {
            return Err(KernelError::Length { dst: plain, src: encoded, elem: self.dtype.size() });
        }
        Ok(())
    }

    fn decode_with(&self, src: &[u8], dst: &mut [u8], add: bool) -> Result<(), KernelError> {
        let elems = self.elems_of(dst)?;
        self.check_encoded(src.len(), elems, dst.len())?;
        match self.dtype {
            DType::F32 => self.decode_as::<f32>(src, cast_mut(dst)?, add),
            DType::F64 => self.decode_as::<f64>(src, cast_mut(dst)?, add),
            DType::F16 => self.decode_as::<f16>(src, cast_mut(dst)?, add),
            DType::BF16 => self.decode_as::<bf16>(src, cast_mut(dst)?, add),
            _ => unreachable!("a codec has a float type"),
        }
        Ok(())
    }

    fn encode_as<T: Value>(&self, src: &[T], dst: &mut [u8]) {
        match self.q.format {
            Format::F16 => cast_out(src, dst, |s: &[f32], d: &mut [f16]| d.convert_from_f32_slice(s)),
            Format::BF16 => cast_out(src, dst, |s: &[f32], d: &mut [bf16]| d.convert_from_f32_slice(s)),
            Format::Int8 | Format::Int4 => {
                let mut out = dst;
                for block in src.chunks(self.q.block) {
                    let (this, rest) = out.split_at_mut(self.block_bytes(block.len()));
                    encode_block::<T>(block, self.q.format, this);
                    out = rest;
                }
            }
        }
    }

    fn decode_as<T: Value>(&self, src: &[u8], dst: &mut [T], add: bool) {
        match self.q.format {
            Format::F16 => cast_in(src, dst, add, |s: &[f16], d: &mut [f32]| s.convert_to_f32_slice(d)),
            Format::BF16 => cast_in(src, dst, add, |s: &[bf16], d: &mut [f32]| s.convert_to_f32_slice(d)),
            Format::Int8 | Format::Int4 => {
                let mut input = src;
                for block in dst.chunks_mut(self.q.block) {
                    let (this, rest) = input.split_at(self.block_bytes(block.len()));
                    decode_block::<T>(this, self.q.format, block, add);
                    input = rest;
                }
            }
        }
    }
}

/// Elements converted at a time through a buffer on the stack.
const BATCH: usize = 256;

/// Casts `src` to 16-bit floats with `convert` (in f32), into `dst` as little-endian bytes.
fn cast_out<T: Value, H: bytemuck::Pod + Default>(src: &[T], dst: &mut [u8], convert: fn(&[f32], &mut [H])) {
    // Float32 into an aligned buffer (as the engine's are): converted in place, no batches.
    if let (Some(s), Ok(d)) = (T::as_f32(src), bytemuck::try_cast_slice_mut::<u8, H>(dst)) {
        return convert(s, d);
    }
    let (mut wide, mut narrow) = ([0f32; BATCH], [H::default(); BATCH]);
    for (s, d) in src.chunks(BATCH).zip(dst.chunks_mut(2 * BATCH)) {
        let n = s.len();
        T::widen(s, &mut wide[..n]);
        convert(&wide[..n], &mut narrow[..n]);
        d.copy_from_slice(bytemuck::cast_slice(&narrow[..n]));
    }
}

/// Casts 16-bit floats in `src` (little-endian bytes) to f32 with `convert`, then stores (or
/// adds) them into `dst`.
fn cast_in<T: Value, H: bytemuck::Pod + Default>(src: &[u8], dst: &mut [T], add: bool, convert: fn(&[H], &mut [f32])) {
    if let (false, Ok(s)) = (add, bytemuck::try_cast_slice::<u8, H>(src)) {
        if let Some(d) = T::as_f32_mut(dst) {
            return convert(s, d);
        }
    }
    let (mut wide, mut narrow) = ([0f32; BATCH], [H::default(); BATCH]);
    for (s, d) in src.chunks(2 * BATCH).zip(dst.chunks_mut(BATCH)) {
        let n = d.len();
        bytemuck::cast_slice_mut::<H, u8>(&mut narrow[..n]).copy_from_slice(s);
        convert(&narrow[..n], &mut wide[..n]);
        T::store(&wide[..n], d, add);
    }
}

/// Min-max quantizes one block of `x` into `out` (header, then codes).
fn encode_block<T: Value>(x: &[T], format: Format, out: &mut [u8]) {
    let half = T::Acc::BYTES;
    let (header, codes) = out.split_at_mut(2 * half);
    let (lo, hi, nan) = min_max(x);
    let span = hi.sub(lo);
    if nan || !span.is_finite() {
        T::Acc::NAN.put(&mut header[..half]);
        T::Acc::NAN.put(&mut header[half..]);
        codes.fill(0);
        return;
    }
    let top = T::Acc::from_u32(format.top());
    let scale = span.div(top);
    let inv = if span > T::Acc::ZERO { top.div(span) } else { T::Acc::ZERO };
    lo.put(&mut header[..half]);
    scale.put(&mut header[half..]);
    // The scaled offset lies in 0 ..= top (give or take a rounding): no clamp needed.
    let code = |v: T| v.up().sub(lo).mul(inv).round_to_code();
    match format {
        Format::Int8 => codes.iter_mut().zip(x).for_each(|(c, v)| *c = code(*v)),
        _ => {
            let pairs = x.chunks_exact(2);
            let last = pairs.remainder().first().map(|v| code(*v));
            for (c, p) in codes.iter_mut().zip(pairs) {
                *c = code(p[0]) | code(p[1]) << 4;
            }
            if let Some(q) = last {
                codes[x.len() / 2] = q;
            }
        }
    }
}

/// The least and greatest of `x`, and whether any is NaN. Eight running minima and maxima,
/// one per lane, so that the loop vectorizes (a single one is a chain of dependent compares).
#[inline]
fn min_max<T: Value>(x: &[T]) -> (T::Acc, T::Acc, bool) {
    const LANES: usize = 8;
    let first = x[0].up();
    let (mut lo, mut hi, mut nan) = ([first; LANES], [first; LANES], [false; LANES]);
    let mut lanes = x.chunks_exact(LANES);
    for group in &mut lanes {
        for j in 0..LANES {
            let v = group[j].up();
            lo[j] = if v < lo[j] { v } else { lo[j] };
            hi[j] = if v > hi[j] { v } else { hi[j] };
            #[allow(clippy::eq_op)] // `v != v` is the NaN test, and vectorizes.
            let is_nan = v != v;
            nan[j] |= is_nan;
        }
    }
    for v in lanes.remainder() {
        let v = v.up();
        lo[0] = if v < lo[0] { v } else { lo[0] };
        hi[0] = if v > hi[0] { v } else { hi[0] };
        #[allow(clippy::eq_op)]
        let is_nan = v != v;
        nan[0] |= is_nan;
    }
    let pick = |a: [T::Acc; LANES], less: bool| a.into_iter().reduce(|m, v| if (v < m) == less { v } else { m });
    (pick(lo, true).expect("lanes"), pick(hi, false).expect("lanes"), nan.contains(&true))
}

/// Decodes one block `input` (header, then codes) into `x`, or adds it.
fn decode_block<T: Value>(input: &[u8], format: Format, x: &mut [T], add: bool) {
    let half = T::Acc::BYTES;
    let (lo, scale) = (T::Acc::get(&input[..half]), T::Acc::get(&input[half..2 * half]));
    let codes = &input[2 * half..];
    let value = |q: u8| lo.add(T::Acc::from_u32(u32::from(q)).mul(scale));
    let put = |d: &mut T, q: u8| *d = if add { T::down(d.up().add(value(q))) } else { T::down(value(q)) };
    match format {
        Format::Int8 => x.iter_mut().zip(codes).for_each(|(d, &q)| put(d, q)),
        _ => {
            let mut pairs = x.chunks_exact_mut(2);
            for (p, &c) in (&mut pairs).zip(codes) {
                put(&mut p[0], c & 15);
                put(&mut p[1], c >> 4);
            }
            if let Some(d) = pairs.into_remainder().first_mut() {
                put(d, codes[codes.len() - 1] & 15);
            }
        }
    }
}

/// An element type a codec works on, and the type it computes in.
trait Value: bytemuck::Pod {
    type Acc: Acc;
    fn up(self) -> Self::Acc;
    fn down(a: Self::Acc) -> Self;
    /// Copies `src` into `dst` as f32 (for a cast to 16 bits).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Stores (or adds) f32 values `src` into `dst`.
    fn store(src: &[f32], dst: &mut [Self], add: bool);
    /// The slice as f32, if it is.
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// The slice as f32, if it is.
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

/// The arithmetic of a codec, spelled out so that the order of operations is fixed.
trait Acc: Copy + PartialOrd {
    const BYTES: usize;
    const ZERO: Self;
    const NAN: Self;
    fn from_u32(v: u32) -> Self;
    /// Rounds a value in `0.0 ..= 255.0` to the nearest integer (ties to even), as a code.
    fn round_to_code(self) -> u8;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn is_finite(self) -> bool;
    fn put(self, out: &mut [u8]);
    fn get(b: &[u8]) -> Self;
}

macro_rules! acc {
    ($t:ty, $mantissa:expr) => {
        impl Acc for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            const ZERO: Self = 0.0;
            const NAN: Self = <$t>::NAN;
            #[inline]
            fn from_u32(v: u32) -> Self {
                v as $t
            }
            #[inline]
            fn round_to_code(self) -> u8 {
                // Added to 1.5 * 2^mantissa, the value is rounded to an integer by the addition
                // itself (round to nearest, ties to even), which lands in the low bits: no
                // float-to-integer conversion, whose checks for NaN and range do not vectorize.
                const MAGIC: $t = 1.5 * (1u64 << $mantissa) as $t;
                (self + MAGIC).to_bits() as u8
            }
            #[inline]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline]
            fn div(self, o: Self) -> Self {
                self / o
            }
            #[inline]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            fn put(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("a header field"))
            }
        }
    };
}
acc!(f32, 23);
acc!(f64, 52);

impl Value for f32 {
    type Acc = f32;
    #[inline]
    fn up(self) -> f32 {
        self
    }
    #[inline]
    fn down(a: f32) -> f32 {
        a
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [f32]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn store(src: &[f32], dst: &mut [f32], add: bool) {
        if add {
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += *s);
        } else {
            dst.copy_from_slice(src);
        }
    }
}

impl Value for f64 {
    type Acc = f64;
    #[inline]
    fn up(self) -> f64 {
        self
    }
    #[inline]
    fn down(a: f64) -> f64 {
        a
    }
    fn widen(src: &[f64], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = *s as f32);
    }
    fn store(src: &[f32], dst: &mut [f64], add: bool) {
        let pairs = dst.iter_mut().zip(src);
        if add {
            pairs.for_each(|(d, s)| *d += f64::from(*s));
        } else {
            pairs.for_each(|(d, s)| *d = f64::from(*s));
        }
    }
}

macro_rules! half_value {
    ($t:ty) => {
        impl Value for $t {
            type Acc = f32;
            #[inline]
            fn up(self) -> f32 {
                self.to_f32()
            }
            #[inline]
            fn down(a: f32) -> Self {
                <$t>::from_f32(a)
            }
            fn widen(src: &[Self], dst: &mut [f32]) {
                src.convert_to_f32_slice(dst);
            }
            fn store(src: &[f32], dst: &mut [Self], add: bool) {
                let pairs = dst.iter_mut().zip(src);
                if add {
                    pairs.for_each(|(d, s)| *d = <$t>::from_f32(d.to_f32() + *s));
                } else {
                    dst.convert_from_f32_slice(src);
                }
            }
        }
    };
}
half_value!(f16);
half_value!(bf16);

fn cast<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T], KernelError> {
    bytemuck::try_cast_slice(bytes).map_err(|_| KernelError::Misaligned { elem: std::mem::size_of::<T>() })
}

fn cast_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> Result<&mut [T], KernelError> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| KernelError::Misaligned { elem: std::mem::size_of::<T>() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::xorshift;
    use proptest::prelude::*;

    /// A normal deviate from two uniform ones (Box–Muller), and heavy tails on demand.
    fn sample(rng: &mut u64, heavy: bool) -> f64 {
        let mut uniform = || {
            *rng = xorshift(*rng);
            ((*rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (u, v) = (uniform(), uniform());
        let normal = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
        // Student's t with 2 degrees of freedom: normal / sqrt(chi2_2 / 2).
        if heavy {
            normal / (-uniform().ln()).sqrt()
        } else {
            normal
        }
    }

    fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    /// Encodes and decodes `x` (as f32); the decoded values.
    fn through(codec: &Codec, x: &[f32]) -> Vec<f32> {
        let mut enc = vec![0u8; codec.encoded_len(x.len())];
        codec.encode(&bytes_of(x), &mut enc).unwrap();
        let mut out = vec![0f32; x.len()];
        codec.decode(&enc, bytemuck::cast_slice_mut(&mut out)).unwrap();
        out
    }

    fn codec(name: &str, block: Option<usize>, dtype: DType) -> Codec {
        Quantization::parse(name, block).unwrap().codec(dtype, Some(ReduceOp::Sum)).unwrap().unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// Every element decodes within half a step of its block (plus the rounding of the
        /// decode itself).
        #[test]
        fn block_wise_error_is_at_most_half_a_step(
            int4 in any::<bool>(),
            block in 8usize..300,
            len in 1usize..700,
            spread in -20i32..20,
            offset in -3.0f64..3.0,
            seed in any::<u64>(),
        ) {
            let c = codec(if int4 { "int4" } else { "int8" }, Some(block), DType::F32);
            let top = if int4 { 15.0 } else { 255.0 };
            let mut rng = seed | 1;
            let scale = 2f64.powi(spread);
            let x: Vec<f32> = (0..len).map(|_| ((sample(&mut rng, false) + offset) * scale) as f32).collect();
            let y = through(&c, &x);
            for (b, (xs, ys)) in x.chunks(block).zip(y.chunks(block)).enumerate() {
                let lo = xs.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let step = (f64::from(hi) - f64::from(lo)) / top;
                let slack = 4.0 * f64::from(f32::EPSILON) * f64::from(lo.abs().max(hi.abs()));
                for (a, q) in xs.iter().zip(ys) {
                    let err = (f64::from(*a) - f64::from(*q)).abs();
                    prop_assert!(err <= step / 2.0 * (1.0 + 1e-5) + slack,
                        "block {} element {} -> {}: error {} over half a step {}", b, a, q, err, step / 2.0);
                }
            }
        }
    }

    #[test]
    fn casts_round_to_nearest_and_keep_16_bit_tensors_exact() {
        let x = [1.0f32, 1.0 + 1.0 / 4096.0, -65504.0, 1e-3, 3.0e38];
        let y = through(&codec("fp16", None, DType::F32), &x);
        assert_eq!(&y[..4], &[1.0, 1.0, -65504.0, f16::from_f32(1e-3).to_f32()]);
        assert!(y[4].is_infinite(), "out of half precision's range");
        let y = through(&codec("bf16", None, DType::F32), &x);
        assert_eq!(y[4], bf16::from_f32(3.0e38).to_f32());
        let same = |name, dtype| Quantization::parse(name, None).unwrap().codec(dtype, None).unwrap();
        assert_eq!(same("fp16", DType::F16), None);
        assert_eq!(same("bf16", DType::BF16), None);
    }

    #[test]
    fn every_dtype_round_trips_and_adds_what_it_decodes() {
        let mut rng = 7u64;
        let x: Vec<f64> = (0..1000).map(|_| sample(&mut rng, false)).collect();
        for name in ["fp16", "bf16", "int8", "int4"] {
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let Some(c) = Quantization::parse(name, None).unwrap().codec(dtype, None).ok().flatten() else {
                    continue;
                };
                let plain: Vec<u8> = match dtype {
                    DType::F32 => bytes_of(&x.iter().map(|v| *v as f32).collect::<Vec<_>>()),
                    DType::F64 => bytes_of(&x),
                    DType::F16 => bytes_of(&x.iter().map(|v| f16::from_f64(*v)).collect::<Vec<_>>()),
                    _ => bytes_of(&x.iter().map(|v| bf16::from_f64(*v)).collect::<Vec<_>>()),
                };
                let mut enc = vec![0u8; c.encoded_len(x.len())];
                c.encode(&plain, &mut enc).unwrap();
                // A misaligned encoded buffer takes the batched path, to the same bytes.
                let mut shifted = vec![0u8; enc.len() + 1];
                c.encode(&plain, &mut shifted[1..]).unwrap();
                assert_eq!(&shifted[1..], &enc[..], "{name} of {}", dtype.name());
                let mut words = vec![0u64; plain.len() / 8];
                let out: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                c.decode(&enc, out).unwrap();
                // Decoding twice adds up to twice the decoded values, exactly: the sum of equal
                // binary floats doubles the exponent.
                let once = out.to_vec();
                c.add_decoded(&enc, out).unwrap();
                let mut twice = once.clone();
                crate::reduce_into(dtype, ReduceOp::Sum, &mut twice, &once).unwrap();
                assert_eq!(out, &twice[..], "{name} of {}", dtype.name());
                // The round trip in place leaves what decoding gives.
                let mut buf = plain.clone();
                let mut enc2 = vec![0u8; enc.len()];
                c.round_trip(&mut buf, &mut enc2).unwrap();
                assert_eq!((&buf, &enc2), (&once, &enc), "{name} of {}", dtype.name());
            }
        }
    }

    #[test]
    fn rounding_to_nearest_is_unbiased_where_truncation_is_not() {
        // Over many random tensors the mean error is a small fraction of a step: PCCL's
        // truncating min-max was measured here at -0.088 per element.
        for (name, heavy) in [("int8", false), ("int8", true), ("int4", false), ("int4", true)] {
            let c = codec(name, None, DType::F32);
            let (mut err, mut abs, mut n) = (0f64, 0f64, 0usize);
            let mut rng = 99u64;
            for _ in 0..200 {
                let x: Vec<f32> = (0..4096).map(|_| sample(&mut rng, heavy) as f32).collect();
                let y = through(&c, &x);
                for (a, b) in x.iter().zip(&y) {
                    err += f64::from(*b) - f64::from(*a);
                    abs += (f64::from(*b) - f64::from(*a)).abs();
                    n += 1;
                }
            }
            let (mean, mean_abs) = (err / n as f64, abs / n as f64);
            assert!(mean.abs() < mean_abs / 50.0, "{name} heavy={heavy}: mean error {mean}, mean |error| {mean_abs}");
        }
    }

    #[test]
    fn non_finite_blocks_decode_as_nan_and_constant_ones_exactly() {
        let c = codec("int8", Some(8), DType::F32);
        let mut x = vec![1.5f32; 24];
        x[3] = f32::NAN;
        x[9] = f32::INFINITY;
        x[17] = 4.0;
        let y = through(&c, &x);
        assert!(y[..16].iter().all(|v| v.is_nan()), "{y:?}");
        assert_eq!(&y[16..], &[1.5, 4.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]);
        assert_eq!(through(&c, &[-2.25; 8]), [-2.25; 8]);
    }

    #[test]
    fn sizes_on_the_wire() {
        let c = |name, block| codec(name, block, DType::F32);
        assert_eq!(c("fp16", None).encoded_len(1000), 2000);
        assert_eq!(c("int8", Some(128)).encoded_len(1000), 7 * (8 + 128) + (8 + 104));
        assert_eq!(c("int4", Some(256)).encoded_len(513), 2 * (8 + 128) + (8 + 1));
        assert_eq!(codec("int8", Some(128), DType::F64).encoded_len(128), 16 + 128);
        // Odd lengths: the last code of an int4 block has a byte of its own.
        // Spans of 15: every integer is a code.
        let x = [0.0, 15.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 15.0, 7.0, 8.0, 9.0];
        assert_eq!(through(&c("int4", Some(8)), &x), x);
    }

    #[test]
    fn meaningless_combinations_are_refused_with_their_reason() {
        let int8 = Quantization::parse("int8", None).unwrap();
        let err = |r: Result<Option<Codec>, QuantError>| r.unwrap_err().to_string();
        assert!(err(int8.codec(DType::I32, Some(ReduceOp::Sum))).contains("float tensors, not i32"));
        assert!(err(int8.codec(DType::F32, Some(ReduceOp::Max))).contains("sum and avg, not max"));
        let fp16 = Quantization::parse("fp16", None).unwrap();
        assert!(err(fp16.codec(DType::BF16, None)).contains("loses precision"));
        assert!(Quantization::parse("int3", None).unwrap_err().to_string().contains("unknown quantization"));
        assert!(Quantization::parse("int8", Some(4)).unwrap_err().to_string().contains("8 to 32768"));
        assert!(Quantization::parse("bf16", Some(64)).unwrap_err().to_string().contains("casts every element"));
    }
}
