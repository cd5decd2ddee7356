//! NumPy at the boundary. Going in, a field's value is inspected while the GIL is held (dtype,
//! shape, where its bytes are) and copied once into a chunk after the GIL is released. Coming
//! out, cells become read-only NumPy arrays that view the chunk directly; each array keeps its
//! chunk alive through its `base` object, so no copy is made and nothing dangles.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use asyncflow_core::{
    Cell, Chunk, ChunkLayout, Column, DType, FieldSchema, MemoryGuard, StoreError,
};
use asyncflow_server::client::PutColumn;
use numpy::npyffi::{self, NPY_ARRAY_CARRAY_RO, NpyTypes, PY_ARRAY_API, npy_intp};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::errors::to_py;

fn schema_err(field: &str, msg: impl std::fmt::Display) -> PyErr {
    to_py(StoreError::schema(format!("field {field:?}: {msg}")))
}

/// The store dtype of a NumPy dtype, if the store can hold it.
fn store_dtype(descr: &Bound<'_, PyArrayDescr>) -> Option<DType> {
    Some(match (descr.kind(), descr.itemsize()) {
        (b'b', 1) => DType::Bool,
        (b'u', 1) => DType::U8,
        (b'i', 1) => DType::I8,
        (b'i', 2) => DType::I16,
        (b'i', 4) => DType::I32,
        (b'i', 8) => DType::I64,
        (b'f', 2) => DType::F16,
        (b'f', 4) => DType::F32,
        (b'f', 8) => DType::F64,
        _ => return None,
    })
}

/// Applies an explicit dtype (`"bf16"` over 2-byte integers, `"bytes"` over u8) to an array's
/// natural one.
fn resolve_dtype(
    field: &str,
    descr: &Bound<'_, PyArrayDescr>,
    explicit: Option<&str>,
) -> PyResult<DType> {
    let natural = store_dtype(descr);
    let Some(name) = explicit else {
        return natural.ok_or_else(|| {
            schema_err(field, format!("dtype {descr} is not supported (bool, uint8, int8, int16, int32, int64, float16, float32, float64)"))
        });
    };
    let wanted = DType::from_name(name).map_err(to_py)?;
    let ok = match wanted {
        DType::BF16 => matches!(descr.kind(), b'u' | b'i') && descr.itemsize() == 2,
        DType::Bytes => natural == Some(DType::U8),
        other => natural == Some(other),
    };
    if ok {
        Ok(wanted)
    } else {
        Err(schema_err(field, format!("an array of dtype {descr} cannot be stored as {wanted}")))
    }
}

/// A byte range of a live Python object, carried across the GIL release.
#[derive(Clone, Copy)]
struct RawSlice {
    ptr: usize,
    len: usize,
}

impl RawSlice {
    /// # Safety
    /// The object the range belongs to must be alive and unmodified while the slice is used.
    unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

fn array_bytes(field: &str, arr: &Bound<'_, PyUntypedArray>) -> PyResult<RawSlice> {
    if !arr.is_c_contiguous() {
        return Err(schema_err(field, "array is not C-contiguous (pass np.ascontiguousarray(x))"));
    }
    if arr.dtype().is_native_byteorder() == Some(false) {
        return Err(schema_err(field, "array is not in native byte order"));
    }
    let len = arr.len() * arr.dtype().itemsize();
    // SAFETY: `arr` is a live NumPy array; reading its data pointer is a field access.
    let ptr = unsafe { (*arr.as_array_ptr()).fields.data } as usize;
    if !ptr.is_multiple_of(arr.dtype().itemsize().max(1)) {
        return Err(schema_err(field, "array data is not aligned"));
    }
    Ok(RawSlice { ptr, len })
}

/// One field of a put, read off its Python value while the GIL is held.
pub struct PendingColumn {
    name: String,
    schema: FieldSchema,
    layout: ChunkLayout,
    /// One source per cell, or one source for all cells when they are already contiguous.
    sources: Vec<RawSlice>,
    first_dims: Vec<u64>,
}

impl PendingColumn {
    /// Reads `value`: a NumPy array whose first axis is rows, or a list of per-row arrays
    /// (or of `bytes` objects).
    pub fn inspect(name: &str, value: &Bound<'_, PyAny>, dtype: Option<&str>) -> PyResult<Self> {
        if let Ok(arr) = value.cast::<PyUntypedArray>() {
            return Self::stacked(name, arr, dtype);
        }
        if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
            let items: Vec<Bound<'_, PyAny>> = value.try_iter()?.collect::<PyResult<_>>()?;
            if items.first().is_some_and(PyAnyMethods::is_instance_of::<PyBytes>) {
                return Self::bytes(name, &items);
            }
            return Self::cells(name, &items, dtype);
        }
        Err(schema_err(
            name,
            format!("expected a NumPy array or a list of arrays, got {}", value.get_type().name()?),
        ))
    }

    fn stacked(name: &str, arr: &Bound<'_, PyUntypedArray>, dtype: Option<&str>) -> PyResult<Self> {
        let dtype = resolve_dtype(name, &arr.dtype(), dtype)?;
        let shape: Vec<u64> = arr.shape().iter().map(|&d| d as u64).collect();
        let Some((&rows, cell_shape)) = shape.split_first() else {
            return Err(schema_err(name, "a 0-d array has no rows; wrap it in a list"));
        };
        let schema = match cell_shape.split_first() {
            None => FieldSchema::scalar(dtype),
            Some((_, trailing)) => FieldSchema::ragged(dtype, trailing.to_vec()),
        };
        schema.validate().map_err(to_py)?;
        let first_dim = cell_shape.first().copied().unwrap_or(1);
        let cell_bytes = usize::try_from(schema.cell_bytes(first_dim).map_err(to_py)?)
            .map_err(|_| schema_err(name, "a cell is larger than this machine can address"))?;
        let source = array_bytes(name, arr)?;
        Ok(Self {
            name: name.to_owned(),
            schema,
            layout: ChunkLayout::contiguous(std::iter::repeat_n(cell_bytes, rows as usize)),
            sources: vec![source],
            first_dims: vec![first_dim; rows as usize],
        })
    }

    fn cells(name: &str, items: &[Bound<'_, PyAny>], dtype: Option<&str>) -> PyResult<Self> {
        let mut schema: Option<FieldSchema> = None;
        let mut sources = Vec::with_capacity(items.len());
        let mut first_dims = Vec::with_capacity(items.len());
        for (k, item) in items.iter().enumerate() {
            let arr = item.cast::<PyUntypedArray>().map_err(|_| {
                schema_err(
                    name,
                    format!("row {k} is not a NumPy array (the wrapper converts lists)"),
                )
            })?;
            let d = resolve_dtype(name, &arr.dtype(), dtype)?;
            let shape: Vec<u64> = arr.shape().iter().map(|&s| s as u64).collect();
            let this = match shape.split_first() {
                None => FieldSchema::scalar(d),
                Some((_, trailing)) => FieldSchema::ragged(d, trailing.to_vec()),
            };
            match &schema {
                None => schema = Some(this.clone()),
                Some(s) if *s != this => {
                    return Err(schema_err(name, format!("row {k} is {this}, row 0 is {s}")));
                }
                Some(_) => {}
            }
            sources.push(array_bytes(name, arr)?);
            first_dims.push(shape.first().copied().unwrap_or(1));
        }
        let schema = schema.ok_or_else(|| schema_err(name, "no rows given"))?;
        schema.validate().map_err(to_py)?;
        Ok(Self {
            name: name.to_owned(),
            layout: ChunkLayout::packed(sources.iter().map(|s| s.len)),
            schema,
            sources,
            first_dims,
        })
    }

    /// Reads a ragged column given as one array whose first axis runs through every row's cells
    /// in turn, and each row's length along it: row `i` is `values[start_i..start_i +
    /// lengths[i]]`. The cells are views of the one array, copied once as any others.
    pub fn ragged(
        name: &str,
        values: &Bound<'_, PyAny>,
        lengths: &[u64],
        dtype: Option<&str>,
    ) -> PyResult<Self> {
        let arr = values
            .cast::<PyUntypedArray>()
            .map_err(|_| schema_err(name, "ragged values must be a NumPy array"))?;
        let dtype = resolve_dtype(name, &arr.dtype(), dtype)?;
        let Some((&total, trailing)) = arr.shape().split_first() else {
            return Err(schema_err(name, "ragged values must have at least one axis"));
        };
        if lengths.is_empty() {
            return Err(schema_err(name, "no rows given"));
        }
        let given = lengths.iter().try_fold(0u64, |sum, &n| sum.checked_add(n));
        if given != Some(total as u64) {
            return Err(schema_err(
                name,
                format!(
                    "the row lengths add up to {}, the values have {total}",
                    given.map_or_else(|| "more than 2**64".to_owned(), |g| g.to_string())
                ),
            ));
        }
        let schema = FieldSchema::ragged(dtype, trailing.iter().map(|&d| d as u64).collect());
        schema.validate().map_err(to_py)?;
        let whole = array_bytes(name, arr)?;
        let per_item = whole.len.checked_div(total).unwrap_or(0);
        let mut sources = Vec::with_capacity(lengths.len());
        let mut at = 0usize;
        for &n in lengths {
            // Within `whole`: the lengths add up to its first axis.
            let len = n as usize * per_item;
            sources.push(RawSlice { ptr: whole.ptr + at, len });
            at += len;
        }
        Ok(Self {
            name: name.to_owned(),
            layout: ChunkLayout::packed(sources.iter().map(|s| s.len)),
            schema,
            sources,
            first_dims: lengths.to_vec(),
        })
    }

    fn bytes(name: &str, items: &[Bound<'_, PyAny>]) -> PyResult<Self> {
        let mut sources = Vec::with_capacity(items.len());
        for (k, item) in items.iter().enumerate() {
            let b = item
                .cast::<PyBytes>()
                .map_err(|_| schema_err(name, format!("row {k} is not bytes like row 0")))?;
            let data = b.as_bytes();
            sources.push(RawSlice { ptr: data.as_ptr() as usize, len: data.len() });
        }
        Ok(Self {
            name: name.to_owned(),
            schema: FieldSchema::ragged(DType::Bytes, vec![]),
            layout: ChunkLayout::packed(sources.iter().map(|s| s.len)),
            first_dims: sources.iter().map(|s| s.len as u64).collect(),
            sources,
        })
    }

    /// The column's cells as byte slices, for sending to a daemon.
    ///
    /// # Safety
    /// The Python objects inspected by [`PendingColumn::inspect`] must stay alive and unmodified
    /// while the returned column is used.
    pub unsafe fn as_put_column(&self) -> PutColumn<'_> {
        let cells = if let [whole] = self.sources.as_slice() {
            // SAFETY: forwarded from the caller.
            let bytes = unsafe { whole.as_slice() };
            self.layout.spans.iter().map(|&(offset, len)| &bytes[offset..offset + len]).collect()
        } else {
            // SAFETY: forwarded from the caller.
            self.sources.iter().map(|s| unsafe { s.as_slice() }).collect::<Vec<_>>()
        };
        PutColumn {
            name: self.name.clone(),
            schema: self.schema.clone(),
            cells: cells.into_iter().zip(self.first_dims.iter().copied()).collect(),
        }
    }

    /// Bytes this column will occupy in the store.
    pub fn bytes_needed(&self) -> u64 {
        self.layout.total as u64
    }

    /// Copies the column into a chunk paid for by `accounting`.
    ///
    /// # Safety
    /// The Python objects inspected by [`PendingColumn::inspect`] must still be alive and
    /// unmodified.
    pub unsafe fn into_column(self, accounting: MemoryGuard) -> Column {
        let chunk = if let [whole] = self.sources.as_slice() {
            // SAFETY: forwarded from the caller.
            let bytes = unsafe { whole.as_slice() };
            let all = ChunkLayout::contiguous([bytes.len()]);
            asyncflow_core::copy_into_chunk(&all, &[bytes], Some(accounting))
        } else {
            // SAFETY: forwarded from the caller.
            let slices: Vec<&[u8]> = self.sources.iter().map(|s| unsafe { s.as_slice() }).collect();
            asyncflow_core::copy_into_chunk(&self.layout, &slices, Some(accounting))
        };
        let cells = self
            .layout
            .spans
            .iter()
            .zip(&self.first_dims)
            .map(|(&(offset, len), &first_dim)| Cell {
                chunk: Arc::clone(&chunk),
                offset,
                len,
                first_dim,
            })
            .collect();
        Column { name: self.name, schema: self.schema, cells }
    }
}

/// Keeps a chunk alive for as long as NumPy arrays view it.
#[pyclass(module = "asyncflow._native", frozen)]
pub struct ChunkOwner {
    chunk: Arc<Chunk>,
}

#[pymethods]
impl ChunkOwner {
    /// Size of the chunk in bytes.
    fn __len__(&self) -> usize {
        self.chunk.len()
    }
}

fn descr(py: Python<'_>, dtype: DType) -> Bound<'_, PyArrayDescr> {
    match dtype {
        DType::Bool => numpy::dtype::<bool>(py),
        DType::U8 | DType::Bytes => numpy::dtype::<u8>(py),
        DType::I8 => numpy::dtype::<i8>(py),
        DType::I16 => numpy::dtype::<i16>(py),
        DType::I32 => numpy::dtype::<i32>(py),
        DType::I64 => numpy::dtype::<i64>(py),
        DType::F16 => {
            // SAFETY: a plain descriptor lookup by type number.
            unsafe {
                let raw = PY_ARRAY_API.PyArray_DescrFromType(py, npyffi::NPY_TYPES::NPY_HALF as _);
                Bound::from_owned_ptr(py, raw.cast()).cast_into_unchecked()
            }
        }
        // bf16 has no NumPy dtype; its bits are shown as uint16 (torch views them as bfloat16).
        DType::BF16 => numpy::dtype::<u16>(py),
        DType::F32 => numpy::dtype::<f32>(py),
        DType::F64 => numpy::dtype::<f64>(py),
    }
}

/// Turns cells into Python values: read-only NumPy views for numeric fields, `bytes` (a copy)
/// for bytes fields. Cells sharing a chunk share one owner object.
pub struct CellViews<'py> {
    py: Python<'py>,
    owners: HashMap<*const Chunk, Bound<'py, ChunkOwner>>,
}

impl<'py> CellViews<'py> {
    pub fn new(py: Python<'py>) -> Self {
        Self { py, owners: HashMap::new() }
    }

    pub fn view(&mut self, schema: &FieldSchema, cell: &Cell) -> PyResult<Bound<'py, PyAny>> {
        if schema.dtype == DType::Bytes {
            return Ok(PyBytes::new(self.py, cell.bytes()).into_any());
        }
        let key = Arc::as_ptr(&cell.chunk);
        let owner = if let Some(o) = self.owners.get(&key) {
            o.clone()
        } else {
            let o = Bound::new(self.py, ChunkOwner { chunk: Arc::clone(&cell.chunk) })?;
            self.owners.insert(key, o.clone());
            o
        };
        // Checked again here, with checked arithmetic, rather than trusted: the array below
        // reads exactly `cell_bytes` bytes, so they must be the cell's.
        let cell_bytes = schema.cell_bytes(cell.first_dim).map_err(to_py)?;
        if cell_bytes != cell.len as u64 {
            return Err(to_py(StoreError::schema(format!(
                "a {schema} cell of first dimension {} needs {cell_bytes} bytes, not {}",
                cell.first_dim, cell.len
            ))));
        }
        let mut dims = schema
            .cell_shape(cell.first_dim)
            .iter()
            .map(|&d| npy_intp::try_from(d))
            .collect::<Result<Vec<npy_intp>, _>>()
            .map_err(|_| to_py(StoreError::schema(format!("a {schema} cell is too large"))))?;
        let data = cell.bytes().as_ptr().cast_mut().cast::<c_void>();
        let py = self.py;
        // SAFETY: `data` points at `cell.len` bytes, which is exactly what `dims` and the dtype
        // need laid out C-contiguously (checked just above, without overflow); the array is
        // created read-only and its base is `owner`, which holds the chunk alive for the
        // array's lifetime.
        unsafe {
            let array_type = npyffi::get_type_object(py, NpyTypes::PyArray_Type);
            let raw = PY_ARRAY_API.PyArray_NewFromDescr(
                py,
                array_type,
                descr(py, schema.dtype).into_ptr().cast(),
                dims.len() as i32,
                dims.as_mut_ptr(),
                std::ptr::null_mut(),
                data,
                NPY_ARRAY_CARRAY_RO,
                std::ptr::null_mut(),
            );
            if raw.is_null() {
                return Err(PyErr::fetch(py));
            }
            let array = Bound::from_owned_ptr(py, raw);
            if PY_ARRAY_API.PyArray_SetBaseObject(py, raw.cast(), owner.into_ptr()) != 0 {
                return Err(PyErr::fetch(py));
            }
            Ok(array)
        }
    }
}
