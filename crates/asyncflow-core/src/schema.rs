//! Field schemas: an element type plus the shape of one cell. A cell is either a scalar or an
//! array whose first dimension varies from row to row (stored unpadded) and whose trailing
//! dimensions are fixed by the field's first write.

use std::fmt;

use crate::error::{Result, StoreError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    Bool = 0,
    U8 = 1,
    I32 = 2,
    I64 = 3,
    F16 = 4,
    BF16 = 5,
    F32 = 6,
    F64 = 7,
    /// Opaque bytes (text, serialised records); a cell is a 1-D run of bytes.
    Bytes = 8,
    I8 = 9,
    I16 = 10,
}

impl DType {
    /// Indexed by code: a new dtype takes the next code, so older peers' codes keep meaning.
    pub const ALL: [DType; 11] = [
        DType::Bool,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::Bytes,
        DType::I8,
        DType::I16,
    ];

    pub fn item_size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::Bytes => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::Bytes => "bytes",
        }
    }

    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| StoreError::bad_request(format!("unknown dtype {name:?}")))
    }

    pub fn from_code(code: u8) -> Result<Self> {
        Self::ALL
            .get(usize::from(code))
            .copied()
            .ok_or_else(|| StoreError::bad_request(format!("unknown dtype code {code}")))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The most bytes one cell may have, and the largest dimension: what an array (NumPy's
/// `npy_intp`, Rust's `isize`) can index.
pub const MAX_CELL_BYTES: u64 = i64::MAX as u64;
pub const MAX_DIM: u64 = i64::MAX as u64;

/// The fixed part of a field's cells.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FieldSchema {
    pub dtype: DType,
    /// `None`: every cell is a scalar. `Some(trailing)`: a cell has shape `(n, *trailing)` with
    /// `n` free per row.
    pub trailing: Option<Vec<u64>>,
}

impl FieldSchema {
    pub fn scalar(dtype: DType) -> Self {
        Self { dtype, trailing: None }
    }

    pub fn ragged(dtype: DType, trailing: Vec<u64>) -> Self {
        Self { dtype, trailing: Some(trailing) }
    }

    /// Checks the schema is one the store can hold: every size it implies is countable.
    pub fn validate(&self) -> Result<()> {
        if self.dtype == DType::Bytes && self.trailing.as_ref().is_none_or(|t| !t.is_empty()) {
            return Err(StoreError::schema("a bytes field holds one 1-D run of bytes per row"));
        }
        self.row_stride().map(|_| ())
    }

    /// Bytes taken by one step of the first dimension (or by a scalar cell); a schema error if
    /// that is more than [`MAX_CELL_BYTES`] or a dimension is more than an array can have.
    pub fn row_stride(&self) -> Result<u64> {
        let mut stride = self.dtype.item_size() as u64;
        for &d in self.trailing.iter().flatten() {
            if d > MAX_DIM {
                return Err(StoreError::schema(format!("{self}: dimension {d} is too large")));
            }
            stride = stride.checked_mul(d).filter(|&b| b <= MAX_CELL_BYTES).ok_or_else(|| {
                StoreError::schema(format!("{self}: one row of a cell has too many bytes"))
            })?;
        }
        Ok(stride)
    }

    /// The shape of a cell whose first dimension is `first_dim` (ignored for scalars).
    pub fn cell_shape(&self, first_dim: u64) -> Vec<u64> {
        match &self.trailing {
            None => Vec::new(),
            Some(trailing) => std::iter::once(first_dim).chain(trailing.iter().copied()).collect(),
        }
    }

    /// Bytes of a cell whose first dimension is `first_dim` (ignored for scalars); a schema
    /// error if the cell could not exist: more than [`MAX_CELL_BYTES`] bytes, or a dimension
    /// more than an array can have.
    pub fn cell_bytes(&self, first_dim: u64) -> Result<u64> {
        let stride = self.row_stride()?;
        if self.trailing.is_none() {
            return Ok(stride);
        }
        if first_dim > MAX_DIM {
            return Err(StoreError::schema(format!(
                "a {self} cell of first dimension {first_dim} is too large"
            )));
        }
        stride.checked_mul(first_dim).filter(|&b| b <= MAX_CELL_BYTES).ok_or_else(|| {
            StoreError::schema(format!(
                "a {self} cell of first dimension {first_dim} has too many bytes"
            ))
        })
    }
}

impl fmt::Display for FieldSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.trailing {
            None => write!(f, "{} scalar", self.dtype),
            Some(trailing) => {
                write!(f, "{}[*", self.dtype)?;
                for d in trailing {
                    write!(f, ", {d}")?;
                }
                f.write_str("]")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_and_codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()).unwrap(), d);
            assert_eq!(DType::from_code(d as u8).unwrap(), d);
        }
        assert!(DType::from_name("f128").is_err());
        assert!(DType::from_code(200).is_err());
    }

    #[test]
    fn cell_sizes_follow_the_shape() {
        let s = FieldSchema::ragged(DType::F32, vec![3, 2]);
        assert_eq!(s.cell_shape(5), vec![5, 3, 2]);
        assert_eq!(s.cell_bytes(5).unwrap(), 5 * 6 * 4);
        let scalar = FieldSchema::scalar(DType::F64);
        assert_eq!(scalar.cell_shape(7), Vec::<u64>::new());
        assert_eq!(scalar.cell_bytes(7).unwrap(), 8);
    }

    #[test]
    fn sizes_that_overflow_are_schema_errors_not_wrapped() {
        // (2^62 + 1) * 4 bytes wraps to 4 in 64 bits.
        let f32_rows = FieldSchema::ragged(DType::F32, vec![1]);
        let e = f32_rows.cell_bytes((1 << 62) + 1).unwrap_err();
        assert!(matches!(e, StoreError::Schema(_)), "{e}");
        // 2^32 * 2^32 wraps to 0 bytes.
        let square = FieldSchema::ragged(DType::U8, vec![1 << 32, 1 << 32]);
        assert!(matches!(square.validate(), Err(StoreError::Schema(_))));
        assert!(matches!(square.cell_bytes(0), Err(StoreError::Schema(_))));
        assert!(matches!(square.cell_bytes(1), Err(StoreError::Schema(_))));
        // A dimension an array cannot have, even with no bytes.
        let empty = FieldSchema::ragged(DType::F32, vec![0]);
        assert_eq!(empty.cell_bytes(3).unwrap(), 0);
        assert!(empty.cell_bytes(u64::MAX).is_err());
        assert!(FieldSchema::ragged(DType::F32, vec![u64::MAX, 0]).validate().is_err());
        // The largest sizes that fit are kept.
        assert_eq!(f32_rows.cell_bytes(1 << 60).unwrap(), 1 << 62);
        assert!(f32_rows.cell_bytes(1 << 61).is_err(), "2^63 bytes is past isize");
    }

    #[test]
    fn bytes_fields_must_be_one_dimensional() {
        assert!(FieldSchema::ragged(DType::Bytes, vec![]).validate().is_ok());
        assert!(FieldSchema::scalar(DType::Bytes).validate().is_err());
        assert!(FieldSchema::ragged(DType::Bytes, vec![2]).validate().is_err());
    }
}
