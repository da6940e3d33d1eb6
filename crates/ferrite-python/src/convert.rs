//! NumPy arrays to core tensors and back, without copying fixed-size data.

use bytes::Bytes;
use ferrite_core::{dispatch, engine::spec::ModelSpec, DataType, Tensor, TensorData};
use numpy::{
    ndarray::{ArrayView, IxDyn},
    npyffi, Element, PyArray, PyArrayDescr, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    prelude::*,
    types::{PyBytes, PyDict, PyList, PyString},
};

/// Keeps a NumPy array alive while the engine reads its memory in place.
struct ArrayOwner {
    _array: Py<PyAny>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is only read, and the memory it points to is kept alive by `_array`
// (a `Py` may be dropped on any thread; PyO3 defers the decref until the GIL is held).
unsafe impl Send for ArrayOwner {}

impl AsRef<[u8]> for ArrayOwner {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` points at `len` bytes of the C-contiguous array held by `_array`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// NumPy's dtype for `dt`; none for BYTES and for BF16 (NumPy has no bfloat16 of its own).
fn np_dtype(py: Python<'_>, dt: DataType) -> Option<Bound<'_, PyArrayDescr>> {
    match dt {
        DataType::Bf16 => None,
        dt => dispatch!(dt, T => Some(numpy::dtype::<T>(py)), bytes => None),
    }
}

/// The datatype an array already has (for inputs the model does not name; the core refuses them).
fn datatype_of(py: Python<'_>, d: &Bound<'_, PyArrayDescr>) -> DataType {
    DataType::ALL.into_iter().find(|&dt| np_dtype(py, dt).is_some_and(|n| n.is_equiv_to(d))).unwrap_or(DataType::Bytes)
}

/// Converts `{name: array}` for `spec`. Arrays of the model's dtype that are C-contiguous are read
/// in place; others are refused unless `copy`, which converts them.
pub fn inputs(py: Python<'_>, spec: &ModelSpec, dict: &Bound<'_, PyDict>, copy: bool) -> PyResult<Vec<Tensor>> {
    let mut out = Vec::with_capacity(dict.len());
    for (k, v) in dict.iter() {
        let name: String = k.extract().map_err(|_| PyTypeError::new_err("input names must be str"))?;
        let expected = spec.inputs.iter().find(|s| s.name == name).map(|s| s.datatype);
        out.push(input(py, &name, v, expected, copy)?);
    }
    Ok(out)
}

fn input(
    py: Python<'_>,
    name: &str,
    obj: Bound<'_, PyAny>,
    expected: Option<DataType>,
    copy: bool,
) -> PyResult<Tensor> {
    let np = py.import("numpy")?;
    let mut obj = obj;
    if obj.cast::<PyUntypedArray>().is_err() {
        if obj.hasattr("__dlpack__")? {
            // A DLPack producer (CPU): a NumPy view of the same memory.
            obj = np.call_method1("from_dlpack", (obj,))?;
        } else if copy {
            obj = np.call_method1("asarray", (obj,))?;
        } else {
            let ty = obj.get_type().name()?;
            return Err(PyTypeError::new_err(format!(
                "input '{name}': expected a numpy array or a DLPack tensor, got {ty}; pass copy=True to convert"
            )));
        }
    }
    let arr = obj.cast::<PyUntypedArray>().map_err(PyErr::from)?.clone();
    let shape = arr.shape().to_vec();
    let dt = expected.unwrap_or_else(|| datatype_of(py, &arr.dtype()));
    if dt == DataType::Bytes {
        return bytes_input(name, &arr, shape);
    }
    let (arr, raw_bf16) = match (dt, np_dtype(py, dt)) {
        (_, Some(want)) if want.is_equiv_to(&arr.dtype()) => (arr, false),
        (_, Some(want)) if copy => (arr.call_method1("astype", (want,))?.cast_into::<PyUntypedArray>()?, false),
        (DataType::Bf16, _) if is_bf16(&arr) => (arr, false),
        (DataType::Bf16, _) if copy => {
            (np.call_method1("asarray", (arr, "float32"))?.cast_into::<PyUntypedArray>()?, true)
        }
        _ => {
            let got = arr.dtype().str()?.to_string();
            let want = np_dtype(py, dt).map_or("bfloat16 (ml_dtypes)".to_string(), |d| d.to_string());
            return Err(PyTypeError::new_err(format!(
                "input '{name}': the model takes {dt} ({want}), got a {got} array; pass copy=True to convert"
            )));
        }
    };
    let arr = if arr.is_c_contiguous() {
        arr
    } else if copy {
        np.call_method1("ascontiguousarray", (arr,))?.cast_into::<PyUntypedArray>()?
    } else {
        return Err(PyValueError::new_err(format!("input '{name}' is not C-contiguous; pass copy=True to copy it")));
    };
    // SAFETY: `arr` is a live NumPy array; its data pointer is valid for `nbytes` bytes.
    let ptr = unsafe { (*arr.as_array_ptr()).fields.data } as *const u8;
    let len = arr.len() * arr.dtype().itemsize();
    let data = if raw_bf16 {
        // float32 values given with copy=True for a BF16 input: convert element by element.
        // SAFETY: a C-contiguous float32 array of `arr.len()` elements.
        let f = unsafe { std::slice::from_raw_parts(ptr.cast::<f32>(), arr.len()) };
        let b: Vec<u8> = f.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
        Bytes::from(b)
    } else {
        Bytes::from_owner(ArrayOwner { _array: arr.clone().into_any().unbind(), ptr, len })
    };
    Ok(Tensor::new(name, dt, shape, TensorData::Fixed(data)))
}

fn is_bf16(arr: &Bound<'_, PyUntypedArray>) -> bool {
    let d = arr.dtype();
    d.itemsize() == 2 && d.to_string() == "bfloat16"
}

/// BYTES: an array of `bytes` or `str` objects (copied: they are Python objects, not a buffer).
fn bytes_input(name: &str, arr: &Bound<'_, PyUntypedArray>, shape: Vec<usize>) -> PyResult<Tensor> {
    let mut items = Vec::with_capacity(arr.len());
    for item in arr.call_method0("ravel")?.try_iter()? {
        let item = item?;
        if let Ok(b) = item.cast::<PyBytes>() {
            items.push(Bytes::copy_from_slice(b.as_bytes()));
        } else if let Ok(s) = item.cast::<PyString>() {
            items.push(Bytes::copy_from_slice(s.to_cow()?.as_bytes()));
        } else {
            return Err(PyTypeError::new_err(format!("input '{name}': BYTES elements must be bytes or str")));
        }
    }
    Ok(Tensor::new(name, DataType::Bytes, shape, TensorData::Strings(items)))
}

/// The address the engine reads an input from (the debug hook behind the zero-copy test).
pub fn data_pointer(t: &Tensor) -> usize {
    match &t.data {
        TensorData::Fixed(b) => b.as_ptr() as usize,
        TensorData::Strings(_) => 0,
    }
}

/// Owns an output's bytes; NumPy arrays returned to Python use it as their `base`.
#[pyclass(frozen, module = "ferrite._native")]
pub struct OutputBuffer {
    data: Bytes,
}

#[pymethods]
impl OutputBuffer {
    fn __len__(&self) -> usize {
        self.data.len()
    }
}

fn view<'py, T: Element>(py: Python<'py>, shape: &[usize], data: Bytes) -> PyResult<Bound<'py, PyAny>> {
    let n: usize = shape.iter().product();
    let ptr = data.as_ptr().cast::<T>();
    if n == 0 || !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
        // Empty or (never from our backend) unaligned: a plain copy.
        let mut v = Vec::<T>::with_capacity(n);
        // SAFETY: `data` holds exactly `n` elements of `T` (checked by the core); unaligned reads.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), v.as_mut_ptr().cast::<u8>(), n * std::mem::size_of::<T>());
            v.set_len(n);
        }
        return Ok(PyArray::from_vec(py, v).reshape(shape.to_vec())?.into_any());
    }
    // SAFETY: `ptr` is aligned and points at `n` initialised elements of `T`, kept alive (and never
    // written) by the `OutputBuffer` that becomes the array's base.
    let view = unsafe { ArrayView::<T, IxDyn>::from_shape_ptr(IxDyn(shape), ptr) };
    let owner = Bound::new(py, OutputBuffer { data: data.clone() })?;
    let array = unsafe { PyArray::<T, IxDyn>::borrow_from_array(&view, owner.into_any()) };
    // The buffer is shared (other requests of the batch read it too): hand it out read-only.
    // SAFETY: clearing NPY_ARRAY_WRITEABLE on an array we just created.
    unsafe { (*array.as_array_ptr()).fields.flags &= !npyffi::NPY_ARRAY_WRITEABLE };
    Ok(array.into_any())
}

pub fn outputs(py: Python<'_>, tensors: Vec<Tensor>) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    for t in tensors {
        let shape = t.shape.clone();
        let value = match t.data {
            TensorData::Strings(items) => {
                let list = PyList::new(py, items.iter().map(|b| PyBytes::new(py, b)))?;
                let np = py.import("numpy")?;
                np.call_method1("array", (list, "object"))?.call_method1("reshape", (shape,))?
            }
            TensorData::Fixed(data) => match t.datatype {
                DataType::Bf16 => {
                    // NumPy has no bfloat16: widen to float32 (a copy).
                    let v: Vec<f32> =
                        data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
                    PyArray::from_vec(py, v).reshape(shape)?.into_any()
                }
                dt => {
                    dispatch!(dt, T => view::<T>(py, &shape, data)?, bytes => unreachable!("BYTES data is never raw"))
                }
            },
        };
        dict.set_item(t.name, value)?;
    }
    Ok(dict)
}
