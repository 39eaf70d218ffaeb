//! FP8 formats and emulation: `FP8_FORMATS`, `fp8_quantize`, `fp8_dequantize`, `fp8_roundtrip`.

use numpy::ndarray::ArrayViewD;
use numpy::{PyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::arrays::{as_ndarray, dtype_name, is, readonly};
use crate::fp8::{Fp8Format, FORMATS};

/// One FP8 encoding's constants.
#[pyclass(module = "loka.stats", name = "Fp8Format", frozen)]
pub struct PyFp8Format {
    inner: Fp8Format,
}

#[pymethods]
impl PyFp8Format {
    /// `"e4m3"` or `"e5m2"`.
    #[getter]
    fn name(&self) -> &'static str {
        self.inner.name
    }
    /// Largest finite magnitude.
    #[getter]
    fn max(&self) -> f64 {
        self.inner.max as f64
    }
    /// Smallest positive normal value.
    #[getter]
    fn min_normal(&self) -> f64 {
        self.inner.min_normal() as f64
    }
    /// Smallest positive subnormal value.
    #[getter]
    fn min_subnormal(&self) -> f64 {
        self.inner.min_subnormal() as f64
    }
    #[getter]
    fn mantissa_bits(&self) -> u32 {
        self.inner.mantissa_bits
    }
    #[getter]
    fn exponent_bits(&self) -> u32 {
        self.inner.exponent_bits
    }
    #[getter]
    fn bias(&self) -> i32 {
        self.inner.bias
    }
    fn __repr__(&self) -> String {
        let f = &self.inner;
        format!(
            "Fp8Format(name='{}', max={}, min_normal={:e}, min_subnormal={:e}, mantissa_bits={})",
            f.name,
            f.max,
            f.min_normal(),
            f.min_subnormal(),
            f.mantissa_bits
        )
    }
}

pub fn format_by_name(name: &str) -> PyResult<Fp8Format> {
    Fp8Format::by_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown FP8 format {name:?}; expected one of \"e4m3\", \"e5m2\""
        ))
    })
}

/// The named format and the scale as float32 (finite and positive), or a ValueError.
pub fn format_and_scale(format: &str, scale: f64, context: &str) -> PyResult<(Fp8Format, f32)> {
    let f = format_by_name(format)?;
    let s = scale as f32;
    if s.is_finite() && s > 0.0 {
        Ok((f, s))
    } else {
        Err(PyValueError::new_err(format!(
            "{context}: scale must be finite and positive in float32, got {scale}"
        )))
    }
}

/// All formats, for `FP8_FORMATS`.
#[pyfunction]
pub fn fp8_formats() -> Vec<PyFp8Format> {
    FORMATS.iter().map(|&inner| PyFp8Format { inner }).collect()
}

fn map_float32<'py, T: numpy::Element + Send>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    context: &str,
    f: impl Fn(f32) -> T + Send + Sync,
) -> PyResult<Bound<'py, PyArrayDyn<T>>> {
    let array = as_ndarray(x, context)?;
    if !is::<f32>(array) {
        return Err(PyTypeError::new_err(format!(
            "{context}: expected float32 values, got dtype {}; convert with x.astype(numpy.float32)",
            dtype_name(array)
        )));
    }
    let values = readonly::<f32>(array, context)?;
    let view: ArrayViewD<'_, f32> = values.as_array();
    let out = py.detach(|| view.mapv(f));
    Ok(PyArrayDyn::from_owned_array(py, out))
}

/// FP8 bits (uint8) of `saturate(x * scale)`, round-to-nearest-even, `x * scale` rounded
/// to float32 first: bit-exact with `torch.clamp(x * scale, -max, max).to(float8)`.
#[pyfunction]
#[pyo3(signature = (x, format, scale = 1.0))]
pub fn fp8_quantize<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    format: &str,
    scale: f64,
) -> PyResult<Bound<'py, PyArrayDyn<u8>>> {
    let (f, s) = format_and_scale(format, scale, "fp8_quantize")?;
    map_float32(py, x, "fp8_quantize", move |v| f.quantize(v, s))
}

/// float32 values `q / scale` of FP8 bits.
#[pyfunction]
#[pyo3(signature = (bits, format, scale = 1.0))]
pub fn fp8_dequantize<'py>(
    py: Python<'py>,
    bits: &Bound<'py, PyAny>,
    format: &str,
    scale: f64,
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    const CONTEXT: &str = "fp8_dequantize";
    let (f, s) = format_and_scale(format, scale, CONTEXT)?;
    let array = as_ndarray(bits, CONTEXT)?;
    if !is::<u8>(array) {
        return Err(PyTypeError::new_err(format!(
            "{CONTEXT}: expected uint8 FP8 bit patterns, got dtype {} (shape {:?})",
            dtype_name(array),
            array.shape()
        )));
    }
    let codes = readonly::<u8>(array, CONTEXT)?;
    let view = codes.as_array();
    let table = f.decode_table();
    let out = py.detach(|| view.mapv(|c| table[c as usize] / s));
    Ok(PyArrayDyn::from_owned_array(py, out))
}

/// `fp8_dequantize(fp8_quantize(x, format, scale), format, scale)`.
#[pyfunction]
#[pyo3(signature = (x, format, scale = 1.0))]
pub fn fp8_roundtrip<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    format: &str,
    scale: f64,
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let (f, s) = format_and_scale(format, scale, "fp8_roundtrip")?;
    let table = f.decode_table();
    map_float32(py, x, "fp8_roundtrip", move |v| f.roundtrip(v, s, &table))
}
