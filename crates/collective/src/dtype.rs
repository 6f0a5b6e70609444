//! Element types, reduction operators and collective kinds, with their stable wire codes.

/// An element type. Codes are part of the wire format: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16 (the upper half of an f32).
    BF16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
}

impl DType {
    /// Every type, in code order.
    pub const ALL: [DType; 12] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The short name used by the Python API (`"f32"`, `"bf16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::U16 => "u16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// Parses a name written by [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Wire code.
    pub fn code(self) -> u8 {
        self as u8 + 1
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

/// A reduction operator. Codes are part of the wire format: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (integers wrap on overflow).
    Sum,
    /// Sum divided by the number of participants (integers: truncating division).
    Avg,
    /// Product (integers wrap on overflow).
    Prod,
    /// Minimum (floats: NaN if either side is NaN, like `numpy.minimum`).
    Min,
    /// Maximum (floats: NaN if either side is NaN, like `numpy.maximum`).
    Max,
}

impl ReduceOp {
    /// Every operator, in code order.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

    /// The name used by the Python API.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// Parses a name written by [`ReduceOp::name`].
    pub fn from_name(name: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| o.name() == name)
    }

    /// Wire code.
    pub fn code(self) -> u8 {
        self as u8 + 1
    }

    /// Inverse of [`ReduceOp::code`].
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }
}

/// Which collective an operation is. Codes are part of the wire format: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// Every member ends with the reduction of every member's buffer.
    AllReduce,
    /// Every member ends with every member's block, in rank order.
    AllGather,
    /// Member `r` ends with the reduction of every member's block `r`.
    ReduceScatter,
    /// Every member ends with the root's buffer.
    Broadcast,
    /// Every member has called it: each member's one byte reached every other (which shows it
    /// called), so a member lost before it called fails the barrier on every survivor.
    Barrier,
}

impl CollectiveKind {
    /// Every kind.
    pub const ALL: [CollectiveKind; 5] = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
    ];

    /// Wire code.
    pub fn code(self) -> u8 {
        match self {
            CollectiveKind::AllReduce => 1,
            CollectiveKind::AllGather => 2,
            CollectiveKind::ReduceScatter => 3,
            CollectiveKind::Broadcast => 4,
            CollectiveKind::Barrier => 5,
        }
    }

    /// The kind of wire code `code`.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.code() == code)
    }

    /// Name for errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(o.code()), Some(o));
            assert_eq!(ReduceOp::from_name(o.name()), Some(o));
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::from_code(13), None);
        assert_eq!(ReduceOp::from_code(6), None);
        for k in CollectiveKind::ALL {
            assert_eq!(CollectiveKind::from_code(k.code()), Some(k));
        }
    }
}
