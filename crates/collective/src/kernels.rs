//! Element-wise reduction kernels over byte buffers.
//!
//! Buffers arrive as bytes (from a socket, or a user's tensor viewed as bytes) and are viewed as
//! typed slices with `bytemuck`, which checks alignment. The loops are simple enough for the
//! compiler to vectorise the common cases (sums, products, min and max of integers and f32/f64).
//! f16 and bf16 are computed in f32 and rounded back, once per element per step, so the result
//! depends only on the schedule's fixed accumulation order.

use crate::{DType, ReduceOp};
use half::{bf16, f16};

/// Why a kernel refused its buffers. These are bugs of the caller or a misaligned user buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The buffers differ in length, or the length is not a whole number of elements.
    #[error("buffer lengths {dst} and {src} do not match or are not multiples of {elem} bytes")]
    Length {
        /// Destination length in bytes.
        dst: usize,
        /// Source length in bytes.
        src: usize,
        /// Element size.
        elem: usize,
    },
    /// A buffer is not aligned to its element size.
    #[error("buffer is not aligned to its {elem}-byte element size")]
    Misaligned {
        /// Element size.
        elem: usize,
    },
}

/// Computes `dst[i] = dst[i] op src[i]` for every element. [`ReduceOp::Avg`] sums here; the
/// owner of the final value divides once with [`finish_avg`].
///
/// # Errors
/// [`KernelError`] if the buffers differ in length or are misaligned for `dtype`.
///
/// # Examples
/// ```
/// use shoal_collective::{reduce_into, DType, ReduceOp};
/// let mut dst = 3i32.to_le_bytes().to_vec();
/// reduce_into(DType::I32, ReduceOp::Max, &mut dst, &7i32.to_le_bytes()).unwrap();
/// assert_eq!(dst, 7i32.to_le_bytes());
/// ```
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    let elem = dtype.size();
    if dst.len() != src.len() || !dst.len().is_multiple_of(elem) {
        return Err(KernelError::Length { dst: dst.len(), src: src.len(), elem });
    }
    // Nothing to reduce, wherever it points (numpy gives an empty array any address).
    if dst.is_empty() {
        return Ok(());
    }
    match dtype {
        DType::U8 => int_u8(op, dst, src),
        DType::I8 => int_i8(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::I16 => int_i16(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::U16 => int_u16(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::I32 => int_i32(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::U32 => int_u32(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::I64 => int_i64(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::U64 => int_u64(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::F32 => float_f32(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::F64 => float_f64(op, cast_mut(dst, elem)?, cast(src, elem)?),
        DType::F16 => {
            let (d, s): (&mut [f16], &[f16]) = (cast_mut(dst, elem)?, cast(src, elem)?);
            via_f32(op, d, s, f16::to_f32, f16::from_f32)
        }
        DType::BF16 => {
            let (d, s): (&mut [bf16], &[bf16]) = (cast_mut(dst, elem)?, cast(src, elem)?);
            via_f32(op, d, s, bf16::to_f32, bf16::from_f32)
        }
    }
    Ok(())
}

/// Divides every element by `count`, turning a sum into an average. Integers use truncating
/// division; floats divide (not multiply by a reciprocal), f16/bf16 in f32.
///
/// # Errors
/// [`KernelError`] if the buffer is misaligned or not a whole number of elements.
///
/// # Panics
/// If `count` is zero.
pub fn finish_avg(dtype: DType, buf: &mut [u8], count: usize) -> Result<(), KernelError> {
    assert!(count > 0, "average over zero participants");
    let elem = dtype.size();
    if !buf.len().is_multiple_of(elem) {
        return Err(KernelError::Length { dst: buf.len(), src: buf.len(), elem });
    }
    if buf.is_empty() {
        return Ok(());
    }
    macro_rules! div_int {
        ($t:ty) => {{
            let n = count as $t;
            cast_mut::<$t>(buf, elem)?.iter_mut().for_each(|x| *x /= n)
        }};
    }
    match dtype {
        DType::U8 => buf.iter_mut().for_each(|x| *x /= count as u8),
        DType::I8 => div_int!(i8),
        DType::I16 => div_int!(i16),
        DType::U16 => div_int!(u16),
        DType::I32 => div_int!(i32),
        DType::U32 => div_int!(u32),
        DType::I64 => div_int!(i64),
        DType::U64 => div_int!(u64),
        DType::F32 => cast_mut::<f32>(buf, elem)?.iter_mut().for_each(|x| *x /= count as f32),
        DType::F64 => cast_mut::<f64>(buf, elem)?.iter_mut().for_each(|x| *x /= count as f64),
        DType::F16 => {
            cast_mut::<f16>(buf, elem)?.iter_mut().for_each(|x| *x = f16::from_f32(x.to_f32() / count as f32))
        }
        DType::BF16 => {
            cast_mut::<bf16>(buf, elem)?.iter_mut().for_each(|x| *x = bf16::from_f32(x.to_f32() / count as f32))
        }
    }
    Ok(())
}

fn cast_mut<T: bytemuck::Pod>(bytes: &mut [u8], elem: usize) -> Result<&mut [T], KernelError> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| KernelError::Misaligned { elem })
}

fn cast<T: bytemuck::Pod>(bytes: &[u8], elem: usize) -> Result<&[T], KernelError> {
    bytemuck::try_cast_slice(bytes).map_err(|_| KernelError::Misaligned { elem })
}

macro_rules! int_kernel {
    ($name:ident, $t:ty) => {
        fn $name(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
            let pairs = dst.iter_mut().zip(src);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(d, s)| *d = d.wrapping_add(*s)),
                ReduceOp::Prod => pairs.for_each(|(d, s)| *d = d.wrapping_mul(*s)),
                ReduceOp::Min => pairs.for_each(|(d, s)| *d = (*d).min(*s)),
                ReduceOp::Max => pairs.for_each(|(d, s)| *d = (*d).max(*s)),
            }
        }
    };
}
int_kernel!(int_u8, u8);
int_kernel!(int_i8, i8);
int_kernel!(int_i16, i16);
int_kernel!(int_u16, u16);
int_kernel!(int_i32, i32);
int_kernel!(int_u32, u32);
int_kernel!(int_i64, i64);
int_kernel!(int_u64, u64);

macro_rules! float_kernel {
    ($name:ident, $t:ty) => {
        fn $name(op: ReduceOp, dst: &mut [$t], src: &[$t]) {
            let pairs = dst.iter_mut().zip(src);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(d, s)| *d += *s),
                ReduceOp::Prod => pairs.for_each(|(d, s)| *d *= *s),
                ReduceOp::Min => pairs.for_each(|(d, s)| *d = nan_min(*d, *s)),
                ReduceOp::Max => pairs.for_each(|(d, s)| *d = nan_max(*d, *s)),
            }
        }
    };
}
float_kernel!(float_f32, f32);
float_kernel!(float_f64, f64);

fn via_f32<T: Copy>(op: ReduceOp, dst: &mut [T], src: &[T], up: fn(T) -> f32, down: fn(f32) -> T) {
    let combine: fn(f32, f32) -> f32 = match op {
        ReduceOp::Sum | ReduceOp::Avg => |a, b| a + b,
        ReduceOp::Prod => |a, b| a * b,
        ReduceOp::Min => nan_min,
        ReduceOp::Max => nan_max,
    };
    for (d, s) in dst.iter_mut().zip(src) {
        *d = down(combine(up(*d), up(*s)));
    }
}

/// `numpy.minimum` semantics: NaN if either operand is NaN.
#[inline]
#[allow(clippy::eq_op)] // `x != x` is the generic NaN test.
fn nan_min<T: PartialOrd + Copy>(a: T, b: T) -> T {
    if a != a {
        a
    } else if b != b || b < a {
        b
    } else {
        a
    }
}

/// `numpy.maximum` semantics: NaN if either operand is NaN.
#[inline]
#[allow(clippy::eq_op)]
fn nan_max<T: PartialOrd + Copy>(a: T, b: T) -> T {
    if a != a {
        a
    } else if b != b || b > a {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn float_min_max_propagate_nan_like_numpy() {
        let mut d = bytes_f32(&[1.0, f32::NAN, 3.0, 2.0]);
        reduce_into(DType::F32, ReduceOp::Min, &mut d, &bytes_f32(&[f32::NAN, 0.0, 1.0, 5.0])).unwrap();
        let got: Vec<f32> = bytemuck::cast_slice(&d).to_vec();
        assert!(got[0].is_nan() && got[1].is_nan());
        assert_eq!(&got[2..], &[1.0, 2.0]);
    }

    #[test]
    fn mismatched_or_misaligned_buffers_are_refused() {
        let mut d = vec![0u8; 8];
        assert!(matches!(reduce_into(DType::F32, ReduceOp::Sum, &mut d, &[0u8; 4]), Err(KernelError::Length { .. })));
        let mut backing = vec![0u64; 3];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut backing);
        let src = [0u8; 8];
        assert_eq!(
            reduce_into(DType::F64, ReduceOp::Sum, &mut bytes[1..9], &src),
            Err(KernelError::Misaligned { elem: 8 })
        );
        // Empty buffers have nothing to align: a one-shot fold of an empty tensor once panicked.
        assert_eq!(reduce_into(DType::F64, ReduceOp::Sum, &mut bytes[1..1], &src[1..1]), Ok(()));
        assert_eq!(finish_avg(DType::F64, &mut bytes[1..1], 2), Ok(()));
    }

    #[test]
    fn integer_average_truncates_and_sum_wraps() {
        let mut d = vec![250u8, 7];
        reduce_into(DType::U8, ReduceOp::Sum, &mut d, &[10, 0]).unwrap();
        assert_eq!(d, [4, 7]);
        finish_avg(DType::U8, &mut d, 2).unwrap();
        assert_eq!(d, [2, 3]);
    }
}
