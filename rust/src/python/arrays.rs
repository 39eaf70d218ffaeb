//! Reading numpy arrays without copying, with errors that say what was wrong.

use numpy::{
    dtype, Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// Values of one of the accepted element types, borrowed read-only from numpy.
pub enum Values<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    F16(PyReadonlyArrayDyn<'py, half::f16>),
    /// bfloat16 bit patterns passed as uint16.
    Bf16(PyReadonlyArrayDyn<'py, u16>),
    /// bfloat16 bit patterns passed as int16 (what `tensor.view(torch.int16)` gives).
    Bf16Signed(PyReadonlyArrayDyn<'py, i16>),
}

/// The array itself, or a TypeError naming what was passed instead.
pub fn as_ndarray<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    context: &str,
) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    obj.cast::<PyUntypedArray>().map_err(|_| {
        let kind = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        PyTypeError::new_err(format!(
            "{context}: expected a numpy.ndarray, got {kind}; convert with numpy.asarray(...) \
             (a torch tensor: t.detach().cpu().numpy())"
        ))
    })
}

pub fn dtype_name(array: &Bound<'_, PyUntypedArray>) -> String {
    array
        .dtype()
        .str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into())
}

pub fn is<T: Element>(array: &Bound<'_, PyUntypedArray>) -> bool {
    array.dtype().is_equiv_to(&dtype::<T>(array.py()))
}

pub fn readonly<'py, T: Element>(
    array: &Bound<'py, PyUntypedArray>,
    context: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let typed = array
        .cast::<PyArrayDyn<T>>()
        .map_err(|e| PyTypeError::new_err(format!("{context}: {e}")))?;
    typed
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("{context}: cannot borrow the array: {e}")))
}

/// Require C order (or, when `any_order`, either C or Fortran order: for a multiset of
/// values the order does not matter).
pub fn check_contiguous(
    array: &Bound<'_, PyUntypedArray>,
    context: &str,
    any_order: bool,
) -> PyResult<()> {
    let ok = array.is_c_contiguous() || (any_order && array.is_fortran_contiguous());
    if ok {
        Ok(())
    } else {
        let wanted = if any_order {
            "contiguous"
        } else {
            "C-contiguous"
        };
        Err(PyValueError::new_err(format!(
            "{context}: the array is not {wanted} (strides {:?}); pass numpy.ascontiguousarray(x)",
            array.strides()
        )))
    }
}

/// Read float32 / float16 values, or bfloat16 bit patterns (uint16 / int16) when `bf16`.
pub fn read_values<'py>(
    obj: &Bound<'py, PyAny>,
    bf16: bool,
    context: &str,
    any_order: bool,
) -> PyResult<Values<'py>> {
    let array = as_ndarray(obj, context)?;
    let values = if bf16 {
        if is::<u16>(array) {
            Values::Bf16(readonly(array, context)?)
        } else if is::<i16>(array) {
            Values::Bf16Signed(readonly(array, context)?)
        } else {
            return Err(PyTypeError::new_err(format!(
                "{context}: bf16=True expects the bfloat16 bit patterns as uint16 or int16, got \
                 dtype {} (from torch: t.view(torch.int16).numpy())",
                dtype_name(array)
            )));
        }
    } else if is::<f32>(array) {
        Values::F32(readonly(array, context)?)
    } else if is::<half::f16>(array) {
        Values::F16(readonly(array, context)?)
    } else {
        let hint = if is::<u16>(array) || is::<i16>(array) {
            "; for bfloat16 bit patterns pass bf16=True"
        } else {
            "; convert with x.astype(numpy.float32)"
        };
        return Err(PyTypeError::new_err(format!(
            "{context}: expected float32 or float16 values, got dtype {}{hint}",
            dtype_name(array)
        )));
    };
    check_contiguous(array, context, any_order)?;
    Ok(values)
}

/// View int16 bit patterns as uint16.
pub fn as_unsigned(bits: &[i16]) -> &[u16] {
    // SAFETY: i16 and u16 have the same size and alignment, and every bit pattern is valid.
    unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<u16>(), bits.len()) }
}
